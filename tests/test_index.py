"""Tests of the Python API of ``icecache.DCIIndex`` (the Rust core through its PyO3 bindings).

Everything runs on random data made here (NumPy RNG and hypothesis), checked against a NumPy
float64 brute-force reference. Exact results are compared by *score*, not by id, so ties cannot
make a correct answer fail. The whole file is sized to run in well under 20 s on 2 cores.
"""

from __future__ import annotations

import icecache
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from icecache import DCIIndex

METRICS = ["ip", "l2"]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def clustered(rng, n, dim, *, n_clusters=24, intrinsic=8, nq=0, norm_spread=True):
    """Clustered keys (and queries from the same distribution), float32.

    Each cluster is a centre plus noise in a random ``intrinsic``-dimensional subspace plus a
    little isotropic noise, with per-point norm scaling (attention keys have uneven norms).
    """
    centres = rng.standard_normal((n_clusters, dim))
    bases = rng.standard_normal((n_clusters, intrinsic, dim)) / np.sqrt(dim) * 1.5

    def draw(m):
        lab = rng.integers(0, n_clusters, m)
        coef = rng.standard_normal((m, intrinsic))
        x = centres[lab] + np.einsum("mi,mid->md", coef, bases[lab])
        x += 0.05 * rng.standard_normal((m, dim))
        if norm_spread:
            x *= rng.uniform(0.6, 1.4, (m, 1))
        return x.astype(np.float32)

    keys = draw(n)
    if nq:
        return keys, draw(nq)
    return keys


def ref_scores(keys, queries, metric):
    """float64 score matrix [nq, n]: inner products, or squared L2 distances."""
    k = np.asarray(keys, dtype=np.float64)
    q = np.asarray(queries, dtype=np.float64)
    ip = q @ k.T
    if metric == "ip":
        return ip
    d = (q * q).sum(1)[:, None] + (k * k).sum(1)[None, :] - 2.0 * ip
    return np.maximum(d, 0.0)


def ref_topk_ids(keys, key_ids, queries, metric, k):
    s = ref_scores(keys, queries, metric)
    order = np.argsort(-s if metric == "ip" else s, axis=1, kind="stable")[:, :k]
    return np.asarray(key_ids)[order]


def tolerance(keys, queries, metric):
    """Per-query absolute tolerance for float32 arithmetic inside the library."""
    q = np.asarray(queries, dtype=np.float64)
    qn = np.linalg.norm(q, axis=1)
    kmax = float(np.linalg.norm(np.asarray(keys, dtype=np.float64), axis=1).max()) if len(keys) else 0.0
    if metric == "ip":
        return 2e-5 * qn * kmax + 1e-6
    return 2e-5 * (qn * qn + kmax * kmax) + 1e-6


def check_valid(ids, scores, keys, key_ids, queries, metric, k):
    """Shapes, dtypes, order, uniqueness, and that each returned score is the true score of
    the returned id. Returns the float64 reference score matrix."""
    queries = np.asarray(queries)
    nq = queries.shape[0]
    assert isinstance(ids, np.ndarray) and isinstance(scores, np.ndarray)
    assert ids.dtype == np.int64, ids.dtype
    assert scores.dtype == np.float32, scores.dtype
    assert ids.shape == (nq, k), ids.shape
    assert scores.shape == (nq, k), scores.shape
    assert np.all(np.isfinite(scores))
    # order up to float32 rounding here; strict order is tested in test_returned_scores_are_sorted
    step = np.diff(scores.astype(np.float64), axis=1) * (1 if metric == "l2" else -1)
    tol_o = tolerance(keys, queries, metric)
    assert np.all(step >= -tol_o[:, None]), f"{metric} scores are not in best-first order"
    key_ids = np.asarray(key_ids, dtype=np.int64)
    sorter = np.argsort(key_ids)
    pos = np.searchsorted(key_ids, ids, sorter=sorter)
    pos = np.clip(pos, 0, len(key_ids) - 1)
    rows = sorter[pos]
    assert np.all(key_ids[rows] == ids), "query returned ids that are not in the index"
    for r in range(nq):
        assert len(np.unique(ids[r])) == k, f"duplicate ids in row {r}: {ids[r]}"
    s = ref_scores(keys, queries, metric)
    tol = tolerance(keys, queries, metric)
    true = np.take_along_axis(s, rows, axis=1)
    err = np.abs(true - scores.astype(np.float64))
    assert np.all(err <= tol[:, None]), f"returned scores differ from true scores by {err.max()}"
    return s


def check_exact(ids, scores, keys, key_ids, queries, metric, k):
    """Exact top-k: valid, and the k returned scores equal the k best reference scores."""
    s = check_valid(ids, scores, keys, key_ids, queries, metric, k)
    best = -np.sort(-s, axis=1)[:, :k] if metric == "ip" else np.sort(s, axis=1)[:, :k]
    tol = tolerance(keys, queries, metric)
    err = np.abs(best - scores.astype(np.float64))
    bad = np.argwhere(err > tol[:, None])
    assert bad.size == 0, (
        f"exact top-{k} scores differ from brute force at {len(bad)} places, e.g. query {bad[0][0]} "
        f"rank {bad[0][1]}: got {scores[bad[0][0], bad[0][1]]}, want {best[bad[0][0], bad[0][1]]}"
    )


def recall(ids, ref_ids, k):
    hits = [len(np.intersect1d(a[:k], b[:k])) for a, b in zip(ids, ref_ids)]
    return float(np.mean(hits)) / k


