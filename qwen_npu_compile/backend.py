"""The ``qwen_npu`` Dynamo backend: canonicalise, fuse, report, hand off.

Registered only through the ``torch_dynamo_backends`` entry point (``pyproject.toml``), so
``torch.compile(model, backend="qwen_npu", options={...})`` finds it without importing anything here
at ``import torch`` time::

    Dynamo graph --(canonicalize)--> pre-autograd ATen graph --(fuse, per family)--> rewritten graph
                 --(hand off)--> torchair (real torch_npu, or off-NPU conversion check) | aot_eager (default off-NPU)
                                 | eager | inductor
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.fx

from . import canonicalize
from .config import ALL_FAMILIES, QwenNpuConfig
from .fusion import CompileTarget, RefusalRecorder, targeting
from .handoff import check_offline_mode, hand_off
from .npu_ops import NpuOpsStatus, ensure_npu_ops
from .report import SUMMARY, FusionError, GraphReport, write_graph_dump, write_report

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
    strict_refusals = [r for r in report.refused if r.family in report.families]
    if config.strict and report.fallback and report.families:
        publish(report, config)
        raise FusionError(f"qwen_npu strict mode: {report.name} compiled unfused: {report.fallback}")
    if config.strict and strict_refusals:
        publish(report, config)
        lines = "\n".join(f"  {r.family}: {r.reason} (at {r.source})" for r in strict_refusals)
        raise FusionError(f"qwen_npu strict mode: {len(strict_refusals)} fusion(s) refused in {report.name}:\n{lines}")
    constants = canonicalize.lift_tensor_constants(rewritten)
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
    return bind_trailing_inputs(compiled, constants) if constants else compiled


def bind_trailing_inputs(compiled, extra: list[torch.Tensor]):
    """Wrap ``compiled`` so that ``extra`` is passed after the caller's inputs.

    Dynamo calls a backend's result as ``fn(*args)``. (``_boxed_call`` is not a reliable signal here:
    ``functools.wraps`` copies it onto AOTAutograd's unboxed ``forward``.)
    """

    def run(*args):
        return compiled(*args, *extra)

    return run


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
    """Canonicalise ``gm`` and run the enabled fusion passes (the report is published by the caller).

    Returns:
        ``(report, rewritten GraphModule)``.
    """
    from qwen_npu_compile.patterns import get_family_pass

    compile_id = torch._guards.CompileContext.current_compile_id()
    index = SUMMARY.next_index()
    name = f"g{index:03d}_{str(compile_id).replace('/', '_') if compile_id is not None else 'eager'}"
    families = [family for family in ALL_FAMILIES if family in config.fusions]
    report = GraphReport(name=name, simulated=status.simulated, downstream=downstream, families=families)

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
        log.warning("qwen_npu %s: fusion skipped, compiling the graph unfused: %s", name, reason)
        return report, gm
    report.seconds["canonicalize"] = time.perf_counter() - start
    folder = dump_root(config) / name if config.dump_dir is not None else None
    if folder is not None:
        report.dump_path = str(folder)
        write_graph_dump(folder, "captured", gm)
        write_graph_dump(folder, "canonical", aten_gm)

    recorder = RefusalRecorder()
    start = time.perf_counter()
    graphs = canonicalize.fusion_graphs(aten_gm)  # the graph and its checkpointed regions' bodies
    with targeting(CompileTarget(downstream, status.simulated)):
        for family in families:
            family_pass = get_family_pass(family)
            report.already_fused[family] = sum(family_pass.count_fused(g.graph) for g in graphs)
            report.anchors[family] = sum(family_pass.count_anchors(g.graph) for g in graphs)
            report.fusions[family] = sum(family_pass.apply(g, recorder) for g in graphs)
    for family in ALL_FAMILIES:
        if family not in config.fusions:
            # a disabled family is not matched; say so wherever its anchor op shows it could have been
            for anchor in (a for g in graphs for a in get_family_pass(family).anchor_nodes(g.graph)):
                recorder.refuse(family, anchor, f"family {family!r} is disabled (fusions={sorted(config.fusions)})")
    for graph_module in reversed(graphs):  # bodies first: their outputs' users live in the caller
        graph_module.graph.eliminate_dead_code()
        graph_module.graph.lint()
        graph_module.recompile()
    report.seconds["fuse"] = time.perf_counter() - start
    report.refused = recorder.live([g.graph for g in graphs])
    if folder is not None:
        write_graph_dump(folder, "rewritten", aten_gm)
    return report, aten_gm


def dump_root(config: QwenNpuConfig) -> Path:
    """The dump folder of this process: ``dump_dir``, or ``dump_dir/rank<N>`` under torch.distributed
    (each rank compiles the same graphs and would overwrite the others' files)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return config.dump_dir / f"rank{dist.get_rank()}"
    return config.dump_dir


def publish(report: GraphReport, config: QwenNpuConfig) -> None:
    """Record ``report`` in the process summary, log its line (and the near-miss warning), dump it."""
    SUMMARY.add(report)
    log.info(report.log_line())
    missed = [f for f in report.families if report.fusions[f] == 0 and report.anchors.get(f, 0) > 0]
    if missed:
        log.warning(
            "qwen_npu %s: enabled famil%s %s found %s anchor op(s) but fused nothing; %s",
            report.name, "y" if len(missed) == 1 else "ies", missed, [report.anchors[f] for f in missed], _DUMP_HINT,
        )
    if config.dump_dir is not None:
        write_report(report, dump_root(config))
