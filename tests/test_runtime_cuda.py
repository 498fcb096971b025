"""The IceCache runtime on a GPU: device sinks, windows and page pools, CPU page stores, pinned
double-buffered staging for the bulk host-to-device copy, the prefill pipeline's side stream.
Skipped without CUDA (CI has no GPU); run on a GPU machine with
``PYTHONPATH=python pytest tests/test_runtime_cuda.py``."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from icecache.runtime import IceCache, IceCacheConfig  # noqa: E402
from test_runtime import check_pools, ice_layers, prompt_ids, run_steps, tiny_model  # noqa: E402
from transformers import DynamicCache  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _padded_batch():
    ids = prompt_ids(300, seed=9, batch=2).cuda()
    mask = torch.ones_like(ids)
    mask[1, :100] = 0
    return ids, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_budget_covering_context_matches_full_cache(dtype):
    model = tiny_model("llama").cuda().to(dtype)
    ids, mask = _padded_batch()
    full = run_steps(model, ids, DynamicCache(config=model.config), 40, attention_mask=mask)
    ice = run_steps(model, ids, IceCache(IceCacheConfig(budget=1024, full_layers=1), model), 40, attention_mask=mask)
    if dtype == torch.float32:
        torch.testing.assert_close(ice, full, rtol=1e-3, atol=1e-3)
    else:  # bf16 rounding differs between kernels; the predictions must still agree
        assert (ice.argmax(-1) == full.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("reuse", [1, 2])
def test_cuda_pages_move_through_pinned_staging(reuse):
    model = tiny_model("llama").cuda().to(torch.bfloat16)
    ids, mask = _padded_batch()
    cache = IceCache(IceCacheConfig(budget=96, full_layers=1, reuse=reuse, pool_pages=4), model, track_recall=True)
    logits = run_steps(model, ids, cache, 100, attention_mask=mask)
    torch.cuda.synchronize()
    assert torch.isfinite(logits).all()
    layers = ice_layers(cache)
    assert all(layer.pool_k.is_cuda and layer.win_k.is_cuda for layer in layers)
    assert cache.runtime.staging.pin and cache.stats.pages_loaded > 0
    assert all(buf is None or buf.is_pinned() for buf in cache.runtime.staging._buffers)
    assert cache.runtime.transit.stream is not None
    assert check_pools(cache) > 0
    assert 0 < cache.stats.recall <= 1
