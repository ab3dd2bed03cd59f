"""The ``qwen_npu`` Dynamo backend: a short orchestrator of the four stages.

Registered only through the ``torch_dynamo_backends`` entry point (``pyproject.toml``), so
``torch.compile(model, backend="qwen_npu", options={...})`` finds it without importing anything here
at ``import torch`` time::

    Dynamo graph --canonicalize--> pre-autograd ATen graph --fuse (a pass per family)--> rewritten graph
                 --emit--> finished graph + report --hand off--> torchair (real torch_npu, or off-NPU
                 conversion check) | aot_eager (default off-NPU) | eager | inductor

canonicalize: :mod:`~qwen_npu_compile.graph.canonicalize`; fuse: :mod:`~qwen_npu_compile.fusion.manager`; emit:
:mod:`~qwen_npu_compile.graph.emit`; hand off: :mod:`~qwen_npu_compile.handoff`. Reports:
:mod:`~qwen_npu_compile.report`; dumps: :mod:`~qwen_npu_compile.dump`.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Sequence

import torch
import torch.fx

from qwen_npu_compile import compat, dump, substitutions
from qwen_npu_compile.fusion.family import CompileTarget
from qwen_npu_compile.fusion.manager import FusionPassError, FusionPasses, count_fused_in_captured, fuse
from qwen_npu_compile.graph import canonicalize, emit
from qwen_npu_compile.handoff import hand_off
from qwen_npu_compile.handoff.torchair import check_offline_mode
from qwen_npu_compile.ops import NpuOpsStatus, ensure_npu_ops
from qwen_npu_compile.substitutions import deltanet

from .config import ENV_FUSIONS, QwenNpuConfig, QwenNpuConfigError
from .report import SUMMARY, FusionError, GraphReport, new_graph_name

log = logging.getLogger("qwen_npu_compile")

# torch.compile(backend="qwen_npu") imports this module before Dynamo traces a frame: the tracing fixes are
# in place even where the package was imported before torch (its public names then load lazily).
compat.install_tracing_fixes()
if compat.trace_kernels_bookkeeping_under_checkpoint():
    log.debug("qwen_npu: the kernels package is installed: torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_"
             "checkpoint set to True, so that gradient-checkpointed layers of transformers >= 5.25 compile and fuse "
             "(kernels' per-forward bookkeeping, a set and restore of one attribute, is not replayed in the backward)")

_DUMP_HINT = "set QWEN_NPU_DUMP_DIR=<dir> (or options={'dump_dir': ...}) and read <dir>/summary.json for the reasons"


def _fusions_at_lookup() -> frozenset[str]:
    """The families ``QWEN_NPU_FUSIONS`` enables, all of them when it is unset or malformed.

    Only that variable is read, and a malformed value raises nothing here: this runs while ``torch.compile``
    looks the backend up, where an error would come through the entry-point import machinery (some 30
    traceback lines) and before the ``options=`` that may override it can be seen; the backend raises it at
    the first call, as one line (:func:`qwen_npu_backend`).
    """
    environ = {ENV_FUSIONS: os.environ[ENV_FUSIONS]} if ENV_FUSIONS in os.environ else {}
    try:
        return QwenNpuConfig.from_options(None, environ=environ).fusions
    except QwenNpuConfigError:
        return QwenNpuConfig().fusions


# torch.compile imports this module when it looks "qwen_npu" up, before Dynamo traces the first frame: the one
# moment a backend can act before tracing. The substitutions go in here, for the modeling modules imported by
# then (and for those imported later: deltanet.install watches their import).
substitutions.install(_fusions_at_lookup())


def refusal_reasons(refused, families, limit: int = 3) -> str:
    """The refusals of ``families`` as one line: each distinct (family, reason, source line) once, with its
    count, the first ``limit`` of them (strict mode lists the same reasons, one per line)."""
    groups: dict[tuple[str, str, str], int] = {}
    for refusal in refused:
        if refusal.family in families:
            key = (refusal.family, refusal.reason, refusal.source)
            groups[key] = groups.get(key, 0) + 1
    parts = [f"{family}: {reason} (at {source}{f', {n} times' if n > 1 else ''})"
             for (family, reason, source), n in list(groups.items())[:limit]]
    if len(groups) > limit:
        parts.append(f"{len(groups) - limit} more reason(s)")
    return "; ".join(parts)


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
        qwen_npu_compile.config.QwenNpuConfigError: (a ``ValueError``) a bad option or ``QWEN_NPU_*`` value,
            ``mode`` given, or ``downstream="torchair"`` off-NPU with ``torchair_mode="reduce-overhead"``; one
            line, passed by Dynamo to the caller of the compiled model as it is (not as
            ``BackendCompilerFailed``, and without Dynamo's frames: :func:`qwen_npu_compile.compat.through_dynamo`).
        qwen_npu_compile.torchair.offline.TorchairUnavailableError: ``downstream="torchair"`` off-NPU and
            the paired torch_npu wheel could not be obtained (no network and none cached).
        FusionError: strict mode and an enabled family refused or near-missed a match, or a stage failed
            (canonicalize, fuse, emit, hand-off, dump, report) where the default falls back with one
            warning (:data:`STAGES`; see docs/how-it-works.md, "No stage stops training").
    """
    try:
        config, status, downstream = validated_settings(options, mode)
    except QwenNpuConfigError as exc:
        # the user's setting, not a compiler failure: one line where the compiled model was called, without
        # Dynamo's BackendCompilerFailed wrapping, its frames and its bug-report footer
        raise compat.through_dynamo(exc, inspect.currentframe()) from None
    substitutions.install(config.fusions)  # this graph's options, for the frames Dynamo traces next
    compat.install_tracing_fixes()  # again after a torch._dynamo.reset(), which drops the compile-start callback
    deltanet.warn_if_substituted_while_disabled(gm, config.fusions)
    report, rewritten = rewrite(gm, example_inputs, config, status, downstream)
    refuse_in_strict_mode(report, config)
    rewritten, constants = lift_constants(gm, rewritten, report, config)
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


