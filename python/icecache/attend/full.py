"""One query token per sequence over a full-cache layer's whole storage, under a key mask.

A step graph attends a full-cache layer (``full_layers``) at a fixed shape: its storage has room
for tokens not written yet, and a mask says which positions hold one. torch's SDPA with a mask
cannot use the flash kernel (the one that splits a decode step's keys over the GPU's SMs), so a
one-token step ran the memory-efficient kernel, which gives each (sequence, head) one thread
block that reads every key in turn: a handful of blocks on a GPU of a hundred-odd SMs, slower
the longer the context. Here the step is two batched matrix products over the KV heads, the
group's query heads as the rows (the keys are never repeated per query head), which spread the
keys over the whole GPU: logits accumulated and kept in float32, the softmax in float32, its
weights rounded to the value dtype for the second product (as flash attention does), and the
output accumulated in float32. (torch before 2.8 has no float32 output for 16-bit products on
CUDA: there the step runs SDPA with the mask, as before.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

__all__ = ["masked_decode_attention"]

#: Whether ``torch.bmm`` can return float32 from 16-bit inputs on CUDA (``out_dtype``, torch 2.8).
_BMM_TO_FLOAT32 = TorchVersion(torch.__version__) >= "2.8"


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (batched) accumulated and returned in float32."""
    if a.dtype == torch.float32:
        return torch.bmm(a, b)
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def masked_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of one query token per sequence over the keys that ``key_mask`` marks.

    Args:
        query: ``[B, H*G, 1, D]``; query head ``j`` reads KV head ``j // G``.
        key, value: ``[B, H, T, D]``.
        key_mask: ``[B, T]`` bool, the positions that hold a token (at least one per sequence).
        scale: logit scale.

    Returns:
        ``[B, 1, H*G, D]`` in the query's dtype (the layout transformers' attention returns).
    """
    B, Hq, L, D = query.shape
    H, T = key.shape[1], key.shape[2]
    if L != 1 or Hq % H or key.shape != (B, H, T, D) or value.shape != key.shape or key_mask.shape != (B, T):
        raise ValueError(
            f"masked_decode_attention needs query [B, H*G, 1, D], key and value [B, H, T, D] and key_mask "
            f"[B, T]; got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}, {tuple(key_mask.shape)}"
        )
    G = Hq // H
    if key.is_cuda and key.dtype != torch.float32 and not _BMM_TO_FLOAT32:  # torch before 2.8: SDPA
        q = query.reshape(B, H, G, D).to(key.dtype)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=key_mask[:, None, None, :], scale=scale)
        return out.reshape(B, 1, Hq, D).to(query.dtype)
    q = query.reshape(B * H, G, D).to(key.dtype)
    logits = _product(q, key.reshape(B * H, T, D).transpose(1, 2)).view(B, H, G, T)
    logits.mul_(scale).masked_fill_(~key_mask[:, None, None, :], float("-inf"))
    weights = torch.softmax(logits, dim=-1).to(value.dtype)
    out = _product(weights.view(B * H, G, T), value.reshape(B * H, T, D))
    return out.view(B, 1, Hq, D).to(query.dtype)
