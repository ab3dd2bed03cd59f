"""The Gated DeltaNet on packed rows: one semantics, each sequence as if alone, on every path
(:mod:`qwen_npu_compile.substitutions.deltanet`), and never a crash.

- transformers >= 5.15 (5.24's hub wrapper): a DeltaNet given ``cu_seq_lens_q`` raises ``ValueError`` in eager
  without FLA; compiled runs each sequence alone (conv and state restarting), with one warning naming that.
- A whole Qwen3.5 under ``maybe_compile`` on a row packed only by ``position_ids`` (sdpa): eager runs the
  DeltaNet over the row as one sequence; compiled gives every sequence its own logits and gradients.
- verl 0.9.1 (transformers 5.10.4; skipped without verl): the unbacked marking only where the takeover reads
  the offsets; Ulysses sp > 1 declined to verl's own code outside the graph, no crash; transformers' own forward
  with an FLA-like ``@torch.compiler.disable`` kernel bound keeps the op (<= 2 graphs over 10 packings).

Tiny random configs of transformers' real modeling code, fp32 (per sequence within 1e-5 relative) and bf16.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
import transformers

pytest.importorskip("transformers.models.qwen3_5", reason="Qwen3.5 needs transformers >= 5")
from transformers.models.qwen3_5 import modeling_qwen3_5 as M

from qwen_npu_compile.report import SUMMARY
from qwen_npu_compile.substitutions import deltanet
from qwen_npu_compile.substitutions import varlen_attention as varlen
from qwen_npu_compile.worker import ENV_COMPILE
from tests.helpers.fla import fla_like_chunk_gated_delta_rule
from tests.helpers.models import tiny_hybrid
from tests.helpers.numerics import max_abs_ratio, relative_l2, worst_relative_l2

LENGTHS = [37, 70, 20]  # crosses a 64-token chunk inside the second sequence
OP = torch.ops.qwen_npu.chunk_gated_delta_rule.default
#: transformers >= 5.15: the hub wrapper (a plain function with ``__wrapped__``, or its kernels ``Func`` module)
HUB_WRAPPER = deltanet.resolve_binding(M.torch_chunk_gated_delta_rule)[1] != "plain function"


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _deltanet(dtype=torch.float32):
    model = tiny_hybrid("qwen3_5", dtype, num_hidden_layers=1, layer_types=["linear_attention"])
    module = model.model.layers[0].linear_attn
    with torch.no_grad():
        module.conv1d.weight.normal_(0.0, 0.5)  # a conv that mixes neighbours visibly
    return module


def _alone(module, hidden, lengths):
    """Each sequence through the module alone (eager): outputs per sequence and the summed parameter gradients."""
    outs = []
    weights = _weights(hidden[..., :module.hidden_size]).split(lengths, dim=1)
    for piece, weight in zip(hidden.split(lengths, dim=1), weights):
        out = module(piece)
        (out.float() * weight).sum().backward()
        outs.append(out.detach())
    return outs, _grads(module)


def _weights(out):
    """Loss weights ``[1, T, H]`` over the packed row (split per sequence for the runs alone)."""
    return torch.linspace(-1, 1, out.numel()).view(out.shape)


def _grads(module):
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return grads


@pytest.mark.skipif(not HUB_WRAPPER, reason="transformers' DeltaNet calls the hub wrapper from 5.15 on")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hub_wrapper_with_cu_seq_lens_runs_each_sequence_alone(npu_ops, caplog, monkeypatch, dtype):
    """5.24: eager raises ValueError for ``cu_seq_lens_q`` (no FLA); compiled, the delta rule is the op with the
    offsets and the conv restarts per sequence: each sequence's output and the gradients equal its run alone;
    one warning says how eager differs."""
    monkeypatch.setattr(deltanet, "_refused", set())  # the warning is once per process
    module = _deltanet(dtype)
    hidden = torch.randn(1, sum(LENGTHS), module.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    with pytest.raises(ValueError, match="can't keep packed sequences apart"):
        module(hidden, cu_seq_lens_q=_cu(LENGTHS))
    reference = _deltanet(torch.float32)
    want, want_grads = _alone(reference, hidden.float(), LENGTHS)
    compiled = torch.compile(module, backend="qwen_npu")
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        out = compiled(hidden, cu_seq_lens_q=_cu(LENGTHS))
    (out.float() * _weights(out)).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 5e-2  # bf16 weights and activations against the fp32 truth
    for got, expected in zip(out.split(LENGTHS, dim=1), want):
        assert max_abs_ratio(got, expected) <= tol
    grads = _grads(module)
    for name, expected in want_grads.items():
        assert relative_l2(grads[name], expected) <= (3e-5 if tol == 1e-5 else 5e-2)
    [report] = [r for r in SUMMARY.graphs]
    assert report.fusions["gated_delta_rule"] == 1
    assert sum("eager raises ValueError" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.skipif(not HUB_WRAPPER, reason="transformers' DeltaNet forwards the pre-hook's offsets from 5.15 on")
def test_maybe_compile_packed_row_runs_each_sequence_alone(monkeypatch, npu_ops):
    """A whole Qwen3.5 (3 DeltaNet + 1 full-attention layer, sdpa) on rows packed by ``position_ids`` only, under
    maybe_compile: the pre-hook's sequence ends (the packing rule attention uses) reach the DeltaNet; each
    sequence's logits and the gradients equal its run alone (eager merges the sequences: shown to differ)."""
    from qwen_npu_compile import maybe_compile

    monkeypatch.setenv(ENV_COMPILE, "1")
    ids = torch.randint(0, 256, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]

    def loss(model, ids, positions):
        logits = model(input_ids=ids, position_ids=positions).logits
        (logits.float().logsumexp(-1).sum()).backward()
        return logits.detach()[0]

    eager = tiny_hybrid("qwen3_5", torch.float32).train()
    alone = [loss(eager, piece, torch.arange(piece.shape[1])[None]) for piece in ids.split(LENGTHS, dim=1)]
    alone_grads = _grads(eager)
    merged = loss(eager, ids, positions)
    assert max(max_abs_ratio(g, w) for g, w in zip(merged.split(LENGTHS), alone)) > 1e-2  # eager: one sequence
    eager.zero_grad(set_to_none=True)

    model = tiny_hybrid("qwen3_5", torch.float32).train()
    maybe_compile(model)
    logits = loss(model, ids, positions)
    for got, want in zip(logits.split(LENGTHS), alone):
        assert max_abs_ratio(got, want) <= 1e-5
    grads = _grads(model)
    worst = worst_relative_l2(grads, alone_grads)
    assert worst <= 3e-5
    kinds = [report.fusions.get("gated_delta_rule") for report in SUMMARY.graphs]
    assert kinds == [1, 0]  # one graph per layer kind: the DeltaNet layer's op, then the full-attention layer


