"""Issue 12 (long sequences): an explicit attention mask that is provably the plain causal mask fuses with
``sparse_mode=2`` and the compressed 2048x2048 mask, so no ``[.., S, S]`` tensor is left in the forward;
data-dependent (padding, packed position ids), symbolic or non-causal masks keep the explicit mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.operator_schemas import normalize_function

from qwen_npu_compile.cli.check.models import tiny_qwen2
from qwen_npu_compile.patterns.attention import masks as attention_mask
from tests.helpers.models import token_ids
from tests.helpers.numerics import assert_parity

LAYERS = 2
BATCH, SEQ = 2, 24
#: head_dim 64 (realistic) with GQA (n_rep 2); SEQ differs from every other dim (32 rotary frequencies), so
#: an [.., SEQ, SEQ] tensor is a mask.
GQA64 = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
CAUSAL = (2, (2048, 2048))
EXPLICIT = (0, (BATCH, 1, SEQ, SEQ))
OPTIONS = {"downstream": "aot_eager"}


def _attention_calls(gm) -> list[tuple]:
    """``(sparse_mode, atten_mask shape)`` of every npu_fusion_attention call in ``gm``."""
    calls = []
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.npu.npu_fusion_attention.default):
        _, kwargs = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        mask = kwargs.get("atten_mask")
        calls.append((kwargs.get("sparse_mode", 0), tuple(mask.meta["val"].shape) if mask is not None else None))
    return calls


def _square_nodes(gm, seq=SEQ) -> list[str]:
    """Nodes of ``gm`` whose value is an ``[..., seq, seq]`` tensor (views included)."""
    def square(value):
        return isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[-2:]) == (seq, seq)

    return [node.name for node in gm.graph.nodes if square(node.meta.get("val"))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_training_without_mask_uses_sparse_mode_and_no_square_tensor(npu_ops, rewritten, attn, dtype):
    model = tiny_qwen2(dtype, attn=attn, **GQA64).train()
    reports = assert_parity(model, token_ids(batch=BATCH, seq=SEQ), True, dtype, options=OPTIONS)
    assert [r.fusions["attention"] for r in reports] == [LAYERS]
    assert [r for r in reports[0].refused if r.family == "attention"] == []
    assert reports[0].aot_ops["backward"].get("npu_fusion_attention_grad") == LAYERS
    (gm,) = rewritten
    assert _attention_calls(gm) == [CAUSAL] * LAYERS
    assert _square_nodes(gm) == []  # the mask-building subgraph is dead code, removed


@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 9),
                    reason="torch 2.7 inlines checkpointed regions (compiled unfused)")
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_checkpointed_layers_prove_the_mask_their_caller_builds(npu_ops, rewritten, attn):
    """With activation checkpointing the mask reaches each layer's region body as an input: the proof
    follows it to the mask the calling graph builds, so every layer takes sparse_mode 2 (the region call
    still passes the explicit mask, now unused by attention)."""
    from qwen_npu_compile.graph.utils import checkpoint_bodies

    model = tiny_qwen2(torch.float32, attn=attn, **GQA64).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reports = assert_parity(model, token_ids(batch=BATCH, seq=SEQ), True, torch.float32, options=OPTIONS)
    assert [r.fusions["attention"] for r in reports] == [LAYERS]
    (gm,) = rewritten
    bodies = checkpoint_bodies(gm)
    assert len(bodies) == LAYERS
    assert [call for body in bodies for call in _attention_calls(body)] == [CAUSAL] * LAYERS


def test_row_blocks_prove_a_large_mask(npu_ops, rewritten, monkeypatch):
    """With a tiny evaluation budget every [B, 1, S, S] tensor of the mask subgraph is computed per block
    of query rows (what S=32768 needs): still proven causal."""
    blocks = []
    original = attention_mask._RowBlocks.blocks

    def spy(self):
        for block in original(self):
            blocks.append(block)
            yield block

    monkeypatch.setattr(attention_mask, "EVAL_BLOCK_ELEMENTS", 3 * SEQ)
    monkeypatch.setattr(attention_mask._RowBlocks, "blocks", spy)
    model = tiny_qwen2(torch.float32, **GQA64).train()
    assert_parity(model, token_ids(batch=BATCH, seq=SEQ), True, torch.float32, options=OPTIONS)
    (gm,) = rewritten
    assert _attention_calls(gm) == [CAUSAL] * LAYERS
    assert blocks == [(row, row + 1) for row in range(SEQ)]  # a row of [2, 1, 24, 24] is 48 elements of 72


def test_padding_mask_keeps_the_explicit_mask(npu_ops, rewritten):
    model = tiny_qwen2(torch.float32, **GQA64).train()
    padding = torch.ones(BATCH, SEQ, dtype=torch.long)
    padding[0, :5] = 0
    assert_parity(model, token_ids(batch=BATCH, seq=SEQ), True, torch.float32, options=OPTIONS, attention_mask=padding)
    (gm,) = rewritten
    assert _attention_calls(gm) == [EXPLICIT] * LAYERS


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_position_ids_keep_the_block_diagonal_mask(npu_ops, rewritten, attn):
    """User-passed position ids (packed sequences 10 + 14, and 24) make the mask data-dependent."""
    model = tiny_qwen2(torch.float32, attn=attn, **GQA64).train()
    positions = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]), torch.arange(SEQ)])
    assert_parity(model, token_ids(batch=BATCH, seq=SEQ), True, torch.float32, options=OPTIONS, position_ids=positions)
    (gm,) = rewritten
    assert _attention_calls(gm) == [EXPLICIT] * LAYERS


def test_symbolic_length_keeps_the_explicit_mask(npu_ops, rewritten):
    model = tiny_qwen2(torch.float32, **GQA64).train()
    reports = assert_parity(model, token_ids(batch=BATCH, seq=SEQ), True, torch.float32, options=OPTIONS, dynamic=True)
    assert [r.fusions["attention"] for r in reports] == [LAYERS]
    calls = [call for gm in rewritten for call in _attention_calls(gm)]  # the backend may retrace once
    assert calls and {mode for mode, _ in calls} == {0} and all(len(shape) == 4 for _, shape in calls)


@pytest.mark.parametrize("blocked", [False, True], ids=["whole", "row_blocks"])
def test_constant_sliding_window_mask_is_not_causal(npu_ops, rewritten, monkeypatch, blocked):
    """A sliding-window mask is a graph constant too, but not the plain causal mask: evaluated, compared,
    kept (also when compared block by block)."""
    if blocked:
        monkeypatch.setattr(attention_mask, "EVAL_BLOCK_ELEMENTS", 4 * SEQ)
    model = tiny_qwen2(torch.float32, use_sliding_window=True, sliding_window=4, max_window_layers=0, **GQA64)
    assert {"sliding_attention"} == set(getattr(model.config, "layer_types", None) or ["sliding_attention"])
    assert_parity(model.train(), token_ids(batch=BATCH, seq=SEQ), True, torch.float32, options=OPTIONS)
    (gm,) = rewritten
    assert _attention_calls(gm) == [EXPLICIT] * LAYERS


# --- hand-written masks: what the proof accepts and refuses ---------------------------------------


def _qkv():
    torch.manual_seed(0)
    return [torch.randn(1, 2, SEQ, 64, requires_grad=True) for _ in range(3)]


def _compiled_calls(fn, rewritten):
    """Compile ``fn(q, k, v)``; check forward and gradients against eager; the fused calls."""
    eager_inputs, compiled_inputs = _qkv(), _qkv()
    torch.manual_seed(1)  # the random mask: the same draws in both runs
    expected = fn(*eager_inputs)
    expected.sum().backward()
    torch.manual_seed(1)
    out = torch.compile(fn, backend="qwen_npu", options=OPTIONS)(*compiled_inputs)
    out.sum().backward()
    torch.testing.assert_close(out, expected)
    for a, b in zip(compiled_inputs, eager_inputs):
        torch.testing.assert_close(a.grad, b.grad)
    (gm,) = rewritten
    return _attention_calls(gm)


def test_hand_written_tril_mask_is_causal(npu_ops, rewritten):
    def fn(q, k, v):
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    assert _compiled_calls(fn, rewritten) == [CAUSAL]


def test_mask_above_the_evaluation_cap_stays_explicit(npu_ops, rewritten, monkeypatch):
    monkeypatch.setattr(attention_mask, "EVAL_MAX_ELEMENTS", SEQ * SEQ - 1)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(SEQ, SEQ, dtype=torch.bool).tril())

    assert _compiled_calls(fn, rewritten) == [(0, (SEQ, SEQ))]


@pytest.mark.parametrize(
    "build",
    [
        lambda q: torch.ones(SEQ, SEQ, dtype=torch.bool).tril(1),  # one future key
        lambda q: torch.ones(SEQ, SEQ, dtype=torch.bool).tril() | torch.eye(SEQ, dtype=torch.bool).roll(1, 0),
        lambda q: (torch.rand(SEQ, SEQ) > 0.3) | torch.eye(SEQ, dtype=torch.bool),  # random: never evaluated
        lambda q: torch.ones(SEQ, SEQ, dtype=torch.bool).tril() | (q[0, 0, :, :1] > 10),  # reads q's data
    ],
    ids=["tril_1", "tril_or_wrapped_diagonal", "random", "data_dependent"],
)
def test_hand_written_non_causal_masks_stay_explicit(npu_ops, rewritten, build):
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=build(q))

    assert _compiled_calls(fn, rewritten) == [(0, (SEQ, SEQ))]


def test_mask_mutated_after_it_is_built_stays_explicit(npu_ops, rewritten):
    """An in-place write into the mask (outside its producing subgraph) is seen: not proven, kept."""

    def fn(q, k, v):
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        mask[0, 1] = True
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    assert _compiled_calls(fn, rewritten) == [(0, (SEQ, SEQ))]
