"""The Gated DeltaNet's Ascend kernels on the simulated Ascend host (``qwen_npu::chunk_gated_delta_rule`` on ``npu``
tensors, dispatched to its PrivateUse1 kernels; the choice: ``ops/qwen_npu/gated_delta_rule_kernels.py``).

- FLA 0.5.2 bound (the stand-in, ``tests/stand_ins/fla``, checking its arguments and requiring npu tensors): a
  compiled tiny Qwen3.5 DeltaNet layer holds the op, trains with FLA's forward and FLA's backward (a recomputed FLA
  forward under autograd), loss and gradients equal eager's (transformers 5.24 eager calls FLA itself: the stand-in,
  whose result is the op's reference, which ``tests/ops/test_gated_delta_rule.py`` compares with transformers'
  ``torch_chunk_gated_delta_rule``); packed rows through the op equal the reference per sequence.
- No FLA: DeltaNet head dim 32 trains on the reference (one INFO line with the reason, one WARNING naming what to
  install); head dim 128, no grad, sequences of <= 8 tokens: torch_npu's ``npu_chunk_gated_delta_rule`` runs inside
  its documented contract (the stand-in torch_npu enforces it: outside it, its aclnn call fails).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import sim
import torch

from qwen_npu_compile import get_reports
from qwen_npu_compile.ops.qwen_npu import gated_delta_rule as G
from qwen_npu_compile.ops.qwen_npu import gated_delta_rule_kernels as K
from tests.helpers.numerics import relative_l2

STAND_INS = Path(__file__).resolve().parents[1] / "stand_ins"
OP = torch.ops.qwen_npu.chunk_gated_delta_rule.default
TINY = dict(vocab_size=256, hidden_size=128, num_hidden_layers=1, layer_types=["linear_attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_conv_kernel_dim=4, intermediate_size=256, max_position_embeddings=256, use_cache=False)


def _forget_fla():
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        sys.modules.pop(name)
    K._fla_probe.cache_clear()


@pytest.fixture
def no_fla(monkeypatch, caplog):
    _forget_fla()
    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.setattr(K, "_logged", set())
    caplog.set_level(logging.INFO, logger="qwen_npu_compile")
    yield caplog
    K._fla_probe.cache_clear()


@pytest.fixture
def fla(monkeypatch):
    _forget_fla()
    monkeypatch.syspath_prepend(str(STAND_INS))
    import fla.ops.gated_delta_rule as entry
    import fla.utils

    assert fla.utils.IS_NPU  # PrivateUse1 is named npu here
    monkeypatch.setattr(entry, "REQUIRED_DEVICE_TYPE", "npu")
    entry.CALLS.clear()
    yield entry
    _forget_fla()


def _model(dtype, dim, seed=0):
    import transformers

    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5")
    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(**TINY, linear_key_head_dim=dim, linear_value_head_dim=dim)
    model = transformers.Qwen3_5ForCausalLM._from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.5)
    return model.to(dtype).to(sim.device())


def _step(model, ids, compiled=False):
    run = torch.compile(model, backend="qwen_npu", options={"downstream": "aot_eager"}) if compiled else model
    loss = run(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.detach().cpu() for n, p in model.named_parameters()}


def _eager_resolves_fla_now(monkeypatch):
    """transformers 5.24 picks its delta-rule kernel ONCE, when ``modeling_qwen3_5`` is first imported
    (``use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")``: FLA if importable then, else the
    torch function), and each ``fla`` fixture imports a fresh FLA stand-in (its own ``CALLS``). So which FLA, if
    any, eager calls depends on which test of the process imported Qwen3.5 first (test_eager_parity.py,
    test_check_qwen3_5.py, a ``no_fla`` test: the torch function). Re-run transformers' own decorator now, with
    this test's FLA importable, as importing ``modeling_qwen3_5`` on a host with FLA does (undone after the
    test). Only for the eager run: the compiled run's substitution is keyed on the function it found."""
    from transformers.integrations import hub_kernels
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    from qwen_npu_compile.substitutions import deltanet

    # the hub wrapper's torch function (with kernels installed, the wrapper sits inside a kernels Func module)
    torch_function = deltanet.resolve_binding(modeling.torch_chunk_gated_delta_rule)[0].__wrapped__
    decorate = hub_kernels.use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", decorate(torch_function))


def test_a_compiled_deltanet_layer_trains_on_fla(npu, fla, monkeypatch):
    model, eager = _model(torch.float32, 32), _model(torch.float32, 32)  # (deepcopy of npu storages crashes here)
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(1)).to(npu)
    loss, grads = _step(model, ids, compiled=True)
    assert [r.fusions["gated_delta_rule"] for r in get_reports()] == [1]  # the op in the graph
    calls = fla.CALLS
    assert [c["grad_enabled"] for c in calls] == [False, True]  # FLA's forward; its backward through autograd
    for call in calls:
        assert call["q"] == call["k"] == (torch.float32, (1, 70, 4, 32), "npu") and call["g"][0] == torch.float32
        assert call["use_qk_l2norm_in_kernel"] is True and call["output_final_state"] is True
    _eager_resolves_fla_now(monkeypatch)
    want_loss, want = _step(eager, ids)
    assert len(calls) == 3  # transformers 5.24's eager dispatches to FLA by itself (its hub wrapper)
    assert relative_l2(loss, want_loss) < 1e-5
    for name, grad in grads.items():
        assert relative_l2(grad, want[name]) < 1e-4, name


