"""What several test files share: the shape of the tiny random-weight models.

Imported by name (``from conftest import ...``) as well as loaded by pytest. torch and
transformers are imported only when a model is made, so that tests without them still collect.
"""

#: Vocabulary of the tiny models.
VOCAB = 128

#: The tiny models' shape: 5 layers, 4 query / 2 KV heads of 16 dims. Tests change single fields.
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)


def tiny_llama_config(**changes):
    """A ``LlamaConfig`` of :data:`TINY`'s shape with ``changes``."""
    import transformers

    return transformers.LlamaConfig(**{**TINY, **changes})


def tiny_llama(**changes):
    """A random-weight Llama of :func:`tiny_llama_config` (seed 0), float32, eval mode."""
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config(**changes)).eval()
