"""SwiGLU -> ``npu_swiglu``.

Mirrors transformers ``models/qwen2/modeling_qwen2.py`` ``Qwen2MLP.forward`` (4.5x and 5.x)::

    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))   # act_fn = SiLU

FX before (pre-dispatch ATen)::

    linear = aten.linear.default(x, w_gate)
    silu = aten.silu.default(linear)
    linear_1 = aten.linear.default(x, w_up)
    mul = aten.mul.Tensor(silu, linear_1)
    linear_2 = aten.linear.default(mul, w_down)

FX after, for plain ``aten.linear(x, w)`` gate/up projections without bias on the same ``x``: both
projections are written into the two contiguous halves of one buffer (``qwen_npu::gate_up_proj``,
:mod:`qwen_npu_compile.ops.qwen_npu.gate_up_proj`: two matmuls with ``out=``, no copy) and ``npu_swiglu``
splits that buffer along its new leading dim; the parameters and state-dict keys stay as they are::

    gate_up_proj = qwen_npu.gate_up_proj.default(x, w_gate, w_up)   # [2, ..., I]: [0] gate, [1] up
    npu_swiglu = npu.npu_swiglu.default(gate_up_proj, 0)           # [1, ..., I]
    squeeze = aten.squeeze.dim(npu_swiglu, 0)                      # a view
    linear_2 = aten.linear.default(squeeze, w_down)

No element is copied at any token count (the weight concatenation ``cat([w_gate, w_up])`` moved
``2·2I·H`` elements, the activation one ``2·T·2I``), so there is no layout to choose. In training the
backward of ``gate_up_proj`` is two ``dx`` matmuls and their ``add`` (``3·T·H`` elements, as for two
separate linears and for verl's activation ``cat``) and one ``dW`` matmul per weight. The merged weight
avoided that ``add`` (one ``dx`` matmul), so for a *training* graph with more than ``4I/3`` tokens
(about 25k at Qwen2.5-7B, 6.5k at 0.5B) it moved fewer bytes per step (7B, S=32768: 0.7% fewer), but
AOTAutograd saved its ``[H, 2I]`` concatenation for the backward: ``2I·H`` more activation memory per
layer (259 MiB at 7B bf16, 7 GiB over 28 layers); ``gate_up_proj`` saves only ``x`` and the
parameters. Forward-only graphs move strictly fewer bytes at every token count.

When the linears are not plain ``aten.linear(x, w)`` without bias on the same input (LoRA, a bias, a
cast in between), or gate/up are used elsewhere too, only the ``silu(gate) * up`` variants match and the
activations are concatenated::

    cat = aten.cat.default([linear, linear_1], -1)             # [..., 2I]: 2·T·2I elements moved
    npu_swiglu = npu.npu_swiglu.default(cat, -1)

Constraints (torch_npu 2.13.0 ``npu_swiglu`` docs): A is the *first* half, gate first; the size along
``dim`` must be even (2 along dim 0; 2·I along -1) and the input contiguous (``gate_up_proj``'s and
``cat``'s outputs are). gate and up must have equal shapes (no broadcasting) and dtypes. The anchor is
``aten.silu``. The limits live with the ops: :func:`~qwen_npu_compile.ops.torch_npu.swiglu.swiglu_violation`
and :func:`~qwen_npu_compile.ops.qwen_npu.gate_up_proj.gate_up_proj_violation`.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from qwen_npu_compile.fusion.family import FusionFamily, PatternVariant, meta_val
from qwen_npu_compile.ops.qwen_npu import gate_up_proj
from qwen_npu_compile.ops.torch_npu.swiglu import swiglu_violation

aten = torch.ops.aten
F = torch.nn.functional

#: The dim ``npu_swiglu`` splits ``gate_up_proj``'s ``[2, ..., I]`` output along.
GATE_UP_DIM = 0


def _search_silu_left(gate, up):
    return torch.nn.functional.silu(gate) * up


def _search_silu_right(gate, up):
    return up * torch.nn.functional.silu(gate)


def _replace(gate, up):
    return torch.ops.npu.npu_swiglu.default(torch.cat([gate, up], dim=-1), -1)


def _search_linear_left(x, w_gate, w_up):
    return F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)


def _replace_linear(x, w_gate, w_up):
    return torch.ops.npu.npu_swiglu.default(gate_up_proj.OP(x, w_gate, w_up), GATE_UP_DIM).squeeze(GATE_UP_DIM)


def check_swiglu(gate, up) -> str | None:
    """Refusal reason for fusing ``silu(gate) * up`` via ``cat([gate, up], -1)`` (FakeTensors), or None.

    Args:
        gate: ``[..., I]`` output of gate_proj; up: ``[..., I]`` output of up_proj.
    """
    reason = _check_operands(gate, up)
    if reason is not None:
        return reason
    # the op's own limits, on the input the rewrite builds: cat([gate, up], -1), contiguous, 2·I wide
    return swiglu_violation(gate.new_empty((*gate.shape[:-1], 2 * gate.shape[-1])), -1)


def _check_operands(gate, up) -> str | None:
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor):
        return "gate or up is not a tensor"
    if gate.dtype != up.dtype:
        return f"dtype mismatch: gate {gate.dtype}, up {up.dtype}"
    if gate.shape != up.shape:
        return f"shape mismatch (broadcasting): gate {tuple(gate.shape)}, up {tuple(up.shape)}"
    if gate.dim() < 1 or statically_known_true(gate.numel() == 0):
        return "empty or 0-d input"
    return None


def _check(match) -> str | None:
    return check_swiglu(meta_val(match.kwargs["gate"]), meta_val(match.kwargs["up"]))


def check_swiglu_linear(x, w_gate, w_up) -> str | None:
    """Refusal reason for fusing ``silu(linear(x, w_gate)) * linear(x, w_up)`` into
    ``npu_swiglu(gate_up_proj(x, w_gate, w_up), 0)``, or None to fuse.

    Args:
        x: ``[..., H]``; w_gate, w_up: ``[I, H]`` weights (FakeTensors; sizes may be symbolic).
    """
    reason = gate_up_proj.gate_up_proj_violation(x, w_gate, w_up)
    if reason is not None:
        return reason
    gate = x.new_empty((*x.shape[:-1], w_gate.shape[0]))
    reason = _check_operands(gate, gate)
    if reason is not None:
        return reason
    # npu_swiglu's own limits, on the buffer gate_up_proj writes: [2, ..., I], contiguous, split along 0
    return swiglu_violation(x.new_empty((2, *gate.shape)), GATE_UP_DIM)


def _check_linear(match) -> str | None:
    return check_swiglu_linear(*(meta_val(match.kwargs[name]) for name in ("x", "w_gate", "w_up")))


def _examples():
    return [torch.empty(2, 4, 16), torch.empty(2, 4, 16)]


def _linear_examples():
    return [torch.empty(2, 4, 8), torch.empty(16, 8), torch.empty(16, 8)]


class SwiGluFamily(FusionFamily):
    """``silu(gate) * up`` -> ``npu_swiglu`` on ``gate_up_proj``'s two halves, or on ``cat([gate, up], -1)``;
    L per Qwen2 model."""

    name = "swiglu"
    anchor_ops = (aten.silu.default,)
    fused_op_names = ("npu_swiglu",)
    backward_op_name = "npu_swiglu_backward"
    per_layer = 1  # the MLP

    @classmethod
    def expected_count(cls, model_config, *, per_layer: bool = False, layer_type: str | None = None) -> int:
        from .moe import swiglu_expected  # MoE models: dense MLPs and shared experts; the routed experts are moe's

        count = swiglu_expected(model_config, per_layer=per_layer)
        return super().expected_count(model_config, per_layer=per_layer, layer_type=layer_type) if count is None else count

    def iter_variants(self):
        # The graph is dtype-independent (no casts), so one trace per operand order covers all dtypes.
        # The linear form comes first (variants of one output op are tried in registration order).
        yield PatternVariant("swiglu_linear_silu_left", _search_linear_left, _replace_linear, _linear_examples,
                             _check_linear, why="Qwen2MLP with plain gate/up linears: both written into one buffer")
        yield PatternVariant("swiglu_silu_left", _search_silu_left, _replace, _examples, _check,
                             why="Qwen2MLP: act_fn(gate_proj(x)) * up_proj(x)")
        yield PatternVariant("swiglu_silu_right", _search_silu_right, _replace, _examples, _check,
                             why="the commuted product up * silu(gate), which the matcher does not commute")