def to_bf16(x):
    """float32 -> bfloat16 bits as uint16 (truncation), and the float32 those bits mean."""
    bits = (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    back = (bits.astype(np.uint32) << 16).view(np.float32)
    return bits, back


def snapshot(idx, queries, k=5):
    ids_a, sc_a = idx.query(queries, k)
    ids_e, sc_e = idx.query(queries, k, exact=True)
    return len(idx), ids_a.copy(), sc_a.copy(), ids_e.copy(), sc_e.copy()


def assert_unchanged(idx, queries, snap, k=5):
    now = snapshot(idx, queries, k)
    assert now[0] == snap[0], f"len changed from {snap[0]} to {now[0]} after a failed call"
    for a, b in zip(now[1:], snap[1:]):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------------------------
# basics
# --------------------------------------------------------------------------------------------


def test_module_surface():
    assert isinstance(icecache.__version__, str)
    assert issubclass(icecache.IndexFileError, ValueError)
    idx = DCIIndex(16)
    assert idx.dim == 16
    assert idx.metric == "ip"
    assert len(idx) == 0
    idx2 = DCIIndex(8, "l2", seed=1, threads=1, effort=2.0)
    assert idx2.metric == "l2" and idx2.dim == 8


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(dim=0), r"(?i)dim"),
        (dict(dim=4097), r"(?i)dim"),
        (dict(dim=8, metric="cosine"), r"(?i)metric"),
        (dict(dim=8, promotion=1.5), r"(?i)promotion"),
        (dict(dim=8, promotion=-0.1), r"(?i)promotion"),
        (dict(dim=8, promotion=[0.1, float("nan")]), r"(?i)promotion"),
        (dict(dim=8, num_simple=0), r"(?i)num_simple|simple"),
        (dict(dim=8, num_composite=0), r"(?i)num_composite|composite"),
        (dict(dim=8, effort=0.0), r"(?i)effort"),
        (dict(dim=8, effort=float("nan")), r"(?i)effort"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, pattern):
    dim = kwargs.pop("dim")
    with pytest.raises(ValueError, match=pattern):
        DCIIndex(dim, **kwargs)


# --------------------------------------------------------------------------------------------
# exact queries == brute force
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", METRICS)
def test_exact_query_matches_numpy(metric):
    rng = np.random.default_rng(10)
    keys, queries = clustered(rng, 3000, 48, nq=64)
    idx = DCIIndex(48, metric, seed=0)
    ids = idx.add(keys)
    assert len(idx) == 3000
    for k in (1, 10, 100):
        got_ids, got_sc = idx.query(queries, k, exact=True)
        check_exact(got_ids, got_sc, keys, ids, queries, metric, k)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("exact", [True, False])
def test_returned_scores_are_sorted(metric, exact):
    """The returned scores are exactly in best-first order (descending ip, ascending l2)."""
    rng = np.random.default_rng(10)
    keys, queries = clustered(rng, 3000, 48, nq=64)
    idx = DCIIndex(48, metric, seed=0)
    idx.add(keys)
    _, sc = idx.query(queries, 100, exact=exact)
    step = np.diff(sc, axis=1) * (1 if metric == "l2" else -1)
    bad = np.argwhere(step < 0)
    assert bad.size == 0, (
        f"{len(bad)} out-of-order score pairs, e.g. query {bad[0][0]} ranks {bad[0][1]},{bad[0][1] + 1}: "
        f"{sc[bad[0][0], bad[0][1]]!r} then {sc[bad[0][0], bad[0][1] + 1]!r}"
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 200),
    dim=st.integers(1, 40),
    nq=st.integers(1, 8),
    metric=st.sampled_from(METRICS),
    integer_valued=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_exact_query_matches_numpy_hypothesis(n, dim, nq, metric, integer_valued, seed, data):
    """Random shapes; integer-valued keys make many exact ties and duplicate keys."""
    rng = np.random.default_rng(seed)
    if integer_valued:
        keys = rng.integers(-2, 3, (n, dim)).astype(np.float32)
        queries = rng.integers(-2, 3, (nq, dim)).astype(np.float32)
    else:
        keys = (rng.standard_normal((n, dim)) * rng.uniform(0.1, 10)).astype(np.float32)
        queries = rng.standard_normal((nq, dim)).astype(np.float32)
    k = data.draw(st.integers(1, n), label="k")
    idx = DCIIndex(dim, metric, seed=seed % 1000, threads=1)
    ids = idx.add(keys)
    got_ids, got_sc = idx.query(queries, k, exact=True)
    check_exact(got_ids, got_sc, keys, ids, queries, metric, k)
    # The approximate answer must at least be made of valid, distinct ids with true scores.
    a_ids, a_sc = idx.query(queries, k)
    check_valid(a_ids, a_sc, keys, ids, queries, metric, k)


# --------------------------------------------------------------------------------------------
# approximate recall
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", METRICS)
def test_default_recall_on_clustered_data(metric):
    rng = np.random.default_rng(20)
    keys, queries = clustered(rng, 5000, 64, nq=200)
    idx = DCIIndex(64, metric, seed=1)
    ids = idx.add(keys)
    got_ids, got_sc = idx.query(queries, 10)
    check_valid(got_ids, got_sc, keys, ids, queries, metric, 10)
    r = recall(got_ids, ref_topk_ids(keys, ids, queries, metric, 10), 10)
    assert r >= 0.9, f"recall@10 with default settings is {r:.3f} (< 0.9), metric={metric}"


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("offset", [10.0, 30.0])
def test_recall_invariant_to_common_offset(metric, offset):
    """Shifting every key (and, for l2, every query) by one vector leaves the true top-k as it is
    (l2: distances unchanged; ip: q.(k+o) = q.k + q.o, the same shift for every key). The
    index should find them about as well as without the shift. The shift here is 8-25x the
    data's own spread (non-centred embeddings, e.g. all-positive descriptors, look like this)."""
    rng = np.random.default_rng(5)
    keys, queries = clustered(rng, 4000, 32, nq=200)
    o = (offset * rng.standard_normal(32)).astype(np.float32)
    keys = keys + o
    if metric == "l2":
        queries = queries + o
    idx = DCIIndex(32, metric, seed=0)
    ids = idx.add(keys)
    ref = ref_topk_ids(keys, ids, queries, metric, 10)
    check_exact(*idx.query(queries, 10, exact=True), keys, ids, queries, metric, 10)
    r = recall(idx.query(queries, 10)[0], ref, 10)
    r4 = recall(idx.query(queries, 10, effort=4.0)[0], ref, 10)
    assert r >= 0.9 and r4 >= 0.95, (
        f"recall@10 with a common offset of norm {np.linalg.norm(o):.0f}: {r:.3f} at effort 1, "
        f"{r4:.3f} at effort 4 (without the offset both are ~1.0), metric={metric}"
    )


