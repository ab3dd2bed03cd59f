"""Graph helpers every stage uses (canonicalize, fuse, emit, hand off, the families in ``patterns/``).

The lowest graph module of the package: it imports only :mod:`.compat`, and :mod:`.canonicalize` and
:mod:`.fusion` both import it (neither imports the other back). It holds:

- :func:`node_source`: the model source line of a node (every refusal and log line names it);
- pattern tracing: :func:`trace_pattern` and the normalisations it shares with the model graphs
  (:func:`normalize`, :func:`remove_noop_casts`, :func:`remove_constant_detach_`, and
  :func:`remove_noop_slices`, for graphs only);
- activation-checkpointed regions: :func:`checkpoint_calls`, :func:`checkpoint_bodies`,
  :func:`checkpoint_operands`, :func:`fusion_graphs`;
- custom ``torch.autograd.Function`` walks: :func:`custom_autograd_function_applies`;
- :func:`ancestors` of a node; :func:`share_first`: one node per key, the first in graph order (the
  families share mask conversions and varlen offsets with it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from qwen_npu_compile import compat

aten = torch.ops.aten

#: ``aten.to`` overloads: they return ``self`` when nothing changes, so erasing them is exact.
_TO_OPS = (aten.to.dtype, aten.to.dtype_layout)


# --------------------------------------------------------------------------------------------------
# node source


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


_TORCH_DIR = os.path.dirname(torch.__file__)


def node_source(node: torch.fx.Node) -> str:
    """``file:line`` of the model code that produced ``node``, or ``"<unknown>"``.

    The innermost frame of a transformers ``modeling_*.py`` file wins (``modeling_qwen2.py:63`` is
    more useful than the ``activations.py`` line of ``nn.SiLU``); otherwise the innermost frame
    outside torch itself.
    """
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return "<unknown>"
    modeling = [frame for frame in frames if frame[0].rsplit("/", 1)[-1].startswith("modeling_")]
    outside_torch = [frame for frame in frames if not frame[0].startswith(_TORCH_DIR)]
    path, line = (modeling or outside_torch or frames)[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}"


# --------------------------------------------------------------------------------------------------
# normalisation and pattern tracing


def _tensor_in_out(node: torch.fx.Node) -> tuple[torch.fx.Node | None, object, object]:
    """``(source node, its FakeTensor, node's FakeTensor)`` of a unary tensor op, or ``(None, None, None)``
    when the first argument is not a node or either value is not a tensor."""
    source = node.args[0] if node.args else None
    if not isinstance(source, torch.fx.Node):
        return None, None, None
    val_in, val_out = source.meta.get("val"), node.meta.get("val")
    if not isinstance(val_in, torch.Tensor) or not isinstance(val_out, torch.Tensor):
        return None, None, None
    return source, val_in, val_out


def remove_noop_casts(graph: torch.fx.Graph) -> int:
    """Erase ``aten.to`` nodes whose input already has the requested dtype.

    Only plain dtype casts are removed (no layout, device, memory_format or ``copy=True``).

    Returns:
        The number of casts removed.
    """
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _TO_OPS:
            continue
        source, val_in, val_out = _tensor_in_out(node)
        if source is None:
            continue
        if node.kwargs.get("copy") or (len(node.args) > 3 and node.args[3]):
            continue
        if node.kwargs.get("memory_format") not in (None, torch.preserve_format):
            continue
        same = (
            val_in.dtype == val_out.dtype
            and val_in.device == val_out.device
            and val_in.layout == val_out.layout
            and val_in.shape == val_out.shape
        )
        if same:
            node.replace_all_uses_with(source)
            graph.erase_node(node)
            removed += 1
    return removed


def remove_noop_slices(graph: torch.fx.Graph) -> int:
    """Erase ``aten.slice.Tensor`` nodes that take the whole of a dimension of static size.

    ``x[:, :, None]`` slices every dimension it passes over. Since torch 2.8, tensor indexing returns
    ``x`` itself for a full slice of a static dimension and the pre-dispatch trace holds no node for
    it; torch 2.7 records ``aten.slice(x, dim, 0, 9223372036854775807)`` (e.g. four of them around
    transformers' ``repeat_kv``). Removing them gives every supported torch the same graph. A slice
    of a symbolic dimension is kept, as every torch keeps it (deciding it is full would need a guard).

    Graphs only, not patterns: patterns spell their slices with explicit ATen calls (the full slice
    standing for a symbolic dimension is traced on static example sizes and must stay), and index
    nothing that would leave a static full slice.

    Returns:
        The number of slices removed.
    """
    removed = 0
    for node in list(graph.find_nodes(op="call_function", target=aten.slice.Tensor)):
        source, val_in, val_out = _tensor_in_out(node)
        if source is None:
            continue
        names = ("dim", "start", "end", "step")
        given = dict(zip(names, node.args[1:]), **node.kwargs)
        dim, start, step = given.get("dim", 0), given.get("start"), given.get("step", 1)
        if not isinstance(dim, int) or start not in (None, 0) or step != 1 or val_in.dim() == 0:
            continue
        size, kept = val_in.shape[dim], val_out.shape[dim]
        if type(size) is int and type(kept) is int and size == kept:  # SymInts never compared: no guards
            node.replace_all_uses_with(source)
            graph.erase_node(node)
            removed += 1
    return removed


def remove_constant_detach_(graph: torch.fx.Graph) -> int:
    """Erase ``aten.detach_`` of a ``lift_fresh_copy`` (make_fx's spelling of ``torch.tensor(0.125)``
    created in the forward: a fresh copy of a real constant, which needs no grad, so ``detach_`` is a no-op).

    Inductor's pattern matcher treats every in-place op as a mutation barrier and never matches across
    one, so such a constant used inside a subgraph (a tensor ``variance_epsilon`` made in the norm's
    forward) would otherwise split it.

    Returns:
        The number of ``detach_`` nodes removed.
    """
    removed = 0
    for node in list(graph.find_nodes(op="call_function", target=aten.detach_.default)):
        source = node.args[0] if node.args else None
        if isinstance(source, torch.fx.Node) and source.target is aten.lift_fresh_copy.default:
            node.replace_all_uses_with(source)
            graph.erase_node(node)
            removed += 1
    return removed


def normalize(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Apply every normalisation in place (:func:`remove_noop_casts`, :func:`remove_constant_detach_`)
    and recompile."""
    remove_noop_casts(gm.graph)
    remove_constant_detach_(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm


def trace_pattern(fn: Callable[..., object], args: Sequence[object], **_ignored) -> torch.fx.GraphModule:
    """Trace a pattern or replacement function exactly as :func:`~qwen_npu_compile.graph.canonicalize.to_aten_graph` traces models.

    This is the ``trace_fn`` given to Inductor's ``register_replacement``; it must accept (and here
    ignores) the ``get_decomp_fn`` keyword: pre-dispatch graphs are matched undecomposed.
    """
    with torch.fx.traceback.preserve_node_meta():
        gm = make_fx(fn, pre_dispatch=True)(*args)
    return normalize(gm)

# --------------------------------------------------------------------------------------------------
# Activation-checkpointed regions
#
# Non-reentrant ``torch.utils.checkpoint`` (transformers' gradient_checkpointing_enable, HF Trainer's
# gradient_checkpointing=True) reaches the backend as one call per region,
# ``tag_activation_checkpoint(wrap_body_N, *inputs, use_reentrant=False)``, whose body is a Dynamo
# GraphModule attribute (:mod:`.canonicalize` canonicalizes each body on its own). The fusion passes run
# on the top-level graph and on every body (:func:`fusion_graphs`): the recomputation in the backward
# runs the same fused ops.


def checkpoint_calls(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The ``tag_activation_checkpoint`` call nodes of ``graph``, in graph order."""
    return list(graph.find_nodes(op="call_function", target=compat.CHECKPOINT_HOP))


def checkpoint_bodies(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """The body GraphModules of ``gm``'s ``tag_activation_checkpoint`` calls, in graph order, each once."""
    seen: dict[str, torch.fx.GraphModule] = {}
    for call in checkpoint_calls(gm.graph):
        seen.setdefault(call.args[0].target, getattr(gm, call.args[0].target))
    return list(seen.values())


def checkpoint_operands(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, list[object]]:
    """What the calling graphs pass for each placeholder of a checkpointed region's body, depth first.

    ``tag_activation_checkpoint(body, *operands)`` calls ``body(*operands)``: the i-th placeholder of
    the body receives the i-th operand. A body called by several regions maps to every caller's operand.

    Returns:
        Body placeholder node -> the operands (nodes of the calling graph, or constants) bound to it.
    """
    operands: dict[torch.fx.Node, list[object]] = {}
    for call in checkpoint_calls(gm.graph):
        body = getattr(gm, call.args[0].target)
        for placeholder, operand in zip(body.graph.find_nodes(op="placeholder"), call.args[1:]):
            operands.setdefault(placeholder, []).append(operand)
    for body in checkpoint_bodies(gm):
        for placeholder, bound in checkpoint_operands(body).items():
            operands.setdefault(placeholder, []).extend(bound)
    return operands


def fusion_graphs(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """``gm`` and, depth first, the body of every checkpointed region it calls: the graphs to fuse."""
    return [gm, *(graph for body in checkpoint_bodies(gm) for graph in fusion_graphs(body))]


# --------------------------------------------------------------------------------------------------
# custom autograd functions


def custom_autograd_function_applies(gm: torch.fx.GraphModule) -> Iterator[tuple[torch.fx.GraphModule, torch.fx.Node]]:
    """``(module, node)`` for every ``autograd_function_apply`` HOP node (a custom ``torch.autograd.Function``
    in Dynamo's graph: ``node.args[0]`` / ``[1]`` are ``get_attr`` nodes of its forward / backward body) in
    ``gm`` and its submodules; nothing where torch has no such HOP."""
    hop = getattr(torch.ops.higher_order, "autograd_function_apply", None)
    if hop is None:
        return
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.find_nodes(op="call_function", target=hop):
                yield module, node


# --------------------------------------------------------------------------------------------------
# ancestors; sharing identical nodes


def ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    """``node`` and every node it depends on (its inputs, their inputs, ...)."""
    seen, stack = {node}, [node]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                stack.append(arg)
    return seen


def share_first(graph: torch.fx.Graph, keyed: Iterable[tuple[torch.fx.Node, Hashable]],
                on_first: Callable[[torch.fx.Node, Hashable], None] | None = None) -> int:
    """Keep the first node of each key and point every later one's uses at it (the later ones are erased).

    Args:
        graph: the graph holding the nodes.
        keyed: ``(node, key)`` pairs in graph order (nodes of one key compute the same value, so the first
            precedes every use of the later ones); read lazily, after ``on_first`` ran on earlier nodes.
        on_first: called with ``(node, key)`` on the first node of each key (e.g. to rewire or move it).

    Returns:
        How many nodes were erased.
    """
    first: dict[Hashable, torch.fx.Node] = {}
    removed = 0
    for node, key in keyed:
        if key not in first:
            first[key] = node
            if on_first is not None:
                on_first(node, key)
            continue
        node.replace_all_uses_with(first[key])
        graph.erase_node(node)
        removed += 1
    return removed
