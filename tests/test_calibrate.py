"""``DCIIndex.calibrate`` and ``effort="auto"``: the effort found reaches its target recall on
held-back real attention queries, bad input changes nothing, and the result is saved.

The real-data tests capture SmolLM2's post-RoPE keys and queries of one short prose document
(skipped when the GGUF is neither cached nor fetchable)."""

from __future__ import annotations

import numpy as np
import pytest
from icecache import Calibration, DCIIndex

K = 100


def exact_ids(keys: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    s = queries.astype(np.float64) @ keys.astype(np.float64).T
    return np.argpartition(-s, k - 1, axis=1)[:, :k]


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([np.intersect1d(a, b).size / truth.shape[1] for a, b in zip(found, truth)]))


@pytest.fixture(scope="module")
def smollm2_qk():
    """Keys ``[H_kv, T - 1, D]`` (sink left out) and queries ``[H_q, T, D]`` of layers 3 and 17
    of SmolLM2 on 3000 tokens of prose."""
    pytest.importorskip("torch")
    from icecache import models, texts
    from icecache.capture import capture_qkv

    try:
        models.fetch_gguf("smollm2")
    except RuntimeError as exc:
        pytest.skip(f"SmolLM2 GGUF neither cached nor fetchable: {exc}")
    model, tok = models.load_model("smollm2")
    ids = texts.documents(tok, 1, 3000, seed=5)[0]
    data = capture_qkv(model, ids, layers=[3, 17])
    return {layer: (q, k[:, 1:]) for layer, (q, k, _) in data.items()}


def split(q: np.ndarray, group: int, head: int, T: int):
    """Sample: the GQA group's queries at positions 2000..2499; held back: 2500..T-1."""
    g = q[head * group : (head + 1) * group]
    sample = g[:, 2000:2500:2].reshape(-1, g.shape[-1])
    held = g[:, 2500:T].reshape(-1, g.shape[-1])
    return np.ascontiguousarray(sample), np.ascontiguousarray(held)


@pytest.mark.parametrize("layer", [3, 17])
def test_calibration_reaches_target_on_held_back_real_queries(smollm2_qk, layer):
    q, k = smollm2_qk[layer]
    group = q.shape[0] // k.shape[0]
    for head in range(k.shape[0]):
        keys = np.ascontiguousarray(k[head])
        sample, held = split(q, group, head, q.shape[1])
        truth = exact_ids(keys, held, K)
        idx = DCIIndex(keys.shape[1], seed=0, threads=1)
        idx.add(keys)
        for target in (0.9, 0.95):
            cal = idx.calibrate(sample, K, target)
            assert isinstance(cal, Calibration)
            assert cal.reached and cal.k == K and cal.queries == len(sample)
            assert cal.recall - 2 * cal.recall_stderr >= target - 1e-9
            assert idx.stats()["effort"] == pytest.approx(cal.effort)
            found, _ = idx.query(held, K)  # the default effort is now the calibrated one
            held_recall = recall(found, truth)
            # Two standard errors of margin on the sample; the held-back queries are other
            # positions, so allow half a point of noise.
            assert held_recall >= target - 0.005, (layer, head, target, held_recall, cal)


