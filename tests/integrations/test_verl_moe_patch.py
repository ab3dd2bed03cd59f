"""verl coexistence: a Qwen3-MoE whose sparse MoE block is verl 0.9.1's own ``npu_patch``
(``qwen3_moe_sparse_moe_block_forward_npu``: ``npu_moe_token_permute``, ``histc``, three ``NPUGmmFunction``
grouped matmuls, ``npu_swiglu(cat)``, ``npu_moe_token_unpermute``), compiled with ``qwen_npu``.

verl's real module is imported: its ``import torch_npu`` gets a throwaway module (:func:`tests.helpers.verl_npu_patch.stand_in_torch_npu`)
whose functions are our ``torch.ops.npu`` stand-ins, and ``_patch_qwen3_moe()`` is applied and undone around
each test. Checked: nothing of the patched block is fused twice (its graph compiles unfused, with the reason
below, and verl's fused ops count as already fused), whole model and per layer (``maybe_compile``); the
torchair (GE) conversion's failures, op by op with their reasons; parity with the same patched model run
eagerly, forward and backward.

Found here first: the backend's pre-dispatch retrace (``canonicalize.to_aten_graph``) inlines Dynamo's
``autograd_function_apply`` (verl's ``NPUGmmFunction``) forward under ``_set_grad_enabled(False)`` and drops its
backward: fused, the experts' ``gate_up_proj`` / ``down_proj`` got no gradient at all, silently. Such a graph
now compiles unfused with the reason (``canonicalize.refuse_custom_autograd_functions``), so verl's block is
not fused twice: its graph keeps verl's ops, AOTAutograd runs NPUGmmFunction's own backward, and verl's fused
ops are counted as already fused (``fuse.count_fused_in_captured``).

This file applies verl's patch with no hook installed (what a graph holding verl's block gets). With
``qwen_npu_compile.verl`` and ``QWEN_NPU_COMPILE=1`` the hook keeps verl's block out of the compiled layers
(:mod:`qwen_npu_compile.integrations.verl_npu_patch`; tests/integrations/test_verl_npu_patch.py): moe 2 per layer there.

CPU only: ``torch.histc`` has no integer CPU kernel (verl calls it on the int64 top-k ids; torch_npu's and
CUDA's histc take integers and keep the dtype); :func:`_histc_any_dtype` stands in for it here.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from qwen_npu_compile.cli.check.harness import fp32_reference, run_model  # noqa: E402
from tests.helpers.models import tiny_moe, token_ids  # noqa: E402
from tests.helpers.numerics import assert_runs_match  # noqa: E402
from tests.helpers.torchair import run_ge_script  # noqa: E402
from tests.helpers.verl_npu_patch import verl_qwen3_moe_patched  # noqa: E402

LAYERS = 2


@pytest.fixture
def patched():
    with verl_qwen3_moe_patched() as npu_patch:
        yield npu_patch


def _pair(dtype):
    return [tiny_moe("qwen3_moe", dtype).train() for _ in range(2)]


def test_block_is_verls(patched):
    from transformers.models.qwen3_moe import modeling_qwen3_moe as modeling

    assert modeling.Qwen3MoeSparseMoeBlock.forward is patched.qwen3_moe_sparse_moe_block_forward_npu


#: Why a graph holding verl's block compiles unfused (canonicalize.refuse_custom_autograd_functions): the
#: pre-dispatch retrace would keep NPUGmmFunction's forward only and drop its backward, and the experts'
#: gate_up_proj / down_proj would get no gradient at all (silently: what this file found first).
FALLBACK = "the graph applies a custom torch.autograd.Function at modeling_qwen3_moe.py:"
NOTHING = {"gated_delta_rule": 0, "rms_norm_gated": 0, "rms_norm": 0, "moe": 0, "swiglu": 0, "rotary": 0, "attention": 0}
#: What verl's patch fused, counted as already fused in the unfused graph (fuse.count_fused_in_captured): per
#: layer 4 npu_rms_norm (input, post-attention, q_norm, k_norm) and 2 npu_rotary_mul, and the MoE block's 3
#: NPUGmmFunction grouped matmuls (their forward bodies; the backward bodies' dx/dW are not counted) and its
#: npu_swiglu; the final norm once per model.
ALREADY_FUSED_PER_LAYER = {"gated_delta_rule": 0, "rms_norm_gated": 0, "rms_norm": 4, "moe": 3, "swiglu": 1, "rotary": 2, "attention": 0}


def test_whole_model_compiles_unfused_with_the_reason_and_parity(patched, tmp_path):
    """verl's fused ops stay as verl wrote them (nothing fused twice: no qwen_npu.grouped_matmul), the graph
    compiles unfused with its reason recorded, and forward and backward match the patched model run eagerly
    (every expert weight has its gradient)."""
    model, reference = _pair(torch.bfloat16)
    compiled = torch.compile(model, backend="qwen_npu", options={"dump_dir": str(tmp_path)})
    assert_runs_match(run_model(model, compiled, token_ids(), True), run_model(reference, reference, token_ids(), True),
                      fp32_reference(reference, token_ids(), True))
    from qwen_npu_compile import get_reports

    (report,) = get_reports()
    assert report.fallback_stage == "canonicalize" and report.fallback.startswith(FALLBACK), report.fallback
    assert report.fusions == NOTHING and not any(v.startswith("moe") for v in report.variants)
    assert report.already_fused == {family: n * LAYERS + (family == "rms_norm")
                                    for family, n in ALREADY_FUSED_PER_LAYER.items()}
    forward = report.aot_ops["forward"]
    assert (forward["npu_grouped_matmul"], forward["npu_moe_token_permute"], forward["npu_moe_token_unpermute"]) == (
        3 * LAYERS, LAYERS, LAYERS)
    code = (tmp_path / report.name / "aot_forward.py").read_text()
    assert "torch.ops.qwen_npu.grouped_matmul" not in code  # verl's calls are not rewritten (no double fusion)


def test_strict_names_the_custom_autograd_function(patched):
    model, _ = _pair(torch.bfloat16)
    with pytest.raises(Exception, match=r"compiled unfused \(canonicalize stage failed\): " + FALLBACK):
        run_model(model, torch.compile(model, backend="qwen_npu", options={"strict": True}), token_ids(), True)


def test_per_layer_compiles_unfused_with_the_reason_and_parity(patched, monkeypatch):
    from qwen_npu_compile import maybe_compile
    from qwen_npu_compile.worker import ENV_COMPILE

    monkeypatch.setenv(ENV_COMPILE, "1")
    model, reference = _pair(torch.bfloat16)
    layers = maybe_compile(model, {})
    assert_runs_match(run_model(model, model, token_ids(), True), run_model(reference, reference, token_ids(), True),
                      fp32_reference(reference, token_ids(), True))
    reports = [report for record in layers.records.values() for report in record.reports]
    assert len(reports) == len(layers) == LAYERS
    for report in reports:
        assert report.fallback_stage == "canonicalize" and report.fallback.startswith(FALLBACK), report.fallback
        assert report.fusions == NOTHING and report.already_fused == ALREADY_FUSED_PER_LAYER


GE_SCRIPT = """
import json, sys
import torch
from qwen_npu_compile import ensure_npu_ops, get_reports
ensure_npu_ops()
from tests.helpers.models import tiny_moe, token_ids
from tests.helpers.verl_npu_patch import verl_qwen3_moe_patched
with verl_qwen3_moe_patched():
    model = tiny_moe("qwen3_moe", torch.bfloat16)
    compiled = torch.compile(model, backend="qwen_npu", options={"downstream": "torchair", "dump_dir": sys.argv[1]})
    compiled(input_ids=token_ids(), labels=token_ids()).loss.backward()
