"""Tests for qwen_npu_compile.worker: QWEN_NPU_COMPILE, per-layer compile in place, verl's monkey patches.

Single process, no torch.distributed (FSDP is covered by test_fsdp.py).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2 import modeling_qwen2

import qwen_npu_compile
from qwen_npu_compile import ALL_FAMILIES, maybe_compile
from qwen_npu_compile.cli.check.models import tiny_qwen2_config
from qwen_npu_compile.layers import clean_name, find_decoder_layers
from qwen_npu_compile.patterns import expected_fusions
from qwen_npu_compile.worker import ENV_COMPILE, CompiledLayers, layer_reports

LAYERS = 2
PER_LAYER = expected_fusions(Qwen2Config(), per_layer=True)  # one Qwen2 decoder layer


def tiny_config(**overrides) -> Qwen2Config:
    return tiny_qwen2_config(num_hidden_layers=LAYERS, **overrides)


def model_pair(seed: int = 0, **config):
    """Two Qwen2ForCausalLM with equal weights (one to compile, one eager reference), fp32, train mode."""
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_config(**config))
    reference = Qwen2ForCausalLM(tiny_config(**config))
    reference.load_state_dict(model.state_dict())
    return model.train(), reference.train()


def implemented(family: str) -> bool:
    """The family is registered and has patterns (rotary/attention were skeletons for a while)."""
    if family not in ALL_FAMILIES:
        return False
    from qwen_npu_compile.patterns import FAMILIES

    return any(True for _ in FAMILIES[family]().iter_variants())


def tokens(seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(seed))


def assert_layer_graphs(model, expected: dict[str, int], names=None):
    """Every compiled layer ran at least one graph, and each of its graphs fused ``expected``."""
    records = layer_reports(model)
    assert sorted(records) == sorted(names or [f"model.layers.{i}" for i in range(LAYERS)])
    for name, record in records.items():
        assert record.reports, f"{name} ran no qwen_npu graph"
        for report in record.reports:
            for family, count in expected.items():
                assert report.fusions.get(family, 0) == count, (name, report.name, family, report.fusions)


# --- the switch --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "", "0", "false", "no", "off", "FALSE", " Off "])
def test_switched_off_leaves_the_model_alone(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(ENV_COMPILE, raising=False)
    else:
        monkeypatch.setenv(ENV_COMPILE, value)
    model, _ = model_pair()
    result = maybe_compile(model)
    assert result == [] and isinstance(result, CompiledLayers) and not result
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)


@pytest.mark.parametrize("value", ["1", "true", "yes", "on", "TRUE", " Yes "])
def test_switched_on_compiles_each_layer_in_place(monkeypatch, value):
    monkeypatch.setenv(ENV_COMPILE, value)
    model, reference = model_pair()
    classes = [type(m).__name__ for m in model.modules()]
    result = maybe_compile(model)
    assert result == ["model.layers.0", "model.layers.1"]
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    # in place: same classes (FSDP wrap policies match them by name), same state-dict keys
    assert [type(m).__name__ for m in model.modules()] == classes
    assert list(model.state_dict()) == list(reference.state_dict())
    assert [record.class_name for record in result.records.values()] == ["Qwen2DecoderLayer"] * LAYERS


@pytest.mark.parametrize("value", ["2", "maybe", "enable", "1.0", "y", "ture"])
def test_bad_values_are_refused(monkeypatch, value):
    monkeypatch.setenv(ENV_COMPILE, value)
    model, _ = model_pair()
    with pytest.raises(ValueError, match=ENV_COMPILE) as info:
        maybe_compile(model)
    assert "1/true/yes/on" in str(info.value) and "0/false/no/off" in str(info.value) and repr(value) in str(info.value)
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)


def test_environ_argument_overrides_os_environ(monkeypatch):
    monkeypatch.setenv(ENV_COMPILE, "garbage")
    model, _ = model_pair()
    assert maybe_compile(model, environ={}) == []
    assert maybe_compile(model, environ={ENV_COMPILE: "1"}) == ["model.layers.0", "model.layers.1"]


def test_bad_options_are_refused_before_compiling(compile_on):
    model, _ = model_pair()
    with pytest.raises(ValueError, match="unknown option"):
        maybe_compile(model, options={"fusion": "all"})
    with pytest.raises(ValueError, match="unknown fusion famil"):
        maybe_compile(model, options={"fusions": "rmsnorm"})
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)


def test_second_call_keeps_the_compiled_layers(compile_on):
    model, _ = model_pair()
    first = maybe_compile(model)
    calls = [layer._compiled_call_impl for layer in model.model.layers]
    second = maybe_compile(model)
    assert second == first
    assert [layer._compiled_call_impl for layer in model.model.layers] == calls


# --- finding decoder layers ----------------------------------------------------------------------


def test_layers_are_found_from_no_split_modules():
    model, _ = model_pair()
    assert set(model._no_split_modules) == {"Qwen2DecoderLayer"}  # a set on instances in transformers 5
    found = find_decoder_layers(model)
    assert [name for name, _ in found] == ["model.layers.0", "model.layers.1"]
    assert [module for _, module in found] == list(model.model.layers)


def test_layers_are_found_through_fsdp2_style_class_renames():
    # fully_shard swaps a layer's class for a subclass "FSDP<Layer>"; wrap policies run before that,
    # but maybe_compile may be called after: match base classes too.
    model, _ = model_pair()
    renamed = type("FSDPQwen2DecoderLayer", (modeling_qwen2.Qwen2DecoderLayer,), {})
    for layer in model.model.layers:
        layer.__class__ = renamed
    assert [name for name, _ in find_decoder_layers(model)] == ["model.layers.0", "model.layers.1"]


def test_wrapper_parts_are_dropped_from_layer_names():
    assert clean_name("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module") == "model.layers.0"
    assert clean_name("_orig_mod.model.layers.3._checkpoint_wrapped_module") == "model.layers.3"
    assert clean_name("base_model.model.model.layers.1") == "base_model.model.model.layers.1"  # PEFT keeps its names


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.proj(x)) + x


class Stack(nn.Module):
    """Not a Hugging Face model: no _no_split_modules, a ModuleList of identical blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.heads = nn.ModuleList([nn.Linear(8, 2), nn.Linear(8, 3)])  # not identical: ignored

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.heads[0](x)


