#!/usr/bin/env python
"""Forest build time of two builds of the extension, interleaved under the same load.

Each round runs one subprocess per build (``--old`` and ``--new``: directories that hold an
``icecache`` package, put first on ``PYTHONPATH``), in turn; each times ``--repeats`` builds of
one Llama-3.1-8B-shape layer (8 KV heads x 32k x 128, the clustered synthetic keys of
``bench_pages.py``) after a warm-up, per thread count. Reports the median over all rounds.
The machine may be shared: alternating the builds gives both the same load.

    python benches/bench_build_ab.py --old /tmp/old/python --new python [--rounds 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

CHILD = """
import json, sys, time
sys.path.insert(0, {benches!r})
import icecache
from bench_pages import clustered
keys = clustered(8, 32768, 128, 2)
out = {{}}
for threads in {threads!r}:
    icecache.HeadForest(keys, seed=0, threads=threads)
    times = []
    for _ in range({repeats}):
        t = time.perf_counter()
        icecache.HeadForest(keys, seed=0, threads=threads)
        times.append((time.perf_counter() - t) * 1e3)
    out[threads] = times
print(json.dumps(out))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    code = CHILD.format(benches=str(Path(__file__).resolve().parent), threads=threads, repeats=args.repeats)
    times: dict = {(b, t): [] for b in ("old", "new") for t in threads}
    for _ in range(args.rounds):
        for build in ("old", "new"):
            env = dict(os.environ, PYTHONPATH=str(getattr(args, build).resolve()))
            res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            for t, ts in json.loads(res.stdout).items():
                times[(build, int(t))].extend(ts)
    print("| threads | old ms (median) | new ms (median) | speedup | builds each |")
    print("|---|---|---|---|---|")
    for t in threads:
        old, new = np.median(times[("old", t)]), np.median(times[("new", t)])
        print(f"| {t} | {old:.0f} | {new:.0f} | {old / new:.2f}x | {len(times[('old', t)])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
