"""The data of the recall evaluation: real post-RoPE Q/K/V of one model on real documents.

Each document is captured once (:func:`icecache.capture.capture_qkv`) and cached as one
``.npz``: queries float32 at the query positions only, keys and values float16 at every
position. Later runs read the cache without loading the model.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from icecache._util import atomic_file, progress_bar

__all__ = ["DocQKV", "default_eval_cache_dir", "load_or_capture", "query_positions"]

# Bump when the cache files' contents change: older files are then captured again.
_CACHE_FORMAT = 1


@dataclass
class DocQKV:
    """Queries, keys and values of one document, as the attention saw them (post-RoPE).

    Attributes:
        positions: the query positions ``t`` (increasing), shape ``[nq]``.
        layers: ``{layer: (q [H_q, nq, D], k [H_kv, T, D], v [H_kv, T, D])}``; ``q[:, i]`` is the
            query of position ``positions[i]``; keys and values cover every position (float16
            or float32).
        name: a label (e.g. the cache file).
    """

    positions: np.ndarray
    layers: Dict[int, Tuple[np.ndarray, np.ndarray, np.ndarray]]
    name: str = ""


def query_positions(n_tokens: int, n_queries: int = 16, frac: float = 0.05) -> np.ndarray:
    """``n_queries`` positions spread evenly over the last ``frac`` of ``n_tokens`` tokens.

    The span is at least ``n_queries`` tokens; the last position is always ``n_tokens - 1``.
    """
    if n_tokens < 1 or n_queries < 1:
        raise ValueError("n_tokens and n_queries must be >= 1")
    span = min(n_tokens, max(n_queries, int(math.ceil(frac * n_tokens))))
    pos = np.round(np.linspace(n_tokens - span, n_tokens - 1, n_queries)).astype(np.int64)
    return np.unique(pos)


def default_eval_cache_dir() -> Path:
    """``$ICECACHE_EVAL_CACHE`` when set, otherwise ``~/.cache/icecache/eval``."""
    env = os.environ.get("ICECACHE_EVAL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "icecache" / "eval"


def _cache_path(
    cache_dir: Path, model: str, n_docs: int, i: int, n_tokens: int, seed: int, positions: np.ndarray, kind: str
) -> Path:
    tag = hashlib.sha256(np.asarray(positions, np.int64).tobytes()).hexdigest()[:10]
    kind_tag = "" if kind == "prose" else f"_{kind}"  # prose captures keep their earlier names
    return cache_dir / f"{model}_v{_CACHE_FORMAT}{kind_tag}_T{n_tokens}_s{seed}_doc{i}of{n_docs}_q{tag}.npz"


def load_or_capture(
    n_docs: int = 2,
    n_tokens: int = 8000,
    *,
    positions: Optional[Sequence[int]] = None,
    n_queries: int = 16,
    query_frac: float = 0.05,
    layers: Optional[Sequence[int]] = None,
    model: str = "smollm2",
    seed: int = 0,
    kind: str = "prose",
    cache_dir: Optional[Union[str, os.PathLike]] = None,
    progress: bool = True,
) -> List[DocQKV]:
    """Real post-RoPE Q/K/V of ``model`` on ``n_docs`` documents of ``n_tokens`` tokens.

    Documents come from :func:`icecache.texts.documents` (``seed``, ``kind``: ``"prose"`` or
    ``"code"``). Each document is captured
    once with :func:`icecache.capture.capture_qkv` (all layers; about 50 s for 8000 tokens of
    SmolLM2 on 2 cores) and cached as one ``.npz`` per document in ``cache_dir`` (default
    :func:`default_eval_cache_dir`): queries float32 at ``positions`` only, keys and values
    float16 (about 185 MB per 8000-token document). Later calls load the cache, without loading
    the model or the tokenizer.

    Args:
        positions: query positions; default :func:`query_positions` (``n_queries``, ``query_frac``).
        layers: layers to return (default all of the model's layers); the cache holds all.

    Returns:
        One :class:`DocQKV` per document.
    """
    if kind not in ("prose", "code"):
        raise ValueError(f"kind must be 'prose' or 'code', got {kind!r}")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_eval_cache_dir()
    pos = query_positions(n_tokens, n_queries, query_frac) if positions is None else np.asarray(positions, np.int64)
    if pos.ndim != 1 or pos.size == 0 or pos.min() < 0 or pos.max() >= n_tokens:
        raise ValueError(f"query positions must lie in [0, {n_tokens})")
    paths = [_cache_path(cache, model, n_docs, i, n_tokens, seed, pos, kind) for i in range(n_docs)]
    state: Dict[str, Any] = {}

    def model_and_docs():
        if "docs" not in state:
            from icecache import models, texts

            m, tok = models.load_model(model)
            state["model"] = m
            state["docs"] = texts.documents(tok, n_docs, n_tokens, seed=seed, kind=kind)
        return state["model"], state["docs"]

    out: List[DocQKV] = []
    bar = progress_bar(total=n_docs, desc="capture Q/K/V", enable=progress)
    try:
        for i, path in enumerate(paths):
            if not path.is_file():
                bar.set_postfix_str(f"doc {i}: running {model} on {n_tokens} tokens")
                m, docs = model_and_docs()
                _capture_to(path, m, docs[i], pos)
            with np.load(path) as z:
                q, k, v, layer_ids = z["q"], z["k"], z["v"], z["layers"]
            want = [int(x) for x in layer_ids] if layers is None else [int(x) for x in layers]
            index = {int(layer): j for j, layer in enumerate(layer_ids)}
            bad = [layer for layer in want if layer not in index]
            if bad:
                raise ValueError(f"{model} has no layer(s) {bad} (it has {len(layer_ids)})")
            out.append(
                DocQKV(
                    positions=pos.copy(),
                    layers={layer: (q[index[layer]], k[index[layer]], v[index[layer]]) for layer in want},
                    name=path.name,
                )
            )
            bar.update(1)
    finally:
        bar.close()
    return out


def _capture_to(path: Path, model: Any, ids: Sequence[int], pos: np.ndarray) -> None:
    from icecache.capture import capture_qkv

    data = capture_qkv(model, list(ids))
    layer_ids = np.array(sorted(data), dtype=np.int64)
    q = np.stack([data[layer][0][:, pos] for layer in layer_ids]).astype(np.float32)
    k = np.stack([data[layer][1] for layer in layer_ids]).astype(np.float16)
    v = np.stack([data[layer][2] for layer in layer_ids]).astype(np.float16)
    del data
    # A concurrent or interrupted capture leaves no half file.
    with atomic_file(path) as part, open(part, "wb") as f:
        np.savez(f, q=q, k=k, v=v, layers=layer_ids, positions=pos, tokens=np.asarray(ids, dtype=np.int32))
