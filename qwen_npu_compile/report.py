"""What every compile reports: one :class:`GraphReport` per compiled graph, its log line, and the
process-wide list of them (:func:`get_reports`).

The report is filled along the pipeline, canonicalize → fuse → emit → hand off: the canonicalize and
fuse timings, the fuse stage's counts and refusals (recorded by :func:`qwen_npu_compile.graph.emit.record`),
the npu ops of the AOT / GE graphs (hand off). Writing it to disk (``report.json`` per graph, the dump
folder's ``summary.json``) is :mod:`qwen_npu_compile.dump`'s job.

``report.json`` is :meth:`GraphReport.as_dict`: the attributes below, ``refused`` as
``[{"family", "reason", "source", "node"}]``. Field ``variants``:
``{variant name: replacements applied}`` for the variants that matched, e.g.
``{"rms_norm_half": 5, "swiglu_linear_silu_left": 2}``; per family they add up to ``fusions``.
Field ``layout_pins``: the AOT graph nodes pinned to their traced layout
(:mod:`qwen_npu_compile.handoff.aot_layout`). Fields ``fallback_stage`` and ``downstream_fallbacks``: the stage whose failure made
the graph compile unfused, and every time the downstream backend failed and the graph ran one step
further down (``torchair`` → ``aot_eager`` → ``eager``; :mod:`qwen_npu_compile.handoff`).
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import threading
from collections import Counter

import torch

from qwen_npu_compile.fusion.family import Refusal

log = logging.getLogger("qwen_npu_compile")


class FusionError(RuntimeError):
    """Raised in strict mode when an enabled family refused or near-missed a match, or when a stage
    (canonicalize, fuse, emit, hand-off, dump, report) failed where the default is to fall back."""


@dataclasses.dataclass
class GraphReport:
    """The outcome of one ``qwen_npu`` compile of one Dynamo graph.

    Attributes:
        name: unique in the process, ``g<index>_<dynamo compile id>``.
        simulated: True when the npu ops are this package's stand-ins.
        downstream: what actually runs the graph: the configured downstream backend, or what it fell back
            to (``"aot_eager"`` after torchair failed on every AOT graph it was given, ``"eager"`` after
            aot_eager failed; ``"torchair+aot_eager"`` when torchair runs some of the graph's AOT graphs
            and the others run eagerly). See ``downstream_fallbacks``.
        families: the enabled families.
        fusions: per family, the number of subgraphs replaced by a fused op.
        variants: per pattern variant name, the replacements it applied (matched variants only).
        already_fused: per family, fused ops the captured graph already held (monkey-patched models).
        anchors: per family, anchor ops seen before fusion (an upper bound of what could fuse).
        refused: every refusal and near miss, with reason and model source line.
        seconds: wall time per stage (``canonicalize``, ``fuse``), seconds.
        aot_ops: npu op counts in the AOT ``forward`` and ``backward`` graphs (aot_eager downstream).
        aot_qwen_npu_ops: the same for our own ``torch.ops.qwen_npu`` ops (e.g. ``chunk_gated_delta_rule_backward``).
        fallback: why the graph was compiled unfused (it could not be retraced faithfully, or a stage of
            ours raised), or None.
        fallback_stage: the stage that failed when ``fallback`` is set (``"canonicalize"``, ``"fuse"`` or
            ``"emit"``), else None.
        downstream_fallbacks: each failure of the downstream backend this graph survived, oldest first:
            ``{"backend": failed backend, "ran": what runs instead, "graph": "whole" | "forward" |
            "backward" | "inference", "when": "compile" | "first run", "node": FX node or None,
            "source": model source line, "error": "<type>: <message>"}``.
        ge: torchair's FX→GE conversion of this graph when the downstream is torchair off-NPU (torch_npu
            version, GE op counts per GE graph, every node that failed to convert), else None; a
            ``qwen_npu_compile.torchair.offline.GeResults`` (not imported here: torchair/offline imports
            this module, never the other way round).
        layout_pins: every node of the AOT graphs whose output was copied to the layout AOTAutograd traced
            it with, because its eager kernel lays it out otherwise than its fake kernel (a torch bug,
            :mod:`qwen_npu_compile.handoff.aot_layout`): ``{"graph": "forward" | "backward" | "inference", "node",
            "op", "fake_order", "eager_order", "source"}``.
        recomputed: with ``recompute="cheap"``, per declared cheap op (``"npu::npu_rms_norm"``), how many of its
            forward calls were tagged for recompute (:mod:`qwen_npu_compile.handoff.recompute`): the backward recomputes each
            one it reads instead of saving it (a tagged output that leaves the graph, at a graph break, is an output
            as before); empty otherwise or before the AOT partition (inference graphs are not partitioned).
    """

    name: str
    simulated: bool
    downstream: str
    families: list[str]
    fusions: dict[str, int] = dataclasses.field(default_factory=dict)
    variants: dict[str, int] = dataclasses.field(default_factory=dict)
    already_fused: dict[str, int] = dataclasses.field(default_factory=dict)
    anchors: dict[str, int] = dataclasses.field(default_factory=dict)
    refused: list[Refusal] = dataclasses.field(default_factory=list)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    aot_ops: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    aot_qwen_npu_ops: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    dump_path: str | None = None
    fallback: str | None = None
    fallback_stage: str | None = None
    downstream_fallbacks: list[dict] = dataclasses.field(default_factory=list)
    ge: object | None = None  # torchair.offline.GeResults
    layout_pins: list[dict] = dataclasses.field(default_factory=list)
    recomputed: dict[str, int] = dataclasses.field(default_factory=dict)

    def note_recomputed(self, counts) -> None:
        """Record :func:`qwen_npu_compile.handoff.recompute.tag_cheap`'s counts of one partition (added up)."""
        for name, count in counts.items():
            self.recomputed[name] = self.recomputed.get(name, 0) + count

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["refused"] = [refusal.as_dict() for refusal in self.refused]
        return data

    def log_line(self) -> str:
        # the enabled families this graph holds anything of (a fusion, or an anchor op that could have fused)
        shown = [f for f in self.families if self.fusions.get(f, 0) or self.anchors.get(f, 0)]
        fused = (", ".join(f"{family} {self.fusions.get(family, 0)}" for family in shown)
                 or ("nothing (no anchor op of an enabled family)" if self.families else "no family enabled"))
        extra = f"; already fused: {self.already_fused}" if any(self.already_fused.values()) else ""
        enabled = [r for r in self.refused if r.family in self.families]
        refused = ""
        if enabled:
            first = enabled[0]
            refused = f"; {len(enabled)} refused (first: {first.family}: {first.reason} at {first.source})"
        disabled = Counter(r.family for r in self.refused if r.family not in self.families)
        if disabled:
            refused += "; left to disabled families: " + ", ".join(f"{family} {n}" for family, n in disabled.items())
        if self.ge is not None and self.ge.failures:
            refused += f"; {len(self.ge.failures)} node(s) failed GE conversion"
        if self.fallback:
            refused += f"; UNFUSED: {self.fallback}"
        for fell in self.downstream_fallbacks:
            refused += f"; {fell['backend']} failed ({fell['graph']}, {fell['when']}): ran {fell['ran']}"
        return (
            f"qwen_npu [{'simulated' if self.simulated else 'real'} npu ops] {self.name}: fused {fused}"
            f"{extra}{refused}; downstream {self.downstream}"
        )


