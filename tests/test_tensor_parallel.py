"""IceCache under tensor parallelism: 2 CPU processes on gloo, against one process.

A small random-weight Llama (8 query / 4 KV heads) is split by transformers' tensor
parallelism (``DistributedConfig(tp_plan="auto")``), so each rank holds 2 KV heads and their
4 query heads, and runs its own IceCache. One spawn (a few seconds of imports per process)
serves every test; the single-process references run in the test process. Decode steps feed
fixed tokens (teacher forcing), so both sides see the same inputs whatever the logits.

- Budget >= context: the logits of both ranks equal the single-process full cache's.
- Small budget: each rank's page selections, every layer and step, equal the single-process
  IceCache's for that rank's heads. This needs identical keys on both sides; the row-parallel
  ``o_proj``/``down_proj`` add the ranks' partial sums in the all-reduce, which changes the
  rounding of every later layer's keys (~1e-7), and selections compare discrete choices. The
  selection model therefore has those two projections zeroed: each layer's keys and queries
  then come straight from the embeddings and are bit-identical in both runs.
- Heads that do not divide by the ranks raise before any work; threads split per host.
"""

import dataclasses
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
tp_config = pytest.importorskip("transformers.distributed")

from conftest import tiny_llama_config  # noqa: E402
from icecache._util import cache_keyword  # noqa: E402
from icecache.demo_tp import spawn_cpu  # noqa: E402
from icecache.runtime import HeadShard, IceCache, IceCacheConfig, kv_heads_per_rank  # noqa: E402
from icecache.runtime.layer import IceLayer  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

RANKS = 2
PROMPT = 300
STEPS = 20
# Each rank would leave the bridge at its own step: reproducible runs wait for the index.
EXACT = IceCacheConfig(budget=1024, full_layers=1, exact_until_indexed=False, page_format="native")  # exact
SMALL = IceCacheConfig(  # selects 12 of more pages, attends 3
    budget=96, full_layers=0, superset_pages=12, exact_until_indexed=False
)


def _config(kv_heads: int = 4) -> LlamaConfig:
    return tiny_llama_config(
        hidden_size=32 * kv_heads,
        num_hidden_layers=4,
        num_attention_heads=2 * kv_heads,
        num_key_value_heads=kv_heads,
    )


def _state(zero_rowwise: bool = False, kv_heads: int = 4) -> dict:
    """Seeded weights; ``zero_rowwise``: ``o_proj`` and ``down_proj`` zero (see the module
    docstring)."""
    torch.manual_seed(0)
    state = LlamaForCausalLM(_config(kv_heads)).state_dict()
    if zero_rowwise:
        state = {k: torch.zeros_like(v) if ("o_proj" in k or "down_proj" in k) else v for k, v in state.items()}
    return state


def _tokens() -> torch.Tensor:
    return torch.randint(1, 128, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))


def _selections(cache) -> dict:
    """The pages the host selected from this step's queries, of sequence 0 per selecting
    IceCache layer, ``[H_kv, M]`` (-1: none). The one place that reads the runtime's selection
    state."""
    return {
        layer.layer_idx: layer.jobs.lookahead.selected()[0]
        for layer in cache.layers
        if isinstance(layer, IceLayer) and layer.leader is None
    }


def _run(model, cache, record=None) -> tuple:
    """Prompt forward, then one forward per fixed token; returns ``(logits [1, STEPS+1, V],
    [record(cache) after each step])``."""
    tokens = _tokens()
    kw = cache_keyword(model)
    logits, records = [], []
    with torch.inference_mode():
        logits.append(model(tokens[:, :PROMPT], **{kw: cache}).logits[:, -1])
        for i in range(PROMPT, PROMPT + STEPS):
            logits.append(model(tokens[:, i : i + 1], **{kw: cache}).logits[:, -1])
            if record is not None:
                records.append(record(cache))
    return torch.stack(logits, 1), records


def _tp_model(state: dict, kv_heads: int = 4):
    return LlamaForCausalLM.from_pretrained(
        None,
        config=_config(kv_heads),
        state_dict=state,
        distributed_config=tp_config.DistributedConfig(tp_plan="auto", tp_size=RANKS),
    ).eval()


