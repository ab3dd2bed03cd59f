"""verl 0.9.1's ``fsdp_turbo`` strategy (``FSDPTurboEngineWithLMHead``) with ``QWEN_NPU_COMPILE=1``.

The engine wraps the model with ``FSDPTurbo(config, module).model`` (FSDP-Turbo, not on PyPI: the stand-in
tests/stand_ins/fsdp_turbo does what verl calls, FSDP2 ``fully_shard`` plus ``module_patches`` that replace
forwards by dotted path) and reloads the state dict. The hook compiles the decoder layers of the wrapped model,
or, where a replaced forward would receive the layers' packed-row arguments, leaves them uncompiled with one
warning. Two parts:

* the hook's decisions on stand-in engines and the hazard it refuses (runs everywhere);
* ``-m verl``: verl 0.9.1's own ``FSDPTurboEngineWithLMHead`` on CPU (gloo, world size 1), driven by
  tests/drivers/verl_engine_run.py in subprocesses with the variable unset and set: exact per-layer fusions (those
  of the ``FSDPEngine`` runs of tests/integrations/test_verl_hook.py for the same tiny Qwen2), losses and gradients
  equal to the unset run.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch
from test_verl_hook import (  # noqa: F401
    BUILD_LINE,
    GRAPHS_LINE,
    PER_LAYER,
    assert_matches,
    fake_engine_module,
    fake_verl,
    needs_verl,
    run_scenarios,
    tiny_qwen2,
)

import qwen_npu_compile.verl as hook
from qwen_npu_compile.worker import ENV_COMPILE, layer_reports
from tests.helpers import REPO

STAND_IN = REPO / "tests" / "stand_ins" / "fsdp_turbo"
QWEN2 = "transformers.models.qwen2.modeling_qwen2"
MLP_PATCH = {f"{QWEN2}.Qwen2MLP.forward": "fsdp_turbo.example_patches.fused_swiglu_mlp_forward"}
LAYER_PATCH = {f"{QWEN2}.Qwen2DecoderLayer.forward": "fsdp_turbo.example_patches.decoder_layer_forward"}
#: a Qwen2 decoder layer whose MLP runs the patch's npu_swiglu: SwiGLU is the patch's, counted as already fused
PER_LAYER_MLP_PATCHED = {**PER_LAYER, "swiglu": 0}


def turbo_site(folder: Path) -> Path:
    """A folder holding only the stand-in ``fsdp_turbo`` (not tests/stand_ins itself: its ``fla`` would bind too)."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "fsdp_turbo"
    if not link.exists():
        link.symlink_to(STAND_IN, target_is_directory=True)
    return folder


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """The stand-in importable in this process; its module patches undone after the test."""
    monkeypatch.syspath_prepend(str(turbo_site(tmp_path / "site")))
    from fsdp_turbo.fsdp_turbo import undo_module_patches

    yield sys.modules["fsdp_turbo.fsdp_turbo"]
    undo_module_patches()


# --------------------------------------------------------------------------------------------------
# the hook's decisions (stand-in engines: FSDPTurbo's patches without sharding)


def fake_turbo_engine(patches: dict[str, str], **attributes):
    """A ``FSDPEngine`` stand-in and its ``FSDPTurboEngineWithLMHead`` (verl's module and class name), whose FSDP
    step applies ``patches`` as the stand-in FSDPTurbo does and returns the model; hooked."""
    from fsdp_turbo.fsdp_turbo import apply_module_patches

    module = fake_engine_module()

    class FSDPTurboEngineWithLMHead(module.FSDPEngine):
        def _build_fsdp_module(self, module):
            apply_module_patches(patches)
            return module

    FSDPTurboEngineWithLMHead.__module__ = hook.TURBO_MODULE
    hook.patch_engine(module)
    engine = FSDPTurboEngineWithLMHead(strategy="fsdp_turbo")
    for name, value in attributes.items():
        setattr(engine, name, value)
    return engine


