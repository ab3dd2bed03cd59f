"""Issue 18, whole-model compile: packed sequences (``position_ids`` restarting per sequence, no
``attention_mask``) make transformers build a ``[1, 1, T, T]`` block-diagonal causal mask in the graph;
proven from the position ids (``patterns/attention/varlen.py``), attention runs as
``qwen_npu.varlen_attention`` with one ``seq_ends_from_positions`` per graph and no T x T tensor.
Anything not proven (padding, a hand-written or edited mask, sliding window, batch > 1) keeps the
explicit mask, with the reason recorded by the proof."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from qwen_npu_compile import handoff
from qwen_npu_compile.cli.check.models import tiny_qwen2, tiny_qwen2_config
from qwen_npu_compile.handoff import fallback
from qwen_npu_compile.ops.limits import bound_arguments
from qwen_npu_compile.ops.qwen_npu import varlen_attention as varlen_ops
from qwen_npu_compile.patterns import expected_fusions
from qwen_npu_compile.patterns.attention import varlen as attention_varlen
from qwen_npu_compile.report import SUMMARY
from tests.helpers.models import packed_row
from tests.helpers.numerics import assert_parity

LAYERS = 2
#: hidden 128 / 4 heads = head_dim 32, GQA (2 KV heads); no dim is 33, so a [.., 33, 33] tensor is a mask.
CONFIG = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
LENGTHS = (10, 7, 13, 3)
T = sum(LENGTHS)
OPTIONS = {"downstream": "aot_eager"}
WHOLE_MODEL = expected_fusions(tiny_qwen2_config(**CONFIG))


@pytest.fixture
def aot_ops(monkeypatch):
    """Per AOT graph kind (``forward`` / ``backward``), the qwen_npu / npu op counts of every graph handed off."""
    seen = []
    original = fallback.npu_op_counts

    def spy(graph, namespace="npu"):
        if namespace != "npu":  # the hand-off counts each graph's npu ops, then its qwen_npu ops: count once
            return original(graph, namespace)
        counts = {}
        for node in graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                if node.target.namespace in ("npu", "qwen_npu"):
                    name = node.target._schema.name.split("::")[-1]
                    counts[name] = counts.get(name, 0) + 1
        seen.append(counts)
        return original(graph)

    monkeypatch.setattr(fallback, "npu_op_counts", spy)
    return seen


def _square(shape, tokens=T) -> bool:
    return len(shape) >= 2 and tuple(shape[-2:]) == (tokens, tokens)


class _SquareTensors(TorchDispatchMode):
    """Records every op whose inputs or outputs hold a ``[..., T, T]`` tensor."""

    def __init__(self, tokens):
        super().__init__()
        self.tokens, self.hits, self.calls = tokens, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls += 1
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if any(_square(t.shape, self.tokens) for t in tensors):
            self.hits.append(str(func))
        return out


@pytest.fixture
def dispatch_mode(monkeypatch):
    """While ``.active``, the AOT forward and backward graphs handed off run under one :class:`_SquareTensors`
    mode (Dynamo runs no compiled frame while a dispatch mode is active, so it goes inside the graphs)."""
    state = types.SimpleNamespace(active=False, mode=_SquareTensors(T))
    original = handoff.recording_compiler

    def recording_compiler(kind, report, config):
        compiler = original(kind, report, config)

        def wrapped(gm, example_inputs):
            fn = compiler(gm, example_inputs)

            def run(args):
                if not state.active:
                    return fn(args)
                with state.mode:
                    return fn(args)

            run._boxed_call = True
            return run

        return wrapped

    monkeypatch.setattr(handoff, "recording_compiler", recording_compiler)
    return state


def _profiled_step(runner, ids, positions, mode=None):
    """One training step of ``runner`` under the profiler (every ATen call, nested kernel calls too, with
    its input shapes) and ``mode`` (the dispatch mode: inputs and outputs); the ops that touched T x T."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        with mode if mode is not None else contextlib.nullcontext():
            out = runner(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
            out.loss.backward()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    assert len(events) > 100  # the profiler saw the step
    return [e.name for e in events if any(_square(s, ids.shape[1]) for s in (e.input_shapes or []) if s)]


def _rewritten_calls(gm):
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    return {
        "varlen": targets.count(varlen_ops.OP),
        "seq_ends": targets.count(varlen_ops.SEQ_ENDS_OP),
        "explicit": targets.count(torch.ops.npu.npu_fusion_attention.default),
    }


VARIANT = {
    ("sdpa", torch.float32): "varlen_sdpa_mask_repeat_kv",
    ("sdpa", torch.bfloat16): "varlen_sdpa_mask_repeat_kv",
    ("eager", torch.float32): "varlen_eager_repeat_kv_fp32_train",
    ("eager", torch.bfloat16): "varlen_eager_repeat_kv_bf16_train",
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_training_step_runs_varlen_attention(npu_ops, rewritten, aot_ops, dispatch_mode, attn, dtype):
    model = tiny_qwen2(dtype, attn=attn, **CONFIG).train()
    ids, positions = packed_row(LENGTHS)
    reports = assert_parity(model, ids, True, dtype, options=OPTIONS, position_ids=positions)
    (report,) = reports
    counts = {"rms_norm": 5, "swiglu": 2, "rotary": 4, "attention": 2}
    assert {family: WHOLE_MODEL[family] for family in counts} == counts
    assert report.fusions == {family: counts.get(family, 0) for family in report.fusions}
    assert report.variants[VARIANT[attn, dtype]] == LAYERS
    assert sum(v for name, v in report.variants.items() if name.startswith("varlen_")) == LAYERS
    assert report.refused == []
    (gm,) = rewritten
    assert _rewritten_calls(gm) == {"varlen": LAYERS, "seq_ends": 1, "explicit": 0}
    assert not any(_square(n.meta["val"].shape) for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor))
    forward, backward = aot_ops
    assert forward.get("varlen_attention") == LAYERS and forward.get("seq_ends_from_positions") == 1
    assert backward.get("varlen_attention_backward") == LAYERS
    assert "npu_fusion_attention" not in forward and "npu_fusion_attention_grad" not in backward
    if dtype == torch.bfloat16:  # a compiled step, profiled: no T x T tensor anywhere
        compiled = torch.compile(model, backend="qwen_npu", options=OPTIONS)
        compiled(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss.backward()
        dispatch_mode.active = True
        assert _profiled_step(compiled, ids, positions) == []  # the dispatch mode runs inside the graphs
        assert dispatch_mode.mode.calls > 100 and dispatch_mode.mode.hits == []  # the mode saw the graphs run


def test_eager_reference_step_touches_t_by_t_tensors(npu_ops):
    """The profiled step's detector is live: the uncompiled model builds and reads the T x T mask."""
    model = tiny_qwen2(torch.bfloat16, **CONFIG).train()
    ids, positions = packed_row(LENGTHS)
    mode = _SquareTensors(T)
    assert len(_profiled_step(model, ids, positions)) > 0
    assert len(_profiled_step(model, ids, positions, mode)) > 0 and len(mode.hits) > 0


def test_twenty_packings_compile_at_most_two_graphs(npu_ops):
    """dynamic=True: T and the number of sequences change every micro-batch (verl's dynamic batch size);
    the offsets are data, so the graph is reused; each step matches eager."""
    model = tiny_qwen2(torch.float32, **CONFIG).train()
    compiled = torch.compile(model, backend="qwen_npu", options=OPTIONS, dynamic=True)
    generator = torch.Generator().manual_seed(3)
    for step in range(20):
        count = int(torch.randint(1, 6, (1,), generator=generator))
        lengths = [int(n) for n in torch.randint(2, 12, (count,), generator=generator)]
        ids, positions = packed_row(lengths, seed=step)
        out = compiled(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
        out.loss.backward()
        if step in (0, 19):
            expected = model(input_ids=ids, position_ids=positions, use_cache=False).logits
            torch.testing.assert_close(out.logits, expected, rtol=1e-4, atol=1e-4)
        model.zero_grad(set_to_none=True)
    graphs = list(SUMMARY.graphs)
    assert 1 <= len(graphs) <= 2, [g.name for g in graphs]
    assert all(sum(v for n, v in g.variants.items() if n.startswith("varlen_")) == LAYERS for g in graphs)
    assert {"varlen_sdpa_mask_repeat_kv_symbolic"} >= {n for g in graphs for n in g.variants if n.startswith("varlen")}


# --- what keeps the explicit mask, and why ----------------------------------------------------------


def _mask_reasons(gm) -> list[str | None]:
    """The proof's answer for the mask of every explicit-mask attention of ``gm`` (cached per graph)."""
    reasons = []
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.npu.npu_fusion_attention.default):
        converted = bound_arguments(node)["atten_mask"]  # logical_not(mask) / mask != 0
        reasons.append(attention_varlen.packed_mask_reason(converted.args[0]))
    return reasons


def _explicit(model, ids, rewritten, **kwargs):
    """Compile an inference forward; the one rewritten graph must fuse attention with explicit masks."""
    assert_parity(model.eval(), ids, False, torch.float32, options=OPTIONS, **kwargs)
    (gm,) = rewritten
    calls = _rewritten_calls(gm)
    assert calls["varlen"] == 0 and calls["seq_ends"] == 0 and calls["explicit"] == LAYERS
    return _mask_reasons(gm)


def test_left_padding_keeps_the_explicit_mask(npu_ops, rewritten):
    model = tiny_qwen2(torch.float32, **CONFIG)
    ids = torch.randint(0, 128, (2, 12))
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :4] = 0
    positions = (padding.cumsum(-1) - 1).clamp(min=0)
    reasons = _explicit(model, ids, rewritten, attention_mask=padding, position_ids=positions)
    assert len(set(reasons)) == 1 and "graph input that is not a [B, T] integer tensor" not in reasons[0]
    assert "not part of the packed causal mask" in reasons[0] or "batch" in reasons[0], reasons


def test_position_ids_batch_two_keep_the_explicit_mask(npu_ops, rewritten):
    model = tiny_qwen2(torch.float32, **CONFIG)
    _, positions = packed_row((5, 7))
    positions = positions.expand(2, -1).contiguous()
    reasons = _explicit(model, torch.randint(0, 128, (2, 12)), rewritten, position_ids=positions)
    assert all("has batch 2: varlen attention takes one packed row" in r for r in reasons), reasons


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_sliding_window_keeps_the_explicit_mask(npu_ops, rewritten, family):
    ids, positions = packed_row((5, 7))
    if family == "qwen2":
        model = tiny_qwen2(torch.float32, use_sliding_window=True, sliding_window=4, max_window_layers=0, **CONFIG)
    else:
        from transformers import MistralConfig, MistralForCausalLM

        torch.manual_seed(0)
        config = MistralConfig(**{**tiny_qwen2_config(**CONFIG).to_dict(), "sliding_window": 4, "model_type": "mistral"})
        model = MistralForCausalLM._from_config(config, attn_implementation="sdpa")
    reasons = _explicit(model, ids, rewritten, position_ids=positions)
    assert all("not part of the packed causal mask" in r for r in reasons), reasons


# --- hand-written masks: the proof is exact ------------------------------------------------------------


def _transformers_packed_mask(positions):
    """transformers 5.24's packed causal mask, written out (find_packed_sequence_indices + sdpa_mask)."""
    segments = (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    tokens = positions.shape[1]
    b = torch.arange(1)[:, None, None, None]
    q, kv = torch.arange(tokens)[None, None, :, None], torch.arange(tokens)[None, None, None, :]
    mask = positions[b, kv] <= positions[b, q]
    return (mask & (segments[b, q] == segments[b, kv])).expand(1, -1, tokens, tokens)


def _zero_rule_mask(positions):
    """A hand-written block mask: sequences start where position == 0 (FA2's rule, not the packed mask's)."""
    segments = (positions == 0).cumsum(-1)
    return (segments[:, None, :, None] == segments[:, None, None, :]) & torch.ones(
        positions.shape[1], positions.shape[1], dtype=torch.bool
    ).tril()


def _edited_in_place(positions):
    mask = _transformers_packed_mask(positions).clone()
    mask[..., 12, 0] = True  # query 12 (sequence 2) also sees key 0
    return mask


def _edited(positions):
    return _transformers_packed_mask(positions) | torch.eye(positions.shape[1], dtype=torch.bool).roll(-1, 1)


def _qkv(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, T, 32, generator=generator, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize(
    "build, varlen, reason",
    [
        (_transformers_packed_mask, True, None),
        (_zero_rule_mask, False, "a cumsum that is not `(diff(position_ids) != 1).cumsum(-1)`"),
        (_edited_in_place, False, "written in place"),
        (_edited, False, "not part of the packed causal mask"),
    ],
    ids=["transformers_construction", "zero_rule", "edited_in_place", "edited"],
)
def test_hand_written_masks(npu_ops, rewritten, build, varlen, reason):
    _, positions = packed_row(LENGTHS)

    def fn(q, k, v, positions):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=build(positions), scale=0.2)

    eager_inputs, compiled_inputs = _qkv(1), _qkv(1)
    expected = fn(*eager_inputs, positions)
    expected.sum().backward()
    out = torch.compile(fn, backend="qwen_npu", options=OPTIONS)(*compiled_inputs, positions)
    out.sum().backward()
    torch.testing.assert_close(out, expected)
    for a, b in zip(compiled_inputs, eager_inputs):
        torch.testing.assert_close(a.grad, b.grad)
    (gm,) = rewritten
    calls = _rewritten_calls(gm)
    assert (calls["varlen"], calls["explicit"]) == ((1, 0) if varlen else (0, 1))
    if reason is not None:
        (found,) = _mask_reasons(gm)
        assert reason in found, found


# --- every varlen variant fuses its setting --------------------------------------------------------------

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("row", attention_varlen.VARLEN_ROWS, ids=attention_varlen.variant_name)
def test_every_varlen_variant_fuses_its_setting(npu_ops, row):
    """Each ``varlen_<row>`` variant, on transformers' own attention function in its row's setting (dtype,
    MHA or GQA, eager training or inference, symbolic length), with the packed mask built as transformers
    5.24 builds it: fused by that variant, with the eager function's result."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    n_rep = 1 if row.kv == "mha" else 2
    module = types.SimpleNamespace(num_key_value_groups=n_rep, training=row.dropout, is_causal=True)
    _, positions = packed_row((5, 7))
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 12, 16, generator=generator).to(row.dtype)
    k, v = (torch.randn(1, 4 // n_rep, 12, 16, generator=generator).to(row.dtype) for _ in range(2))

    def fn(q, k, v, positions):
        mask = _transformers_packed_mask(positions)
        if row.impl == "sdpa":
            return sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.25)[0]
        additive = torch.where(mask, torch.zeros((), dtype=q.dtype), torch.finfo(q.dtype).min)
        return eager_attention_forward(module, q, k, v, additive, scaling=0.25, dropout=0.0)[0]

    if row.kv == "repeat_kv_symbolic":
        for t, dim in ((q, 2), (k, 2), (v, 2), (positions, 1)):
            torch._dynamo.mark_dynamic(t, dim)
    out = torch.compile(fn, backend="qwen_npu", options=OPTIONS, fullgraph=True)(q, k, v, positions)
    (report,) = SUMMARY.graphs
    assert report.variants == {attention_varlen.variant_name(row): 1}, report.variants
    expected = fn(q, k, v, positions)
    error = (out.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert error.item() <= TOLERANCE[row.dtype], error
