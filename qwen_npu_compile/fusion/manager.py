"""The *fuse* stage: run the enabled families' pattern passes over a canonical ATen graph.

Pipeline: canonicalize (:mod:`~qwen_npu_compile.graph.canonicalize`) → **fuse** → emit
(:mod:`~qwen_npu_compile.graph.emit`) → hand off (:mod:`~qwen_npu_compile.handoff`).

:class:`FusionPasses` is the pass manager (in the style of vLLM's ``PostGradPassManager`` configured by
its ``PassConfig``): built from a :class:`~qwen_npu_compile.config.QwenNpuConfig` in one place
(:meth:`FusionPasses.from_config`), it runs one :class:`~qwen_npu_compile.fusion.family.FamilyPass` per
enabled family in registry order (``qwen_npu_compile.patterns.FAMILIES``) and says, for every disabled
family, where its anchor ops show that it could have fused. :func:`fuse` is the public entry point
(the backend and ``benchmarks/capture.py`` call it)::

    result = fuse(aten_gm, QwenNpuConfig.from_options({"fusions": "all"}),
                  target=CompileTarget(downstream="aot_eager", simulated=True))
    result.fusions   # {"rms_norm": 5, "swiglu": 2, "rotary": 4, "attention": 2}
    result.variants  # {"rms_norm_half": 5, "swiglu_linear_silu_left": 2, ...}
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import torch._dynamo.exc
import torch.fx

from qwen_npu_compile.config import ALL_FAMILIES, QwenNpuConfig
from qwen_npu_compile.fusion.family import (
    CompileTarget,
    Refusal,
    RefusalRecorder,
    binding_region_operands,
    counting_matches,
    targeting,
)
from qwen_npu_compile.graph import canonicalize
from qwen_npu_compile.graph.utils import checkpoint_operands, fusion_graphs


@dataclasses.dataclass
class FuseResult:
    """What :func:`fuse` did to one graph.

    Attributes:
        families: the enabled families, in pass order.
        fusions: per enabled family, the subgraphs replaced by a fused op.
        variants: per variant name, the replacements it applied (only variants that matched).
        anchors: per enabled family, its anchor ops in the graph before its pass ran.
        already_fused: per enabled family, fused ops the graph held before its pass ran.
        refusals: every refusal and near miss still in the graph (enabled families), and every anchor of
            a disabled family (reason ``family '<name>' is disabled``).
        seconds: wall time of the stage (registration of newly needed variants included).
    """

    families: list[str]
    fusions: dict[str, int] = dataclasses.field(default_factory=dict)
    variants: dict[str, int] = dataclasses.field(default_factory=dict)
    anchors: dict[str, int] = dataclasses.field(default_factory=dict)
    already_fused: dict[str, int] = dataclasses.field(default_factory=dict)
    refusals: list[Refusal] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


class FusionPassError(RuntimeError):
    """A family's pass raised (a bug of ours, never the user's): the backend compiles the captured graph unfused and
    names the family (``report.fallback``: ``"the <family> pass raised: <type>: <message>"``).

    Attributes:
        family: the family whose pass raised; the original exception is ``__cause__``.
    """

    def __init__(self, family: str, cause: BaseException):
        super().__init__(f"the {family} pass raised: {type(cause).__name__}: {cause}")
        self.family = family


@dataclasses.dataclass(frozen=True)
class FusionPasses:
    """The ordered fusion passes of one configuration.

    Attributes:
        enabled: families whose pass runs, in pass order.
        disabled: the other known families (their anchors are reported as refusals, nothing else).
    """

    enabled: tuple[str, ...]
    disabled: tuple[str, ...]

    @classmethod
    def from_config(cls, config: QwenNpuConfig) -> FusionPasses:
        """The passes ``config.fusions`` enables, in the registry's pass order."""
        return cls(
            enabled=tuple(family for family in ALL_FAMILIES if family in config.fusions),
            disabled=tuple(family for family in ALL_FAMILIES if family not in config.fusions),
        )

    def describe(self) -> list[str]:
        """One line per pass, in order (for logs and bug reports): ``"rms_norm: RmsNormPass, 2 variants"``."""
        from qwen_npu_compile.patterns import get_family_pass

        lines = []
        for family in self.enabled:
            family_pass = get_family_pass(family)
            lines.append(f"{family}: {type(family_pass).__name__}, {len(family_pass.declared_variants)} variants")
        return lines + [f"{family}: disabled" for family in self.disabled]

    def run(self, gm: torch.fx.GraphModule, *, target: CompileTarget) -> FuseResult:
        """Fuse ``gm`` in place (see :func:`fuse`)."""
        from qwen_npu_compile.patterns import get_family_pass

        start = time.perf_counter()
        result = FuseResult(families=list(self.enabled))
        recorder = RefusalRecorder()
        matched: Counter[str] = Counter()
        graphs = fusion_graphs(gm)  # gm and its activation-checkpointed regions' bodies
        operands = checkpoint_operands(gm)  # what the regions' callers bind to their bodies' inputs
        with targeting(target), counting_matches(matched), binding_region_operands(operands):
            for family in self.enabled:
                try:
                    family_pass = get_family_pass(family)
                    result.already_fused[family] = sum(family_pass.count_fused(g.graph) for g in graphs)
                    result.anchors[family] = sum(family_pass.count_anchors(g.graph) for g in graphs)
                    result.fusions[family] = sum(family_pass.apply(g, recorder) for g in graphs)
                except torch._dynamo.exc.RestartAnalysis:
                    raise  # Dynamo recaptures and calls the backend again: not a failure
                except Exception as exc:
                    raise FusionPassError(family, exc) from exc
        for family in self.disabled:
            # a disabled family is not matched; say so wherever its anchor op shows it could have been
            for anchor in (a for g in graphs for a in get_family_pass(family).anchor_nodes(g.graph)):
                recorder.refuse(family, anchor, f"family {family!r} is disabled (fusions={sorted(self.enabled)})")
        # Nodes a replacement left without users go now, so that only anchors still computed are reported.
        for graph_module in graphs:
            graph_module.graph.eliminate_dead_code()
        result.refusals = recorder.live([g.graph for g in graphs])
        result.variants = dict(matched)
        result.seconds = time.perf_counter() - start
        return result