def test_layers_fall_back_to_a_list_of_identical_blocks():
    model = Stack()
    assert [name for name, _ in find_decoder_layers(model)] == ["blocks.0", "blocks.1", "blocks.2"]
    model._no_split_modules = ["NoSuchLayer"]  # names nothing present: still falls back
    assert [name for name, _ in find_decoder_layers(model)] == ["blocks.0", "blocks.1", "blocks.2"]


def test_unsupported_model_is_refused_with_what_was_looked_for(compile_on):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError) as info:
        maybe_compile(model)
    message = str(info.value)
    assert "Sequential" in message and "_no_split_modules" in message and "model.model.layers" in message
    assert "nn.ModuleList" in message


# --- compiled training -----------------------------------------------------------------------------


def _train_steps(model, steps: int = 2, seq: int = 16):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        ids = tokens(seq, seed=step)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_compiled_layers_train_like_eager_and_report_per_layer(compile_on):
    model, reference = model_pair()
    result = maybe_compile(model)
    losses = _train_steps(model)
    expected = _train_steps(reference)
    assert losses == pytest.approx(expected, abs=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5, msg=name)

    assert_layer_graphs(model, {"rms_norm": 2, "swiglu": 1})
    assert result.not_compiled() == []
    assert result.reports() == {name: record.reports for name, record in layer_reports(model).items()}
    for record in result.records.values():
        assert record.calls == {"compiled": 2, "checkpointed": 0, "eager": 0}
    # all layers share one graph per input shape: the code of a layer is compiled once, not per layer
    assert len({report.name for record in result.records.values() for report in record.reports}) == 1


def test_a_deep_copy_runs_its_own_weights(compile_on):
    # torch drops _compiled_call_impl when a module is copied: the copy runs eagerly, on its own
    # weights, until maybe_compile is called on it too
    model, reference = model_pair(seed=7)
    maybe_compile(model)
    clone = copy.deepcopy(model)
    assert layer_reports(clone) == {}
    with torch.no_grad():
        for p in clone.model.layers[1].parameters():
            p.mul_(0.5)
    reference.load_state_dict(clone.state_dict())
    ids = tokens()
    with torch.no_grad():
        expected = reference(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(clone(input_ids=ids, use_cache=False).logits, expected)
        assert maybe_compile(clone) == ["model.layers.0", "model.layers.1"]
        torch.testing.assert_close(clone(input_ids=ids, use_cache=False).logits, expected, atol=1e-5, rtol=1e-5)
    assert all(record.reports for record in layer_reports(clone).values())
    assert not any(record.reports for record in layer_reports(model).values())  # the original did not run


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_gradient_checkpointing_checkpoints_a_compiled_forward(compile_on):
    model, reference = model_pair(seed=3)
    for m in (model, reference):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    result = maybe_compile(model)
    assert _train_steps(model) == pytest.approx(_train_steps(reference), abs=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5, msg=name)
    # copies get transformers' own checkpoint function back (as torch drops the compile)
    wrapped = {type(layer._gradient_checkpointing_func).__name__ for layer in model.model.layers}
    assert wrapped == {"_CompilingCheckpoint"}
    clone = copy.deepcopy(model)
    assert all(isinstance(layer._gradient_checkpointing_func, functools.partial) for layer in clone.model.layers)
    for record in result.records.values():
        assert record.calls["checkpointed"] == 2 and record.calls["compiled"] == 0
        backward_ops = record.reports[0].aot_ops.get("backward", {})
        assert backward_ops.get("npu_rms_norm_backward") == 2  # the fused op is differentiated by its own backward
    assert_layer_graphs(model, {"rms_norm": 2, "swiglu": 1})


def test_calls_with_a_kv_cache_run_eagerly(compile_on):
    model, reference = model_pair(seed=4)
    model.eval(), reference.eval()
    result = maybe_compile(model)
    ids = tokens(8)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        ref = reference(input_ids=ids, use_cache=True)
        torch.testing.assert_close(out.logits, ref.logits)
        assert all(record.calls["eager"] == 1 and not record.reports for record in result.records.values())
        # without a cache the same model runs compiled
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, ref.logits, atol=1e-5, rtol=1e-5)
    assert_layer_graphs(model, {"rms_norm": 2, "swiglu": 1})


