"""Tests of icecache.eval.recall (attention-mass recall evaluation) and the ``icecache`` CLI parser.

Everything runs offline on small synthetic Q/K/V (no model, no capture cache); the HeadForest
methods are skipped where the installed build has no ``icecache.HeadForest``.
"""

from __future__ import annotations

import math
import sys

import icecache
import numpy as np
import pytest
from icecache.eval import recall as R

needs_forest = pytest.mark.skipif(not hasattr(icecache, "HeadForest"), reason="icecache.HeadForest not built")

BASE = ["oracle", "quest", "streamingllm"]
FOREST = ["icecache", "icecache_ranked", "reference"]
#: Methods whose KV heads' page counts differ (the budget holds over a step's heads).
SHARED = ["icecache_adaptive"]
ALL_DIAG = list(R.DIAGNOSTIC_METHODS)


def synth_docs(seed=0, *, n_docs=2, T=320, H_kv=2, G=3, D=16, n_layers=2, nq=6):
    """Clustered keys (attention keys cluster) and queries aimed near a few clusters."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        layers = {}
        pos = np.unique(np.linspace(T - 40, T - 1, nq).round().astype(int))
        for layer in range(n_layers):
            centres = rng.standard_normal((H_kv, 12, D)) * 1.5
            lab = rng.integers(0, 12, (H_kv, T))
            k = np.take_along_axis(centres, lab[..., None], axis=1) + 0.5 * rng.standard_normal((H_kv, T, D))
            v = rng.standard_normal((H_kv, T, D))
            tgt = rng.integers(0, 12, (H_kv, G, len(pos)))
            q = np.take_along_axis(centres[:, None], tgt[..., None], axis=2) * 1.2
            q = q + 0.3 * rng.standard_normal(q.shape)
            layers[layer] = (
                q.reshape(H_kv * G, len(pos), D).astype(np.float32),
                k.astype(np.float16),
                v.astype(np.float16),
            )
        docs.append(R.DocQKV(positions=pos, layers=layers))
    return docs


def test_query_positions():
    p = R.query_positions(8000, 16, 0.05)
    assert len(p) == 16 and p[-1] == 7999 and p[0] == 7600
    assert np.all(np.diff(p) > 0)
    p = R.query_positions(100, 16, 0.05)  # span at least n_queries
    assert len(p) == 16 and p[0] == 84 and p[-1] == 99


def test_oracle_bounds_every_method():
    docs = synth_docs(1)
    res = R.evaluate_qkv(docs, budgets=[48, 64, 96, 160], methods=BASE + ["quest_pagemass"])
    o = res.recall[res.methods.index("oracle")]
    for m in res.methods:
        assert np.all(o >= res.recall[res.methods.index(m)] - 1e-9), m
        assert np.all(res.middle_recall[0] >= res.middle_recall[res.methods.index(m)] - 1e-9), m
    # more budget never hurts the oracle, and recall is a share
    assert np.all(np.diff(o, axis=0) >= -1e-9)
    assert np.all((res.recall >= 0) & (res.recall <= 1 + 1e-9))
    # the true-mass ranking of positional pages is the best positional ranking
    assert res.mean("quest_pagemass", 64) >= res.mean("quest", 64) - 1e-9


@needs_forest
def test_oracle_bounds_forest_methods():
    docs = synth_docs(2)
    res = R.evaluate_qkv(docs, budgets=[64, 96, 160], methods=["oracle"] + FOREST + ALL_DIAG)
    o = res.recall[0]
    for m in res.methods:
        assert np.all(o >= res.recall[res.methods.index(m)] - 1e-9), m
    # ranking a layout's pages by their true mass beats any other ranking of the same pages
    for b in res.budgets:
        assert res.mean("icecache_pagemass", b) >= res.mean("icecache", b) - 1e-9
        assert res.mean("icecache_pagemass", b) >= res.mean("icecache_maxkey", b) - 1e-9
        assert res.mean("reference_pagemass", b) >= res.mean("reference", b) - 1e-9


def test_streamingllm_hand_computed():
    # One KV head, two query heads, D = 4 (scale 1/2), context of 48 tokens, query at t = 47.
    T, D = 48, 4
    k = np.zeros((1, T, D))
    k[0, 20, 0] = math.log(3.0)  # head 0: weight 3 on token 20 (middle, dropped at B = 40)
    k[0, 30, 0] = math.log(2.0)  # head 0: weight 2 on token 30 (kept by the grown window)
    q = np.zeros((2, 1, D), np.float32)
    q[0, 0, 0] = 2.0  # logits = 2 * k[:, 0] * 0.5 = k[:, 0]
    q[1, 0, 1] = 2.0  # head 1: all logits 0 -> uniform
    v = np.random.default_rng(0).standard_normal((1, T, D))
    doc = R.DocQKV(positions=np.array([47]), layers={0: (q, k.astype(np.float32), v.astype(np.float32))})
    res = R.evaluate_qkv([doc], budgets=[40], methods=["streamingllm"])
    # B = 40: sink [0, 16) + the 24 most recent tokens [24, 48).
    z0 = 46 + 3 + 2
    head0 = (16 + 23 + 2) / z0
    head1 = 40 / 48
    assert res.recall[0, 0, 0, 0, 0] == pytest.approx((head0 + head1) / 2, abs=1e-6)
    # middle = [16, 32) (window [32, 48)); selected middle = [24, 32).
    mid0, sel0 = 14 + 3 + 2, 7 + 2
    mid1, sel1 = 16, 8
    assert res.middle_recall[0, 0, 0, 0, 0] == pytest.approx(
        (sel0 / z0 + sel1 / 48) / (mid0 / z0 + mid1 / 48), abs=1e-6
    )
    assert res.charged[0, 0, 0, 0, 0] == 40
    # output: renormalised softmax over the attended tokens
    w = np.exp(k[0, :, 0])
    att = np.r_[0:16, 24:48]
    errs = []
    for head_w in (w, np.ones(T)):
        p = head_w / head_w.sum()
        o_full = p @ v[0]
        ps = np.zeros(T)
        ps[att] = head_w[att]
        o_sel = (ps / ps.sum()) @ v[0]
        errs.append(np.linalg.norm(o_sel - o_full) / np.linalg.norm(o_full))
    assert res.output_error[0, 0, 0, 0, 0] == pytest.approx(np.mean(errs), rel=1e-5)


def _whole_middle_budget(docs, sink=16, window=16, page=16):
    n_mid = max(int(d.positions.max()) + 1 for d in docs) - sink - window
    return sink + window + page * n_mid  # enough even if every page held a single token


@pytest.mark.parametrize("with_forest", [False, pytest.param(True, marks=needs_forest)])
def test_whole_middle_budget_is_exact(with_forest):
    docs = synth_docs(3, n_docs=1, T=200, nq=3)
    B = _whole_middle_budget(docs)
    methods = BASE + ["quest_pagemass"] + (FOREST + SHARED + ALL_DIAG if with_forest else [])
    res = R.evaluate_qkv(docs, budgets=[B], methods=methods)
    for m in res.methods:
        i = res.methods.index(m)
        np.testing.assert_allclose(res.recall[i], 1.0, atol=1e-9, err_msg=m)
        np.testing.assert_allclose(res.middle_recall[i], 1.0, atol=1e-9, err_msg=m)
        assert np.max(res.output_error[i]) < 1e-9, m


@pytest.mark.parametrize("with_forest", [False, pytest.param(True, marks=needs_forest)])
def test_budget_accounting_never_exceeds(with_forest):
    docs = synth_docs(4, n_docs=1, T=300, nq=4)
    budgets = [32, 40, 47, 48, 63, 64, 100, 128, 200, 256]
    methods = BASE + ["quest_pagemass"] + (FOREST + SHARED + ALL_DIAG if with_forest else [])
    res = R.evaluate_qkv(docs, budgets=budgets, methods=methods)
    B = np.asarray(budgets)[None, :, None, None]
    assert np.all(res.charged.mean(3) <= B + 1e-9)
    fixed = [i for i, m in enumerate(res.methods) if m not in SHARED]
    assert np.all(res.charged[fixed] <= B[..., None])
    for m in res.methods:
        i = res.methods.index(m)
        for bi, b in enumerate(budgets):
            allowed = (b - 32) // 16
            if m in SHARED:  # [layer, KV head, query]: the heads' pages add up to the allowance
                assert np.all(res.pages[i, bi].sum(1) <= res.pages.shape[3] * allowed), m
                assert np.all(res.tokens[i, bi] <= 16 * res.pages[i, bi]), m
            elif m in ("oracle", "streamingllm"):
                assert np.all(res.tokens[i, bi] <= b - 32)
                assert np.all(np.isnan(res.pages[i, bi]))
            else:
                assert np.all(res.pages[i, bi] <= allowed), m
                assert np.all(res.tokens[i, bi] <= 16 * res.pages[i, bi]), m
                assert np.all(res.charged[i, bi] == 32 + 16 * res.pages[i, bi]), m
    # page methods fill their allowance when the middle has enough pages
    for m in ("quest", "quest_pagemass"):
        i = res.methods.index(m)
        assert np.all(res.pages[i, budgets.index(128)] == 6)


def test_summary_table_and_plot(tmp_path):
    docs = synth_docs(5, n_docs=1, n_layers=3, nq=3)
    res = R.evaluate_qkv(docs, budgets=[48, 64, 128], methods=BASE)
    md = res.save_table(tmp_path / "t.md").read_text()
    assert "floor((B - 16 - 16) / 16)" in md
    assert md.count("| 64 |") == 3 and "StreamingLLM" in md and "Quest" in md
    rows = res.summary()
    assert len(rows) == 9 and all(r["max_charged"] <= r["budget"] for r in rows)
    # worst 5% of (layer, head) pairs: 3 layers x 2 heads = 6 pairs -> the single worst pair
    per_pair = res.recall[1, 1].mean(-1).ravel()
    assert res.worst("quest", 64) == pytest.approx(per_pair.min())
    assert res.worst("quest", 64) <= res.mean("quest", 64)
    assert res.per_layer("quest", 64).shape == (3,)
    js = res.save_json(tmp_path / "r.json")
    assert js.stat().st_size > 100
    pytest.importorskip("matplotlib")
    png = res.save_plot(tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments():
    docs = synth_docs(6, n_docs=1, nq=2)
    with pytest.raises(ValueError):
        R.evaluate_qkv(docs, budgets=[16], methods=BASE)  # below sink + window
    with pytest.raises(ValueError):
        R.evaluate_qkv(docs, budgets=[64], methods=["nope"])
    bad = R.DocQKV(positions=np.array([5]), layers=docs[0].layers)
    with pytest.raises(ValueError):
        R.evaluate_qkv([bad], budgets=[64], methods=BASE)
    if not hasattr(icecache, "HeadForest"):
        with pytest.raises(RuntimeError):
            R.evaluate_qkv(docs, budgets=[64], methods=["icecache"])


def test_cli_parser():
    from icecache import cli

    p = cli.build_parser()
    a = p.parse_args(
        [
            "eval",
            "recall",
            "--docs",
            "1",
            "--tokens",
            "2000",
            "--budgets",
            "64",
            "128",
            "--layers",
            "2-4",
            "9",
            "--out",
            "x",
        ]
    )
    assert a.docs == 1 and a.tokens == 2000 and a.budgets == [64, 128] and a.out == "x"
    assert cli._layer_list(a.layers) == [2, 3, 4, 9]
    assert cli._layer_list(["2,5", "3"]) == [2, 3, 5]
    with pytest.raises(SystemExit):
        p.parse_args([])
    with pytest.raises(SystemExit):
        p.parse_args(["eval"])


def _fake_capture(monkeypatch):
    """``load_or_capture`` replaced by synthetic documents; returns the log of its calls."""
    calls = []

    def fake(*args, **kwargs):
        calls.append(args)
        return synth_docs(7, n_docs=1, nq=2)

    monkeypatch.setattr("icecache.eval.recall.evaluate.load_or_capture", fake)
    return calls


def test_cli_passes_the_kind_of_text(monkeypatch, tmp_path):
    from icecache import cli

    kinds = []

    def fake(*args, **kwargs):
        kinds.append(kwargs["kind"])
        return synth_docs(7, n_docs=1, nq=2)

    monkeypatch.setattr("icecache.eval.recall.evaluate.load_or_capture", fake)
    argv = ["eval", "recall", "--out", str(tmp_path), "--quiet", "--no-plot", "--budgets", "64", "--layers", "0"]
    assert cli.main(argv + ["--methods", *BASE, "--kind", "code"]) == 0
    assert cli.main(argv + ["--methods", *BASE]) == 0
    assert kinds == ["code", "prose"]
    with pytest.raises(ValueError, match="kind"):
        R.load_or_capture(1, 100, kind="poetry", cache_dir=tmp_path, progress=False)


@needs_forest
def test_adaptive_budgets_move_pages_between_heads():
    """``icecache_adaptive`` gives some heads more pages than the fixed share and others fewer,
    never more in all; ``icecache_ranked`` ranks the same superset with a fixed share."""
    docs = synth_docs(8, n_docs=1, T=400, H_kv=3, nq=4)
    res = R.evaluate_qkv(docs, budgets=[96], methods=["icecache_ranked", "icecache_adaptive"])
    fixed, shared = res.pages[0, 0], res.pages[1, 0]  # [layer, KV head, query]
    assert np.all(fixed == 4)
    assert np.all(shared.sum(1) <= 3 * 4) and shared.max() > 4 and shared.min() < 4


def test_missing_matplotlib_is_found_before_any_work(monkeypatch, tmp_path):
    """The library call fails before capturing anything; the CLI says up front that it skips
    the plot, then prints and saves the results."""
    from icecache import cli

    calls = _fake_capture(monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with pytest.raises(ImportError, match="matplotlib"):
        R.evaluate_recall(n_docs=1, budgets=[64], methods=BASE, layers=[0, 1], out_dir=tmp_path, plot=True)
    assert calls == []
    argv = ["eval", "recall", "--out", str(tmp_path), "--quiet", "--budgets", "64", "--layers", "0", "1"]
    assert cli.main(argv + ["--methods", *BASE]) == 0
    assert len(calls) == 1


def test_cli_prints_and_saves_results_before_the_plot(monkeypatch, tmp_path, capsys):
    from icecache import cli

    _fake_capture(monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = ["eval", "recall", "--out", str(tmp_path), "--quiet", "--budgets", "64", "--layers", "0", "1"]
    assert cli.main(argv + ["--methods", *BASE]) == 0
    out, err = capsys.readouterr()
    assert "matplotlib is not installed" in err and "recall_vs_budget.png is skipped" in err
    assert "| 64 |" in out and "recall.json" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recall.json", "recall_table.md"]

    # With plotting available (stubbed: CI has no matplotlib), the plot comes last.
    def fake_plot(self, path):
        path.write_bytes(b"png")
        return path

    monkeypatch.setattr("icecache.eval.recall.plotting_missing", lambda: None)
    monkeypatch.setattr(R.RecallResult, "save_plot", fake_plot)
    assert cli.main(argv + ["--methods", *BASE]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.index("| 64 |") < out.index("recall.json") < out.index("recall_vs_budget.png")
    assert (tmp_path / "recall_vs_budget.png").read_bytes() == b"png"
