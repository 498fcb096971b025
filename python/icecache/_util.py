"""Small helpers shared by the package's modules."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

_registered: set = set()
_register_lock = threading.Lock()


def register_attention(name: str, attention: Callable[..., Any], mask: Optional[Callable[..., Any]] = None) -> None:
    """Register ``attention`` as transformers attention implementation ``name`` (once), with
    ``mask`` (default: transformers' SDPA mask function) as its mask function: without a mask
    function registered for it, the mask an attention function receives is silently ``None``."""
    with _register_lock:
        if name in _registered:
            return
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, sdpa_mask if mask is None else mask)
        _registered.add(name)


def cache_keyword(model: Any) -> str:
    """The name of the cache argument of ``model``'s forward and ``generate``: ``cache`` from
    transformers 5.24 on, ``past_key_values`` before. Passing the other name is no error there:
    the forward's ``**kwargs`` swallow it, and the model then runs without the cache."""
    forward: Any = type(model).forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


@contextlib.contextmanager
def atomic_file(target: Path) -> Iterator[Path]:
    """Yields a temporary path beside ``target``; when the block succeeds the file is renamed
    onto ``target`` (atomic on one file system) and made world-readable, otherwise it is
    removed: an interrupted or failed write never leaves a partial file under ``target``."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, part = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    os.close(fd)
    try:
        yield Path(part)
        os.chmod(part, 0o644)  # mkstemp makes it 0600; caches are meant to be shared
        os.replace(part, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)
        raise


def progress_bar(iterable: Any = None, *, total: Optional[int] = None, desc: str = "", enable: bool = True) -> Any:
    """A tqdm progress bar on stderr (or the bare iterable when disabled or tqdm is missing)."""
    if enable:
        try:
            from tqdm.auto import tqdm

            return tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True)
        except ImportError:  # pragma: no cover - tqdm is in the model extra
            pass
    return _NoBar(iterable)


class _NoBar:
    """What :func:`progress_bar` returns without a bar: iterates, and ignores the bar's calls."""

    def __init__(self, iterable: Optional[Iterable[Any]]):
        self._it = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self._it if self._it is not None else ())

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass
