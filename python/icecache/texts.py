"""Long real English text that ships with IceCache and works offline.

The package carries three of Jane Austen's novels, gzip-compressed, in ``icecache/_texts/``:
*Pride and Prejudice* (1813), *Persuasion* (1818) and *Northanger Abbey* (1817), about 1.6 MB of
text (~370k SmolLM2 tokens) in 0.58 MB. They are public domain. The text is Project Gutenberg's
transcription as packaged in the R package ``janeaustenr`` (Julia Silge, MIT), taken from
Debian's ``r-cran-janeaustenr`` 1.0.0-1 and read without R through the PyPI package ``rdata``
(see :func:`rebuild_from_janeaustenr`). Only the lines of the novels are kept, joined with
newlines, exactly as janeaustenr has them (Gutenberg's hard wrap at ~70 columns; no Gutenberg
header or licence boilerplate).

Demos and benchmarks use it through :func:`documents`, which cuts several distinct,
non-overlapping token sequences out of different novels.
"""

from __future__ import annotations

import functools
import gzip
import inspect
import random
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Sequence, Union

__all__ = ["available_texts", "load_text", "documents", "rebuild_from_janeaustenr"]

_TEXT_DIR = Path(__file__).resolve().parent / "_texts"
_SUFFIX = ".txt.gz"

# janeaustenr's variable names -> the file names shipped here.
_JANEAUSTENR_NAMES = {
    "prideprejudice": "pride_and_prejudice",
    "persuasion": "persuasion",
    "northangerabbey": "northanger_abbey",
}

_CHAPTER_RE = re.compile(r"^chapter\s+[0-9ivxlc]+\b", re.IGNORECASE | re.MULTILINE)
# A single newline inside a paragraph (Gutenberg's hard wrap), not a paragraph break.
_WRAP_RE = re.compile(r"(?<!\n)\n(?!\n)")


def available_texts() -> List[str]:
    """Names of the shipped texts, sorted (e.g. ``["northanger_abbey", "persuasion", ...]``)."""
    if not _TEXT_DIR.is_dir():
        return []
    return sorted(p.name[: -len(_SUFFIX)] for p in _TEXT_DIR.glob("*" + _SUFFIX))


@functools.lru_cache(maxsize=None)
def _read(name: str) -> str:
    path = _TEXT_DIR / (name + _SUFFIX)
    if not path.is_file():
        raise KeyError(f"no shipped text {name!r}; available: {available_texts()}")
    return gzip.decompress(path.read_bytes()).decode("utf-8")


def load_text(name: str, *, unwrap: bool = False) -> str:
    """Return the full text of one shipped novel.

    Args:
        name: one of :func:`available_texts`.
        unwrap: join Gutenberg's hard-wrapped lines within each paragraph with spaces
            (paragraphs stay separated by blank lines). Closer to the running text a
            language model usually sees.

    Raises:
        KeyError: no text of that name is shipped.
    """
    text = _read(name)
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


def documents(tokenizer: Any, n_docs: int, tokens_per_doc: int, *, seed: int = 0) -> List[List[int]]:
    """Cut ``n_docs`` distinct real-text token sequences of exactly ``tokens_per_doc`` tokens.

    Documents are spread round-robin over the shipped novels (in an order shuffled by
    ``seed``); the ``k`` documents that fall on one novel come from ``k`` disjoint, equal
    slices of it, so no two documents share text. Each document starts at a chapter heading
    chosen with ``seed`` inside its slice (or at the slice start when no chapter fits) and
    runs on over following chapters. Lines are unwrapped (see :func:`load_text`). No special
    tokens are added, so the first token of each document is ordinary text.

    Args:
        tokenizer: a Hugging Face tokenizer, any object with ``.encode(str) -> list[int]``, or
            a callable ``str -> list[int]``.
        n_docs: number of documents (>= 1).
        tokens_per_doc: length of each document in tokens (>= 1).
        seed: picks the novel order and the starting chapters; same seed, same documents.

    Returns:
        ``n_docs`` lists of ``tokens_per_doc`` ints.

    Raises:
        ValueError: bad arguments, or a slice of a novel is too short for ``tokens_per_doc``
            (ask for fewer or shorter documents).
    """
    if n_docs < 1 or tokens_per_doc < 1:
        raise ValueError("n_docs and tokens_per_doc must be >= 1")
    names = available_texts()
    if not names:
        raise RuntimeError(f"no texts shipped in {_TEXT_DIR}")
    rng = random.Random(seed)
    order = names[:]
    rng.shuffle(order)
    encode = _encoder(tokenizer)

    per_novel: Dict[str, int] = {}
    plan = []  # (novel, index of this doc within the novel)
    for i in range(n_docs):
        name = order[i % len(order)]
        plan.append((name, per_novel.get(name, 0)))
        per_novel[name] = per_novel.get(name, 0) + 1

    out: List[List[int]] = []
    for name, j in plan:
        text = load_text(name, unwrap=True)
        k = per_novel[name]
        lo, hi = j * len(text) // k, (j + 1) * len(text) // k
        # Chapter starts that leave a generous estimate of the needed text before the slice ends.
        need = 6 * tokens_per_doc
        starts = [m.start() for m in _CHAPTER_RE.finditer(text, lo, hi) if hi - m.start() >= need]
        if starts:
            start = rng.choice(starts)
        else:  # no chapter fits: start at the first paragraph of the slice
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
        path = out / (_JANEAUSTENR_NAMES.get(var, var) + _SUFFIX)
        # mtime=0 keeps the gzip bytes reproducible.
        path.write_bytes(gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))
        written.append(path)
    _read.cache_clear()
    return written


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="List the shipped texts, or rebuild them from janeaustenr.")
    ap.add_argument("--rebuild", metavar="JANEAUSTENR_DIR", help="unpacked R package directory")
    args = ap.parse_args()
    if args.rebuild:
        for p in rebuild_from_janeaustenr(args.rebuild):
            print(p, p.stat().st_size)
    for n in available_texts():
        print(f"{n}: {len(load_text(n)):,} chars")