print(json.dumps([dict(report.as_dict()["ge"], fusions=report.fusions, already_fused=report.already_fused,
                       downstream=report.as_dict()["downstream"]) for report in get_reports()]))
"""

#: The GE conversion's failures (torch_npu 2.13.0's torchair, off-NPU), in graph order, per MoE layer: torchair
#: has no converter for npu_moe_token_permute / _unpermute and their *_grad_v2 backward ops (no AscendIR
#: registered), nor for aten.histc (no auto-generated converter for built-in ops); and the graph compiles unfused
#: (FALLBACK), so attention stays the CPU's SDPA op, which no NPU has either.
SDPA = ("aten._scaled_dot_product_flash_attention_for_cpu.default", "forward", "Failed to auto-generated converter")
PERMUTE = ("npu.npu_moe_token_permute.default", "forward", "No AscendIR NpuMoeTokenPermute was found to be registered")
HISTC = ("aten.histc.default", "forward", "Failed to auto-generated converter for aten.histc.default to AscendIR")
UNPERMUTE = ("npu.npu_moe_token_unpermute.default", "forward", "No AscendIR NpuMoeTokenUnpermute was found")
UNPERMUTE_GRAD = ("npu.npu_moe_token_unpermute_grad_v2.default", "backward",
                  "No AscendIR NpuMoeTokenUnpermuteGradV2 was found")
PERMUTE_GRAD = ("npu.npu_moe_token_permute_grad_v2.default", "backward", "No AscendIR NpuMoeTokenPermuteGradV2 was found")
SDPA_GRAD = ("aten._scaled_dot_product_flash_attention_for_cpu_backward.default", "backward",
             "Failed to auto-generated converter")
GE_FAILURES = [SDPA, PERMUTE, HISTC, UNPERMUTE] * LAYERS + [UNPERMUTE_GRAD, PERMUTE_GRAD, SDPA_GRAD] * LAYERS


def test_torchair_conversion_records_each_unconvertible_op(tmp_path):
    """Forward and backward GE graphs of a bf16 training step, off-NPU (torchair from the torch_npu wheel;
    skipped without it): no crash, verl's grouped matmuls convert (GroupedMatmul, forward and NPUGmmFunction's
    backward), and every op torchair has no converter for is a recorded failure with its reason (on an NPU the
    hand-off then runs that graph eagerly, docs/bad-inputs.md)."""
    (ge,) = run_ge_script(GE_SCRIPT, tmp_path)
    assert (ge["fusions"], ge["downstream"]) == (NOTHING, "torchair")
    assert ge["already_fused"] == {family: n * LAYERS + (family == "rms_norm") for family, n in ALREADY_FUSED_PER_LAYER.items()}
    kinds = {g["name"]: g["kind"] for g in ge["graphs"]}
    failures = [(f["op"], kinds[f["graph"]], f["error"]) for f in ge["failures"]]
    assert [(op, kind) for op, kind, _ in failures] == [(op, kind) for op, kind, _ in GE_FAILURES]
    for (_, _, error), (_, _, reason) in zip(failures, GE_FAILURES):
        assert reason in error, error
    assert all(f["kind"] == "converter" and f["source"].startswith("modeling_qwen3_moe.py:") for f in ge["failures"])
    forward, backward = ({g["kind"]: g["ops"] for g in ge["graphs"]}[kind] for kind in ("forward", "backward"))
    assert (forward["GroupedMatmul"], forward["SwiGlu"], forward["RmsNorm"]) == (3 * LAYERS, LAYERS, 4 * LAYERS + 1)
    assert (backward["GroupedMatmul"], backward["SwiGluGrad"], backward["RmsNormGrad"]) == (
        2 * 3 * LAYERS, LAYERS, 4 * LAYERS + 1)
