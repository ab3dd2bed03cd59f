"""Recording a downstream backend that failed, for every hand-off path: the report entry, the warning, strict mode.

Also the AOT compilers that run AOT graphs eagerly and record what reached them (aot_eager's, and the per-graph
fallback of torchair's guard).
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.fx

from qwen_npu_compile import dump
from qwen_npu_compile.config import QwenNpuConfig
from qwen_npu_compile.handoff import aot_layout
from qwen_npu_compile.report import FusionError, GraphReport, npu_op_counts

log = logging.getLogger("qwen_npu_compile")

#: Serialises the report's fallback entries (AOT graphs of one graph may fail on different threads) and the
#: per-config registries of :mod:`.torchair`.
FALLBACK_LOCK = threading.Lock()


def falls_back(exc: BaseException) -> bool:
    """Whether a downstream failure ``exc`` falls back (settings that cannot work and Dynamo's restarts do not)."""
    from qwen_npu_compile.torchair.offline.wheel import TorchairUnavailableError

    return not isinstance(exc, (torch._dynamo.exc.RestartAnalysis, TorchairUnavailableError, FusionError))


def downstream_failed(report: GraphReport, config: QwenNpuConfig, backend: str, ran: str, graph: str, when: str,
                      exc: BaseException, node: torch.fx.Node | None = None, runs: str | None = None) -> None:
    """Record in ``report`` that ``backend`` failed on ``graph`` and ``ran`` runs it instead; one warning.

    Args:
        backend: the backend that raised (``"torchair"``, ``"inductor"``, ``"aot_eager"``).
        ran: what runs instead (``"aot_eager"``, ``"eager"``).
        graph: ``"whole"`` (the qwen_npu graph) or the AOT graph's kind (``"forward"``, ``"backward"``).
        when: ``"compile"`` or ``"first run"``.
        exc: the error; the FX node being converted is read from its traceback when ``node`` is None.
        runs: the new ``report.downstream`` (default: ``ran`` for the whole graph, else unchanged).

    Raises:
        FusionError: ``config.strict`` (chained to ``exc``), naming the hand-off stage.
    """
    node = node if node is not None else failing_node(exc)
    source = node_source_line(node) if node is not None else "<unknown>"
    error = " ".join(f"{type(exc).__name__}: {exc}".split())[:400]
    where = f" at node {node.name} ({node.target}, {source})" if node is not None else ""
    if config.strict:
        raise FusionError(f"qwen_npu strict mode: {report.name}: the hand-off stage failed: {backend} "
                          f"({graph} graph, {when}){where}: {error}") from exc
    with FALLBACK_LOCK:
        report.downstream_fallbacks.append({"backend": backend, "ran": ran, "graph": graph, "when": when,
                                            "node": node.name if node is not None else None, "source": source,
                                            "error": error})
        report.downstream = runs or (ran if graph == "whole" else report.downstream)
    log.warning("qwen_npu %s: %s failed (%s graph, %s)%s: %s; %s instead", report.name, backend, graph, when, where,
                error, "the same graph runs eagerly through AOTAutograd" if ran == "aot_eager" else f"{ran} runs it")
    dump.write_report(report, config)


def failing_node(exc: BaseException) -> torch.fx.Node | None:
    """The FX node being interpreted when ``exc`` was raised, or None.

    torchair converts each node in a ``torch.fx.Interpreter``: the innermost frame with a ``node`` / ``n``
    local that is a Node, along the traceback of ``exc`` and of the errors it was raised from (torchair's
    ``pretty_error_msg`` re-raises a new error from the converter's).
    """
    found, seen = None, set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            for name in ("node", "n"):
                value = tb.tb_frame.f_locals.get(name)
                if isinstance(value, torch.fx.Node):
                    found = value
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return found


def node_source_line(node: torch.fx.Node) -> str:
    """``file:line`` of the model code of ``node``: its own, else its nearest user's (a fused op's
    result reaches a node with a stack trace through getitem/view nodes)."""
    from qwen_npu_compile.graph.utils import node_source
    from qwen_npu_compile.torchair.offline.convert import UNKNOWN, _nearest_user_source

    found = node_source(node)
    return found if found != UNKNOWN else _nearest_user_source(node)


def record_aot_ops(report: GraphReport, kind: str, gm: torch.fx.GraphModule) -> None:
    """Record in ``report`` the npu and qwen_npu op counts of the AOT graph ``gm`` of ``kind`` (forward/backward)."""
    report.aot_ops[kind] = npu_op_counts(gm.graph)
    report.aot_qwen_npu_ops[kind] = npu_op_counts(gm.graph, "qwen_npu")


def recording_compiler(kind: str, report: GraphReport, config: QwenNpuConfig):
    """An AOT compiler that pins ``kind``'s layouts, records its npu op counts and dumps it, then runs it eagerly."""
    from torch._functorch.aot_autograd import make_boxed_func

    def compiler(gm: torch.fx.GraphModule, example_inputs):
        aot_layout.pin_aot_graph(gm, kind, report)
        record_aot_ops(report, kind, gm)
        dump.write_graph(config, report, f"aot_{kind}", gm)
        dump.write_report(report, config)
        return make_boxed_func(gm.forward)

    return compiler


