"""Hostile arguments to the core's Python API: sizes far beyond what the data can need, ids and
counts outside their integer range, arrays passed twice, bools for sizes. Each raises a clean
``Exception`` subclass with a clear message (never an abort or a ``PanicException``, which is a
``BaseException``) or works correctly. Calls that could abort run in a subprocess."""

from __future__ import annotations

import icecache
import numpy as np
import pytest
from icecache import DCIIndex, HeadForest, ResidentPages
from isolated import isolated


def forest(n=300, heads=2, dim=16, page_size=8, seed=0):
    keys = np.random.default_rng(seed).random((heads, n, dim), dtype=np.float32)
    return HeadForest(keys, page_size=page_size, seed=seed), keys


# --------------------------------------------------------------------------------------------
# huge sizes: a clean MemoryError or ValueError, never an abort
# --------------------------------------------------------------------------------------------


def test_select_with_huge_max_pages_raises_memory_error():
    out = isolated(
        """
        f = HeadForest(np.random.rand(2, 300, 16).astype(np.float32), page_size=8)
        q = np.ones((4, 16), np.float32)
        attempt(lambda: f.select(q, max_pages=2**40))
        attempt(lambda: f.select(q, max_pages=2**62))
        pages, counts = attempt(lambda: f.select(q, max_pages=f.max_pages() + 3))
        print(pages.shape[1] == f.max_pages() + 3, bool((pages[:, counts.min():] < f.max_pages()).all()))
        """
    )
    assert out[0].startswith("MemoryError: ") and out[1].startswith("MemoryError: "), out
    assert out[2:] == ["OK", "True True"], out


def test_query_with_a_huge_result_raises_memory_error():
    """``nq * k`` results (k up to the index size) are allocated fallibly: 2**24 queries of the
    2**16 nearest keys ask for 12 TB."""
    out = isolated(
        """
        idx = DCIIndex(1, seed=0)
        idx.add(np.random.default_rng(0).standard_normal((2**16, 1), dtype=np.float32))
        q = np.ones((2**24, 1), np.float32)
        attempt(lambda: idx.query(q, 2**16))
        attempt(lambda: idx.query(q[:2], 3))
        """
    )
    assert out[0].startswith("MemoryError: ") and out[1] == "OK", out


def test_resident_pages_capacity_is_range_checked_and_costs_nothing_up_front():
    out = isolated(
        """
        import resource
        attempt(lambda: ResidentPages(2, 2**40))
        attempt(lambda: ResidentPages(1, 2**62))
        attempt(lambda: ResidentPages(1, -1))
        attempt(lambda: ResidentPages(2**40, 4))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        r = attempt(lambda: ResidentPages(2, 2**31 - 1))
        heads, pages, slots, table = r.plan(np.array([[7, 3], [1, -1]]), np.array([2, 1]))
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        print(grown_mb < 50, heads.tolist(), pages.tolist(), table.tolist())
        """
    )
    assert [o.split(":")[0] for o in out[:4]] == ["ValueError"] * 4, out
    assert "capacity" in out[0] and "capacity" in out[1], out
    assert out[4] == "OK", out
    assert out[5] == "True [0, 0, 1] [3, 7, 1] [[0, 1], [0, -1]]", out


def test_plan_with_far_page_ids_does_not_allocate_per_page():
    """One bogus page id used to size a dense page table: 3.4 GB for ids near 5e8."""
    out = isolated(
        """
        import resource
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        r = ResidentPages(2, 4)
        plan = attempt(lambda: r.plan(np.array([[500_000_000, -1], [400_000_000, -1]]), np.array([1, 1])))
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        print(grown_mb < 50, [a.tolist() for a in plan])
        # the pages stay resident: the same selection loads nothing
        print([a.tolist() for a in r.plan(np.array([[500_000_000, -1], [400_000_000, -1]]), np.array([1, 1]))])
        """
    )
    assert out[0] == "OK", out
    assert out[1] == "True [[0, 1], [500000000, 400000000], [0, 0], [[0, -1], [0, -1]]]", out
    assert out[2] == "[[], [], [], [[0, -1], [0, -1]]]", out


