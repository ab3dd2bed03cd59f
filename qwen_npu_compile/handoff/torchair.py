"""The torchair half of the hand-off: ``torchair.get_npu_backend`` for one graph.

On an Ascend host the installed torchair (``import torch_npu``) compiles the graph for the NPU; off-NPU the
torchair of the paired torch_npu wheel converts it to GE without running it (:mod:`qwen_npu_compile.torchair.offline`).
Either way this project's GE converters are registered first (:func:`qwen_npu_compile.torchair.converters.register_converters`),
the ``torchair_*`` settings applied (:func:`torchair_compiler_config`), and two of torchair's per-config pieces
wrapped for our configs only (:func:`wrap_torchair_result`): the compiler, so that each AOT graph falls back on its
own (:func:`guard_torchair_compiler`), and the partitioner, for ``recompute="cheap"`` (:func:`recompute_in_torchair`).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable

import torch
import torch.fx

from qwen_npu_compile import dump
from qwen_npu_compile.config import QwenNpuConfig, QwenNpuConfigError
from qwen_npu_compile.handoff import aot_layout, recompute
from qwen_npu_compile.handoff.fallback import FALLBACK_LOCK, downstream_failed, falls_back, record_aot_ops
from qwen_npu_compile.report import GraphReport

log = logging.getLogger("qwen_npu_compile")


def drop_runtime_asserts(gm: torch.fx.GraphModule) -> None:
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
    from qwen_npu_compile.ops import ensure_npu_ops
    from qwen_npu_compile.torchair.converters import register_converters

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
                if not falls_back(exc):
                    raise
                return self.eager(gm, kind, "compile", exc)
            if self.failed:
                self.report.downstream = self.runs()
            return self.first_run_guarded(compiled, gm, kind)

        return _GuardedCompiler(compiler, compile_aot_graph)

    def eager(self, gm: torch.fx.GraphModule, kind: str, when: str, exc: BaseException):
        self.failed.add(kind)
        record_aot_ops(self.report, kind, gm)
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
                if not falls_back(exc):
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
    with FALLBACK_LOCK:
        registry[id(compiler_config)] = (compiler_config, wrap)
    if getattr(original, "_qwen_npu_per_config", False):
        return True

    def per_config(config=None):
        result = original(config)
        with FALLBACK_LOCK:
            entry = registry.get(id(config))
        return entry[1](result) if entry is not None and entry[0] is config else result

    per_config._qwen_npu_per_config = True  # type: ignore[attr-defined]
    per_config.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(module, name, per_config)
    return True


def guard_torchair_compiler(compiler_config, guard: _TorchairGuard) -> None:
    """Make the graphs torchair compiles with ``compiler_config`` fall back per AOT graph (``guard``): the compiler
    ``npu_fx_compiler.get_compiler`` returns for it is ``guard.wrap(compiler)`` (:func:`wrap_torchair_result`). A
    torchair without that function gets no per-graph guard (the whole-graph fallback of :func:`~qwen_npu_compile.handoff.hand_off` still
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
