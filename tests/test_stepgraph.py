"""The step graph's phases (host work of every IceCache layer, then the decoder's forward, then
the next jobs) run eagerly on the CPU: they must decode as plain eager decoding does. The CUDA
graphs themselves are checked in test_runtime_cuda.py."""

import pytest
import torch
from icecache.runtime import IceCache, IceCacheConfig
from icecache.runtime.stepgraph import ROOM, StaticFullLayer
from test_runtime import left_padded, prompt_ids, run_steps, tiny_model


def _config(**changes):
    base = dict(budget=96, full_layers=1, exact_until_indexed=False, superset_pages=12, pool_pages=16)
    return IceCacheConfig(**{**base, **changes})


def _phased(model, cfg):
    cache = IceCache(cfg, model)
    cache.step_graph.enabled = True  # on the CPU: the phases, eagerly
    return cache


@pytest.mark.parametrize(
    "reuse, page_format, padded",
    [(1, "native", False), (2, "int8", True), (1, "k8v4", True), (2, "native", True)],
)
def test_step_graph_phases_decode_as_eager_decoding(reuse, page_format, padded):
    """Long enough for window flushes, inserts, evictions and reloads; with left padding the
    full layer's mask must keep the padding out."""
    model = tiny_model("llama")
    if padded:
        ids, mask = left_padded(prompt_ids(300, seed=1), prompt_ids(220, seed=2))
    else:
        ids, mask = prompt_ids(300, seed=1), None
    cfg = _config(reuse=reuse, page_format=page_format)
    eager = run_steps(model, ids, IceCache(cfg, model), 60, attention_mask=mask)
    cache = _phased(model, cfg)
    phased = run_steps(model, ids, cache, 60, attention_mask=mask)
    # The first decode step runs eagerly (its job runs now); every later one in phases, which
    # on the CPU count as steps that captured (their host time apart from replayed steps').
    assert cache.step_graph.steps == cache.stats.graph_capture_steps == 59
    assert cache.stats.graph_steps == 0 and cache.stats.graph_capture_s > 0
    assert any(isinstance(layer, StaticFullLayer) for layer in cache.layers)
    assert torch.equal(phased.argmax(-1), eager.argmax(-1))
    torch.testing.assert_close(phased, eager, rtol=1e-5, atol=1e-5)


def test_step_graph_full_layers_grow_and_reset():
    """A full layer's storage grows when its room runs out; a reset gives the next prompt
    plain layers again, and it decodes as a fresh cache does."""
    model = tiny_model("llama")
    cfg = _config()
    cache = _phased(model, cfg)
    run_steps(model, prompt_ids(120, seed=4), cache, 8)
    full = next(layer for layer in cache.layers if isinstance(layer, StaticFullLayer))
    assert full.capacity == 120 + 1 + ROOM and full.get_seq_length() == 128
    written = full.keys.clone()
    full.length = full.capacity  # as if the room were used up: the next step grows it
    assert full.make_room() and full.capacity == 121 + 2 * ROOM
    assert torch.equal(full.keys[:, :, :128], written) and not full.key_mask[:, 121 + ROOM :].any()
    full.length = 128
    with torch.inference_mode():
        cache.reset()
    assert not any(isinstance(layer, StaticFullLayer) for layer in cache.layers)
    again = run_steps(model, prompt_ids(150, seed=5), cache, 20)
    fresh = run_steps(model, prompt_ids(150, seed=5), IceCache(cfg, model), 20)
    torch.testing.assert_close(again, fresh, rtol=1e-5, atol=1e-5)


def test_step_graph_off_where_it_cannot_serve():
    """On by default; sliding-window models, fresh selection, CUDA graphs off, the option off
    and the CPU leave it off, each saying so (the device is checked last, so each option's own
    reason shows on the CPU too)."""
    assert IceCacheConfig().step_graph
    model = tiny_model("llama")
    cases = [
        (IceCache(_config(), tiny_model("gemma3")), "sliding-window"),
        (IceCache(_config(lookahead=False), model), "lookahead=False"),
        (IceCache(_config(step_graph=False), model), "step_graph=False"),
        (IceCache(_config(cuda_graphs=False), model), "cuda_graphs=False"),
        (IceCache(_config(), model), "the device is cpu"),
    ]
    for cache, reason in cases:
        assert not cache.step_graph.enabled
        assert reason in cache.step_graph.off_reason
