"""QWEN_NPU_COMPILE inside multi-process FSDP training (2 ranks, gloo on CPU): FSDP2 and FSDP1.

The ranks run ``examples/fsdp_train.py``'s ``launch`` (torch.multiprocessing spawn, one spawn per
strategy, several runs per spawn to keep the tests short) and hand their results back as JSON files.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch.distributed as dist
import transformers

from qwen_npu_compile.patterns import expected_fusions
from tests.helpers import REPO
from tests.helpers.runs import assert_every_layer_fused

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

EXAMPLE = REPO / "examples" / "fsdp_train.py"
RANKS, LAYERS, STEPS = 2, 2, 3
ATOL = 1e-5  # fp32: compiled and eager losses agree to ~1e-7
FUSED_PER_LAYER = expected_fusions(transformers.Qwen2Config(), ("rms_norm", "swiglu"), per_layer=True)


@pytest.fixture(scope="module")
def fsdp_train():
    """The example as a module; its folder is on sys.path so that spawned ranks can import it too."""
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        yield importlib.import_module("fsdp_train")
    finally:
        sys.path.remove(str(EXAMPLE.parent))


def assert_losses_match(off: dict, on: dict, rank: int) -> None:
    assert len(on["losses"]) == len(off["losses"]) == STEPS
    assert on["losses"] == pytest.approx(off["losses"], abs=ATOL), rank
    assert len(set(off["losses"])) > 1  # the model trains: losses move between steps


# --- FSDP2 --------------------------------------------------------------------------------------------

FSDP2 = {"layers": LAYERS, "steps": STEPS, "batch_size": 2, "seq_len": 16, "lr": 1e-3, "seed": 0,
         "strategy": "fsdp2", "use_orig_params": True, "compile_when": "before", "gradient_checkpointing": False}


@pytest.fixture(scope="module")
def fsdp2_results(fsdp_train):
    """2 ranks that inherit QWEN_NPU_COMPILE=1 from the launcher train with it, then with it set to 0.

    (One spawn for both runs keeps the test short; ``examples/fsdp_train.py --compile both`` runs
    them in separate processes.)
    """
    results = fsdp_train.launch([FSDP2, {**FSDP2, "env": {"QWEN_NPU_COMPILE": "0"}}], RANKS, compile_env="1")
    on = [results[rank][0] for rank in range(RANKS)]
    off = [results[rank][1] for rank in range(RANKS)]
    return off, on


def test_fsdp2_two_ranks_with_the_variable_on_match_the_variable_off(fsdp_train, fsdp2_results):
    off, on = fsdp2_results
    assert len(off) == len(on) == RANKS
    for rank in range(RANKS):
        assert "error" not in off[rank], off[rank].get("traceback")
        assert "error" not in on[rank], on[rank].get("traceback")
        assert_losses_match(off[rank], on[rank], rank)
        # the variable on: every decoder layer ran a fused graph; off: nothing compiled
        assert_every_layer_fused(on[rank], FUSED_PER_LAYER, LAYERS, f"rank {rank}")
        assert off[rank]["compiled_layers"] == [] and off[rank]["layers"] == {}
        # fully_shard found the layers by class name after compilation; state-dict keys are unchanged
        assert on[rank]["layer_classes"] == ["FSDPQwen2DecoderLayer"]
        assert on[rank]["state_dict_keys_equal"] and off[rank]["state_dict_keys_equal"]
        assert {layer["calls"]["compiled"] for layer in on[rank]["layers"].values()} == {STEPS}
    assert off[0]["losses"] != off[1]["losses"]  # the ranks trained on different data
    # the example's own verdict agrees
    verdict = fsdp_train.compare(off, on, ATOL, LAYERS)
    assert verdict["passed"], verdict["problems"]
    assert verdict["max_loss_diff"] <= ATOL
    text = fsdp_train.verdict_text(verdict, RANKS, STEPS, LAYERS)
    assert text.startswith("PASS") and "rms_norm 2" in text and "swiglu 1" in text


def test_fsdp_train_cli_options():
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for option in ("--ranks", "--steps", "--layers", "--compile", "{on,off,both}", "--out", "--strategy",
                   "--use-orig-params", "--gradient-checkpointing"):
        assert option in proc.stdout, option


# --- FSDP1 --------------------------------------------------------------------------------------------

FSDP1 = {"layers": LAYERS, "steps": STEPS, "batch_size": 2, "seq_len": 16, "lr": 1e-3, "seed": 0,
         "strategy": "fsdp1", "use_orig_params": True, "compile_when": "before", "gradient_checkpointing": False}
SCENARIOS = {
    "off": {**FSDP1, "env": {"QWEN_NPU_COMPILE": "0"}},
    # verl's order: gradient checkpointing enabled, maybe_compile, then FSDP(..., use_orig_params=True)
    "orig_params_before_wrap": {**FSDP1, "gradient_checkpointing": True, "env": {"QWEN_NPU_COMPILE": "1"}},
    "orig_params_after_wrap": {**FSDP1, "compile_when": "after", "env": {"QWEN_NPU_COMPILE": "1"}},
    "flat_params_before_wrap": {**FSDP1, "use_orig_params": False, "env": {"QWEN_NPU_COMPILE": "1"}},
    "flat_params_after_wrap": {**FSDP1, "use_orig_params": False, "compile_when": "after",
                               "env": {"QWEN_NPU_COMPILE": "1"}},
}


@pytest.fixture(scope="module")
def fsdp1_results(fsdp_train):
    """Every FSDP1 scenario, run in turn by the same 2 ranks: ``{scenario: [rank results]}``."""
    results = fsdp_train.launch(list(SCENARIOS.values()), RANKS, compile_env=None)
    return {name: [results[rank][index] for rank in range(RANKS)] for index, name in enumerate(SCENARIOS)}


@pytest.mark.parametrize("scenario", ["orig_params_before_wrap", "orig_params_after_wrap"])
def test_fsdp1_with_use_orig_params_matches_the_variable_off(fsdp1_results, scenario):
    for rank, (off, on) in enumerate(zip(fsdp1_results["off"], fsdp1_results[scenario])):
        assert "error" not in off and "error" not in on, (off.get("traceback"), on.get("traceback"))
        assert_losses_match(off, on, rank)
        assert off["compiled_layers"] == []
        assert_every_layer_fused(on, FUSED_PER_LAYER, LAYERS, f"rank {rank}")
        assert on["layer_classes"] == ["Qwen2DecoderLayer"]  # FSDP1 wraps the layer, its class stays
        assert on["state_dict_keys_equal"]
        calls = {layer["calls"]["checkpointed" if on["spec"]["gradient_checkpointing"] else "compiled"]
                 for layer in on["layers"].values()}
        assert calls == {STEPS}


@pytest.mark.parametrize("scenario", ["flat_params_before_wrap", "flat_params_after_wrap"])
def test_fsdp1_without_use_orig_params_is_refused_with_what_to_change(fsdp1_results, scenario):
    for result in fsdp1_results[scenario]:
        assert "losses" not in result
        error = result["error"]
        assert error.startswith("ValueError: qwen_npu:"), error
        assert "use_orig_params=False" in error and "use_orig_params=True" in error
        assert "actor_rollout_ref.actor.fsdp_config.use_orig_params=True" in error  # the verl setting
        assert "fully_shard" in error and "QWEN_NPU_COMPILE" in error
        if scenario == "flat_params_after_wrap":
            assert "maybe_compile" in result["traceback"] and "FSDP1 unit(s)" in error  # refused when called
        else:
            assert "compiled by maybe_compile before wrapping" in error  # refused at the first forward