def _worker(out_dir: str) -> None:
    """One rank: the runs the tests check, saved to ``out_dir/rank{r}.pt``."""
    rank = dist.get_rank()
    res = {}
    model = _tp_model(_state())
    cache = IceCache(EXACT, model)
    res["exact_logits"], _ = _run(model, cache)
    res["exact_steps"] = cache.stats.layer_steps
    res["shard"] = dataclasses.asdict(cache.shard)
    res["threads"] = cache.runtime.config.threads
    model = _tp_model(_state(zero_rowwise=True))
    small = IceCache(SMALL, model)
    _, res["selections"] = _run(model, small, _selections)
    res["small_steps"] = small.stats.layer_steps
    try:
        IceCache(EXACT, _tp_model(_state(kv_heads=3), kv_heads=3))
        res["uneven_error"] = None
    except ValueError as exc:
        res["uneven_error"] = str(exc)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    spawn_cpu(_worker, RANKS, (str(out),), timeout=300)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(RANKS)]


def _single(zero_rowwise: bool = False):
    model = LlamaForCausalLM(_config())
    model.load_state_dict(_state(zero_rowwise))
    model.set_attn_implementation("sdpa")
    return model.eval()


def test_each_rank_holds_its_kv_heads_and_a_share_of_the_cores(ranks):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for r, res in enumerate(ranks):
        assert res["shard"] == dataclasses.asdict(HeadShard(rank=r, size=RANKS, first=2 * r, count=2))
        assert res["threads"] == max(1, cores // RANKS)


def test_budget_covering_context_equals_single_process_full_cache(ranks):
    """Tolerance: float32 with the same inputs; tensor parallelism adds the ranks' partial
    sums of ``o_proj``/``down_proj`` in the all-reduce and IceCache sums attention over sink,
    pages and window separately, which changes the rounding only (3.2e-7 here, logits up to
    0.9). Dropping pages (budget 256) moves them by 4e-2, a 10% error in the attention scale by
    5e-4."""
    model = _single()
    full, _ = _run(model, DynamicCache(config=model.config))
    for res in ranks:
        assert res["exact_steps"] == STEPS * 3  # the 3 layers after the full one decode with IceCache
        torch.testing.assert_close(res["exact_logits"], full, rtol=1e-5, atol=1e-5)
    # The lm_head's output is gathered: every rank has the whole logits.
    assert torch.equal(ranks[0]["exact_logits"], ranks[1]["exact_logits"])


def test_small_budget_selections_equal_single_process_for_each_rank_heads(ranks):
    model = _single(zero_rowwise=True)
    cache = IceCache(SMALL, model)
    _, reference = _run(model, cache, _selections)
    layers = sorted(reference[0])
    assert len(layers) == 4 and len(reference) == STEPS
    # A real selection: SMALL.selected_pages pages per head (the look-ahead superset) out of
    # more, changing with the query.
    width = SMALL.selected_pages
    assert all((sel >= 0).all() and sel.shape == (4, width) for step in reference for sel in step.values())
    assert len({step[layers[-1]].tobytes() for step in reference}) > 1
    for r, res in enumerate(ranks):
        assert res["small_steps"] == STEPS * len(layers)
        heads = slice(2 * r, 2 * r + 2)
        for step, (mine, theirs) in enumerate(zip(res["selections"], reference)):
            assert sorted(mine) == layers
            for layer in layers:
                np.testing.assert_array_equal(mine[layer], theirs[layer][heads], err_msg=f"rank {r} step {step}")


def test_kv_heads_that_do_not_divide_raise_before_any_work(ranks):
    for res in ranks:
        assert res["uneven_error"] is not None
        assert "3 KV heads" in res["uneven_error"] and "2 ranks" in res["uneven_error"]


def test_kv_heads_per_rank():
    assert kv_heads_per_rank(_config(4), 2) == 2
    assert kv_heads_per_rank(_config(4), 4) == 1
    with pytest.raises(ValueError, match="6 query / 3 KV heads, which do not divide by 2 ranks"):
        kv_heads_per_rank(_config(3), 2)
    with pytest.raises(ValueError, match="positive int"):
        kv_heads_per_rank(_config(4), 0)


def test_single_process_holds_every_head_with_the_config_as_given():
    cache = IceCache(EXACT, _single())
    assert cache.shard == HeadShard(rank=0, size=1, first=0, count=4)
    assert cache.runtime.config == EXACT