# --------------------------------------------------------------------------------------------
# panics: never a PanicException
# --------------------------------------------------------------------------------------------


def test_the_same_array_as_source_and_store_is_a_value_error():
    out = isolated(
        """
        f = HeadForest(np.random.rand(2, 300, 16).astype(np.float32), page_size=8)
        ks = np.zeros((2, f.max_pages() + 8, 8, 16), np.float32)
        vs = np.zeros_like(ks)
        attempt(lambda: f.write_pages(ks, vs, ks, vs))
        attempt(lambda: f.insert(ks, vs, ks, vs))
        attempt(lambda: f.write_pages(np.zeros((2, 300, 16), np.float32), np.zeros((2, 300, 16), np.float32), ks, ks))
        attempt(lambda: gather_pages(ks, vs, np.array([0]), np.array([0]), ks[0], vs[0]))
        print(len(f))
        """
    )
    assert all(o.startswith("ValueError: ") for o in out[:4]), out
    assert out[4] == "300", out


# --------------------------------------------------------------------------------------------
# ids and counts: range-checked, never cast
# --------------------------------------------------------------------------------------------


def test_plan_rejects_ids_and_counts_outside_int32_and_wrong_shapes():
    r = ResidentPages(1, 4)
    with pytest.raises(ValueError, match="page"):
        r.plan(np.array([[2**32 + 5]]), np.array([1]))
    with pytest.raises(ValueError, match="counts"):
        r.plan(np.array([[5]]), np.array([2**32 + 1]))
    with pytest.raises(ValueError, match="counts"):
        r.plan(np.array([[5]]), np.array([[1]]))
    with pytest.raises(ValueError, match="pages"):
        r.plan(np.array([5]), np.array([1]))
    with pytest.raises(ValueError, match="page"):
        r.invalidate(0, np.array([2**40]))
    with pytest.raises(ValueError, match="pages"):
        r.invalidate(0, np.array([[1]]))
    with pytest.raises((ValueError, TypeError), match="integer|int"):
        r.plan(np.array([[5.5]]), np.array([1]))
    # nothing changed: page 5 is not resident
    assert r.plan(np.array([[5]]), np.array([1]))[1].tolist() == [5]


def test_gather_pages_rejects_wrapping_ids_and_flattened_shapes():
    ks = np.arange(2 * 3 * 8 * 4, dtype=np.float32).reshape(2, 3, 8, 4)
    vs = ks + 1
    kt = np.zeros((2, 8, 4), np.float32)
    vt = np.zeros_like(kt)
    with pytest.raises(ValueError, match="page"):
        icecache.gather_pages(ks, vs, np.array([0]), np.array([2**32 + 1]), kt, vt)
    with pytest.raises(ValueError, match="head"):
        icecache.gather_pages(ks, vs, np.array([2**32]), np.array([1]), kt, vt)
    with pytest.raises(ValueError, match="heads"):
        icecache.gather_pages(ks, vs, np.array([[0, 1]]), np.array([1, 1]), kt, vt)
    with pytest.raises(ValueError, match="pages"):
        icecache.gather_pages(ks, vs, np.array([0, 1]), np.array([[1, 1]]), kt, vt)
    assert not kt.any()
    icecache.gather_pages(ks, vs, np.array([1, 0]), np.array([2, 1]), kt, vt)
    np.testing.assert_array_equal(kt, ks[[1, 0], [2, 1]])


def test_sizes_and_flags_reject_bools():
    with pytest.raises(TypeError, match="dim"):
        DCIIndex(True)
    with pytest.raises(TypeError, match="k"):
        idx = DCIIndex(4, seed=0)
        idx.add(np.ones((3, 4), np.float32))
        idx.query(np.ones((1, 4), np.float32), True)
    f, _ = forest()
    with pytest.raises(TypeError, match="max_pages"):
        f.select(np.ones((4, 16), np.float32), True)
    with pytest.raises(TypeError, match="page_size"):
        HeadForest(np.ones((1, 20, 8), np.float32), page_size=True)
    with pytest.raises(TypeError, match="capacity"):
        ResidentPages(1, True)


