"""``recompute="cheap"``: the backward recomputes the cheap fused ops instead of saving their outputs.

Tiny random-weight models of transformers' own modeling code (Qwen2, Qwen3-MoE, Qwen3.5), training steps compiled
with ``recompute`` "none" and "cheap" from the same weights and inputs: logits and every gradient **bit-identical**
(a deterministic op recomputed gives the same bits), the same fusion counts, exact counts of the recomputed ops
(``GraphReport.recomputed``: one per fused norm, rotary and SwiGLU), fewer saved bytes (counted with
``saved_tensors_hooks``, by storage, parameters and attention's fixed compressed mask excluded), and the
recomputed forward ops in the AOT backward graph.
Also under ``maybe_compile`` with HF gradient checkpointing and packed micro-batches (verl's default), through
``QWEN_NPU_RECOMPUTE``, and with the torchair downstream off-NPU (GE converts the recomputing backward graph).
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import transformers

from qwen_npu_compile import maybe_compile
from qwen_npu_compile.config import QwenNpuConfig, QwenNpuConfigError
from qwen_npu_compile.handoff.recompute import cheap_ops
from qwen_npu_compile.report import SUMMARY
from qwen_npu_compile.worker import ENV_COMPILE, layer_reports
from tests.helpers.models import tiny_hybrid, tiny_moe
from tests.helpers.torchair import run_ge_script

TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def _qwen2(dtype):
    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=256, use_cache=False)
    return transformers.Qwen2ForCausalLM(config).to(dtype).train()


def _models():
    cases = [("qwen2", _qwen2)]
    if TRANSFORMERS_5:
        cases += [("qwen3_moe", lambda dtype: tiny_moe("qwen3_moe", dtype).train()),
                  ("qwen3_5", lambda dtype: tiny_hybrid("qwen3_5", dtype).train())]
    return cases


def _recomputed_expected(report) -> dict:
    """Every forward call of a declared cheap op in the graph's AOT forward graph is recomputed: its counts there
    (none for a graph without a backward: nothing is partitioned)."""
    if "backward" not in report.aot_ops:
        return {}
    calls = {f"npu::{op}": n for op, n in report.aot_ops["forward"].items()}
    calls.update({f"qwen_npu::{op}": n for op, n in report.aot_qwen_npu_ops.get("forward", {}).items()})
    return {name: n for name, n in calls.items() if name in cheap_ops() and n}


def _step(model, run, ids):
    """One training step of ``run`` (the model or its compiled form): logits, gradients and the saved bytes."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        # not an activation: npu_fusion_attention's compressed causal mask (sparse_mode 3), one fixed 2048 x 2048
        # bool per graph whatever the tokens (torch_npu 2.13.0 npu_fusion_attention docs)
        mask = tensor.dtype == torch.bool and tuple(tensor.shape) == (2048, 2048)
        if pointer not in params and not mask:
            saved[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = run(input_ids=ids).logits
    (logits.float().logsumexp(-1) * torch.linspace(-1, 1, ids.shape[1])).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads, sum(saved.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("name", "build"), _models(), ids=[name for name, _ in _models()])
def test_cheap_recompute_is_bit_identical_and_saves_less(npu_ops, name, build, dtype):
    runs = {}
    for setting in ("none", "cheap"):
        torch._dynamo.reset()  # each setting compiles from scratch (no automatic-dynamic state of the other)
        model = build(dtype)
        ids = torch.randint(0, model.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(1))
        compiled = torch.compile(model, backend="qwen_npu", options={"recompute": setting, "strict": True})
        first = len(SUMMARY.graphs)
        runs[setting] = (*_step(model, compiled, ids), SUMMARY.graphs[first:])
    (logits, grads, saved, reports), (c_logits, c_grads, c_saved, c_reports) = runs["none"], runs["cheap"]
    assert torch.equal(c_logits, logits)
    assert grads.keys() == c_grads.keys() and all(torch.equal(c_grads[k], grads[k]) for k in grads)
    assert [r.fusions for r in c_reports] == [r.fusions for r in reports]
    assert all(r.recomputed == {} for r in reports)
    for report in c_reports:
        assert report.recomputed == _recomputed_expected(report)
        # one npu_rms_norm per fused norm and gated norm, one rotary op per fused rotary
        norms = report.fusions["rms_norm"] + report.fusions["rms_norm_gated"]
        assert report.recomputed.get("npu::npu_rms_norm", 0) == norms
        assert (report.recomputed.get("npu::npu_rotary_mul", 0)
                + report.recomputed.get("qwen_npu::rotary_mul_orthogonal", 0)) == report.fusions["rotary"]
        # the recomputed forward ops run in the backward graph (a graph fragment without a backward has none)
        backward = report.aot_ops.get("backward", {})
        # ... each tagged call the backward reads: all of them in one whole-model graph; a graph cut by a break may
        # hand a tagged output on to the next graph instead (transformers 5.10.4's MoE on CPU weights)
        tagged = report.recomputed.get("npu::npu_rms_norm", 0)
        recomputed_in_backward = backward.get("npu_rms_norm", 0)
        assert recomputed_in_backward == tagged if len(c_reports) == 1 else recomputed_in_backward <= tagged
        assert report.aot_ops.get("forward") == reports[c_reports.index(report)].aot_ops.get("forward")
    assert c_saved < 0.8 * saved, (c_saved, saved)


def test_maybe_compile_with_checkpointing_and_packed_rows(npu_ops, monkeypatch):
    """verl's way: per decoder layer through ``QWEN_NPU_RECOMPUTE``, packed micro-batches, HF gradient checkpointing
    on and off: bit-identical to recompute none; each layer's graph recomputes its 2 norms, 2 rotaries, 1 SwiGLU."""
    monkeypatch.setenv(ENV_COMPILE, "1")
    lengths = [30, 50, 16]
    ids = torch.randint(0, 256, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    results = {}
    for checkpointing in (False, True):
        for setting in ("none", "cheap"):
            monkeypatch.setenv("QWEN_NPU_RECOMPUTE", setting)
            torch._dynamo.reset()  # the variable is read when a graph compiles: no cached layer graph of the other
            model = _qwen2(torch.bfloat16)
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            maybe_compile(model)
            logits = model(input_ids=ids, position_ids=positions).logits
            logits.float().square().mean().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            recomputed = [r.recomputed for record in layer_reports(model).values() for r in record.reports]
            results[checkpointing, setting] = (logits.detach(), grads, recomputed)
    for checkpointing in (False, True):
        logits, grads, none = results[checkpointing, "none"]
        c_logits, c_grads, cheap = results[checkpointing, "cheap"]
        assert torch.equal(logits, c_logits) and all(torch.equal(grads[k], c_grads[k]) for k in grads)
        assert none and all(r == {} for r in none)
        assert cheap and all(r == {"npu::npu_rms_norm": 2, "npu::npu_rotary_mul": 2, "npu::npu_swiglu": 1}
                             or r == {"npu::npu_rms_norm": 2, "qwen_npu::rotary_mul_orthogonal": 2,
                                      "npu::npu_swiglu": 1} for r in cheap), cheap


def test_bad_values_are_one_line():
    with pytest.raises(QwenNpuConfigError, match=r"^qwen_npu: environment variable QWEN_NPU_RECOMPUTE = 'chep' is "
                       r"not valid \(did you mean 'cheap'\?\); choose one of \['none', 'cheap'\]$"):
        QwenNpuConfig.from_options(None, {"QWEN_NPU_RECOMPUTE": "chep"})
    assert QwenNpuConfig.from_options({"recompute": "Cheap"}, {}).recompute == "cheap"
    assert QwenNpuConfig.from_options(None, {}).recompute == "none"


GE_SCRIPT = textwrap.dedent("""
    import json, sys, torch, transformers
    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=256, use_cache=False)
    out = []
    for setting in ("none", "cheap"):
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).train()
        ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
        compiled = torch.compile(model, backend="qwen_npu", options={"downstream": "torchair", "recompute": setting})
        compiled(input_ids=ids).logits.float().square().mean().backward()
        from qwen_npu_compile import get_reports
        report = get_reports()[-1]
        ge = report.ge
        out.append({"setting": setting, "recomputed": report.recomputed, "failures": len(ge.failures),
                    "graphs": [g.kind for g in ge.graphs], "downstream": report.downstream,
                    "backward": report.aot_ops.get("backward", {}),
                    "grad": model.model.layers[0].mlp.down_proj.weight.grad.float().sum().item()})
    print(json.dumps(out))
""")


def test_torchair_converts_the_recomputing_backward(tmp_path):
    """Off-NPU torchair (the paired torch_npu wheel's): forward and backward GE graphs convert without a failure, the
    backward graph holding the recomputed npu_rms_norm calls; the gradient equals recompute none's."""
    none, cheap = run_ge_script(GE_SCRIPT, tmp_path)
    assert none["recomputed"] == {} and none["failures"] == 0
    assert cheap["recomputed"] == {"npu::npu_rms_norm": 5, "npu::npu_rotary_mul": 4, "npu::npu_swiglu": 2} or \
        cheap["recomputed"] == {"npu::npu_rms_norm": 5, "qwen_npu::rotary_mul_orthogonal": 4, "npu::npu_swiglu": 2}
    assert cheap["failures"] == 0 and cheap["graphs"] == none["graphs"] == ["forward", "backward"]
    assert cheap["downstream"] == none["downstream"]
    assert cheap["backward"].get("npu_rms_norm") == 5 and none["backward"].get("npu_rms_norm", 0) == 0
    assert cheap["grad"] == none["grad"]
    json.dumps(cheap)  # the report's recomputed counts are JSON (summary.json)
