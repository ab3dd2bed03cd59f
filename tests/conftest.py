"""The fixtures every test folder shares: a clean Dynamo/qwen_npu state per test (and the package's process-wide
state restored after it), the npu ops, spies on the backend. The plain helpers (tiny models, parity assertions,
graph helpers) are the package :mod:`tests.helpers`."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from torch._functorch.aot_autograd import make_boxed_func

from qwen_npu_compile import ensure_npu_ops
from qwen_npu_compile.report import SUMMARY

# tests/ascend_host (the simulated Ascend host) rename PrivateUse1 for the whole process: they run in a pytest
# process of their own (tools/ascend_host_check.sh), only where the stand-in torch_npu is the one importable
_torch_npu = importlib.util.find_spec("torch_npu")
collect_ignore = [] if _torch_npu is not None and _torch_npu.origin and "ascend_host" in Path(_torch_npu.origin).parts \
    else ["ascend_host"]


@pytest.fixture(autouse=True)
def _clean_state():
    """A fresh Dynamo per test. ``torch._dynamo.reset()`` also drops the package's compile-start callback (which
    marks transformers' version probes constant for a transformers imported later): re-armed, as in a process that
    never reset."""
    from qwen_npu_compile import compat

    torch._dynamo.reset()
    compat.install_tracing_fixes()
    SUMMARY.clear()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
    compat.install_tracing_fixes()


@pytest.fixture(autouse=True)
def _restore_process_state():
    """Each test leaves the package's process-wide state as it found it, so that the tests pass in any order, in
    one process or several: the Gated DeltaNet substitution's switch (every qwen_npu compile sets it from its
    options' families, so a compile with ``fusions="rms_norm"`` would leave the next test's DeltaNet traced as
    Python, where transformers' hub wrapper raises on packed rows) and the said-once memories of warnings (a test
    that expects a warning would not see it after another test said it)."""
    from qwen_npu_compile import dump, worker
    from qwen_npu_compile.ops.qwen_npu import gated_delta_rule_kernels
    from qwen_npu_compile.substitutions import deltanet, varlen_attention

    state = [(deltanet, "_enabled"), (deltanet, "_refused"), (varlen_attention, "_warned"),
             (gated_delta_rule_kernels, "_logged"), (worker, "_warned_cache_eager"), (worker, "_said_cache_dropped"),
             (dump, "_STOPPED")]
    saved = [(module, name, copy.copy(getattr(module, name))) for module, name in state]
    yield
    for module, name, value in saved:
        setattr(module, name, value)


@pytest.fixture(scope="session")
def npu_ops():
    return ensure_npu_ops()


@pytest.fixture
def rewritten(monkeypatch):
    """The rewritten (fused) graphs of the test's compiles, in order (a spy on ``backend.rewrite``)."""
    from qwen_npu_compile import backend

    graphs = []
    original = backend.rewrite

    def spy(*args, **kwargs):
        report, gm = original(*args, **kwargs)
        graphs.append(gm)
        return report, gm

    monkeypatch.setattr(backend, "rewrite", spy)
    return graphs


@pytest.fixture(scope="session")
def simulated_npu_ops(npu_ops):
    """For tests of the CPU stand-ins themselves: skipped where the real torch_npu is present."""
    if not npu_ops.simulated:
        pytest.skip("real torch_npu present: these tests check the CPU stand-ins")
    return npu_ops


@pytest.fixture
def torchair_target_on_aot_eager(monkeypatch):
    """Fuse for torchair (``downstream="torchair"``: its rotary forms and limits) but run the AOT graphs on
    aot_eager; returns ``{"forward": [gm...], "backward": [gm...]}``, the AOT graphs in compile order."""
    from torch._dynamo.backends.common import aot_autograd

    from qwen_npu_compile import backend
    from qwen_npu_compile.handoff import hand_off as real_hand_off

    graphs = {"forward": [], "backward": []}

    def recorder(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    def hand_off(downstream, gm, example_inputs, report, config):
        if downstream != "torchair":
            return real_hand_off(downstream, gm, example_inputs, report, config)
        return aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))(gm, example_inputs)

    monkeypatch.setattr(backend, "hand_off", hand_off)
    return graphs


@pytest.fixture
def compile_on(monkeypatch):
    """``QWEN_NPU_COMPILE=1`` (``maybe_compile`` compiles), with the families left to their default (all)."""
    from qwen_npu_compile.worker import ENV_COMPILE

    monkeypatch.setenv(ENV_COMPILE, "1")
    monkeypatch.delenv("QWEN_NPU_FUSIONS", raising=False)
