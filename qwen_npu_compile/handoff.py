"""The *hand off* stage: give the emitted graph to the downstream backend: torchair | aot_eager | eager | inductor.

Pipeline: canonicalize → fuse → emit → **hand off** (:mod:`qwen_npu_compile.backend`).

torchair: on an Ascend host (real torch_npu) the installed torchair compiles the graph for the NPU.
Without one (simulated npu ops) the torchair of the paired torch_npu wheel runs off-NPU
(:mod:`qwen_npu_compile.torchair_offline`): its real FX→GE conversion of the forward and backward
graphs, recorded per graph in ``report.ge`` (GE op counts, every node that failed to convert), then
the FX graphs run eagerly with the simulated ops (torchair ``debug.run_eagerly``).
In both cases this project's GE converters are registered before any conversion.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.fx

from . import compat, dump
from .config import QwenNpuConfig
from .report import GraphReport, npu_op_counts

log = logging.getLogger("qwen_npu_compile")


def hand_off(downstream: str, gm: torch.fx.GraphModule, example_inputs, report: GraphReport, config: QwenNpuConfig):
    """Compile the rewritten graph with the downstream backend and return its callable.

    Raises:
        qwen_npu_compile.torchair_offline.TorchairUnavailableError: torchair off-NPU, and no torch_npu
            wheel could be obtained (the message says how to provide one).
    """
    if downstream == "torchair":
        return torchair_hand_off(gm, example_inputs, report, config)
    if downstream == "aot_eager":
        # aot_eager with compilers that record which npu ops reach the AOT forward/backward graphs
        # (the backward should hold npu_rms_norm_backward etc., as it would on an NPU).
        from torch._dynamo.backends.common import aot_autograd

        backend = aot_autograd(
            fw_compiler=_recording_compiler("forward", report, config),
            bw_compiler=_recording_compiler("backward", report, config),
            partition_fn=compat.default_partition,  # AOTAutograd's default, made to work on torch 2.9
        )
        return backend(gm, example_inputs)
    if downstream == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    return gm.forward


def _recording_compiler(kind: str, report: GraphReport, config: QwenNpuConfig):
    from torch._functorch.aot_autograd import make_boxed_func

    def compiler(gm: torch.fx.GraphModule, example_inputs):
        report.aot_ops[kind] = npu_op_counts(gm.graph)
        dump.write_graph(config, report, f"aot_{kind}", gm)
        dump.write_report(report, config)
        return make_boxed_func(gm.forward)

    return compiler


def torchair_hand_off(gm: torch.fx.GraphModule, example_inputs, report: GraphReport, config: QwenNpuConfig):
    """``torchair.get_npu_backend`` on ``gm``: the real torchair on an NPU, the wheel's off-NPU.

    Off-NPU, ``report.ge`` receives a :class:`~qwen_npu_compile.torchair_offline.GeResults` that fills
    as torchair converts the forward graph (now) and the backward graph (at the first backward).

    Raises:
        TorchairUnavailableError: off-NPU without an obtainable wheel.
        ValueError: ``torchair_mode="reduce-overhead"`` off-NPU (ACL graph capture needs an NPU).
    """
    from .ge_converters import register_converters
    from .npu_ops import ensure_npu_ops

    status = ensure_npu_ops()
    offline = None
    if status.simulated:
        check_offline_mode(config)
        from .torchair_offline import load_offline_torchair

        offline = load_offline_torchair()
        torchair = offline.module
    else:
        import torchair  # installed by `import torch_npu`
    register_converters()

    compiler_config = torchair_compiler_config(torchair.CompilerConfig(), config, report, offline=offline is not None)
    backend = torchair.get_npu_backend(compiler_config=compiler_config)
    if offline is not None:
        from .torchair_offline import GeResults, watch

        report.ge = GeResults(torch_npu=offline.torch_npu_version, torchair="offline", mode=config.torchair_mode)
        watch(compiler_config, report.ge, on_graph=lambda graph: _after_ge_graph(report, config, graph))
        # With run_eagerly torchair hands AOTAutograd the FX graph itself (npu_fx_compiler._gen_compiled_gm),
        # an unboxed callable AOTAutograd warns about and runs correctly. The filter goes in after
        # get_npu_backend, which puts torchair's own "once" filter for every UserWarning in front.
        warnings.filterwarnings("ignore", message="Your compiler for AOTAutograd is returning a function that "
                                "doesn't take boxed arguments", category=UserWarning)
    return backend(gm, example_inputs)


def check_offline_mode(config: QwenNpuConfig) -> None:
    """Raise when the torchair settings cannot run off-NPU.

    Raises:
        ValueError: ``torchair_mode="reduce-overhead"``: torchair then captures an ACL graph on the NPU
            (``torchair/_acl_concrete_graph``) instead of converting to GE, so there is nothing to check.
    """
    if config.torchair_mode != "max-autotune":
        raise ValueError(
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
    if config.torchair_dump is not None and config.dump_dir is not None:
        compiler_config.debug.graph_dump.type = config.torchair_dump
        compiler_config.debug.graph_dump.path = str(dump.torchair_folder(config, report))
    return compiler_config


def _after_ge_graph(report: GraphReport, config: QwenNpuConfig, graph) -> None:
    report.aot_ops[graph.kind] = dict(graph.npu_ops)
    dump.write_report(report, config)