def build(engine, caplog) -> tuple[torch.nn.Module, list[str]]:
    model = tiny_qwen2()
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        assert engine._build_fsdp_module(model) is model
    return model, [r.getMessage() for r in caplog.records if "FSDPTurboEngineWithLMHead" in r.getMessage()]


def test_turbo_engine_compiles_the_wrapped_layers(monkeypatch, fake_verl, stand_in, caplog):
    monkeypatch.setenv(ENV_COMPILE, "1")
    model, lines = build(fake_turbo_engine({}), caplog)
    assert [layer._compiled_call_impl is not None for layer in model.model.layers] == [True, True]
    assert lines == ["qwen_npu: verl 0.0.fake: FSDPTurboEngineWithLMHead._build_fsdp_module: set 2 decoder layer(s) "
                     "of Qwen2ForCausalLM to compile after FSDP-Turbo wrapped them (graphs at the first forward)"]


def test_turbo_engine_compiles_over_a_replaced_mlp_and_counts_its_op_as_already_fused(
        monkeypatch, fake_verl, stand_in, caplog):
    monkeypatch.setenv(ENV_COMPILE, "1")
    model, lines = build(fake_turbo_engine(MLP_PATCH), caplog)
    assert len(lines) == 1 and "set 2 decoder layer(s)" in lines[0]
    assert (f"FSDP-Turbo replaced {QWEN2}.Qwen2MLP.forward by fsdp_turbo.example_patches.fused_swiglu_mlp_forward "
            "(model.layers.0.mlp, model.layers.1.mlp) inside them") in lines[0]
    ids = torch.randint(0, 128, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    for name, record in layer_reports(model).items():
        assert record.reports[-1].fusions == PER_LAYER_MLP_PATCHED, name
        assert {k: n for k, n in record.reports[-1].already_fused.items() if n} == {"swiglu": 1}, name


@pytest.mark.parametrize("patches, attributes, why", [
    (LAYER_PATCH, {}, f"FSDP-Turbo replaced {QWEN2}.Qwen2DecoderLayer.forward by "
                      "fsdp_turbo.example_patches.decoder_layer_forward (model.layers.0, model.layers.1)"),
    ({f"{QWEN2}.Qwen2Attention.forward": "fsdp_turbo.example_patches.decoder_layer_forward"}, {},
     f"FSDP-Turbo replaced {QWEN2}.Qwen2Attention.forward by"),
    ({f"{QWEN2}.Qwen2Model.forward": "fsdp_turbo.example_patches.decoder_layer_forward"}, {},
     f"FSDP-Turbo replaced {QWEN2}.Qwen2Model.forward by"),
    ({}, {"use_ulysses_sp": True, "ulysses_sequence_parallel_size": 2}, "sequence parallelism of size 2"),
])
def test_turbo_engine_refuses_with_one_warning_and_trains_uncompiled(monkeypatch, fake_verl, stand_in, caplog,
                                                                     patches, attributes, why):
    monkeypatch.setenv(ENV_COMPILE, "1")
    model, lines = build(fake_turbo_engine(patches, **attributes), caplog)
    assert [layer._compiled_call_impl for layer in model.model.layers] == [None, None]
    assert len(lines) == 1, lines
    assert "the decoder layers of Qwen2ForCausalLM are left uncompiled" in lines[0] and why in lines[0]
    assert "strategy=fsdp2" in lines[0] and f"unset {ENV_COMPILE}" in lines[0]


def test_turbo_engine_is_untouched_when_switched_off(monkeypatch, fake_verl, stand_in, caplog):
    monkeypatch.setenv(ENV_COMPILE, "0")
    model, lines = build(fake_turbo_engine({}), caplog)
    assert lines == [] and [layer._compiled_call_impl for layer in model.model.layers] == [None, None]


def test_a_replaced_layer_forward_compiled_anyway_would_attend_across_packed_sequences(monkeypatch, stand_in):
    """Why the refusal: a layer forward that passes attention only the arguments it names drops the packed rows'
    offsets, and the compiled layers' pre-hook passed no mask (sdpa): attention then spans the packed sequences."""
    from fsdp_turbo.fsdp_turbo import apply_module_patches, undo_module_patches

    import qwen_npu_compile

    monkeypatch.setenv(ENV_COMPILE, "1")
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None]  # two sequences packed in one row

    def loss(compiled: bool, patched: bool) -> float:
        torch.manual_seed(0)
        model = tiny_qwen2()
        model.config.use_cache = False
        if patched:
            apply_module_patches(LAYER_PATCH)
        if compiled:
            qwen_npu_compile.maybe_compile(model)
        try:
            return model(input_ids=ids, position_ids=positions, labels=ids).loss.item()
        finally:
            undo_module_patches()
            torch._dynamo.reset()

    assert tiny_qwen2().config._attn_implementation == "sdpa"
    eager = loss(False, False)
    assert loss(True, False) == pytest.approx(eager, rel=1e-5)  # transformers' own layer: compiled is exact
    assert loss(False, True) == pytest.approx(eager, rel=1e-6)  # the replacement computes the same eagerly
    assert abs(loss(True, True) - eager) > 1e-4  # compiled over it: attention across the two sequences