def test_auto_effort_calibrates_on_first_query_batch(smollm2_qk):
    q, k = smollm2_qk[17]
    keys = np.ascontiguousarray(k[0])
    sample, held = split(q, q.shape[0] // k.shape[0], 0, q.shape[1])
    idx = DCIIndex(keys.shape[1], seed=0, threads=1, effort="auto")
    idx.add(keys)
    assert idx.awaits_calibration and idx.calibration is None
    idx.query(sample[:3], K, effort=1.0)  # an explicit effort does not calibrate
    idx.query(sample[:3], K, exact=True)  # nor does an exact scan
    assert idx.awaits_calibration
    with pytest.raises(ValueError):
        idx.query(sample, len(keys) + 1)  # a failed first query leaves it waiting
    assert idx.awaits_calibration
    ids, _ = idx.query(sample, K)
    cal = idx.calibration
    assert cal is not None and not idx.awaits_calibration
    assert cal.queries == min(len(sample), 256) and cal.k == K and cal.target_recall == 0.975
    assert cal.effort >= 1.0  # auto never searches less than the default
    # The first batch is answered at the calibrated effort.
    again, _ = idx.query(sample, K, effort=cal.effort)
    np.testing.assert_array_equal(ids, again)
    assert recall(idx.query(held, K)[0], exact_ids(keys, held, K)) >= 0.945
    # Later queries do not calibrate again.
    idx.query(held, K)
    later = idx.calibration
    assert later is not None and (later.seconds, later.effort) == (cal.seconds, cal.effort)


# ------------------------------------------------------------------ synthetic: input and state


@pytest.fixture
def built():
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((3000, 16)).astype(np.float32)
    queries = rng.standard_normal((50, 16)).astype(np.float32)
    idx = DCIIndex(16, seed=2, threads=1, effort=1.5)
    idx.add(keys)
    return idx, queries


def snapshot(idx, queries):
    return idx.stats()["effort"], idx.calibration, idx.query(queries[:5], 10)[0]


@pytest.mark.parametrize(
    "args, kwargs, error",
    [
        ((np.zeros((4, 15), np.float32), 10), {}, ValueError),  # shape
        ((np.zeros((0, 16), np.float32), 10), {}, ValueError),  # no queries
        ((np.full((2, 16), np.nan, np.float32), 10), {}, ValueError),
        ((np.zeros((2, 16), np.int32), 10), {}, (ValueError, TypeError)),  # dtype
        ((None, 0), {}, ValueError),
        ((None, 3001), {}, ValueError),
        ((None, 10, 0.0), {}, ValueError),
        ((None, 10, 1.5), {}, ValueError),
        ((None, 10, float("nan")), {}, ValueError),
        ((None, 10), dict(max_effort=0.5), ValueError),
        ((None, 10), dict(max_effort=float("inf")), ValueError),
        ((None, 10), dict(min_effort=0.0), ValueError),
        ((None, 10), dict(min_effort=1.5), ValueError),
    ],
)
def test_bad_input_raises_and_changes_nothing(built, args, kwargs, error):
    idx, queries = built
    before = snapshot(idx, queries)
    args = (queries if args[0] is None else args[0], *args[1:])
    with pytest.raises(error):
        idx.calibrate(*args, **kwargs)
    after = snapshot(idx, queries)
    assert after[0] == before[0] == 1.5 and after[1] is None
    np.testing.assert_array_equal(after[2], before[2])


def test_empty_index_and_bad_auto_word():
    with pytest.raises(ValueError, match="empty"):
        DCIIndex(8).calibrate(np.zeros((2, 8), np.float32), 1)
    with pytest.raises(ValueError, match="auto"):
        DCIIndex(8, effort="fast")  # type: ignore[arg-type]


def test_unreachable_target_is_reported_not_raised(built):
    idx, queries = built
    # max_effort 1 tries only effort 1: recall@200 of 1.0 is out of its reach on this data.
    cal = idx.calibrate(queries, 200, 1.0, max_effort=1.0)
    assert not cal.reached and cal.effort == 1.0 and cal.evaluations == 1 and cal.recall < 1.0
    assert idx.stats()["effort"] == 1.0
    cal = idx.calibrate(queries, 200, 1.0)
    assert cal.reached and cal.recall == 1.0


def test_calibration_and_pending_auto_are_saved(built, tmp_path):
    idx, queries = built
    cal = idx.calibrate(queries, 10, 0.9)
    idx.save(tmp_path / "a.idx")
    back = DCIIndex.load(tmp_path / "a.idx")
    assert back.stats()["effort"] == pytest.approx(cal.effort)
    got = back.calibration
    assert got is not None and (got.effort, got.recall, got.k, got.reached) == (cal.effort, cal.recall, 10, True)
    assert not back.awaits_calibration

    auto = DCIIndex(16, seed=2, effort="auto")
    auto.add(np.asarray(queries).repeat(4, axis=0) + np.arange(200, dtype=np.float32)[:, None])
    auto.save(tmp_path / "b.idx")
    back = DCIIndex.load(tmp_path / "b.idx")
    assert back.awaits_calibration and back.calibration is None
    back.query(queries, 10)
    assert not back.awaits_calibration and back.calibration is not None


def test_head_forest_calibrates_each_head_and_select_uses_it():
    from icecache import HeadForest

    rng = np.random.default_rng(4)
    h_kv, group, n, d = 2, 2, 3000, 16
    centres = 2 * rng.standard_normal((h_kv, 8, d)).astype(np.float32)
    keys = (centres[:, rng.integers(0, 8, n)] + rng.standard_normal((h_kv, n, d))).astype(np.float32)
    queries = np.repeat(keys[:, :64], group, axis=0) + 0.5 * rng.standard_normal((h_kv * group, 64, d))
    queries = queries.astype(np.float32)  # [H_q, 64, d]: query head j reads KV head j // group
    f = HeadForest(keys, seed=1, threads=1, effort=1.0)
    for bad in (
        dict(queries=queries[:3], k=50),  # 3 query heads for 2 KV heads
        dict(queries=queries[:, :, :8], k=50),  # dim
        dict(queries=queries[0], k=50),  # not [H_q, n, d]
        dict(queries=queries, k=n + 1),
        dict(queries=queries, k=50, target_recall=0.0),
        dict(queries=queries, k=50, min_effort=2.0),
    ):
        with pytest.raises(ValueError):
            f.calibrate(**bad)
        assert f.efforts == [1.0, 1.0]
    found = f.calibrate(queries, 50)
    assert [c.effort for c in found] == pytest.approx(f.efforts)
    assert all(c.reached and c.queries == group * 64 and c.k == 50 for c in found)
    for i in range(0, 64, 8):
        step = np.ascontiguousarray(queries[:, i])
        own, _ = f.select(step, 4)
        for head, c in enumerate(found):
            at, _ = f.select(step, 4, effort=c.effort)
            np.testing.assert_array_equal(own[head], at[head])


def test_lookahead_layer_selects_at_each_heads_own_effort():
    """``LookAheadLayer(effort=None)`` selects as ``HeadForest.select(effort=None)`` (each KV
    head at its own effort, here 3), not at effort 1; a given effort is still validated."""
    from conftest import lookahead_parts
    from icecache import HeadForest, ResidentPages, _core

    rng = np.random.default_rng(5)
    h_kv, group, n, d, ps, m = 2, 2, 3000, 16, 16, 4
    keys = rng.standard_normal((h_kv, n, d)).astype(np.float32)
    values = rng.standard_normal((h_kv, n, d)).astype(np.float32)
    f = HeadForest(keys, seed=1, threads=1, effort=3.0)
    assert f.efforts == [3.0, 3.0]
    parts = lookahead_parts(f, keys, values, query_heads=h_kv * group, page_size=ps, max_pages=m)
    queries = parts.queries
    args = (_core.LookAhead(1), *parts.lent)
    shape = dict(kv_heads=h_kv, page_size=ps, max_pages=m, scale=0.25)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="effort"):
            _core.LookAheadLayer(*args, **shape, effort=bad)
    with pytest.raises(TypeError, match="effort"):
        _core.LookAheadLayer(*args, **shape, effort=True)
    with pytest.raises(TypeError, match="scale"):
        _core.LookAheadLayer(*args, **{**shape, "scale": True})
    jobs = _core.LookAheadLayer(*args, **shape)  # effort=None: each head's own
    jobs.set_lane(0, parts.k_store, parts.v_store, forest=f, resident=ResidentPages(h_kv, 2 * m))
    differs = 0
    for _ in range(12):
        queries[0] = 2 * rng.standard_normal((h_kv * group, d))
        jobs.start([0])
        jobs.wait()
        got = jobs.selected()[0]
        own, _ = f.select(queries[0], m, scale=0.25)
        np.testing.assert_array_equal(got, own)
        at_one, _ = f.select(queries[0], m, scale=0.25, effort=1.0)
        differs += not np.array_equal(got, at_one)
    jobs.clear()
    assert differs > 0, "effort 3 and effort 1 select alike: the test cannot tell them apart"
