"""Exact attention of a prompt chunk over the tokens before it and its own, without a mask tensor.

A chunk of ``L`` queries at the end of ``T`` keys attends causally with the diagonal at the
bottom right: query ``i`` sees keys ``0 .. T - L + i``. transformers builds that as a boolean
mask ``[B, 1, L, T]``, which for a 32k chunk of a 512k prompt is 16 GiB; here the kernel applies
it itself (``torch.nn.attention.bias.causal_lower_right``). Left padding is cut off each
sequence's keys instead of masked, and grouped-query attention runs one call per query head of
each group, so that the keys are never repeated in memory.

On a GPU with cuDNN's fused attention (16-bit inputs), each group's call is two: the chunk over
the earlier keys (no mask) and over its own keys (square causal), merged by their log-sum-exps.
Both run in cuDNN's kernel, which on the H200 is 1.7x faster than the flash kernel that serves
the lower-right causal mask (``benches/RESULTS.md``, "Chunked prefill in bounded GPU memory");
where that kernel refuses the call, the lower-right mask serves it.
"""

from __future__ import annotations

from typing import Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

__all__ = ["chunk_attention", "left_padding"]


def left_padding(valid: torch.Tensor) -> Optional[list]:
    """Per sequence, the padding positions before its first real one, if ``valid`` ``[B, T]``
    is left padding only (every real position after every padding one); else ``None``."""
    pads = (~valid).sum(-1)
    T = valid.shape[-1]
    positions = torch.arange(T, device=valid.device)
    if bool((valid == (positions[None, :] >= pads[:, None])).all()):
        return pads.tolist()
    return None


#: (head dim, dtype) pairs that cuDNN's fused attention refused: the lower-right mask serves them.
_cudnn_refused: Set[Tuple[int, torch.dtype]] = set()


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """cuDNN's fused attention with its log-sum-exp: ``(out [B, H, L, D], lse [B, H, L])``."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[
        :2
    ]
    return out, lse.reshape(out.shape[:-1]).float()


def _split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Lower-right causal attention as the chunk over the earlier keys plus the chunk over its
    own (square causal), merged by log-sum-exp."""
    P = k.shape[2] - q.shape[2]
    o1, lse1 = _cudnn(q, k[:, :, :P], v[:, :, :P], False, scale)
    o2, lse2 = _cudnn(q, k[:, :, P:], v[:, :, P:], True, scale)
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = torch.exp(lse1 - lse)[..., None], torch.exp(lse2 - lse)[..., None]
    return (o1.float() * w1 + o2.float() * w2).to(q.dtype)


def _lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Lower-right causal attention of ``q`` over ``k``/``v`` with as many heads."""
    L, T = q.shape[2], k.shape[2]
    kind = (q.shape[-1], q.dtype)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and T > L and kind not in _cudnn_refused:
        try:
            return _split(q.contiguous(), k, v, scale)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:  # cuDNN cannot serve this head dim or dtype here
            _cudnn_refused.add(kind)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(L, T), scale=scale)


def _grouped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Lower-right causal attention ``[B, H_q, L, D]`` of ``query`` over ``key``/``value``
    ``[B, H_kv, T, D]`` (``T >= L``)."""
    Hq, Hkv = query.shape[1], key.shape[1]
    groups = Hq // Hkv
    out = torch.empty_like(query)
    # Query head h * groups + g reads KV head h (transformers' repeat_kv order).
    for g in range(groups):
        out[:, g::groups] = _lower_right(query[:, g::groups], key, value, scale)
    return out


def chunk_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: Optional[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Attention of a chunk's queries ``[B, H_q, L, D]`` over ``key``/``value`` ``[B, H_kv, T,
    D]`` (the tokens before the chunk, then the chunk's), causal with the diagonal at the
    bottom right; returns ``[B, L, H_q, D]`` as transformers' attention functions do.

    Args:
        valid: ``[B, T]`` real (non-padding) key positions, left padding only, or ``None``.
            A padding query position gets a zero output (nothing it may attend).
        scale: the softmax scale.

    Raises:
        ValueError: ``valid`` is not left padding, or the shapes disagree.
    """
    B, Hq, L, D = query.shape
    T = key.shape[2]
    if key.shape[0] != B or value.shape != key.shape or key.shape[-1] != D or Hq % key.shape[1] or T < L:
        raise ValueError(f"chunk_attention: query {tuple(query.shape)} and keys {tuple(key.shape)} do not match")
    if valid is None or bool(valid.all()):
        return _grouped(query, key, value, scale).transpose(1, 2).contiguous()
    pads = left_padding(valid)
    if pads is None:
        raise ValueError("chunk_attention takes left padding only")
    out = query.new_zeros(B, Hq, L, D)
    for b, pad in enumerate(pads):
        first = max(0, pad - (T - L))  # the chunk's first real query
        if pad < T and first < L:
            q, k, v = query[b : b + 1, :, first:], key[b : b + 1, :, pad:], value[b : b + 1, :, pad:]
            out[b : b + 1, :, first:] = _grouped(q, k, v, scale)
    return out.transpose(1, 2).contiguous()
