"""The "verl-style" baseline: transformers' Qwen2 monkey-patched the way verl does it on Ascend.

verl's ``verl/models/transformers/npu_patch.py`` defines three patches (``rms_norm_forward``,
``silu_forward``, ``apply_rotary_pos_emb_*_npu``) and assigns them to the Qwen-family HF classes it
supports (``Qwen2RMSNorm``; ``Qwen2_5_VLMLP`` / ``Qwen3MLP``; Qwen3-MoE rotary). Here the same three
patches are applied to transformers' text Qwen2 classes, which is what a verl user training Qwen2.5 on
Ascend gets with all three enabled; attention is left to SDPA:

* ``Qwen2RMSNorm.forward``  -> ``npu_rms_norm(x, weight, epsilon)[0]``
* ``Qwen2MLP.forward``      -> ``down_proj(npu_swiglu(cat([gate_proj(x), up_proj(x)], -1), -1))``
* ``apply_rotary_pos_emb``  -> ``npu_rotary_mul(q, cos.unsqueeze(1), sin.unsqueeze(1))`` (and k), on HF's
  head-first BNSD q/k (a transposed, non-contiguous view)

The functions below are those patches, written against ``torch.ops.npu.*`` (the simulated stand-ins
here, the real torch_npu ops on an NPU; same schemas). :func:`verl_patches` applies them for the
duration of a ``with`` block and restores transformers' originals afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers.models.qwen2 import modeling_qwen2

#: Where the patched functions come from (cited in the results).
SOURCES = ("https://github.com/volcengine/verl/blob/main/verl/models/transformers/npu_patch.py",)


def rms_norm_forward(self, x):
    """verl's ``rms_norm_forward``: the fused kernel on the input as it comes (no dtype cast)."""
    return torch.ops.npu.npu_rms_norm.default(x, self.weight, self.variance_epsilon)[0]


def silu_forward(self, hidden_state):
    """verl's ``silu_forward``: gate and up projections concatenated (gate first), then ``npu_swiglu``."""
    gate_up = torch.cat((self.gate_proj(hidden_state), self.up_proj(hidden_state)), dim=-1)
    return self.down_proj(torch.ops.npu.npu_swiglu.default(gate_up, -1))


def apply_rotary_pos_emb_npu(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """verl's ``apply_rotary_pos_emb_npu``: ``npu_rotary_mul`` on HF's BNSD q and k."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = torch.ops.npu.npu_rotary_mul.default(q, cos, sin)
    k_embed = torch.ops.npu.npu_rotary_mul.default(k, cos, sin)
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


@contextlib.contextmanager
def verl_patches() -> Iterator[None]:
    """Patch transformers' Qwen2 like verl does, inside the block only (originals restored on exit)."""
    saved = (
        modeling_qwen2.Qwen2RMSNorm.forward,
        modeling_qwen2.Qwen2MLP.forward,
        modeling_qwen2.apply_rotary_pos_emb,
    )
    modeling_qwen2.Qwen2RMSNorm.forward = rms_norm_forward
    modeling_qwen2.Qwen2MLP.forward = silu_forward
    modeling_qwen2.apply_rotary_pos_emb = apply_rotary_pos_emb_npu
    try:
        yield
    finally:
        (
            modeling_qwen2.Qwen2RMSNorm.forward,
            modeling_qwen2.Qwen2MLP.forward,
            modeling_qwen2.apply_rotary_pos_emb,
        ) = saved
