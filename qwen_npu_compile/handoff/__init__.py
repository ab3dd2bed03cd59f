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
compiler (``torchair.npu_fx_compiler.get_compiler``, see :func:`.torchair.guard_torchair_compiler`), so that a
backward graph that fails to convert at the first backward, or a GE graph that fails at its first run
on the NPU, runs eagerly too. With ``strict`` every such failure raises
:class:`~qwen_npu_compile.report.FusionError` instead. Not caught: the errors of a setting that cannot
work at all (``TorchairUnavailableError`` off-NPU, ``torchair_mode="reduce-overhead"`` off-NPU) and
Dynamo's ``RestartAnalysis``.

Modules: this one (the fallback chain, aot_eager), :mod:`.torchair` (torchair's backend for one graph: settings,
converters registered, the per-AOT-graph guard, the recompute partitioner), :mod:`.fallback` (recording a
failed backend), :mod:`.aot_layout` (pinning AOT graphs' layouts), :mod:`.recompute` (recompute tags).
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from qwen_npu_compile import compat
from qwen_npu_compile.config import QwenNpuConfig
from qwen_npu_compile.handoff import recompute
from qwen_npu_compile.handoff.fallback import downstream_failed, falls_back, recording_compiler
from qwen_npu_compile.handoff.torchair import drop_runtime_asserts, torchair_backend
from qwen_npu_compile.report import GraphReport

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
            drop_runtime_asserts(gm)
        else:
            from torch._inductor.compile_fx import compile_fx as backend
        try:
            return backend(gm, example_inputs)
        except Exception as exc:  # noqa: BLE001 - a downstream failure must not stop training
            if not falls_back(exc):
                raise
            downstream_failed(report, config, downstream, "aot_eager", "whole", "compile", exc)
            downstream = "aot_eager"
    if downstream == "aot_eager":
        try:
            return aot_eager_hand_off(gm, example_inputs, report, config)
        except Exception as exc:  # noqa: BLE001
            if not falls_back(exc):
                raise
            downstream_failed(report, config, "aot_eager", "eager", "whole", "compile", exc)
    return gm.forward


def aot_eager_hand_off(gm: torch.fx.GraphModule, example_inputs, report: GraphReport, config: QwenNpuConfig):
    """AOTAutograd with compilers that run the AOT graphs eagerly and record which npu ops reach the AOT
    forward/backward graphs (the backward should hold npu_rms_norm_backward etc., as it would on an NPU)."""
    from torch._dynamo.backends.common import aot_autograd

    backend = aot_autograd(
        fw_compiler=recording_compiler("forward", report, config),
        bw_compiler=recording_compiler("backward", report, config),
        # AOTAutograd's default (made to work on torch 2.9), tagging the cheap fused ops first with recompute="cheap"
        partition_fn=recompute.partition_fn(config.recompute, compat.default_partition, report.note_recomputed),
    )
    return backend(gm, example_inputs)


