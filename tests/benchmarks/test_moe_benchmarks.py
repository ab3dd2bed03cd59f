"""The MoE traffic benchmark (``benchmarks/moe_traffic.py``: the traffic of the three MoE variants) on a tiny Qwen3-MoE, per layer.

One training capture of the three variants (transformers' grouped_mm default, verl-style, qwen_npu) on
``tiny_moe("qwen3_moe")``'s shapes (hidden 64, 4 experts, top-2, ``moe_intermediate_size`` 32) at T = 16 tokens,
bf16, under fake tensors; per layer = graph(2 layers) - graph(1 layer). Asserted exactly: the grouped-matmul kernels
per layer and graph of each variant, their FLOPs against the formula from the config, qwen_npu's ``npu_swiglu``
reading the grouped matmul (no ``cat``) where verl's reads a ``cat`` (whose glue bytes are the formula's), and the
fusions per layer. Where verl is installed, the modelled verl block (``benchmarks/verl_moe_patch.py``) is compared
with verl's real ``npu_patch`` block: same forward and gradients.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repository root on sys.path
    sys.path.insert(0, str(ROOT))

from benchmarks import moe_traffic, traffic  # noqa: E402

TOKENS = 16
ZERO = dict.fromkeys(moe_traffic.GROUPED_MM_LABELS, 0)


@pytest.fixture(scope="module")
def config():
    return moe_traffic.tiny_config()


@pytest.fixture(scope="module")
def rows(config):
    return moe_traffic.per_layer_rows(config, TOKENS, torch.bfloat16, inference=False)


def test_grouped_matmul_kernels_per_layer(rows):
    """transformers: aten._grouped_mm 2 forward / 4 backward; verl: its 3 NPUGmmFunction forwards and
    their dx + dW; qwen_npu: 2 qwen_npu.grouped_matmul forward, 4 npu_grouped_matmul backward, no _grouped_mm."""
    got = {name: row["grouped_mm"] for name, row in rows.items()}
    assert got == {
        "transformers": {"forward": {**ZERO, "aten._grouped_mm": 2}, "backward": {**ZERO, "aten._grouped_mm": 4}},
        "verl": {"forward": {**ZERO, "npu_grouped_matmul": 3}, "backward": {**ZERO, "npu_grouped_matmul": 6}},
        "qwen_npu": {"forward": {**ZERO, "qwen_npu.grouped_matmul": 2}, "backward": {**ZERO, "npu_grouped_matmul": 4}},
    }


def test_grouped_matmul_flops_match_the_formula(rows, config):
    """2·M·K·N over the groups, S = T·k rows: forward gate_up 2·S·H·2I + down 2·S·I·H; backward dx and dW of each
    (dW as K-axis groups: counted as 2·E·K·N·M it would be E times too large)."""
    rows_routed = TOKENS * config.num_experts_per_tok
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    forward = 2 * rows_routed * hidden * 2 * inter + 2 * rows_routed * inter * hidden
    assert moe_traffic.expected_grouped_mm_flops(config, TOKENS) == {"forward": forward, "backward": 2 * forward}
    for name, row in rows.items():
        assert row["grouped_mm_flops"] == {"forward": forward, "backward": 2 * forward, "total": 3 * forward}, name


def test_qwen_npu_swiglu_reads_the_grouped_matmul_without_cat(rows, config):
    """qwen_npu's experts: npu_swiglu on the gate_up grouped matmul's output, no cat and no glue in the forward;
    verl's: npu_swiglu(cat([gate, up])), the cat's glue = read 2 x [S, I] + write [S, 2I] bf16."""
    assert rows["qwen_npu"]["swiglu"]["forward"] == {"npu_swiglu": 1, "fed_by_cat": 0, "fed_by_grouped_matmul": 1}
    assert "aten.cat.default" not in rows["qwen_npu"]["by_op"]["forward"]
    assert rows["qwen_npu"]["glue_bytes"]["forward"] == 0
    assert rows["verl"]["swiglu"]["forward"] == {"npu_swiglu": 1, "fed_by_cat": 1, "fed_by_grouped_matmul": 0}
    cat = rows["verl"]["by_op"]["forward"]["aten.cat.default"]
    routed = TOKENS * config.num_experts_per_tok
    assert (cat["kernels"], cat["glue_kernels"]) == (1, 1)
    assert cat["glue_bytes"] == 2 * (routed * 2 * config.moe_intermediate_size * 2)
    assert rows["transformers"]["swiglu"]["forward"] == {"npu_swiglu": 0, "fed_by_cat": 0, "fed_by_grouped_matmul": 0}


def test_fusions_and_fused_kernels_per_layer(rows):
    """qwen_npu fuses every family of a Qwen3-MoE layer (4 norms with q/k_norm, 2 grouped matmuls, 2 rotary,
    1 attention); transformers' default runs no fused kernel at all."""
    assert rows["qwen_npu"]["fusions_per_layer"] == {"rms_norm": 4, "moe": 2, "rotary": 2, "attention": 1}
    assert rows["transformers"]["fusions_per_layer"] == {}
    for kind in ("forward", "backward"):
        fused = [op for op, row in rows["transformers"]["by_op"][kind].items() if row["category"] == "fused"]
        assert fused == [], kind
    assert rows["verl"]["by_op"]["forward"]["npu.npu_moe_token_permute.default"]["kernels"] == 1
    assert rows["verl"]["by_op"]["backward"]["npu.npu_moe_token_unpermute_grad_v2.default"]["kernels"] == 1


