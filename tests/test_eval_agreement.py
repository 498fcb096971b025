"""Tests of icecache.eval.agreement (teacher-forced greedy agreement) on a tiny random Llama.

The emulated methods' masks are checked against selections recomputed here by brute force,
their attention against SDPA; whole runs must agree exactly where every method attends to the
whole context, and must not where the budget cuts it.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import VOCAB, tiny_llama  # noqa: E402
from icecache import cli  # noqa: E402
from icecache.eval import agreement as ag  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(num_hidden_layers=4, attn_implementation="sdpa")


def _prompt(n, seed=0):
    rng = np.random.default_rng(seed)
    return ag.Prompt("random", "code", rng.integers(0, VOCAB, n).tolist())


def test_agreement_counts_and_first_divergence():
    assert ag.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == ag.Agreement(0.75, 2)
    assert ag.agreement([5, 6], [5, 6]) == (1.0, None)
    assert ag.agreement([5, 6], [0, 6]).first_divergence == 0
    with pytest.raises(ValueError):
        ag.agreement([1, 2], [1])
    with pytest.raises(ValueError):
        ag.agreement([], [])


def _emulation(method, budget, sink=4, window=8, page=4):
    return ag.Emulation(method, budget, sink, window, page, frozenset([0]))


def test_streamingllm_keeps_sink_and_the_most_recent_tokens():
    q, k = torch.randn(4, 16), torch.randn(2, 100, 16)
    keep = ag.keep_mask(_emulation("streamingllm", 40), q, k, 0.25)
    want = torch.zeros(2, 100, dtype=torch.bool)
    want[:, :4] = True
    want[:, 100 - 36 :] = True  # budget 40 = 4 sink + the 36 most recent
    assert torch.equal(keep, want)
    assert torch.equal(ag.keep_mask(_emulation("streamingllm", 200), q, k, 0.25), torch.ones(2, 100, dtype=torch.bool))


def test_quest_keeps_the_pages_with_the_best_bound():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(4, 16, generator=gen), torch.randn(2, 103, 16, generator=gen)
    em = _emulation("quest", 4 + 8 + 5 * 4)  # 5 pages of 4 tokens
    keep = ag.keep_mask(em, q, k, 0.25)
    mid = k[:, 4 : 103 - 8]  # 91 middle tokens: 22 full pages and a partial one of 3
    for h in range(2):
        pages = [mid[h, i : i + 4] for i in range(0, 91, 4)]
        qg = q[2 * h : 2 * h + 2]  # this KV head's query heads
        score = [
            max(float(torch.maximum(qj * p.min(0).values, qj * p.max(0).values).sum()) for qj in qg) for p in pages
        ]
        best = sorted(range(len(pages)), key=lambda i: -score[i])[:5]
        want = torch.zeros(103, dtype=torch.bool)
        want[:4] = want[103 - 8 :] = True
        for i in best:
            want[4 + 4 * i : min(4 + 4 * i + 4, 95)] = True
        assert torch.equal(keep[h], want), h
        assert int(keep[h].sum()) <= em.budget
    assert torch.equal(ag.keep_mask(_emulation("quest", 400), q, k, 0.25), torch.ones(2, 103, dtype=torch.bool))


def test_emulation_checks_its_settings():
    with pytest.raises(ValueError):
        _emulation("h2o", 64)
    with pytest.raises(ValueError):
        _emulation("quest", 8)  # below sink + window


def _step_logits(model, prompt, emulation):
    """Logits of one decode step after prefilling ``prompt[:-1]``, under ``emulation``."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.tensor([prompt[:-1]]), cache=cache)
        with ag.emulating(model, emulation):
            return model(torch.tensor([prompt[-1:]]), cache=cache).logits[0, -1]


def test_emulated_attention_is_sdpa_over_what_it_keeps(tiny):
    ids = _prompt(300).ids
    full = _step_logits(tiny, ids, None)
    layers = frozenset(ag.served_layers(tiny, 2))
    assert layers == {2, 3}
    everything = ag.Emulation("streamingllm", 512, 16, 32, 16, layers)
    torch.testing.assert_close(_step_logits(tiny, ids, everything), full, rtol=1e-4, atol=1e-5)
    cut = ag.Emulation("streamingllm", 64, 16, 32, 16, layers)
    assert float((_step_logits(tiny, ids, cut) - full).abs().max()) > 1e-3
    assert tiny.config._attn_implementation == "sdpa"  # restored


