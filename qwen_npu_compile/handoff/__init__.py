"""The *hand off* stage: give the emitted graph to the downstream backend: torchair | aot_eager | eager | inductor.

Pipeline: canonicalize → fuse → emit → **hand off** (:mod:`qwen_npu_compile.backend`).

torchair: on an Ascend host (real torch_npu) the installed torchair compiles the graph for the NPU.
Without one (simulated npu ops) the torchair of the paired torch_npu wheel runs off-NPU
(:mod:`qwen_npu_compile.torchair.offline`): its real FX→GE conversion of the forward and backward
graphs, recorded per graph in ``report.ge`` (GE op counts, every node that failed to convert), then
the FX graphs run eagerly with the simulated ops (torchair ``debug.run_eagerly``).
In both cases this project's GE converters are registered before any conversion.

The hand-off never stops training: when the downstream backend raises while converting or
compiling the graph, or at the first run of a compiled AOT graph, that graph runs one step further down,
``torchair`` → ``aot_eager`` (the same rewritten FX graph with the fused ops, through AOTAutograd, its
AOT graphs run eagerly) → ``eager`` (the rewritten graph's ``forward``; ``inductor`` falls back to
``aot_eager`` too). Each fallback is one warning naming the FX node being converted (when the error
names one), its model source line and the error, and an entry of ``report.downstream_fallbacks``;
``report.downstream`` says what actually runs. Per AOT graph this is done by guarding torchair's
compiler (``torchair.npu_fx_compiler.get_compiler``, see :func:`install_compiler_guard`), so that a
backward graph that fails to convert at the first backward, or a GE graph that fails at its first run
on the NPU, runs eagerly too. With ``strict`` every such failure raises
:class:`~qwen_npu_compile.report.FusionError` instead. Not caught: the errors of a setting that cannot
work at all (``TorchairUnavailableError`` off-NPU, ``torchair_mode="reduce-overhead"`` off-NPU) and
Dynamo's ``RestartAnalysis``.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from collections.abc import Callable

import torch
import torch.fx

from qwen_npu_compile.handoff import aot_layout, recompute
from qwen_npu_compile import compat, dump
from qwen_npu_compile.config import QwenNpuConfig, QwenNpuConfigError
from qwen_npu_compile.report import FusionError, GraphReport, npu_op_counts

log = logging.getLogger("qwen_npu_compile")


def hand_off(downstream: str, gm: torch.fx.GraphModule, example_inputs, report: GraphReport, config: QwenNpuConfig):
    """Compile the rewritten graph with the downstream backend and return its callable; when the backend
    raises, fall back one step (torchair/inductor → aot_eager → eager), see the module docstring.

    Raises:
        qwen_npu_compile.torchair.offline.TorchairUnavailableError: torchair off-NPU, and no torch_npu
            wheel could be obtained (the message says how to provide one).
        ValueError: ``torchair_mode="reduce-overhead"`` off-NPU.
        FusionError: ``config.strict`` and the downstream backend failed.
    """
    if downstream in ("torchair", "inductor"):
        if downstream == "torchair":
            backend = torchair_backend(report, config)  # settings that cannot work raise here, no fallback
            _drop_runtime_asserts(gm)
        else:
            from torch._inductor.compile_fx import compile_fx as backend
        try:
            return backend(gm, example_inputs)
        except Exception as exc:  # noqa: BLE001 - a downstream failure must not stop training
            if not _falls_back(exc):
                raise
            downstream_failed(report, config, downstream, "aot_eager", "whole", "compile", exc)
            downstream = "aot_eager"
    if downstream == "aot_eager":
        try:
            return aot_eager_hand_off(gm, example_inputs, report, config)
        except Exception as exc:  # noqa: BLE001
            if not _falls_back(exc):
                raise
            downstream_failed(report, config, "aot_eager", "eager", "whole", "compile", exc)
    return gm.forward


def _falls_back(exc: BaseException) -> bool:
    """Whether a downstream failure ``exc`` falls back (settings that cannot work and Dynamo's restarts do not)."""
    from qwen_npu_compile.torchair.offline.wheel import TorchairUnavailableError

    return not isinstance(exc, (torch._dynamo.exc.RestartAnalysis, TorchairUnavailableError, FusionError))


def aot_eager_hand_off(gm: torch.fx.GraphModule, example_inputs, report: GraphReport, config: QwenNpuConfig):
    """AOTAutograd with compilers that run the AOT graphs eagerly and record which npu ops reach the AOT
    forward/backward graphs (the backward should hold npu_rms_norm_backward etc., as it would on an NPU)."""
    from torch._dynamo.backends.common import aot_autograd

    backend = aot_autograd(
        fw_compiler=_recording_compiler("forward", report, config),
        bw_compiler=_recording_compiler("backward", report, config),
        # AOTAutograd's default (made to work on torch 2.9), tagging the cheap fused ops first with recompute="cheap"
        partition_fn=recompute.partition_fn(config.recompute, compat.default_partition, report.note_recomputed),
    )
    return backend(gm, example_inputs)


_FALLBACK_LOCK = threading.Lock()


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
    with _FALLBACK_LOCK:
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
    from qwen_npu_compile.fusion.family import node_source
    from qwen_npu_compile.torchair.offline.convert import UNKNOWN, _nearest_user_source

    found = node_source(node)
    return found if found != UNKNOWN else _nearest_user_source(node)


def _recording_compiler(kind: str, report: GraphReport, config: QwenNpuConfig):
    from torch._functorch.aot_autograd import make_boxed_func

    def compiler(gm: torch.fx.GraphModule, example_inputs):
        aot_layout.pin_aot_graph(gm, kind, report)
        report.aot_ops[kind] = npu_op_counts(gm.graph)
        report.aot_qwen_npu_ops[kind] = npu_op_counts(gm.graph, "qwen_npu")
        dump.write_graph(config, report, f"aot_{kind}", gm)
        dump.write_report(report, config)
        return make_boxed_func(gm.forward)

    return compiler


def torchair_hand_off(gm: torch.fx.GraphModule, example_inputs, report: GraphReport, config: QwenNpuConfig):
    """``torchair.get_npu_backend`` on ``gm``: the real torchair on an NPU, the wheel's off-NPU (no
    whole-graph fallback here: :func:`hand_off` adds it). See :func:`torchair_backend`."""
    _drop_runtime_asserts(gm)
    return torchair_backend(report, config)(gm, example_inputs)


def _drop_runtime_asserts(gm: torch.fx.GraphModule) -> None:
    """Dynamo's runtime assertions on unbacked sizes (the number of packed sequences, ``substitutions/varlen_attention.py``)
    go before torchair: it cannot convert their SymInt comparisons
    (:func:`qwen_npu_compile.torchair.converters.drop_runtime_asserts`)."""
    from qwen_npu_compile.torchair.converters import drop_runtime_asserts

    if drop_runtime_asserts(gm.graph):
        gm.recompile()


def torchair_backend(report: GraphReport, config: QwenNpuConfig):
    """``torchair.get_npu_backend`` for one graph: the real torchair on an NPU, the wheel's off-NPU, its
    compiler guarded per AOT graph (:func:`guard_torchair_compiler`).

    Off-NPU, ``report.ge`` receives a :class:`~qwen_npu_compile.torchair.offline.GeResults` that fills
    as torchair converts the forward graph (now) and the backward graph (at the first backward).

    Raises:
        TorchairUnavailableError: off-NPU without an obtainable wheel.
        ValueError: ``torchair_mode="reduce-overhead"`` off-NPU (ACL graph capture needs an NPU).
    """
    from qwen_npu_compile.torchair.converters import register_converters
    from qwen_npu_compile.ops import ensure_npu_ops

    status = ensure_npu_ops()
    offline = None
    if status.simulated:
        check_offline_mode(config)
        from qwen_npu_compile.torchair.offline import load_offline_torchair

        offline = load_offline_torchair()
        torchair = offline.module
    else:
        import torchair  # installed by `import torch_npu`
    register_converters()

    compiler_config = torchair_compiler_config(torchair.CompilerConfig(), config, report, offline=offline is not None)
    backend = torchair.get_npu_backend(compiler_config=compiler_config)
    guard_torchair_compiler(compiler_config, _TorchairGuard(report, config))
    recompute_in_torchair(compiler_config, config, report)
    if offline is not None:
        from qwen_npu_compile.torchair.offline import GeResults, watch

        report.ge = GeResults(torch_npu=offline.torch_npu_version, torchair="offline", mode=config.torchair_mode)
        watch(compiler_config, report.ge, on_graph=lambda graph: _after_ge_graph(report, config, graph))
        # With run_eagerly torchair hands AOTAutograd the FX graph itself (npu_fx_compiler._gen_compiled_gm),
        # an unboxed callable AOTAutograd warns about and runs correctly. The filter goes in after
        # get_npu_backend, which puts torchair's own "once" filter for every UserWarning in front.
        warnings.filterwarnings("ignore", message="Your compiler for AOTAutograd is returning a function that "
                                "doesn't take boxed arguments", category=UserWarning)
    return backend


def check_offline_mode(config: QwenNpuConfig) -> None:
    """Raise when the torchair settings cannot run off-NPU.

    Raises:
        QwenNpuConfigError: (a ``ValueError``) ``torchair_mode="reduce-overhead"``: torchair then captures an
            ACL graph on the NPU (``torchair/_acl_concrete_graph``) instead of converting to GE, so there is
            nothing to check.
    """
    if config.torchair_mode != "max-autotune":
        raise QwenNpuConfigError(
            f"qwen_npu: torchair_mode {config.torchair_mode!r} captures an ACL graph on the NPU; off-NPU only the "
            "GE graph mode 'max-autotune' (the default) can be checked: unset torchair_mode / QWEN_NPU_TORCHAIR_MODE"
        )


def torchair_compiler_config(compiler_config, config: QwenNpuConfig, report: GraphReport, offline: bool):
    """Apply the ``torchair_*`` settings of ``config`` to a fresh ``torchair.CompilerConfig``.

    Off-NPU ``debug.run_eagerly`` is always on (GE cannot run there); an explicit
    ``torchair_run_eagerly=False`` is then ignored with a warning.
    """
    compiler_config.mode = config.torchair_mode
    run_eagerly = bool(config.torchair_run_eagerly)
    if offline:
        if config.torchair_run_eagerly is False:
            log.warning("qwen_npu: torchair_run_eagerly=False ignored off-NPU: GE graphs are built but cannot run "
                        "without an NPU, so the FX graph runs eagerly")
        run_eagerly = True
    compiler_config.debug.run_eagerly = run_eagerly
    folder = dump.torchair_folder(config, report) if config.torchair_dump is not None else None
    if folder is not None:
        compiler_config.debug.graph_dump.type = config.torchair_dump
        compiler_config.debug.graph_dump.path = str(folder)
    return compiler_config


def _after_ge_graph(report: GraphReport, config: QwenNpuConfig, graph) -> None:
    report.aot_ops[graph.kind] = dict(graph.npu_ops)
    dump.write_report(report, config)


# --------------------------------------------------------------------------------------------------
# per AOT graph: torchair's compiler, guarded


def _aot_kind(gm: torch.fx.GraphModule) -> str:
    takes_tangents = any(node.op == "placeholder" and node.name.startswith("tangents") for node in gm.graph.nodes)
    return "backward" if takes_tangents else "forward"


class _TorchairGuard:
    """torchair's compiler for the AOT graphs of one qwen_npu graph, made to fall back per AOT graph.

    An AOT graph whose conversion or GE compile raises, or whose first run raises (GE compiles at the first
    run on an NPU), runs as its FX graph, eagerly, as aot_eager's compilers run it; later AOT graphs
    (the backward, compiled at the first backward) still go to torchair.
    """

    def __init__(self, report: GraphReport, config: QwenNpuConfig) -> None:
        self.report, self.config = report, config
        self.compiled: set[str] = set()
        self.failed: set[str] = set()

    def runs(self) -> str:
        return "aot_eager" if self.failed >= self.compiled else "torchair+aot_eager"

    def wrap(self, compiler):
        def compile_aot_graph(gm: torch.fx.GraphModule, example_inputs):
            kind = _aot_kind(gm)
            self.compiled.add(kind)
            aot_layout.pin_aot_graph(gm, kind, self.report)
            try:
                compiled = compiler(gm, example_inputs)
            except Exception as exc:  # noqa: BLE001 - a GE conversion failure must not stop training
                if not _falls_back(exc):
                    raise
                return self.eager(gm, kind, "compile", exc)
            if self.failed:
                self.report.downstream = self.runs()
            return self.first_run_guarded(compiled, gm, kind)

        return _GuardedCompiler(compiler, compile_aot_graph)

    def eager(self, gm: torch.fx.GraphModule, kind: str, when: str, exc: BaseException):
        self.failed.add(kind)
        self.report.aot_ops[kind] = npu_op_counts(gm.graph)
        self.report.aot_qwen_npu_ops[kind] = npu_op_counts(gm.graph, "qwen_npu")
        downstream_failed(self.report, self.config, "torchair", "aot_eager", kind, when, exc, runs=self.runs())

        def run(*args):
            return gm(*args)

        return run

    def first_run_guarded(self, compiled, gm: torch.fx.GraphModule, kind: str):
        """``compiled`` (called as torchair returned it: boxed or not), falling back to ``gm`` when its first call raises."""
        boxed = bool(getattr(compiled, "_boxed_call", False))
        state = {"call": compiled, "first": True}

        def run(*args):
            if not state["first"]:
                return state["call"](*args)
            saved = list(args[0]) if boxed else None  # a boxed callee may clear its argument list
            try:
                out = compiled(*args)
            except Exception as exc:  # noqa: BLE001
                if not _falls_back(exc):
                    raise
                eager = self.eager(gm, kind, "first run", exc)
                state.update(call=(lambda inputs: eager(*inputs)) if boxed else eager, first=False)
                return eager(*saved) if boxed else eager(*args)
            state["first"] = False
            return out

        if boxed:
            run._boxed_call = True  # type: ignore[attr-defined]
        return run


class _GuardedCompiler:
    """Calls ``compile`` in place of torchair's compiler object; its other attributes are the compiler's."""

    def __init__(self, inner, compile) -> None:
        self._inner, self._compile = inner, compile

    def __call__(self, gm, example_inputs):
        return self._compile(gm, example_inputs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


#: Per wrapped ``torchair.npu_fx_compiler`` function: compiler config id -> (the config, what wraps its result).
_PER_CONFIG: dict[str, dict[int, tuple[object, Callable]]] = {}


def wrap_torchair_result(name: str, compiler_config, wrap: Callable) -> bool:
    """For ``compiler_config`` only, pass what ``torchair.npu_fx_compiler.<name>(config)`` returns through ``wrap``.

    torchair's backend builds its pieces per ``CompilerConfig`` through module functions of ``npu_fx_compiler``
    (torch_npu 2.13.0 / 2.14.0 ``_npu_backend``: ``get_compiler``, ``_get_partition_fn``) and takes no hook of ours;
    the module function ``name`` is wrapped once per process so that, for the configs registered here, its result
    goes through their ``wrap`` (other configs, e.g. a user's own torchair compiles, get torchair's as it is).

    Returns:
        False where this torchair has no such function (nothing registered).
    """
    import importlib

    try:
        module = importlib.import_module("torchair.npu_fx_compiler")
    except ImportError:
        module = None
    original = getattr(module, name, None)
    if original is None:
        return False
    registry = _PER_CONFIG.setdefault(name, {})
    with _FALLBACK_LOCK:
        registry[id(compiler_config)] = (compiler_config, wrap)
    if getattr(original, "_qwen_npu_per_config", False):
        return True

    def per_config(config=None):
        result = original(config)
        with _FALLBACK_LOCK:
            entry = registry.get(id(config))
        return entry[1](result) if entry is not None and entry[0] is config else result

    per_config._qwen_npu_per_config = True  # type: ignore[attr-defined]
    per_config.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(module, name, per_config)
    return True


def guard_torchair_compiler(compiler_config, guard: _TorchairGuard) -> None:
    """Make the graphs torchair compiles with ``compiler_config`` fall back per AOT graph (``guard``): the compiler
    ``npu_fx_compiler.get_compiler`` returns for it is ``guard.wrap(compiler)`` (:func:`wrap_torchair_result`). A
    torchair without that function gets no per-graph guard (the whole-graph fallback of :func:`hand_off` still
    applies)."""
    if not wrap_torchair_result("get_compiler", compiler_config, guard.wrap):
        log.debug("qwen_npu: torchair has no npu_fx_compiler.get_compiler; no per-graph fallback")


def recompute_in_torchair(compiler_config, config: QwenNpuConfig, report: GraphReport) -> None:
    """Make torchair's AOT step partition the graphs it compiles with ``compiler_config`` through
    :func:`qwen_npu_compile.handoff.recompute.partition_fn` (``config.recompute``): the partitioner
    ``npu_fx_compiler._get_partition_fn`` returns for it (``default_partition``, or with
    ``experimental_config.npu_fx_pass`` its joint passes then ``default_partition``) tags first. Its joint-graph
    mode (``aot_config_enable_joint_graph``) does not partition and is not affected. A torchair without that
    function recomputes nothing: one warning."""
    if config.recompute == "none":
        return
    tagging = functools.partial(recompute.partition_fn, config.recompute, on_tagged=report.note_recomputed)
    if not wrap_torchair_result("_get_partition_fn", compiler_config, tagging):
        log.warning("qwen_npu: recompute=%r: this torchair has no npu_fx_compiler._get_partition_fn to wrap; its AOT "
                    "step partitions as usual (nothing recomputed)", config.recompute)
