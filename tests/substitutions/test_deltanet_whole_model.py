"""A whole Qwen3.5 compiled (``torch.compile(model, backend="qwen_npu")``, no ``maybe_compile``) on one row packed
only by restarting ``position_ids``: the Gated DeltaNet runs each sequence as if alone, as attention
does, from attention's packing proof (``patterns/gated_delta_rule_packed.py``); eager transformers 5.24 runs the
DeltaNet over the row as one sequence (shown to differ; one warning names it).

Negative cases: a plain batch, position ids that do not restart (one sequence by the data), a block-diagonal mask
passed in with packed position ids (no proof): compiled equals eager there. Tiny random Qwen3.5 (3 DeltaNet + 1
full-attention layer, sdpa) of transformers' own modeling code; exact counts under ``strict``.
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_5", reason="Qwen3.5 needs transformers >= 5")

from qwen_npu_compile.patterns import expected_fusions
from qwen_npu_compile.report import SUMMARY
from qwen_npu_compile.substitutions import deltanet
from tests.helpers.models import tiny_hybrid
from tests.helpers.numerics import max_abs_ratio, worst_relative_l2

LENGTHS = [37, 70, 20]  # the second sequence crosses a 64-token chunk
OP = torch.ops.qwen_npu.chunk_gated_delta_rule.default


def _row(lengths=LENGTHS):
    ids = torch.randint(0, 256, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    return ids, torch.cat([torch.arange(n) for n in lengths])[None]


def _model(dtype=torch.float32):
    model = tiny_hybrid("qwen3_5", dtype).train()
    with torch.no_grad():  # a conv that mixes neighbours visibly
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.conv1d.weight.normal_(0.0, 0.5)
    return model


def _step(run, ids, **kwargs):
    logits = run(input_ids=ids, **kwargs).logits
    (logits.float().logsumexp(-1) * torch.linspace(-1, 1, ids.shape[1])).sum().backward()
    return logits.detach()[0].float()


def _grads(model):
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _alone(model, ids, lengths=LENGTHS):
    """Each sequence run alone (eager): the logits of the row, the summed gradients."""
    weights = torch.linspace(-1, 1, ids.shape[1]).split(lengths)
    outs = []
    for piece, weight in zip(ids.split(lengths, dim=1), weights):
        logits = model(input_ids=piece).logits
        (logits.float().logsumexp(-1) * weight).sum().backward()
        outs.append(logits.detach()[0].float())
    return torch.cat(outs), _grads(model)


def _offsets_of_ops(graphs) -> list:
    return [node.args[5] is not None for gm in graphs for node in gm.graph.find_nodes(op="call_function", target=OP)]


def test_packed_row_each_sequence_as_alone_fp32(npu_ops, rewritten, caplog, monkeypatch):
    monkeypatch.setattr(deltanet, "_refused", set())  # the one warning per process, seen here
    ids, positions = _row()
    model = _model()
    truth, truth_grads = _alone(model, ids)
    merged = _step(model, ids, position_ids=positions)
    model.zero_grad(set_to_none=True)
    assert max_abs_ratio(merged[LENGTHS[0]:], truth[LENGTHS[0]:]) > 1e-2  # eager: the DeltaNet runs the row as one sequence

    compiled = torch.compile(model, backend="qwen_npu", options={"strict": True})
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        logits = _step(compiled, ids, position_ids=positions)
    grads = _grads(model)
    for got, want in zip(logits.split(LENGTHS), truth.split(LENGTHS)):
        assert max_abs_ratio(got, want) <= 1e-5
    assert worst_relative_l2(grads, truth_grads) <= 3e-5
    (report,) = SUMMARY.graphs
    assert report.fusions == expected_fusions(model.config)
    assert _offsets_of_ops(rewritten) == [True] * 3
    warnings = [r.getMessage() for r in caplog.records if "a row packed by position_ids" in r.getMessage()]
    assert len(warnings) == 1 and "transformers 5." in warnings[0] and "modeling_qwen3_5" in warnings[0]


def test_packed_row_bf16_as_close_to_the_truth_as_eager_alone(npu_ops):
    """bf16 compiled against the fp32 truth (each sequence alone) no farther than eager bf16 run alone (1.5x)."""
    ids, positions = _row()
    truth, truth_grads = _alone(_model(), ids)
    model = _model(torch.bfloat16)
    eager, eager_grads = _alone(model, ids)
    compiled = torch.compile(model, backend="qwen_npu", options={"strict": True})
    logits = _step(compiled, ids, position_ids=positions)
    grads = _grads(model)
    assert SUMMARY.graphs[0].fusions == expected_fusions(model.config)
    for got, base, want in zip(logits.split(LENGTHS), eager.split(LENGTHS), truth.split(LENGTHS)):
        assert max_abs_ratio(got, want) <= 1.5 * max_abs_ratio(base, want) + 1e-3
    assert worst_relative_l2(grads, truth_grads) <= 1.5 * worst_relative_l2(eager_grads, truth_grads) + 1e-3


def _block_diagonal_mask(lengths=LENGTHS):
    """The packed causal mask's values, passed in as a 4-D bool mask (a graph input: nothing proves it packed)."""
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    causal = torch.ones(sum(lengths), sum(lengths), dtype=torch.bool).tril()
    return ((segment[:, None] == segment[None, :]) & causal)[None, None]


