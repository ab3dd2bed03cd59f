"""Packed micro-batches under per-layer compile (``maybe_compile``): varlen attention with host offsets.

verl's default input (``use_remove_padding``): ``input_ids (1, T)``, ``position_ids (1, T)`` restarting at
0 per sequence, no attention mask, ``use_cache=False``. The references are the same model run eagerly
without ``QWEN_NPU_COMPILE``: for ``sdpa`` transformers' block-diagonal mask, for ``flash_attention_2``
transformers' own NPU flash-attention functions (``npu_fusion_attention`` TND / BSND) driven with our
stand-ins (:func:`tests.helpers.npu_host.simulated_npu_host`), as on an Ascend host.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from qwen_npu_compile import maybe_compile
from qwen_npu_compile.cli.check.harness import run_model
from qwen_npu_compile.cli.check.models import tiny_qwen2_config
from qwen_npu_compile.ops.qwen_npu import varlen_attention
from qwen_npu_compile.patterns import expected_fusions
from qwen_npu_compile.patterns.attention import TAKEOVER_VARIANT
from qwen_npu_compile.substitutions import varlen_attention as varlen
from qwen_npu_compile.worker import ENV_COMPILE
from tests.helpers.npu_host import simulated_npu_host
from tests.helpers.numerics import assert_runs_match

#: head_dim 64 (a realistic width), GQA 4/2.
CONFIG = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
#: One decoder layer's graph: rms_norm 2, swiglu 1, rotary 2, attention 1 (the varlen takeover), from the
#: families' own declarations (a family with nothing to fuse in Qwen2 expects 0).
PER_LAYER = expected_fusions(Qwen2Config(), per_layer=True)
assert {k: PER_LAYER[k] for k in ("rms_norm", "swiglu", "rotary", "attention")} == {
    "rms_norm": 2, "swiglu": 1, "rotary": 2, "attention": 1}


def packed(lens: list[int], seed: int = 0) -> dict:
    """One packed row: ``input_ids (1, T)`` and ``position_ids (1, T)`` restarting at 0 per sequence."""
    total = sum(lens)
    ids = torch.randint(0, 128, (1, total), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    return {"input_ids": ids, "position_ids": positions}


def random_packings(count: int, seed: int = 0) -> list[list[int]]:
    """``count`` packings with different T and different numbers of sequences (1 included)."""
    rng = random.Random(seed)
    out = [[37]]
    while len(out) < count:
        total, nseq = rng.randint(24, 72), rng.randint(1, 7)
        cuts = sorted(rng.sample(range(1, total), nseq - 1))
        out.append([b - a for a, b in zip([0, *cuts], [*cuts, total])])
    return out


def host(attn: str):
    return simulated_npu_host() if attn == "flash_attention_2" else contextlib.nullcontext()


def pair(attn: str, dtype: torch.dtype, **overrides):
    """(model to compile, eager reference) with equal weights, in train mode."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        config = tiny_qwen2_config(**{**CONFIG, **overrides})
        models.append(Qwen2ForCausalLM._from_config(config, attn_implementation=attn).to(dtype).train())
    return models


def step(model, batch, train=True):
    return run_model(model, model, batch["input_ids"], train, labels=batch["input_ids"] if train else None,
                     position_ids=batch["position_ids"])


def fp32_step(model, batch, train=True):
    import copy

    reference = copy.deepcopy(model).float()
    return step(reference, batch, train)


class _SquareTensors(TorchDispatchMode):
    """Records every op whose output (or input) has last two dims (T, T)."""

    def __init__(self, total: int):
        super().__init__()
        self.total, self.seen = total, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_leaves((args, kwargs, out))
        if any(isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) == (self.total,) * 2 for t in flat):
            self.seen.append(str(func))
        return out


