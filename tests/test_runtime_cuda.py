"""The IceCache runtime on a GPU: device page pools fed through pinned staging by the look-ahead
worker (flags written by the device behind each layer's queries), device-side ranking and
attention, the prefill pipeline's side stream. Skipped without CUDA (CI has no GPU); run on a
GPU machine with ``PYTHONPATH=python:tests pytest tests/test_runtime_cuda.py``."""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from icecache.attend import ranked_decode_attention  # noqa: E402
from icecache.runtime import IceCache, IceCacheConfig  # noqa: E402
from isolated import isolated  # noqa: E402
from test_runtime import (  # noqa: E402, F401 (pool_checks is a fixture)
    CACHE_KW,
    _first_group_run,
    _held_bridge_run,
    _naive_ranked,
    _ranked_inputs,
    ice_layers,
    pool_checks,
    prompt_ids,
    run_steps,
    tiny_model,
)
from transformers import DynamicCache  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _padded_batch():
    ids = prompt_ids(300, seed=9, batch=2).cuda()
    mask = torch.ones_like(ids)
    mask[1, :100] = 0
    return ids, mask


def _paging_config(**options) -> IceCacheConfig:
    """A budget that makes the tiny model's layers load and evict pages from the first step."""
    return IceCacheConfig(
        budget=96,
        full_layers=1,
        superset_pages=12,
        pool_pages=16,
        exact_until_indexed=False,  # pages move from the first step
        **options,
    )


