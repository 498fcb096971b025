"""Small helpers shared by the package's modules."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

_registered: set = set()
_register_lock = threading.Lock()


def register_attention(name: str, attention: Callable[..., Any]) -> None:
    """Register ``attention`` as transformers attention implementation ``name`` (once), with
    transformers' SDPA mask function under the same name: without a mask function registered
    for it, the mask an attention function receives is silently ``None``."""
    with _register_lock:
        if name in _registered:
            return
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, sdpa_mask)
        _registered.add(name)


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
