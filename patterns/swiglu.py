"""SwiGLU -> ``npu_swiglu``.

Mirrors transformers ``models/qwen2/modeling_qwen2.py`` ``Qwen2MLP.forward`` (4.5x and 5.x)::

    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))   # act_fn = SiLU

FX before (pre-dispatch ATen)::

    linear = aten.linear.default(x, w_gate)
    silu = aten.silu.default(linear)
    linear_1 = aten.linear.default(x, w_up)
    mul = aten.mul.Tensor(silu, linear_1)
    linear_2 = aten.linear.default(mul, w_down)

FX after::

    cat = aten.cat.default([linear, linear_1], -1)
    npu_swiglu = npu.npu_swiglu.default(cat, -1)
    linear_2 = aten.linear.default(npu_swiglu, w_down)

Constraints (torch_npu 2.13.0 ``npu_swiglu`` docs): A is the *first* half, so the input is
``cat([gate, up], -1)``, gate first; the split size must be even (it is: 2·I) and the input contiguous
(``cat`` output is). gate and up must have equal shapes (no broadcasting) and dtypes. The anchor is
``aten.silu``. The ``cat`` costs one extra copy of gate and up; fusing gate_proj and up_proj into one
linear would remove it (see the README's performance notes).
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from qwen_npu_compile.fusion import FusionFamily, PatternVariant, meta_val
from qwen_npu_compile.npu_ops.swiglu import swiglu_violation

aten = torch.ops.aten


def _search_silu_left(gate, up):
    return torch.nn.functional.silu(gate) * up


def _search_silu_right(gate, up):
    return up * torch.nn.functional.silu(gate)


def _replace(gate, up):
    return torch.ops.npu.npu_swiglu.default(torch.cat([gate, up], dim=-1), -1)


def check_swiglu(gate, up) -> str | None:
    """Refusal reason for fusing ``silu(gate) * up`` (FakeTensors), or None to fuse.

    Args:
        gate: ``[..., I]`` output of gate_proj; up: ``[..., I]`` output of up_proj.
    """
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor):
        return "gate or up is not a tensor"
    if gate.dtype != up.dtype:
        return f"dtype mismatch: gate {gate.dtype}, up {up.dtype}"
    if gate.shape != up.shape:
        return f"shape mismatch (broadcasting): gate {tuple(gate.shape)}, up {tuple(up.shape)}"
    if gate.dim() < 1 or statically_known_true(gate.numel() == 0):
        return "empty or 0-d input"
    # the op's own limits, on the input the rewrite builds: cat([gate, up], -1), contiguous, 2·I wide
    return swiglu_violation(gate.new_empty((*gate.shape[:-1], 2 * gate.shape[-1])), -1)


def _check(match) -> str | None:
    return check_swiglu(meta_val(match.kwargs["gate"]), meta_val(match.kwargs["up"]))


def _examples():
    return [torch.empty(2, 4, 16), torch.empty(2, 4, 16)]


class SwiGluFamily(FusionFamily):
    """``silu(gate) * up`` -> ``npu_swiglu(cat([gate, up], -1), -1)``; L per Qwen2 model."""

    name = "swiglu"
    anchor_ops = (aten.silu.default,)
    fused_op_names = ("npu_swiglu",)

    def iter_variants(self):
        # The graph is dtype-independent (no casts), so one trace per operand order covers all dtypes.
        yield PatternVariant("swiglu_silu_left", _search_silu_left, _replace, _examples, _check,
                             why="Qwen2MLP: act_fn(gate_proj(x)) * up_proj(x)")
        yield PatternVariant("swiglu_silu_right", _search_silu_right, _replace, _examples, _check,
                             why="the commuted product up * silu(gate), which the matcher does not commute")
