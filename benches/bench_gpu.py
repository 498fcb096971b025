#!/usr/bin/env python
r"""Decode on a GPU: full cache (DynamicCache with SDPA or FlashInfer) vs IceCache (look-ahead and
fresh selection) and IceCache-reuse.

A Llama-3.1-8B-shaped model (``--shape llama8b``; ``smollm2`` for a quick run, ``tiny`` for a
CPU check), config written here, random bf16 weights made on the GPU; no download. Under
torchrun with N processes (tensor parallelism, one GPU each; see below) each rank makes its
own shard. Per context length, one prompt of random tokens. With ``--model smollm2`` (or any model
:mod:`icecache.models` loads) the weights are that model's real ones, de-quantised from its GGUF
(bf16 on a GPU), and the prompt is real text cut from the shipped texts (``--text prose`` or
``code``; one document per sequence): selection then sees a real model's queries, which reuse
most of their pages from one step to the next, where random weights make every step select a
new superset. Per variant:

- time to second token (TTST): prefill (one forward, or ``--prefill-chunk`` tokens at a time)
  + one decode step, from an empty cache, for each variant (``--ttst-repeats`` rounds, order
  rotated, median). On a GPU each variant's first prompt of the process is a round of its own
  (``--cold``), reported as its cold TTST and left out of the median: the first decode step of
  a process loads the kernels it launches (CUDA loads a kernel's module at its first launch)
  and makes the host memory it pins, and a variant whose prompt came first would pay for the
  kernels the others share. IceCache's prefill
  pipeline indexes on a worker thread: by default the decode steps attend the whole cache
  meanwhile (``exact_until_indexed``, "bridged"; each reuse group leaves when its own index
  is ready, and the log says how many layers had left by the end of the second token's step),
  and the run decodes on, step by step, until the step that the last group leaves the bridge at
  ("switch": the tokens decoded meanwhile join the indexes and windows, "catch-up", and the
  layers' first host jobs run; "ready": when it started, every index was ready by then); with
  ``ice-wait`` the first decode step waits for the indexes ("index wait");
- time per output token (TPOT): each variant keeps decoding from its own cache; after a
  warm-up, ``--repeats`` rounds of ``--steps`` one-token steps, variants interleaved (order
  rotated per round), every step timed to a device sync; median over all steps;
- IceCache's host time: during the TPOT rounds, the host time IceCache's own code takes per
  IceCache layer step (window writes, waiting for the layer's host job, the copy and scatter,
  ranking and attention launches), and how much of it was waiting; and the share of layer
  steps whose staging copy started early, on the copy stream (``LayerJobs.upload_ahead``;
  ``-inline`` variants turn that off, for comparison);
- IceCache breakdown: one more pass per IceCache variant with a device sync at every stage
  boundary (``Runtime.sync_timing``), per token: wait (for the layer's host job: with
  look-ahead the worker's job started a step earlier, with fresh selection the whole job), copy
  (the one host-to-device copy + scatter), attention (ranking + attention), rest (all else:
  projections, MLPs, the full layers, window bookkeeping); the synced pass is slower than the
  TPOT pass, its total is shown too; the worker's own time per token (insert, select + plan,
  gather), pages loaded per token; ``--cprofile N`` adds cProfile tables of N steps (and of
  each prefill);
- device KV bytes and host bytes (page stores + indexes + staging + transit: ``IceCache.nbytes``,
  which counts the stores' reserved room too) after decoding, and how much the process's
  resident memory grew while each IceCache variant prefilled and built its indexes (``RSS
  growth``: what the machine actually holds; the stores' room, untouched until inserts fill
  it, is not resident where the allocator maps large blocks lazily);
- throughput: ``--batch 1 4 8`` runs everything above once per batch size (aggregate tok/s =
  batch / TPOT, each against the full cache at the same batch) and, on a GPU, estimates the
  most sequences of each context each variant fits on the machine from its measured bytes per
  sequence (``capacity``). Random weights make consecutive queries unrelated, so every IceCache
  step selects and loads a new superset: the worst selection-reuse rate (real models reuse most
  pages from step to step, see RESULTS.md).

Variants: ``full`` DynamicCache + SDPA, ``fullfi`` DynamicCache + FlashInfer single-sequence
decode (needs FlashInfer; batch 1), ``full-compile`` transformers' fastest full-cache decode:
``StaticCache`` + ``generate``, which compiles the decode step with ``torch.compile`` (mode
``reduce-overhead``, CUDA graphs) on a GPU (:class:`CompiledFull`; each of its rounds is one
``generate`` call that prefills the prompt again, its TTST is that call's second token, and the
compile's warm-up, one call before the rounds, is reported on its own line and left out of
TTST and TPOT), ``ice`` IceCache (look-ahead), ``ice3`` IceCache with
reuse 3, ``ice-wait`` IceCache whose first decode step waits for the index
(``exact_until_indexed=False``), ``ice-r2`` IceCache selecting a new superset every second step, ``ice-fixed`` and
``ice-adaptive`` IceCache with that ``budget_mode``, ``ice-native``, ``ice-int8`` and
``ice-k8v4`` IceCache with that ``page_format``, ``ice-auto`` IceCache with
``effort="auto"`` (each layer's index calibrated on the prompt's last queries), ``fresh`` IceCache
with fresh selection (every layer step waits for the host: the
synchronous reference). Look-ahead never waits for the host within a step, so a "correction
rate" (share of layer steps that select synchronously from the fresh query) is 0% for ``ice``
and 100% for ``fresh``; with random weights consecutive queries are unrelated, so every step
loads a new superset (the worst case; real models reload a few pages, see RESULTS.md).

    python benches/bench_gpu.py [--shape llama8b|smollm2] [--contexts 32768 131072] [--steps 32]
        [--repeats 3] [--variants full fullfi ice ice3 fresh] [--batch B [B ...]] [--threads N]
        [--cprofile N] [--out DIR]

Runs recorded in benches/RESULTS.md, on the lent H200 (icecache wheel, and for the ``fullfi``
baseline FlashInfer, installed with ``pip install --no-index --no-deps --no-build-isolation
--target /tmp/site``, ``PYTHONPATH=/tmp/site``):

    python3 benches/bench_gpu.py --contexts 32768 --variants full fullfi ice ice3 \
        --repeats 3 --steps 16 --warmup 24 --profile-steps 4 --cprofile 4 --out $OUT
    python3 benches/bench_gpu.py --contexts 131072 --variants full fullfi ice ice3 \
        --repeats 2 --steps 16 --warmup 16 --profile-steps 4 --out $OUT
    python3 benches/bench_gpu.py --shape smollm2 --contexts 16384 --variants full fullfi ice ice3 \
        --repeats 3 --steps 16 --warmup 24 --profile-steps 4 --out $OUT

Host memory at 128k: ~21 GB of page stores per IceCache variant.

Tensor parallelism: ``torchrun --nproc-per-node N benches/bench_gpu.py [options]`` splits the
model over N GPUs with transformers' tensor parallelism (``from_pretrained(None, config=...,
state_dict={}, distributed_config=DistributedConfig(tp_plan="auto"))``, NCCL): each rank makes
its shard of the random weights, holds its KV heads in its cache (IceCache: indexes, stores
and selects only them) and runs the same steps; the ranks move in lockstep through every
layer's all-reduce, and rank 0 reports its own times, breakdown and bytes. The H200 x2 runs,
with the TP=1 runs of the same script on the same machine as the baseline for the ratios
(NVLink multicast stays off, as that machine requires):

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python3 -m torch.distributed.run --nproc-per-node 2 benches/bench_gpu.py --contexts 32768 \
        --variants full fullfi ice --repeats 3 --steps 16 --warmup 16 --profile-steps 4 --out $OUT/tp2-32k
    (the same with --nproc-per-node 1, and with --contexts 131072 --repeats 2)

On the CPU (gloo, torch attention, float32) as a check of the script, not a measurement:
``torchrun --nproc-per-node 2 benches/bench_gpu.py --shape tiny --contexts 2048 --steps 4
--repeats 2 --warmup 2 --profile-steps 2``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

from bench_soak import rss_bytes
from icecache.models import MODELS, load_model
from icecache.texts import documents


def llama8b_config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )


def smollm2_config(layers: int):
    """SmolLM2-135M's shape (9 query / 3 KV heads of 64 dims), for a quick run."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=65536,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )


