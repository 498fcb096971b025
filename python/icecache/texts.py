"""Long real text that ships with IceCache and works offline: English prose and Python code.

**Prose** (``kind="prose"``): three of Jane Austen's novels, gzip-compressed, in
``icecache/_texts/``: *Pride and Prejudice* (1813), *Persuasion* (1818) and *Northanger Abbey*
(1817), about 1.6 MB of text (~370k SmolLM2 tokens) in 0.58 MB. They are public domain. The
text is Project Gutenberg's transcription as packaged in the R package ``janeaustenr`` (Julia
Silge, MIT), taken from Debian's ``r-cran-janeaustenr`` 1.0.0-1 and read without R through the
PyPI package ``rdata`` (see :func:`rebuild_from_janeaustenr`). Only the lines of the novels are
kept, joined with newlines, exactly as janeaustenr has them (Gutenberg's hard wrap at ~70
columns; no Gutenberg header or licence boilerplate).

**Code** (``kind="code"``): four modules of CPython 3.11.7's standard library, byte for byte
as that interpreter installs them (``Lib/``), gzip-compressed: ``configparser.py``,
``difflib.py``, ``statistics.py`` and ``tarfile.py``, about 290 kB of Python (~75k SmolLM2
tokens, at least 12k per module). None of them is among the modules that the look-ahead
benchmark tuned on. They are Copyright (c) 2001-2023 Python Software Foundation; All Rights
Reserved, and are distributed under the PSF License Agreement, whose full text (CPython's
``LICENSE``) ships beside them as ``_texts/CPYTHON_LICENSE.txt``, as that agreement requires.
:func:`rebuild_code_from_stdlib` regenerates them from a CPython installation.

Demos, benchmarks and evaluations use them through :func:`documents`, which cuts several
distinct, non-overlapping token sequences out of different texts of one kind.
"""

from __future__ import annotations

import functools
import gzip
import inspect
import random
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = [
    "KINDS",
    "available_texts",
    "text_kind",
    "load_text",
    "documents",
    "document_sources",
    "rebuild_from_janeaustenr",
    "rebuild_code_from_stdlib",
]

_TEXT_DIR = Path(__file__).resolve().parent / "_texts"
#: The kinds of shipped text; a text's kind is told by its file name's ending.
KINDS = ("prose", "code")
_SUFFIXES = {"prose": ".txt.gz", "code": ".py.gz"}
#: CPython standard-library modules shipped as code (see the module docstring).
_STDLIB_MODULES = ("configparser", "difflib", "statistics", "tarfile")
_CPYTHON_LICENSE = "CPYTHON_LICENSE.txt"

# janeaustenr's variable names -> the file names shipped here.
_JANEAUSTENR_NAMES = {
    "prideprejudice": "pride_and_prejudice",
    "persuasion": "persuasion",
    "northangerabbey": "northanger_abbey",
}

_CHAPTER_RE = re.compile(r"^chapter\s+[0-9ivxlc]+\b", re.IGNORECASE | re.MULTILINE)
# A definition (top-level or a method, from its indentation on) after a blank line, so a
# decorated one starts at its first decorator.
_DEFINITION_RE = re.compile(r"(?<=\n\n)[ \t]*(?:@|class\s|def\s|async\s+def\s)")
# Where documents may start, per kind: chapter headings, or top-level definitions.
_START_RE = {"prose": _CHAPTER_RE, "code": _DEFINITION_RE}
# A single newline inside a paragraph (Gutenberg's hard wrap), not a paragraph break.
_WRAP_RE = re.compile(r"(?<!\n)\n(?!\n)")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def available_texts(kind: Optional[str] = None) -> List[str]:
    """Names of the shipped texts of one kind (``None``: all kinds), sorted: e.g.
    ``["northanger_abbey", "persuasion", ...]`` for ``"prose"``, ``["configparser", ...]`` for
    ``"code"``.

    Raises:
        ValueError: ``kind`` is not ``None`` or one of :data:`KINDS`.
    """
    if kind is not None:
        _check_kind(kind)
    if not _TEXT_DIR.is_dir():
        return []
    kinds = KINDS if kind is None else (kind,)
    return sorted(p.name[: -len(_SUFFIXES[k])] for k in kinds for p in _TEXT_DIR.glob("*" + _SUFFIXES[k]))


