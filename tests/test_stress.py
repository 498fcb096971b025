"""The lifecycle stress run (benches/bench_stress.py) at CI's size, on the CPU: generations
with a new IceCache each, earlier caches dropped and collected at random moments, forced
collections inside decode steps, batch 1 and 3, both ``exact_until_indexed`` settings, native
and 8-bit pages, another cache's prefill keeping the index worker busy, then one cache reused
through ``reset()``. No generation may raise, and repeated generations must agree. The GPU run
(CUDA graphs captured meanwhile) is recorded in benches/RESULTS.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

import bench_stress  # noqa: E402


def test_lifecycle_stress_on_the_cpu(tmp_path):
    code = bench_stress.main(
        [
            "--device", "cpu",
            "--contexts", "300", "520", "700",
            "--generations", "30",
            "--reset-generations", "12",
            "--steps", "6",
            "--gc-rate", "0.3",
            "--check-every", "3",
            "--busy-context", "600",
            "--every", "1000",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    report = (tmp_path / "stress.md").read_text()
    assert code == 0, report
    assert "| new | 30 | 0 |" in report and "| reset | 12 | 0 |" in report, report
