"""Layout audit of the AOT graphs: find, at compile time, the nodes whose FakeTensor strides differ from
what the eager kernel returns, and pin their output to the layout the graph was traced with.

Why it is needed. AOTAutograd traces the joint graph with FakeTensors and decides from their strides
whether a ``reshape`` can be a ``view``. When an op's fake (meta) kernel promises a layout its eager
kernel does not produce, the AOT graph holds an ``aten.view`` that raises at run time::

    RuntimeError: view size is not compatible with input tensor's size and stride ...

This is a torch bug, not ours, and it ends a training job at its first backward. It is how the Qwen3.5 /
Qwen3.5-MoE / Qwen3-Next training step crashed (torch 2.9.0 through 2.13.0, any backend that runs
AOTAutograd's graphs eagerly, ``aot_eager`` included): the Gated DeltaNet's
``g = -A_log.exp() * softplus(a.float() + dt_bias)`` gets its gradient transposed (``g`` is read as
``g.transpose(1, 2)``), and ``aten.softplus_backward``'s meta kernel (the Python decomposition
``torch._decomp.decompositions.softplus_backward``, a ``where`` whose first operand is ``x``) gives the
layout of ``x`` where the CPU kernel (TensorIterator over ``grad_output, self``) gives ``grad_output``'s.
The backward of ``in_proj_a`` then views that gradient as ``[B*S, N]``. Minimal reproduction
(``tests/ops/test_aot_layout.py::test_torch_softplus_backward_meta_strides``)::

    g = torch.randn(2, 4, 16).transpose(1, 2); x = torch.randn(2, 16, 4)
    torch.ops.aten.softplus_backward(g, x, 1, 20).stride()                  # (64, 1, 16)
    torch.ops.aten.softplus_backward(g.to("meta"), x.to("meta"), 1, 20).stride()  # (64, 4, 1)

``hardsigmoid_backward``, ``hardswish_backward`` and ``elu_backward`` disagree the same way on torch
2.13.0. Not a list kept here: :func:`eager_layout_mismatch` probes every candidate node (an ATen op with at least two
tensor operands of different layouts and an elementwise-shaped output: the only case where the
stride rules of a decomposition and of TensorIterator can part) with the eager CPU kernel on small
tensors laid out like the fake ones, and compares the output's dimension order with the fake's.

Where it disagrees, :func:`pin_layouts` puts a copy to the traced layout after the node
(``aten.clone(memory_format=contiguous_format)``, or a permute / clone / permute for a non-row-major
one), so that every later node sees the strides AOTAutograd traced with, whatever the device kernel
returns. The copy is of that node's output only (the DeltaNet's ``[B, S, num_v_heads]`` gate, 4 KiB at
B*S = 512); each pinned node is one entry of ``GraphReport.layout_pins`` and one INFO line.

What the probe cannot see: a device kernel (an NPU one) whose layout differs from the CPU kernel's where
the CPU kernel agrees with the fake one. GE graphs (torchair on an NPU) carry no strides, so the pin only
matters where AOT graphs run eagerly (``aot_eager``, torchair's per-graph fallback, off-NPU conversion).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.fx

log = logging.getLogger("qwen_npu_compile")

aten = torch.ops.aten

#: sizes of the probe's dimensions (distinct, so a dense layout has no two equal strides)
_PROBE_SIZES = (2, 3, 5, 7, 11, 13)

#: ops never probed: random or in-place ops, and ops whose result's layout is what they are for
_SKIP_NAMESPACES = ("prims", "npu", "qwen_npu")


def _tensor_args(node: torch.fx.Node) -> list[tuple[int, torch.fx.Node]]:
    return [(i, arg) for i, arg in enumerate(node.args)
            if isinstance(arg, torch.fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor)]


def _order(sizes: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """The dims of size > 1, outermost first (by stride, then by index): a layout's dimension order."""
    dims = [d for d in range(len(sizes)) if sizes[d] != 1]
    return tuple(sorted(dims, key=lambda d: (-strides[d], d)))


