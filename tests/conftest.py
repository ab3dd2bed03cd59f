"""Shared fixtures (a clean Dynamo/qwen_npu state per test, the npu ops) and the parity assertion.

The tiny Qwen2 (``tiny_qwen2``, ``tiny_qwen2_config``), the forward/backward step (``run_model``) and the
parity rule (``judge_runs``) are the ``check`` harness's own (:mod:`qwen_npu_compile.cli.check`), so the
tests judge parity exactly as ``qwen-npu-compile check`` does (docs/check.md, "Parity").
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from torch._functorch.aot_autograd import aot_function, make_boxed_func

from qwen_npu_compile import ensure_npu_ops
from qwen_npu_compile.cli.check.harness import fp32_reference, run_model
from qwen_npu_compile.cli.check.parity import gradient_mismatch, judge_runs, problems
from qwen_npu_compile.report import SUMMARY

# tests/ascend_host (the simulated Ascend host) rename PrivateUse1 for the whole process: they run in a pytest
# process of their own (tools/ascend_host_check.sh), only where the stand-in torch_npu is the one importable
_torch_npu = importlib.util.find_spec("torch_npu")
collect_ignore = [] if _torch_npu is not None and _torch_npu.origin and "ascend_host" in Path(_torch_npu.origin).parts \
    else ["ascend_host"]


@pytest.fixture(autouse=True)
def _clean_state():
    torch._dynamo.reset()
    SUMMARY.clear()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


def _process_state() -> list[tuple[object, str]]:
    """``(module, name)`` of the package's process-wide state a test can change: the Gated DeltaNet substitution's
    switch (every qwen_npu compile sets it from its options' families: a compile with ``fusions="rms_norm"``
    left the next test's DeltaNet traced as Python, transformers' hub wrapper then raising on packed rows) and
    the said-once memories of warnings (a test that expects the warning would not see it after another test
    said it)."""
    from qwen_npu_compile import dump, worker
    from qwen_npu_compile.ops.qwen_npu import gated_delta_rule_kernels
    from qwen_npu_compile.substitutions import deltanet, varlen_attention

    return [(deltanet, "_enabled"), (deltanet, "_refused"), (varlen_attention, "_warned"),
            (gated_delta_rule_kernels, "_logged"), (worker, "_warned_cache_eager"), (worker, "_said_cache_dropped"),
            (dump, "_STOPPED")]


@pytest.fixture(autouse=True)
def _restore_process_state():
    """Each test leaves the package's process-wide state (:func:`_process_state`) as it found it, so that the
    tests pass in any order, one process or several."""
    saved = [(module, name, copy.copy(getattr(module, name))) for module, name in _process_state()]
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


def assert_runs_match(compiled, eager, reference=None) -> dict:
    """``compiled`` (``(logits, grads)`` of :func:`run_model`) has parity with ``eager`` by
    :func:`qwen_npu_compile.cli.check.parity.judge_runs` (fp32 bounds; half precision against the fp32
    ``reference`` run); with gradients, both runs have them for the same parameters. Returns the rows."""
    assert not gradient_mismatch(compiled, eager), gradient_mismatch(compiled, eager)
    assert bool(compiled[1]) == bool(eager[1])
    rows = judge_runs(compiled, eager, reference)
    assert not problems(rows), rows
    return rows


def eager_and_reference(model, input_ids, train: bool, dtype, **kwargs):
    """``(eager, reference)``: :func:`run_model` of ``model`` eagerly and, for a half-precision ``dtype``,
    of an fp32 copy (the yardstick of :func:`assert_runs_match`; None for fp32)."""
    eager = run_model(model, model, input_ids, train, **kwargs)
    return eager, (fp32_reference(model, input_ids, train, **kwargs) if dtype != torch.float32 else None)


def assert_parity(model, input_ids, train: bool, dtype, options=None, dynamic=None, **kwargs):
    """Compile ``model`` with qwen_npu, compare logits and gradients against eager (and, for half
    precision ``dtype``, an fp32 reference run) with :func:`assert_runs_match`; return the reports."""
    eager, reference = eager_and_reference(model, input_ids, train, dtype, **kwargs)
    compiled = torch.compile(model, backend="qwen_npu", options=options or {}, dynamic=dynamic)
    assert_runs_match(run_model(model, compiled, input_ids, train, **kwargs), eager, reference)
    return list(SUMMARY.graphs)


def aot_traced(fn):
    """``(compiled, graphs)``: ``fn`` under AOTAutograd (``aot_function``); calling ``compiled`` (and its
    backward) fills ``graphs["fw"]`` / ``graphs["bw"]`` with the GraphModules AOTAutograd hands over."""
    graphs = {}

    def record(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    return aot_function(fn, fw_compiler=record("fw"), bw_compiler=record("bw")), graphs


def call_targets(gm) -> list:
    """The targets of ``gm``'s ``call_function`` nodes, in graph order."""
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


