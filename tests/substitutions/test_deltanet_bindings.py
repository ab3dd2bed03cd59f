"""Whatever transformers binds for the Gated DeltaNet's delta rule, the ``gated_delta_rule`` family fuses it or
says, in one warning, why not.

transformers binds ``torch_chunk_gated_delta_rule`` as a plain function (4.57.6, 5.10.4), as its hub wrapper
(>= 5.15), or, with the ``kernels`` package installed (a hard dependency of 5.25; optional on 5.24), as a kernels
``Func`` module around that wrapper; ``deltanet.resolve_binding`` finds the function Dynamo reaches in each. A
binding this project does not know is one WARNING naming it and the fix, and the family's near miss names the same
cause. 5.25's ``from_pretrained`` models re-kernelize at every ``train()`` / ``eval()`` (dropping instance-level
``forward`` patches): the in-place compile of ``maybe_compile`` survives it and still fuses. The ``maybe_compile``
summary counts the layers that reached their declared fusions and warns about a shortfall nobody explained.
Tiny random-weight Qwen3.5 / Qwen2 of transformers' own modeling code.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
import transformers

pytest.importorskip("transformers.models.qwen3_5", reason="Qwen3.5 needs transformers >= 5")

from transformers.models.qwen3_5 import modeling_qwen3_5 as M

from qwen_npu_compile import maybe_compile, worker
from qwen_npu_compile.patterns import expected_fusions
from qwen_npu_compile.report import SUMMARY
from qwen_npu_compile.substitutions import deltanet
from qwen_npu_compile.worker import ENV_COMPILE, layer_reports
from tests.helpers.models import tiny_hybrid

RELEASE = tuple(int(part) for part in transformers.__version__.split("+")[0].split(".")[:2])
KERNELS = importlib.util.find_spec("kernels") is not None
KEY = f"{M.__name__}.torch_chunk_gated_delta_rule"


def _expected_kind() -> str:
    if RELEASE < (5, 15):
        return "plain function"
    return "kernels Func wrapper" if KERNELS else "hub wrapper"


def test_the_binding_of_this_stack_is_known_and_substituted():
    """The kind follows the version and ``kernels``; the function found is the one transformers' torch path runs."""
    function, kind = deltanet.resolve_binding(M.torch_chunk_gated_delta_rule)
    assert kind == _expected_kind()
    assert function.__name__ == "torch_chunk_gated_delta_rule"
    assert deltanet.install()  # idempotent; the substitution is in place
    assert deltanet._installed[KEY].startswith("modeling_qwen3_5.torch_chunk_gated_delta_rule -> qwen_npu::")
    assert deltanet._bindings[M.__name__] == kind


