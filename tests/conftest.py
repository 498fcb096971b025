"""What several test files share: the shape of the tiny random-weight models, and the buffers of
a look-ahead layer.

Imported by name (``from conftest import ...``) as well as loaded by pytest. torch and
transformers are imported only when a model is made, so that tests without them still collect.
"""

from typing import NamedTuple

import numpy as np

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


def tiny_bpe_tokenizer():
    """A byte-level BPE of 400 tokens trained here (deterministic, no download), with a chat
    template: RULER's generators tokenize with it."""
    import transformers
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."] * 20
    corpus += ["One of the special magic numbers for the key is: 1234567. What is the special magic number?"] * 5
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = "<s>{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    return fast


def tiny_ruler_model(name, device, dtype):
    """``(model, tokenizer)`` for the RULER tests: a 4-layer tiny Llama over
    :func:`tiny_bpe_tokenizer`; a loader with the signature that RULER's worker processes call
    (``name`` is ignored)."""
    import torch

    tokenizer = tiny_bpe_tokenizer()
    model = tiny_llama(
        vocab_size=len(tokenizer), num_hidden_layers=4, max_position_embeddings=1024, attn_implementation="sdpa"
    )
    return model.to(device, getattr(torch, dtype)), tokenizer


def counting_ruler_model(name, device, dtype):
    """:func:`tiny_ruler_model` whose every prefill (a forward of more than one token) appends a
    line to the file ``$ICECACHE_TEST_PREFILLS``: how many samples a worker process started."""
    import os

    model, tokenizer = tiny_ruler_model(name, device, dtype)
    log = os.environ["ICECACHE_TEST_PREFILLS"]

    def count(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[-1] > 1:
            with open(log, "a") as f:
                f.write("prefill\n")

    model.register_forward_pre_hook(count, with_kwargs=True)
    return model, tokenizer


class LookAheadParts(NamedTuple):
    """What a one-sequence ``LookAheadLayer`` is made from and lent (:func:`lookahead_parts`)."""

    k_store: np.ndarray
    v_store: np.ndarray
    queries: np.ndarray
    flag: np.ndarray
    flush_k: np.ndarray
    flush_v: np.ndarray
    staging: np.ndarray

    @property
    def lent(self):
        """The buffers in ``LookAheadLayer``'s argument order, after the worker."""
        return self.queries, self.flag, self.flush_k, self.flush_v, self.staging


def lookahead_parts(forest, keys, values, *, query_heads, page_size, max_pages):
    """float32 page stores written by ``forest`` from ``keys``/``values`` ``[H_kv, n, d]``, and
    the buffers of a one-sequence look-ahead layer over them: queries ``[1, query_heads, d]``,
    a flag, flush buffers and staging for ``max_pages`` pages per head in a pool of twice that."""
    from icecache import _core

    h_kv, _, d = keys.shape
    k_store = np.zeros((h_kv, forest.max_pages() + 1, page_size, d), np.float32)
    v_store = np.zeros_like(k_store)
    forest.write_pages(keys, values, k_store, v_store)
    layout = _core.LookAheadLayer.staging_layout(
        batch=1, kv_heads=h_kv, dim=d, page_size=page_size, itemsize=4, max_pages=max_pages, capacity=2 * max_pages
    )
    flush = np.zeros((1, h_kv, page_size, d), np.float32)
    return LookAheadParts(
        k_store,
        v_store,
        np.zeros((1, query_heads, d), np.float32),
        np.zeros(1, np.int64),
        flush,
        flush.copy(),
        np.zeros(layout.bytes, np.uint8),
    )