def _path(name: str) -> Tuple[Path, str]:
    for kind in KINDS:
        path = _TEXT_DIR / (name + _SUFFIXES[kind])
        if path.is_file():
            return path, kind
    raise KeyError(f"no shipped text {name!r}; available: {available_texts()}")


def text_kind(name: str) -> str:
    """The kind of a shipped text: ``"prose"`` or ``"code"``.

    Raises:
        KeyError: no text of that name is shipped.
    """
    return _path(name)[1]


@functools.lru_cache(maxsize=None)
def _read(name: str) -> str:
    return gzip.decompress(_path(name)[0].read_bytes()).decode("utf-8")


def load_text(name: str, *, unwrap: bool = False) -> str:
    """Return the full text of one shipped novel or module.

    Args:
        name: one of :func:`available_texts`.
        unwrap: prose only: join Gutenberg's hard-wrapped lines within each paragraph with
            spaces (paragraphs stay separated by blank lines). Closer to the running text a
            language model usually sees.

    Raises:
        KeyError: no text of that name is shipped.
        ValueError: ``unwrap`` for code, whose line breaks are syntax.
    """
    text = _read(name)
    if unwrap and text_kind(name) != "prose":
        raise ValueError(f"{name!r} is code: its line breaks are syntax, it cannot be unwrapped")
    return _WRAP_RE.sub(" ", text) if unwrap else text


def _encoder(tokenizer: Any) -> Callable[[str], List[int]]:
    """Turn a tokenizer into ``str -> list[int]`` without special tokens (no BOS/EOS)."""
    enc = getattr(tokenizer, "encode", None)
    if callable(enc):
        params: Mapping[str, inspect.Parameter]
        try:
            params = inspect.signature(enc).parameters
        except (TypeError, ValueError):
            params = {}
        takes_flag = "add_special_tokens" in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
        )
        if takes_flag:  # Hugging Face tokenizers: a BOS in mid-corpus would be a fake sink
            return lambda s: list(enc(s, add_special_tokens=False))
        return lambda s: list(enc(s))
    if callable(tokenizer):
        return lambda s: list(tokenizer(s))
    raise TypeError("tokenizer must have an .encode(str) method or be a callable str -> list[int]")


# Characters tokenized at least per try: a short request still gets a prefix worth tokenizing.
_MIN_SPAN = 4096


def _tokens_from(encode: Callable[[str], List[int]], text: str, start: int, end: int, n: int) -> List[int]:
    """First ``n`` tokens of ``text[start:end]``, tokenizing growing prefixes (not the whole span)."""
    span = max(8 * n, _MIN_SPAN)  # ~4-5 chars per BPE token; 8 leaves room for byte-level tokenizers
    while True:
        stop = min(start + span, end)
        ids = encode(text[start:stop])
        # The last few tokens of a cut prefix may straddle the cut; keep a margin unless at the end.
        if len(ids) >= n + 16 or stop >= end:
            if len(ids) < n:
                raise ValueError("not enough text")
            return ids[:n]
        span *= 2


def _text_order(n_docs: int, seed: int, kind: str) -> Tuple[List[str], random.Random]:
    """The text each of ``n_docs`` documents comes from, and the random state after choosing."""
    if n_docs < 1:
        raise ValueError("n_docs must be >= 1")
    names = available_texts(kind)
    if not names:
        raise RuntimeError(f"no texts shipped in {_TEXT_DIR}")
    rng = random.Random(seed)
    order = names[:]
    rng.shuffle(order)
    return [order[i % len(order)] for i in range(n_docs)], rng


