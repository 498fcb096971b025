"""The options of ``icecache demo`` and their per-model defaults, shared by the single-process
demo (:mod:`icecache.demo`), the tensor-parallel one (:mod:`icecache.demo_tp`) and the CLI."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

__all__ = ["MODEL_DEFAULTS", "NEEDLES", "TASKS", "ModelDefaults", "add_arguments"]

#: The demo's tasks (see :mod:`icecache.demo`).
TASKS = ("complete", "passkey")


@dataclass(frozen=True)
class ModelDefaults:
    """Defaults of the demo's options for one built-in model."""

    task: str
    tokens: int
    new_tokens: int
    budgets: tuple
    full_layers: int
    prefill_chunk: int  # 0: one forward over the whole prompt


#: Per-model defaults. Gemma 3 has only three full-attention layers (5, 11, 17); IceCache
#: serves all of them. Its prefill runs in chunks of 2048 tokens so that the sliding-window
#: layers attend to at most 2048 + 511 keys per query. At 16k tokens the whole Gemma run
#: (load, prefill, full cache and two budgets) takes about 4 minutes on 2 CPU cores, most of
#: it the 16k-token prefill (about 95 tokens/s).
MODEL_DEFAULTS = {
    "smollm2": ModelDefaults("complete", 6400, 16, (64, 128, 256), 2, 0),
    "gemma3": ModelDefaults("passkey", 16384, 8, (128, 256), 0, 2048),
}

#: Planted lines, as (first half, second half): unusual enough that the text never predicts them.
NEEDLES = [
    (
        "The secret passphrase of the lighthouse keeper is",
        " violet marmalade, eleven thunderstorms, and a copper kettle.",
    ),
    ("Remember this: the treasure lies buried", " beneath the third crooked willow behind the old mill at Kellynch."),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser`` (used by ``icecache demo`` and both demos' ``main``)."""
    from icecache.models import MODELS

    def per_model(field: str) -> str:
        return ", ".join(
            f"{m}: {' '.join(map(str, v)) if isinstance(v, tuple) else v}"
            for m, d in MODEL_DEFAULTS.items()
            for v in [getattr(d, field)]
        )

    parser.add_argument(
        "--model",
        default="smollm2",
        choices=sorted(MODELS),
        help="model (default smollm2; gemma3: Gemma-3-270M, 253 MB, passkey at 16k tokens, "
        "about 4 minutes on 2 CPU cores)",
    )
    parser.add_argument(
        "--task",
        default=None,
        choices=TASKS,
        help=f"complete: finish a planted line; passkey: recall a planted pass key "
        f"(default per model: {per_model('task')})",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=None,
        help=f"document length in tokens (default per model: {per_model('tokens')}; "
        "gemma3's 16k-token prefill takes about 3 minutes on 2 CPU cores; "
        "--tokens 8192 or 4096 halves or quarters it)",
    )
    parser.add_argument(
        "--depth",
        type=float,
        default=0.1,
        help="where the line is planted, as a fraction of the document (default 0.1)",
    )
    parser.add_argument(
        "--needle",
        type=int,
        default=0,
        choices=range(len(NEEDLES)),
        help="which planted line of the complete task (default 0)",
    )
    parser.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        default=None,
        help=f"IceCache token budgets (default per model: {per_model('budgets')})",
    )
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help=f"tokens to generate (default per model: {per_model('new_tokens')})",
    )
    parser.add_argument(
        "--full-layers",
        type=int,
        default=None,
        help="leading full-attention layers that keep a full cache (default per model: "
        f"{per_model('full_layers')}; gemma3 has 3 full-attention layers)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help=f"prefill in chunks of this many tokens, 0: at once (default per model: {per_model('prefill_chunk')})",
    )
    parser.add_argument("--reuse", type=int, default=1, help="layer-reuse group size (default 1: off)")
    parser.add_argument("--seed", type=int, default=0, help="picks the document (default 0)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor parallelism on this many CPU processes (gloo): a random-weight Llama with 4 KV "
        "heads split between them, full cache vs IceCache (icecache.demo_tp; --model, --task, --depth, "
        "--needle, --prefill-chunk and --threads do not apply; default 1: the single-process demo)",
    )
    parser.add_argument("--no-recall", action="store_true", help="skip the attention recall measurement")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or messages on stderr")
