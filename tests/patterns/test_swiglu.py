"""SwiGLU -> ``npu_swiglu``: the copy-free linear form (gate_proj and up_proj written into the
two halves of one ``qwen_npu::gate_up_proj`` buffer, ``npu_swiglu(buf, 0)``, at every token count) with
exact counts and parity on real Qwen2 code, the activation-cat fallback (bias/LoRA, gate used elsewhere),
and the negatives (an activation used outside the product, mismatched dtypes). Counts on whole models
with RMSNorm: tests/patterns/test_rms_norm.py."""

import pytest
import torch

from qwen_npu_compile import get_reports
from qwen_npu_compile.cli.check.harness import run_model
from qwen_npu_compile.cli.check.models import tiny_qwen2
from qwen_npu_compile.ops.qwen_npu import gate_up_proj
from tests.helpers.numerics import assert_parity, assert_runs_match, eager_and_reference

LAYERS = 2
CORE = {"fusions": "rms_norm,swiglu"}
NPU = torch.ops.npu
aten = torch.ops.aten


def _swiglu_inputs(gm: torch.fx.GraphModule) -> list[tuple[str, int]]:
    """For each npu_swiglu in ``gm``: (what feeds it: ``gate_up_proj`` / ``activation_cat`` / the target, dim)."""
    found = []
    for node in gm.graph.find_nodes(op="call_function", target=NPU.npu_swiglu.default):
        source, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
        if source.target is gate_up_proj.OP:
            found.append(("gate_up_proj", dim))
        elif source.target is aten.cat.default:
            found.append(("activation_cat", dim))
        else:
            found.append((str(source.target), dim))
    return found


