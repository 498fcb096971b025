#!/usr/bin/env python
"""Single-thread benchmark of ``icecache.DCIIndex`` against exact scans and hnswlib.

On the same keys and queries, in one run, it measures for each method / setting:

* build time (bulk build of all keys but the last ``--insert``),
* single-insert throughput (the last ``--insert`` keys added one call per key),
* single-query latency (one query per call; median and mean over the query set),
* batch throughput (all queries in one call),
* recall@10 and recall@k against the exact inner-product top-k (float64 NumPy).

Methods: DCIIndex at several ``effort`` values and in exact mode; a NumPy exact scan
(``q @ K.T`` + ``argpartition``); hnswlib (M=16, efConstruction=128) in raw inner-product space
and in the L2 space of the transform ``k -> [k/c, sqrt(1 - |k|^2/c^2)]``, ``q -> [q/|q|, 0]``,
at several ``ef`` values. Queries are answered on the full index (built + inserted keys).

Everything runs on one thread. The data sets are made by ``benches/data/make_keys.py``
(``~/.cache/icecache/bench/{smollm2_keys,synthetic_clustered}.npz``, arrays ``keys`` and
``queries``).

    python benches/bench_index.py --data all --k 100 --queries 1000 --out benches/out/

``--growth`` measures instead how an index grown by ``add`` compares with a bulk build of the
same keys: one ``add`` of all keys, an index grown from empty in batches of ``--growth-batch``
keys, and one grown one key per call. For each, at several efforts: single-query latency
(median; the three indexes are timed in turn, round after round, and each keeps its fastest
round) and recall@10. It reports the grown indexes' recall at the bulk build's latency at
effort 1 (interpolated over their efforts) and their latency at the same effort.
``--data clustered150k`` is the synthetic generator of ``make_keys.py`` at 150,000 keys of
dimension 64 (made in memory):

    python benches/bench_index.py --growth --data all --out benches/out/

``--calibrate`` measures ``effort="auto"`` instead: for every (layer, KV head) of SmolLM2 layers
``--calib-layers`` it builds an index of that head's keys over several documents (one kind of
text at a time: Jane Austen prose, and IceCache's own Rust and Python sources as code), lets
the first query batch (queries at the earlier half of the query positions) calibrate it for
recall@k 0.95, and measures recall@k and single-query latency on the held-back queries (the
later half of the positions), against single-threaded exact scans (the index's own and NumPy's;
the latency target compares with the faster). The captures are
cached in ``~/.cache/icecache/bench/calib_*.npz`` (one forward pass per document):

    python benches/bench_index.py --calibrate --out benches/out/
"""

from __future__ import annotations

import os

# One thread everywhere; must happen before NumPy (and its BLAS) is imported.
for _v in (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "RAYON_NUM_THREADS",
):
    os.environ[_v] = "1"

import argparse  # noqa: E402
import datetime as _dt  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # progress is optional

    def tqdm(it=None, **_kw):
        return it


DATA_DIR = Path(os.environ.get("ICECACHE_BENCH_DIR", "~/.cache/icecache/bench")).expanduser()
DATA_FILES = {"smollm2": "smollm2_keys.npz", "synthetic": "synthetic_clustered.npz"}
# Made in memory by make_keys.synthetic_clustered: (n, dim, clusters, queries).
GENERATED = {"clustered150k": (150_000, 64, 256, 1000)}
RECALL_TARGET = 0.95


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------


def run_header(title: str, argv) -> tuple[str, dict]:
    """A results section's heading with the machine, versions, command and date, and the same
    run facts (command, machine, versions) for its JSON."""
    m, v = machine_info(), versions()
    command = shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv)
    header = "\n".join(
        [
            f"## {title}",
            "",
            f"- machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), {m['platform']}",
            f"- versions: python {v['python']}, numpy {v['numpy']}, icecache {v['icecache']}",
            f"- command: `{command}`",
            f"- date: {_dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
        ]
    )
    return header, dict(command=command, machine=m, versions=v)


def save_results(out: Path, name: str, md: str, payload: dict) -> None:
    """Print ``md`` and save it with ``payload`` as JSON, as ``name-<timestamp>.{md,json}`` in ``out``."""
    print(md)
    out.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    jpath = out / f"{name}-{stamp}.json"
    jpath.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    (out / f"{name}-{stamp}.md").write_text(md if md.endswith("\n") else md + "\n")
    log(f"wrote {jpath}")


