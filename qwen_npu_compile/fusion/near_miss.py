"""Anchor ops that are structurally another computation, not a near miss of any family.

A family's anchor op (``aten.rsqrt`` for RMSNorm, ``aten.silu`` for SwiGLU and the gated RMSNorm,
``aten.neg`` for rotary) left in a graph after matching is a *near miss*: reported, and an error in
``strict`` mode. Qwen3.5 / Qwen3-Next's Gated DeltaNet (transformers 5.24 ``modeling_qwen3_5.py``,
``modeling_qwen3_next.py``; 4.57.6 ``modeling_qwen3_next.py``) holds the same ops in other roles:

- ``l2norm(x) = x * rsqrt((x * x).sum(-1, keepdim=True) + eps)`` of q and k
  (``torch_chunk_gated_delta_rule``, ``use_qk_l2norm_in_kernel=True``): an L2 normalisation, a **sum** of
  squares where RMSNorm takes the **mean**;
- ``silu`` after the causal depthwise conv1d (``causal_conv1d_fn``'s ``activation="silu"``): an activation
  whose result nothing multiplies (no gate);
- ``g = -A_log.float().exp() * softplus(...)``: a negation that reaches no ``cat`` (``rotate_half`` is
  ``cat((-x2, x1), -1)``).

Each rule here is structural (the graph around the anchor, never its source line) and says what the
anchor is instead; :meth:`qwen_npu_compile.fusion.family.FamilyPass.apply` leaves such anchors out of the near
misses (DEBUG log). A rule errs on the side of a near miss: whatever it does not recognise stays one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.fx

aten = torch.ops.aten

#: ops that pass a value on without computing (casts, views, copies): followed when looking for a consumer
_PASS_THROUGH = {
    aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.view.default, aten.reshape.default,
    aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.clone.default,
    aten.contiguous.default, aten.expand.default, aten.slice.Tensor, aten.t.default, aten._unsafe_view.default,
}


def consumers(node: torch.fx.Node, depth: int = 4) -> Iterator[torch.fx.Node]:
    """The users of ``node`` that compute, looking through up to ``depth`` casts/views/copies
    (:data:`_PASS_THROUGH`); an output node counts as a consumer."""
    frontier, seen = [node], {node}
    for _ in range(depth + 1):
        following = []
        for current in frontier:
            for user in current.users:
                if user in seen:
                    continue
                seen.add(user)
                if user.op == "call_function" and user.target in _PASS_THROUGH:
                    following.append(user)
                else:
                    yield user
        frontier = following
        if not frontier:
            return


def _producer(node: torch.fx.Node, depth: int = 4) -> torch.fx.Node | None:
    """``node``'s first argument, looking back through casts/views/copies."""
    current = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    for _ in range(depth):
        if current is None or current.op != "call_function" or current.target not in _PASS_THROUGH:
            return current
        current = current.args[0] if isinstance(current.args[0], torch.fx.Node) else None
    return current


def silu_without_gate(anchor: torch.fx.Node) -> str | None:
    """A SiLU whose result no ``mul`` consumes and that does not leave the graph: an activation (the DeltaNet
    conv's), not a gate. (A result that leaves the graph may be multiplied after a graph break: a near miss.)"""
    if any(user.op == "output" or (user.op == "call_function" and user.target == aten.mul.Tensor)
           for user in consumers(anchor)):
        return None
    return "a SiLU activation whose result nothing multiplies (no gate): not SwiGLU or a gated norm"


def rsqrt_of_sum_of_squares(anchor: torch.fx.Node) -> str | None:
    """``rsqrt(sum(x * x, -1) + eps)``: an L2 normalisation (l2norm), not RMSNorm (which takes the mean)."""
    add = _producer(anchor)
    if add is None or add.op != "call_function" or add.target != aten.add.Tensor:
        return None
    summed = add.args[0] if isinstance(add.args[0], torch.fx.Node) else None
    if summed is None or summed.op != "call_function" or summed.target != aten.sum.dim_IntList:
        return None
    square = summed.args[0]
    if not (isinstance(square, torch.fx.Node) and square.op == "call_function" and (
            (square.target == aten.mul.Tensor and square.args[0] is square.args[1])
            or (square.target == aten.pow.Tensor_Scalar and square.args[1] == 2))):
        return None
    return "rsqrt of a sum of squares: an L2 normalisation (l2norm), not RMSNorm's mean of squares"


def neg_outside_rotate_half(anchor: torch.fx.Node) -> str | None:
    """A negation that reaches no ``cat``: not ``rotate_half``."""
    if any(user.op == "output" or (user.op == "call_function" and user.target == aten.cat.default)
           for user in consumers(anchor)):
        return None
    return "a negation that reaches no cat: not rotate_half"


#: anchor op -> rule; the rule returns what the anchor is instead, or None (it may be a near miss)
RULES: dict[object, Callable[[torch.fx.Node], str | None]] = {
    aten.silu.default: silu_without_gate,
    aten.rsqrt.default: rsqrt_of_sum_of_squares,
    aten.neg.default: neg_outside_rotate_half,
}


def foreign(anchor: torch.fx.Node) -> str | None:
    """What ``anchor`` (a call of an anchor op) is instead of a family's subgraph, or None (see :data:`RULES`)."""
    rule = RULES.get(anchor.target)
    return rule(anchor) if rule is not None else None
