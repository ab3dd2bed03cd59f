"""SwiGLU -> ``npu_swiglu``.

Mirrors transformers ``models/qwen2/modeling_qwen2.py`` ``Qwen2MLP.forward`` (4.5x and 5.x)::

    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))   # act_fn = SiLU

FX before (pre-dispatch ATen)::

    linear = aten.linear.default(x, w_gate)
    silu = aten.silu.default(linear)
    linear_1 = aten.linear.default(x, w_up)
    mul = aten.mul.Tensor(silu, linear_1)
    linear_2 = aten.linear.default(mul, w_down)

FX after, when the graph has at least as many tokens as the hidden size (``T >= H``: verl's 4k-32k
token micro-batches at 0.5B/7B), one matmul against the gate/up weights concatenated *in the graph*
(the parameters and state-dict keys stay as they are)::

    cat = aten.cat.default([w_gate, w_up])                     # [2I, H]: 2·2I·H elements moved
    linear = aten.linear.default(x, cat)                       # [..., 2I], gate first
    npu_swiglu = npu.npu_swiglu.default(linear, -1)
    linear_2 = aten.linear.default(npu_swiglu, w_down)

Otherwise (fewer tokens than H: decode, short prompts) the activations are concatenated::

    cat = aten.cat.default([linear, linear_1], -1)             # [..., 2I]: 2·T·2I elements moved
    npu_swiglu = npu.npu_swiglu.default(cat, -1)

The choice (:func:`merge_weights`) compares the two copies' bytes, ``2I·H`` (weights) against
``T·2I`` (activations); in training the merged weight also turns the two ``dx`` matmuls and their
``add`` into one matmul (``T·H`` x 3 elements less in the backward). It is made from the graph's size
hints, without a guard (a symbolic T never recompiles for it). When the linears are not plain
``aten.linear(x, w)`` without bias on the same input (LoRA, a bias, a cast in between), only the
``silu(gate) * up`` variants match and the activations are concatenated.

Constraints (torch_npu 2.13.0 ``npu_swiglu`` docs): A is the *first* half, so the input is
``cat([gate, up], -1)``, gate first; the split size must be even (it is: 2·I) and the input contiguous
(``cat`` output is). gate and up must have equal shapes (no broadcasting) and dtypes. The anchor is
``aten.silu``. The ``cat`` costs one extra copy of gate and up; fusing gate_proj and up_proj into one
linear would remove it (see the README's performance notes).
"""

from __future__ import annotations

import logging

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from qwen_npu_compile.fusion import FusionFamily, PatternVariant, meta_val, node_source
from qwen_npu_compile.npu_ops.swiglu import swiglu_violation

aten = torch.ops.aten
F = torch.nn.functional
log = logging.getLogger(__name__)

#: What :func:`merge_weights` picks, as recorded in logs and benchmark results.
LAYOUT_MERGED_WEIGHT = "merged_weight"
LAYOUT_ACTIVATION_CAT = "activation_cat"


