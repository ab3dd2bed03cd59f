"""Every emitted op's limits, looked up by graph node: for the GE conversion check and diagnostics.

Each op's limits live in its own module (one function per op, kernel and torchair converter limits
together): :func:`~.rotary_mul.rotary_mul_violation`, :func:`~.rms_norm.rms_norm_violation`,
:func:`~.swiglu.swiglu_violation`, :func:`~.fusion_attention.call_violation`,
:func:`~.add_rms_norm.add_rms_norm_violation`, :func:`~.gate_up_proj.gate_up_proj_violation`,
:func:`~.varlen_attention.varlen_violation`. This module only maps a
node of a graph (the rewritten graph, or the forward/backward graphs torchair converts) to the right
function, with the arguments bound by the op's schema and the tensors taken from ``meta["val"]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

from qwen_npu_compile.ops.qwen_npu import gate_up_proj, varlen_attention
from qwen_npu_compile.ops.torch_npu import add_rms_norm, fusion_attention, grouped_matmul, rms_norm, rotary_mul, swiglu


def _rotary(backward: bool):
    def check(a, downstream):
        return rotary_mul.rotary_mul_violation(a["self"] if "self" in a else a["x"], a["r1"], a["r2"],
                                               backward=backward, downstream=downstream)

    return check


def _attention(a, downstream):
    return fusion_attention.call_violation(
        a["query"], a["key"], a["value"], a["head_num"], a["input_layout"], atten_mask=a.get("atten_mask"),
        sparse_mode=a.get("sparse_mode", 0), keep_prob=a.get("keep_prob", 1.0),
        softmax_layout=a.get("softmax_layout", ""), sink=a.get("sink"), actual_seq_qlen=a.get("actual_seq_qlen"),
        actual_seq_kvlen=a.get("actual_seq_kvlen"), downstream=downstream,
    )


def _varlen(a, downstream):
    return varlen_attention.varlen_violation(a["query"], a["key"], a["value"], a["seq_ends"], a["head_num"],
                                             sparse_mode=a.get("sparse_mode", 3), downstream=downstream)


def _val(item):
    return item.meta.get("val") if isinstance(item, torch.fx.Node) else item


#: ``"namespace::op"`` -> its limit function over the schema-bound arguments and the downstream.
CHECKS: dict[str, Callable[[dict, str | None], str | None]] = {
    "npu::npu_rotary_mul": _rotary(backward=False),
    "npu::npu_rotary_mul_backward": _rotary(backward=True),
    "qwen_npu::rotary_mul_orthogonal": _rotary(backward=False),
    "qwen_npu::rotary_mul_aten_backward": _rotary(backward=False),
    "npu::npu_rms_norm": lambda a, downstream: rms_norm.rms_norm_violation(a["self"], a["gamma"], downstream=downstream),
    "npu::npu_rms_norm_backward": lambda a, downstream: rms_norm.rms_norm_violation(
        a["self"], a["gamma"], downstream=downstream),
    "npu::npu_add_rms_norm": lambda a, downstream: add_rms_norm.add_rms_norm_violation(
        a["x1"], a["x2"], a["gamma"], downstream=downstream),
    "npu::npu_swiglu": lambda a, downstream: swiglu.swiglu_violation(a["self"], a.get("dim", -1), downstream=downstream),
    "npu::npu_swiglu_backward": lambda a, downstream: swiglu.swiglu_violation(
        a["self"], a.get("dim", -1), downstream=downstream),
    "qwen_npu::gate_up_proj": lambda a, downstream: gate_up_proj.gate_up_proj_violation(
        a["x"], a["w_gate"], a["w_up"], downstream=downstream),
    "qwen_npu::grouped_matmul": lambda a, downstream: grouped_matmul.grouped_matmul_violation(
        a["x"], a["weight"], a["group_list"], downstream=downstream),
    "npu::npu_grouped_matmul": lambda a, downstream: grouped_matmul.npu_call_violation(
        [_val(t) for t in a["x"]], [_val(t) for t in a["weight"]], a.get("group_list"), a.get("group_type"),
        downstream=downstream),
    "npu::npu_fusion_attention": _attention,
    "npu::npu_fusion_attention_grad": _attention,
    "qwen_npu::varlen_attention": _varlen,
    "qwen_npu::varlen_attention_backward": _varlen,
}


def node_violation(node: torch.fx.Node, downstream: str | None = "torchair") -> str | None:
    """Why the emitted op that ``node`` calls would fail (kernel or, for torchair, GE converter), or None.

    Args:
        node: a ``call_function`` node whose arguments carry ``meta["val"]`` (FakeTensors).
        downstream: the backend the graph goes to.

    Returns:
        None for a supported call or a node this project does not emit, else a one-line reason.
    """
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    check = CHECKS.get(target._schema.name)
    if check is None:
        return None
    values = {name: (value.meta.get("val") if isinstance(value, torch.fx.Node) else value)
              for name, value in bound_arguments(node).items()}
    return check(values, downstream)


def bound_arguments(node: torch.fx.Node) -> dict[str, object]:
    """``{argument name: value}`` of a call of an ``OpOverload``, by its schema: positional arguments named,
    keyword arguments as given (defaults not filled in). Values are graph nodes or literals."""
    positional = [arg.name for arg in node.target._schema.arguments if not arg.kwarg_only]
    return {**dict(zip(positional, node.args)), **node.kwargs}


def graph_violations(graph: torch.fx.Graph, downstream: str | None = "torchair") -> list[tuple[torch.fx.Node, str]]:
    """``(node, reason)`` for every call of an emitted op in ``graph`` that :func:`node_violation` refuses."""
    found = []
    for node in graph.nodes:
        reason = node_violation(node, downstream)
        if reason is not None:
            found.append((node, reason))
    return found