# --------------------------------------------------------------------------------------------------
# verl 0.9.1's own FSDPTurboEngineWithLMHead (pytest -m verl)

FP32_PLAN = {"param_dtype": "fp32", "reduce_dtype": "fp32", "output_dtype": "fp32"}
#: verl 0.9.1's FSDPTurboEngineWithLMHead runs every forward under bf16 autocast whatever the fsdp_plan: its
#: _build_fsdp_module does not set _autocast_dtype, which FSDPEngine.__init__ defaults to bfloat16 (FSDPEngine's
#: own sets it from mixed_precision). Compiled and eager runs then agree to bf16's tolerance, not fp32's.
AUTOCAST = "bf16"
BF16_PLAN = {"param_dtype": "bf16", "reduce_dtype": "fp32", "output_dtype": "bf16"}


def turbo(param_dtype: str, patches: dict[str, str] | None = None, **settings) -> dict:
    plan = FP32_PLAN if param_dtype == "fp32" else BF16_PLAN
    return {"strategy": "fsdp_turbo", "param_dtype": param_dtype, "gradient_checkpointing": False, **settings,
            "turbo_config": {"distributed": {"fully_shard_parallel_size": 1, "fsdp_plan": plan},
                             "module_patches": patches or {}}}


#: name -> settings of tests/drivers/verl_engine_run.py (padded micro-batches unless use_remove_padding)
TURBO_SCENARIOS = {
    "turbo_fp32_params": turbo("fp32"),
    # verl's actor defaults: bf16 mixed precision (FSDP-Turbo's fsdp_plan default), gradient checkpointing
    "turbo_bf16_checkpointing": turbo("bf16", gradient_checkpointing=True),
    "turbo_mlp_patched": turbo("fp32", MLP_PATCH),
    # packed rows (use_remove_padding) with sdpa: the case where a compiled layer over this patch is wrong
    "turbo_layer_patched_packed": turbo("fp32", LAYER_PATCH, use_remove_padding=True),
}
#: the FSDPEngine runs' two lines (tests/integrations/test_verl_hook.py), for this engine, compiled after FSDP-Turbo
BUILD = BUILD_LINE.replace("FSDPEngineWithLMHead", "FSDPTurboEngineWithLMHead").replace(
    "before FSDP wrapping", "after FSDP-Turbo wrapped them")
GRAPHS = GRAPHS_LINE.replace("FSDPEngineWithLMHead", "FSDPTurboEngineWithLMHead")