def test_recall_grows_with_effort():
    rng = np.random.default_rng(21)
    keys, queries = clustered(rng, 4000, 32, nq=100)
    idx = DCIIndex(32, "ip", seed=2)
    ids = idx.add(keys)
    ref = ref_topk_ids(keys, ids, queries, "ip", 10)
    r_lo = recall(idx.query(queries, 10, effort=0.25)[0], ref, 10)
    r_hi = recall(idx.query(queries, 10, effort=4.0)[0], ref, 10)
    assert r_hi >= r_lo - 0.02, f"recall fell when effort grew: {r_lo:.3f} -> {r_hi:.3f}"
    assert r_hi >= 0.95, f"recall@10 at effort 4 is only {r_hi:.3f}"


def test_every_key_finds_itself_l2():
    rng = np.random.default_rng(30)
    keys = clustered(rng, 2000, 32)
    idx = DCIIndex(32, "l2", seed=3)
    ids = idx.add(keys)
    got_ids, got_sc = idx.query(keys, 1, exact=True)
    missing = np.flatnonzero(got_ids[:, 0] != ids)
    assert missing.size == 0, f"{missing.size} keys not found by exact self-query, e.g. row {missing[:5]}"
    assert np.all(np.abs(got_sc[:, 0]) <= 1e-3 * (np.linalg.norm(keys, axis=1) ** 2 + 1))
    # approximate self-lookup should almost always succeed too
    a_ids, _ = idx.query(keys, 1)
    rate = float(np.mean(a_ids[:, 0] == ids))
    assert rate >= 0.95, f"approximate self-query finds only {rate:.3f} of the keys"


def test_zero_query_is_handled():
    """A zero query has all inner products 0: no NaN, valid distinct ids."""
    rng = np.random.default_rng(31)
    keys = rng.standard_normal((500, 16)).astype(np.float32)
    idx = DCIIndex(16, "ip", seed=0)
    ids = idx.add(keys)
    q = np.zeros((2, 16), np.float32)
    for exact in (False, True):
        got_ids, got_sc = idx.query(q, 10, exact=exact)
        check_valid(got_ids, got_sc, keys, ids, q, "ip", 10)
        assert np.all(got_sc == 0)


# --------------------------------------------------------------------------------------------
# remove
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", METRICS)
def test_removed_ids_never_returned(metric):
    rng = np.random.default_rng(40)
    keys, queries = clustered(rng, 3000, 32, nq=100)
    idx = DCIIndex(32, metric, seed=4)
    ids = idx.add(keys)
    gone = rng.choice(ids, 1200, replace=False)
    # remove in a few differently sized chunks (one id, a few, many)
    idx.remove(gone[:1])
    idx.remove(gone[1:10])
    idx.remove(gone[10:])
    assert len(idx) == 3000 - 1200
    keep = ~np.isin(ids, gone)
    live_keys, live_ids = keys[keep], ids[keep]
    # queries right at removed keys are the hardest case
    qs = np.concatenate([queries, keys[np.isin(ids, gone[:100])]])
    for exact in (False, True):
        got_ids, got_sc = idx.query(qs, 50, exact=exact)
        assert not np.isin(got_ids, gone).any(), f"removed ids returned (exact={exact})"
        check_valid(got_ids, got_sc, live_keys, live_ids, qs, metric, 50)
    got_ids, got_sc = idx.query(qs, 50, exact=True)
    check_exact(got_ids, got_sc, live_keys, live_ids, qs, metric, 50)
    a_ids, _ = idx.query(qs, 10)
    r = recall(a_ids, ref_topk_ids(live_keys, live_ids, qs, metric, 10), 10)
    assert r >= 0.9, f"recall@10 after removing 40% of the points is {r:.3f}"
    # k == len(idx) is still answerable
    got_ids, _ = idx.query(qs[:3], len(idx), exact=True)
    assert set(got_ids[0].tolist()) == set(live_ids.tolist())


def test_remove_everything_then_add_again():
    rng = np.random.default_rng(41)
    keys = rng.standard_normal((300, 8)).astype(np.float32)
    idx = DCIIndex(8, "l2", seed=5)
    ids = idx.add(keys)
    idx.remove(ids)
    assert len(idx) == 0
    with pytest.raises(ValueError, match=r"(?i)empty"):
        idx.query(keys[:1], 1)
    new_ids = idx.add(keys[:50])
    assert len(idx) == 50
    got_ids, got_sc = idx.query(keys[:50], 1, exact=True)
    np.testing.assert_array_equal(got_ids[:, 0], new_ids)


def test_removed_id_can_be_reused():
    rng = np.random.default_rng(42)
    keys = rng.standard_normal((200, 8)).astype(np.float32)
    idx = DCIIndex(8, "l2", seed=6)
    idx.add(keys, ids=np.arange(200, dtype=np.int64))
    idx.remove(np.array([7], dtype=np.int64))
    new_key = keys[7:8] + 100.0
    idx.add(new_key, ids=np.array([7], dtype=np.int64))
    assert len(idx) == 200
    got_ids, got_sc = idx.query(new_key, 1, exact=True)
    assert got_ids[0, 0] == 7 and abs(got_sc[0, 0]) < 1e-2


# --------------------------------------------------------------------------------------------
# incremental inserts
# --------------------------------------------------------------------------------------------