def test_effort_and_target_recall_reject_bools_and_none_by_name():
    x = np.random.default_rng(0).random((50, 4), dtype=np.float32)
    for make in (lambda: DCIIndex(4, effort=True), lambda: DCIIndex(4, effort=None)):
        with pytest.raises(TypeError, match="effort"):
            make()
    idx = DCIIndex(4, seed=0)
    idx.add(x)
    with pytest.raises(TypeError, match="effort"):
        idx.query(x[:2], 3, effort=True)
    with pytest.raises(TypeError, match="target_recall"):
        idx.calibrate(x[:8], 3, True)
    with pytest.raises(TypeError, match="max_effort"):
        idx.calibrate(x[:8], 3, max_effort=False)
    assert idx.calibration is None  # nothing changed
    f, keys = forest()
    with pytest.raises(TypeError, match="effort"):
        HeadForest(keys, page_size=8, effort=True)
    with pytest.raises(TypeError, match="effort"):
        f.select(np.ones((4, 16), np.float32), 3, effort=True)
    with pytest.raises(TypeError, match="scale"):
        f.select(np.ones((4, 16), np.float32), 3, scale=True)
    with pytest.raises(TypeError, match="target_recall"):
        f.calibrate(np.ones((4, 8, 16), np.float32), 3, True)
    # numbers still pass, ints included
    assert DCIIndex(4, effort=2).stats()["effort"] == 2.0
    assert idx.query(x[:2], 3, effort=1)[0].shape == (2, 3)


def test_threads_beyond_any_machine_is_a_value_error_naming_threads():
    for make in (
        lambda: DCIIndex(4, threads=10**6),
        lambda: HeadForest(np.ones((1, 20, 8), np.float32), threads=10**6),
    ):
        with pytest.raises(ValueError, match="threads"):
            make()
    with pytest.raises(ValueError, match="threads"):
        DCIIndex(4, threads=0)


def test_a_store_read_by_one_call_cannot_be_written_by_another_meanwhile():
    """The rule the docs state: an array a call writes may not be read or written by another
    running call (NumPy's borrow tracking), a ValueError that says so; reading calls share."""
    import threading

    f, keys = forest(n=3000, dim=64)
    ks = np.zeros((2, f.max_pages() + 400, 8, 64), np.float32)
    vs = np.zeros_like(ks)
    f.write_pages(keys, keys, ks, vs)
    heads = np.zeros(20000, np.int64)
    pages = np.arange(20000) % f.max_pages()
    kt = np.zeros((20000, 8, 64), np.float32)
    vt = np.zeros_like(kt)
    stop = threading.Event()
    readers_ok = []

    def read():
        while not stop.is_set():
            icecache.gather_pages(ks, vs, heads, pages, kt, vt)
            readers_ok.append(1)

    t = threading.Thread(target=read)
    t.start()
    errors = []
    try:
        new = np.random.default_rng(1).random((2, 1, 64), dtype=np.float32)
        for _ in range(200):
            try:
                f.insert(new, new, ks, vs)
            except ValueError as e:
                errors.append(str(e))
    finally:
        stop.set()
        t.join()
    assert readers_ok
    assert all("read or written by another running call" in e for e in errors), errors[:3]


# --------------------------------------------------------------------------------------------
# page stores: a forest's stores hold its own keys, and an 8-bit forest reads only its K store
# --------------------------------------------------------------------------------------------


def _stores(f, page_format, dtype=np.float32, extra=8):
    p = f.max_pages() + extra
    if page_format == "int8":
        shape = (f.num_heads, p, f.page_size * (f.dim + 4))
        return np.zeros(shape, np.uint8), np.zeros(shape, np.uint8)
    shape = (f.num_heads, p, f.page_size, f.dim)
    return np.zeros(shape, dtype), np.zeros(shape, dtype)