def test_gradients_left_in_a_transposed_layout(rows, config):
    """Non-contiguous gradients the backward graph returns (AccumulateGrad copies them after the graph, read +
    write): verl's down_proj only (its gate_up gradient is the chunk backward's cat, counted in the graph);
    transformers' _grouped_mm backward and qwen_npu's grouped_matmul (dWᵀ by group_type=2 on gᵀ and x for a
    weight passed as param.transpose(1, 2)) return both in the parameters' layout."""
    experts, hidden, inter, b = config.num_experts, config.hidden_size, config.moe_intermediate_size, 2
    gate_up, down = experts * 2 * inter * hidden * b, experts * hidden * inter * b
    copies = {name: {k: row["grad_layout_copies"][k] for k in ("tensors", "bytes")} for name, row in rows.items()}
    assert copies == {"transformers": {"tensors": 0, "bytes": 0}, "verl": {"tensors": 1, "bytes": 2 * down},
                      "qwen_npu": {"tensors": 0, "bytes": 0}}
    cat = rows["verl"]["by_op"]["backward"]["aten.cat.default"]
    assert (cat["kernels"], cat["bytes_read"], cat["bytes_written"]) == (1, gate_up, gate_up)


def test_row_totals_are_the_per_op_sums(rows):
    """The row's columns are the per-op tables' sums (bytes = read + written; roofline = its categories)."""
    for name, row in rows.items():
        for kind in ("forward", "backward"):
            table = row["by_op"][kind]
            assert row["bytes"][kind] == row["bytes_read"][kind] + row["bytes_written"][kind], name
            assert row["kernels"][kind] == sum(r["kernels"] for r in table.values()), name
            assert row["est_ms"][kind] == pytest.approx(row["bytes"][kind] / traffic.BANDWIDTH["bytes_per_second"] * 1e3)
        assert row["roofline_ms"]["total"] == pytest.approx(sum(row["roofline_ms_by_category"].values()))


def test_modelled_verl_block_matches_verls_own(config):
    """benchmarks/verl_moe_patch.py's block against verl 0.9.1's real npu_patch block (run on the stand-ins by
    tests/integrations/test_verl_moe_patch.py's harness): same output and same gradients, fp32, eagerly."""
    pytest.importorskip("verl")
    from transformers.models.qwen3_moe import modeling_qwen3_moe as modeling

    from benchmarks.verl_moe_patch import sparse_moe_block_forward, verl_moe_patches
    from qwen_npu_compile import ensure_npu_ops
    from tests.helpers.verl_npu_patch import verl_qwen3_moe_patched

    ensure_npu_ops()
    torch.manual_seed(0)
    block = modeling.Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(1, TOKENS, config.hidden_size)

    def run():
        block.zero_grad()
        inp = x.clone().requires_grad_()
        out = block(inp)
        out.square().sum().backward()
        return out.detach(), inp.grad, [p.grad.clone() for p in block.parameters()]

    with verl_moe_patches():
        assert modeling.Qwen3MoeSparseMoeBlock.forward is sparse_moe_block_forward
        ours = run()
    with verl_qwen3_moe_patched() as npu_patch:
        assert modeling.Qwen3MoeSparseMoeBlock.forward is npu_patch.qwen3_moe_sparse_moe_block_forward_npu
        theirs = run()
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)
    torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=0)
    for a, b in zip(ours[2], theirs[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
