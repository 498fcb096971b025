#!/usr/bin/env python
"""One decode step's attention over a full-cache layer in a step graph (needs a CUDA GPU).

A step graph attends each full-cache layer (``full_layers``) over its whole storage, ``ROOM``
(2,048) tokens longer than the context, under a mask of the written positions. Three ways are
timed, each as 20 calls replayed from one CUDA graph, at the Llama-3.1-8B shape (32 query heads,
8 KV heads, ``D = 128``, bf16):

- ``sdpa-mask``: transformers' SDPA attention with that mask (``sdpa_attention_forward``, flash,
  memory-efficient and math backends allowed), what the step graph ran before;
- ``masked``: :func:`icecache.attend.full.masked_decode_attention`, what it runs now;
- ``flash-ideal``: flash attention without a mask over the written tokens only, with GQA, as
  the eager full cache runs a one-token step (the floor; a fixed-shape graph cannot do this).

Each line also gives the largest difference from ``flash-ideal``'s output.

    python benches/bench_full_attention.py [--shapes 1x32768 1x131072 8x32768] [--reps 20]
"""

from __future__ import annotations

import argparse
import time
import types

import torch
from icecache.attend.full import masked_decode_attention
from icecache.runtime.stepgraph import ROOM
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

Hq, H, D = 32, 8, 128
_MODULE = types.SimpleNamespace(num_key_value_groups=Hq // H, is_causal=True)
_DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def graph_ms(fn, reps: int) -> float:
    """Milliseconds per call of ``fn``, replayed ``reps`` at a time from one CUDA graph."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / (3 * reps) * 1e3


def run_shape(batch: int, context: int, reps: int) -> None:
    """Time the three ways at one batch size and context, and print their lines."""
    cap = context + ROOM
    k = torch.randn(batch, H, cap, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    mask = torch.zeros(batch, cap, dtype=torch.bool, device="cuda")
    mask[:, :context] = True
    scale = D**-0.5

    def sdpa_mask():
        with sdpa_kernel(_DECODE_BACKENDS):
            return sdpa_attention_forward(_MODULE, q, k, v, mask[:, None, None, :], scaling=scale)[0]

    def flash_ideal():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k[:, :, :context], v[:, :, :context], scale=scale, enable_gqa=True
            )
        return out.transpose(1, 2)

    def masked():
        return masked_decode_attention(q, k, v, mask, scale)

    ideal = flash_ideal().float()
    for name, fn in (("sdpa-mask", sdpa_mask), ("masked", masked), ("flash-ideal", flash_ideal)):
        err = (fn().float() - ideal).abs().max().item()
        ms = graph_ms(fn, reps)
        print(f"batch {batch} x {context}: {name:12s} {ms:7.3f} ms   max |diff| from flash-ideal {err:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["1x32768", "1x131072", "8x32768"], help="BATCHxCONTEXT")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_full_attention.py needs a CUDA GPU")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for shape in args.shapes:
        batch, context = (int(x) for x in shape.split("x"))
        run_shape(batch, context, args.reps)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