def test_inserts_after_larger_norm_keys_ip():
    """Keys whose norm exceeds everything seen so far change the transform's constant c; the
    index must stay exact in exact mode and keep a high recall in approximate mode."""
    rng = np.random.default_rng(50)
    dim = 32
    keys, queries = clustered(rng, 4000, dim, nq=150)
    idx = DCIIndex(dim, "ip", seed=7)
    all_ids = [idx.add(keys[:2500])]
    all_keys = [keys[:2500]]
    big_rows = []
    rest = keys[2500:]
    # interleave growing-norm keys with ordinary keys, in batches of different sizes
    pos = 0
    for scale, batch in ((3.0, 1), (10.0, 7), (30.0, 100), (100.0, 1392)):
        big = (rest[pos : pos + 1] / np.linalg.norm(rest[pos])) * scale * np.linalg.norm(keys, axis=1).max()
        big = big.astype(np.float32)
        big_rows.append(sum(len(a) for a in all_keys))
        all_ids.append(idx.add(big))
        all_keys.append(big)
        chunk = rest[pos + 1 : pos + 1 + batch]
        for i in range(0, len(chunk), max(1, batch // 3)):
            part = chunk[i : i + max(1, batch // 3)]
            all_ids.append(idx.add(part))
            all_keys.append(part)
        pos += 1 + batch
    K = np.concatenate(all_keys)
    ids = np.concatenate(all_ids)
    assert len(idx) == len(K) == len(np.unique(ids))

    got_ids, got_sc = idx.query(queries, 20, exact=True)
    check_exact(got_ids, got_sc, K, ids, queries, "ip", 20)

    a_ids, a_sc = idx.query(queries, 10)
    check_valid(a_ids, a_sc, K, ids, queries, "ip", 10)
    r = recall(a_ids, ref_topk_ids(K, ids, queries, "ip", 10), 10)
    assert r >= 0.9, f"recall@10 after inserting larger-norm keys is {r:.3f}"

    # queries along the big keys: the approximate top-1 is the true top-1 (a big key)
    qb = K[big_rows]
    b_ids, _ = idx.query(qb, 1)
    np.testing.assert_array_equal(b_ids[:, 0], ref_topk_ids(K, ids, qb, "ip", 1)[:, 0])

    # the ordinary keys inserted last are findable: recall on queries drawn from the last batch
    tail_q = K[-200:] + 0.01 * rng.standard_normal((200, dim)).astype(np.float32)
    t_ids, _ = idx.query(tail_q, 10)
    r_tail = recall(t_ids, ref_topk_ids(K, ids, tail_q, "ip", 10), 10)
    assert r_tail >= 0.9, f"recall@10 near the last-inserted keys is {r_tail:.3f}"


@pytest.mark.parametrize("metric", METRICS)
def test_incremental_build_recall(metric):
    """An index grown from one key by single and small-batch inserts answers as well as a bulk build."""
    rng = np.random.default_rng(51)
    dim = 32
    keys, queries = clustered(rng, 2500, dim, nq=100)
    idx = DCIIndex(dim, metric, seed=8)
    ids = [idx.add(keys[:1])]
    for i in range(1, 600):
        ids.append(idx.add(keys[i : i + 1]))
    for i in range(600, 2500, 50):
        ids.append(idx.add(keys[i : i + 50]))
    ids = np.concatenate(ids)
    assert len(idx) == 2500 and len(np.unique(ids)) == 2500
    got_ids, got_sc = idx.query(queries, 10, exact=True)
    check_exact(got_ids, got_sc, keys, ids, queries, metric, 10)
    a_ids, _ = idx.query(queries, 10)
    r = recall(a_ids, ref_topk_ids(keys, ids, queries, metric, 10), 10)
    assert r >= 0.9, f"recall@10 of an incrementally built index is {r:.3f} (metric={metric})"


# --------------------------------------------------------------------------------------------
# save / load
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", METRICS)
def test_save_load_identical(tmp_path, metric):
    rng = np.random.default_rng(60)
    keys, queries = clustered(rng, 3000, 32, nq=100)
    idx = DCIIndex(32, metric, seed=9, effort=0.7)
    ids = np.concatenate(
        [idx.add(keys[:2500], ids=np.arange(1000, 3500, dtype=np.int64)), idx.add(keys[2500:])]
    )  # bulk build, then an incremental part with fresh ids
    assert len(np.unique(ids)) == 3000
    idx.remove(ids[::7])
    before = [idx.query(queries, 10), idx.query(queries, 10, effort=2.0), idx.query(queries, 10, exact=True)]

    p = tmp_path / "index.icecache"
    idx.save(p)  # PathLike
    idx.save(str(tmp_path / "index2.icecache"))  # str
    for loaded in (DCIIndex.load(p), DCIIndex.load(str(tmp_path / "index2.icecache"), threads=1)):
        assert len(loaded) == len(idx)
        assert loaded.dim == idx.dim and loaded.metric == idx.metric
        assert loaded.stats()["levels"] == idx.stats()["levels"]
        after = [
            loaded.query(queries, 10),
            loaded.query(queries, 10, effort=2.0),
            loaded.query(queries, 10, exact=True),
        ]
        for (ai, asc), (bi, bsc) in zip(before, after):
            np.testing.assert_array_equal(ai, bi)
            np.testing.assert_array_equal(asc, bsc)

    # the loaded index keeps working: inserts and removes, still exact
    loaded = DCIIndex.load(p)
    extra = clustered(rng, 200, 32)
    new_ids = loaded.add(extra)
    assert not np.isin(new_ids, ids).any()
    live = ~np.isin(ids, ids[::7])
    K = np.concatenate([keys[live], extra])
    allids = np.concatenate([ids[live], new_ids])
    got_ids, got_sc = loaded.query(queries, 10, exact=True)
    check_exact(got_ids, got_sc, K, allids, queries, metric, 10)


def test_save_load_empty_and_tiny(tmp_path):
    idx = DCIIndex(4, "l2", seed=0)
    idx.save(tmp_path / "empty.bin")
    e = DCIIndex.load(tmp_path / "empty.bin")
    assert len(e) == 0 and e.dim == 4 and e.metric == "l2"
    e.add(np.ones((1, 4), np.float32), ids=np.array([42], np.int64))
    e.save(tmp_path / "one.bin")
    one = DCIIndex.load(tmp_path / "one.bin")
    ids, sc = one.query(np.zeros((1, 4), np.float32), 1)
    assert ids[0, 0] == 42 and sc[0, 0] == pytest.approx(4.0)


# --------------------------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_half_precision_keys_match_rounded_float32(metric, kind):
    rng = np.random.default_rng(70)
    keys, queries = clustered(rng, 2000, 32, nq=64)
    if kind == "float16":
        k_half, k_back = keys.astype(np.float16), keys.astype(np.float16).astype(np.float32)
        q_half, q_back = queries.astype(np.float16), queries.astype(np.float16).astype(np.float32)
    else:
        k_half, k_back = to_bf16(keys)
        q_half, q_back = to_bf16(queries)
    a = DCIIndex(32, metric, seed=11, threads=1)
    b = DCIIndex(32, metric, seed=11, threads=1)
    ids_a = a.add(k_half)
    ids_b = b.add(k_back)
    np.testing.assert_array_equal(ids_a, ids_b)
    # exact: same answer as the float32 index on the rounded values, and correct w.r.t. them
    ea = a.query(q_back, 10, exact=True)
    eb = b.query(q_back, 10, exact=True)
    check_exact(*ea, k_back, ids_a, q_back, metric, 10)
    np.testing.assert_allclose(ea[1], eb[1], rtol=1e-6, atol=1e-6)
    # half-precision queries behave like their rounded float32 values
    eh = a.query(q_half, 10, exact=True)
    np.testing.assert_allclose(eh[1], ea[1], rtol=1e-6, atol=1e-6)
    # approximate: same seed, same (rounded) values, one thread -> same answers
    aa = a.query(q_back, 10)
    ab = b.query(q_back, 10)
    np.testing.assert_array_equal(aa[0], ab[0])
    np.testing.assert_allclose(aa[1], ab[1], rtol=1e-6, atol=1e-6)
    # incremental inserts in half precision too
    more = clustered(rng, 100, 32)
    more_half = more.astype(np.float16) if kind == "float16" else to_bf16(more)[0]
    more_back = more.astype(np.float16).astype(np.float32) if kind == "float16" else to_bf16(more)[1]
    ids_more = a.add(more_half)
    K = np.concatenate([k_back, more_back])
    allids = np.concatenate([ids_a, ids_more])
    check_exact(*a.query(q_back, 10, exact=True), K, allids, q_back, metric, 10)


def test_same_seed_is_deterministic():
    rng = np.random.default_rng(71)
    keys, queries = clustered(rng, 2000, 32, nq=50)
    res = []
    for _ in range(2):
        idx = DCIIndex(32, "ip", seed=123, threads=1)
        idx.add(keys[:1500])
        idx.add(keys[1500:])
        res.append(idx.query(queries, 10))
    np.testing.assert_array_equal(res[0][0], res[1][0])
    np.testing.assert_array_equal(res[0][1], res[1][1])


def test_non_contiguous_inputs_are_accepted():
    rng = np.random.default_rng(72)
    big = rng.standard_normal((1000, 64)).astype(np.float32)
    keys = big[:, ::2]  # strided view, 32 columns
    assert not keys.flags.c_contiguous
    qbig = rng.standard_normal((20, 64)).astype(np.float32)
    queries = np.asfortranarray(qbig[:, 1::2])
    a = DCIIndex(32, "ip", seed=12, threads=1)
    b = DCIIndex(32, "ip", seed=12, threads=1)
    a.add(keys)
    b.add(np.ascontiguousarray(keys))
    for exact in (False, True):
        ra = a.query(queries, 10, exact=exact)
        rb = b.query(np.ascontiguousarray(queries), 10, exact=exact)
        np.testing.assert_array_equal(ra[0], rb[0])
        np.testing.assert_array_equal(ra[1], rb[1])
    # reversed rows (negative stride) too
    c = DCIIndex(32, "ip", seed=12, threads=1)
    ids_c = c.add(keys[::-1])
    check_exact(*c.query(queries, 10, exact=True), keys[::-1], ids_c, queries, "ip", 10)


# --------------------------------------------------------------------------------------------
# ids
# --------------------------------------------------------------------------------------------


def test_custom_ids_round_trip(tmp_path):
    rng = np.random.default_rng(80)
    keys, queries = clustered(rng, 1500, 16, nq=30)
    custom = rng.choice(np.int64(2) ** 62, size=1500, replace=False).astype(np.int64)
    idx = DCIIndex(16, "l2", seed=13)
    ret = idx.add(keys[:1000], ids=custom[:1000])
    assert ret.dtype == np.int64
    np.testing.assert_array_equal(ret, custom[:1000])
    ret2 = idx.add(keys[1000:], ids=custom[1000:])
    np.testing.assert_array_equal(ret2, custom[1000:])
    got_ids, got_sc = idx.query(keys[:300], 1, exact=True)
    np.testing.assert_array_equal(got_ids[:, 0], custom[:300])
    check_exact(*idx.query(queries, 10, exact=True), keys, custom, queries, "l2", 10)
    idx.remove(custom[5:10])
    assert not np.isin(idx.query(keys[5:10], 20, exact=True)[0], custom[5:10]).any()
    idx.save(tmp_path / "ids.bin")
    loaded = DCIIndex.load(tmp_path / "ids.bin")
    np.testing.assert_array_equal(loaded.query(keys[20:300], 1, exact=True)[0][:, 0], custom[20:300])


def test_auto_ids_are_unique_and_do_not_collide_with_custom_ids():
    rng = np.random.default_rng(81)
    keys = rng.standard_normal((900, 8)).astype(np.float32)
    idx = DCIIndex(8, "l2", seed=14)
    a = idx.add(keys[:300])
    assert a.dtype == np.int64 and a.shape == (300,)
    b = idx.add(keys[300:400], ids=np.arange(0, 1000, 10, dtype=np.int64) + int(a.max()) + 1)
    c = idx.add(keys[400:900])
    allids = np.concatenate([a, b, c])
    assert len(np.unique(allids)) == 900, "fresh ids collide with earlier ids"
    got_ids, _ = idx.query(keys, 1, exact=True)
    np.testing.assert_array_equal(got_ids[:, 0], allids)


def test_arraylike_inputs():
    """The API takes ArrayLike ids: Python lists of ints work for add and remove."""
    rng = np.random.default_rng(82)
    keys = rng.standard_normal((10, 4)).astype(np.float32)
    idx = DCIIndex(4, "l2", seed=0)
    ret = idx.add(keys, ids=list(range(100, 110)))
    np.testing.assert_array_equal(ret, np.arange(100, 110))
    idx.remove([100, 101])
    assert len(idx) == 8


# --------------------------------------------------------------------------------------------
# batch vs single
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", METRICS)
def test_batch_query_equals_per_row_query(metric, tmp_path):
    rng = np.random.default_rng(90)
    keys, queries = clustered(rng, 3000, 32, nq=40)
    idx = DCIIndex(32, metric, seed=15)
    idx.add(keys[:2800])
    idx.add(keys[2800:])
    for kwargs in (dict(), dict(effort=0.5), dict(effort=3.0), dict(exact=True)):
        b_ids, b_sc = idx.query(queries, 10, **kwargs)
        for r in range(len(queries)):
            s_ids, s_sc = idx.query(queries[r : r + 1], 10, **kwargs)
            np.testing.assert_array_equal(s_ids[0], b_ids[r], err_msg=f"row {r}, {kwargs}")
            # scores: equal up to float32 rounding (a batch may use a blocked kernel)
            tol = tolerance(keys, queries[r : r + 1], metric)[0]
            np.testing.assert_allclose(s_sc[0], b_sc[r], rtol=0, atol=tol, err_msg=f"row {r}, {kwargs}")
    # the number of threads answering a batch does not change the answer
    idx.save(tmp_path / "t.bin")
    r1 = DCIIndex.load(tmp_path / "t.bin", threads=1).query(queries, 10)
    r2 = DCIIndex.load(tmp_path / "t.bin", threads=2).query(queries, 10)
    np.testing.assert_array_equal(r1[0], r2[0])
    np.testing.assert_array_equal(r1[1], r2[1])


# --------------------------------------------------------------------------------------------
# stats
# --------------------------------------------------------------------------------------------


def test_stats_are_sane():
    rng = np.random.default_rng(100)
    keys = clustered(rng, 4000, 32)
    idx = DCIIndex(32, "ip", seed=16, promotion=[0.1, 0.2])
    empty = idx.stats()
    assert isinstance(empty, dict) and empty["len"] == 0
    idx.add(keys)
    st_ = idx.stats()
    assert st_["len"] == len(idx) == 4000
    levels = st_["levels"]
    assert isinstance(levels, list) and all(isinstance(c, int) for c in levels)
    assert 1 <= len(levels) <= 3, levels
    assert all(c >= 0 for c in levels), levels
    # node counts per level, either "level exactly l" (sums to len) or "on level l" (level 0 = len)
    if sum(levels) == 4000:
        at_least = np.cumsum(levels[::-1])[::-1].tolist()
    else:
        assert levels[0] == 4000, f"levels {levels} neither sum to len nor start with len"
        at_least = levels
    assert all(a >= b for a, b in zip(at_least, at_least[1:])), levels
    assert len(at_least) >= 2, f"no upper level with 4000 points and promotion 0.1: {levels}"
    # P(level >= 1) = 0.1: binomial(4000, 0.1) = 400 +- 19; P(level >= 2) = 0.02: 80 +- 9
    assert 300 <= at_least[1] <= 500, f"{at_least[1]} points at level >= 1, expected about 400"
    if len(at_least) >= 3:
        assert 30 <= at_least[2] <= 140, f"{at_least[2]} points at level >= 2, expected about 80"
    assert isinstance(st_["bytes"], int) and st_["bytes"] >= 4000 * 32 * 2, st_["bytes"]
    assert st_["bytes"] > empty["bytes"]
    idx.remove(idx.query(keys[:1], 100, exact=True)[0][0])
    st2 = idx.stats()
    assert st2["len"] == len(idx) == 3900
    lv2 = st2["levels"]
    assert (sum(lv2) == 3900) if sum(levels) == 4000 else (lv2[0] == 3900), lv2


# --------------------------------------------------------------------------------------------
# stateful: random interleavings of add / remove / query against a model
# --------------------------------------------------------------------------------------------


class IndexMachine(RuleBasedStateMachine):
    @initialize(metric=st.sampled_from(METRICS), seed=st.integers(0, 1000))
    def setup(self, metric, seed):
        self.dim = 6
        self.metric = metric
        self.rng = np.random.default_rng(seed)
        self.idx = DCIIndex(self.dim, metric, seed=seed, threads=1)
        self.model: dict[int, np.ndarray] = {}
        self.next_custom = 10**12

    @rule(n=st.integers(1, 40), custom=st.booleans())
    def add(self, n, custom):
        keys = self.rng.standard_normal((n, self.dim)).astype(np.float32)
        if custom:
            base = max([self.next_custom] + [i + 1 for i in self.model])
            ids = np.arange(base, base + n, dtype=np.int64)
            self.next_custom = base + n + 3
            ret = self.idx.add(keys, ids=ids)
            np.testing.assert_array_equal(ret, ids)
        else:
            ret = self.idx.add(keys)
        assert ret.shape == (n,)
        for i, k in zip(ret.tolist(), keys):
            assert i not in self.model, f"add returned an id already in use: {i}"
            self.model[i] = k

    @precondition(lambda self: len(self.model) > 0)
    @rule(frac=st.floats(0.05, 1.0))
    def remove(self, frac):
        live = np.array(sorted(self.model), dtype=np.int64)
        m = max(1, int(len(live) * frac))
        gone = self.rng.choice(live, m, replace=False)
        self.idx.remove(gone)
        for i in gone.tolist():
            del self.model[i]

    @precondition(lambda self: len(self.model) > 0)
    @rule(k=st.integers(1, 30))
    def query(self, k):
        k = min(k, len(self.model))
        ids = np.array(list(self.model), dtype=np.int64)
        keys = np.stack([self.model[i] for i in ids.tolist()])
        q = self.rng.standard_normal((3, self.dim)).astype(np.float32)
        check_exact(*self.idx.query(q, k, exact=True), keys, ids, q, self.metric, k)
        check_valid(*self.idx.query(q, k), keys, ids, q, self.metric, k)

    @invariant()
    def length(self):
        if hasattr(self, "idx"):
            assert len(self.idx) == len(self.model)
            assert self.idx.stats()["len"] == len(self.model)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)


# --------------------------------------------------------------------------------------------
# bad inputs: exception type, message, and the index is left unchanged
# --------------------------------------------------------------------------------------------

DIM = 16


@pytest.fixture
def small():
    rng = np.random.default_rng(200)
    keys = rng.standard_normal((400, DIM)).astype(np.float32)
    queries = rng.standard_normal((5, DIM)).astype(np.float32)
    idx = DCIIndex(DIM, "ip", seed=17)
    ids = idx.add(keys, ids=np.arange(400, dtype=np.int64))
    return idx, keys, queries, ids, snapshot(idx, queries)


def _bad_keys():
    rng = np.random.default_rng(201)
    ok = rng.standard_normal((5, DIM)).astype(np.float32)
    nan = ok.copy()
    nan[3, 2] = np.nan
    inf = ok.copy()
    inf[4, 0] = np.inf
    ninf = ok.copy()
    ninf[0, 1] = -np.inf
    f16_inf = ok.astype(np.float16)
    f16_inf[1, 1] = np.float16(np.inf)
    bf16_nan = to_bf16(nan)[0]
    return [
        ("wrong_dim", rng.standard_normal((5, DIM + 1)).astype(np.float32), r"(?i)dim|shape"),
        ("int32", rng.integers(0, 9, (5, DIM)).astype(np.int32), r"(?i)dtype|float32"),
        ("int64", rng.integers(0, 9, (5, DIM)).astype(np.int64), r"(?i)dtype|float32"),
        ("float64", ok.astype(np.float64), r"astype\(np\.float32\)"),
        ("one_d", ok[0], r"(?i)2-?d|two.dim|shape|dim"),
        ("three_d", ok[None], r"(?i)2-?d|two.dim|shape|dim"),
        ("nan", nan, r"(?i)nan|finite"),
        ("inf", inf, r"(?i)inf|finite"),
        ("neg_inf", ninf, r"(?i)inf|finite"),
        ("f16_inf", f16_inf, r"(?i)inf|finite"),
        ("bf16_nan", bf16_nan, r"(?i)nan|finite"),
    ]


@pytest.mark.parametrize("name, keys, pattern", _bad_keys(), ids=[c[0] for c in _bad_keys()])
def test_add_rejects_bad_keys(small, name, keys, pattern):
    idx, _, queries, _, snap = small
    with pytest.raises(ValueError, match=pattern):
        idx.add(keys)
    assert_unchanged(idx, queries, snap)
    # also with explicit ids, and into an empty index (the bulk-build path)
    if keys.ndim == 2:
        with pytest.raises(ValueError, match=pattern):
            idx.add(keys, ids=np.arange(10_000, 10_000 + len(keys), dtype=np.int64))
        assert_unchanged(idx, queries, snap)
    empty = DCIIndex(DIM, "ip", seed=0)
    with pytest.raises(ValueError, match=pattern):
        empty.add(keys)
    assert len(empty) == 0


def _bad_queries():
    rng = np.random.default_rng(202)
    ok = rng.standard_normal((3, DIM)).astype(np.float32)
    nan = ok.copy()
    nan[1, 1] = np.nan
    inf = ok.copy()
    inf[2, 3] = np.inf
    return [
        ("wrong_dim", rng.standard_normal((3, DIM - 1)).astype(np.float32), r"(?i)dim|shape"),
        ("int32", rng.integers(0, 9, (3, DIM)).astype(np.int32), r"(?i)dtype|float32"),
        ("float64", ok.astype(np.float64), r"astype\(np\.float32\)"),
        ("one_d", ok[0], r"(?i)2-?d|two.dim|shape|dim"),
        ("three_d", ok[None], r"(?i)2-?d|two.dim|shape|dim"),
        ("nan", nan, r"(?i)nan|finite"),
        ("inf", inf, r"(?i)inf|finite"),
    ]


@pytest.mark.parametrize("name, queries_bad, pattern", _bad_queries(), ids=[c[0] for c in _bad_queries()])
@pytest.mark.parametrize("exact", [False, True])
def test_query_rejects_bad_queries(small, name, queries_bad, pattern, exact):
    idx, _, queries, _, snap = small
    with pytest.raises(ValueError, match=pattern):
        idx.query(queries_bad, 5, exact=exact)
    assert_unchanged(idx, queries, snap)


@pytest.mark.parametrize("k", [0, -1])
def test_query_rejects_nonpositive_k(small, k):
    idx, _, queries, _, snap = small
    for exact in (False, True):
        with pytest.raises(ValueError, match=r"(?i)\bk\b"):
            idx.query(queries, k, exact=exact)
    assert_unchanged(idx, queries, snap)


def test_query_rejects_k_larger_than_len(small):
    idx, _, queries, _, snap = small
    for exact in (False, True):
        with pytest.raises(ValueError, match=r"(?i)\bk\b"):
            idx.query(queries, len(idx) + 1, exact=exact)
    assert_unchanged(idx, queries, snap)
    # k == len is fine
    got, _ = idx.query(queries, len(idx), exact=True)
    assert got.shape == (len(queries), len(idx))


@pytest.mark.parametrize("effort", [0.0, -1.0, float("nan"), float("inf")])
def test_query_rejects_bad_effort(small, effort):
    idx, _, queries, _, snap = small
    with pytest.raises(ValueError, match=r"(?i)effort"):
        idx.query(queries, 5, effort=effort)
    assert_unchanged(idx, queries, snap)


def test_query_on_empty_index_raises():
    idx = DCIIndex(DIM, "ip", seed=0)
    q = np.zeros((1, DIM), np.float32) + 1
    for exact in (False, True):
        with pytest.raises(ValueError, match=r"(?i)empty"):
            idx.query(q, 1, exact=exact)
    assert len(idx) == 0


def test_remove_unknown_id_raises_keyerror(small):
    idx, _, queries, _, snap = small
    with pytest.raises(KeyError, match=r"123456"):
        idx.remove(np.array([123456], dtype=np.int64))
    assert_unchanged(idx, queries, snap)
    # partly known: nothing at all is removed
    with pytest.raises(KeyError, match=r"999999"):
        idx.remove(np.array([1, 2, 999999, 3], dtype=np.int64))
    assert_unchanged(idx, queries, snap)
    # removing the same id twice: the second time it is unknown
    idx2 = DCIIndex(DIM, "ip", seed=0)
    idx2.add(np.ones((3, DIM), np.float32), ids=np.array([1, 2, 3], np.int64))
    idx2.remove(np.array([2], np.int64))
    with pytest.raises(KeyError, match=r"\b2\b"):
        idx2.remove(np.array([2], np.int64))
    assert len(idx2) == 2


def test_add_rejects_duplicate_ids_in_one_call(small):
    idx, keys, queries, _, snap = small
    dup = np.array([5000, 5001, 5000], dtype=np.int64)
    with pytest.raises(ValueError, match=r"(?i)duplicate|more than once"):
        idx.add(keys[:3], ids=dup)
    assert_unchanged(idx, queries, snap)
    empty = DCIIndex(DIM, "ip", seed=0)
    with pytest.raises(ValueError, match=r"(?i)duplicate|more than once"):
        empty.add(keys[:3], ids=dup)
    assert len(empty) == 0


def test_remove_rejects_repeated_id(small):
    idx, _, queries, _, snap = small
    with pytest.raises(ValueError, match=r"(?i)duplicate|more than once"):
        idx.remove(np.array([3, 4, 3], dtype=np.int64))
    assert_unchanged(idx, queries, snap)


def test_add_rejects_ids_already_in_index(small):
    idx, keys, queries, _, snap = small
    with pytest.raises(ValueError, match=r"(?i)duplicate|already"):
        idx.add(keys[:3], ids=np.array([7000, 7001, 17], dtype=np.int64))  # 17 exists
    assert_unchanged(idx, queries, snap)
    # none of the new ids in the failed call went in: adding them now works
    idx.add(keys[:2], ids=np.array([7000, 7001], dtype=np.int64))
    assert len(idx) == snap[0] + 2


@pytest.mark.parametrize("n_ids", [4, 6, 0])
def test_add_rejects_ids_length_mismatch(small, n_ids):
    idx, keys, queries, _, snap = small
    with pytest.raises(ValueError, match=r"(?i)ids|length|mismatch"):
        idx.add(keys[:5], ids=np.arange(9000, 9000 + n_ids, dtype=np.int64))
    assert_unchanged(idx, queries, snap)


def test_add_rejects_2d_ids(small):
    idx, keys, queries, _, snap = small
    with pytest.raises(ValueError, match=r"(?i)ids|1-?d|shape"):
        idx.add(keys[:4], ids=np.arange(9000, 9004, dtype=np.int64).reshape(2, 2))
    assert_unchanged(idx, queries, snap)


# ---- save files ----


@pytest.fixture
def saved(tmp_path, small):
    idx, keys, queries, ids, snap = small
    p = tmp_path / "good.icecache"
    idx.save(p)
    return p, p.read_bytes(), idx, queries, snap


def test_load_truncated_file(saved, tmp_path):
    p, data, idx, queries, snap = saved
    for cut in (0, 4, 16, len(data) // 2, len(data) - 1):
        bad = tmp_path / f"trunc{cut}.icecache"
        bad.write_bytes(data[:cut])
        with pytest.raises(
            icecache.IndexFileError, match=r"(?i)truncat|unexpected end|eof|too short|short|incomplete|corrupt"
        ):
            DCIIndex.load(bad)
    assert_unchanged(idx, queries, snap)
    # the original file still loads
    assert len(DCIIndex.load(p)) == len(idx)


@pytest.mark.parametrize("where", ["header", "middle", "end"])
def test_load_flipped_byte(saved, tmp_path, where):
    p, data, idx, queries, snap = saved
    pos = {"header": min(10, len(data) - 1), "middle": len(data) // 2, "end": len(data) - 1}[where]
    b = bytearray(data)
    b[pos] ^= 0x40
    bad = tmp_path / "flip.icecache"
    bad.write_bytes(bytes(b))
    with pytest.raises(icecache.IndexFileError, match=r"(?i)corrupt|checksum|crc|invalid|magic|version|truncat"):
        DCIIndex.load(bad)
    assert_unchanged(idx, queries, snap)


def test_load_wrong_magic(saved, tmp_path):
    p, data, idx, queries, snap = saved
    bad = tmp_path / "magic.icecache"
    bad.write_bytes(b"NOTANIDX" + data[8:])
    with pytest.raises(icecache.IndexFileError, match=r"(?i)magic|not an? icecache|format|signature"):
        DCIIndex.load(bad)
    other = tmp_path / "other.npy"
    np.save(other, np.zeros(100, np.float32))
    with pytest.raises(icecache.IndexFileError, match=r"(?i)magic|not an? icecache|format|signature"):
        DCIIndex.load(other)
    assert_unchanged(idx, queries, snap)


def test_load_wrong_version(saved, tmp_path):
    """Header layout (rust/index/persist.rs): magic[8] | version u32 LE | len u64 | crc u32 | payload."""
    p, data, idx, queries, snap = saved
    bad = tmp_path / "version.icecache"
    bad.write_bytes(data[:8] + (99).to_bytes(4, "little") + data[12:])
    with pytest.raises(icecache.IndexFileError, match=r"(?i)version"):
        DCIIndex.load(bad)
    assert_unchanged(idx, queries, snap)


def test_load_missing_file(tmp_path, small):
    idx, _, queries, _, snap = small
    missing = tmp_path / "does-not-exist.icecache"
    with pytest.raises(FileNotFoundError, match=r"(?i)does-not-exist|no such file|not found"):
        DCIIndex.load(missing)
    assert_unchanged(idx, queries, snap)


def test_save_to_missing_directory_raises_oserror(tmp_path, small):
    idx, _, queries, _, snap = small
    with pytest.raises(OSError):
        idx.save(tmp_path / "no" / "such" / "dir" / "x.icecache")
    assert_unchanged(idx, queries, snap)


def test_index_file_error_is_value_error(saved, tmp_path):
    p, data, *_ = saved
    bad = tmp_path / "t.icecache"
    bad.write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError):
        DCIIndex.load(bad)
