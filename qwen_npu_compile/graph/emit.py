"""The *emit* stage: finish the rewritten graph and say what the fuse stage did.

Pipeline: canonicalize (:mod:`~qwen_npu_compile.graph.canonicalize`) → fuse (:mod:`~qwen_npu_compile.fusion.manager`)
→ **emit** → hand off (:mod:`~qwen_npu_compile.handoff`).

The fused ops are already in the graph (the fuse stage's replacements emit
``torch.ops.npu.<op>.default`` calls: the real torch_npu ops or the stand-ins of
:mod:`qwen_npu_compile.ops`). Emitting makes the graph a valid module again (:func:`finalize`),
records the fuse result in the graph's report (:func:`record`), and turns tensor constants into
trailing inputs for the downstream backend (:func:`lift_constants`, :func:`bind_trailing_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.fx

from qwen_npu_compile.graph import canonicalize
from qwen_npu_compile.graph.utils import fusion_graphs

if TYPE_CHECKING:  # types only: the graph stage sits below fusion and the reports (tests/test_layers.py)
    from qwen_npu_compile.fusion.manager import FuseResult
    from qwen_npu_compile.report import GraphReport


def finalize(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Remove dead nodes, check the graph (``Graph.lint``) and regenerate ``gm``'s code, and the same for
    the body of every activation-checkpointed region it calls; returns ``gm``.

    Raises:
        RuntimeError: the rewritten graph is malformed (``Graph.lint``: a use before its definition, a
            dangling node); a bug of a pattern's replacement.
    """
    for graph_module in reversed(fusion_graphs(gm)):  # checkpointed regions' bodies first
        graph_module.graph.eliminate_dead_code()
        graph_module.graph.lint()
        graph_module.recompile()
    return gm


def record(report: GraphReport, result: FuseResult) -> None:
    """Copy the fuse stage's counts, refusals and time into ``report``."""
    report.fusions.update(result.fusions)
    report.variants.update(result.variants)
    report.anchors.update(result.anchors)
    report.already_fused.update(result.already_fused)
    report.refused = list(result.refusals)
    report.seconds["fuse"] = result.seconds


def lift_constants(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Turn ``gm``'s tensor constants into trailing placeholders (torchair and AOTAutograd want inputs);
    returns them, in placeholder order, to be passed after the caller's inputs
    (:func:`qwen_npu_compile.graph.canonicalize.lift_tensor_constants`)."""
    return canonicalize.lift_tensor_constants(gm)


def bind_trailing_inputs(compiled: Callable, extra: list[torch.Tensor]) -> Callable:
    """Wrap ``compiled`` so that ``extra`` is passed after the caller's inputs (``compiled`` itself when
    ``extra`` is empty).

    Dynamo calls a backend's result as ``fn(*args)``. (``_boxed_call`` is not a reliable signal here:
    ``functools.wraps`` copies it onto AOTAutograd's unboxed ``forward``.)
    """
    if not extra:
        return compiled

    def run(*args):
        return compiled(*args, *extra)

    return run