@pytest.mark.parametrize("lookahead", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_budget_covering_context_matches_full_cache(dtype, lookahead):
    model = tiny_model("llama").cuda().to(dtype)
    ids, mask = _padded_batch()
    full = run_steps(model, ids, DynamicCache(config=model.config), 40, attention_mask=mask)
    cfg = IceCacheConfig(budget=1024, full_layers=1, lookahead=lookahead, page_format="native")
    ice = run_steps(model, ids, IceCache(cfg, model), 40, attention_mask=mask)
    if dtype == torch.float32:
        torch.testing.assert_close(ice, full, rtol=1e-3, atol=1e-3)
    else:  # bf16 rounding differs between kernels; the predictions must still agree
        assert (ice.argmax(-1) == full.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("page_format", ["native", "int8", "k8v4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_chunked_prefill_matches_full_cache(dtype, page_format):
    """A left-padded batch in chunks of 64 (the earlier tokens streamed back from pinned host
    memory, on the copy stream) then 40 decode steps, at a budget covering the context, against
    the full cache in one forward; in bf16 within the full cache's own difference between chunked
    and one-forward prefill."""
    model = tiny_model("llama").cuda().to(dtype)
    ids, mask = _padded_batch()
    full = run_steps(model, ids, DynamicCache(config=model.config), 40, attention_mask=mask)
    full_chunked = run_steps(model, ids, DynamicCache(config=model.config), 40, attention_mask=mask, chunk=64)
    cfg = IceCacheConfig(budget=1024, full_layers=1, page_format=page_format, exact_until_indexed=False)
    ice = run_steps(model, ids, IceCache(cfg, model), 40, attention_mask=mask, chunk=64)
    if dtype == torch.float32 and page_format == "native":
        torch.testing.assert_close(ice, full, rtol=1e-3, atol=1e-3)
    else:
        own = (full_chunked - full).abs().max().item()
        err = (ice - full).abs().max().item()
        assert err <= max(2 * own, {"native": 1e-2, "int8": 0.05, "k8v4": 0.1}[page_format]), (err, own)


@pytest.mark.parametrize("reuse, lookahead", [(1, True), (2, True), (1, False)])
def test_cuda_pages_move_through_pinned_staging(reuse, lookahead, pool_checks):  # noqa: F811
    model = tiny_model("llama").cuda().to(torch.bfloat16)
    ids, mask = _padded_batch()
    cache = IceCache(_paging_config(reuse=reuse, lookahead=lookahead), model, track_recall=True)
    logits = run_steps(model, ids, cache, 100, attention_mask=mask)
    torch.cuda.synchronize()
    assert torch.isfinite(logits).all()
    layers = ice_layers(cache)
    assert all(layer.pool_kv.is_cuda and layer.window.dense_valid.is_cuda for layer in layers)
    for layer in layers:
        bufs = layer.jobs.buffers()
        assert all(t.is_pinned() for t in (bufs.queries, bufs.flag, bufs.flush_k, bufs.staging))
    assert cache.runtime.transit.stream is not None
    assert cache.stats.pages_loaded > 0 and sum(pool_checks) > 0
    assert 0 < cache.stats.recall <= 1


@pytest.mark.parametrize("ranked, adaptive", [(True, False), (False, False), (True, True), (False, True)])
def test_cuda_ranked_attention_equals_the_cpu_reference(ranked, adaptive):
    """The device path gives the CPU reference's result for the same inputs and selection."""
    inputs = _ranked_inputs(5, B=2, H=4, G=4, D=64, C=12, S=16, L=48)
    B, H, C = inputs[2].shape[:3]
    keep = None if ranked else torch.rand(B, H, C) < 0.4
    got = ranked_decode_attention(
        *[t.cuda() for t in inputs],
        pages=5,
        scale=0.125,
        keep=None if keep is None else keep.cuda(),
        adaptive=adaptive,
    )
    cpu = ranked_decode_attention(*inputs, pages=5, scale=0.125, keep=keep, adaptive=adaptive)
    assert torch.equal(got.kept.cpu(), cpu.kept)
    torch.testing.assert_close(got.out.cpu(), _naive_ranked(*inputs, cpu.kept, 0.125), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "budget_mode, page_format",
    [("fixed", "native"), ("adaptive", "native"), ("adaptive", "int8"), ("fixed", "k8v4")],
)
def test_cuda_graphs_decode_like_the_eager_path(budget_mode, page_format):
    """Replaying each layer's device step from CUDA graphs (window write, page loads and with
    quantised pages their dequantisation, ranking, attention, hand-off) gives the eager result."""
    model = tiny_model("llama").cuda()
    ids, mask = _padded_batch()
    runs = []
    for graphs in (True, False):
        config = _paging_config(cuda_graphs=graphs, budget_mode=budget_mode, page_format=page_format, step_graph=False)
        cache = IceCache(config, model)
        runs.append(run_steps(model, ids, cache, 40, attention_mask=mask))
        assert all(bool(layer._device_step._graphs) == graphs for layer in ice_layers(cache))
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_format, reuse", [("native", 1), ("int8", 2), ("k8v4", 2)])
def test_cuda_copies_ahead_change_nothing(page_format, reuse, pool_checks):  # noqa: F811
    """Staging copies started early on the copy stream (``LayerJobs.upload_ahead``) give the
    same decode as copies made at each layer's own step (the layers unlinked)."""
    model = tiny_model("llama").cuda()
    ids, mask = _padded_batch()
    runs, ahead = [], []
    for linked in (True, False):
        cache = IceCache(_paging_config(reuse=reuse, page_format=page_format, step_graph=False), model)
        if not linked:
            for layer in ice_layers(cache):
                layer.next_layer = None
        runs.append(run_steps(model, ids, cache, 100, attention_mask=mask))
        ahead.append(cache.stats.copies_ahead)
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-5)
    assert ahead[0] > 0 and ahead[1] == 0
    assert sum(pool_checks) > 0


@pytest.mark.parametrize("reuse, page_format", [(1, "int8"), (2, "int8"), (2, "k8v4")])
def test_cuda_quantised_pages_dequantise_on_the_device(reuse, page_format, pool_checks):  # noqa: F811
    """Quantised pages through pinned staging: the device dequantises each loaded page into its
    bf16 pool exactly as the CPU reads the store (``PageStore.tokens``), also from CUDA graphs."""
    model = tiny_model("llama").cuda().to(torch.bfloat16)
    ids, mask = _padded_batch()
    cache = IceCache(_paging_config(reuse=reuse, page_format=page_format, step_graph=False), model)
    logits = run_steps(model, ids, cache, 100, attention_mask=mask)
    torch.cuda.synchronize()
    assert torch.isfinite(logits).all()
    layers = ice_layers(cache)
    assert all(bool(layer._device_step._graphs) for layer in layers)
    assert all(s.k.dtype == torch.uint8 for layer in layers for s in layer.stores)
    assert cache.stats.pages_loaded > 0 and sum(pool_checks) > 0


@pytest.mark.parametrize("split", [True, False])
def test_cuda_chunk_attention_matches_masked_attention(split, monkeypatch):
    """The chunk kernel on the GPU (cuDNN's split call merged by log-sum-exp, or the lower-right
    mask) equals float32 attention with transformers' explicit mask, in bf16's precision."""
    from icecache.attend import chunk

    kind = (128, torch.bfloat16)
    monkeypatch.setattr(chunk, "_cudnn_refused", set() if split else {kind})
    g = torch.Generator(device="cuda").manual_seed(0)
    B, Hq, Hkv, L, T, D = 2, 8, 2, 256, 1000, 128
    q = torch.randn(B, Hq, L, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, T, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, T, D, generator=g, device="cuda", dtype=torch.bfloat16)
    valid = torch.ones(B, T, dtype=torch.bool, device="cuda")
    valid[1, :300] = False
    causal = torch.arange(T, device="cuda")[None, :] <= torch.arange(T - L, T, device="cuda")[:, None]
    for mask in (None, valid):
        allowed = causal[None] & (mask[:, None, :] if mask is not None else True)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.float(),
            k.float().repeat_interleave(Hq // Hkv, 1),
            v.float().repeat_interleave(Hq // Hkv, 1),
            attn_mask=allowed[:, None],
        ).transpose(1, 2)
        got = chunk.chunk_attention(q, k, v, mask, D**-0.5)
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert (kind in chunk._cudnn_refused) is not split  # the split call served it, or was not tried


@pytest.mark.parametrize("batch, length", [(1, 5000), (3, 1500)])
def test_cuda_masked_decode_attention_matches_float32_attention(batch, length):
    """The step graph's full-layer attention in bf16 (float32 logits, softmax and sums) equals
    float32 SDPA over the keys the mask marks, in bf16's precision."""
    from icecache.attend.full import masked_decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    Hq, Hkv, D = 32, 8, 128
    q = torch.randn(batch, Hq, 1, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, Hkv, length, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, Hkv, length, D, generator=g, device="cuda", dtype=torch.bfloat16)
    mask = torch.rand(batch, length, generator=g, device="cuda") < 0.7
    mask[:, 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(),
        k.float().repeat_interleave(Hq // Hkv, 1),
        v.float().repeat_interleave(Hq // Hkv, 1),
        attn_mask=mask[:, None, None, :],
        scale=D**-0.5,
    ).transpose(1, 2)
    got = masked_decode_attention(q, k, v, mask, D**-0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_bridge_is_exact_then_hands_over(dtype, chunk):
    """``exact_until_indexed`` on the GPU: steps with the index worker held attend the whole
    cache as the full cache does (a prompt in chunks: read back from pinned host memory at each
    step, the next layer's on the copy stream); after the hand-over, retrieval with CUDA graphs,
    the budget covering the context, stays exact."""
    model = tiny_model("llama").cuda().to(dtype)
    ids, mask = _padded_batch()
    full = run_steps(model, ids, DynamicCache(config=model.config), 40, attention_mask=mask)
    cfg = IceCacheConfig(budget=1024, full_layers=1, page_format="native")  # exact: 16-bit pages
    ice, cache, bridging = _held_bridge_run(model, ids, mask, cfg, 17, 40, chunk=chunk)
    assert all((bridge.host is not None) == (chunk is not None) for bridge in bridging[0])
    assert [all(step) for step in bridging] == [True] * 18 + [False] * 22  # the 18th hands 17 tokens to the worker
    if dtype == torch.float32:
        torch.testing.assert_close(ice, full, rtol=1e-3, atol=1e-3)
    else:  # bf16 rounding differs between kernels; the predictions must still agree
        assert (ice.argmax(-1) == full.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("step_graph", [True, False])
def test_cuda_layers_capture_their_own_graphs_only_without_the_step_graph(monkeypatch, step_graph):
    """With the step graph on, no IceCache layer captures graphs of its own, neither when it
    leaves the bridge while later layers bridge on nor after: the step graph replays every
    layer once the bridge ends. Without it, a layer captures its own at its first step after
    the bridge. Exact at full budget throughout."""
    model = tiny_model("llama").cuda()
    ids = prompt_ids(300, seed=21).cuda()
    full = run_steps(model, ids, DynamicCache(config=model.config), 40)
    cfg = IceCacheConfig(budget=1024, full_layers=1, page_format="native", step_graph=step_graph)
    ice, cache, layers, seen = _first_group_run(
        monkeypatch,
        model,
        ids,
        cfg,
        None,
        after=lambda layer: layer.device_step is not None and bool(layer.device_step._graphs),
    )
    torch.testing.assert_close(ice, full, rtol=1e-3, atol=1e-3)
    assert seen["bridging"][19] == [False] + [True] * (len(layers) - 1)
    assert not any(any(step) for step in seen["bridging"][22:])
    graphs = seen["after"]
    if step_graph:
        assert not any(any(step) for step in graphs)
        assert cache.step_graph.off_reason is None and cache.step_graph.replays > 0
    else:  # the layer that left has its own graphs, the bridged ones none yet; then all have
        assert graphs[19] == [True] + [False] * (len(layers) - 1)
        assert all(graphs[-1])


_CAPTURE_PRELUDE = """
import gc, warnings, torch
from icecache.runtime import IceCache, IceCacheConfig
from test_runtime import ice_layers, prompt_ids, run_steps, tiny_model
model = tiny_model("llama").cuda()
ids = prompt_ids(300, seed=9).cuda()
def config(**options):
    paging = dict(budget=96, full_layers=1, superset_pages=12, pool_pages=16, exact_until_indexed=False)
    options.setdefault("step_graph", False)  # each layer captures its own graphs
    return IceCacheConfig(**paging, **options)
eager = run_steps(model, ids, IceCache(config(cuda_graphs=False), model), 30)
"""


def test_cuda_no_collection_runs_during_a_capture_and_dropped_caches_break_none():
    """The cyclic garbage collector may run at any allocation; during a capture, collecting a
    dropped cache would destroy its graphs and invalidate the capture (torch then aborts the
    process). With the collector at its most eager (a collection at nearly every allocation)
    and every cache freed only by it (a cycle), no collection may start while a stream
    captures, every layer must capture its graphs, and decode must equal the eager path."""
    out = isolated(
        _CAPTURE_PRELUDE
        + """
during = []
gc.callbacks.append(lambda phase, info: phase == "start" and during.append(torch.cuda.is_current_stream_capturing()))
gc.set_threshold(1, 1, 1)
for i in range(4):
    cache = IceCache(config(), model)
    cache.cycle = cache
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a capture that fell back to eager would warn
        got = run_steps(model, ids, cache, 30)
    print(all(layer._device_step._graphs for layer in ice_layers(cache)), float((got - eager).abs().max()) < 1e-5)
    del cache
print(len(during) > 100, any(during))
""",
        timeout=600,
    )
    assert out == ["True True"] * 4 + ["True False"], out


def test_cuda_graphs_keep_their_blas_workspace_when_torch_compile_frees_it():
    """torch.compile's CUDA graphs free cuBLAS's workspaces around their captures
    (``_cuda_clearCublasWorkspaces``). A graph captured under ``graphs.guarded`` owns its
    workspace: a tensor that takes the memory freed then is not written by its replays, and
    the replays stay right. (Outside ``guarded`` the graph keeps using the workspace that its
    stream's first matmul allocated from the ordinary pool, which the tensor then takes.)"""
    out = isolated(
        """
import torch
from icecache.runtime import graphs
torch.manual_seed(0)
dev = torch.device("cuda")
# Shapes of one decode step of an 8B model, and a long reduction cuBLAS splits (split-K).
pairs = [((1, 4096), (4096, 14336)), ((1, 14336), (14336, 4096)), ((8, 65536), (65536, 128))]
bf16 = dict(device=dev, dtype=torch.bfloat16)
xs = [(torch.randn(a, **bf16), torch.randn(b, **bf16)) for a, b in pairs]
want = [x @ w for x, w in xs]
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for x, w in xs:  # warm-up: the side stream's workspace
        x @ w
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with graphs.guarded(), torch.cuda.stream(side):
    graph.capture_begin(capture_error_mode="thread_local")
    got = [x @ w for x, w in xs]
    graph.capture_end()
torch.cuda.synchronize()
before = torch.cuda.memory_allocated()
torch._C._cuda_clearCublasWorkspaces()  # what torch.compile's CUDA graphs do
freed = before - torch.cuda.memory_allocated()
with torch.cuda.stream(side):  # the freed block goes to the next allocation of its size there
    taker = torch.full((max(freed, 1),), 7, dtype=torch.uint8, device=dev)
for _ in range(3):
    graph.replay()
torch.cuda.synchronize()
print(bool((taker == 7).all()), all(torch.allclose(g, w, rtol=2e-2, atol=2e-1) for g, w in zip(got, want)))
"""
    )
    assert out == ["True True"], out


def test_cuda_a_failed_capture_warns_and_decodes_eagerly():
    """A capture that fails (here: a call the capture forbids, inside the captured step) is a
    warning and an eager layer from then on, with the eager path's output, not an abort."""
    out = isolated(
        _CAPTURE_PRELUDE
        + """
import icecache.runtime.step as step
attend = step.ranked_decode_attention
def forbidden(*args, **kwargs):
    if torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()
    return attend(*args, **kwargs)
step.ranked_decode_attention = forbidden
cache = IceCache(config(), model)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = run_steps(model, ids, cache, 30)
print(any("capture failed" in str(w.message) for w in caught))
print(not any(layer._device_step._graphs for layer in ice_layers(cache)), float((got - eager).abs().max()) < 1e-5)
with torch.inference_mode():  # the full-cache layers' tensors are inference tensors
    cache.reset()
print(float((run_steps(model, ids, cache, 30) - eager).abs().max()) < 1e-5)
""",
        timeout=600,
    )
    assert out == ["True", "True True", "True"], out


def test_cuda_chunked_prefill_peak_at_64k_stays_under_its_bound():
    """Llama-3.1-8B's layer shape (4 layers: 2 full-cache, 2 served by IceCache; random bf16
    weights), a 65,536-token prompt in the default chunks of 8,192, then two decode steps: the
    device memory beyond the weights peaks under 2.5 GiB. That bound is what the design holds at
    once: the full layers' KV (0.5 GiB), one IceCache layer's earlier prompt read back twice (the
    current buffer and the next layer's prefetch, 2 x 0.28 GiB), a chunk's activations (~1 GiB)
    and the first step's bridge. The same prompt in one forward through the full cache peaks
    above it (its KV and a 64k-token forward's activations): the bound can fail."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=70000,
        rope_theta=500000.0,
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (1, 65536), device="cuda")
    weights = torch.cuda.memory_allocated()

    def peak(cache, chunk):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            for at in range(0, ids.shape[1], chunk):
                out = model(ids[:, at : at + chunk], logits_to_keep=1, **{CACHE_KW: cache})
            for _ in range(2):
                out = model(out.logits[:, -1:].argmax(-1), logits_to_keep=1, **{CACHE_KW: cache})
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - weights) / 2**30

    ice = IceCache(IceCacheConfig(budget=256, full_layers=2), model)
    ice_peak = peak(ice, IceCacheConfig().prefill_chunk)
    ice.reset()
    del ice
    full_peak = peak(DynamicCache(config=model.config), ids.shape[1])
    assert ice_peak <= 2.5 < full_peak, (ice_peak, full_peak)


def test_cuda_cache_pins_by_registering_pages():
    """A cache on CUDA in a process with no allocator configuration has torch pin host memory by
    registering pages; a chunked prompt then decodes as one forward does."""
    from icecache.runtime import hostmem

    if any(os.environ.get(v) for v in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")):
        pytest.skip("the process configured its own allocator")
    model = tiny_model("llama").cuda()
    ids = prompt_ids(300, seed=5).cuda()
    cfg = IceCacheConfig(budget=1024, full_layers=1, exact_until_indexed=False)
    cache = IceCache(cfg, model)
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)  # torch 2.11 has none
    assert getter is None or hostmem.PINNING in getter()
    got = run_steps(model, ids, cache, 4, chunk=64)
    assert torch.empty(8, pin_memory=True).is_pinned()
    want = run_steps(model, ids, IceCache(cfg, model), 4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_cuda_second_chunked_prompt_reuses_the_first_ones_pinned_blocks():
    """Two prompts in chunks on one cache, reset between: the first's pinned host blocks come
    back to the process's pool once its index is built and serve the second's host copy; the
    second decodes as a fresh cache does; the blocks the second did not take are released when
    its decoding starts."""
    model = tiny_model("llama").cuda()
    first, second = prompt_ids(300, seed=3).cuda(), prompt_ids(256, seed=4).cuda()  # blocks: 5 and 4 a layer
    cfg = IceCacheConfig(budget=1024, full_layers=1, page_format="native", exact_until_indexed=False)
    cache = IceCache(cfg, model)
    run_steps(model, first, cache, 4, chunk=64)
    pinned = cache.runtime.pinned
    kept = pinned.nbytes()
    assert kept > 0  # the first prompt's blocks, free once its index was built
    blocks = {b.data_ptr() for blocks in pinned._free.values() for b in blocks}
    with torch.inference_mode():
        cache.reset()
    got = run_steps(model, second, cache, 4, chunk=64)
    assert pinned.nbytes() < kept  # the second took some (back now); the rest were released
    assert {b.data_ptr() for blocks in pinned._free.values() for b in blocks} <= blocks
    want = run_steps(model, second, IceCache(cfg, model), 4, chunk=64)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("page_format", ["native", "int8"])
def test_cuda_step_graph_decodes_as_the_eager_path(page_format):
    """Whole decode steps replayed from one CUDA graph each (every layer: the full layer in its
    fixed storage, each IceCache layer's device step; the host's work around the replay) decode
    as eager steps do, over a generation with inserts, evictions and reloads, at batch 1 and at
    a left-padded batch of 2; after a reset and a batch-size change the graphs are captured again."""
    model = tiny_model("llama").cuda()
    ids, mask = _padded_batch()
    single = ids[:1]
    cache = IceCache(_paging_config(page_format=page_format, step_graph=True), model)
    for prompt, pmask in ((single, None), (ids, mask), (single, None)):
        eager = run_steps(
            model,
            prompt,
            IceCache(_paging_config(page_format=page_format, step_graph=False), model),
            100,
            attention_mask=pmask,
        )
        with torch.inference_mode():
            cache.reset()
        got = run_steps(model, prompt, cache, 100, attention_mask=pmask)
        graph = cache.step_graph
        assert graph.steps == 99 and graph.replays == 99 and 1 <= graph.captures <= 6, (
            graph.steps,
            graph.replays,
            graph.captures,
        )
        assert torch.equal(got.argmax(-1), eager.argmax(-1))
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
