"""The stack-compatibility suite: every family fused, with parity, on whichever torch x transformers runs it.

CI runs this file alone in one virtual environment per supported stack (``tools/stack_matrix.py``:
``pytest -m stack_compat``; torch 2.7.1 to 2.15.0 x transformers 4.57.6 / 5.10.4 / 5.24.0 / 5.25.0), and it is
part of the primary suite. It uses only what every supported stack has: transformers' real Qwen2
modeling code on a tiny random config (``qwen_npu_compile.cli.check.models.tiny_qwen2``: hidden 64, 2 layers,
4 heads, 2 KV heads = GQA), compiled

* whole-model (``torch.compile(model, backend="qwen_npu")``; on transformers 4.53-4.57 the graph
  holds the ``torch.vmap``-built masks, which must be fused, not fallen back), and
* per decoder layer (``qwen_npu_compile.maybe_compile``, verl's path; the masks are built eagerly
  outside the layers),

with sdpa and eager attention, bf16 training and fp32 inference, with and without left padding.

The cases marked ``stack_compat_full`` as well run on the primary and the newest stack only; the older
stacks run the rest (``-m "stack_compat and not stack_compat_full"``, tools/stack_matrix.py). Each of them
compiles a graph that a core case on the same stack already compiles (the fp32 static training runs repeat
the bf16 padded training graphs at a tighter bound; per-layer padded inference repeats per-layer padded
training's graph without its backward) or tests this project's own fallback logic with the retrace
monkeypatched away, so no version-dependent path (mask construction, packed/varlen, MoE, Dynamo/AOT
behaviour, torchair conversion) goes untested on any stack.
Each case asserts exact fusion counts, no fallback, no refusal, and parity with eager as ``check``
judges it (``qwen_npu_compile.cli.check.parity``): fp32 relative L2 error <= 1e-5 on logits and <= 1e-4 on
all gradients together; bf16 against an fp32 run of the same weights (relative L2 to it <= 2 x eager's
+ 1e-3), logits of real tokens only with left padding. The fusion totals go
to the junit report (``record_property("fusions", ...)``), from which docs/supported-stacks.md's support table is
generated. Nothing global is written: the compile switch is passed to ``maybe_compile`` as
``environ``, no dump folder, and tests/conftest.py resets Dynamo and the report summary around every test.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from qwen_npu_compile import ALL_FAMILIES, compat, maybe_compile
from qwen_npu_compile.cli.check.harness import run_model
from qwen_npu_compile.cli.check.models import tiny_qwen2, tiny_qwen2_config
from qwen_npu_compile.cli.check.parity import relative_l2
from qwen_npu_compile.graph import canonicalize
from qwen_npu_compile.patterns import expected_fusions
from qwen_npu_compile.report import SUMMARY
from qwen_npu_compile.worker import ENV_COMPILE, layer_reports
from tests.helpers.numerics import assert_runs_match, eager_and_reference

pytestmark = pytest.mark.stack_compat
#: on the primary and newest stacks only (module docstring)
FULL_ONLY = pytest.mark.stack_compat_full

FAMILIES = ALL_FAMILIES
LAYERS = 2
SEQ, PAD = 16, 5  # PAD leading zeros in the attention mask of the second sequence
#: One whole-model graph: RMSNorm 2 per layer + the final norm, SwiGLU 1, rotary 2 (q, k), attention 1 per layer.
WHOLE_MODEL = expected_fusions(tiny_qwen2_config(num_hidden_layers=LAYERS))
#: One decoder layer's graph (maybe_compile: the final norm is outside the layers and stays eager).
PER_LAYER = expected_fusions(tiny_qwen2_config(), per_layer=True)
#: Per-layer eager attention receives the additive float mask as a graph input: its values cannot be
#: proven to be 0 / finfo.min inside the layer's graph, so patterns/attention.py refuses it (exactly).
PER_LAYER_EAGER_REFUSAL = "additive float mask comes from a graph input"
MODES = {"train_bf16": (True, torch.bfloat16), "infer_fp32": (False, torch.float32)}
#: per-layer cases whose graph a core case compiles already (padded inference: padded training's forward)
PER_LAYER_FULL_ONLY = {("sdpa", "infer_fp32", True), ("eager", "infer_fp32", True)}


def _per_layer_params():
    return [pytest.param(attn, mode, padded, id=f"{attn}-{mode}-{'left_padding' if padded else 'no_padding'}",
                         marks=[FULL_ONLY] if (attn, mode, padded) in PER_LAYER_FULL_ONLY else [])
            for attn in ("sdpa", "eager") for mode in MODES for padded in (False, True)]


def _tokens(seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(seed))


def _left_padding(seq: int = SEQ, pad: int = PAD) -> torch.Tensor:
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, :pad] = 0
    return mask


def _assert_clean(report) -> None:
    assert report.fallback is None, report.fallback
    assert [r for r in report.refused if r.family in FAMILIES] == [], report.refused


def _eager_case(attn: str, mode: str, padded: bool):
    """The tiny Qwen2 of one case, its tokens and padding mask, and its eager (and fp32 reference) run."""
    train, dtype = MODES[mode]
    model = tiny_qwen2(dtype, attn=attn).train(train)
    input_ids, mask = _tokens(), _left_padding() if padded else None
    expected, reference = eager_and_reference(model, input_ids, train, dtype, attention_mask=mask)
    return model, input_ids, mask, train, expected, reference


@pytest.mark.parametrize("padded", [False, True], ids=["no_padding", "left_padding"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_whole_model(attn, mode, padded, record_property):
    model, input_ids, mask, train, expected, reference = _eager_case(attn, mode, padded)
    actual = run_model(model, torch.compile(model, backend="qwen_npu"), input_ids, train, mask)

    reports = list(SUMMARY.graphs)
    totals = {f: sum(r.fusions.get(f, 0) for r in reports) for f in FAMILIES}
    record_property("fusions", json.dumps(totals))
    assert len(reports) == 1, [r.name for r in reports]
    _assert_clean(reports[0])
    assert totals == WHOLE_MODEL
    assert_runs_match(actual, expected, reference)


@pytest.mark.parametrize(("attn", "mode", "padded"), _per_layer_params())
def test_per_layer(attn, mode, padded, record_property):
    model, input_ids, mask, train, expected, reference = _eager_case(attn, mode, padded)
    compiled = maybe_compile(model, environ={ENV_COMPILE: "1"})
    assert compiled == [f"model.layers.{i}" for i in range(LAYERS)]
    actual = run_model(model, model, input_ids, train, mask)

    records = layer_reports(model)
    assert sorted(records) == list(compiled)
    totals = dict.fromkeys(FAMILIES, 0)
    want = dict(PER_LAYER, attention=0) if attn == "eager" else PER_LAYER
    for name, record in records.items():
        assert record.calls == {"compiled": 1, "checkpointed": 0, "eager": 0}, (name, record.calls)
        assert len(record.reports) == 1, (name, [r.name for r in record.reports])
        report = record.reports[0]
        assert report.fallback is None, report.fallback
        assert {f: report.fusions.get(f, 0) for f in FAMILIES} == want, (name, report.fusions, report.refused)
        refused = [r for r in report.refused if r.family in FAMILIES]
        if attn == "eager":
            assert [r.family for r in refused] == ["attention"], refused
            assert refused[0].reason.startswith(PER_LAYER_EAGER_REFUSAL), refused[0].reason
        else:
            assert refused == [], refused
        for family in FAMILIES:
            totals[family] += report.fusions.get(family, 0)
    record_property("fusions", json.dumps(totals))
    assert_runs_match(actual, expected, reference)


@pytest.mark.parametrize(("attn", "dynamic"), [pytest.param("sdpa", False, id="sdpa", marks=FULL_ONLY),
                                              pytest.param("eager", False, id="eager", marks=FULL_ONLY),
                                              pytest.param("sdpa", True, id="sdpa_dynamic")])
def test_whole_model_fp32_training_with_left_padding(attn, dynamic):
    """fp32 gradients through the masks (on 4.5x: the desugared vmap regions) meet the fp32 bound.

    ``dynamic=True`` also makes float attributes graph inputs (the rotary ``attention_scaling``),
    which AOTAutograd tensorifies (torch 2.9.0's default partitioner crashed on them; see
    ``compat.default_partition``)."""
    model = tiny_qwen2(torch.float32, attn=attn).train()
    input_ids, mask = _tokens(), _left_padding()
    expected = run_model(model, model, input_ids, True, mask)
    actual = run_model(model, torch.compile(model, backend="qwen_npu", dynamic=dynamic or None), input_ids, True, mask)
    (report,) = SUMMARY.graphs
    _assert_clean(report)
    assert report.fusions == WHOLE_MODEL
    assert_runs_match(actual, expected)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_whole_model_new_lengths_and_paddings(attn):
    """A new length recompiles once with a symbolic sequence length (Dynamo's automatic dynamic
    shapes); that graph fuses everything too and stays exact for every later length and padding."""
    model = tiny_qwen2(torch.float32, attn=attn).eval()
    compiled = torch.compile(model, backend="qwen_npu")
    for seq, pad in [(16, 5), (24, 3), (11, 0), (20, 9)]:
        input_ids, mask = _tokens(seq, seed=seq), _left_padding(seq, pad)
        assert_runs_match(run_model(model, compiled, input_ids, False, mask), run_model(model, model, input_ids, False, mask))
    reports = list(SUMMARY.graphs)
    assert len(reports) == 2, [r.name for r in reports]  # the static first graph, then one symbolic graph
    for report in reports:
        _assert_clean(report)
        assert report.fusions == WHOLE_MODEL


def test_whole_model_packed_sequences_run_varlen_attention():
    """verl's packed micro-batch (``use_remove_padding``: one row, position ids restarting per sequence, no
    attention mask): the packed causal mask transformers builds in the graph (4.57: through torch.vmap) is
    proven from the position ids, so attention runs as ``qwen_npu.varlen_attention``."""
    model = tiny_qwen2(torch.bfloat16).train()
    positions = torch.cat([torch.arange(n) for n in (6, 3, 7)])[None]
    input_ids = torch.randint(0, 128, positions.shape, generator=torch.Generator().manual_seed(2))
    expected, reference = eager_and_reference(model, input_ids, True, torch.bfloat16, position_ids=positions)
    actual = run_model(model, torch.compile(model, backend="qwen_npu"), input_ids, True, position_ids=positions)
    (report,) = SUMMARY.graphs
    _assert_clean(report)
    assert report.fusions == WHOLE_MODEL
    assert report.variants.get("varlen_sdpa_mask_repeat_kv") == LAYERS, report.variants
    assert_runs_match(actual, expected, reference)


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_per_layer_packed_sequences_run_varlen_attention(attn, record_property):
    """verl's packed micro-batches under per-layer compile, 3 packings of different T and sequence count:
    the base model's pre-hook passes host offsets, each layer graph runs ``qwen_npu.varlen_attention``
    (``flash_attention_2``: transformers' own NPU path, off-NPU through simulated_npu_host), at most 2 graphs
    shared by the layers, parity with the eager run of each packing (issues 18, 19)."""
    import contextlib

    from tests.helpers.npu_host import simulated_npu_host

    host = simulated_npu_host() if attn == "flash_attention_2" else contextlib.nullcontext()
    with host:
        torch.manual_seed(0)
        model = tiny_qwen2(torch.bfloat16, attn=attn).train()
        eager_model = tiny_qwen2(torch.bfloat16, attn=attn).train()
        compiled = maybe_compile(model, environ={ENV_COMPILE: "1"})
        assert compiled == [f"model.layers.{i}" for i in range(LAYERS)]
        for i, lens in enumerate([(6, 3, 7), (11,), (4, 9, 2, 5)]):
            positions = torch.cat([torch.arange(n) for n in lens])[None]
            input_ids = torch.randint(0, 128, positions.shape, generator=torch.Generator().manual_seed(i))
            expected, reference = eager_and_reference(eager_model, input_ids, True, torch.bfloat16,
                                                      position_ids=positions)
            actual = run_model(model, model, input_ids, True, position_ids=positions)
            assert_runs_match(actual, expected, reference)
    records = layer_reports(model)
    graphs = {report.name for record in records.values() for report in record.reports}
    assert 1 <= len(graphs) <= 2, graphs
    totals = dict.fromkeys(FAMILIES, 0)
    for name, record in records.items():
        assert record.calls["eager"] == 0 and record.calls["compiled"] == 3, (name, record.calls)
        for report in record.reports:
            _assert_clean(report)
            assert {f: report.fusions.get(f, 0) for f in FAMILIES} == PER_LAYER, (name, report.fusions)
            assert report.variants.get("varlen_packed_offsets") == 1, report.variants
        for family in FAMILIES:
            totals[family] += record.reports[0].fusions.get(family, 0)
    record_property("fusions", json.dumps(totals))


# --- torch.vmap regions and retrace failures, independent of the transformers version --------------


class VmapNorm(torch.nn.Module):
    """An RMSNorm whose input is offset by a nested-vmap-built tensor (as transformers 4.5x builds masks)."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(hidden) + 0.5)

    def forward(self, x):
        rows = torch.arange(x.shape[-2])
        cols = torch.arange(x.shape[-1])
        table = torch.vmap(torch.vmap(lambda r, c: (r * 3 + c) % 5 == 0, in_dims=(None, 0)), in_dims=(0, None))(rows, cols)
        x = x + table.to(x.dtype)
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + 1e-6))