@pytest.mark.parametrize("case", ["plain_batch", "positions_not_restarting", "mask_only_looks_packed"])
def test_not_packed_is_untouched(npu_ops, rewritten, case):
    """No packing proof (a batch of 2; a block-diagonal mask passed in with the packed position ids) or one
    sequence by the data (0..T-1): compiled equals eager, which runs the DeltaNet over each row as one sequence;
    the op gets offsets only where the proof holds."""
    model = _model().eval()
    ids, positions = _row()
    kwargs = {
        "plain_batch": dict(input_ids=torch.cat([ids, ids.flip(1)])),
        "positions_not_restarting": dict(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]),
        "mask_only_looks_packed": dict(input_ids=ids, position_ids=positions, attention_mask=_block_diagonal_mask()),
    }[case]
    with torch.no_grad():
        want = model(**kwargs).logits
        got = torch.compile(model, backend="qwen_npu", options={"strict": True})(**kwargs).logits
    assert max_abs_ratio(got, want) <= 1e-5
    total = Counter()  # transformers 5.10.4 breaks the graph ahead of a 4-D mask passed in
    for report in SUMMARY.graphs:
        total.update(report.fusions)
    assert {family: total[family] for family in expected_fusions(model.config)} == expected_fusions(model.config)
    assert _offsets_of_ops(rewritten) == [case == "positions_not_restarting"] * 3


def test_conditional_generation_packed_row_each_sequence_as_alone(npu_ops, rewritten):
    """``Qwen3_5ForConditionalGeneration`` (what real checkpoints are; text only here, the mrope stack of one row):
    compiled, each packed sequence's logits equal its run alone, exact counts (no-grad forward)."""
    import transformers

    from tests.helpers.models import TINY_HYBRID

    torch.manual_seed(0)
    config = transformers.Qwen3_5Config(
        text_config=dict(TINY_HYBRID, intermediate_size=256),
        vision_config=dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=64, out_hidden_size=128))
    model = transformers.Qwen3_5ForConditionalGeneration._from_config(config, attn_implementation="sdpa").eval()
    ids, positions = _row()
    with torch.no_grad():
        truth = torch.cat([model(input_ids=piece).logits for piece in ids.split(LENGTHS, dim=1)], dim=1)[0]
        logits = torch.compile(model, backend="qwen_npu", options={"strict": True})(
            input_ids=ids, position_ids=positions).logits[0]
    for got, want in zip(logits.split(LENGTHS), truth.split(LENGTHS)):
        assert max_abs_ratio(got, want) <= 1e-5
    assert SUMMARY.graphs[0].fusions == expected_fusions(config)
    assert _offsets_of_ops(rewritten) == [True] * 3