def test_full_budget_agrees_exactly_and_small_budgets_do_not(tiny):
    prompts = [_prompt(200, seed=s) for s in range(2)]
    res = ag.evaluate_prompts(tiny, prompts, budgets=[64, 512], new_tokens=12, progress=False)
    assert len(res.runs) == 2 * len(ag.METHODS) * 2
    for method in ag.METHODS:  # budget 512 >= 200 + 12 tokens: every method attends to all
        assert [r.agreement for r in res.select(method, 512)] == [1.0, 1.0], method
        assert all(r.first_divergence is None for r in res.select(method, 512))
    # StreamingLLM at 64 drops ~150 tokens on every served layer: the random model's greedy
    # tokens follow the context, so some differ.
    assert res.mean("streamingllm", 64) < 1.0
    text = res.to_markdown()
    assert "| 512 | IceCache | - | 1.000 (1.000-1.000) | 1.000 |" in text
    d = json.loads(json.dumps(res.to_dict()))
    assert {r["method"] for r in d["runs"]} == set(ag.METHODS) and d["served_layers"] == [2, 3]


def test_result_tables_and_plot(tmp_path):
    res = ag.AgreementResult(["icecache", "quest"], [128, 256], 8, 16, 32, 16, 2, [2, 3, 4])
    for name, kind in (("p0", "prose"), ("c0", "code"), ("c1", "code")):
        for m in res.methods:
            for b in res.budgets:
                res.runs.append(ag.PromptRun(name, kind, 4096, m, b, 0.5 if kind == "code" else 1.0, 3))
    assert res.mean("icecache", 128, "code") == 0.5 and res.mean("quest", 256, "prose") == 1.0
    assert np.isnan(res.mean("icecache", 512))
    text = res.save_table(tmp_path / "t.md").read_text()
    assert "| 128 | IceCache | 1.000 (1.000-1.000) | 0.500 (0.500-0.500) | 0.667 | 3, 3, 3 |" in text
    assert "| c1 | 4096 | 0.500 / 3 |" in text
    assert json.loads(res.save_json(tmp_path / "a.json").read_text())["rows"][0]["code_prompts"] == 2
    if ag.plotting_missing() is None:
        assert res.save_plot(tmp_path / "p.png").stat().st_size > 1000


def test_cli_parses_agreement_options():
    args = cli.build_parser().parse_args(["eval", "agreement", "--code", "3", "--budgets", "128", "--no-plot"])
    assert (args.prose, args.code, args.tokens, args.new_tokens, args.budgets) == (2, 3, 4096, 64, [128])
    assert args.func is cli._cmd_eval_agreement and args.window == 32


def test_refresh_is_checked_before_work_and_recorded(tiny):
    assert cli.build_parser().parse_args(["eval", "agreement", "--refresh", "2"]).refresh == 2
    with pytest.raises(ValueError, match="refresh"):
        ag.evaluate_prompts(tiny, [_prompt(50)], budgets=[64], refresh=0, progress=False)
    res = ag.evaluate_prompts(
        tiny, [_prompt(200)], budgets=[512], methods=["icecache"], new_tokens=6, refresh=2, progress=False
    )
    assert res.info["refresh"] == 2 and [r.agreement for r in res.select("icecache", 512)] == [1.0]


def test_effort_and_group_view_default_to_the_config_and_are_recorded(tiny):
    from icecache.runtime import IceCacheConfig

    parse = cli.build_parser().parse_args
    assert (parse(["eval", "agreement"]).effort, parse(["eval", "agreement"]).group_view) == (None, None)
    assert parse(["eval", "agreement", "--no-group-view", "--effort", "1"]).group_view is False
    with pytest.raises(ValueError, match="group_view"):
        ag.evaluate_prompts(tiny, [_prompt(50)], budgets=[64], group_view=1, progress=False)
    kw = dict(budgets=[64], methods=["icecache"], new_tokens=4, progress=False)
    res = ag.evaluate_prompts(tiny, [_prompt(200)], **kw)
    assert (res.info["effort"], res.info["group_view"]) == (IceCacheConfig.effort, IceCacheConfig.group_view)
    res = ag.evaluate_prompts(tiny, [_prompt(200)], effort=1.0, group_view=False, **kw)
    assert (res.info["effort"], res.info["group_view"]) == (1.0, False)


def test_smollm2_code_prompt_full_budget_is_exact_and_a_small_one_is_not():
    """Real model and real shipped code; runs only where the SmolLM2 GGUF is already cached."""
    pytest.importorskip("gguf")
    from icecache import models, texts

    if models.cached_gguf("smollm2") is None:
        pytest.skip("SmolLM2 GGUF not cached (python -m icecache.models fetches it)")
    model, tok = models.load_model("smollm2")
    ids = texts.documents(tok, 1, 400, seed=0, kind="code")[0]
    res = ag.evaluate_prompts(model, [ag.Prompt("code", "code", ids)], budgets=[64, 512], new_tokens=8, progress=False)
    assert all(r.agreement == 1.0 for r in res.runs if r.budget == 512), res.to_markdown()
    # At 64 (16 sink + 32 window + 1 page, or 48 recent tokens) of a 400-token prompt, the
    # three methods keep different tokens: their logits, and so some argmax, must move.
    assert min(r.agreement for r in res.runs if r.budget == 64) < 1.0, res.to_markdown()
