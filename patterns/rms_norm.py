"""RMSNorm -> ``npu_rms_norm``.

Mirrors transformers ``models/qwen2/modeling_qwen2.py`` ``Qwen2RMSNorm.forward`` (4.5x and 5.x)::

    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)

FX before (pre-dispatch ATen, bf16)::

    to = aten.to.dtype(x, torch.float32)
    pow_1 = aten.pow.Tensor_Scalar(to, 2)
    mean = aten.mean.dim(pow_1, [-1], True)
    add = aten.add.Tensor(mean, eps)
    rsqrt = aten.rsqrt.default(add)
    mul = aten.mul.Tensor(to, rsqrt)
    to_1 = aten.to.dtype(mul, torch.bfloat16)
    out = aten.mul.Tensor(weight, to_1)

FX after::

    npu_rms_norm = npu.npu_rms_norm.default(x, weight, eps)
    out = operator.getitem(npu_rms_norm, 0)

Constraints (torch_npu 2.13.0 ``npu_rms_norm`` docs, ``shared/reference/npu-op-contracts.md``): the
(x, gamma) dtypes must be one of :data:`SUPPORTED_DTYPES`; gamma must have the trailing shape of x.
The kernel returns x's dtype, while HF promotes ``fp32 weight * bf16`` to fp32: the replacement casts
the result to the promoted dtype (the kernel computes in fp32 and rounds once, about 1 ulp from HF,
which rounds before the weight multiply). The anchor is ``aten.rsqrt``.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from qwen_npu_compile.fusion import FusionFamily, PatternVariant, meta_val
from qwen_npu_compile.npu_ops.rms_norm import rms_norm_violation

aten = torch.ops.aten


def _search(x, weight, eps):
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def _replace(x, weight, eps):
    out = torch.ops.npu.npu_rms_norm.default(x, weight, eps)[0]
    promoted = torch.promote_types(x.dtype, weight.dtype)
    # HF returns weight * x.to(input_dtype): fp32 when a bf16/fp16 input meets an fp32 weight.
    return out if promoted == out.dtype else out.to(promoted)


def check_rms_norm(x, weight) -> str | None:
    """Refusal reason for fusing RMSNorm of ``x`` (FakeTensor) with ``weight``, or None to fuse.

    The op's limits are :func:`~qwen_npu_compile.npu_ops.rms_norm.rms_norm_violation`'s; this adds a
    1-D weight (HF's) and a non-empty input.

    Args:
        x: ``[..., H]`` activation (fp16/bf16/fp32).
        weight: ``[H]`` gamma.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return "input or weight is not a tensor"
    if weight.dim() != 1 or x.dim() < 1:
        return f"weight shape {tuple(weight.shape)} is not the last dim of x {tuple(x.shape)}"
    reason = rms_norm_violation(x, weight)
    if reason is not None:
        return reason
    if statically_known_true(x.numel() == 0):
        return "empty input"
    return None


def _check(match) -> str | None:
    return check_rms_norm(meta_val(match.kwargs["x"]), meta_val(match.kwargs["weight"]))


class RmsNormFamily(FusionFamily):
    """Qwen2RMSNorm -> ``npu_rms_norm(x, w, eps)[0]``; 2L+1 per Qwen2 model (2 per layer + final)."""

    name = "rms_norm"
    anchor_ops = (aten.rsqrt.default,)
    fused_op_names = ("npu_rms_norm",)

    def iter_variants(self):
        # One variant per dtype family, because the normalised graphs differ structurally:
        # half precision casts to fp32 and back; in fp32 both casts are no-ops and are removed.
        for label, dtype in (("half", torch.bfloat16), ("fp32", torch.float32)):
            yield PatternVariant(
                name=f"rms_norm_{label}",
                search_fn=_search,
                replace_fn=_replace,
                example_inputs=lambda dtype=dtype: [torch.empty(2, 4, 16, dtype=dtype), torch.empty(16, dtype=dtype), 1e-6],
                check=_check,
                # eps is a literal in static graphs and a graph input under dynamic=True: never bake it in.
                scalar_workaround={"eps": 1e-6},
                why="fp16/bf16 activations" if label == "half" else "fp32 activations (no-op casts removed)",
            )
