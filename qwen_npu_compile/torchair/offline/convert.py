"""Record what torchair's FX→GE conversion made of each graph: GE op counts and every failed node.

torchair converts each AOT graph (forward, backward) in ``GeConcreteGraph``
(``torchair/_ge_concrete_graph/fx2ge_converter.py``): ``parse_node`` runs one FX node's GE converter,
``optimize_graph_without_runtime`` finishes the GE graph. :func:`install_recording` replaces the
module's ``GeConcreteGraph`` (looked up by ``npu_fx_compiler._NpuFxCompiler`` at each compile) with a
subclass that, for graphs whose ``CompilerConfig`` was registered with :func:`watch`:

- on a converter exception, records the node (op, error, model source line) and continues with
  torchair's own mock node (``_create_mock_node_for_op``), so one run reports every blocker;
- when the GE graph is complete, records its op types and the torch_npu ops of the FX graph.

Graphs of unregistered configs convert exactly as torchair does (exceptions propagate). A converted
node that breaks its op's kernel or converter limits (``ops/limits.py``) is recorded too
(``kind="limit"``): it would build a GE graph that cannot run.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import torch

from qwen_npu_compile.graph.utils import node_source

log = logging.getLogger("qwen_npu_compile")

UNKNOWN = "<unknown>"
#: How many levels of users to search for a source line when a node has none (a fused op's result
#: goes through getitem and view nodes before reaching a node that carries the model's stack trace).
SOURCE_SEARCH_DEPTH = 6

#: Longest error text kept per failure (torchair's messages embed whole argument lists).
MAX_ERROR_CHARS = 400


@dataclasses.dataclass
class GeFailure:
    """One FX node that torchair could not convert to GE.

    Attributes:
        op: the FX target, e.g. ``"aten.silu_backward.default"``.
        error: ``"<exception type>: <message>"``, whitespace collapsed, at most :data:`MAX_ERROR_CHARS`.
        source: ``file:line`` of the model code (:func:`qwen_npu_compile.fusion.family.node_source`).
        graph: the GE graph's name (``graph_<n>``).
        node: the FX node's name.
        kind: ``"converter"`` (torchair's converter raised) or ``"limit"`` (the node converted but breaks a
            kernel or GE converter limit of the op, :func:`qwen_npu_compile.ops.limits.node_violation`,
            e.g. fp32 q/k/v for FlashAttentionScore, which takes fp16/bf16 only).
    """

    op: str
    error: str
    source: str
    graph: str
    node: str
    kind: str = "converter"


@dataclasses.dataclass
class GeGraph:
    """One GE graph torchair built.

    Attributes:
        name: torchair's name, ``graph_<n>`` (unique in the process).
        kind: ``"backward"`` when the FX graph takes tangents, else ``"forward"``.
        ops: ``{GE op type: count}`` (``Data``, ``NetOutput``, ``Const`` included; not the ops made by
            nodes that failed to convert, nor their mock nodes).
        npu_ops: ``{torch_npu op: count}`` in the FX graph torchair converted (after its AOTAutograd).
        seconds: wall time from torchair creating the GE graph to its last graph pass (node conversion
            and torchair's GE graph passes; not its AOTAutograd trace).
    """

    name: str
    kind: str
    ops: dict[str, int]
    npu_ops: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


@dataclasses.dataclass
class GeResults:
    """torchair's conversion of one ``qwen_npu`` graph (its forward and, after backward, backward).

    Attributes:
        torch_npu: the torch_npu version whose torchair converted.
        torchair: ``"offline"`` (the wheel's torchair with stand-in extensions, ops simulated) or
            ``"real"``.
        mode: torchair's ``CompilerConfig.mode``.
        graphs: the GE graphs built, in order.
        failures: every node that failed to convert.
    """

    torch_npu: str
    torchair: str
    mode: str
    graphs: list[GeGraph] = dataclasses.field(default_factory=list)
    failures: list[GeFailure] = dataclasses.field(default_factory=list)


class _Watch:
    """Per-config recording target, with a callback run after each recorded GE graph.

    ``sources`` maps an autograd sequence number (``node.meta["seq_nr"]``) to the model source line of
    the forward node: backward nodes carry their forward op's ``seq_nr``, and the fused ops' nodes carry
    no ``stack_trace`` of their own (Inductor's pattern matcher copies it only to the node that replaces
    the matched output, here the ``getitem`` of the fused op's result).
    """

    def __init__(self, results: GeResults, on_graph: Callable[[GeGraph], None] | None) -> None:
        self.results = results
        self.on_graph = on_graph
        self.sources: dict[int, str] = {}
        self.failed_ops: dict[str, set[str]] = {}  # GE graph name -> names of GE ops made by failed nodes

    def source(self, node: torch.fx.Node) -> str:
        """The model source line of ``node``: its own, its forward op's, or its nearest user's."""
        found = node_source(node)
        if found == UNKNOWN and node.meta.get("seq_nr") is not None:
            found = self.sources.get(node.meta["seq_nr"], UNKNOWN)
        if found == UNKNOWN:
            found = _nearest_user_source(node)
        return found

    def learn_sources(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            seq_nr = node.meta.get("seq_nr")
            if node.op == "call_function" and seq_nr is not None and seq_nr not in self.sources:
                found = self.source(node)
                if found != UNKNOWN:
                    self.sources[seq_nr] = found


_WATCHES: dict[int, tuple[object, _Watch]] = {}
_LOCK = threading.Lock()


def watch(compiler_config, results: GeResults, on_graph: Callable[[GeGraph], None] | None = None) -> None:
    """Record the conversion of every graph compiled with ``compiler_config`` into ``results``.

    ``on_graph`` runs after each GE graph is recorded (e.g. to refresh a dump: the backward graph
    converts at the first backward call, long after the hand-off returned).
    """
    with _LOCK:
        _WATCHES[id(compiler_config)] = (compiler_config, _Watch(results, on_graph))


def _watch_of(compiler_config) -> _Watch | None:
    with _LOCK:
        entry = _WATCHES.get(id(compiler_config))
    return entry[1] if entry is not None and entry[0] is compiler_config else None


def _nearest_user_source(node: torch.fx.Node, depth: int = SOURCE_SEARCH_DEPTH) -> str:
    """Breadth-first over the users of ``node`` (getitem, view, ...): the first known source line."""
    frontier, seen = list(node.users), {node}
    for _ in range(depth):
        following = []
        for user in frontier:
            if user in seen:
                continue
            seen.add(user)
            found = node_source(user)
            if found != UNKNOWN:
                return found
            following.extend(user.users)
        frontier = following
    return UNKNOWN


def _limit_violations(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, str]]:
    """The emitted ops of ``graph`` that break their kernel or torchair converter limits (the one home of
    each op's limits, ``ops/<op>.py``, through :func:`qwen_npu_compile.ops.limits.graph_violations`)."""
    try:
        from qwen_npu_compile.ops.limits import graph_violations

        return graph_violations(graph, downstream="torchair")
    except Exception as exc:  # a limit function that cannot read this graph must not hide the conversion result
        log.warning("qwen_npu: the npu op limits could not be checked on %s: %s: %s", graph, type(exc).__name__, exc)
        return []


def _short_error(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _npu_op_counts(graph: torch.fx.Graph) -> dict[str, int]:
    from qwen_npu_compile.report import npu_op_counts

    return npu_op_counts(graph)


def _warn_failures(graph: GeGraph, failures: list[GeFailure]) -> None:
    """One warning per GE graph with conversion failures: each failing op with its count and source lines
    (a Gated DeltaNet layer has a dozen such nodes of 2-3 ops; one line per node said the same thing
    a dozen times). Each node is at DEBUG when it fails."""
    converter = [f for f in failures if f.kind == "converter"]
    if not converter:
        return
    by_op: dict[str, list[str]] = {}
    for failure in converter:
        by_op.setdefault(failure.op, []).append(failure.source)
    ops = "; ".join(f"{op} x{len(sources)} ({', '.join(sorted(set(sources)))})" for op, sources in by_op.items())
    log.warning("qwen_npu: torchair could not convert %d node(s) of GE graph %s (%s): %s; on an NPU this AOT graph "
                "runs eagerly through AOTAutograd instead (first error: %s)", len(converter), graph.name, graph.kind,
                ops, converter[0].error)


def install_recording(fx2ge_converter) -> None:
    """Replace ``fx2ge_converter.GeConcreteGraph`` with the recording subclass (idempotent)."""
    base = fx2ge_converter.GeConcreteGraph
    if getattr(base, "_qwen_npu_recording", False):
        return

    class RecordingGeConcreteGraph(base):
        """torchair's ``GeConcreteGraph`` that records failures and results for watched configs."""

        _qwen_npu_recording = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._qwen_npu_started = time.perf_counter()

        def parse_node(self, target, args, kwargs, meta_outputs):
            ops_before = len(self.graph.op)
            try:
                return super().parse_node(target, args, kwargs, meta_outputs)
            except Exception as exc:
                recorder = _watch_of(self.config)
                if recorder is None:
                    raise
                node = getattr(self._converter_ctx, "node", None)
                failure = GeFailure(
                    op=str(target), error=_short_error(exc),
                    source=recorder.source(node) if node is not None else UNKNOWN,
                    graph=self.graph.name, node=node.name if node is not None else "?",
                )
                recorder.results.failures.append(failure)
                log.debug("qwen_npu: torchair could not convert %s (%s) at %s: %s",
                          failure.node, failure.op, failure.source, failure.error)
                mock = self._create_mock_node_for_op(target, args, kwargs)
                if meta_outputs is not None:
                    fx2ge_converter.set_ge_outputs(mock, meta_outputs)
                made = recorder.failed_ops.setdefault(self.graph.name, set())
                made.update(op.name for op in self.graph.op[ops_before:])
                return mock

        def optimize_graph_without_runtime(self, *args, **kwargs):
            result = super().optimize_graph_without_runtime(*args, **kwargs)
            recorder = _watch_of(self.config)
            if recorder is not None:
                fx_graph = self.fx_graph.graph if self.fx_graph is not None else None
                takes_tangents = fx_graph is not None and any(
                    node.op == "placeholder" and node.name.startswith("tangents") for node in fx_graph.nodes)
                failed = recorder.failed_ops.get(self.graph.name, set())
                graph = GeGraph(
                    name=self.graph.name,
                    kind="backward" if takes_tangents else "forward",
                    ops=dict(sorted(Counter(op.type for op in self.graph.op if op.name not in failed).items())),
                    npu_ops=_npu_op_counts(fx_graph) if fx_graph is not None else {},
                    seconds=time.perf_counter() - self._qwen_npu_started,
                )
                if fx_graph is not None:
                    recorder.learn_sources(fx_graph)
                    failed_nodes = {f.node for f in recorder.results.failures if f.graph == self.graph.name}
                    for node, reason in _limit_violations(fx_graph):
                        if node.name not in failed_nodes:
                            recorder.results.failures.append(GeFailure(
                                op=str(node.target), error=f"limit: {reason}", source=recorder.source(node),
                                graph=self.graph.name, node=node.name, kind="limit"))
                            log.warning("qwen_npu: %s (%s) at %s converted to GE but cannot run: %s", node.name,
                                        node.target, recorder.source(node), reason)
                _warn_failures(graph, [f for f in recorder.results.failures if f.graph == self.graph.name])
                recorder.results.graphs.append(graph)
                if recorder.on_graph is not None:
                    recorder.on_graph(graph)
            return result

    RecordingGeConcreteGraph.__name__ = RecordingGeConcreteGraph.__qualname__ = "GeConcreteGraph"
    fx2ge_converter.GeConcreteGraph = RecordingGeConcreteGraph