def document_sources(n_docs: int, *, seed: int = 0, kind: str = "prose") -> List[str]:
    """The name of the shipped text (:func:`available_texts`) that each document of
    ``documents(tokenizer, n_docs, ..., seed=seed, kind=kind)`` is cut from.

    Raises:
        ValueError: ``n_docs < 1`` or an unknown ``kind``.
    """
    return _text_order(n_docs, seed, kind)[0]


def documents(
    tokenizer: Any, n_docs: int, tokens_per_doc: int, *, seed: int = 0, kind: str = "prose"
) -> List[List[int]]:
    """Cut ``n_docs`` distinct real-text token sequences of exactly ``tokens_per_doc`` tokens.

    Documents are spread round-robin over the shipped texts of ``kind`` (in an order shuffled
    by ``seed``); the ``k`` documents that fall on one text come from ``k`` disjoint, equal
    slices of it, so no two documents share text. Each document starts at a place chosen
    with ``seed`` inside its slice (or at the slice start when none fits) and runs on from
    there: for prose a chapter heading, with lines unwrapped (see :func:`load_text`); for code
    a ``def``/``class`` line, top-level or a method (or its first decorator), with the source
    exactly as it is.
    No special tokens are added, so the first token of each document is ordinary text.

    Args:
        tokenizer: a Hugging Face tokenizer, any object with ``.encode(str) -> list[int]``, or
            a callable ``str -> list[int]``.
        n_docs: number of documents (>= 1).
        tokens_per_doc: length of each document in tokens (>= 1).
        seed: picks the text order and the starting places; same seed, same documents.
        kind: ``"prose"`` (the novels) or ``"code"`` (the Python modules).

    Returns:
        ``n_docs`` lists of ``tokens_per_doc`` ints.

    Raises:
        ValueError: bad arguments, or a slice of a text is too short for ``tokens_per_doc``
            (ask for fewer or shorter documents).
    """
    if n_docs < 1 or tokens_per_doc < 1:
        raise ValueError("n_docs and tokens_per_doc must be >= 1")
    sources, rng = _text_order(n_docs, seed, kind)
    encode = _encoder(tokenizer)

    per_novel: Dict[str, int] = {}
    plan = []  # (novel, index of this doc within the novel)
    for name in sources:
        plan.append((name, per_novel.get(name, 0)))
        per_novel[name] = per_novel.get(name, 0) + 1

    out: List[List[int]] = []
    for name, j in plan:
        text = load_text(name, unwrap=kind == "prose")
        k = per_novel[name]
        lo, hi = j * len(text) // k, (j + 1) * len(text) // k
        # Starts that leave a generous estimate of the needed text before the slice ends
        # (~4.5 characters per token of prose, ~3.5 of code).
        need = (6 if kind == "prose" else 5) * tokens_per_doc
        starts = [m.start() for m in _START_RE[kind].finditer(text, lo, hi) if hi - m.start() >= need]
        if starts:
            start = rng.choice(starts)
        else:  # no heading or definition fits: start at the first paragraph of the slice
            para = text.find("\n\n", lo, hi)
            start = para + 2 if para >= 0 and j > 0 else lo
        try:
            out.append(_tokens_from(encode, text, start, hi, tokens_per_doc))
        except ValueError:
            raise ValueError(
                f"{name} slice {j + 1}/{k} ({hi - lo} chars) has fewer than {tokens_per_doc} tokens; "
                "ask for fewer or shorter documents"
            ) from None
    return out