def _mlp_cats(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """``cat`` nodes of the MLPs: reading a linear's output or gate_up_proj's inputs (x, weights), or
    feeding npu_swiglu (the rotary ``cat``s of cos/sin and rotate_half are none of these)."""
    mlp_inputs = {arg for node in gm.graph.find_nodes(op="call_function", target=gate_up_proj.OP) for arg in node.args}
    found = []
    for cat in gm.graph.find_nodes(op="call_function", target=aten.cat.default):
        inputs = cat.args[0]
        if (any(i.target is aten.linear.default or i in mlp_inputs for i in inputs)
                or any(u.target is NPU.npu_swiglu.default for u in cat.users)):
            found.append(cat)
    return found


@pytest.mark.parametrize("seq_len", [16, 48], ids=["T<H", "T>H"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
def test_linear_form_is_copy_free_at_every_token_count(npu_ops, rewritten, dtype, train, seq_len):
    """B=2, H=64: 32 and 96 tokens both give gate_up_proj + npu_swiglu(dim=0), no cat, exact counts, parity."""
    model = tiny_qwen2(dtype).train(train)
    reports = assert_parity(model, torch.randint(0, 128, (2, seq_len)), train, dtype, options=CORE)
    assert [r.fusions for r in reports] == [{"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS}]
    assert {k: v for k, v in reports[0].variants.items() if k.startswith("swiglu")} == {"swiglu_linear_silu_left": LAYERS}
    [gm] = rewritten
    assert _swiglu_inputs(gm) == [("gate_up_proj", 0)] * LAYERS
    assert len(gm.graph.find_nodes(op="call_function", target=gate_up_proj.OP)) == LAYERS
    assert _mlp_cats(gm) == []
    if train:
        assert reports[0].aot_ops["backward"]["npu_swiglu_backward"] == LAYERS
    # parameters and state-dict keys are untouched
    assert {k for k in model.state_dict() if "mlp" in k} == {
        f"model.layers.{i}.mlp.{p}_proj.weight" for i in range(LAYERS) for p in ("gate", "up", "down")
    }


def test_linear_form_under_dynamic_shapes(npu_ops, rewritten):
    """dynamic=True (verl's varying lengths): one graph, symbolic tokens, the same copy-free form, parity."""
    model = tiny_qwen2(torch.bfloat16).train()
    compiled = torch.compile(model, backend="qwen_npu", options=CORE, dynamic=True)
    for seq in (16, 11):
        input_ids = torch.randint(0, 128, (2, seq))
        eager, reference = eager_and_reference(model, input_ids, True, torch.bfloat16)
        assert_runs_match(run_model(model, compiled, input_ids, True), eager, reference)
    [report] = get_reports()
    assert report.fusions == {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS}
    gm = rewritten[-1]  # the graph that ran (a report per published graph; rewrite may have run more often)
    assert _swiglu_inputs(gm) == [("gate_up_proj", 0)] * LAYERS and _mlp_cats(gm) == []
    [node, *_] = gm.graph.find_nodes(op="call_function", target=gate_up_proj.OP)
    assert any(isinstance(size, torch.SymInt) for size in node.meta["val"].shape)


def test_bias_on_gate_falls_back_to_activation_cat(npu_ops, rewritten):
    """A gate projection with a bias is not the plain-linear form: the silu*mul variant fuses it via cat."""
    model = tiny_qwen2(torch.float32).train()
    for layer in model.model.layers:
        layer.mlp.gate_proj.bias = torch.nn.Parameter(torch.randn(128) * 0.1)
    reports = assert_parity(model, torch.randint(0, 128, (2, 48)), True, torch.float32, options=CORE)
    assert reports[0].fusions == {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS}
    assert reports[0].variants.get("swiglu_linear_silu_left", 0) == 0
    [gm] = rewritten
    assert _swiglu_inputs(gm) == [("activation_cat", -1)] * LAYERS
    assert gm.graph.find_nodes(op="call_function", target=gate_up_proj.OP) == []
    assert len(_mlp_cats(gm)) == LAYERS


class LoraLinear(torch.nn.Module):
    """PEFT's LoRA forward shape: ``base(x) + B(A(x)) * scaling`` (base weight frozen)."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = torch.nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype)
        self.lora_b = torch.nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype)
        torch.nn.init.normal_(self.lora_b.weight, std=0.1)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x)) * 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_projections_keep_the_activation_cat(npu_ops, rewritten, dtype):
    model = tiny_qwen2(dtype).train()
    for layer in model.model.layers:
        layer.mlp.gate_proj = LoraLinear(layer.mlp.gate_proj)
        layer.mlp.up_proj = LoraLinear(layer.mlp.up_proj)
    reports = assert_parity(model, torch.randint(0, 128, (2, 16)), True, dtype, options=CORE)
    assert reports[0].fusions == {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS}
    [gm] = rewritten
    assert _swiglu_inputs(gm) == [("activation_cat", -1)] * LAYERS


class MlpWithGateUsedElsewhere(torch.nn.Module):
    def __init__(self, hidden=8, inter=16):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)

    def forward(self, x):
        gate = self.gate_proj(x)
        return torch.nn.functional.silu(gate) * self.up_proj(x), gate.sum()


def test_gate_used_elsewhere_is_not_the_linear_form(npu_ops, rewritten):
    """The linear form's intermediate (gate) has another user: that variant is refused by the matcher, the
    silu*mul variant fuses with the activation cat; values and gradients match eager."""
    module = MlpWithGateUsedElsewhere()
    x = torch.randn(2, 4, 8, requires_grad=True)
    out, extra = torch.compile(module, backend="qwen_npu", options=CORE)(x)
    ref_out, ref_extra = module(x)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(extra, ref_extra)
    grad = torch.randn_like(out)
    got = torch.autograd.grad((out * grad).sum() + extra, (x, module.gate_proj.weight, module.up_proj.weight))
    want = torch.autograd.grad((ref_out * grad).sum() + ref_extra, (x, module.gate_proj.weight, module.up_proj.weight))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    [report] = get_reports()
    assert report.fusions["swiglu"] == 1 and report.variants == {"swiglu_silu_left": 1}
    [gm] = rewritten
    assert _swiglu_inputs(gm) == [("activation_cat", -1)]


def test_weights_of_another_dtype_refuse_the_linear_form_naming_the_limit():
    from qwen_npu_compile.patterns.swiglu import check_swiglu_linear

    x = torch.empty(2, 4, 8, dtype=torch.bfloat16)
    reason = check_swiglu_linear(x, torch.empty(16, 8), torch.empty(16, 8))
    assert "dtypes differ" in reason and "float32" in reason
    assert check_swiglu_linear(x, torch.empty(16, 8, dtype=torch.bfloat16), torch.empty(16, 8, dtype=torch.bfloat16)) is None
    assert "differ (I or H)" in check_swiglu_linear(x, torch.empty(16, 8, dtype=torch.bfloat16),
                                                    torch.empty(12, 8, dtype=torch.bfloat16))


# --- negatives --------------------------------------------------------------------------------------


class SwiGluLeakingActivation(torch.nn.Module):
    def forward(self, gate, up):
        act = torch.nn.functional.silu(gate)
        return act * up, act.sum()


def test_activation_used_outside_swiglu_is_not_fused(npu_ops):
    gate, up = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    torch.compile(SwiGluLeakingActivation(), backend="qwen_npu", options=CORE)(gate, up)
    [report] = get_reports()
    assert report.fusions["swiglu"] == 0
    (refusal,) = [r for r in report.refused if r.family == "swiglu"]
    assert "used outside" in refusal.reason


def test_swiglu_dtype_mismatch_is_refused(npu_ops):
    def mlp(gate, up):
        return torch.nn.functional.silu(gate) * up

    gate, up = torch.randn(2, 8, dtype=torch.float16), torch.randn(2, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(torch.compile(mlp, backend="qwen_npu", options=CORE)(gate, up), mlp(gate, up))
    [report] = get_reports()
    (refusal,) = report.refused
    assert refusal.family == "swiglu" and "dtype mismatch" in refusal.reason