@pytest.mark.parametrize("page_format", ["native", "int8"])
def test_write_pages_takes_only_the_forests_keys_and_finite_ones(page_format):
    """``write_pages`` of keys other than those the forest was built on is a ``ValueError`` (with
    8-bit pages it would change what ``select`` scores), and so are NaN or infinite keys; the
    stores stay as they were. A layer that reuses the forest's page layout may write its own
    keys into its own stores once the forest's own were written."""
    keys = np.random.default_rng(1).standard_normal((2, 300, 16)).astype(np.float32)
    f = HeadForest(keys, page_size=8, page_format=page_format, seed=0)
    other = np.random.default_rng(2).standard_normal(keys.shape).astype(np.float32)
    ks, vs = _stores(f, page_format)
    with pytest.raises(ValueError, match="other keys than this forest was built on"):
        f.write_pages(other, other, ks, vs)
    for bad in (np.nan, np.inf, -np.inf):
        nan = keys.copy()
        nan[1, 7, 3] = bad
        with pytest.raises(ValueError, match="finite"):
            f.write_pages(nan, keys, ks, vs)
    assert not ks.any() and not vs.any(), "a failed write_pages changed the stores"
    f.write_pages(keys, keys, ks, vs)
    written = ks.copy(), vs.copy()
    with pytest.raises(ValueError, match="other keys than this forest was built on"):
        f.write_pages(other, other, ks, vs)  # over the forest's own pages
    np.testing.assert_array_equal(ks, written[0])
    np.testing.assert_array_equal(vs, written[1])
    # A reusing layer's own stores take its own (finite) keys in this layout.
    fk, fv = _stores(f, page_format)
    f.write_pages(other, other, fk, fv)
    nan = other.copy()
    nan[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        f.write_pages(nan, other, *_stores(f, page_format))
    # The forest still selects from its own pages, and inserts go there (or to a grown copy).
    grown = [np.concatenate([s, np.zeros_like(s)], axis=1) for s in (ks, vs)]
    new = np.random.default_rng(3).standard_normal((2, 5, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="does not hold this forest's pages"):
        f.insert(new, new, fk, fv)
    assert len(f) == 300
    f.insert(new, new, *grown)
    assert len(f) == 305
    # The inserted keys are the forest's keys now.
    both = np.concatenate([keys, new], axis=1)
    f.write_pages(both, both, *grown)
    pages, counts = f.select(both[:, 0].repeat(2, axis=0), 3, k_store=grown[0] if page_format == "int8" else None)
    assert (counts > 0).all()


def test_an_int8_forest_reads_only_the_k_store_it_was_written_to():
    """``select``, ``calibrate`` and ``insert`` of an 8-bit forest refuse a K store that does not
    hold its pages (another layer's, or a blank one), with a ``ValueError``; a copy of its own
    store is still its store."""
    keys = np.random.default_rng(4).standard_normal((2, 400, 16)).astype(np.float32)
    f = HeadForest(keys, page_size=8, page_format="int8", seed=0)
    ks, vs = _stores(f, "int8")
    f.write_pages(keys, keys, ks, vs)
    other = np.random.default_rng(5).standard_normal(keys.shape).astype(np.float32)
    fk, fv = _stores(f, "int8")
    f.write_pages(other, other, fk, fv)  # a reusing layer's stores, in this layout
    q = keys[:, 3].repeat(2, axis=0)
    want = f.select(q, 4, k_store=ks)
    for wrong in (fk, np.zeros_like(ks)):
        with pytest.raises(ValueError, match="does not hold this forest's pages"):
            f.select(q, 4, k_store=wrong)
        with pytest.raises(ValueError, match="does not hold this forest's pages"):
            f.calibrate(keys[:, :4].repeat(2, axis=0), 4, k_store=wrong)
        new = keys[:, :2].copy()
        with pytest.raises(ValueError, match="does not hold this forest's pages"):
            f.insert(new, new, wrong, np.zeros_like(wrong))
    assert len(f) == 400
    got = f.select(q, 4, k_store=ks.copy())
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