def rebuild_from_janeaustenr(
    package_dir: Union[str, Path],
    out_dir: Union[str, Path, None] = None,
    names: Sequence[str] = tuple(_JANEAUSTENR_NAMES),
) -> List[Path]:
    """Regenerate the shipped ``.txt.gz`` files from an unpacked ``janeaustenr`` R package.

    Maintainer tool, needs the PyPI package ``rdata``. Get the package without R with
    ``apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb pkg`` and pass
    ``pkg/usr/lib/R/site-library/janeaustenr``. Its data is R's lazy-load database
    (``data/Rdata.rdx``: gzip-compressed index of offsets; ``data/Rdata.rdb``: one
    zlib-compressed serialized object per variable behind a 4-byte length), not an ``.rda``.

    Args:
        package_dir: the installed R package directory (holding ``data/Rdata.rdb``).
        out_dir: where to write; default the package's own ``_texts`` directory.
        names: janeaustenr variable names to export.

    Returns:
        Paths of the files written.
    """
    import struct
    import zlib

    import rdata

    data = Path(package_dir) / "data"
    conv = lambda raw: rdata.conversion.convert(rdata.parser.parse_data(raw))  # noqa: E731
    index = conv(gzip.decompress((data / "Rdata.rdx").read_bytes()))["variables"]
    rdb = (data / "Rdata.rdb").read_bytes()
    out = Path(out_dir) if out_dir is not None else _TEXT_DIR
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for var in names:
        off, length = (int(x) for x in index[var])
        blob = rdb[off : off + length]
        (size,) = struct.unpack(">I", blob[:4])
        raw = zlib.decompress(blob[4:])
        assert len(raw) == size, (var, len(raw), size)
        lines = [str(x) for x in conv(raw)]
        text = "\n".join(lines) + "\n"
        path = out / (_JANEAUSTENR_NAMES.get(var, var) + _SUFFIXES["prose"])
        # mtime=0 keeps the gzip bytes reproducible.
        path.write_bytes(gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))
        written.append(path)
    _read.cache_clear()
    return written


def rebuild_code_from_stdlib(
    stdlib_dir: Union[str, Path, None] = None,
    out_dir: Union[str, Path, None] = None,
    modules: Sequence[str] = _STDLIB_MODULES,
) -> List[Path]:
    """Regenerate the shipped code (``<module>.py.gz``) and ``CPYTHON_LICENSE.txt`` from a
    CPython installation's standard library.

    Maintainer tool. The shipped files come from CPython 3.11.7; another version gives other
    bytes (the tests check that each module compiles, not its hash).

    Args:
        stdlib_dir: the directory holding ``difflib.py`` etc. and CPython's ``LICENSE.txt``
            (default: this interpreter's, ``sysconfig.get_path("stdlib")``).
        out_dir: where to write; default the package's own ``_texts`` directory.
        modules: module names (files ``<name>.py`` in ``stdlib_dir``).

    Returns:
        Paths of the files written.
    """
    import sysconfig

    src = Path(stdlib_dir) if stdlib_dir is not None else Path(sysconfig.get_path("stdlib"))
    out = Path(out_dir) if out_dir is not None else _TEXT_DIR
    out.mkdir(parents=True, exist_ok=True)
    licence = out / _CPYTHON_LICENSE
    licence.write_bytes((src / "LICENSE.txt").read_bytes())
    written = [licence]
    for name in modules:
        path = out / (name + _SUFFIXES["code"])
        # mtime=0 keeps the gzip bytes reproducible.
        path.write_bytes(gzip.compress((src / f"{name}.py").read_bytes(), compresslevel=9, mtime=0))
        written.append(path)
    _read.cache_clear()
    return written


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(
        description="List the shipped texts, or rebuild them from janeaustenr and CPython's standard library."
    )
    ap.add_argument("--rebuild", metavar="JANEAUSTENR_DIR", help="unpacked R package directory")
    ap.add_argument("--rebuild-code", action="store_true", help="copy the modules from this interpreter's stdlib")
    args = ap.parse_args()
    if args.rebuild:
        for p in rebuild_from_janeaustenr(args.rebuild):
            print(p, p.stat().st_size)
    if args.rebuild_code:
        for p in rebuild_code_from_stdlib():
            print(p, p.stat().st_size)
    for n in available_texts():
        print(f"{n} ({text_kind(n)}): {len(load_text(n)):,} chars")
