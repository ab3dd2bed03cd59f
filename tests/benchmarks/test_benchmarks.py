"""Smoke test of the benchmarks (``python -m benchmarks.run --quick``): files, keys, exact counts.

Runs in-process (the registration part still spawns its fresh child), on tiny shapes, into tmp_path.
The kernel counts asserted here are exact per-layer relations that a silently broken pass, counter or
layer split cannot satisfy: one Qwen2 decoder layer holds 2 RMSNorms, 1 SwiGLU, 2 rotary applications
(q and k) and 1 attention.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from transformers.models.qwen2 import modeling_qwen2

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repository root on sys.path
    sys.path.insert(0, str(ROOT))

from benchmarks import run as bench_run  # noqa: E402

FILES = ("kernel_traffic.json", "moe_traffic.json", "compile_cost.json", "registration_cost.json", "summary.md")
META_KEYS = {"command", "versions", "npu_ops", "host", "quick", "part_seconds"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    from transformers import modeling_flash_attention_utils as fa_utils
    from transformers.integrations import npu_flash_attention

    def state():
        return (
            modeling_qwen2.Qwen2RMSNorm.forward,
            modeling_qwen2.Qwen2MLP.forward,
            modeling_qwen2.apply_rotary_pos_emb,
            fa_utils._is_packed_sequence,
            fa_utils.prepare_fa_kwargs_from_position_ids,
            fa_utils.is_torch_npu_available,
            dict(npu_flash_attention.ATTN_MASK_NPU_CACHE),
        )

    originals = state()
    assert bench_run.main(["--quick", "--out", str(out)]) == 0
    # neither verl's patches nor the NPU flash-attention set-up may leak out of the benchmark
    assert state() == originals
    return {name: (out / name) for name in FILES}


def _load(results, name):
    return json.loads(results[name].read_text())


def _kernels(layer: dict, op: str) -> int:
    row = layer["by_op"].get(op)
    return row["kernels"] if row else 0


def test_files_and_metadata(results):
    for name, path in results.items():
        assert path.exists(), name
    for name in FILES[:4]:
        data = _load(results, name)
        assert META_KEYS <= set(data["meta"]), name
        assert data["meta"]["quick"] is True
        assert data["meta"]["npu_ops"]["simulated"] in (True, False)
        assert data["meta"]["versions"]["torch"]
        assert "benchmarks.run" in data["meta"]["command"]
    summary = results["summary.md"].read_text()
    for heading in ("## 1. Kernels and HBM traffic", "## MoE per decoder layer", "## 2. Compile cost",
                    "## 3. Pattern registration"):
        assert heading in summary


def test_kernel_traffic_counts(results):
    data = _load(results, "kernel_traffic.json")
    assert {"bandwidth", "peak", "definitions", "models", "packed"} <= set(data)
    # the Atlas A2 figures are sourced (CANN developer guide), not assumed
    assert data["bandwidth"]["bytes_per_second"] == 1.6e12 and "ASSUMPTION" not in data["bandwidth"]["label"]
    assert data["peak"]["cube_bf16_flops_per_second"] == 353.9e12
    assert data["bandwidth"]["source_url"].startswith("https://") and data["peak"]["source_url"].startswith("https://")
    (model,) = data["models"].values()
    variants = model["variants"]
    assert set(variants) == {"eager", "verl", "qwen_npu"}
    for entry in variants.values():
        assert {"per_layer", "per_forward", "bytes_per_layer", "ratio_to_lower_bound", "est_ms_per_layer"} <= set(entry)

    eager_fw = variants["eager"]["per_layer"]["forward"]
    eager_bw = variants["eager"]["per_layer"]["backward"]
    assert _kernels(eager_fw, "aten.rsqrt.default") == 2  # two unfused RMSNorms per layer
    assert _kernels(eager_fw, "aten.silu.default") == 1
    assert _kernels(eager_fw, "aten.neg.default") == 2  # rotate_half of q and of k
    assert eager_fw["kernels"]["fused"] == 0 and eager_bw["kernels"]["fused"] == 0
    assert eager_fw["kernels"]["attention"] == 1  # one SDPA kernel

    fused = variants["qwen_npu"]
    assert fused["fusions_per_layer"] == {"rms_norm": 2, "swiglu": 1, "rotary": 2, "attention": 1}
    fw, bw = fused["per_layer"]["forward"], fused["per_layer"]["backward"]
    assert _kernels(fw, "npu.npu_rms_norm.default") == 2
    assert _kernels(bw, "npu.npu_rms_norm_backward.default") == 2
    assert _kernels(fw, "npu.npu_swiglu.default") == 1
    assert _kernels(bw, "npu.npu_swiglu_backward.default") == 1
    # torchair target: the orthogonal rotary form (its backward is the forward op again), else npu_rotary_mul
    orthogonal = "qwen_npu.rotary_mul_orthogonal.default"
    assert _kernels(fw, "npu.npu_rotary_mul.default") + _kernels(fw, orthogonal) == 2
    assert _kernels(bw, "npu.npu_rotary_mul_backward.default") + _kernels(bw, orthogonal) == 2
    assert _kernels(fw, "npu.npu_fusion_attention.default") == 1
    assert _kernels(bw, "npu.npu_fusion_attention_grad.default") == 1
    assert _kernels(fw, "aten.rsqrt.default") == 0 and _kernels(fw, "aten.silu.default") == 0
    # SwiGLU without any cat: gate_up_proj (a matmul kernel, no bytes counted) feeds npu_swiglu directly
    assert _kernels(fw, "qwen_npu.gate_up_proj.default") == 1
    assert fw["by_op"]["qwen_npu.gate_up_proj.default"]["category"] == "matmul"
    assert fw["by_op"]["qwen_npu.gate_up_proj.default"]["bytes_read"] == 0
    assert _kernels(fw, "aten.cat.default") == 0 and fw["bytes"]["glue"] == 0
    assert fused["swiglu_forward_bytes_per_layer"]["input_glue"] == 0

    # verl-style = npu_patch + transformers' NPU flash attention (one sequence: npu_fusion_attention, BSND)
    verl_fw, verl_bw = variants["verl"]["per_layer"]["forward"], variants["verl"]["per_layer"]["backward"]
    assert _kernels(verl_fw, "npu.npu_rms_norm.default") == 2
    assert _kernels(verl_fw, "npu.npu_swiglu.default") == 1
    assert _kernels(verl_fw, "npu.npu_rotary_mul.default") == 2
    assert verl_fw["kernels"]["attention"] == 1 and _kernels(verl_fw, "npu.npu_fusion_attention.default") == 1
    assert verl_bw["kernels"]["attention"] == 1 and _kernels(verl_bw, "npu.npu_fusion_attention_grad.default") == 1
    assert not any("scaled_dot_product" in op for layer in (verl_fw, verl_bw) for op in layer["by_op"])
    # both fused kernels read and write the same tensors: attention bytes agree with qwen_npu's exactly
    assert verl_fw["bytes"]["attention"] == fw["bytes"]["attention"]
    assert verl_bw["bytes"]["attention"] == bw["bytes"]["attention"]

    # roofline: matmul FLOPs are 2·M·N·K of the layer's projections, identical in every variant
    shape = model["shape"]
    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    nq, nkv, t = shape["num_attention_heads"], shape["num_key_value_heads"], shape["seq_len"]
    per_token = h * (nq + 2 * nkv) * d + nq * d * h + 3 * h * i  # q/k/v, o, gate/up/down weights
    for entry in variants.values():
        assert entry["matmul_flops_per_layer"] == 3 * 2 * t * per_token  # forward 2·T·P, backward twice that
        assert entry["roofline_ms_per_layer"]["total"] > entry["est_ms_per_layer"]["total"] > 0
    # the one-sequence attention is causal: T(T+1)/2 pairs, forward 2·pairs·Nq·2D, backward 2·pairs·Nq·5D
    pairs = t * (t + 1) // 2
    assert variants["qwen_npu"]["attention_flops_per_layer"] == 2 * pairs * nq * 2 * d + 2 * pairs * nq * 5 * d
    assert variants["verl"]["attention_flops_per_layer"] == variants["qwen_npu"]["attention_flops_per_layer"]

    moved = {name: entry["bytes_per_layer"]["total"] for name, entry in variants.items()}
    assert moved["eager"] > moved["verl"] > 0
    assert moved["eager"] > moved["qwen_npu"] > 0
    bound = model["lower_bound"]["bytes_per_layer"]["total"]
    assert 0 < bound <= moved["qwen_npu"]
    assert variants["qwen_npu"]["ratio_to_lower_bound"]["total"] >= 1.0
    assert variants["eager"]["ratio_to_lower_bound"]["total"] > variants["qwen_npu"]["ratio_to_lower_bound"]["total"]


def test_compile_cost_keys(results):
    data = _load(results, "compile_cost.json")
    assert {"setup", "samples", "medians", "growth"} <= set(data)
    layers = [str(n) for n in data["setup"]["layers"]]
    assert set(data["medians"]) == set(layers)
    for m in data["medians"].values():
        assert m["capture_s"] > 0 and m["aot_s"] > 0 and m["ours_s"] > 0
        assert m["ratio_ours_to_capture_aot"] > 0
    assert {"capture_s", "aot_s", "capture_aot_s", "ours_s"} <= set(data["growth"])
    for sample in data["samples"][layers[-1]]:
        assert sample["graphs"] == 1
        assert sample["fusions"]["rms_norm"] == 2 * int(layers[-1]) + 1  # 2 per layer + the final norm
        assert sample["fusions"]["swiglu"] == int(layers[-1])


def test_registration_is_once_per_process(results):
    data = _load(results, "registration_cost.json")
    assert not any(data["registered_before_first_compile"].values())
    assert data["first_compile"]["register_replacement_calls"] == sum(
        f["variants"] for f in data["per_family"].values()
    ) > 0
    assert data["second_compile"]["register_replacement_calls"] == 0
    assert data["second_compile_pays_registration"] is False
    assert data["registration_total_s"] > 0


def test_inference_rows_and_verl_step(results):
    """Issue 12: inference forwards (npu_add_rms_norm), the verl-step view and the math backward bound."""
    data = _load(results, "kernel_traffic.json")
    (infer,) = data["inference"].values()
    assert infer["mode"] == "inference"
    ours = infer["variants"]["qwen_npu"]["per_layer"]["forward"]
    assert _kernels(ours, "npu.npu_add_rms_norm.default") == 2  # both norms of a layer follow a residual add
    assert _kernels(ours, "npu.npu_rms_norm.default") == 0
    assert "backward" not in infer["variants"]["qwen_npu"]["per_layer"]
    (model,) = data["models"].values()
    math = model["lower_bound"]["math_backward"]
    assert math["bytes"] == sum(math["terms"].values()) > 0
    (step,) = data["verl_step"].values()
    variants = step["variants"]
    assert set(variants) == {"eager", "verl", "qwen_npu"}
    for name, entry in variants.items():
        train = model["variants"][name]["bytes_per_layer"]["total"]
        assert entry["bytes_per_layer"] == train + 2 * infer["variants"][name]["bytes_per_layer"]["total"]
        assert entry["bytes_per_step"] == step["layers"] * entry["bytes_per_layer"] + entry["per_forward_bytes"]  # all 3 forwards
    assert variants["eager"]["bytes_per_layer"] > variants["qwen_npu"]["bytes_per_layer"]
    # at the smoke test's S=64 the per-forward work is not comparable: the provably causal mask becomes the
    # kernel's 2048x2048 compressed mask (built once per forward, 12 MiB moved) instead of a 64x64 mask



def test_packed_rows(results):
    """Issue 18: a packed row (T=40 as 8 + 16 + 16): explicit T×T mask vs varlen vs verl-style (TND)."""
    data = _load(results, "kernel_traffic.json")
    (packed,) = data["packed"].values()
    assert set(packed) == {"training", "ratios"}  # the quick run measures training only
    model = packed["training"]
    assert model["shape"]["packing"] == [8, 16, 16] and model["shape"]["seq_len"] == 40
    variants = model["variants"]
    assert set(variants) == {"qwen_npu_explicit_mask", "qwen_npu_varlen", "verl"}
    explicit, varlen, verl = (variants[n] for n in ("qwen_npu_explicit_mask", "qwen_npu_varlen", "verl"))
    families = {"rms_norm": 2, "swiglu": 1, "rotary": 2, "attention": 1}
    assert explicit["fusions_per_layer"] == families and varlen["fusions_per_layer"] == families

    # no T×T tensor anywhere in the varlen and verl graphs; the explicit mask is built in the forward and
    # saved for the backward
    for entry in (varlen, verl):
        assert all(sq["tensors"] == 0 and sq["kernels_reading"] == 0 for sq in entry["square_tensors"].values())
    assert explicit["square_tensors"]["forward"]["written"] > 0
    assert explicit["square_tensors"]["backward"]["inputs"] > 0

    ex_fw, ex_bw = explicit["per_layer"]["forward"], explicit["per_layer"]["backward"]
    vl_fw, vl_bw = varlen["per_layer"]["forward"], varlen["per_layer"]["backward"]
    ve_fw, ve_bw = verl["per_layer"]["forward"], verl["per_layer"]["backward"]
    assert _kernels(ex_fw, "npu.npu_fusion_attention.default") == 1
    assert _kernels(ex_bw, "npu.npu_fusion_attention_grad.default") == 1
    assert _kernels(vl_fw, "qwen_npu.varlen_attention.default") == 1
    assert _kernels(vl_bw, "qwen_npu.varlen_attention_backward.default") == 1
    assert vl_fw["kernels"]["attention"] == 1 and _kernels(vl_fw, "npu.npu_fusion_attention.default") == 0
    assert _kernels(ve_fw, "npu.npu_fusion_attention.default") == 1  # transformers' TND call
    assert _kernels(ve_bw, "npu.npu_fusion_attention_grad.default") == 1

    # attention FLOPs: Σ len(len+1)/2 pairs per sequence (causal) vs T² (explicit mask: no block skipped)
    shape = model["shape"]
    nq, d = shape["num_attention_heads"], shape["head_dim"]
    causal = sum(n * (n + 1) // 2 for n in (8, 16, 16))
    full = 40 * 40

    def flops(pairs):
        return 2 * pairs * nq * 2 * d + 2 * pairs * nq * 5 * d  # forward QKᵀ + PV, backward 5 matmuls

    assert varlen["attention_flops_per_layer"] == flops(causal)
    assert verl["attention_flops_per_layer"] == flops(causal)
    assert explicit["attention_flops_per_layer"] == flops(full)
    assert packed["ratios"]["training"]["qwen_npu_explicit_mask"]["attention_flops"] == full / causal

    # varlen's kernel reads what verl's TND kernel reads (q, k, v, min(2048², T²) bytes of the compressed
    # mask), plus its int64 offsets (3 sequences)
    assert vl_fw["bytes"]["attention"] == ve_fw["bytes"]["attention"] + 8 * 3
    assert vl_bw["bytes"]["attention"] == ve_bw["bytes"]["attention"] + 8 * 3
    for entry in variants.values():  # at these tiny shapes every kernel is memory-bound: no ordering asserted
        assert entry["roofline_ms_per_layer"]["total"] > 0
    summary = results["summary.md"].read_text()
    assert "## 1d. Packed sequences" in summary


def test_packing_must_fill_one_row():
    """A packing that does not sum to S in one row is refused before anything is captured."""
    import torch

    from benchmarks import traffic
    from qwen_npu_compile.cli.check.models import tiny_qwen2_config

    with pytest.raises(ValueError, match="must sum to S=40 in one row"):
        traffic.build_graphs(tiny_qwen2_config(), 1, traffic.PACKED_VARIANTS[:1], 1, 40, torch.bfloat16, packing=(8, 16))
    with pytest.raises(ValueError, match="B=2"):
        traffic.build_graphs(tiny_qwen2_config(), 1, traffic.PACKED_VARIANTS[:1], 2, 40, torch.bfloat16, packing=(8, 32))
    with pytest.raises(ValueError, match="agree"):
        traffic.build_graphs(tiny_qwen2_config(), 1, traffic.PACKED_VARIANTS, 1, 40, torch.bfloat16, packing=(8, 32))


# ----------------------------------------------------------------------------------------------------
# activation memory (benchmarks/activation_memory.py)


@pytest.fixture(scope="module")
def activation_memory(tmp_path_factory):
    """The quick activation-memory part alone (tiny configs, S = 128, fake vs real on the dense layer)."""
    out = tmp_path_factory.mktemp("am")
    assert bench_run.main(["--quick", "--parts", "activation_memory", "--out", str(out)]) == 0
    return json.loads((out / "activation_memory.json").read_text())


def test_activation_memory_structure(activation_memory):
    from benchmarks import activation_memory as am

    data = activation_memory
    assert data["kind"] == "activation_memory" and data["meta"]["quick"] is True and data["tokens"] == am.QUICK_TOKENS
    assert list(data["layers"]) == [case.key for case in am.CASES]
    for key, entry in data["layers"].items():
        assert list(entry["settings"]) == list(am.SETTINGS), key
        for setting, row in entry["settings"].items():
            assert {"activation_bytes", "activation_excluding_input_bytes", "layer_input_bytes", "constant_bytes",
                    "storages", "excluded", "tensors", "mib_per_1k_tokens", "layer_ms", "recompute_ms",
                    "recompute_fraction"} <= set(row), (key, setting)
            assert row["activation_bytes"] == row["layer_input_bytes"] + row["activation_excluding_input_bytes"]
            assert row["activation_bytes"] == sum(t["bytes"] for t in row["tensors"])
        s = entry["settings"]
        # the compiled settings: what the hooks saw is what the AOT backward graph reads
        for setting in ("qwen_npu_none", "qwen_npu_cheap"):
            assert s[setting]["graph"]["intermediate_bytes"] == s[setting]["activation_excluding_input_bytes"]
        assert s["qwen_npu_none"]["recomputed"] == {} and s["qwen_npu_cheap"]["recomputed"], key
        assert s["qwen_npu_cheap"]["recompute_ms"] > 0 and s["qwen_npu_cheap"]["recompute_ops"]
        # non-reentrant checkpointing saves the layer's input, [1, S, H] bf16, and nothing else
        hidden = {"qwen2.5-7b": 64, "qwen3-30b-a3b": 64}.get(key, 128)
        assert s["hf_checkpointing"]["activation_bytes"] == s["hf_checkpointing"]["layer_input_bytes"] == \
            data["tokens"] * hidden * 2
    assert set(data["verl_step"]) == set(am.MODELS) and set(data["goals"]) == set(data["layers"])
    for model, by_setting in data["verl_step"].items():
        assert list(by_setting) == list(am.SETTINGS)
        assert by_setting["hf_checkpointing"]["tokens"] > by_setting["qwen_npu_cheap"]["tokens"] > 0, model
    for case, by_setting in data["fake_vs_real"].items():
        for setting, by_s in by_setting.items():
            for pair in by_s.values():
                assert pair["fake"] == pair["real"] and pair["fake_storages"] == pair["real_storages"], (case, setting)


def test_activation_memory_dense_order(activation_memory):
    """cheap < none < eager on the dense layer, per token (the compressed mask, a constant 4 MiB, left out: at the
    quick run's 128 tokens it would outweigh the rest)."""
    s = activation_memory["layers"]["qwen2.5-7b"]["settings"]
    per_token = {name: row["activation_bytes"] - row["constant_bytes"] for name, row in s.items()}
    assert per_token["qwen_npu_cheap"] < per_token["qwen_npu_none"] < per_token["eager"], per_token


def test_activation_memory_docs_table():
    """docs/performance.md's "Activation memory" tables are the rendering of the committed results."""
    from benchmarks import markdown

    data = json.loads((ROOT / "benchmarks/results/activation_memory.json").read_text())
    assert markdown.activation_memory_table(data) in (ROOT / "docs/performance.md").read_text()
