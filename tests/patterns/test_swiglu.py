"""SwiGLU -> ``npu_swiglu``: the layouts (issue 12: merged gate/up weight when tokens >= hidden, else the
activation cat, chosen per graph) with exact counts and parity, and the negatives (an activation used
outside the product, mismatched dtypes). Counts on whole models with RMSNorm: tests/patterns/test_rms_norm.py."""

import pytest
import torch

from conftest import assert_parity
from qwen_npu_compile import get_reports
from qwen_npu_compile.check.models import tiny_qwen2

LAYERS = 2
CORE = {"fusions": "rms_norm,swiglu"}


def _swiglu_inputs(gm: torch.fx.GraphModule) -> list[str]:
    """For each npu_swiglu in ``gm``: ``merged_weight`` or ``activation_cat`` (what feeds it)."""
    found = []
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.npu.npu_swiglu.default):
        source = node.args[0]
        if source.target is torch.ops.aten.linear.default and source.args[1].target is torch.ops.aten.cat.default:
            found.append("merged_weight")
        elif source.target is torch.ops.aten.cat.default:
            found.append("activation_cat")
        else:
            found.append(str(source.target))
    return found


@pytest.mark.parametrize("seq_len,layout", [(16, "activation_cat"), (48, "merged_weight")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
def test_layout_by_tokens_exact_counts_parity(npu_ops, monkeypatch, dtype, train, seq_len, layout):
    """B=2, H=64: 32 tokens < H concatenates activations; 96 tokens >= H concatenates the weights."""
    from qwen_npu_compile import backend

    seen = []
    original = backend.rewrite

    def spy(*args, **kwargs):
        report, gm = original(*args, **kwargs)
        seen.extend(_swiglu_inputs(gm))
        return report, gm

    monkeypatch.setattr(backend, "rewrite", spy)
    model = tiny_qwen2(dtype).train(train)
    reports = assert_parity(model, torch.randint(0, 128, (2, seq_len)), train, dtype, options=CORE)
    assert [r.fusions for r in reports] == [{"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS}]
    assert seen == [layout] * LAYERS
    if train:
        assert reports[0].aot_ops["backward"]["npu_swiglu_backward"] == LAYERS
    # parameters and state-dict keys are untouched by the merged layout
    assert {k for k in model.state_dict() if "mlp" in k} == {
        f"model.layers.{i}.mlp.{p}_proj.weight" for i in range(LAYERS) for p in ("gate", "up", "down")
    }


def test_merge_weights_rule_uses_hints_without_guards():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from qwen_npu_compile.patterns.swiglu import merge_weights

    env = ShapeEnv()
    with FakeTensorMode(shape_env=env) as mode:
        x = mode.from_tensor(torch.empty(1, 4096, 3584), symbolic_context=None)
        assert merge_weights(x, torch.empty(18944, 3584))
        assert not merge_weights(torch.empty(1, 1024, 3584), torch.empty(18944, 3584))
    assert env.guards == []


def test_lora_like_linear_falls_back_to_activation_cat(npu_ops):
    """A gate projection with a bias is not the plain-linear form: the silu*mul variant fuses it."""
    model = tiny_qwen2(torch.float32).eval()
    for layer in model.model.layers:
        layer.mlp.gate_proj.bias = torch.nn.Parameter(torch.zeros(128))
    reports = assert_parity(model, torch.randint(0, 128, (2, 48)), False, torch.float32, options=CORE)
    assert reports[0].fusions == {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS}


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