# -- verl 0.9.1 (transformers 5.10.4) --------------------------------------------------------------------------


@pytest.fixture
def verl_deltanet(monkeypatch):
    """verl 0.9.1's packed forward installed on the DeltaNet class, as its ``apply_monkey_patch`` does."""
    verl_qwen3_5 = pytest.importorskip("verl.models.transformers.qwen3_5", reason="verl 0.9.1")
    monkeypatch.setattr(M.Qwen3_5GatedDeltaNet, "forward", verl_qwen3_5.qwen3_5_gated_delta_net_forward)
    return verl_qwen3_5


def _unbacked(tensor) -> bool:
    return bool(getattr(tensor, "_dynamo_unbacked_indices", None) or getattr(tensor, "_dynamo_dynamic_indices", None))


def test_offsets_marked_unbacked_only_where_the_takeover_reads_them(verl_deltanet, npu_ops):
    """``packed_layer_call`` marks verl's ``cu_seqlens`` unbacked for a layer whose DeltaNet forward is taken over,
    never for one still running verl's forward (its ``.tolist()`` raised ``GuardOnDataDependentSymNode``)."""
    layer = tiny_hybrid("qwen3_5", num_hidden_layers=1, layer_types=["linear_attention"]).model.layers[0]
    kwargs = {varlen.SEQ_ENDS_KWARG: _cu(LENGTHS)[1:].long()}
    hidden = torch.randn(1, sum(LENGTHS), 128)

    cu = _cu(LENGTHS)
    with varlen.packed_layer_call((hidden,), {**kwargs, "cu_seqlens": cu}, layer):
        pass
    assert not deltanet.offsets_traceable(layer) and not _unbacked(cu)

    deltanet.install()
    assert M.Qwen3_5GatedDeltaNet.forward._qwen_npu_original is verl_deltanet.qwen3_5_gated_delta_net_forward
    cu = _cu(LENGTHS)
    with varlen.packed_layer_call((hidden,), {**kwargs, "cu_seqlens": cu}, layer):
        pass
    assert deltanet.offsets_traceable(layer) and _unbacked(cu)


