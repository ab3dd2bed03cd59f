"""The ``qwen_npu`` Dynamo backend: a short orchestrator of the four stages.

Registered only through the ``torch_dynamo_backends`` entry point (``pyproject.toml``), so
``torch.compile(model, backend="qwen_npu", options={...})`` finds it without importing anything here
at ``import torch`` time::

    Dynamo graph --canonicalize--> pre-autograd ATen graph --fuse (a pass per family)--> rewritten graph
                 --emit--> finished graph + report --hand off--> torchair (real torch_npu, or off-NPU
                 conversion check) | aot_eager (default off-NPU) | eager | inductor

canonicalize: :mod:`~qwen_npu_compile.canonicalize`; fuse: :mod:`~qwen_npu_compile.fuse`; emit:
:mod:`~qwen_npu_compile.emit`; hand off: :mod:`~qwen_npu_compile.handoff`. Reports:
:mod:`~qwen_npu_compile.report`; dumps: :mod:`~qwen_npu_compile.dump`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
import torch.fx

from . import canonicalize, dump, emit
from .config import QwenNpuConfig
from .fuse import FusionPasses, fuse
from .fusion import CompileTarget
from .handoff import check_offline_mode, hand_off
from .npu_ops import NpuOpsStatus, ensure_npu_ops
from .report import SUMMARY, FusionError, GraphReport, new_graph_name

log = logging.getLogger("qwen_npu_compile")

_DUMP_HINT = "set QWEN_NPU_DUMP_DIR=<dir> (or options={'dump_dir': ...}) and read <dir>/summary.json for the reasons"


def qwen_npu_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[object],
    options: dict | None = None,
    mode: str | None = None,
):
    """Dynamo backend: fuse Qwen2 subgraphs into torch_npu ops, then compile downstream.

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its example inputs (tensors, SymInts).
        options: ``torch.compile(..., options=...)``; see :class:`qwen_npu_compile.config.QwenNpuConfig`.
        mode: not supported (``torch.compile(mode=...)`` is an Inductor notion).

    Returns:
        The compiled callable of the downstream backend.

    Raises:
        ValueError: a bad option or env value, ``mode`` given, or ``downstream="torchair"`` off-NPU with
            ``torchair_mode="reduce-overhead"``.
        qwen_npu_compile.torchair_offline.TorchairUnavailableError: ``downstream="torchair"`` off-NPU and
            the paired torch_npu wheel could not be obtained (no network and none cached).
        FusionError: strict mode and an enabled family refused or near-missed a match.
    """
    if mode is not None:
        raise ValueError(
            f"qwen_npu: torch.compile(mode={mode!r}) is not supported; choose the downstream backend with "
            "options={'downstream': 'torchair'|'aot_eager'|'eager'|'inductor'}"
        )
    config = QwenNpuConfig.from_options(options)
    status = ensure_npu_ops()
    downstream = resolve_downstream(config, status)
    report, rewritten = rewrite(gm, example_inputs, config, status, downstream)
    refuse_in_strict_mode(report, config)
    constants = emit.lift_constants(rewritten)
    try:
        compiled = hand_off(downstream, rewritten, [*example_inputs, *constants], report, config)
    except torch._dynamo.exc.RestartAnalysis:
        # Dynamo will recapture (e.g. TensorifyScalarRestartAnalysis specialises float inputs such as
        # eps under dynamic=True) and call us again: this attempt is not a compiled graph.
        raise
    except Exception:
        publish(report, config)
        raise
    publish(report, config)
    return emit.bind_trailing_inputs(compiled, constants)


def resolve_downstream(config: QwenNpuConfig, status: NpuOpsStatus) -> str:
    """The downstream backend: the configured one, else torchair with real ops, else aot_eager.

    ``torchair`` with simulated ops is the off-NPU conversion check (torchair from the paired torch_npu
    wheel, see :mod:`qwen_npu_compile.torchair_offline`); the wheel is obtained at the hand-off.

    Raises:
        ValueError: torchair off-NPU with a torchair mode that cannot run there (``reduce-overhead``).
    """
    if config.downstream is None:
        return "aot_eager" if status.simulated else "torchair"
    if config.downstream == "torchair" and status.simulated:
        check_offline_mode(config)
    return config.downstream


def rewrite(gm, example_inputs, config: QwenNpuConfig, status: NpuOpsStatus, downstream: str):
    """Canonicalize ``gm``, fuse, emit (the report is published by the caller).

    A graph that cannot be canonicalized comes back as it is, unfused, with ``report.fallback`` saying why.

    Returns:
        ``(report, rewritten GraphModule)``.
    """
    families = list(FusionPasses.from_config(config).enabled)
    report = GraphReport(name=new_graph_name(), simulated=status.simulated, downstream=downstream, families=families)

    start = time.perf_counter()
    try:
        aten_gm = canonicalize.to_aten_graph(gm, example_inputs)
    except torch._dynamo.exc.RestartAnalysis:
        raise  # Dynamo recaptures and calls us again: not a failure
    except Exception as exc:  # noqa: BLE001 - a retrace failure must never crash the user's compile
        # Never a silent wrong result: compile the captured graph as it is, unfused, and say so.
        reason = str(exc) if isinstance(exc, canonicalize.CanonicalizationError) else f"{type(exc).__name__}: {exc}"
        report.fallback = reason
        report.fusions = dict.fromkeys(families, 0)
        log.warning("qwen_npu %s: fusion skipped, compiling the graph unfused: %s", report.name, reason)
        return report, gm
    report.seconds["canonicalize"] = time.perf_counter() - start
    dump.write_graph(config, report, "captured", gm)
    dump.write_graph(config, report, "canonical", aten_gm)

    result = fuse(aten_gm, config, target=CompileTarget(downstream, status.simulated))
    emit.record(report, result)
    emit.finalize(aten_gm)
    dump.write_graph(config, report, "rewritten", aten_gm)
    return report, aten_gm


def refuse_in_strict_mode(report: GraphReport, config: QwenNpuConfig) -> None:
    """In strict mode, publish ``report`` and raise when an enabled family did not fuse everything.

    Raises:
        FusionError: ``config.strict`` and the graph fell back unfused, or an enabled family refused or
            near-missed a match (the message lists each reason and model source line).
    """
    if not config.strict:
        return
    if report.fallback and report.families:
        publish(report, config)
        raise FusionError(f"qwen_npu strict mode: {report.name} compiled unfused: {report.fallback}")
    refused = [r for r in report.refused if r.family in report.families]
    if refused:
        publish(report, config)
        lines = "\n".join(f"  {r.family}: {r.reason} (at {r.source})" for r in refused)
        raise FusionError(f"qwen_npu strict mode: {len(refused)} fusion(s) refused in {report.name}:\n{lines}")


def publish(report: GraphReport, config: QwenNpuConfig) -> None:
    """Record ``report`` in the process's reports, log its line (and the near-miss warning), dump it."""
    SUMMARY.add(report)
    log.info(report.log_line())
    missed = [f for f in report.families if report.fusions[f] == 0 and report.anchors.get(f, 0) > 0]
    if missed:
        log.warning(
            "qwen_npu %s: enabled famil%s %s found %s anchor op(s) but fused nothing; %s",
            report.name, "y" if len(missed) == 1 else "ies", missed, [report.anchors[f] for f in missed], _DUMP_HINT,
        )
    dump.publish(report, config)
