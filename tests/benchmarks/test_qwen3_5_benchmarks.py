"""The Qwen3.5 traffic benchmark (``benchmarks/qwen3_5_traffic.py``: the traffic of the three variants) on a tiny Qwen3.5, per layer
kind.

One training capture per layer kind of the three variants (eager, verl-style, qwen_npu) on
``tiny_hybrid("qwen3_5")``'s shapes (hidden 128, head_dim 64 with rotary on 16 dims, 4 / 2 heads, linear 2 key / 4
value heads of 32) at S = 128 tokens (2 chunks of the delta rule), bf16, under fake tensors; per layer =
graph(2 layers) - graph(1 layer), every layer of the kind. Asserted exactly: the fused kernels per layer kind and
graph of each variant, qwen_npu's fusions per layer, the chunked delta rule's ``bmm`` and triangular-solve FLOPs and
the projections' FLOPs against the formulas from the config, the attention FLOPs (causal for the fused kernel, all
S² pairs for eager's explicit mask). The modelled verl functions (``benchmarks/verl_qwen3_5_patch.py``) are checked
against the notes' description of verl 0.9.1's ``npu_patch`` (ops and numerics, eagerly) and, where verl is
installed (or its ``npu_patch.py`` is named by ``$QWEN_NPU_VERL_NPU_PATCH``), against verl's own functions
(same output and gradients).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repository root on sys.path
    sys.path.insert(0, str(ROOT))

pytest.importorskip("transformers.models.qwen3_5")

from benchmarks import markdown, qwen3_5_traffic, traffic  # noqa: E402
from benchmarks import verl_qwen3_5_patch as verl_model  # noqa: E402

TOKENS = 128
CHUNKS = TOKENS // qwen3_5_traffic.CHUNK
LIN, FULL = "linear_attention", "full_attention"


@pytest.fixture(scope="module")
def config():
    return qwen3_5_traffic.tiny_config()


@pytest.fixture(scope="module")
def rows(config):
    return {kind: qwen3_5_traffic.per_layer_rows(config, kind, TOKENS, torch.bfloat16, inference=False)
            for kind in (LIN, FULL)}


def test_fused_kernels_per_layer_kind(rows):
    """Per layer, the npu / qwen_npu kernels of each graph.

    DeltaNet layer: verl fuses its 3 norms (input, post-attention (1+w), gated) as npu_rms_norm, nothing else;
    qwen_npu fuses the same 3 and the gate of the gated norm and the MLP as npu_swiglu (gate_up_proj feeding the
    MLP's). Full-attention layer: verl and qwen_npu fuse 4 norms (with q/k_norm), 2 partial rotary and the attention;
    qwen_npu also the MLP. The training rotary is ``qwen_npu.rotary_mul_orthogonal`` (fused backward). Eager: none.
    The delta rule op is costed as its kernel runs it: its reference's ATen kernels (qwen_npu), FLA's kernels
    (qwen_npu_fla, ``fla.*`` rows): neither is an npu / qwen_npu kernel.
    """
    got = {kind: {name: row["fused_kernels"] for name, row in by_kind.items()} for kind, by_kind in rows.items()}
    for kind in (LIN, FULL):
        assert got[kind].pop("qwen_npu_fla") == got[kind]["qwen_npu"]
    assert got[LIN] == {
        "eager": {"forward": {}, "backward": {}},
        "verl": {"forward": {"npu.npu_rms_norm.default": 3}, "backward": {"npu.npu_rms_norm_backward.default": 3}},
        "qwen_npu": {
            "forward": {"npu.npu_rms_norm.default": 3, "npu.npu_swiglu.default": 2, "qwen_npu.gate_up_proj.default": 1},
            "backward": {"npu.npu_rms_norm_backward.default": 3, "npu.npu_swiglu_backward.default": 2}},
    }
    assert got[FULL] == {
        "eager": {"forward": {}, "backward": {}},
        "verl": {
            "forward": {"npu.npu_fusion_attention.default": 1, "npu.npu_rms_norm.default": 4,
                        "npu.npu_rotary_mul.default": 2},
            "backward": {"npu.npu_fusion_attention_grad.default": 1, "npu.npu_rms_norm_backward.default": 4,
                         "npu.npu_rotary_mul_backward.default": 2}},
        "qwen_npu": {
            "forward": {"npu.npu_fusion_attention.default": 1, "npu.npu_rms_norm.default": 4,
                        "npu.npu_swiglu.default": 1, "qwen_npu.gate_up_proj.default": 1,
                        "qwen_npu.rotary_mul_orthogonal.default": 2},
            "backward": {"npu.npu_fusion_attention_grad.default": 1, "npu.npu_rms_norm_backward.default": 4,
                         "npu.npu_swiglu_backward.default": 1, "qwen_npu.rotary_mul_orthogonal.default": 2}},
    }


def test_fusions_per_layer(rows):
    """qwen_npu's rewrites per layer kind; eager and verl run no pass of ours."""
    assert rows[LIN]["qwen_npu"]["fusions_per_layer"] == {"gated_delta_rule": 1, "rms_norm_gated": 1, "rms_norm": 2,
                                                          "swiglu": 1}
    assert rows[FULL]["qwen_npu"]["fusions_per_layer"] == {"rms_norm": 4, "swiglu": 1, "rotary": 2, "attention": 1}
    for kind in (LIN, FULL):
        assert rows[kind]["qwen_npu_fla"]["fusions_per_layer"] == rows[kind]["qwen_npu"]["fusions_per_layer"]
        assert rows[kind]["eager"]["fusions_per_layer"] == {}
        assert rows[kind]["verl"]["fusions_per_layer"] == {}


def test_verl_rows_keep_the_gate_eager_in_fp32(rows):
    """verl's gated norm multiplies by silu(gate) eagerly: its forward has one more silu than qwen_npu's (where the gate
    is npu_swiglu) and the fp32 copies around npu_rms_norm; verl's partial rotary ends in a cat (glue)."""
    silu = {name: r["by_op"]["forward"].get("aten.silu.default", {}).get("kernels", 0) for name, r in rows[LIN].items()}
    # eager: the conv's activation, the gated norm's gate, the MLP; verl: the MLP is not patched; qwen_npu: conv only
    assert silu == {"eager": 3, "verl": 3, "qwen_npu": 1, "qwen_npu_fla": 1}
    cat = rows[FULL]["verl"]["by_op"]["forward"]["aten.cat.default"]
    assert cat["kernels"] == 2  # q and k: cat([npu_rotary_mul(q_rot), q_pass])


def test_deltanet_flops_match_the_formula(rows, config):
    """The chunked delta rule is traced ATen ops in eager and verl: the same bmm kernels and FLOPs (4·N + 1 forward:
    2 batched intra-chunk products and 4 per chunk in the scan, less the last chunk's dead state update), and 2
    unit-triangular solves forward, with S·H·(C-1)·(dv + dk) vector FLOPs. qwen_npu (the op on its reference
    kernel): the reference's kernels, with the last state update (the op returns the final state), recomputed in the
    backward. qwen_npu_fla: FLA 0.5.2's kernels, forward S·H·(6·C·dk + 4·C·dv + 6·dk·dv + C²/3), backward that
    forward recomputed plus S·H·(12·C·dk + 10·C·dv + 16·dk·dv + 2·C²) (qwen3_5_traffic.FLA_KERNELS), no bmm, no
    solve."""
    expected = qwen3_5_traffic.expected_deltanet_flops(config, TOKENS)
    heads, dk, dv, c = (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim,
                        qwen3_5_traffic.CHUNK)
    assert expected == {"bmm": TOKENS * heads * (4 * c * dk + 2 * c * dv + 6 * dk * dv) - 2 * c * heads * dk * dv,
                        "solve_triangular": TOKENS * heads * (c - 1) * (dv + dk)}
    reference = rows[LIN]["qwen_npu"]
    assert reference["bmm"]["forward"] == {"kernels": 4 * CHUNKS + 2, "flops": expected["bmm"] + 2 * c * heads * dk * dv}
    assert reference["solve_triangular"]["forward"]["kernels"] == 2
    assert reference["solve_triangular"]["forward"]["vector_flops"] == expected["solve_triangular"]
    assert reference["bmm"]["backward"]["kernels"] > 4 * CHUNKS + 2  # the recompute and the gradients
    fla = rows[LIN]["qwen_npu_fla"]
    forward = 6 * c * dk + 4 * c * dv + 6 * dk * dv + c * c / 3
    for k, per_token, kernels in (("forward", forward, 7),
                                  ("backward", forward + 12 * c * dk + 10 * c * dv + 16 * dk * dv + 2 * c * c, 15)):
        ops = {op: r for op, r in fla["by_op"][k].items() if op.startswith("fla.")}
        assert sum(r["kernels"] for r in ops.values()) == kernels  # the backward op recomputes FLA's forward
        assert sum(r["flops"] for r in ops.values()) == pytest.approx(TOKENS * heads * per_token, abs=20)
        assert fla["bmm"][k]["kernels"] == 0 and fla["solve_triangular"][k]["kernels"] == 0
    for name in ("eager", "verl"):
        row = rows[LIN][name]
        assert row["bmm"]["forward"] == {"kernels": 4 * CHUNKS + 1, "flops": expected["bmm"]}, name
        assert row["solve_triangular"]["forward"]["kernels"] == 2, name
        assert row["solve_triangular"]["forward"]["vector_flops"] == expected["solve_triangular"], name
        assert row["solve_triangular"]["backward"]["kernels"] >= 2, name
    for name, row in rows[FULL].items():
        assert row["bmm"]["forward"]["kernels"] == 0 and row["solve_triangular"]["forward"]["kernels"] == 0, name


def test_projection_and_attention_flops(rows, config):
    """Forward Cube FLOPs per layer = the projections' 2·S·K·N (+ attention's). Full attention: the fused kernel is
    causal, 2·S(S+1)/2·Nq·2D; eager's SDPA with transformers' explicit mask computes all S² pairs."""
    for kind in (LIN, FULL):
        proj = qwen3_5_traffic.expected_projection_flops(config, TOKENS, kind)
        for name, row in rows[kind].items():
            fw = row["by_op"]["forward"]
            matmul = sum(r["flops"] for op, r in fw.items() if r["category"] == "matmul" and op != "aten.bmm.default")
            assert matmul == proj, (kind, name)
    nq, d = config.num_attention_heads, config.head_dim
    causal = 2 * (TOKENS * (TOKENS + 1) // 2) * nq * 2 * d
    assert rows[FULL]["qwen_npu"]["attention_flops"]["forward"] == causal
    assert rows[FULL]["verl"]["attention_flops"]["forward"] == causal
    assert rows[FULL]["eager"]["attention_flops"]["forward"] == 2 * TOKENS * TOKENS * nq * 2 * d


def test_row_totals_are_the_per_op_sums(rows):
    for kind, by_kind in rows.items():
        for name, row in by_kind.items():
            for k in ("forward", "backward"):
                table = row["by_op"][k]
                assert row["bytes"][k] == row["bytes_read"][k] + row["bytes_written"][k], (kind, name)
                assert row["kernels"][k] == sum(r["kernels"] for r in table.values()), (kind, name)
                assert row["est_ms"][k] == pytest.approx(row["bytes"][k] / traffic.BANDWIDTH["bytes_per_second"] * 1e3)
            assert row["roofline_ms"]["total"] == pytest.approx(sum(row["roofline_ms_by_category"].values()))
    # qwen_npu moves fewer bytes than verl-style, verl-style fewer than eager, per layer kind; on a DeltaNet layer the
    # op's reference kernel recomputes its forward in the backward: fewer bytes than eager only; FLA's the fewest
    b = {kind: {name: row["bytes"]["total"] for name, row in by_kind.items()} for kind, by_kind in rows.items()}
    assert b[FULL]["qwen_npu"] == b[FULL]["qwen_npu_fla"] < b[FULL]["verl"] < b[FULL]["eager"], b
    assert b[LIN]["qwen_npu_fla"] < b[LIN]["verl"] < b[LIN]["eager"] and b[LIN]["qwen_npu"] < b[LIN]["eager"], b


def test_markdown_table(rows, config):
    payload = {"models": {"tiny": {"layer_kinds": {kind: {"modes": {"training": by_kind}}
                                                   for kind, by_kind in rows.items()}}}}
    table = markdown.qwen3_5_table(payload)
    assert "| Gated DeltaNet | training | eager |" in table
    assert "| full attention | training | eager |" in table
    assert table.count("| qwen_npu (reference kernel) |") == 3  # 2 layer kinds + the DeltaNet ops table
    assert table.count("| qwen_npu + FLA |") == 3


# ----------------------------------------------------------------------------------------------------
# the modelled verl functions


class _Ops(TorchDispatchMode):
    """Records the ATen/npu ops an eager call dispatches (names without overload)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in ("detach", "alias"):  # no kernel (the npu stand-ins' outputs are detached views)
            self.ops.append(name if func.namespace == "aten" else f"{func.namespace}.{name}")
        return func(*args, **(kwargs or {}))


def _norms(config):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    torch.manual_seed(0)
    norm = modeling.Qwen3_5RMSNorm(config.head_dim, eps=1e-6)
    gated = modeling.Qwen3_5RMSNormGated(config.linear_value_head_dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
        gated.weight.normal_(1.0, 0.5)
    return modeling, norm, gated


def test_modelled_verl_functions_compute_transformers_values_with_npu_ops(config):
    """verl's NPU forms of the Qwen3.5 blocks (``benchmarks/verl_qwen3_5_patch.py``): (1+w) RMSNorm = ``npu_rms_norm(x.float(), 1 + w.float(), eps)[0]
    .type_as(x)``; gated = ``npu_rms_norm`` on fp32, then eager fp32 ``* silu(gate.float())``; partial rotary = slice,
    ``npu_rotary_mul`` on the rotated part, ``cat``. Same values as transformers' originals (fp32 inputs; the npu
    stand-ins compute in fp32), and exactly these ops."""
    from qwen_npu_compile import ensure_npu_ops

    ensure_npu_ops()
    modeling, norm, gated = _norms(config)
    x = torch.randn(2, 5, config.head_dim)
    h, gate = torch.randn(10, config.linear_value_head_dim), torch.randn(10, config.linear_value_head_dim)
    xb, hb, gb = x.bfloat16(), h.bfloat16(), gate.bfloat16()
    with _Ops() as rec:
        y = verl_model.rms_norm_forward(norm, xb)
    # x.float(), 1 + w (w is fp32: .float() is a no-op), the fused norm, type_as(x)
    assert rec.ops == ["_to_copy", "add", "npu.npu_rms_norm", "_to_copy"]
    torch.testing.assert_close(verl_model.rms_norm_forward(norm, x), norm(x), rtol=1e-5, atol=1e-5)
    assert y.dtype == torch.bfloat16
    with _Ops() as rec:
        verl_model.rms_norm_gated_forward(gated, hb, gb)
    # h.to(fp32), the fused norm, gate.to(fp32), silu and mul in fp32 (eager), .to(bf16)
    assert rec.ops == ["_to_copy", "npu.npu_rms_norm", "_to_copy", "silu", "mul", "_to_copy"]
    torch.testing.assert_close(verl_model.rms_norm_gated_forward(gated, h, gate), gated(h, gate), rtol=1e-5, atol=1e-5)

    rot = int(config.head_dim * 0.25)
    q, k = torch.randn(1, 4, 6, config.head_dim), torch.randn(1, 2, 6, config.head_dim)
    angle = torch.randn(1, 6, rot // 2)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    with _Ops() as rec:
        verl_model.apply_rotary_pos_emb(q, k, cos, sin)
    calls = [op for op in rec.ops if op not in ("unsqueeze", "slice")]
    assert calls == ["npu.npu_rotary_mul", "npu.npu_rotary_mul", "cat", "cat"]
    for ours, theirs in zip(verl_model.apply_rotary_pos_emb(q, k, cos, sin), modeling.apply_rotary_pos_emb(q, k, cos, sin)):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # the patch is scoped
    originals = (modeling.Qwen3_5RMSNorm.forward, modeling.Qwen3_5RMSNormGated.forward, modeling.apply_rotary_pos_emb)
    with verl_model.verl_qwen3_5_patches():
        assert modeling.Qwen3_5RMSNorm.forward is verl_model.rms_norm_forward
        assert modeling.Qwen3_5RMSNormGated.forward is verl_model.rms_norm_gated_forward
        assert modeling.apply_rotary_pos_emb is verl_model.apply_rotary_pos_emb
    assert (modeling.Qwen3_5RMSNorm.forward, modeling.Qwen3_5RMSNormGated.forward,
            modeling.apply_rotary_pos_emb) == originals


def _stand_in_torch_npu():
    """A throwaway ``torch_npu`` with the two functions verl's Qwen3.5 patches call, on our ``torch.ops.npu``
    stand-ins (same schemas as torch_npu 2.13.0)."""
    import importlib.machinery
    import types

    module = types.ModuleType("torch_npu", "qwen_npu tests: verl npu_patch's torch_npu, on torch.ops.npu stand-ins")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    module.npu_rms_norm = lambda x, gamma, epsilon=1e-6: torch.ops.npu.npu_rms_norm.default(x, gamma, epsilon)
    module.npu_rotary_mul = lambda x, r1, r2: torch.ops.npu.npu_rotary_mul.default(x, r1, r2)
    return module


def _verl_npu_patch_file() -> Path | None:
    """verl's ``npu_patch.py``: from an installed verl, else ``$QWEN_NPU_VERL_NPU_PATCH`` (a path to the file, e.g.
    unpacked from the verl 0.9.1 wheel), else None."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("verl")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "models" / "transformers" / "npu_patch.py"
        if path.exists():
            return path
    env = os.environ.get("QWEN_NPU_VERL_NPU_PATCH")
    return Path(env) if env and Path(env).exists() else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modelled_verl_functions_match_verls_own(config, dtype):
    """Where verl's ``npu_patch.py`` is found (verl installed, or ``$QWEN_NPU_VERL_NPU_PATCH``): the functions its
    ``_patch_qwen3_5`` assigns, run with ``import torch_npu`` answered by our stand-ins, give exactly the outputs and
    gradients of the modelled ones."""
    import importlib.util

    from qwen_npu_compile import ensure_npu_ops

    path = _verl_npu_patch_file()
    if path is None:
        pytest.skip("verl's npu_patch.py not found (verl not installed, QWEN_NPU_VERL_NPU_PATCH unset)")
    if not ensure_npu_ops().simulated:
        pytest.skip("real torch_npu present")
    saved = sys.modules.get("torch_npu")
    sys.modules["torch_npu"] = _stand_in_torch_npu()
    try:
        spec = importlib.util.spec_from_file_location("_qwen35_verl_npu_patch", path)
        npu_patch = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(npu_patch)
    finally:
        if saved is None:
            del sys.modules["torch_npu"]
        else:
            sys.modules["torch_npu"] = saved
    source = path.read_text()
    for name in ("qwen3_next_rms_norm_forward_npu", "qwen3_next_rms_norm_forward_gated_npu",
                 "qwen3_next_apply_rotary_pos_emb_npu"):
        assert f"modeling_qwen3_5.{'apply_rotary_pos_emb' if 'rotary' in name else 'Qwen3_5RMSNorm'}" in source
        assert f"= {name}" in source, name  # _patch_qwen3_5 assigns it
    _, norm, gated = _norms(config)
    pairs = [(verl_model.rms_norm_forward, npu_patch.qwen3_next_rms_norm_forward_npu, norm, 1),
             (verl_model.rms_norm_gated_forward, npu_patch.qwen3_next_rms_norm_forward_gated_npu, gated, 2)]
    for ours, theirs, module, n_inputs in pairs:
        inputs = [torch.randn(6, module.weight.shape[0]).to(dtype) for _ in range(n_inputs)]
        results = []
        for fn in (ours, theirs):
            module.zero_grad()
            leaves = [t.clone().requires_grad_() for t in inputs]
            out = fn(module, *leaves)
            out.float().square().sum().backward()
            results.append((out.detach(), [t.grad for t in leaves], module.weight.grad.clone()))
        torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    rot = int(config.head_dim * 0.25)
    q, k = torch.randn(1, 4, 6, config.head_dim).to(dtype), torch.randn(1, 2, 6, config.head_dim).to(dtype)
    cos, sin = torch.randn(1, 6, rot).to(dtype), torch.randn(1, 6, rot).to(dtype)
    torch.testing.assert_close(verl_model.apply_rotary_pos_emb(q, k, cos, sin),
                               npu_patch.qwen3_next_apply_rotary_pos_emb_npu(q, k, cos, sin), rtol=0, atol=0)