def test_ulysses_sp2_is_declined_to_verls_code_outside_the_graph(verl_deltanet, monkeypatch, npu_ops):
    """Ulysses sp > 1: the takeover declines (verl needs FLA's cp_context there) and runs verl's forward outside
    the graph: offsets marked unbacked reach no ``.tolist()``, no op in the graph, verl's eager result."""
    import verl.utils.ulysses as ulysses

    deltanet.install()
    module = _deltanet()
    hidden = torch.randn(1, sum(LENGTHS), module.hidden_size)
    want = module(hidden, cu_seqlens=_cu(LENGTHS), cu_seqlens_cpu=_cu(LENGTHS))
    monkeypatch.setattr(ulysses, "get_ulysses_sequence_parallel_world_size", lambda *args: 2)
    assert "Ulysses sp 2" in deltanet.packed_call_refusal(module, hidden, None, _cu(LENGTHS))
    cu, cu_cpu = _cu(LENGTHS), _cu(LENGTHS)
    torch._dynamo.decorators.mark_unbacked(cu, 0)
    torch._dynamo.decorators.mark_unbacked(cu_cpu, 0)
    got = torch.compile(lambda h, c, cc: module(h, cu_seqlens=c, cu_seqlens_cpu=cc) * 2, backend="qwen_npu")(
        hidden, cu, cu_cpu)
    torch.testing.assert_close(got, want * 2, rtol=0, atol=0)
    assert all(report.fusions["gated_delta_rule"] == 0 for report in SUMMARY.graphs)


@pytest.mark.skipif(HUB_WRAPPER, reason="transformers 5.10.4 / 4.57.6 bind FLA's function module-level")
def test_transformers_fla_bound_keeps_the_op(monkeypatch, npu_ops):
    """transformers 5.10.4's own DeltaNet forward with FLA's ``@torch.compiler.disable`` kernel bound (an FLA-like
    stand-in of 0.5.2's signature, set where transformers imports FLA): the op in the graph with the offsets,
    the stand-in never called while compiled, <= 2 graphs over 10 packings, eager's results (eager is FLA)."""
    calls = []
    chunk_gated_delta_rule = fla_like_chunk_gated_delta_rule(calls)
    monkeypatch.setattr(M, "chunk_gated_delta_rule", chunk_gated_delta_rule)
    assert any("(FLA) -> qwen_npu::chunk_gated_delta_rule" in line for line in deltanet.install())
    module = _deltanet()
    assert module.chunk_gated_delta_rule is chunk_gated_delta_rule
    compiled = torch.compile(module, backend="qwen_npu")
    generator = torch.Generator().manual_seed(3)
    for _ in range(10):
        lengths = torch.randint(1, 90, (int(torch.randint(1, 5, (1,), generator=generator)),), generator=generator)
        lengths = lengths.tolist()
        hidden = torch.randn(1, sum(lengths), module.hidden_size, generator=generator)
        want = module(hidden, cu_seq_lens_q=_cu(lengths))
        calls.clear()
        cu = _cu(lengths)
        torch._dynamo.maybe_mark_dynamic(hidden, 1)  # as maybe_compile marks a packed row's tokens
        torch._dynamo.maybe_mark_dynamic(cu, 0)
        got = compiled(hidden, cu_seq_lens_q=cu)
        assert calls == []
        assert max_abs_ratio(got, want) <= 1e-5
    assert len(SUMMARY.graphs) <= 2
    assert all(report.fusions["gated_delta_rule"] == 1 for report in SUMMARY.graphs)