def aot_calls(dump_dir, op: str) -> dict[str, int]:
    """Calls of ``op`` in the dumped AOT forward / backward graphs of the first (only) graph folder."""
    (folder,) = [p for p in dump_dir.iterdir() if p.is_dir()]
    return {kind: (folder / f"aot_{kind}.py").read_text().count(f"torch.ops.qwen_npu.{op}.default(")
            for kind in ("forward", "backward")}


@pytest.mark.parametrize("attn", ["flash_attention_2", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_training_step_runs_varlen(monkeypatch, tmp_path, npu_ops, attn, dtype):
    """One graph per layer with varlen attention (counts 2/1/2/1), parity with eager fwd+bwd, the AOT
    backward holds the varlen backward op."""
    monkeypatch.setenv(ENV_COMPILE, "1")
    with host(attn):
        model, reference = pair(attn, dtype)
        layers = maybe_compile(model, {"dump_dir": str(tmp_path)})
        assert layers.varlen[0] == "Qwen2Model forward pre-hook"
        batch = packed([13, 29, 6, 16])
        compiled = step(model, batch)
        eager = step(reference, batch)
        assert_runs_match(compiled, eager, fp32_step(reference, batch) if dtype != torch.float32 else None)
    for name, record in layers.records.items():
        assert len(record.reports) == 1, name
        report = record.reports[0]
        assert report.fusions == PER_LAYER, (name, report.fusions, report.refused)
        assert report.variants[TAKEOVER_VARIANT] == 1
        assert report.refused == [], report.refused
    assert aot_calls(tmp_path, "varlen_attention") == {"forward": 1, "backward": 0}
    assert aot_calls(tmp_path, "varlen_attention_backward") == {"forward": 0, "backward": 1}


@pytest.mark.parametrize("attn", ["flash_attention_2", "sdpa"])
def test_twenty_packings_compile_at_most_two_graphs(monkeypatch, npu_ops, attn):
    """verl's dynamic batch size: T and the number of sequences change every micro-batch (a single
    sequence included); no layer runs eagerly, at most 2 graphs per layer call site, parity each time."""
    monkeypatch.setenv(ENV_COMPILE, "1")
    with host(attn):
        model, reference = pair(attn, torch.float32)
        layers = maybe_compile(model)
        for i, lens in enumerate(random_packings(20)):
            batch = packed(lens, seed=i)
            assert_runs_match(step(model, batch), step(reference, batch))
    assert layers.not_compiled() == []
    for name, record in layers.records.items():
        assert record.calls["compiled"] == 20 and record.calls["eager"] == 0, (name, record.calls)
        assert 1 <= len(record.reports) <= 2, [r.name for r in record.reports]
        assert all(r.fusions == PER_LAYER for r in record.reports)


@pytest.mark.parametrize("attn", ["flash_attention_2", "sdpa"])
def test_profiled_step_touches_no_t_by_t_tensor(monkeypatch, npu_ops, attn):
    """A packed training step (forward and backward, compiled) never holds a [..., T, T] tensor; the same
    step without QWEN_NPU_COMPILE under sdpa does (the block-diagonal mask), which shows the probe works."""
    lens = [11, 23, 9, 24]  # T = 67: no other dim of the model equals it
    total = sum(lens)
    batch = packed(lens)
    monkeypatch.setenv(ENV_COMPILE, "1")
    with host(attn):
        model, reference = pair(attn, torch.bfloat16)
        maybe_compile(model)
        step(model, batch)  # compile outside the probe
        with _SquareTensors(total) as probe:
            step(model, batch)
        assert probe.seen == []
        if attn == "sdpa":
            with _SquareTensors(total) as eager_probe:
                step(reference, batch)
            assert eager_probe.seen, "the eager sdpa step builds the T x T mask"


def test_gradient_checkpointing(monkeypatch, npu_ops):
    """verl's default gradient checkpointing (non-reentrant): the checkpointed layer runs its compiled
    forward with varlen attention, recomputation included."""
    monkeypatch.setenv(ENV_COMPILE, "1")
    with host("flash_attention_2"):
        model, reference = pair("flash_attention_2", torch.float32)
        for m in (model, reference):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        layers = maybe_compile(model)
        batch = packed([8, 30, 12])
        assert_runs_match(step(model, batch), step(reference, batch))
    for record in layers.records.values():
        assert record.calls["checkpointed"] == 1
        assert [r.fusions for r in record.reports] == [PER_LAYER]


@pytest.mark.parametrize(
    "case",
    ["attention_mask", "batch_of_two", "sliding_window", "kv_cache"],
)
def test_not_packed_keeps_transformers_path(monkeypatch, npu_ops, case):
    """Anything that is not provably one packed causal row keeps transformers' own attention path (sdpa:
    today's fused explicit mask), with equal results."""
    monkeypatch.setenv(ENV_COMPILE, "1")
    overrides = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0} if case == "sliding_window" else {}
    model, reference = pair("sdpa", torch.float32, **overrides)
    maybe_compile(model)
    batch = packed([10, 14])
    kwargs = {"position_ids": batch["position_ids"]}
    if case == "attention_mask":
        kwargs["attention_mask"] = torch.ones_like(batch["input_ids"])
    if case == "batch_of_two":
        batch = {"input_ids": batch["input_ids"].repeat(2, 1)}
        kwargs = {"position_ids": packed([10, 14])["position_ids"].repeat(2, 1)}
    reason = varlen.packing_refusal(model.model, {**kwargs, "use_cache": case == "kv_cache"})
    assert reason is not None
    if case == "kv_cache":
        return  # a cache runs the layers eagerly (test_worker.py); the refusal is what matters here
    from qwen_npu_compile.report import SUMMARY

    assert_runs_match(
        run_model(model, model, batch["input_ids"], True, labels=batch["input_ids"], **kwargs),
        run_model(reference, reference, batch["input_ids"], True, labels=batch["input_ids"], **kwargs),
    )
    assert all(TAKEOVER_VARIANT not in g.variants for g in SUMMARY.graphs)


def test_switched_off_leaves_model_untouched(monkeypatch, npu_ops):
    monkeypatch.delenv(ENV_COMPILE, raising=False)
    model, _ = pair("sdpa", torch.float32)
    assert maybe_compile(model) == []
    assert not model.model._forward_pre_hooks
    assert getattr(model.model, "_qwen_npu_varlen_hook", None) is None


def test_attention_family_disabled_installs_nothing(monkeypatch, npu_ops):
    monkeypatch.setenv(ENV_COMPILE, "1")
    model, _ = pair("sdpa", torch.float32)
    layers = maybe_compile(model, {"fusions": "rms_norm,swiglu,rotary"})
    assert layers.varlen == [] and not model.model._forward_pre_hooks


def test_changed_transformers_fails_loudly(monkeypatch, npu_ops):
    """A transformers whose _flash_attention_forward lost a parameter we read is refused at install."""
    import transformers.integrations.flash_attention as fa

    def _flash_attention_forward(query_states, key_states, value_states, attention_mask, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setattr(fa, "_flash_attention_forward", _flash_attention_forward)
    with simulated_npu_host():
        model, _ = pair("flash_attention_2", torch.float32)
        with pytest.raises(varlen.VarlenIntegrationError, match=r"transformers \d"):
            varlen.install(model)


def test_offsets_follow_each_implementation_rule():
    """sdpa's packed mask starts a sequence where position ids do not step by 1 (find_packed_sequence_indices);
    flash attention only where they restart at 0 (prepare_fa_kwargs_from_position_ids)."""
    positions = torch.tensor([[0, 1, 2, 7, 8, 0, 1]])
    assert varlen_attention.host_seq_ends(positions, "restart").tolist() == [3, 5, 7]
    assert varlen_attention.host_seq_ends(positions, "zero").tolist() == [5, 7]