#: The tiny MoE models of the MoE tests: 2 layers, hidden 64, 4 heads / 2 KV heads, top-2 of 4 experts.
_TINY_MOE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, use_cache=False, moe_intermediate_size=32,
                 num_experts=4, num_experts_per_tok=2)  # fmt: skip


def tiny_moe(family: str, dtype=torch.float32, attn: str = "sdpa", **kwargs):
    """A 2-layer tiny Qwen3-MoE (head_dim 64, top-2 of 4 experts, renormalised) or Qwen2-MoE (head_dim 16,
    shared expert and its sigmoid gate), random weights (seed 0), in ``dtype``; ``kwargs`` go to ``_from_config``."""
    import transformers

    torch.manual_seed(0)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**_TINY_MOE, head_dim=64, norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.Qwen2MoeConfig(**_TINY_MOE, shared_expert_intermediate_size=64)
        cls = transformers.Qwen2MoeForCausalLM
    return cls._from_config(config, attn_implementation=attn, **kwargs).to(dtype)


def torchair_wheel_sources():
    """The torch_npu wheel's sources for this torch (``torchair_offline.wheel.obtain_sources``), or skip the test."""
    from qwen_npu_compile.torchair.offline import wheel

    try:
        return wheel.obtain_sources(torch.__version__)
    except wheel.TorchairUnavailableError as exc:
        pytest.skip(f"no torch_npu wheel: {exc}")


def run_ge_script(script: str, tmp_path, test_dir: str) -> list:
    """Run ``script`` (``python -c``; argv: the dump folder, ``tests/<test_dir>``, ``tests``) in a fresh interpreter,
    as importing torchair patches torch for the whole process; skipped without the torch_npu wheel. Returns the
    JSON list the script printed on its last line."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    torchair_wheel_sources()
    tests = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(tests / test_dir), str(tests)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests.parent), os.environ.get("PYTHONPATH", "")])))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


#: The tiny hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): 4 layers (3 Gated DeltaNet + 1 full attention,
#: transformers' default ``layer_types``), hidden 128, head_dim 64 (rotary on 16 dims, partial_rotary_factor 0.25).
_TINY_HYBRID = dict(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                    linear_value_head_dim=32, linear_conv_kernel_dim=4, max_position_embeddings=256, use_cache=False)
_TINY_HYBRID_MOE = dict(moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2)

#: family -> (config class, causal-LM class, extra config), transformers names; Qwen3.5 needs transformers >= 5
HYBRID_FAMILIES = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(intermediate_size=256)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", _TINY_HYBRID_MOE),
    # dense MLPs (mlp_only_layers): transformers 4.57.6 runs Qwen3-Next's experts as a per-expert loop (a graph
    # break per expert, as Qwen3-MoE there); the MoE block of the hybrid models is qwen3_5_moe's
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(intermediate_size=256, mlp_only_layers=[0, 1, 2, 3], **_TINY_HYBRID_MOE)),
    "qwen3_next_moe": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(intermediate_size=256, **_TINY_HYBRID_MOE)),
}


def tiny_hybrid(family: str, dtype=torch.float32, attn: str = "sdpa", seed: int = 0, **kwargs):
    """A tiny hybrid model of transformers' real modeling code (:data:`HYBRID_FAMILIES`), random weights (``seed``),
    the RMSNorm weights made random too (transformers initialises the (1+w) norms to 0 and the gated norm to 1,
    which would hide a wrong weight), in ``dtype``; ``kwargs`` override the config. Skips the test where this
    transformers has no such model."""
    import transformers

    config_name, model_name, extra = HYBRID_FAMILIES[family]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**_TINY_HYBRID, **extra, **kwargs})
    model = getattr(transformers, model_name)._from_config(config, attn_implementation=attn)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(0.0 if "linear_attn" not in name else 1.0, 0.5)
    return model.to(dtype)


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


def count_calls(graphs, op) -> int:
    """Calls of ``op`` in the GraphModules ``graphs``."""
    return sum(len(gm.graph.find_nodes(op="call_function", target=op)) for gm in graphs)
