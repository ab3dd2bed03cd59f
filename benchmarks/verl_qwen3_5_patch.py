"""The "verl-style" Qwen3.5 baseline: transformers' Qwen3.5 patched as verl 0.9.1's ``npu_patch`` patches it.

A model of verl's ``verl/models/transformers/npu_patch.py`` (verl 0.9.1 wheel, ``_patch_qwen3_5``; the same three
functions serve ``_patch_qwen3_next`` and ``_patch_qwen3_5_moe``), written against ``torch.ops.npu.*`` (the simulated stand-ins here,
torch_npu's ops on an NPU; same schemas). verl patches three names of
``transformers.models.qwen3_5.modeling_qwen3_5``:

* ``Qwen3_5RMSNorm.forward`` -> :func:`rms_norm_forward` (verl's ``qwen3_next_rms_norm_forward_npu``)::

      npu_rms_norm(x.float(), 1.0 + self.weight.float(), epsilon=self.eps)[0].type_as(x)

  the (1+w) norm of the input / post-attention norms, the final norm and the full-attention layer's q/k norms:
  an fp32 copy of ``x`` in, the fp32 ``1 + w`` built per call, the fp32 result cast back: three vector kernels
  around each fused norm (``_to_copy`` in, ``add``, ``_to_copy`` out);
* ``Qwen3_5RMSNormGated.forward`` -> :func:`rms_norm_gated_forward` (``qwen3_next_rms_norm_forward_gated_npu``)::

      h = npu_rms_norm(h.to(float32), self.weight.float(), epsilon=self.variance_epsilon)[0]
      h = h * F.silu(gate.to(float32))                      # eager, fp32
      return h.to(input_dtype)

  the DeltaNet's output norm: the norm fused, the gate eager in fp32 (``silu`` and ``mul`` on fp32 ``[T·Nv, Dv]``);
* ``apply_rotary_pos_emb`` -> :func:`apply_rotary_pos_emb` (``qwen3_next_apply_rotary_pos_emb_npu``): the
  partial rotary as slice to ``cos.shape[-1]``, ``npu_rotary_mul`` on the rotated part, ``cat`` with the rest
  (q and k).

Not patched by verl (and so eager here as in verl): the attention output gate (``attn_output * sigmoid(gate)``),
the Gated DeltaNet (``in_proj_*``, the depthwise ``causal_conv1d_fn`` + SiLU, ``l2norm``, the torch chunked delta
rule ``torch_chunk_gated_delta_rule``), and the dense MLP (verl's ``silu_forward_npu`` is assigned to Qwen2 /
Qwen2.5-VL / Qwen3 MLPs only, not to ``Qwen3_5MLP``). Attention runs as verl's default ``flash_attention_2`` on an
NPU host (:func:`benchmarks.verl_patch.npu_flash_attention_2`), as in the dense and MoE verl-style rows.

Everything is applied by :func:`verl_qwen3_5_patches` inside a ``with`` block only. verl's code itself is not
imported (no torch_npu here); ``tests/benchmarks/test_qwen3_5_benchmarks.py`` checks these functions against verl's real
ones where verl is installed (same output and gradients), and against the notes' description everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from .verl_patch import replaced

#: Where the modelled functions come from (cited in the results).
SOURCES = (
    "https://github.com/volcengine/verl/blob/v0.9.1/verl/models/transformers/npu_patch.py "
    "(qwen3_next_rms_norm_forward_npu, qwen3_next_rms_norm_forward_gated_npu, qwen3_next_apply_rotary_pos_emb_npu, "
    "_patch_qwen3_5)",
)

npu = torch.ops.npu


def rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """verl's ``qwen3_next_rms_norm_forward_npu``: the (1+w) RMSNorm as ``npu_rms_norm`` on fp32 with ``1 + w``."""
    return npu.npu_rms_norm.default(x.float(), 1.0 + self.weight.float(), self.eps)[0].type_as(x)


def rms_norm_gated_forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """verl's ``qwen3_next_rms_norm_forward_gated_npu``: ``npu_rms_norm`` on fp32, then eager fp32 ``* silu(gate)``."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    hidden_states = npu.npu_rms_norm.default(hidden_states, self.weight.float(), self.variance_epsilon)[0]
    hidden_states = hidden_states * F.silu(gate.to(torch.float32))
    return hidden_states.to(input_dtype)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """verl's ``qwen3_next_apply_rotary_pos_emb_npu``: partial rotary as slice + ``npu_rotary_mul`` + ``cat``."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = npu.npu_rotary_mul.default(q_rot, cos, sin).to(q.dtype)
    k_embed = npu.npu_rotary_mul.default(k_rot, cos, sin).to(k.dtype)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed


#: modeling_qwen3_5 name -> the modelled verl function (what ``_patch_qwen3_5`` assigns).
PATCHED = {
    "Qwen3_5RMSNorm.forward": rms_norm_forward,
    "Qwen3_5RMSNormGated.forward": rms_norm_gated_forward,
    "apply_rotary_pos_emb": apply_rotary_pos_emb,
}


@contextlib.contextmanager
def verl_qwen3_5_patches() -> Iterator[None]:
    """Patch transformers' Qwen3.5 like verl's ``_patch_qwen3_5`` (both RMSNorms and the partial rotary), inside the
    block only (originals restored on exit)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    with replaced((modeling.Qwen3_5RMSNorm, "forward", rms_norm_forward),
                  (modeling.Qwen3_5RMSNormGated, "forward", rms_norm_gated_forward),
                  (modeling, "apply_rotary_pos_emb", apply_rotary_pos_emb)):
        yield