def test_an_unknown_binding_is_one_warning_and_the_near_miss_names_it(npu_ops, monkeypatch, caplog):
    """A callable object transformers might bind tomorrow: one WARNING (what it is, what to do), the model still
    trains (its Python traced), and the family's near miss in the graph report names the same cause."""
    original = deltanet._unsubstituted(deltanet.resolve_binding(M.torch_chunk_gated_delta_rule)[0])

    class TomorrowsKernel:
        def __call__(self, *args, **kwargs):
            return original(*args, **kwargs)

    monkeypatch.setattr(M, "torch_chunk_gated_delta_rule", TomorrowsKernel())
    monkeypatch.setattr(deltanet, "_installed", {k: v for k, v in deltanet._installed.items() if k != KEY})
    monkeypatch.setattr(deltanet, "_refused", set())
    monkeypatch.setattr(deltanet, "_setup_problems", {})
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        deltanet.install()
        deltanet.install()  # once per process, not per call
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "TomorrowsKernel" in warnings[0] and "does not know" in warnings[0]
    assert "upgrade qwen_npu_compile" in warnings[0] and "transformers 5." in warnings[0]

    model = tiny_hybrid("qwen3_5", torch.float32).train()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids).logits
    got = torch.compile(model, backend="qwen_npu")(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (report,) = SUMMARY.graphs
    assert report.fusions["gated_delta_rule"] == 0
    reasons = [r.reason for r in report.refused if r.family == "gated_delta_rule"]
    # a near miss per anchor op of the traced delta rule: transformers >= 5.15's chunked scan solves two triangular
    # systems per chunk loop (2 per DeltaNet layer); 5.10.4's reference has no such anchor, so no near miss
    assert len(reasons) == report.anchors.get("gated_delta_rule", 0) == (2 * 3 if RELEASE >= (5, 15) else 0)
    assert all("could not be set up" in reason and "TomorrowsKernel" in reason for reason in reasons)


def test_in_place_compile_survives_train_eval_toggles(npu_ops, tmp_path, monkeypatch, caplog):
    """A ``from_pretrained`` model (5.25: ``use_kernels`` on, re-kernelized at every mode change) compiled in place:
    three train/eval rounds keep every layer compiled, one graph per layer kind and mode, the declared fusions."""
    monkeypatch.setenv(ENV_COMPILE, "1")
    tiny_hybrid("qwen3_5", torch.float32).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    model.config.use_cache = False
    kernelized = bool(getattr(model, "use_kernels", False))
    assert kernelized == (KERNELS and RELEASE >= (5, 25))
    caplog.set_level(logging.INFO, logger="qwen_npu_compile")
    compiled = maybe_compile(model)
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(1))
    modes = []
    for _ in range(3):
        model.train()
        modes.append(str(getattr(model, "kernels_mode", None)))
        model(input_ids=ids, labels=ids).loss.backward()
        model.eval()
        modes.append(str(getattr(model, "kernels_mode", None)))
        with torch.no_grad():
            model(input_ids=ids)
    if kernelized:  # transformers really re-kernelized at each toggle
        assert modes == ["Mode.TRAINING", "Mode.INFERENCE"] * 3
    assert all(type(layer._compiled_call_impl).__name__ == "_CompiledLayerCall" for layer in model.model.layers)
    kinds = model.config.layer_types
    for index, (name, record) in enumerate(layer_reports(model).items()):
        assert record.calls["compiled"] == 6, (name, record.calls)
        assert len(record.reports) == 2, name  # a training graph and a no-grad graph, compiled once each
        want = expected_fusions(model.config, per_layer=True, layer_type=kinds[index])
        assert all({f: r.fusions[f] for f in want} == want for r in record.reports), (name, record.reports)
    assert len(compiled) == 4
    assert any(r.getMessage().endswith("4 of 4 decoder layer(s) of Qwen3_5ForCausalLM produced qwen_npu graphs at "
                                       "their first call; 4 of 4 reached their expected fusions")
               for r in caplog.records if r.levelno == logging.INFO)


def test_the_summary_warns_about_a_shortfall_nobody_explained(npu_ops, monkeypatch, caplog):
    """A layer whose graph fuses fewer than declared with no refusal recorded (a silently lost fusion, forced here
    by declaring one RMSNorm more than a Qwen2 layer has): the first-pass line is a WARNING that names it."""
    monkeypatch.setenv(ENV_COMPILE, "1")
    declared = worker._expected_per_layer

    def one_more(model, layer, families):
        return {**declared(model, layer, families), "rms_norm": 3}

    monkeypatch.setattr(worker, "_expected_per_layer", one_more)
    config = transformers.Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=256, use_cache=False)
    model = transformers.Qwen2ForCausalLM(config).train()
    maybe_compile(model)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="qwen_npu_compile"):
        model(input_ids=ids, labels=ids).loss.backward()
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "reached their expected" in r.getMessage()]
    assert lines == [("WARNING", "qwen_npu: 2 of 2 decoder layer(s) of Qwen2ForCausalLM produced qwen_npu graphs at "
                                 "their first call; 0 of 2 reached their expected fusions (model.layers.0: rms_norm 2 "
                                 "of 3 (no reason recorded); model.layers.1: rms_norm 2 of 3 (no reason recorded); "
                                 "QWEN_NPU_DUMP_DIR=<dir> keeps the graphs)")]
