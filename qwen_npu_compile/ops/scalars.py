"""Scalar arguments of the fused ops: what a match may pass where an op's schema wants a Python number.

The schemas (torch_npu 2.13.0 ``npu_native_functions_by_codegen.yaml``, mirrored in this package):
``npu_fusion_attention(..., float scale=1., float keep_prob=1., ...)``, ``npu_rms_norm(Tensor self,
Tensor gamma, float epsilon=1e-06)``, ``npu_add_rms_norm(..., float epsilon=1e-06)``. A pattern binds
these from the model (``self.scaling``, ``self.variance_epsilon``) as a wildcard, so the bound value can
be a literal, a symbolic scalar input (``dynamic=True``), or a *tensor* when the model holds a tensor
there (``self_attn.scaling = torch.tensor(0.125)``, a per-head ``[1, N, 1, 1]`` scale). Passing a tensor
to a ``float`` argument fails at trace time (``Expected 'float' for argument 'scale' but found
FakeTensor``), so every pattern with such an argument asks :func:`scalar_argument` first.

A one-element tensor is read only when it is provably constant: a real (not fake) tensor the graph
holds as a ``get_attr`` constant (what ``make_fx`` records for ``torch.tensor(0.125)`` created in the
model's forward), reached through copies that keep its value. A 0-d graph input (a module attribute
Dynamo lifts as an input, a buffer) can change between calls without a recompile: refused.
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

#: Ops between a real tensor constant (``get_attr``) and its use that keep its value.
CONSTANT_PASSTHROUGH = (
    aten.lift_fresh_copy.default, aten.detach.default, aten.detach_.default, aten.alias.default,
    aten.clone.default, aten._to_copy.default, aten.to.dtype,
)  # fmt: skip

#: What a fused op's ``float`` argument may be bound to without reading a tensor.
_SCALAR_VALUES = (int, float, torch.SymInt, torch.SymFloat)


def constant_tensor_value(node: torch.fx.Node) -> float | None:
    """The value of a real one-element floating-point tensor constant behind ``node``, else None.

    Follows :data:`CONSTANT_PASSTHROUGH` copies back to a ``get_attr`` of the graph's module; a fake
    tensor, a graph input or any computed tensor is not constant (returns None).
    """
    while (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and node.target in CONSTANT_PASSTHROUGH
        and isinstance(node.args[0], torch.fx.Node)
    ):
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    value = node.graph.owning_module
    for atom in str(node.target).split("."):
        value = getattr(value, atom, None)
    if not isinstance(value, torch.Tensor) or isinstance(value, torch._subclasses.FakeTensor):
        return None
    if value.numel() != 1 or not value.is_floating_point():
        return None
    with torch._subclasses.fake_tensor.unset_fake_temporarily():  # matching runs under the fake mode
        return float(value.item())


def scalar_argument(op: str, argument: str, bound, *, allow_none: bool = False) -> tuple[object, str | None]:
    """What to pass as ``op``'s ``float argument`` for the match's binding ``bound``, or why not.

    Args:
        op: the fused op's name, for the reason (``"npu_fusion_attention"``).
        argument: the schema argument (``"scale"``, ``"epsilon"``).
        bound: the match's value: a Python number, an FX node (symbolic scalar, tensor) or None.
        allow_none: whether None is meaningful (SDPA's ``scale=None`` = 1/sqrt(D)).

    Returns:
        ``(value, None)`` to fuse, where value is ``bound`` itself (a literal, a symbolic scalar node,
        None) or the Python float read from a constant one-element tensor; ``(None, reason)`` to refuse:
        a tensor with more than one element (e.g. a per-head ``[1, N, 1, 1]`` scale), a one-element
        tensor that is not a compile-time constant (a graph input), or anything else that is no number.
    """
    if bound is None and allow_none:
        return None, None
    if isinstance(bound, bool):
        return None, f"{op}'s float {argument} is bound to the bool {bound!r}"
    if isinstance(bound, (int, float)):
        return bound, None
    value = bound.meta.get("val") if isinstance(bound, torch.fx.Node) else bound
    if isinstance(value, _SCALAR_VALUES) and not isinstance(value, bool):
        return bound, None
    if isinstance(value, torch.Tensor):
        shape = tuple(value.shape)
        if value.numel() != 1:  # static shapes in model graphs; symbolic sizes never equal 1 here
            return None, (
                f"{argument} is a {value.dtype} tensor of shape {shape} (e.g. a per-head scale), but "
                f"{op} takes one Python float {argument} for all heads and positions"
            )
        constant = constant_tensor_value(bound)
        if constant is not None:
            return constant, None
        source = "a graph input (a module attribute, buffer or argument)" if getattr(bound, "op", None) == "placeholder" else (
            f"computed by {getattr(bound, 'target', bound)}"
        )
        return None, (
            f"{argument} is a {value.dtype} tensor of shape {shape}, {source}: not a compile-time constant, "
            f"so it cannot become {op}'s Python float {argument} (set it to a Python float)"
        )
    return None, f"{op}'s float {argument} is bound to {type(value).__name__} {value!r}, not a number"