def tiny_config(layers: int):
    """A small Llama with 8 query / 4 KV heads (1, 2 or 4 ranks split it), for CPU checks."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=65536,
    )


SHAPES = {"llama8b": (llama8b_config, 32), "smollm2": (smollm2_config, 30), "tiny": (tiny_config, 6)}


def build_model(cfg, device, world: int):
    """Random weights (bf16 on a GPU, float32 on the CPU) on ``device``; under tensor
    parallelism over ``world`` ranks, each rank makes its own shard."""
    import torch
    from transformers import LlamaForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if world > 1:
        from transformers.distributed import DistributedConfig

        return LlamaForCausalLM.from_pretrained(
            None, config=cfg, state_dict={}, dtype=dtype, distributed_config=DistributedConfig(tp_plan="auto")
        ).eval()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return model.eval()


#: Decode attention of the full-cache FlashInfer variant is on while this holds True.
_FULL_FLASHINFER = [False]


class _TokenClock:
    """A logits processor that notes when each token's logits are ready, after a device sync (as
    every other variant's step is timed); it changes no score."""

    def __init__(self):
        self.times: List[float] = []

    def __call__(self, input_ids, scores):
        import torch

        if scores.is_cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores


class CompiledFull:
    """The fastest full-cache decode transformers offers: a ``StaticCache`` and ``generate``, which
    compiles its decode step with ``torch.compile`` (mode ``reduce-overhead``: CUDA graphs) on a
    GPU. One cache serves every call, emptied in place (a new cache's tensors would recompile the
    step); each call prefills the prompt again (eagerly, in one forward, or in chunks of
    ``prefill_chunk`` tokens) and decodes. The model's attention is SDPA during the call (the
    bench's own otherwise), and any prefill chunk size an IceCache set on the generation config
    is off.

    Args:
        model: the bench's model.
        kw: the name of ``generate``'s cache argument.
        length: the cache's positions (prompt and every token decoded in one call).
        prefill_chunk: ``generate``'s ``prefill_chunk_size`` (``None``: one forward).
    """

    def __init__(self, model, kw: str, length: int, prefill_chunk: Optional[int] = None):
        from transformers import StaticCache

        self.model, self.kw, self.prefill_chunk = model, kw, prefill_chunk
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        self.layers = self.cache.layers

    def generate(self, ids, tokens: int) -> List[float]:
        """Prefill ``ids`` and decode until ``tokens`` new tokens; the times (``perf_counter``)
        at which the call started and each new token's logits were ready."""
        from transformers import LogitsProcessorList

        model, chunk = self.model, self.model.generation_config.prefill_chunk_size
        clock = _TokenClock()
        self.cache.reset()
        model.set_attn_implementation("sdpa")
        model.generation_config.prefill_chunk_size = self.prefill_chunk
        try:
            start = time.perf_counter()
            model.generate(
                ids,
                attention_mask=ids.new_ones(ids.shape),
                max_new_tokens=tokens,
                min_new_tokens=tokens,  # random weights may emit the end token
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([clock]),
                **{self.kw: self.cache},
            )
        finally:
            model.generation_config.prefill_chunk_size = chunk
            model.set_attn_implementation("bench")
        return [start, *clock.times]