def _hint(size) -> int:
    """A size's concrete value, or its size hint when symbolic (never guards)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    # hint_int (torch <= 2.10) became optimization_hint (2.13); SymNode.hint underlies both
    shapes = torch.fx.experimental.symbolic_shapes
    for name in ("hint_int", "optimization_hint"):
        if hasattr(shapes, name):
            return int(getattr(shapes, name)(size))
    return int(size.node.hint)


def merge_weights(x: torch.Tensor, w_gate: torch.Tensor) -> bool:
    """Whether one matmul against ``cat([w_gate, w_up])`` moves fewer bytes than ``cat([gate, up], -1)``.

    The weight copy reads and writes ``2I·H`` elements, the activation copy ``T·2I`` (T = tokens in
    the graph, ``x.numel() / H``): merge when ``T >= H``. Decided on size hints, without a guard.

    Args:
        x: ``[..., H]`` input of gate_proj/up_proj (FakeTensor, sizes may be symbolic).
        w_gate: ``[I, H]`` gate_proj weight.
    """
    hidden = _hint(w_gate.shape[1])
    tokens = 1
    for size in x.shape[:-1]:
        tokens *= _hint(size)
    return tokens >= hidden


def _search_silu_left(gate, up):
    return torch.nn.functional.silu(gate) * up


def _search_silu_right(gate, up):
    return up * torch.nn.functional.silu(gate)


def _replace(gate, up):
    return torch.ops.npu.npu_swiglu.default(torch.cat([gate, up], dim=-1), -1)


def _search_linear_left(x, w_gate, w_up):
    return F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)


def _replace_linear(x, w_gate, w_up):
    # Traced with the match's FakeTensors, so the layout is chosen per graph from its shapes.
    if merge_weights(x, w_gate):
        return torch.ops.npu.npu_swiglu.default(F.linear(x, torch.cat([w_gate, w_up], dim=0)), -1)
    return _replace(F.linear(x, w_gate), F.linear(x, w_up))


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


def check_swiglu_linear(x, w_gate, w_up) -> str | None:
    """Refusal reason for fusing ``silu(linear(x, w_gate)) * linear(x, w_up)``, or None to fuse.

    Args:
        x: ``[..., H]``; w_gate, w_up: ``[I, H]`` weights of one dtype (a weight concatenation needs it).
    """
    if not all(isinstance(t, torch.Tensor) for t in (x, w_gate, w_up)):
        return "input or weights are not tensors"
    if w_gate.dim() != 2 or w_gate.shape != w_up.shape or w_gate.dtype != w_up.dtype:
        return f"gate/up weights differ: {tuple(w_gate.shape)} {w_gate.dtype}, {tuple(w_up.shape)} {w_up.dtype}"
    if w_gate.device != w_up.device or x.dtype != w_gate.dtype:
        return f"input {x.dtype} and weights {w_gate.dtype} differ in dtype (or weights in device)"
    gate = x.new_empty((*x.shape[:-1], w_gate.shape[0]))
    return check_swiglu(gate, gate)


def _check_linear(match) -> str | None:
    x, w_gate, w_up = (meta_val(match.kwargs[name]) for name in ("x", "w_gate", "w_up"))
    reason = check_swiglu_linear(x, w_gate, w_up)
    if reason is None:
        layout = LAYOUT_MERGED_WEIGHT if merge_weights(x, w_gate) else LAYOUT_ACTIVATION_CAT
        anchor = next((n for n in match.nodes if n.target is aten.silu.default), match.nodes[-1])
        log.debug("qwen_npu: swiglu at %s: %s (tokens x %s, hidden %s)", node_source(anchor), layout,
                  tuple(x.shape[:-1]), w_gate.shape[1])
    return reason


def _examples():
    return [torch.empty(2, 4, 16), torch.empty(2, 4, 16)]


def _linear_examples():
    return [torch.empty(2, 4, 8), torch.empty(16, 8), torch.empty(16, 8)]


class SwiGluFamily(FusionFamily):
    """``silu(gate) * up`` -> ``npu_swiglu`` on a merged-weight matmul or ``cat([gate, up], -1)``; L per Qwen2 model."""

    name = "swiglu"
    anchor_ops = (aten.silu.default,)
    fused_op_names = ("npu_swiglu",)
    backward_op_name = "npu_swiglu_backward"
    per_layer = 1  # the MLP

    def iter_variants(self):
        # The graph is dtype-independent (no casts), so one trace per operand order covers all dtypes.
        # The linear forms come first (variants of one output op are tried in registration order).
        yield PatternVariant("swiglu_linear_silu_left", _search_linear_left, _replace_linear, _linear_examples,
                             _check_linear, why="Qwen2MLP with plain gate/up linears: layout chosen by shape")
        yield PatternVariant("swiglu_silu_left", _search_silu_left, _replace, _examples, _check,
                             why="Qwen2MLP: act_fn(gate_proj(x)) * up_proj(x)")
        yield PatternVariant("swiglu_silu_right", _search_silu_right, _replace, _examples, _check,
                             why="the commuted product up * silu(gate), which the matcher does not commute")
