"""MoE under per-layer compile (``maybe_compile``, what verl's FSDP workers use): tiny Qwen3-MoE and Qwen2-MoE
of transformers' real modeling code (transformers >= 5: experts as ``grouped_mm``).

Each decoder layer's graph fuses its experts into ``qwen_npu::grouped_matmul`` (``npu_grouped_matmul`` forward
and backward) with ``npu_swiglu`` on the gate/up output, passes ``strict``, and matches the same model run
eagerly, forward and backward; on verl's packed micro-batches (``use_remove_padding``) attention is varlen
attention, for ``sdpa`` and ``flash_attention_2`` (transformers' own NPU flash-attention functions on our
stand-ins). transformers 5.24's MoE base models build their mask themselves (no per-layer-type mask
mapping): ``substitutions/varlen_attention.py`` ``MASK_BUILT_KWARG``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers

from qwen_npu_compile import maybe_compile
from qwen_npu_compile.cli.check.harness import fp32_reference, run_model
from qwen_npu_compile.patterns import expected_fusions
from qwen_npu_compile.patterns.attention import TAKEOVER_VARIANT
from qwen_npu_compile.worker import ENV_COMPILE
from tests.helpers.models import CPU_GROUPED_MM_BREAK, cpu_grouped_mm_alignment_break, packed_row, tiny_moe
from tests.helpers.npu_host import simulated_npu_host
from tests.helpers.numerics import assert_runs_match

pytestmark = [
    pytest.mark.stack_compat,
    pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                       reason="transformers 4.x MoE experts are a per-expert loop (tests/patterns/test_moe.py)"),
]


def _pair(family: str, dtype: torch.dtype, attn: str = "sdpa"):
    return [tiny_moe(family, dtype, attn).train() for _ in range(2)]


def _aot_code(dump_dir, report) -> dict[str, str]:
    """The dumped AOT forward / backward code of one graph, comment lines (model source) left out."""
    folder = dump_dir / report.name
    return {kind: "\n".join(line for line in (folder / f"aot_{kind}.py").read_text().splitlines()
                            if not line.lstrip().startswith("#")) for kind in ("forward", "backward")}


#: Qwen3-MoE in bf16 (aten._grouped_mm) and Qwen2-MoE in fp32 (transformers::grouped_mm_fallback; its shared
#: expert's SwiGLU), the two expert graphs transformers 5 emits.
CASES = [("qwen3_moe", torch.bfloat16), ("qwen2_moe", torch.float32)]


@pytest.mark.parametrize(("family", "dtype"), CASES, ids=[f for f, _ in CASES])
def test_each_layer_fuses_its_experts_with_parity_and_strict(monkeypatch, tmp_path, npu_ops, family, dtype):
    if dtype == torch.bfloat16 and cpu_grouped_mm_alignment_break():
        pytest.skip(CPU_GROUPED_MM_BREAK)
    monkeypatch.setenv(ENV_COMPILE, "1")
    model, reference = _pair(family, dtype)
    layers = maybe_compile(model, {"strict": True, "dump_dir": str(tmp_path)})
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    compiled = run_model(model, model, ids, True)
    eager = run_model(reference, reference, ids, True)
    assert_runs_match(compiled, eager, fp32_reference(reference, ids, True) if dtype != torch.float32 else None)
    per_layer = expected_fusions(model.config, per_layer=True)
    assert per_layer["moe"] == 2 and per_layer["swiglu"] == (1 if family == "qwen2_moe" else 0)
    reports = [report for record in layers.records.values() for report in record.reports]
    assert len(reports) == len(layers) == 2  # one graph per layer
    fused = "moe_grouped_mm" if dtype == torch.bfloat16 else "moe_fallback"
    for report in reports:
        assert report.fusions == per_layer and report.refused == []
        assert {v: n for v, n in report.variants.items() if v.startswith("moe")} == {fused: 1, f"{fused}_swiglu": 1}
    # the dump folder is shared by the layers' identical graphs: one set of AOT graphs to read
    code = _aot_code(tmp_path, reports[0])
    for text in code.values():
        assert "torch.ops.aten._grouped_mm" not in text and "torch.ops.transformers.grouped_mm_fallback" not in text
    assert code["forward"].count("torch.ops.qwen_npu.grouped_matmul.default(") == 2
    assert reports[0].aot_ops["backward"]["npu_grouped_matmul"] == 4  # dx and dW per fused grouped matmul


@pytest.mark.parametrize("attn", ["flash_attention_2", "sdpa"])
def test_packed_micro_batches_run_varlen_attention(monkeypatch, npu_ops, attn):
    """verl's default input on Qwen3-MoE (whose 5.24 base model takes no mask mapping): varlen attention in
    each layer's graph beside the fused experts; 3 packings (one a single sequence) compile at most 2 graphs
    per layer, parity with the eager model each time."""
    monkeypatch.setenv(ENV_COMPILE, "1")
    with simulated_npu_host() if attn == "flash_attention_2" else contextlib.nullcontext():
        model, reference = _pair("qwen3_moe", torch.float32, attn)
        layers = maybe_compile(model)
        assert layers.varlen[0] == "Qwen3MoeModel forward pre-hook"
        for seed, lens in enumerate([[13, 29, 6, 16], [40], [9, 21, 11]]):
            ids, positions = packed_row(lens, seed=seed)
            runs = [run_model(m, m, ids, True, labels=ids, position_ids=positions) for m in (model, reference)]
            assert_runs_match(*runs)
    per_layer = expected_fusions(model.config, per_layer=True)
    for name, record in layers.records.items():
        assert record.calls["compiled"] == 3 and record.calls["eager"] == 0, (name, record.calls)
        assert 1 <= len(record.reports) <= 2, [r.name for r in record.reports]
        for report in record.reports:
            assert report.fusions == per_layer and report.variants[TAKEOVER_VARIANT] == 1, report.fusions
            assert report.refused == []

