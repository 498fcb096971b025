#!/usr/bin/env python
"""What fewer than 8 bits per value would cost: 4-bit V beside the 8-bit K of the host pages.

The default host pages hold K and V as int8 codes with one float32 scale per (KV head, token)
row: ``2 (D + 4)`` bytes per token and KV head, 0.516x bf16 K+V at ``D = 128``. A host-bytes
target of 0.55x resident leaves too little for the index and the part-filled pages on top, so
part of the data needs fewer bits. Keys stay 8-bit here (the index scores them and selection
must not change); the values go to 4 bits, quantised per token row as the pages store them:

- ``int8`` (today): ``max |x| / 127`` per row, float32 scale;
- ``int4-row``: ``max |x| / 7`` per row (codes -7..7), float32 scale: ``D / 2 + 4`` bytes;
- ``int4-g32``: the same per group of 32 values, float16 scales: ``D / 2 + D / 16`` bytes;
- ``int4-g32-asym``: ``(max - min) / 15`` and the minimum per group of 32, float16 both:
  ``D / 2 + D / 8`` bytes (the KIVI-style value quantiser);
- ``int4-g32-asym-rot``: the same after an orthonormal rotation of each row (random signs, then
  the normalised Hadamard matrix; ``D`` a power of two), undone after dequantisation.

Quantisation is emulated in float32 on the middle tokens (neither sink nor window), so it
measures only what the bits cost, at a budget that covers the context (no selection):

1. **Greedy agreement**, teacher-forced: SmolLM2-135M reads each document once with exact
   attention and once with every layer's middle K and V through the quantisers; the share of
   the last ``--queries`` positions whose next-token argmax agrees.
2. **Attention output error** of every layer (relative L2 against exact float32 attention,
   over the query heads and those positions), with bfloat16 rounding for scale.

Documents are prose and code shipped with the package (``icecache.texts.documents``).

    python benches/bench_value_bits.py [--prose 3] [--code 3] [--tokens 4096] [--queries 64] [--seed 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_index import run_header  # noqa: E402
from bench_int8_pages import bf16_middle, output_errors, prose_and_code  # noqa: E402

SINK, WINDOW = 16, 32
VARIANTS = ("int8", "int4-row", "int4-g32", "int4-g32-asym", "int4-g32-asym-rot")


def row_bytes(variant: str, dim: int) -> float:
    """Host bytes of one token row of ``dim`` values in ``variant``."""
    return {
        "int8": dim + 4,
        "int4-row": dim / 2 + 4,
        "int4-g32": dim / 2 + 2 * dim / 32,
        "int4-g32-asym": dim / 2 + 4 * dim / 32,
        "int4-g32-asym-rot": dim / 2 + 4 * dim / 32,
    }[variant]


def quantise(x, variant: str):
    """``x [..., D]`` (float32 torch) through ``variant``'s codes and back."""
    import torch

    if variant.endswith("-rot"):
        h = rotation(x.shape[-1])
        return quantise(x @ h, variant[: -len("-rot")]) @ h.T
    if variant == "int8":
        scale = x.abs().amax(-1, keepdim=True) / 127
        return torch.round(x / scale.clamp_min(1e-30)) * scale
    if variant == "int4-row":
        scale = x.abs().amax(-1, keepdim=True) / 7
        return torch.round(x / scale.clamp_min(1e-30)) * scale
    g = x.unflatten(-1, (x.shape[-1] // 32, 32))
    if variant == "int4-g32":
        scale = (g.abs().amax(-1, keepdim=True) / 7).half().float()
        return (torch.round(g / scale.clamp_min(1e-30)).clamp(-7, 7) * scale).flatten(-2)
    lo = g.amin(-1, keepdim=True).half().float()
    scale = ((g.amax(-1, keepdim=True) - lo) / 15).half().float()
    return (torch.round((g - lo) / scale.clamp_min(1e-30)).clamp(0, 15) * scale + lo).flatten(-2)


def rotation(dim: int):
    """An orthonormal ``[dim, dim]`` rotation: random signs, then the normalised Hadamard
    matrix (``dim`` a power of two), which spreads a channel's outliers over every channel."""
    import torch

    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    signs = torch.from_numpy(np.random.default_rng(0).choice([-1.0, 1.0], dim)).float()
    return signs[:, None] * h / dim**0.5


class Middle:
    """Which tokens go through the quantisers: those before ``end`` past the sink, ``end`` being
    the window's start for the earliest position measured (later positions' extra window
    tokens stay exact, as the runtime keeps them in its window)."""

    variant: str | None = None
    end = 0


def quantised_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention over the middle K rows in int8 and V rows in ``Middle.variant``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if Middle.variant is not None and key.shape[-2] > Middle.end > SINK:
        key, value = key.clone(), value.clone()
        mid = slice(SINK, Middle.end)
        key[..., mid, :] = quantise(key[..., mid, :].float(), "int8").to(key.dtype)
        value[..., mid, :] = quantise(value[..., mid, :].float(), Middle.variant).to(value.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def agreement(model, docs, queries: int) -> dict:
    """Per document and variant: the share of the last ``queries`` next-token argmaxes that
    agree with exact attention's."""
    import torch
    from icecache._util import register_attention

    register_attention("icecache_value_bits", quantised_attention)
    before = model.config._attn_implementation
    model.set_attn_implementation("icecache_value_bits")
    out = {}
    try:
        for name, ids in docs:
            x = torch.tensor([ids])
            Middle.end = len(ids) - queries - WINDOW
            top = {}
            for variant in (None, *VARIANTS):
                Middle.variant = variant
                with torch.inference_mode():
                    logits = model(x, logits_to_keep=queries).logits[0]
                top[variant] = logits.argmax(-1)
            out[name] = {v: float((top[v] == top[None]).float().mean()) for v in VARIANTS}
            print(f"{name}: " + ", ".join(f"{v} {a:.3f}" for v, a in out[name].items()), flush=True)
    finally:
        Middle.variant = None
        model.set_attn_implementation(before)
    return out


def through(variant: str):
    """A middle transform for :func:`bench_int8_pages.output_errors`: K through the int8
    quantiser, V through ``variant``'s."""
    import torch

    def middle(k, v):
        return quantise(torch.from_numpy(k), "int8").numpy(), quantise(torch.from_numpy(v), variant).numpy()

    return middle


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prose", type=int, default=3)
    ap.add_argument("--code", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--queries", type=int, default=64, help="last positions measured per document")
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    import torch
    from icecache import models

    torch.set_num_threads(args.threads)
    model, tok = models.load_model("smollm2")
    docs = prose_and_code(tok, args.prose, args.code, args.tokens, args.seed)
    agree = agreement(model, docs, args.queries)
    errors = output_errors(model, docs, args.queries, {**{v: through(v) for v in VARIANTS}, "bf16": bf16_middle})
    header, _ = run_header("Fewer bits for V: 4-bit values beside 8-bit keys, SmolLM2-135M", None)
    dim = model.config.hidden_size // model.config.num_attention_heads
    lines = [header, ""]
    lines += [f"| V in | K+V bytes per token, D = 128 (x bf16) | D = {dim} (x bf16) |", "|---|---|---|"]
    for v in VARIANTS:
        pair = [row_bytes("int8", d) + row_bytes(v, d) for d in (128, dim)]
        lines.append(f"| {v} | {pair[0]:.0f} ({pair[0] / 512:.3f}x) | {pair[1]:.0f} ({pair[1] / (4 * dim):.3f}x) |")
    lines += ["", "Greedy agreement with exact attention (teacher-forced, last positions):", ""]
    lines += ["| document | " + " | ".join(VARIANTS) + " |", "|---|" + "---|" * len(VARIANTS)]
    for name, a in agree.items():
        lines.append(f"| {name} | " + " | ".join(f"{a[v]:.3f}" for v in VARIANTS) + " |")
    mean = {v: np.mean([a[v] for a in agree.values()]) for v in VARIANTS}
    lines.append("| mean | " + " | ".join(f"{mean[v]:.3f}" for v in VARIANTS) + " |")
    cols = (*VARIANTS, "bf16")
    lines += ["", "Attention output error, relative L2, mean over layers (worst layer):", ""]
    lines += ["| document | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, e in errors.items():
        cells = [f"{np.mean(e[c]):.2e} ({np.max(e[c]):.2e}, {int(np.argmax(e[c]))})" for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    every = {c: [x for e in errors.values() for x in e[c]] for c in cols}
    n = len(every["bf16"])
    lines.append(
        f"| all ({n} layer-documents) | "
        + " | ".join(f"{np.mean(every[c]):.2e} ({np.max(every[c]):.2e})" for c in cols)
        + " |"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