def as_f32(a: np.ndarray) -> np.ndarray:
    """float32 from float32 / float16 / bfloat16-as-uint16 (or float64) arrays."""
    if a.dtype == np.uint16:  # bf16 bits
        return (a.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(a, dtype=np.float32)


def generated_dataset(name: str, seed: int) -> dict:
    """A data set of ``GENERATED``, from the generator of ``benches/data/make_keys.py``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_keys", Path(__file__).parent / "data" / "make_keys.py")
    assert spec is not None and spec.loader is not None
    make_keys = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_keys)
    n, d, clusters, nq = GENERATED[name]
    data = make_keys.synthetic_clustered(n, d, clusters, nq, seed)
    return dict(
        name=name,
        path=f"make_keys.synthetic_clustered({n}, {d}, {clusters}, {nq}, seed={seed})",
        keys=data["keys"],
        queries=data["queries"],
        key_dtype_on_disk="float32 (in memory)",
        queries_in_file=nq,
    )


def load_dataset(name: str, n_queries: int | None, head: int) -> dict:
    path = DATA_DIR / DATA_FILES[name]
    if not path.exists():
        sys.exit(
            f"error: data set '{name}' not found at {path}\n"
            f"make it first with:  python benches/data/make_keys.py\n"
            f"(or point ICECACHE_BENCH_DIR at the folder holding {DATA_FILES[name]})"
        )
    with np.load(path, allow_pickle=False) as z:
        if "keys" not in z or "queries" not in z:
            sys.exit(f"error: {path} must hold arrays 'keys' and 'queries' (has {list(z.keys())})")
        keys, queries = z["keys"], z["queries"]
        orig_dtype = str(keys.dtype)
    if keys.ndim == 3:  # [heads, n, dim]: one head's index
        if queries.ndim != 3 or queries.shape[0] % keys.shape[0]:
            sys.exit(f"error: {path}: keys {keys.shape} and queries {queries.shape} do not match")
        group = queries.shape[0] // keys.shape[0]  # GQA: query heads per KV head
        keys = keys[head]
        queries = queries[head * group : (head + 1) * group].reshape(-1, queries.shape[-1])
    if keys.ndim != 2 or queries.ndim != 2 or keys.shape[1] != queries.shape[1]:
        sys.exit(f"error: {path}: expected keys [n, d] and queries [nq, d], got {keys.shape}, {queries.shape}")
    keys, queries = as_f32(keys), as_f32(queries)
    n_all_q = len(queries)
    if n_queries and n_queries < len(queries):
        # evenly spread over the file (queries often come in decode order)
        sel = np.linspace(0, len(queries) - 1, n_queries).round().astype(np.int64)
        queries = np.ascontiguousarray(queries[np.unique(sel)])
    return dict(
        name=name,
        path=str(path),
        keys=keys,
        queries=queries,
        key_dtype_on_disk=orig_dtype,
        queries_in_file=n_all_q,
    )


def exact_topk_ip(keys: np.ndarray, queries: np.ndarray, k: int, chunk: int = 64) -> np.ndarray:
    """Exact inner-product top-k ids (row numbers), float64, best first."""
    k64 = keys.astype(np.float64)
    out = np.empty((len(queries), k), np.int64)
    for i in tqdm(range(0, len(queries), chunk), desc="ground truth", leave=False, file=sys.stderr):
        s = queries[i : i + chunk].astype(np.float64) @ k64.T
        top = np.argpartition(-s, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(s, top, 1), axis=1, kind="stable")
        out[i : i + chunk] = np.take_along_axis(top, order, 1)
    return out


def recall_at(found: np.ndarray, truth: np.ndarray, r: int) -> float:
    r = min(r, truth.shape[1], found.shape[1])
    hits = 0
    for a, b in zip(found[:, :r], truth[:, :r]):
        hits += np.intersect1d(a, b, assume_unique=True).size
    return hits / (r * len(truth))


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


def time_single_queries(fn, queries: np.ndarray, desc: str) -> tuple[float, float]:
    """One query per call; (median, mean) latency in microseconds."""
    fn(queries[:1])  # warm up
    lat = np.empty(len(queries))
    pc = time.perf_counter_ns
    for i in tqdm(range(len(queries)), desc=desc, leave=False, file=sys.stderr, mininterval=0.5):
        q = queries[i : i + 1]
        t0 = pc()
        fn(q)
        lat[i] = pc() - t0
    return float(np.median(lat)) / 1e3, float(lat.mean()) / 1e3


def time_batch(fn, queries: np.ndarray, min_total_s: float = 0.3, max_reps: int = 20):
    """All queries in one call, repeated until ``min_total_s``; (queries/s of the median rep, result)."""
    res = fn(queries)
    times = []
    total = 0.0
    while len(times) < max_reps and (total < min_total_s or len(times) < 1):
        t0 = time.perf_counter()
        res = fn(queries)
        dt = time.perf_counter() - t0
        times.append(dt)
        total += dt
    return len(queries) / float(np.median(times)), res


def row(ds, method, setting, *, build_s, build_n, insert_per_s, n_insert, lat, qps, found, truth, k, **extra):
    return dict(
        data=ds["name"],
        method=method,
        setting=setting,
        build_s=build_s,
        build_n=build_n,
        insert_per_s=insert_per_s,
        n_insert=n_insert,
        query_us_median=lat[0],
        query_us_mean=lat[1],
        batch_qps=qps,
        recall_at_10=recall_at(found, truth, 10),
        recall_at_k=recall_at(found, truth, k),
        k=k,
        n_queries=len(truth),
        **extra,
    )


# ----------------------------------------------------------------------------------------------
# methods
# ----------------------------------------------------------------------------------------------


def bench_dci(ds, truth, args, n_build):
    import icecache

    keys, queries, k = ds["keys"], ds["queries"], args.k
    n, dim = keys.shape
    ids = np.arange(n, dtype=np.int64)
    idx = icecache.DCIIndex(dim, "ip", threads=1, seed=args.seed)
    log(f"[{ds['name']}] DCIIndex: bulk build of {n_build} keys")
    t0 = time.perf_counter()
    idx.add(keys[:n_build], ids=ids[:n_build])
    build_s = time.perf_counter() - t0
    ins = None
    if n_build < n:
        t0 = time.perf_counter()
        for i in tqdm(range(n_build, n), desc="DCI inserts", leave=False, file=sys.stderr, mininterval=0.5):
            idx.add(keys[i : i + 1], ids=ids[i : i + 1])
        ins = (n - n_build) / (time.perf_counter() - t0)
    assert len(idx) == n
    stats = idx.stats()
    common = dict(build_s=build_s, build_n=n_build, insert_per_s=ins, n_insert=n - n_build)
    extra = dict(index_bytes=stats.get("bytes"), levels=stats.get("levels"))
    rows = []
    for e in args.efforts:
        lat = time_single_queries(lambda q, e=e: idx.query(q, k, effort=e), queries, f"DCI effort={e}")
        qps, (found, _) = time_batch(lambda q, e=e: idx.query(q, k, effort=e), queries)
        rows.append(
            row(ds, "DCIIndex", f"effort={e:g}", lat=lat, qps=qps, found=found, truth=truth, k=k, **common, **extra)
        )
        log(
            f"  effort={e:g}: {lat[0]:.1f} µs, R@10 {rows[-1]['recall_at_10']:.3f}, R@{k} {rows[-1]['recall_at_k']:.3f}"
        )
    lat = time_single_queries(lambda q: idx.query(q, k, exact=True), queries, "DCI exact")
    qps, (found, _) = time_batch(lambda q: idx.query(q, k, exact=True), queries)
    rows.append(row(ds, "DCIIndex", "exact=True", lat=lat, qps=qps, found=found, truth=truth, k=k, **common, **extra))
    return rows


def bench_numpy(ds, truth, args):
    keys, queries, k = ds["keys"], ds["queries"], args.k

    def single(q):
        s = keys @ q[0]
        top = np.argpartition(s, len(s) - k)[-k:]
        return top[np.argsort(-s[top])]

    def batch(qs, chunk=256):
        out = np.empty((len(qs), k), np.int64)
        for i in range(0, len(qs), chunk):
            s = qs[i : i + chunk] @ keys.T
            top = np.argpartition(s, s.shape[1] - k, axis=1)[:, -k:]
            order = np.argsort(-np.take_along_axis(s, top, 1), axis=1)
            out[i : i + chunk] = np.take_along_axis(top, order, 1)
        return out

    log(f"[{ds['name']}] NumPy exact scan")
    lat = time_single_queries(single, queries, "numpy exact")
    qps, found = time_batch(batch, queries)
    return [
        row(
            ds,
            "numpy",
            "exact scan",
            build_s=0.0,
            build_n=len(keys),
            insert_per_s=None,
            n_insert=0,
            lat=lat,
            qps=qps,
            found=found,
            truth=truth,
            k=k,
        )
    ]


def bench_growth(ds, args) -> dict:
    """Bulk build vs grown indexes of the same keys (see the module docs); one data set."""
    import icecache

    keys, queries = ds["keys"], ds["queries"]
    n, dim = keys.shape
    truth = exact_topk_ip(keys, queries, 10)
    indexes, build_s = {}, {}
    batch = args.growth_batch
    for name, step in (("bulk", n), (f"batches of {batch}", batch), ("one key per call", 1)):
        idx = icecache.DCIIndex(dim, "ip", threads=1, seed=args.seed)
        log(f"[{ds['name']}] {name}")
        t0 = time.perf_counter()
        for i in tqdm(range(0, n, step), desc=name, leave=False, file=sys.stderr, mininterval=0.5):
            idx.add(keys[i : i + step])
        build_s[name] = time.perf_counter() - t0
        assert len(idx) == n
        indexes[name] = idx
    lat = {(name, e): math.inf for name in indexes for e in args.growth_efforts}
    for _ in range(args.growth_rounds):
        for e in args.growth_efforts:
            for name, idx in indexes.items():
                t = time_single_queries(lambda q, idx=idx, e=e: idx.query(q, 10, effort=e), queries, f"{name} {e}")
                lat[name, e] = min(lat[name, e], t[0])
    rec = {
        (name, e): recall_at(idx.query(queries, 10, effort=e)[0], truth, 10)
        for name, idx in indexes.items()
        for e in args.growth_efforts
    }
    bulk_lat, bulk_rec = lat["bulk", 1.0], rec["bulk", 1.0]
    summary = []
    for name in indexes:
        # Recall at the bulk build's latency at effort 1: linear in log latency between the
        # efforts that bracket it (the nearest end outside them).
        pts = sorted((math.log(lat[name, e]), rec[name, e]) for e in args.growth_efforts)
        x = math.log(bulk_lat)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        at_lat = float(np.interp(x, xs, ys))
        summary.append(
            dict(
                index=name,
                build_s=build_s[name],
                recall_at_effort_1=rec[name, 1.0],
                recall_at_bulk_latency=at_lat,
                recall_ratio_at_bulk_latency=at_lat / bulk_rec,
                latency_us_at_effort_1=lat[name, 1.0],
                latency_ratio_at_effort_1=lat[name, 1.0] / bulk_lat,
            )
        )
    curves = [
        dict(index=name, effort=e, latency_us=lat[name, e], recall_at_10=rec[name, e])
        for name in indexes
        for e in args.growth_efforts
    ]
    return dict(data=ds["name"], n=n, dim=dim, n_queries=len(queries), summary=summary, curves=curves)


def growth_markdown(results: list) -> str:
    out = []
    for r in results:
        out += [
            f"### {r['data']}: {r['n']} keys x {r['dim']}, {r['n_queries']} queries",
            "",
            "| index | add time s | R@10 effort 1 | µs effort 1 (x bulk) | R@10 at bulk's µs (x bulk) |",
            "|---|---|---|---|---|",
        ]
        for s in r["summary"]:
            out.append(
                f"| {s['index']} | {s['build_s']:.2f} | {s['recall_at_effort_1']:.3f} | "
                f"{s['latency_us_at_effort_1']:.1f} ({s['latency_ratio_at_effort_1']:.2f}x) | "
                f"{s['recall_at_bulk_latency']:.3f} ({s['recall_ratio_at_bulk_latency']:.3f}x) |"
            )
        out += ["", "| index | effort | µs | R@10 |", "|---|---|---|---|"]
        out += [
            f"| {c['index']} | {c['effort']:g} | {c['latency_us']:.1f} | {c['recall_at_10']:.3f} |" for c in r["curves"]
        ]
        out.append("")
    return "\n".join(out)


def l2_transform(keys, queries):
    """MIPS -> NN: keys [k/c, sqrt(1-|k|^2/c^2)], queries [q/|q|, 0]."""
    kn2 = np.einsum("ij,ij->i", keys, keys, dtype=np.float64)
    c = math.sqrt(float(kn2.max())) or 1.0
    tk = np.empty((len(keys), keys.shape[1] + 1), np.float32)
    tk[:, :-1] = keys / c
    tk[:, -1] = np.sqrt(np.maximum(0.0, 1.0 - kn2 / (c * c)))
    qn = np.linalg.norm(queries.astype(np.float64), axis=1, keepdims=True)
    tq = np.zeros((len(queries), queries.shape[1] + 1), np.float32)
    tq[:, :-1] = queries / np.where(qn > 0, qn, 1.0)
    return tk, tq, c


def bench_hnsw(ds, truth, args, n_build, space):
    import hnswlib

    k = args.k
    if space == "ip":
        keys, queries, name = ds["keys"], ds["queries"], "hnswlib-ip"
    else:
        keys, queries, _c = l2_transform(ds["keys"], ds["queries"])
        name = "hnswlib-l2T"
    n, dim = keys.shape
    ids = np.arange(n, dtype=np.int64)
    p = hnswlib.Index(space=space, dim=dim)
    p.init_index(max_elements=n, M=args.hnsw_m, ef_construction=args.hnsw_efc, random_seed=args.seed)
    p.set_num_threads(1)
    log(f"[{ds['name']}] {name}: build of {n_build} keys (M={args.hnsw_m}, efConstruction={args.hnsw_efc})")
    t0 = time.perf_counter()
    p.add_items(keys[:n_build], ids[:n_build], num_threads=1)
    build_s = time.perf_counter() - t0
    ins = None
    if n_build < n:
        t0 = time.perf_counter()
        for i in tqdm(range(n_build, n), desc=f"{name} inserts", leave=False, file=sys.stderr, mininterval=0.5):
            p.add_items(keys[i : i + 1], ids[i : i + 1], num_threads=1)
        ins = (n - n_build) / (time.perf_counter() - t0)
    assert p.get_current_count() == n
    common = dict(build_s=build_s, build_n=n_build, insert_per_s=ins, n_insert=n - n_build)
    rows = []
    for ef in args.efs:
        p.set_ef(max(ef, k))
        lat = time_single_queries(lambda q: p.knn_query(q, k=k, num_threads=1), queries, f"{name} ef={ef}")
        qps, (labels, _) = time_batch(lambda q: p.knn_query(q, k=k, num_threads=1), queries)
        found = labels.astype(np.int64)
        rows.append(
            row(
                ds,
                name,
                f"ef={max(ef, k)}",
                lat=lat,
                qps=qps,
                found=found,
                truth=truth,
                k=k,
                **common,
                M=args.hnsw_m,
                ef_construction=args.hnsw_efc,
            )
        )
        log(f"  ef={ef}: {lat[0]:.1f} µs, R@10 {rows[-1]['recall_at_10']:.3f}, R@{k} {rows[-1]['recall_at_k']:.3f}")
    return rows


# ----------------------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------------------


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return dict(cpu=cpu, cores=os.cpu_count(), usable_cores=usable, platform=platform.platform())


def versions() -> dict:
    import icecache

    def ver(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return dict(
        python=platform.python_version(),
        numpy=np.__version__,
        hnswlib=ver("hnswlib"),
        icecache=getattr(icecache, "__version__", None) or ver("icecache"),
    )


def blas_info() -> dict:
    info: dict = {}
    try:
        from threadpoolctl import threadpool_info

        info["threadpoolctl"] = threadpool_info()
    except Exception as e:  # not installed, or failed
        info["threadpoolctl"] = f"unavailable ({type(e).__name__})"
    try:
        cfg = np.show_config(mode="dicts")
        info["numpy_blas"] = cfg.get("Build Dependencies", {}).get("blas")
    except Exception:
        pass
    info["env"] = {
        v: os.environ.get(v)
        for v in (
            "OPENBLAS_CORETYPE",
            "OPENBLAS_L2_SIZE",
            "OPENBLAS_NUM_THREADS",
            "OMP_NUM_THREADS",
            "MKL_NUM_THREADS",
            "RAYON_NUM_THREADS",
        )
    }
    return info


def fmt(x, spec, none="–"):
    return none if x is None else format(x, spec)


def markdown_table(rows, k) -> str:
    head = (
        "| data | method | setting | build s | insert/s | query µs (median) | query µs (mean) | batch q/s "
        f"| R@10 | R@{k} |"
    )
    lines = [head, "|" + "|".join(["---"] * 10) + "|"]
    for r in rows:
        lines.append(
            "| {data} | {method} | {setting} | {b} | {i} | {qm} | {qa} | {bq} | {r10} | {rk} |".format(
                data=r["data"],
                method=r["method"],
                setting=r["setting"],
                b=fmt(r["build_s"], ".3f"),
                i=fmt(r["insert_per_s"], ",.0f"),
                qm=fmt(r["query_us_median"], ",.1f"),
                qa=fmt(r["query_us_mean"], ",.1f"),
                bq=fmt(r["batch_qps"], ",.0f"),
                r10=fmt(r["recall_at_10"], ".3f"),
                rk=fmt(r["recall_at_k"], ".3f"),
            )
        )
    return "\n".join(lines)


def targets(rows, k) -> tuple[dict, str]:
    """Per data set: best DCI latency at R@k >= 0.95 against exact scans and hnswlib; insert and
    build ratios against hnswlib."""
    out, text = {}, []
    for data in dict.fromkeys(r["data"] for r in rows):
        rs = [r for r in rows if r["data"] == data]
        dci = [r for r in rs if r["method"] == "DCIIndex" and r["setting"] != "exact=True"]
        dci_ok = [r for r in dci if r["recall_at_k"] >= RECALL_TARGET]
        hnsw = [r for r in rs if r["method"].startswith("hnswlib")]
        hnsw_ok = [r for r in hnsw if r["recall_at_k"] >= RECALL_TARGET]
        npx = next((r for r in rs if r["method"] == "numpy"), None)
        dcx = next((r for r in rs if r["method"] == "DCIIndex" and r["setting"] == "exact=True"), None)
        best = min(dci_ok, key=lambda r: r["query_us_median"], default=None)
        hbest = min(hnsw_ok, key=lambda r: r["query_us_median"], default=None)
        t = dict(recall_target=RECALL_TARGET, k=k)
        text.append(f"### targets: {data} (recall@{k} >= {RECALL_TARGET})")
        if best is None:
            top = max(dci, key=lambda r: r["recall_at_k"], default=None)
            text.append(
                f"- DCIIndex: no effort setting reaches recall@{k} >= {RECALL_TARGET}"
                + (f" (best: {top['recall_at_k']:.3f} at {top['setting']})" if top else "")
            )
        else:
            t["dci_best"] = dict(setting=best["setting"], us=best["query_us_median"], recall=best["recall_at_k"])
            text.append(
                f"- DCIIndex best latency: {best['query_us_median']:,.1f} µs ({best['setting']}, "
                f"R@{k} {best['recall_at_k']:.3f})"
            )
            for ref, label in ((npx, "NumPy exact scan"), (dcx, "DCIIndex exact scan")):
                if ref:
                    ratio = ref["query_us_median"] / best["query_us_median"]
                    t[f"speedup_vs_{'numpy' if ref is npx else 'dci'}_exact"] = ratio
                    text.append(
                        f"  - vs {label} ({ref['query_us_median']:,.1f} µs): speedup {ratio:.2f}×"
                        f" ({'DCI faster' if ratio > 1 else 'DCI slower'})"
                    )
            if hbest:
                ratio = best["query_us_median"] / hbest["query_us_median"]
                t["latency_ratio_vs_hnswlib"] = ratio
                t["hnswlib_best"] = dict(
                    method=hbest["method"],
                    setting=hbest["setting"],
                    us=hbest["query_us_median"],
                    recall=hbest["recall_at_k"],
                )
                text.append(
                    f"  - vs hnswlib best at the same recall ({hbest['method']} {hbest['setting']}, "
                    f"{hbest['query_us_median']:,.1f} µs): DCI/hnswlib latency = {ratio:.2f}"
                    f" ({'DCI faster' if ratio < 1 else 'hnswlib faster'})"
                )
            elif hnsw:
                text.append(f"  - hnswlib: no ef setting reaches recall@{k} >= {RECALL_TARGET}")
        d0 = dci[0] if dci else None
        for h in dict.fromkeys(r["method"] for r in hnsw):
            h0 = next(r for r in hnsw if r["method"] == h)
            if d0 and d0["insert_per_s"] and h0["insert_per_s"]:
                ratio = d0["insert_per_s"] / h0["insert_per_s"]
                t[f"insert_ratio_vs_{h}"] = ratio
                text.append(
                    f"- inserts: DCIIndex {d0['insert_per_s']:,.0f}/s vs {h} {h0['insert_per_s']:,.0f}/s: "
                    f"{ratio:.2f}× ({'DCI faster' if ratio > 1 else 'hnswlib faster'})"
                )
            if d0 and h0["build_s"]:
                ratio = d0["build_s"] / h0["build_s"]
                t[f"build_ratio_vs_{h}"] = ratio
                text.append(
                    f"- build: DCIIndex {d0['build_s']:.3f} s vs {h} {h0['build_s']:.3f} s: DCI/hnswlib = "
                    f"{ratio:.2f} ({'DCI faster' if ratio < 1 else 'hnswlib faster'})"
                )
        out[data] = t
    return out, "\n".join(text)


# ----------------------------------------------------------------------------------------------


def parse_floats(s):
    return [float(x) for x in s.split(",") if x.strip()]


def parse_ints(s):
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", choices=["smollm2", "synthetic", *GENERATED, "all"], default="all")
    ap.add_argument("--growth", action="store_true", help="grown indexes against a bulk build (module docs)")
    ap.add_argument("--calibrate", action="store_true", help='effort="auto" on every (layer, KV head) (module docs)')
    ap.add_argument("--calib-docs", default="prose:4,code:2", help="kinds of text and documents of each")
    ap.add_argument("--calib-tokens", type=int, default=7200, help="tokens per document")
    ap.add_argument("--calib-positions", type=int, default=64, help="query positions per document")
    ap.add_argument("--calib-layers", default="2-29", help="first-last layer")
    ap.add_argument("--growth-batch", type=int, default=1000, help="keys per add of the batch-grown index")
    ap.add_argument("--growth-efforts", type=parse_floats, default=[0.5, 0.75, 1.0, 1.5, 2.0, 3.0])
    ap.add_argument("--growth-rounds", type=int, default=3, help="timing rounds (each index keeps its fastest)")
    ap.add_argument("--k", type=int, default=100, help="neighbours per query (recall@k is reported)")
    ap.add_argument("--queries", type=int, default=None, help="use this many queries (default: all in the file)")
    ap.add_argument("--out", type=Path, default=Path("benches/out"), help="folder for the JSON (and .md) results")
    ap.add_argument("--insert", type=int, default=2000, help="keys inserted one at a time after the build")
    ap.add_argument("--efforts", type=parse_floats, default=[0.25, 0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--efs", type=parse_ints, default=[100, 150, 200, 300, 400, 600])
    ap.add_argument("--hnsw-m", type=int, default=16)
    ap.add_argument("--hnsw-efc", type=int, default=128)
    ap.add_argument("--head", type=int, default=0, help="KV head to use when the keys are [heads, n, d]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", default="", help="comma list of methods to skip: dci,numpy,hnsw-ip,hnsw-l2")
    args = ap.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    try:
        import icecache  # noqa: F401
    except ImportError as e:
        sys.exit(f"error: cannot import icecache ({e}); build it first (maturin develop --release)")
    if args.growth:
        return growth_main(args, argv)
    if args.calibrate:
        return calibrate_main(args, argv)
    if not skip >= {"hnsw-ip", "hnsw-l2"}:
        try:
            import hnswlib  # noqa: F401
        except ImportError:
            sys.exit("error: hnswlib is not installed (pip install 'hnswlib>=0.8'), or pass --skip hnsw-ip,hnsw-l2")

    names = ["smollm2", "synthetic"] if args.data == "all" else [args.data]
    datasets = [load_dataset(n, args.queries, args.head) for n in names]  # fail early if a file is missing

    meta = dict(
        date=_dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        command=shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv),
        machine=machine_info(),
        versions=versions(),
        blas=blas_info(),
        k=args.k,
        efforts=args.efforts,
        efs=args.efs,
        hnsw=dict(M=args.hnsw_m, ef_construction=args.hnsw_efc),
        threads=1,
        notes=[
            "All methods run on one thread. Queries are answered on the full index (bulk-built keys plus "
            "the keys inserted one at a time).",
            "hnswlib-l2T: keys/queries are transformed outside the timed region, with c = max |k| over all "
            "keys, inserted ones included (hnswlib is given c in advance).",
            "Ground truth: exact inner-product top-k in float64.",
        ],
        datasets=[],
    )
    rows = []
    for ds in datasets:
        keys, queries = ds["keys"], ds["queries"]
        n, dim = keys.shape
        k = args.k
        if not 1 <= k <= n:
            sys.exit(f"error: --k {k} must be in 1..{n} for {ds['name']}")
        n_ins = max(0, min(args.insert, n - max(k, 1)))
        n_build = n - n_ins
        meta["datasets"].append(
            dict(
                name=ds["name"],
                path=ds["path"],
                n=n,
                dim=dim,
                n_queries=len(queries),
                queries_in_file=ds["queries_in_file"],
                key_dtype_on_disk=ds["key_dtype_on_disk"],
                n_build=n_build,
                n_insert=n_ins,
            )
        )
        log(f"[{ds['name']}] {n} keys x {dim}, {len(queries)} queries, k={k}: exact ground truth")
        truth = exact_topk_ip(keys, queries, k)
        if "dci" not in skip:
            rows += bench_dci(ds, truth, args, n_build)
        if "numpy" not in skip:
            rows += bench_numpy(ds, truth, args)
        if "hnsw-ip" not in skip:
            rows += bench_hnsw(ds, truth, args, n_build, "ip")
        if "hnsw-l2" not in skip:
            rows += bench_hnsw(ds, truth, args, n_build, "l2")

    tgt, tgt_text = targets(rows, args.k)
    m, v = meta["machine"], meta["versions"]
    header = "\n".join(
        [
            "## DCIIndex benchmark (single thread)",
            "",
            f"- machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), {m['platform']}",
            f"- versions: python {v['python']}, numpy {v['numpy']}, hnswlib {v['hnswlib']}, icecache {v['icecache']}",
            f"- command: `{meta['command']}`",
            f"- date: {meta['date']}",
        ]
        + [
            f"- data {d['name']}: {d['n']} keys x {d['dim']} ({d['key_dtype_on_disk']} on disk), "
            f"{d['n_queries']} queries; build on {d['n_build']}, then {d['n_insert']} single inserts"
            for d in meta["datasets"]
        ]
    )
    md = "\n\n".join([header, markdown_table(rows, args.k), tgt_text]) + "\n"
    save_results(args.out, f"bench_index-{args.data}", md, dict(meta=meta, rows=rows, targets=tgt))


# ----------------------------------------------------------------------------------------------
# --calibrate: effort="auto" on every (layer, KV head)
# ----------------------------------------------------------------------------------------------


def code_text() -> tuple[str, list[str]]:
    """IceCache's own Rust and Python sources, concatenated in path order (the code documents)."""
    root = Path(__file__).resolve().parents[1]
    files = sorted([*root.glob("rust/**/*.rs"), *root.glob("python/icecache/**/*.py")])
    return "\n\n".join(f.read_text() for f in files), [str(f.relative_to(root)) for f in files]


def code_documents(tok, n_docs: int, tokens: int) -> list[list[int]]:
    """``n_docs`` documents of ``tokens`` tokens from disjoint equal slices of :func:`code_text`."""
    text, _ = code_text()
    ids = tok.encode(text)
    if len(ids) < n_docs * tokens:
        sys.exit(f"error: the sources give {len(ids)} tokens, fewer than {n_docs} x {tokens}")
    step = len(ids) // n_docs
    return [ids[i * step : i * step + tokens] for i in range(n_docs)]


def calib_capture(kind: str, n_docs: int, tokens: int, n_pos: int, layers: list[int], seed: int) -> dict:
    """Keys of ``layers`` (every KV head, sink left out) and queries at ``n_pos`` positions spread
    over the last quarter of each document; cached in ``DATA_DIR``."""
    path = DATA_DIR / f"calib_{kind}_{n_docs}x{tokens}_q{n_pos}_s{seed}.npz"
    if path.exists():
        with np.load(path, allow_pickle=False) as z:
            have = [int(x) for x in z["layers"]]
            if set(layers) <= set(have):  # a capture of more layers serves a subset
                rows = [have.index(layer) for layer in layers]
                return dict(
                    keys=z["keys"][rows],
                    queries=z["queries"][rows],
                    positions=z["positions"],
                    layers=np.asarray(layers),
                )
    import torch
    from icecache.capture import capture_qkv
    from icecache.models import load_model
    from icecache.texts import documents

    torch.set_num_threads(os.cpu_count() or 1)  # the capture is not what is timed
    model, tok = load_model("smollm2", dtype=torch.float32)
    docs = documents(tok, n_docs, tokens, seed=seed) if kind == "prose" else code_documents(tok, n_docs, tokens)
    pos = np.unique(np.linspace(tokens - tokens // 4, tokens - 1, n_pos).round().astype(np.int64))
    keys, queries = [], []
    for ids in tqdm(docs, desc=f"capture {kind}", file=sys.stderr):
        data = capture_qkv(model, ids, layers=layers)
        keys.append(np.stack([data[layer][1][:, 1:] for layer in layers]).astype(np.float16))
        queries.append(np.stack([data[layer][0][:, pos] for layer in layers]))
    out = dict(
        keys=np.concatenate(keys, axis=2),  # [L, H_kv, n_docs * (T - 1), D]
        queries=np.stack(queries, axis=2),  # [L, H_q, n_docs, n_pos, D]
        positions=pos,
        layers=np.asarray(layers),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **out)
    os.replace(tmp, path)
    return out


def bench_calibrated_set(keys, sample, held, k, seed) -> dict:
    """One (layer, KV head): ``effort="auto"`` calibrated by the ``sample`` batch, measured on
    ``held`` (recall@k, single-query latency) against the exact scan and effort 1."""
    import icecache

    idx = icecache.DCIIndex(keys.shape[1], "ip", threads=1, seed=seed, effort="auto")
    idx.add(keys)
    idx.query(sample, k)  # the first query batch calibrates
    cal = idx.calibration
    assert cal is not None and not idx.awaits_calibration
    truth = exact_topk_ip(keys, held, k)

    def numpy_exact(q):
        s = keys @ q[0]
        top = np.argpartition(s, len(s) - k)[-k:]
        return top[np.argsort(-s[top])]

    # Interleaved single-query timing: each method on each query in turn.
    fns = {
        "auto": lambda q: idx.query(q, k),
        "exact": lambda q: idx.query(q, k, exact=True),
        "numpy": numpy_exact,
        "effort1": lambda q: idx.query(q, k, effort=1.0),
    }
    lat: dict[str, list[float]] = {m: [] for m in fns}
    pc = time.perf_counter_ns
    for f in fns.values():
        f(held[:1])  # warm up
    for i in range(len(held)):
        q = held[i : i + 1]
        for m, f in fns.items():
            t0 = pc()
            f(q)
            lat[m].append((pc() - t0) / 1e3)
    found_auto, _ = idx.query(held, k)
    found_1, _ = idx.query(held, k, effort=1.0)
    return dict(
        effort=cal.effort,
        calib_recall=cal.recall,
        calib_stderr=cal.recall_stderr,
        reached=cal.reached,
        calib_s=cal.seconds,
        calib_evaluations=cal.evaluations,
        recall_auto=recall_at(found_auto, truth, k),
        recall_effort1=recall_at(found_1, truth, k),
        us_auto=float(np.median(lat["auto"])),
        us_exact=float(np.median(lat["exact"])),
        us_numpy=float(np.median(lat["numpy"])),
        us_effort1=float(np.median(lat["effort1"])),
    )


def calibrate_main(args, argv) -> None:
    """``--calibrate``: effort="auto" on every (layer, KV head) of SmolLM2 (see the module docs)."""
    lo, hi = (int(x) for x in args.calib_layers.split("-"))
    layers = list(range(lo, hi + 1))
    kinds = [(kind, int(n)) for kind, n in (part.split(":") for part in args.calib_docs.split(","))]
    rows = []
    for kind, n_docs in kinds:
        data = calib_capture(kind, n_docs, args.calib_tokens, args.calib_positions, layers, args.seed)
        keys_all, q_all = data["keys"], data["queries"]  # [L, H_kv, n, D], [L, H_q, docs, P, D]
        n_kv, n_q, n_pos = keys_all.shape[1], q_all.shape[1], q_all.shape[3]
        group = n_q // n_kv
        half = n_pos // 2
        for li, layer in enumerate(tqdm(layers, desc=f"{kind} layers", file=sys.stderr)):
            for h in range(n_kv):
                keys = np.ascontiguousarray(keys_all[li, h], dtype=np.float32)
                q = q_all[li, h * group : (h + 1) * group]  # [group, docs, P, D]
                # Earlier positions calibrate; later ones (every document, every query head) are held back.
                sample = np.ascontiguousarray(q[:, :, :half].reshape(-1, q.shape[-1]))
                held = np.ascontiguousarray(q[:, :, half:].reshape(-1, q.shape[-1]))
                r = bench_calibrated_set(keys, sample, held, args.k, args.seed)
                r.update(text=kind, layer=layer, kv_head=h, n_keys=len(keys), n_sample=len(sample), n_held=len(held))
                rows.append(r)
                log(
                    f"  {kind} L{layer} h{h}: effort {r['effort']:.2f}, held R@{args.k} {r['recall_auto']:.3f} "
                    f"(effort 1: {r['recall_effort1']:.3f}), {r['us_auto']:.0f} µs vs exact {r['us_exact']:.0f} µs "
                    f"(NumPy {r['us_numpy']:.0f} µs)"
                )
    title = f'DCIIndex effort="auto" on every (layer, KV head) of SmolLM2 layers {lo}-{hi} (single thread)'
    header, run = run_header(title, argv)
    md = "\n".join([header, "", calibrate_markdown(rows, args.k)])
    save_results(args.out, "bench_index-calibrate", md, dict(**run, rows=rows))


def calibrate_markdown(rows: list, k: int) -> str:
    """Spread over the sets, per kind of text and over all, and the targets."""

    def spread(xs) -> str:
        xs = np.asarray(xs, dtype=np.float64)
        return f"{xs.min():.3f} / {np.median(xs):.3f} / {xs.max():.3f}"

    lines = [
        f"| text | sets | keys per set | held-back R@{k} auto (min / median / max) "
        f"| R@{k} effort 1 (min / median / max) | effort chosen (min / median / max) "
        "| auto µs (median of sets) | exact scan µs: DCIIndex / NumPy (median of sets) "
        "| calibration s (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups = sorted({r["text"] for r in rows})
    for g in [*groups, "all"]:
        rs = [r for r in rows if g in ("all", r["text"])]
        lines.append(
            f"| {g} | {len(rs)} | {int(np.median([r['n_keys'] for r in rs]))} "
            f"| {spread([r['recall_auto'] for r in rs])} "
            f"| {spread([r['recall_effort1'] for r in rs])} | {spread([r['effort'] for r in rs])} "
            f"| {np.median([r['us_auto'] for r in rs]):.0f} "
            f"| {np.median([r['us_exact'] for r in rs]):.0f} / {np.median([r['us_numpy'] for r in rs]):.0f} "
            f"| {np.median([r['calib_s'] for r in rs]):.2f} |"
        )
    # Every set: the effort chosen and the held-back recall it gave.
    sets = sorted({(r["text"], r["kv_head"]) for r in rows})
    by = {(r["text"], r["kv_head"], r["layer"]): r for r in rows}
    lines += [
        "",
        "| layer | " + " | ".join(f"{t} h{h}" for t, h in sets) + " |",
        "|---|" + "---|" * len(sets),
    ]
    for layer in sorted({r["layer"] for r in rows}):
        cells = [by.get((t, h, layer)) for t, h in sets]
        lines.append(
            f"| {layer} | "
            + " | ".join("" if r is None else f"{r['effort']:.2f}: {r['recall_auto']:.3f}" for r in cells)
            + " |"
        )
    worst = sorted(rows, key=lambda r: r["recall_auto"])[:5]
    lines += [
        "",
        "Lowest held-back recall: "
        + ", ".join(
            f"{r['text']} L{r['layer']} h{r['kv_head']} {r['recall_auto']:.3f} (effort {r['effort']:.2f})"
            for r in worst
        ),
        "",
    ]
    below = [r for r in rows if r["recall_auto"] < RECALL_TARGET]
    # Against the faster of the two single-threaded exact scans (NumPy's, on these sets).
    auto = np.median([r["us_auto"] for r in rows])
    exact = min(np.median([r["us_exact"] for r in rows]), np.median([r["us_numpy"] for r in rows]))
    ratio = float(auto / exact)
    per_set = np.median([r["us_auto"] / min(r["us_exact"], r["us_numpy"]) for r in rows])
    lines.append(
        f"- target: held-back recall@{k} >= {RECALL_TARGET} on every set: "
        + ("**met**" if not below else f"**missed** on {len(below)} of {len(rows)} sets")
    )
    lines.append(
        f"- target: median auto latency <= 1/4 of the faster exact scan's: {auto:.0f} / {exact:.0f} µs = "
        f"{ratio:.3f} "
        + ("**met**" if ratio <= 0.25 else "**missed**")
        + f" (median of the per-set ratios: {per_set:.3f})"
    )
    return "\n".join(lines)


def growth_main(args, argv) -> None:
    """``--growth``: bulk build vs grown indexes on each data set; prints and saves the tables."""
    names = ["smollm2", "synthetic", *GENERATED] if args.data == "all" else [args.data]
    load = {n: (lambda n=n: generated_dataset(n, args.seed)) for n in GENERATED}
    files = [n for n in names if n not in GENERATED]
    loaded = {n: load_dataset(n, args.queries, args.head) for n in files}  # fail early if a file is missing
    results = [bench_growth(loaded[n] if n in loaded else load[n](), args) for n in names]
    header, run = run_header("DCIIndex grown by add vs a bulk build (single thread)", argv)
    md = "\n".join([header, "", growth_markdown(results)])
    save_results(args.out, f"bench_index-growth-{args.data}", md, dict(**run, results=results))


if __name__ == "__main__":
    main()