def _hint(value) -> int | None:
    """An int, or a SymInt's hint (the value of this compile's example), read without installing a guard
    (``int(symint)`` would specialise the graph to it: a recompile per sequence length); None when unbacked."""
    if isinstance(value, int):
        return value
    node = getattr(value, "node", None)
    hint = getattr(node, "hint", None)
    return hint if isinstance(hint, int) else None


def _layout(t: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """``(sizes, strides)`` of ``t`` as ints (hints of symbolic ones, no guards), or None when one is unbacked."""
    sizes, strides = [_hint(s) for s in t.shape], [_hint(s) for s in t.stride()]
    return None if None in sizes or None in strides else (sizes, strides)


def _is_row_major(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _probe_like(fake: torch.Tensor, out_rank: int) -> torch.Tensor | None:
    """A small CPU tensor with ``fake``'s dtype, its dims of size 1 and its layout (dimension order,
    expanded dims), the sizes of the other dims from :data:`_PROBE_SIZES` aligned to the output's
    dims from the right (broadcasting). None when ``fake``'s layout is not dense or expanded."""
    layout = _layout(fake)
    if layout is None:  # unbacked sizes: a layout the probe cannot rebuild
        return None
    fake_sizes, strides = layout
    rank = fake.dim()
    offset = out_rank - rank
    sizes, expanded = [], []
    for d in range(rank):
        one = fake_sizes[d] == 1
        expanded.append(not one and strides[d] == 0)
        sizes.append(1 if one else _PROBE_SIZES[offset + d])
    order = sorted((d for d in range(rank) if not expanded[d]), key=lambda d: (-strides[d], d))
    base = [1 if expanded[d] else sizes[d] for d in range(rank)]
    dense = [0] * rank
    step = 1
    for d in reversed(order):
        dense[d] = step
        step *= base[d]
    for d in range(rank):
        if expanded[d]:
            dense[d] = step  # any stride: size 1
    if fake.dtype.is_floating_point or fake.dtype.is_complex:
        probe = torch.empty_strided(base, dense, dtype=fake.dtype).normal_()
    else:
        probe = torch.empty_strided(base, dense, dtype=fake.dtype).zero_()
    return probe.expand(sizes) if any(expanded) else probe


def _candidate(node: torch.fx.Node) -> bool:
    """An ATen op with one tensor result of the largest operand rank and >= 2 tensor operands of different layouts."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    op = node.target
    if op.namespace in _SKIP_NAMESPACES or op._schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags:
        return False
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or node.kwargs.get("out") is not None:
        return False
    args = [arg.meta["val"] for _, arg in _tensor_args(node)]
    if len(args) < 2 or any(a.dim() > out.dim() for a in args):
        return False
    rank = out.dim()
    out_layout = _layout(out)
    if out_layout is None:
        return False
    orders = set()
    for a in args:
        layout = _layout(a)
        if layout is None:
            return False
        sizes, strides = layout
        # broadcast check against the output (dims aligned from the right), on hints: no guard
        for d, size in enumerate(sizes):
            if size != 1 and size != out_layout[0][rank - a.dim() + d]:
                return False
        orders.add(tuple(d + rank - a.dim() for d in _order(sizes, strides)))
    return len(orders) > 1


def eager_layout_mismatch(node: torch.fx.Node) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Run ``node``'s op with its eager CPU kernel on probes laid out like its fake operands.

    Returns:
        ``(fake dimension order, eager dimension order)`` of the output (outermost dim first, dims of size
        1 left out) when they differ, else None (they agree, or the node is not a candidate, or the
        probe could not run: an op without a CPU kernel, symbolic strides).
    """
    if not _candidate(node):
        return None
    # AOTAutograd may compile a graph with its FakeTensorMode still on the dispatch stack (the backward of a
    # dynamic-shape graph): the probe must run the real kernels
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return _probe(node)


def _probe(node: torch.fx.Node) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    out = node.meta["val"]
    rank = out.dim()
    args = list(node.args)
    for i, arg in _tensor_args(node):
        probe = _probe_like(arg.meta["val"], rank)
        if probe is None:
            return None
        args[i] = probe
    kwargs = {k: v for k, v in node.kwargs.items() if not isinstance(v, torch.fx.Node)}
    if len(kwargs) != len(node.kwargs):
        return None
    try:
        with torch.no_grad():
            real = node.target(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - an op the probe cannot run is not audited
        log.debug("qwen_npu: layout probe of %s (%s) could not run: %s", node.name, node.target, exc)
        return None
    if not isinstance(real, torch.Tensor) or real.dim() != rank:
        return None
    layout = _layout(out)
    if layout is None:
        return None
    fake_order = _order(*layout)
    real_order = _order(list(real.shape), list(real.stride()))
    if set(fake_order) != set(real_order):  # a size-1 dim the probe saw differently: not comparable
        return None
    return (fake_order, real_order) if fake_order != real_order else None


def _pin(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    """Insert after ``node`` a copy of its output in the layout of its fake value; return the copy."""
    fake = node.meta["val"]
    sizes, strides = _layout(fake)  # not None: eager_layout_mismatch read it
    users = list(node.users)
    with graph.inserting_after(node):
        if _is_row_major(sizes, strides):
            pinned = graph.call_function(aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
            pinned.meta["val"] = fake
        else:
            perm = sorted(range(fake.dim()), key=lambda d: (-strides[d], d if sizes[d] != 1 else -1))
            inverse = [perm.index(d) for d in range(fake.dim())]
            outer = graph.call_function(aten.permute.default, (node, perm))
            with graph.inserting_after(outer):
                copy = graph.call_function(aten.clone.default, (outer,), {"memory_format": torch.contiguous_format})
            with graph.inserting_after(copy):
                pinned = graph.call_function(aten.permute.default, (copy, inverse))
            outer.meta["val"] = fake.permute(perm)
            copy.meta["val"] = outer.meta["val"]
            pinned.meta["val"] = fake
    for user in users:
        user.replace_input_with(node, pinned)
    pinned.meta["stack_trace"] = node.meta.get("stack_trace")
    return pinned


def pin_layouts(gm: torch.fx.GraphModule) -> list[dict]:
    """Audit ``gm`` (an AOT forward or backward graph with FakeTensor ``meta["val"]``) and pin the output
    of every node whose eager kernel lays it out differently from its fake kernel (see the module
    docstring). The graph is changed in place and recompiled when anything was pinned.

    Returns:
        One ``{"node", "op", "fake_order", "eager_order", "source"}`` per pinned node (dimension orders
        outermost first, size-1 dims left out), in graph order.
    """
    from qwen_npu_compile.graph.utils import node_source

    pinned = []
    for node in list(gm.graph.nodes):
        found = eager_layout_mismatch(node)
        if found is None:
            continue
        _pin(gm.graph, node)
        pinned.append({"node": node.name, "op": str(node.target), "fake_order": list(found[0]),
                       "eager_order": list(found[1]), "source": node_source(node)})
    if pinned:
        gm.recompile()
    return pinned


def pin_aot_graph(gm: torch.fx.GraphModule, kind: str, report) -> None:
    """:func:`pin_layouts` on one AOT graph of ``report``'s graph; records ``report.layout_pins`` and logs
    one INFO line per pinned node. Never raises: an audit that fails leaves the graph as it is (DEBUG)."""
    try:
        pins = pin_layouts(gm)
    except Exception:  # noqa: BLE001 - the audit must not stop a compile
        log.debug("qwen_npu %s: layout audit of the %s graph failed", report.name, kind, exc_info=True)
        return
    for pin in pins:
        pin["graph"] = kind
        log.info("qwen_npu %s: %s graph: %s (%s) is laid out %s by its eager kernel but %s by its fake kernel "
                 "(a torch meta-kernel bug); its output is copied to the traced layout",
                 report.name, kind, pin["op"], pin["source"], pin["eager_order"], pin["fake_order"])
    report.layout_pins.extend(pins)