@dataclass
class Ready:
    """An IceCache's way from the prompt to retrieval: how long its first decode step waited
    for the indexes; the decode steps that attended the whole cache meanwhile (the bridge), as
    a user's generation goes on; the step that left the bridge ("switch": the tokens decoded
    meanwhile join the indexes and windows, ``catch_up_s`` of it, and the layers' first host
    jobs run), and when it started (from the prompt's start: every index was ready by then);
    and the IceCache layers that had left the bridge by the end of the second token's step."""

    wait_s: float
    bridged_s: List[float]
    switch_s: float
    catch_up_s: float
    ready_s: float
    left_at_second: int


def capacity(results: List[dict], model) -> List[str]:
    """The most sequences of each context that each variant fits on this machine, estimated from
    its measured bytes per sequence at the largest batch run: device KV bytes (the weights are
    subtracted from the GPU's memory, and for IceCache the whole prompt KV of one sequence, which
    its prefill holds until the index worker has copied it: sequences prefilled one at a time)
    and host bytes (``IceCache.nbytes``; and, where measured, the RSS growth of its prefill)
    against the host's memory. Activations are not counted, so these are upper bounds."""
    import torch

    gpu = torch.cuda.get_device_properties(0).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    out = [
        f"Capacity estimate: GPU {gpu / 2**30:.0f} GiB less {weights / 2**30:.1f} GiB of weights, host "
        f"{host / 2**30:.0f} GiB; per-sequence bytes at the largest batch run; activations not counted",
        "",
        "| context | variant | device MiB / seq | host MiB / seq | RSS growth MiB / seq | sequences (GPU, host "
        "bound; by RSS) | batch x context |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in sorted({r["context"] for r in results}):
        rows = [r for r in results if r["context"] == n]
        largest = {}
        for r in rows:
            if r["batch"] >= largest.get(r["variant"], {"batch": 0})["batch"]:
                largest[r["variant"]] = r
        full = [r for r in largest.values() if r["variant"].startswith("full")]
        prompt = full[0]["device_kv_bytes"] / full[0]["batch"] if full else 0.0
        for name, r in largest.items():
            dev, hst = r["device_kv_bytes"] / r["batch"], r["host_bytes"] / r["batch"]
            transient = 0.0 if name.startswith("full") else prompt
            by_gpu = int((gpu - weights - transient) // dev)
            by_host = int(host // hst) if hst else None
            fits = by_gpu if by_host is None else min(by_gpu, by_host)
            rss = r.get("host_rss_bytes", 0) / r["batch"]
            by_rss = f"; {min(by_gpu, int(host // rss))}" if rss > 0 else ""
            out.append(
                f"| {n} | {name} | {dev / 2**20:.0f} | {hst / 2**20:.0f} | {rss / 2**20:.0f} | {fits} ({by_gpu}, "
                f"{'-' if by_host is None else by_host}{by_rss}) | {fits} x {n} |"
            )
    return out


def bench_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's attention here: FlashInfer single-sequence decode over the whole cache while
    the full-cache FlashInfer variant steps, IceCache's attention function otherwise (plain SDPA
    for other caches)."""
    from icecache.runtime.integration import icecache_attention

    if _FULL_FLASHINFER[0] and query.shape[2] == 1 and query.shape[0] == 1:
        import flashinfer

        out = flashinfer.single_decode_with_kv_cache(
            query[0, :, 0], key[0], value[0], kv_layout="HND", sm_scale=kwargs.get("scaling")
        )
        return out[None, None], None
    return icecache_attention(module, query, key, value, attention_mask, **kwargs)


def flashinfer_ready() -> str:
    """'' if FlashInfer's single decode runs here (compiling it outside any timing), else why not."""
    import torch

    try:
        import flashinfer

        q = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(8, 64, 128, device="cuda", dtype=torch.bfloat16)
        flashinfer.single_decode_with_kv_cache(q, kv, kv, kv_layout="HND")
        return ""
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def ice_options(name: str) -> dict:
    """IceCacheConfig options of a variant named ``ice`` followed by any of ``-native``, ``-int8``,
    ``-k8v4`` (the page format), ``-gv`` / ``-ov`` (group view on / one view per query head), ``-wait`` (no bridge:
    the first step waits for the index; the prompt's device copy is freed once copied), ``-rN``
    (refresh N), ``-eX`` (effort X), ``-tN`` (N index threads), ``-layers`` (``step_graph=False``: each
    IceCache layer from its own CUDA graphs, the rest of the model eagerly), ``-sgN`` (``step_graph=True``
    in N segments, ``StepGraph.segments``), ``-inline`` (every staging copy at
    its layer's own step, none started early: ``LayerJobs.upload_ahead`` off, for comparison; not
    a config option); empty for any other name."""
    parts = name.split("-")
    if parts[0] != "ice" or len(parts) < 2:
        return {}
    options: dict = {}
    for part in parts[1:]:
        if part in ("native", "int8", "k8v4"):
            options["page_format"] = part
        elif part in ("gv", "ov"):
            options["group_view"] = part == "gv"
        elif part == "wait":
            options["exact_until_indexed"] = False
        elif part == "layers":
            options["step_graph"] = False
        elif part[:2] == "sg" and part[2:].isdigit():
            options["segments"] = int(part[2:])
        elif part == "inline":
            options["inline"] = True
        elif part[:1] in ("r", "t") and part[1:].isdigit():
            options["refresh" if part[0] == "r" else "threads"] = int(part[1:])
        elif part[:1] == "e" and part[1:].replace(".", "", 1).isdigit():
            options["effort"] = float(part[1:])
        else:
            return {}
    return options


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ttst-repeats", type=int, default=1, help="TTST rounds per variant (order rotated; median)")
    ap.add_argument(
        "--cold",
        type=int,
        default=None,
        help="TTST rounds run first as each variant's cold start in this process (reported apart, not in the "
        "median; default 1 on a GPU, 0 on the CPU)",
    )
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument(
        "--shape",
        default="llama8b",
        choices=sorted(SHAPES),
        help="llama8b: Llama-3.1-8B (32 layers); smollm2: SmolLM2-135M (30 layers), quick; tiny: CPU check",
    )
    ap.add_argument("--layers", type=int, default=None, help="default: the shape's")
    ap.add_argument(
        "--model",
        default=None,
        choices=sorted(MODELS),
        help="real weights of this icecache.models model and real text as the prompt, instead of --shape's "
        "random weights and random tokens",
    )
    ap.add_argument("--text", default="prose", choices=["prose", "code"], help="with --model: the kind of shipped text")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument(
        "--threads", type=int, default=None, help="IceCacheConfig.threads (default: all cores, per rank its share)"
    )
    ap.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[1],
        help="sequences decoded together (same prompt length); several: one run per batch size, and a "
        "capacity estimate (the most sequences each variant's measured bytes per sequence fit)",
    )
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="every variant prefills in chunks of this many tokens (default: one forward), so that a batch or "
        "context whose one-forward prefill does not fit the GPU can be measured",
    )
    ap.add_argument("--time-limit", type=float, default=1e9, help="skip contexts started after this many s")
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["full", "ice", "ice3"],
        help="full: DynamicCache+SDPA; fullfi: DynamicCache+FlashInfer decode (batch 1); full-compile: "
        "StaticCache + generate, decode step compiled (torch.compile, CUDA graphs); ice: IceCache; "
        "ice3: IceCache reuse=3; fresh: IceCache with fresh selection; ice-fixed, ice-adaptive: IceCache "
        "with that budget_mode; ice-auto: IceCache with effort='auto' (calibrated during prefill); ice "
        "followed by any of -native/-int8/-k8v4 (page_format), -gv/-ov (group_view on/off), -wait "
        "(exact_until_indexed=False), -rN (refresh N), -eX (effort X), -tN (N index threads), -inline (no "
        "staging copy started early), e.g. ice-r2, "
        "ice-int8-gv-r2",
    )
    ap.add_argument(
        "--cprofile",
        type=int,
        default=0,
        help="also profile this many steps of each IceCache variant (host time by function)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    start = time.perf_counter()

    import icecache
    import torch
    import torch.distributed as dist
    import transformers
    from icecache._util import cache_keyword, register_attention
    from icecache.runtime import IceCache, IceCacheConfig, RuntimeStats, enable, kv_heads_per_rank
    from icecache.runtime.layer import IceLayer
    from transformers import DynamicCache

    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's processes: tensor-parallel ranks
    if args.model and (world > 1 or args.layers):
        ap.error("--model takes the model's own layers, in one process")
    tokenizer = None
    if args.model:  # on the CPU until the device is known
        real_model, tokenizer = load_model(
            args.model, dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32
        )
        cfg = real_model.config
        args.layers = cfg.num_hidden_layers
    else:
        make_config, default_layers = SHAPES[args.shape]
        args.layers = args.layers or default_layers
        cfg = make_config(args.layers)
    kv_heads_per_rank(cfg, world)  # before any work
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rank = int(os.environ.get("RANK", "0"))
    log_lines = []

    def log(msg):
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)
            log_lines.append(msg)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def agree(value):
        """Rank 0's ``value`` in every rank, so that all ranks run the same steps."""
        if world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    fi_error = "no CUDA" if not cuda else ("batch > 1" if min(args.batch) > 1 else flashinfer_ready())

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = real_model.to(device) if tokenizer is not None else build_model(cfg, device, world)
    fi_error = agree(fi_error)
    enable(model)  # registers IceCache's attention function, which bench_attention wraps
    register_attention("bench", bench_attention)
    model.set_attn_implementation("bench")
    log(f"model built in {time.perf_counter() - t0:.1f} s")
    kw = cache_keyword(model)

    def step(cache, tok):
        _FULL_FLASHINFER[0] = getattr(cache, "bench_flashinfer", False)
        out = model(tok, logits_to_keep=1, **{kw: cache})
        return out.logits[:, -1:].argmax(-1)

    def full_flashinfer():
        cache = DynamicCache(config=model.config)
        cache.bench_flashinfer = True
        return cache

    def make_ice(reuse, lookahead=True, refresh=1, threads=None, inline=False, segments=None, **more):
        if segments is not None:  # a step graph in that many segments
            more["step_graph"] = True
        config = IceCacheConfig(
            budget=args.budget,
            reuse=reuse,
            threads=threads or args.threads,
            lookahead=lookahead,
            refresh=refresh,
            **more,
        )
        cache = IceCache(config, model)
        if segments is not None:
            cache.step_graph.segments = segments
        if inline:  # no layer starts the next one's staging copy early
            for layer in cache.layers:
                if isinstance(layer, IceLayer):
                    layer.next_layer = None
        model.set_attn_implementation("bench")  # IceCache's attention, with the FlashInfer baseline
        return cache

    def ttst(cache, ids):
        if isinstance(cache, CompiledFull):
            times = cache.generate(ids, 2)
            return times[2] - times[0], times[1] - times[0], None, None
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            chunk = args.prefill_chunk or ids.shape[1]
            for i in range(0, ids.shape[1], chunk):
                out = model(ids[:, i : i + chunk], logits_to_keep=1, **{kw: cache})
            tok = out.logits[:, -1:].argmax(-1)
            sync()
            t_first = time.perf_counter() - t
            tok = step(cache, tok)
        sync()
        total = time.perf_counter() - t
        if not isinstance(cache, IceCache):
            return total, t_first, tok, None
        waited = cache.stats.index_wait_s
        left = sum(not layer.bridging for layer in cache.layers if isinstance(layer, IceLayer))
        steps = [total - t_first]  # the second token's step, then on until the switch
        ready = t_first
        with torch.inference_mode():
            while cache.runtime.bridges.active:
                ready = time.perf_counter() - t
                t1 = time.perf_counter()
                tok = step(cache, tok)
                sync()
                steps.append(time.perf_counter() - t1)
        if len(steps) == 1:  # no bridge: the second token's step was the switch, after its wait
            return total, t_first, tok, Ready(waited, [], steps[0], cache.stats.catch_up_s, t_first + waited, left)
        return total, t_first, tok, Ready(waited, steps[:-1], steps[-1], cache.stats.catch_up_s, ready, left)

    def profiled(what, fn):
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        out = prof.runcall(fn)
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(35)
        log(f"cProfile, {what}:\n{text.getvalue()}")
        return out

    results, shard, threads = [], None, None
    cold_rounds = args.cold if args.cold is not None else int(cuda)
    for batch, n in ((b, n) for b in args.batch for n in args.contexts):
        if agree(time.perf_counter() - start > args.time_limit):
            log(f"skipping batch {batch} x {n}: time limit")
            continue
        if tokenizer is not None:  # real text, a document per sequence
            ids = torch.tensor(documents(tokenizer, batch, n, seed=n, kind=args.text), device=device)
        else:  # the same prompt in every rank
            ids = torch.randint(0, cfg.vocab_size, (batch, n), generator=torch.Generator().manual_seed(n)).to(device)
        variants = {}
        makers = {
            "full": ("full (SDPA)", lambda: DynamicCache(config=model.config)),
            "fullfi": ("full (FlashInfer)", full_flashinfer),
            "ice": ("IceCache", lambda: make_ice(1)),
            "ice3": ("IceCache reuse=3", lambda: make_ice(3)),
            "fresh": ("IceCache fresh", lambda: make_ice(1, lookahead=False)),
            "ice-fixed": ("IceCache budget_mode=fixed", lambda: make_ice(1, budget_mode="fixed")),
            "ice-adaptive": ("IceCache budget_mode=adaptive", lambda: make_ice(1, budget_mode="adaptive")),
            "ice-auto": ("IceCache effort=auto", lambda: make_ice(1, effort="auto")),
        }
        if "full-compile" in args.variants:
            # One static cache for every round at this context (a new one would recompile).
            compiled = CompiledFull(model, kw, n + args.steps + 8, args.prefill_chunk)
            makers["full-compile"] = ("full (static, torch.compile)", lambda compiled=compiled: compiled)
            t = time.perf_counter()
            compiled.generate(ids, 8)
            compile_warmup = time.perf_counter() - t
            log(
                f"{n}: full (static, torch.compile): warm-up {compile_warmup:.1f} s (one generate call: prefill, "
                f"8 tokens, and compiling the decode step: {'yes' if hasattr(model, '_compiled_call') else 'no'})"
            )
        for v in args.variants:  # ice-wait, ice-r2, ice-int8, ice-tN and combinations: ice-int8-gv-r2
            options = ice_options(v) if v not in makers else None
            if options:
                label = "IceCache " + " ".join(f"{k}={x}" for k, x in options.items())
                makers[v] = (label, functools.partial(make_ice, 1, **options))
        if "fullfi" in args.variants and (fi_error or batch > 1):
            makers.pop("fullfi")
            log(f"full (FlashInfer) variant skipped: {fi_error or 'batch > 1'}")
        chosen = [k for k in args.variants if k in makers]
        ttsts: dict = {makers[k][0]: [] for k in chosen}
        colds: dict = {makers[k][0]: [] for k in chosen}
        # The process's first prompts (at its first context) are the cold rounds.
        cold = cold_rounds if not results else 0
        for rnd in range(cold + args.ttst_repeats):
            if variants:  # an earlier round's caches: their TTSTs are kept, their memory freed
                for v in variants.values():
                    if isinstance(v["cache"], IceCache):
                        with torch.inference_mode():  # its full layers' tensors are inference tensors
                            v["cache"].reset()
                variants.clear()
                if cuda:
                    torch.cuda.empty_cache()
            for k in chosen[rnd % len(chosen) :] + chosen[: rnd % len(chosen)]:
                name, make = makers[k]
                rss_before = rss_bytes()
                cache = make()
                if args.cprofile and not name.startswith("full"):
                    total, first, tok, ready = profiled(f"{n}: {name}: prefill", functools.partial(ttst, cache, ids))
                else:
                    total, first, tok, ready = ttst(cache, ids)
                (colds if rnd < cold else ttsts)[name].append(total)
                variants[name] = dict(cache=cache, tok=tok, ttft=first, steps=[])
                if isinstance(cache, IceCache):
                    v = variants[name]
                    v["host_rss_bytes"] = rss_bytes() - rss_before  # the indexes are ready by now
                    v["index_wait_s"], v["index_ready_s"] = ready.wait_s, ready.ready_s
                    v["switch_s"], v["catch_up_s"] = ready.switch_s, ready.catch_up_s
                    v["bridged_steps"] = len(ready.bridged_s)
                    bridged = statistics.median(ready.bridged_s) * 1e3 if ready.bridged_s else float("nan")
                    v["bridged_step_ms"] = bridged
                    v["left_at_second"] = ready.left_at_second
                    shard, threads = cache.shard, cache.runtime.config.threads
                    log(
                        f"{n}: {name}: TTFT {first:.2f} s, TTST {total:.2f} s ({ready.left_at_second} of "
                        f"{cache.runtime.served_layers} "
                        f"layers had left the bridge by then), {len(ready.bridged_s)} steps bridged "
                        f"(median {bridged:.1f} ms), index ready by {ready.ready_s:.2f} s, switch step "
                        f"{ready.switch_s * 1e3:.0f} ms (catch-up {ready.catch_up_s * 1e3:.0f} ms)"
                    )
                else:
                    log(f"{n}: {name}: TTFT {first:.2f} s, TTST {total:.2f} s")
        for name, v in variants.items():
            v["ttst"], v["ttst_rounds"] = statistics.median(ttsts[name]), ttsts[name]
            if colds[name]:
                v["cold_ttst_s"] = colds[name]
                log(f"{n}: {name}: cold TTST {', '.join(f'{c:.2f}' for c in colds[name])} s (not in the median)")
        with torch.inference_mode():
            for v in variants.values():
                for _ in range(0 if isinstance(v["cache"], CompiledFull) else args.warmup):
                    v["tok"] = step(v["cache"], v["tok"])
            sync()
            for v in variants.values():
                if isinstance(v["cache"], IceCache):
                    v["cache"].runtime.stats = RuntimeStats()  # host time of the TPOT rounds
            names = list(variants)
            for rep in range(args.repeats):
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name in order:
                    v = variants[name]
                    if isinstance(v["cache"], CompiledFull):  # a generate call: prefill, then the steps
                        times = v["cache"].generate(ids, args.steps + 2)
                        v["steps"] += [b - a for a, b in zip(times[2:], times[3:])]
                        continue
                    for _ in range(args.steps):
                        t = time.perf_counter()
                        v["tok"] = step(v["cache"], v["tok"])
                        sync()
                        v["steps"].append(time.perf_counter() - t)
                log(
                    f"{n}: round {rep + 1}: "
                    + ", ".join(
                        f"{k} {statistics.median(variants[k]['steps'][-args.steps :]) * 1e3:.1f} ms" for k in names
                    )
                )
            # Breakdown pass (device-synced stage boundaries).
            for name, v in variants.items():
                cache = v["cache"]
                if not isinstance(cache, IceCache):
                    continue
                s = cache.stats
                v["host_ms_per_layer_step"] = (s.update_s + s.wait_s + s.copy_s + s.attend_s) / s.layer_steps * 1e3
                v["wait_ms_per_layer_step"] = s.wait_s / s.layer_steps * 1e3
                # Layer steps whose staging copy ran early on the copy stream (in the TPOT rounds).
                v["copied_ahead"] = s.copies_ahead / s.layer_steps
                log(f"{n}: {name}: staging copied ahead in {v['copied_ahead']:.1%} of layer steps")
                # Selection reuse in the TPOT rounds: of the pages selected, those already on the device.
                tokens = args.repeats * args.steps
                v["reuse"] = 1 - s.pages_loaded / max(1, s.pages_selected)
                log(
                    f"{n}: {name}: per token {s.pages_selected / tokens:.0f} pages selected, "
                    f"{s.pages_loaded / tokens:.0f} loaded: {v['reuse']:.1%} already on the device"
                )
                sg = cache.step_graph
                v["step_graph_replays"] = sg.replays
                if sg.off_reason:
                    log(f"{n}: {name}: step graph off: {sg.off_reason}")
                else:
                    per = 1e3 / max(1, s.graph_steps)  # ms per replayed step
                    v["graph_host_ms"] = s.graph_host_s * per
                    v["graph_wait_ms"] = s.graph_wait_s * per
                    v["graph_replay_ms"] = s.graph_replay_s * per
                    log(
                        f"{n}: {name}: step graph: {sg.steps} steps, {sg.replays} replayed, {sg.captures} captured "
                        f"({sg.segments} segments); host time per replayed step {s.graph_host_s * per:.2f} ms, of "
                        f"which waiting for the worker {s.graph_wait_s * per:.2f} ms and in the replay calls "
                        f"{s.graph_replay_s * per:.2f} ms; {s.graph_capture_steps} steps captured, "
                        f"{s.graph_capture_s / max(1, s.graph_capture_steps) * 1e3:.1f} ms each"
                    )
                if args.profile_steps < 1:
                    continue
                cache.runtime.stats = RuntimeStats()
                cache.runtime.sync_timing = True
                t = time.perf_counter()
                for _ in range(args.profile_steps):
                    v["tok"] = step(cache, v["tok"])
                sync()
                v["profile_total"] = (time.perf_counter() - t) / args.profile_steps
                cache.runtime.sync_timing = False
                s = cache.stats
                v["breakdown"] = {k: getattr(s, k) / args.profile_steps for k in ("wait_s", "copy_s", "attend_s")}
                if s.graph_steps:
                    device_ms, host_ms = (x / s.graph_steps * 1e3 for x in (s.graph_device_s, s.graph_host_s))
                    log(
                        f"{n}: {name}: synced step graph: {device_ms:.2f} ms from the first replay to the last "
                        f"one's end, host {host_ms:.2f} ms per step"
                    )
                v["worker"] = {
                    k: getattr(s, k) / args.profile_steps
                    for k in ("worker_insert_s", "worker_select_s", "worker_gather_s")
                }
                v["pages_loaded"] = s.pages_loaded / args.profile_steps
                v["pages_selected"] = s.pages_selected / args.profile_steps
            for name, v in variants.items() if args.cprofile else ():
                if isinstance(v["cache"], CompiledFull):
                    continue

                def steps(v=v):
                    for _ in range(args.cprofile):
                        v["tok"] = step(v["cache"], v["tok"])
                    sync()

                profiled(f"{n}: {name}: {args.cprofile} decode steps", steps)
        for name in (makers[k][0] for k in chosen):  # rows in the order asked for
            v = variants[name]
            cache = v["cache"]
            if isinstance(cache, IceCache):
                nb = cache.nbytes()
            else:
                nb = {
                    "device": sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in cache.layers),
                    "host": 0,
                }
            row = dict(
                batch=batch,
                context=n,
                variant=name,
                ttft_s=v["ttft"],
                ttst_s=v["ttst"],
                ttst_s_per_round=v["ttst_rounds"],
                tpot_ms=statistics.median(v["steps"]) * 1e3,
                tpot_ms_per_round=[
                    statistics.median(v["steps"][i * args.steps : (i + 1) * args.steps]) * 1e3
                    for i in range(args.repeats)
                ],
                device_kv_bytes=nb["device"],
                host_bytes=nb["host"],
            )
            for k in (
                "breakdown",
                "worker",
                "profile_total",
                "pages_loaded",
                "pages_selected",
                "reuse",
                "index_wait_s",
                "index_ready_s",
                "switch_s",
                "catch_up_s",
                "bridged_steps",
                "bridged_step_ms",
                "left_at_second",
                "host_ms_per_layer_step",
                "wait_ms_per_layer_step",
                "host_rss_bytes",
                "cold_ttst_s",
            ):
                if k in v:
                    row[k] = v[k]
            if isinstance(cache, CompiledFull):
                row["compile_warmup_s"] = compile_warmup
            results.append(row)
            log(json.dumps(row))
        del variants
        makers.clear()  # the static cache
        if cuda:
            torch.cuda.empty_cache()

    if rank != 0:
        return 0
    where = f"{torch.cuda.get_device_name()} x{world}" if cuda else f"CPU, {world} process(es)"
    if world > 1 and shard is not None:
        where += (
            f", tensor parallelism: rank 0 holds KV heads {shard.first}..{shard.first + shard.count - 1} of "
            f"{shard.count * shard.size}, index threads {threads or 'all'} per rank, figures of rank 0"
        )

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if args.model:
        weights = f"{args.model}'s real weights ({args.layers} layers, {dtype}), a {args.text} prompt"
    else:
        weights = f"{args.shape} shape ({args.layers} layers), random {dtype} weights"
    head = (
        f"{where}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, icecache {icecache.__version__}; {weights}; budget {args.budget} "
        f"(page 16, sink 16, window 32, 2 full layers); TTST median of {args.ttst_repeats} round(s) "
        f"(variants rotated, after {cold_rounds} cold round(s) at the first context); TPOT median of "
        f"{args.repeats}x{args.steps} interleaved steps after {args.warmup} warm-up steps; "
        f"tok/s = batch / TPOT"
    )
    lines = [
        head,
        "",
        "| batch | context | variant | TTST s | x full | index wait s | bridged steps (ms) | ready s | switch ms "
        "| TPOT ms | x full | tok/s | host ms/layer step (waiting) | synced pass ms | wait | copy | attention | rest "
        "| worker insert/select/gather ms | pages loaded/tok | device KV MB | host MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        # "x full": against the faster full-cache run (SDPA or FlashInfer) of the same context.
        fulls = [
            x
            for x in results
            if (x["batch"], x["context"]) == (r["batch"], r["context"]) and x["variant"].startswith("full")
        ]
        ratio = r["tpot_ms"] / min(x["tpot_ms"] for x in fulls) if fulls else float("nan")
        ttst_ratio = r["ttst_s"] / min(x["ttst_s"] for x in fulls) if fulls else float("nan")
        wait = f"{r['index_wait_s']:.2f}" if "index_wait_s" in r else "-"
        if "index_ready_s" not in r:
            ready = "- | - | -"
        else:
            bridged = f"{r['bridged_steps']} ({r['bridged_step_ms']:.1f})" if r["bridged_steps"] else "0"
            ready = f"{bridged} | {r['index_ready_s']:.2f} | {r['switch_s'] * 1e3:.0f}"
        if "breakdown" in r:
            b = {k: v * 1e3 for k, v in r["breakdown"].items()}
            w = {k: v * 1e3 for k, v in r["worker"].items()}
            p = r["profile_total"] * 1e3
            parts = (
                f"{r['host_ms_per_layer_step']:.3f} ({r['wait_ms_per_layer_step']:.3f}) | "
                f"{p:.1f} | {b['wait_s']:.2f} | {b['copy_s']:.2f} | {b['attend_s']:.2f} | "
                f"{p - sum(b.values()):.1f} | {w['worker_insert_s']:.1f} / {w['worker_select_s']:.1f} / "
                f"{w['worker_gather_s']:.1f} | {r['pages_loaded']:.0f}"
            )
        else:
            parts = "- | - | - | - | - | - | - | -"
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['variant']} | {r['ttst_s']:.2f} | {ttst_ratio:.2f} | {wait} | "
            f"{ready} | {r['tpot_ms']:.1f} | {ratio:.2f} | {r['batch'] / r['tpot_ms'] * 1e3:.1f} | "
            f"{parts} | {r['device_kv_bytes'] / 2**20:.0f} | {r['host_bytes'] / 2**20:.0f} |"
        )
    for r in results:
        if "compile_warmup_s" in r:
            warm = r["compile_warmup_s"]
            lines.append(f"\n{r['context']}: {r['variant']}: compile warm-up {warm:.1f} s (not in TTST or TPOT)")
        if "cold_ttst_s" in r:
            colds = ", ".join(f"{c:.2f}" for c in r["cold_ttst_s"])
            first = "the process's first prompt; not in TTST"
            lines.append(f"\n{r['context']}: {r['variant']}: cold TTST {colds} s ({first})")
    if cuda:
        lines += ["", *capacity(results, model)]
    table = "\n".join(lines)
    print(table, flush=True)
    # Peak host memory of the whole run (every variant's caches are alive until the end).
    log(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)
        with open(os.path.join(args.out, "bench_gpu.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(args.out, "bench_gpu.log"), "w") as f:
            f.write("\n".join(log_lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