def test_vmap_regions_are_desugared_and_fused():
    module = VmapNorm()
    x = torch.randn(2, 8, 64)
    expected = module(x)
    out = torch.compile(module, backend="qwen_npu")(x)
    (report,) = SUMMARY.graphs
    assert report.fallback is None and report.fusions["rms_norm"] == 1
    assert relative_l2(out.detach(), expected.detach()) <= 1e-6
    assert compat.functorch_depth() == 0


@FULL_ONLY
def test_a_failed_retrace_compiles_unfused_with_one_warning(monkeypatch, caplog):
    def fail(self, node):
        raise NotImplementedError("simulated retrace failure")

    monkeypatch.setattr(canonicalize._Retracer, "run_node", fail)
    module = VmapNorm()
    x = torch.randn(2, 8, 64)
    expected = module(x)
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        out = torch.compile(module, backend="qwen_npu")(x)
    (report,) = SUMMARY.graphs
    assert report.fallback.startswith("the pre-dispatch retrace failed: NotImplementedError: simulated retrace failure")
    assert report.fusions == dict.fromkeys(FAMILIES, 0)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "qwen_npu_compile"]
    assert len(warnings) == 1 and "compiling the graph unfused" in warnings[0].getMessage()
    torch.testing.assert_close(out, expected)
    assert compat.functorch_depth() == 0


