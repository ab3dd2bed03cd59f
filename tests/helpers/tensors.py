"""Test tensors and reference math: meta tensors for limit checks, random q/k/v, transformers' ``rotate_half``."""

from __future__ import annotations

import torch


def meta(*shape, dtype=torch.float32) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` on the meta device (what a limit check reads: shape, dtype, strides)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def random_qkv(q_shape, kv_shape, dtype=torch.float32, v_shape=None, requires_grad=True, seed=0):
    """``[q, k, v]``, standard normal from their own generator (``seed``), in ``dtype`` (v of ``kv_shape`` unless
    ``v_shape``)."""
    g = torch.Generator().manual_seed(seed)
    shapes = (q_shape, kv_shape, v_shape or kv_shape)
    return [torch.randn(shape, generator=g).to(dtype).requires_grad_(requires_grad) for shape in shapes]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``rotate_half``: ``cat(-x2, x1)`` of the last dimension's halves."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