@pytest.fixture(scope="module")
def turbo_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verl_fsdp_turbo")
    path = os.pathsep.join([str(turbo_site(tmp / "site")), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {"VERL_USE_EXTERNAL_MODULES": "qwen_npu_compile.verl", "PYTHONPATH": path}
    return {"off": run_scenarios(tmp, "off", env, TURBO_SCENARIOS),
            "on": run_scenarios(tmp, "on", {**env, ENV_COMPILE: "1"}, TURBO_SCENARIOS)}


def both(turbo_runs, scenario: str) -> tuple[dict, dict]:
    off, on = turbo_runs["off"][scenario], turbo_runs["on"][scenario]
    assert "error" not in off and "error" not in on, (off.get("traceback"), on.get("traceback"))
    assert off["engine"] == on["engine"] == "FSDPTurboEngineWithLMHead"
    assert off["compiled_layers"] == [] and off["hook_log"] == []  # unset: verl and FSDP-Turbo as they are
    assert on["state_dict_keys"] == off["state_dict_keys"]  # compiled in place: the reloaded keys unchanged
    return off, on


def assert_layers(run: dict, fusions: dict, already_fused: dict, calls_key: str) -> None:
    assert run["compiled_layers"] == ["model.layers.0", "model.layers.1"]
    for name, layer in run["layers"].items():
        assert layer["class"] == "Qwen2DecoderLayer"
        assert layer["fusions"] == [fusions], (name, layer["fusions"])  # one graph, shared by every call
        assert layer["already_fused"] == [already_fused], (name, layer["already_fused"])
        assert layer["calls"][calls_key] == 4, (name, layer["calls"])  # 2 steps x 2 micro-batches


@pytest.mark.verl
@needs_verl
@pytest.mark.parametrize("scenario", ["turbo_fp32_params", "turbo_bf16_checkpointing"])
def test_verl_turbo_engine_fuses_as_fsdp_engine_and_matches_the_unset_run(turbo_runs, scenario):
    off, on = both(turbo_runs, scenario)
    settings = TURBO_SCENARIOS[scenario]
    assert_layers(on, PER_LAYER, {}, "checkpointed" if settings["gradient_checkpointing"] else "compiled")
    assert_matches(on, off, AUTOCAST)
    assert on["hook_log"] == [BUILD, GRAPHS]


@pytest.mark.verl
@needs_verl
def test_verl_turbo_engine_compiles_over_a_replaced_mlp(turbo_runs):
    """A module patch inside the layers (Qwen2MLP.forward on npu_swiglu): the layers trace the replacement; SwiGLU
    is the patch's own op (already fused), everything else fuses as without it."""
    off, on = both(turbo_runs, "turbo_mlp_patched")
    assert_layers(on, PER_LAYER_MLP_PATCHED, {"swiglu": 1}, "compiled")
    assert_matches(on, off, AUTOCAST)
    assert on["hook_log"] == [
        BUILD + f"; FSDP-Turbo replaced {QWEN2}.Qwen2MLP.forward by fsdp_turbo.example_patches.fused_swiglu_mlp_forward"
        " (model.layers.0.mlp, model.layers.1.mlp) inside them: the layers compile the replacement, fused by "
        "qwen_npu only where it keeps transformers' form (fused ops of its own count as already fused in the graph "
        "reports)", GRAPHS]


@pytest.mark.verl
@needs_verl
def test_verl_turbo_engine_with_a_replaced_layer_forward_warns_once_and_trains_uncompiled(turbo_runs):
    off, on = both(turbo_runs, "turbo_layer_patched_packed")
    assert on["compiled_layers"] == [] and on["graphs"] == 0
    assert on["losses"] == off["losses"] and on["grads"] == off["grads"]  # exactly the unset run
    assert len(on["hook_log"]) == 1, on["hook_log"]
    line = on["hook_log"][0]
    assert line.startswith("qwen_npu: verl 0.9.1: FSDPTurboEngineWithLMHead._build_fsdp_module: QWEN_NPU_COMPILE=1, "
                           "but the decoder layers of Qwen2ForCausalLM are left uncompiled: FSDP-Turbo replaced "
                           f"{QWEN2}.Qwen2DecoderLayer.forward by fsdp_turbo.example_patches.decoder_layer_forward "
                           "(model.layers.0, model.layers.1)"), line
    assert "actor_rollout_ref.actor.strategy=fsdp2" in line and "unset QWEN_NPU_COMPILE" in line