def test_options_reach_the_backend(compile_on):
    model, reference = model_pair(seed=5)
    maybe_compile(model, options={"fusions": "rms_norm"})
    ids = tokens()
    torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits,
                               reference(input_ids=ids, use_cache=False).logits, atol=1e-5, rtol=1e-5)
    assert_layer_graphs(model, {"rms_norm": 2})
    for record in layer_reports(model).values():
        assert record.reports[-1].families == ["rms_norm"]
        assert record.reports[-1].fusions == {"rms_norm": 2}


# --- coexistence with verl's NPU monkey patches ------------------------------------------------------
# verl/models/transformers/npu_patch.py replaces Qwen2RMSNorm.forward, Qwen2MLP.forward and
# modeling_qwen2.apply_rotary_pos_emb with calls of torch_npu.npu_rms_norm / npu_swiglu / npu_rotary_mul.
# The same functions, calling torch.ops.npu (the stand-ins here, torch_npu's ops on an NPU):


def rms_norm_forward_npu(self, x):
    if x.dtype != self.weight.dtype:
        x = x.to(self.weight.dtype)
    return torch.ops.npu.npu_rms_norm(x, self.weight, epsilon=self.variance_epsilon)[0]


def silu_forward_npu(self, hidden_state):
    gate_up = torch.cat((self.gate_proj(hidden_state), self.up_proj(hidden_state)), dim=-1)
    return self.down_proj(torch.ops.npu.npu_swiglu(gate_up, dim=-1))


def apply_rotary_pos_emb_npu(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = torch.ops.npu.npu_rotary_mul(q, cos, sin)
    k_embed = torch.ops.npu.npu_rotary_mul(k, cos, sin)
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


@pytest.mark.parametrize("patch_rotary", [False, True], ids=["rms_norm+swiglu", "verl-npu_patch"])
def test_monkey_patched_ops_count_as_already_fused(monkeypatch, compile_on, patch_rotary):
    qwen_npu_compile.ensure_npu_ops()
    model, reference = model_pair(seed=6)
    ids = tokens()
    with torch.no_grad():
        unpatched = reference(input_ids=ids, use_cache=False).logits

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", rms_norm_forward_npu)
    monkeypatch.setattr(modeling_qwen2.Qwen2MLP, "forward", silu_forward_npu)
    patched_families = {"rms_norm": 2, "swiglu": 1}
    if patch_rotary:
        monkeypatch.setattr(modeling_qwen2, "apply_rotary_pos_emb", apply_rotary_pos_emb_npu)
        patched_families["rotary"] = 2

    maybe_compile(model)
    out = model(input_ids=ids, use_cache=False)
    out.logits.sum().backward()
    eager = reference(input_ids=ids, use_cache=False).logits  # patched too: same ops, eagerly
    torch.testing.assert_close(out.logits, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits.detach(), unpatched, atol=1e-4, rtol=1e-4)

    records = layer_reports(model)
    assert sorted(records) == ["model.layers.0", "model.layers.1"]
    for name, record in records.items():
        assert len(record.reports) == 1, name
        report = record.reports[0]
        for family, count in patched_families.items():
            assert report.already_fused[family] == count, (name, family, report.already_fused)
            assert report.fusions[family] == 0, (name, family, report.fusions)  # nothing fused twice
            assert not [r for r in report.refused if r.family == family], report.refused
        # the forward graph holds each patched op exactly once per call site: no second fused op
        forward_ops = report.aot_ops["forward"]
        assert forward_ops["npu_rms_norm"] == 2 and forward_ops["npu_swiglu"] == 1
        # what the patches leave is still fused
        for family in ("rotary", "attention"):
            if family not in patched_families and implemented(family):
                assert report.fusions[family] == PER_LAYER[family], (name, family, report.fusions)
                assert report.already_fused[family] == 0


# --- import cost -------------------------------------------------------------------------------------


def test_worker_imports_nothing_heavy_at_module_level():
    """worker.py is imported by the package: no torch_npu, transformers or FSDP import at import time."""
    import ast

    import qwen_npu_compile.worker as worker

    assert qwen_npu_compile.maybe_compile is worker.maybe_compile
    tree = ast.parse(Path(worker.__file__).read_text())
    top_level = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top_level.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            top_level.add("." * node.level + (node.module or ""))
    heavy = [name for name in top_level
             if name.startswith(("torch_npu", "transformers", "torch.distributed", ".backend"))]
    assert not heavy, heavy
