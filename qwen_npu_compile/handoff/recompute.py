"""Activation recompute of the cheap fused ops: what each compiled layer keeps for its backward.

AOTAutograd splits the joint forward + backward graph into a forward and a backward graph; every forward value
the backward reads is saved (kept alive from the forward to the backward) unless the partitioner recomputes it.
``default_partition`` (what ``aot_eager`` here and torchair's AOT step use: torch_npu 2.13 / 2.14
``torchair/npu_fx_compiler.py`` ``_get_partition_fn``) saves every such value, except forward nodes tagged
``node.meta["recompute"]`` with :class:`torch.utils.checkpoint.CheckpointPolicy` ``PREFER_RECOMPUTE``
(selective activation checkpointing's tags): those it recomputes in the backward from what is saved anyway.

``recompute="cheap"`` (option, or ``QWEN_NPU_RECOMPUTE``) tags, in the joint graph:

- the forward calls of the ops whose own module declares them cheap (``RECOMPUTE_CHEAP`` in
  :mod:`qwen_npu_compile.ops`: ``npu_rms_norm``, ``npu_add_rms_norm``, ``npu_swiglu``, ``npu_rotary_mul``,
  ``qwen_npu::rotary_mul_orthogonal``, ``qwen_npu::rotary_mul_aten_backward``): one memory-bound pass each, no
  matmul;
- the views, pointwise ops and concatenations fed by a tagged node (the gated norm's ``stack``, a normed hidden
  state reshaped for a projection, ``silu(gate) * up`` epilogues): what the backward reads is usually a view
  of the fused op's output, which would otherwise keep its storage alive.

Never attention, matmuls, grouped matmuls or the delta rule (their outputs are saved as before), never a random
op. Recomputing a deterministic op gives the same bits, so values and gradients equal ``recompute="none"``'s
(``tests/handoff/test_recompute.py``). ``"none"`` (the default) leaves the joint graph untagged: today's partition.

torchair has no partitioner option: the hand-off wraps its module-level ``_get_partition_fn`` (the only hook it
has; :func:`qwen_npu_compile.handoff.torchair.recompute_in_torchair`) so that, for this compile's ``CompilerConfig``, the
partition it returns is :func:`partition_fn`'s; GE then converts and runs the recomputed nodes in the backward graph
like any other.
"""

from __future__ import annotations

import importlib
import operator
from collections import Counter
from collections.abc import Callable

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from qwen_npu_compile.config import RECOMPUTE_SETTINGS

#: The op modules that declare ``RECOMPUTE_CHEAP`` (the one place each op's cheapness is stated is its module).
_OP_MODULES = ("torch_npu.rms_norm", "torch_npu.add_rms_norm", "torch_npu.swiglu", "torch_npu.rotary_mul",
               "qwen_npu.rotary_mul_orthogonal", "qwen_npu.rotary_mul_aten_backward")

#: The checkpoint-region id of every node tagged here (``node.meta["ac_graph_id"]``, which torch 2.9's partitioner
#: reads from every tagged node). One id for all: no forced save between two of ours; user regions' ids count from 1
#: (``torch/_higher_order_ops/wrap.py``), so a tagged node feeding one is saved at that region's boundary.
AC_GRAPH_ID = 0

aten = torch.ops.aten
#: Data-movement ops that follow a tagged node into the recompute (their output aliases or copies its values).
_FOLLOW = frozenset({
    operator.getitem, aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
    aten.transpose.int, aten.permute.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.slice.Tensor, aten.select.int, aten.alias.default, aten.clone.default,
    aten.contiguous.default, aten._to_copy.default, aten.cat.default, aten.stack.default,
    aten.split.Tensor, aten.split_with_sizes.default,
})


def cheap_ops() -> frozenset[str]:
    """The qualified names (``"npu::npu_rms_norm"``) of the ops declared cheap by their modules."""
    names = set()
    for module in _OP_MODULES:
        names.update(importlib.import_module(f"qwen_npu_compile.ops.{module}").RECOMPUTE_CHEAP)
    return frozenset(names)


def _op_name(node: torch.fx.Node) -> str:
    name = getattr(node.target, "name", None)
    return name().split(".")[0] if callable(name) else ""


def _follows(node: torch.fx.Node) -> bool:
    target = node.target
    if target in _FOLLOW:
        return True
    tags = getattr(target, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def _backward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The joint graph's nodes that depend on a tangent (the backward part; the rest is the forward)."""
    backward: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and "tangent" in node.name) or any(i in backward for i in node.all_input_nodes):
            backward.add(node)
    return backward


def tag_cheap(joint: torch.fx.GraphModule) -> Counter:
    """Tag the cheap forward nodes of the AOT joint graph ``joint`` ``PREFER_RECOMPUTE`` (module docstring); in place.

    Returns:
        Per declared op (``"npu::npu_rms_norm"``), how many of its forward calls were tagged (the nodes that follow
        them are tagged too, uncounted).
    """
    cheap = cheap_ops()
    backward = _backward_nodes(joint.graph)
    tagged: set[torch.fx.Node] = set()
    counts: Counter = Counter()
    for node in joint.graph.nodes:
        if node.op != "call_function" or node in backward or "recompute" in node.meta:
            continue  # a user's own checkpoint policy wins
        name = _op_name(node)
        if name in cheap:
            counts[name] += 1
        elif not (_follows(node) and any(i in tagged for i in node.all_input_nodes)):
            continue
        node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        node.meta["ac_graph_id"] = AC_GRAPH_ID
        tagged.add(node)
    return counts


def partition_fn(setting: str, partition: Callable, on_tagged: Callable[[Counter], None] | None = None) -> Callable:
    """``partition`` (a ``partition_fn(joint, inputs, **kwargs)``), tagging first when ``setting == "cheap"``.

    Args:
        setting: one of :data:`~qwen_npu_compile.config.RECOMPUTE_SETTINGS`.
        partition: the partitioner to call (``default_partition``).
        on_tagged: called with :func:`tag_cheap`'s counts (the graph report records them).

    Raises:
        ValueError: ``setting`` is not one of :data:`~qwen_npu_compile.config.RECOMPUTE_SETTINGS` (validated earlier by the config).
    """
    if setting not in RECOMPUTE_SETTINGS:
        raise ValueError(f"recompute={setting!r}; choose one of {list(RECOMPUTE_SETTINGS)}")
    if setting == "none":
        return partition

    def recomputing_partition(joint, joint_inputs, **kwargs):
        counts = tag_cheap(joint)
        if on_tagged is not None:
            on_tagged(counts)
        return partition(joint, joint_inputs, **kwargs)

    recomputing_partition.__wrapped__ = partition
    return recomputing_partition