def test_the_op_on_fla_packed_rows_equals_the_reference(npu, fla):
    """Packed rows on npu: FLA gets int64 cu_seqlens on the device and their CPU copy; gradients equal the reference's."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 70, 2, 32) for _ in range(3))
    g, beta = -torch.rand(1, 70, 2) * 0.3, torch.rand(1, 70, 2)
    cpu = [t.requires_grad_() for t in (q, k, v, g, beta)]
    dev = [t.detach().to(npu).requires_grad_() for t in cpu]
    cu = torch.tensor([0, 5, 64, 70], dtype=torch.int32)
    out, _ = OP(*dev, cu.to(npu), None, 32 ** -0.5, True)
    out.square().sum().backward()
    assert fla.CALLS[0]["cu_seqlens"] == (torch.int64, (4,), "npu") and fla.CALLS[0]["cu_seqlens_cpu"][2] == "cpu"
    want, _ = G.reference(*cpu, cu, None, 32 ** -0.5, True)
    want.square().sum().backward()
    assert relative_l2(out.detach().cpu(), want.detach()) < 1e-5
    for ours, theirs in zip(dev, cpu):
        assert relative_l2(ours.grad.cpu(), theirs.grad) < 1e-4


def test_head_dim_32_trains_on_the_reference_without_fla(npu, no_fla):
    model = _model(torch.bfloat16, 32)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1)).to(npu)
    before = sim.op_calls().get("npu_chunk_gated_delta_rule", 0)
    loss, grads = _step(model, ids, compiled=True)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert sim.op_calls().get("npu_chunk_gated_delta_rule", 0) == before
    warnings = [r.getMessage() for r in no_fla.records if r.levelno == logging.WARNING and "Gated DeltaNet" in r.getMessage()]
    infos = [r.getMessage() for r in no_fla.records if r.levelno == logging.INFO and "Gated DeltaNet" in r.getMessage()]
    assert len(warnings) == 1 and "flash-linear-attention>=0.5.2" in warnings[0]
    assert infos == ["qwen_npu: Gated DeltaNet training on the ATen reference: flash-linear-attention is not "
                     "importable (ModuleNotFoundError: import of fla halted; None in sys.modules)"]


def test_head_dim_128_no_grad_forward_runs_torch_npus_op(npu, no_fla):
    """A compiled no-grad forward (8 tokens: the documented L_i <= 8) calls npu_chunk_gated_delta_rule; its result
    equals eager's within bf16."""
    model = _model(torch.bfloat16, 128).eval()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1)).to(npu)
    before = sim.op_calls().get("npu_chunk_gated_delta_rule", 0)
    with torch.no_grad():
        logits = torch.compile(model, backend="qwen_npu", options={"downstream": "aot_eager"})(input_ids=ids).logits
        want = model(input_ids=ids).logits
    assert sim.op_calls().get("npu_chunk_gated_delta_rule", 0) == before + 1
    assert relative_l2(logits.cpu(), want.cpu()) < 2e-2
    # 9 tokens: outside the contract, the reference (no aclnn failure)
    q, k, v = (torch.randn(1, 9, 2, 128, dtype=torch.bfloat16, device=npu) for _ in range(3))
    g, beta = -torch.rand(1, 9, 2, device=npu), torch.rand(1, 9, 2, dtype=torch.bfloat16, device=npu)
    OP(q, k, v, g, beta, None, None, 128 ** -0.5, True)
    assert sim.op_calls().get("npu_chunk_gated_delta_rule", 0) == before + 1


IMPORT_ORDER = """
import torch
import qwen_npu_compile.ops.qwen_npu.gated_delta_rule  # before torch_npu: PrivateUse1 not yet named npu
import torch_npu
q, k, v = (torch.randn(1, 8, 2, 128, dtype=torch.bfloat16).npu() for _ in range(3))
g, beta = -torch.rand(1, 8, 2).npu(), torch.rand(1, 8, 2, dtype=torch.bfloat16).npu()
with torch.no_grad():
    out, _ = torch.ops.qwen_npu.chunk_gated_delta_rule(q, k, v, g, beta, None, None, 128 ** -0.5, True)
print(out.device, torch_npu._ops.CALLS.get("npu_chunk_gated_delta_rule", 0))
"""


def test_the_kernel_is_registered_when_this_package_imports_before_torch_npu():
    import subprocess

    env = sim.subprocess_env()
    env["PYTHONPATH"] = env["PYTHONPATH"].replace(str(STAND_INS), "")  # no FLA: torch_npu's op for this no-grad call
    result = subprocess.run([sys.executable, "-c", IMPORT_ORDER], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["npu:0", "1"]