def validated_settings(options: dict | None, mode: str | None) -> tuple[QwenNpuConfig, NpuOpsStatus, str]:
    """The backend's settings: the config of ``options`` and the environment, the npu ops, the downstream.

    Returns:
        ``(config, npu ops status, downstream backend name)``.

    Raises:
        QwenNpuConfigError: ``mode`` given, a bad option or ``QWEN_NPU_*`` value, or torchair settings that
            cannot run off-NPU (:func:`resolve_downstream`).
    """
    if mode is not None:
        raise QwenNpuConfigError(
            f"qwen_npu: torch.compile(mode={mode!r}) is not supported; choose the downstream backend with "
            "options={'downstream': 'torchair'|'aot_eager'|'eager'|'inductor'}"
        )
    # A dump folder that cannot be written must not stop training: dumping turns itself off with one
    # warning at the first failing write (dump.py); `check` and maybe_compile refuse it up front.
    config = QwenNpuConfig.from_options(options, dump_dir_errors="defer")
    status = ensure_npu_ops()
    return config, status, resolve_downstream(config, status)


def resolve_downstream(config: QwenNpuConfig, status: NpuOpsStatus) -> str:
    """The downstream backend: the configured one, else torchair with real ops, else aot_eager.

    ``torchair`` with simulated ops is the off-NPU conversion check (torchair from the paired torch_npu
    wheel, see :mod:`qwen_npu_compile.torchair.offline`); the wheel is obtained at the hand-off.

    Raises:
        QwenNpuConfigError: torchair off-NPU with a torchair mode that cannot run there (``reduce-overhead``).
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

    # Dynamo's graph first: it is what a canonicalize fallback needs to be debugged with
    dump.write_graph(config, report, "captured", gm)
    if not status.simulated and _all_on_cpu(example_inputs):
        # torch_npu's kernels take npu tensors only: fused ops on CPU tensors would crash the first step
        return compile_unfused(report, gm, "fuse", "the graph's tensors are on the CPU and torch_npu's fused ops run "
                               "on NPU tensors only: move the model and its inputs to the NPU (model.to('npu'))")
    start = time.perf_counter()
    try:
        aten_gm = canonicalize.to_aten_graph(gm, example_inputs)
    except torch._dynamo.exc.RestartAnalysis:
        raise  # Dynamo recaptures and calls us again: not a failure
    except Exception as exc:  # noqa: BLE001 - a retrace failure must never crash the user's compile
        # Never a silent wrong result: compile the captured graph as it is, unfused, and say so.
        reason = str(exc) if isinstance(exc, canonicalize.CanonicalizationError) else f"{type(exc).__name__}: {exc}"
        return compile_unfused(report, gm, "canonicalize", reason)
    report.seconds["canonicalize"] = time.perf_counter() - start
    dump.write_graph(config, report, "canonical", aten_gm)

    # The fuse and emit stages rewrite aten_gm in place: when one raises (a bug of ours, never the
    # user's), the half-rewritten graph is dropped and the captured graph compiles unfused.
    try:
        result = fuse(aten_gm, config, target=CompileTarget(downstream, status.simulated))
    except torch._dynamo.exc.RestartAnalysis:
        raise
    except FusionPassError as exc:
        return compile_unfused(report, gm, "fuse", str(exc))
    except Exception as exc:  # noqa: BLE001 - outside a family's pass (walking the graphs, the disabled families)
        return compile_unfused(report, gm, "fuse", f"a fusion pass raised: {type(exc).__name__}: {exc}")
    try:
        emit.record(report, result)
        emit.finalize(aten_gm)
    except Exception as exc:  # noqa: BLE001
        return compile_unfused(report, gm, "emit", f"finishing the rewritten graph failed: {type(exc).__name__}: {exc}")
    dump.write_graph(config, report, "rewritten", aten_gm)
    return report, aten_gm


def _all_on_cpu(example_inputs) -> bool:
    """True when the graph has tensor inputs and every one is a CPU tensor (parameters are inputs too)."""
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


#: The stages of :func:`qwen_npu_backend`, as named in ``report.fallback_stage`` and strict mode's errors.
STAGES = ("canonicalize", "fuse", "emit", "hand-off", "dump", "report")


def compile_unfused(report: GraphReport, gm: torch.fx.GraphModule, stage: str, reason: str):
    """Record that ``stage`` failed and the captured ``gm`` compiles unfused; log the one warning.

    Returns:
        ``(report, gm)``, as :func:`rewrite` does.
    """
    report.fallback = reason
    report.fallback_stage = stage
    report.fusions = dict.fromkeys(report.families, 0)
    # what a failed pass half-counted describes a graph that is not compiled; the fused ops the captured
    # graph already held (a monkey-patched model) still run, and are counted
    report.variants, report.anchors, report.refused = {}, {}, []
    try:
        report.already_fused = count_fused_in_captured(gm, report.families)
    except Exception as exc:  # noqa: BLE001 - a count must never stop the fallback
        report.already_fused = {}
        log.debug("qwen_npu %s: already-fused ops not counted (%s: %s)", report.name, type(exc).__name__, exc)
    log.warning("qwen_npu %s: fusion skipped (%s stage), compiling the graph unfused: %s", report.name, stage, reason)
    return report, gm


def lift_constants(gm: torch.fx.GraphModule, rewritten: torch.fx.GraphModule, report: GraphReport,
                   config: QwenNpuConfig) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """:func:`qwen_npu_compile.graph.emit.lift_constants` of ``rewritten``; when that raises, the captured ``gm``
    compiles unfused (emit stage; strict mode raises), its constants lifted if they can be, else left as
    ``get_attr`` (which AOTAutograd, eager and Inductor accept).

    Returns:
        ``(graph to hand off, its lifted constants)``.
    """
    try:
        return rewritten, emit.lift_constants(rewritten)
    except Exception as exc:  # noqa: BLE001
        if rewritten is not gm:
            compile_unfused(report, gm, "emit", f"lifting the graph's constants failed: {type(exc).__name__}: {exc}")
            refuse_in_strict_mode(report, config)
            try:
                return gm, emit.lift_constants(gm)
            except Exception as again:  # noqa: BLE001
                exc = again
        log.debug("qwen_npu %s: constants not lifted (%s: %s)", report.name, type(exc).__name__, exc)
        return gm, []


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
        raise FusionError(f"qwen_npu strict mode: {report.name} compiled unfused ({report.fallback_stage} stage "
                          f"failed): {report.fallback}")
    refused = [r for r in report.refused if r.family in report.families]
    if refused:
        publish(report, config)
        lines = "\n".join(f"  {r.family}: {r.reason} (at {r.source})" for r in refused)
        raise FusionError(f"qwen_npu strict mode: {len(refused)} fusion(s) refused in {report.name}:\n{lines}")


def publish(report: GraphReport, config: QwenNpuConfig) -> None:
    """Record ``report`` in the process's reports, log its line (and the near-miss warning), dump it.

    The report stage never stops the compiled graph: a failure here is one warning (strict mode: a
    :class:`FusionError` naming the report stage); dump failures are :mod:`~qwen_npu_compile.dump`'s.
    """
    try:
        if not any(graph is report for graph in SUMMARY.graphs):
            SUMMARY.add(report)
        log.info(report.log_line())
        missed = [f for f in report.families if report.fusions.get(f, 0) == 0 and report.anchors.get(f, 0) > 0]
        if missed:
            reasons = refusal_reasons(report.refused, missed)
            where = (f"all in {report.dump_path}" if report.dump_path
                     else "QWEN_NPU_DUMP_DIR=<dir> keeps the graphs" if reasons else _DUMP_HINT)
            log.warning(
                "qwen_npu %s: enabled famil%s %s found %s anchor op(s) but fused nothing%s (%s)",
                report.name, "y" if len(missed) == 1 else "ies", missed, [report.anchors[f] for f in missed],
                f": {reasons}" if reasons else "", where,
            )
    except Exception as exc:  # noqa: BLE001 - reporting must never stop the user's training
        if config.strict:
            raise FusionError(f"qwen_npu strict mode: {report.name}: the report stage failed: "
                              f"{type(exc).__name__}: {exc}") from exc
        log.warning("qwen_npu %s: the report stage failed (%s: %s); the compiled graph runs, its report may be "
                    "incomplete", report.name, type(exc).__name__, exc)
    dump.publish(report, config)