def fuse(aten_gm: torch.fx.GraphModule, config: QwenNpuConfig, *, target: CompileTarget) -> FuseResult:
    """Run the fusion passes ``config`` enables over ``aten_gm``, in place.

    Args:
        aten_gm: a canonical pre-dispatch ATen graph (:func:`qwen_npu_compile.graph.canonicalize.to_aten_graph`)
            whose nodes carry ``meta["val"]`` (FakeTensors): the checks read shapes and dtypes from them.
        config: the backend settings; only ``fusions`` is read.
        target: what the rewritten graph will run on; the checks whose answer depends on it read it
            (:func:`qwen_npu_compile.fusion.family.current_target`).

    Returns:
        The :class:`FuseResult`. The graph is rewritten but not recompiled: finish it with
        :func:`qwen_npu_compile.graph.emit.finalize`.

    Raises:
        ValueError: a family declares two variants with one name (a bug in ``patterns/``).
    """
    return FusionPasses.from_config(config).run(aten_gm, target=target)


def count_fused_in_captured(gm: torch.fx.GraphModule, families: list[str]) -> dict[str, int]:
    """Per family of ``families``, the fused npu ops a *captured* (Dynamo) graph already holds, for a graph
    that compiles unfused (``backend.compile_unfused``), so that a monkey-patched model's fused ops are
    reported as already fused there too (verl's ``npu_patch`` MoE block, whose custom autograd.Function
    makes the graph fall back: ``canonicalize.refuse_custom_autograd_functions``).

    Dynamo's graph may name an op as an ``OpOverload``, an ``OpOverloadPacket`` (``torch.ops.npu.x``) or a
    torch_npu function; all are matched by op name against the family's
    :attr:`~qwen_npu_compile.fusion.family.FusionFamily.fused_op_names`. The graph's submodules are counted
    (activation-checkpoint bodies, ``autograd_function_apply``'s forward body) except the backward bodies of
    ``autograd_function_apply``, whose ops belong to the backward (``npu_grouped_matmul`` for dx and dW).

    Returns:
        ``{family: count}`` for each family (0 where it holds none).
    """
    from qwen_npu_compile.patterns import get_family_pass

    backward_bodies = set()
    for module, node in canonicalize.custom_autograd_function_applies(gm):
        body = node.args[1] if len(node.args) > 1 else None
        if isinstance(body, torch.fx.Node) and body.op == "get_attr":
            backward_bodies.add(id(getattr(module, body.target, None)))
    names: Counter[str] = Counter()
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule) and id(module) not in backward_bodies:
            names.update(name for node in module.graph.nodes if node.op == "call_function"
                         and (name := _npu_op_name(node.target)) is not None)
    return {family: sum(names[op] for op in get_family_pass(family).family.fused_op_names) for family in families}


def _npu_op_name(target) -> str | None:
    """``"npu_rms_norm"`` for ``torch.ops.npu.npu_rms_norm(.default)`` or a torch_npu function of that name."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1] if target.namespace == "npu" else None
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace, _, name = target._qualified_op_name.partition("::")
        return name if namespace == "npu" else None
    if str(getattr(target, "__module__", None) or "").startswith("torch_npu"):
        return getattr(target, "__name__", None)
    return None