def test_a_failed_vmap_region_trace_leaves_no_functorch_level(monkeypatch):
    # the region's trace dies between _vmap_increment_nesting and _vmap_decrement_nesting
    def fail_after_enter(*args, **kwargs):
        raise RuntimeError("simulated failure inside a vmap region")

    module = VmapNorm()
    x = torch.randn(2, 8, 64)
    expected = module(x)
    original = torch.fx.Interpreter.run_node

    def run_node(self, node):
        result = original(self, node)
        if type(self) is torch.fx.Interpreter and node.op == "call_function" and node.target in compat.VMAP_ENTER:
            fail_after_enter()
        return result

    monkeypatch.setattr(torch.fx.Interpreter, "run_node", run_node)
    out = torch.compile(module, backend="qwen_npu")(x)
    (report,) = SUMMARY.graphs
    assert report.fallback.startswith("tracing the torch.vmap region at"), report.fallback
    assert "simulated failure inside a vmap region" in report.fallback
    assert compat.functorch_depth() == 0
    torch.testing.assert_close(out, expected)


def test_restart_analysis_is_not_swallowed(monkeypatch):
    from qwen_npu_compile.backend import qwen_npu_backend

    def restart(self, node):
        raise torch._dynamo.exc.RestartAnalysis("recapture")

    monkeypatch.setattr(canonicalize._Retracer, "run_node", restart)
    gm = torch.fx.symbolic_trace(lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    with pytest.raises(torch._dynamo.exc.RestartAnalysis):
        qwen_npu_backend(gm, [torch.randn(2, 8)])
    assert SUMMARY.graphs == []