def npu_op_counts(graph: torch.fx.Graph, namespace: str = "npu") -> dict[str, int]:
    """Count ``torch.ops.<namespace>.*`` calls in ``graph`` by op name (overload dropped)."""
    counts: Counter[str] = Counter()
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if node.target.namespace == namespace:
                counts[node.target._schema.name.split("::")[-1]] += 1
    return dict(sorted(counts.items()))


def versions() -> dict[str, str | None]:
    """Versions of everything that changes captured graphs (for reports and bug reports)."""
    import importlib.metadata as md

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "torch_npu": version("torch_npu") or version("torch-npu"),
        "torchair_offline": _offline_torchair_version(),
        "qwen_npu_compile": version("qwen_npu_compile"),
    }


#: The torch_npu version of the off-NPU torchair imported in this process (set by
#: :func:`note_offline_torchair`, which ``torchair.offline.importer`` calls), or None.
_OFFLINE_TORCHAIR: list[str] = []


def note_offline_torchair(torch_npu_version: str) -> None:
    """Record that the off-NPU torchair of ``torch_npu_version`` is imported (for :func:`versions`).

    Called by :func:`qwen_npu_compile.torchair.offline.importer.import_torchair`: the dependency runs
    from torchair/offline to this module only (no import cycle).
    """
    _OFFLINE_TORCHAIR[:] = [torch_npu_version]


def _offline_torchair_version() -> str | None:
    """The torch_npu version of the off-NPU torchair loaded in this process, or None."""
    return _OFFLINE_TORCHAIR[0] if _OFFLINE_TORCHAIR else None


class Summary:
    """Process-wide list of the reports of every graph ``qwen_npu`` compiled (each dump folder's
    ``summary.json`` lists only its own graphs: :mod:`qwen_npu_compile.dump`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.graphs: list[GraphReport] = []

    def next_index(self) -> int:
        with self._lock:
            return len(self.graphs)

    def add(self, report: GraphReport) -> None:
        with self._lock:
            self.graphs.append(report)

    def clear(self) -> None:
        with self._lock:
            self.graphs.clear()


#: Every graph compiled by ``qwen_npu`` in this process.
SUMMARY = Summary()


def get_reports() -> list[GraphReport]:
    """The reports of every graph compiled by ``qwen_npu`` in this process, oldest first."""
    return list(SUMMARY.graphs)


def new_graph_name() -> str:
    """A name unique in the process for the graph being compiled: ``g<index>_<Dynamo compile id>``
    (``g000_0_0``), ``eager`` in place of the id outside a Dynamo compile."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    return f"g{SUMMARY.next_index():03d}_{str(compile_id).replace('/', '_') if compile_id is not None else 'eager'}"
