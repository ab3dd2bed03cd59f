"""The backend on the simulated Ascend host, as users run it there: the model on ``npu``, transformers taking its
own NPU flash-attention branch by itself (``is_torch_npu_available()`` after ``import torch_npu``: no
``simulated_npu_host`` patching), torch_npu's ops (npu tensors only), the default downstream torchair.

Whole model (``torch.compile(backend="qwen_npu")``, SDPA: transformers' flash-attention wrapper branches on the
data of packed ``position_ids``, a graph break per layer) and per layer (``maybe_compile``, flash_attention_2 as
verl runs it: its varlen takeover), packed (verl's ``use_remove_padding``: one row, ``position_ids`` restarting per
sequence) and padded batches, tiny Qwen2 and Qwen3-MoE from transformers' modeling code: exact fusion counts and
parity with eager on the same device."""

from __future__ import annotations

import copy

import pytest
import sim
import torch

from qwen_npu_compile import get_reports, maybe_compile
from qwen_npu_compile.cli.check.harness import fp32_reference, run_model
from qwen_npu_compile.cli.check.models import tiny_qwen2
from qwen_npu_compile.worker import ENV_COMPILE
from tests.helpers.models import tiny_moe
from tests.helpers.numerics import assert_runs_match

WHOLE_QWEN2 = {"rms_norm": 5, "swiglu": 2, "rotary": 4, "attention": 2}
LAYER_QWEN2 = {"rms_norm": 2, "swiglu": 1, "rotary": 2, "attention": 1}
WHOLE_QWEN3_MOE = {"rms_norm": 9, "moe": 4, "rotary": 4, "attention": 2}  # moe: 2 per sparse block
LAYER_QWEN3_MOE = {"rms_norm": 4, "moe": 2, "rotary": 2, "attention": 1}


def nonzero(counts: dict) -> dict:
    return {family: n for family, n in counts.items() if n}


def packed_batch(npu, lens=(11, 7, 14)):
    ids = torch.randint(0, 128, (1, sum(lens)), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    return {"input_ids": ids.to(npu), "position_ids": positions.to(npu)}


def padded_batch(npu):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    return {"input_ids": ids.to(npu), "attention_mask": mask.to(npu)}


def runs(model, runner, batch):
    kwargs = {k: v for k, v in batch.items() if k != "input_ids"}
    return run_model(model, runner, batch["input_ids"], True, **kwargs)


def test_transformers_takes_its_npu_flash_attention_path_by_itself(npu):
    from transformers.utils import is_torch_npu_available

    assert is_torch_npu_available()
    model = tiny_qwen2(torch.bfloat16, attn="flash_attention_2").to(npu).train()
    before = sim.op_calls().get("npu_fusion_attention", 0)
    logits, grads = runs(model, model, packed_batch(npu))
    assert sim.op_calls()["npu_fusion_attention"] - before == 2  # transformers' npu_flash_attn_varlen_func, per layer
    assert logits.device == npu and torch.isfinite(logits.cpu()).all() and grads


@pytest.mark.parametrize("batch_kind", ["packed", "padded"])
def test_whole_model_on_npu_fuses_and_matches_eager(npu, batch_kind):
    model = tiny_qwen2(torch.bfloat16).to(npu).train()
    batch = packed_batch(npu) if batch_kind == "packed" else padded_batch(npu)
    eager = runs(model, model, batch)
    kwargs = {k: v for k, v in batch.items() if k != "input_ids"}
    reference = fp32_reference(model, batch["input_ids"], True, **kwargs)
    compiled = torch.compile(model, backend="qwen_npu")
    result = runs(model, compiled, batch)
    assert result[0].device == npu
    assert_runs_match(result, eager, reference)
    (report,) = get_reports()
    assert nonzero(report.fusions) == WHOLE_QWEN2, report.refused
    assert report.refused == []


def test_maybe_compile_per_layer_on_npu(npu, monkeypatch):
    monkeypatch.setenv(ENV_COMPILE, "1")
    model = tiny_qwen2(torch.bfloat16, attn="flash_attention_2").to(npu).train()
    reference = copy.deepcopy(model)
    layers = maybe_compile(model)
    assert list(layers) == ["model.layers.0", "model.layers.1"]
    batch = packed_batch(npu)
    result, eager = runs(model, model, batch), runs(reference, reference, batch)
    kwargs = {k: v for k, v in batch.items() if k != "input_ids"}
    assert_runs_match(result, eager, fp32_reference(reference, batch["input_ids"], True, **kwargs))
    for name, record in layers.records.items():
        assert len(record.reports) == 1, name
        assert nonzero(record.reports[0].fusions) == LAYER_QWEN2, (name, record.reports[0].refused)


def test_qwen3_moe_whole_model_on_npu(npu):
    model = tiny_moe("qwen3_moe", torch.bfloat16).to(npu).train()
    batch = packed_batch(npu)
    eager = runs(model, model, batch)
    kwargs = {k: v for k, v in batch.items() if k != "input_ids"}
    reference = fp32_reference(model, batch["input_ids"], True, **kwargs)
    before = sim.op_calls().get("npu_grouped_matmul", 0)
    result = runs(model, torch.compile(model, backend="qwen_npu"), batch)
    assert_runs_match(result, eager, reference)
    (report,) = get_reports()
    assert nonzero(report.fusions) == WHOLE_QWEN3_MOE, report.refused
    assert sim.op_calls()["npu_grouped_matmul"] > before  # torch_npu's grouped matmul ran on npu tensors


def test_qwen3_moe_maybe_compile_per_layer_on_npu(npu, monkeypatch):
    monkeypatch.setenv(ENV_COMPILE, "1")
    model = tiny_moe("qwen3_moe", torch.bfloat16, attn="flash_attention_2").to(npu).train()
    reference = copy.deepcopy(model)
    layers = maybe_compile(model)
    batch = packed_batch(npu)
    result, eager = runs(model, model, batch), runs(reference, reference, batch)
    kwargs = {k: v for k, v in batch.items() if k != "input_ids"}
    assert_runs_match(result, eager, fp32_reference(reference, batch["input_ids"], True, **kwargs))
    assert len(layers.records) == 2
    for name, record in layers.records.items():
        assert len(record.reports) == 1, name
        assert nonzero(record.reports[0].fusions) == LAYER_QWEN3_MOE, (name, record.reports[0].refused)


def test_a_model_left_on_the_cpu_trains_unfused_with_one_warning(caplog):
    """On an Ascend host torch_npu's ops refuse CPU tensors: a model compiled on the CPU (the README's first example
    as written) compiles unfused, saying to move it to the NPU, instead of crashing the step."""
    model = tiny_qwen2(torch.bfloat16).train()
    ids = torch.randint(0, 128, (2, 16))
    eager = run_model(model, model, ids, True)
    result = run_model(model, torch.compile(model, backend="qwen_npu", options={"downstream": "aot_eager"}), ids, True)
    assert_runs_match(result, eager, fp32_reference(model, ids, True))
    (report,) = get_reports()
    assert report.fallback_stage == "fuse" and "model.to('npu')" in report.fallback
    assert not any(report.fusions.values())
