"""Where MindSpeed replaced ``torch.compile`` with its ``dummy_compile``, qwen_npu still compiles.

The stand-in ``mindspeed`` package (tests/helpers/mindspeed_stand_in.py: MindSpeed's patch manager and
``dummy_compile``, as ``mindspeed/patch_utils.py`` and ``requirements_basic.py`` do it) is imported in
subprocesses (the patch must not leak into other tests), before ``qwen_npu_compile`` and after it:
``maybe_compile`` on a tiny Qwen2 (bf16, one training step) fuses every layer exactly and matches eager, and
``check`` passes. In this process: torch's own ``torch.compile`` is found without a patch record, and the
safety net names compilation disabled by ``torch._dynamo.config.disable`` (restored by monkeypatch).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from qwen_npu_compile import maybe_compile
from qwen_npu_compile.cli.check.models import tiny_qwen2_config
from qwen_npu_compile.integrations import torch_compiler
from qwen_npu_compile.patterns import expected_fusions
from qwen_npu_compile.worker import ENV_COMPILE, layer_reports
from tests.helpers.mindspeed_stand_in import DUMMY, write_stand_in

LAYERS = 2
CONFIG = tiny_qwen2_config(num_hidden_layers=LAYERS)
PER_LAYER = expected_fusions(CONFIG, per_layer=True)

#: Run in a fresh interpreter: argv = order ("before"/"after" qwen_npu_compile), model dir, output JSON.
DRIVER = r'''
import json, logging, sys
order, model_dir, out_path = sys.argv[1:]
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append((record.levelname, record.getMessage()))
logger = logging.getLogger("qwen_npu_compile")
logger.addHandler(Keep())
logger.setLevel(logging.INFO)
if order == "before":
    import mindspeed.megatron_adaptor
import torch
import qwen_npu_compile
if order == "after":
    import mindspeed.megatron_adaptor
from transformers import Qwen2ForCausalLM
from qwen_npu_compile import cli, maybe_compile
from qwen_npu_compile.cli.check.harness import fp32_reference, run_model
from qwen_npu_compile.cli.check.models import tiny_qwen2_config
from qwen_npu_compile.cli.check.parity import gradient_mismatch, judge_runs, problems
from qwen_npu_compile.report import SUMMARY
from qwen_npu_compile.worker import layer_reports

result = {"torch.compile": f"{torch.compile.__module__}.{torch.compile.__qualname__}"}
# a user's own torch.compile under the patch: never reaches the backend
torch.manual_seed(0)
model = Qwen2ForCausalLM(tiny_qwen2_config(num_hidden_layers=2)).to(torch.bfloat16).train()
ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
run_model(model, torch.compile(model, backend="qwen_npu"), ids, True)
result["graphs_by_patched_torch_compile"] = len(SUMMARY.graphs)
# maybe_compile: one bf16 training step against eager, judged against the fp32 reference
eager = run_model(model, model, ids, True)
reference = fp32_reference(model, ids, True)
compiled = maybe_compile(model, environ={"QWEN_NPU_COMPILE": "1"})
run = run_model(model, model, ids, True)
result["gradient_mismatch"] = gradient_mismatch(run, eager)
result["gradients"], result["parameters"] = len(run[1]), len(list(model.parameters()))
result["parity_problems"] = problems(judge_runs(run, eager, reference))
result["compiled_layers"] = list(compiled)
result["layers"] = {name: {"fusions": [dict(r.fusions) for r in record.reports], "calls": record.calls}
                    for name, record in layer_reports(model).items()}
result["maybe_compile_graphs"] = len(SUMMARY.graphs)
# check, the CLI
# (MindSpeed first: an fp32 inference check, the cheaper one; MindSpeed after us, as verl imports it: bf16 training)
mode = ["--mode", "infer", "--dtype", "fp32"] if order == "before" else []
status = cli.main(["check", model_dir, "--seq-len", "16", "--batch", "2", *mode, "--json", out_path + ".check.json"])
check = json.loads(open(out_path + ".check.json").read())
result["check"] = {"status": status, "verdict": check.get("verdict"), "fusions": check["fusions"],
                   "settings": {k: check["settings"].get(k) for k in ("mode", "dtype")}}
result["torch.compile after"] = f"{torch.compile.__module__}.{torch.compile.__qualname__}"
result["log"] = records
json.dump(result, open(out_path, "w"))
'''


@pytest.fixture(scope="module")
def patched_runs(tmp_path_factory):
    """Both orders, run side by side in fresh interpreters with the stand-in MindSpeed on ``sys.path``."""
    root = tmp_path_factory.mktemp("mindspeed")
    write_stand_in(root / "site")
    (root / "driver.py").write_text(DRIVER)
    model_dir = root / "tiny-qwen2"
    tiny_qwen2_config(num_hidden_layers=LAYERS).save_pretrained(model_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QWEN_NPU", "TORCHDYNAMO", "TORCH_COMPILE"))}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "site"), *filter(None, [env.get("PYTHONPATH")])])
    procs = {
        order: subprocess.Popen([sys.executable, str(root / "driver.py"), order, str(model_dir),
                                 str(root / f"{order}.json")], env=env, cwd=root, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for order in ("before", "after")
    }
    results = {}
    for order, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-2000:] + err[-4000:]
        results[order] = json.loads((root / f"{order}.json").read_text())
    return results


@pytest.mark.parametrize("order", ["before", "after"])
def test_maybe_compile_fuses_every_layer_under_mindspeed(patched_runs, order):
    run = patched_runs[order]
    assert run["torch.compile"] == run["torch.compile after"] == DUMMY  # the patch was on throughout
    assert run["graphs_by_patched_torch_compile"] == 0  # a user's own torch.compile(..., backend="qwen_npu")
    assert run["compiled_layers"] == ["model.layers.0", "model.layers.1"]
    assert sorted(run["layers"]) == ["model.layers.0", "model.layers.1"]
    for name, layer in run["layers"].items():
        assert layer["fusions"] == [PER_LAYER], (name, layer)
        assert layer["calls"] == {"compiled": 1, "checkpointed": 0, "eager": 0}
    assert run["maybe_compile_graphs"] == 1  # both layers share one graph
    # bf16 training step: same gradients as eager, within the fp32-reference bound
    assert run["gradient_mismatch"] == [] and run["gradients"] == run["parameters"]
    assert run["parity_problems"] == []


@pytest.mark.parametrize("order", ["before", "after"])
def test_mindspeed_is_named_once_and_the_first_pass_counts_graphs(patched_runs, order):
    log = patched_runs[order]["log"]
    named = [message for level, message in log if "not torch's own" in message]
    assert len(named) == 1, named
    level, message = next((lv, m) for lv, m in log if "not torch's own" in m)
    assert level == "INFO"
    assert message.startswith(f"qwen_npu: torch.compile is {DUMMY}, not torch's own (MindSpeed's patch: it runs "
                               "functions uncompiled); qwen_npu compiles with torch's own torch.compile ("), message
    assert "mindspeed.patch_utils.MindSpeedPatchesManager.patches_info['torch.compile'].orig_func" in message
    first_pass = [(lv, m) for lv, m in log if "produced qwen_npu graphs" in m]
    assert first_pass == [("INFO", "qwen_npu: 2 of 2 decoder layer(s) of Qwen2ForCausalLM produced qwen_npu graphs "
                                   "at their first call; 2 of 2 reached their expected fusions")]
    assert [m for lv, m in log if "without a qwen_npu graph" in m] == []


@pytest.mark.parametrize("order", ["before", "after"])
def test_check_passes_under_mindspeed(patched_runs, order):
    check = patched_runs[order]["check"]
    assert check["status"] == 0 and check["verdict"] == "PASS", check
    assert check["settings"] == ({"mode": "infer", "dtype": "fp32"} if order == "before" else
                                 {"mode": "train", "dtype": "bf16"})
    whole = expected_fusions(CONFIG)
    for family in ("rms_norm", "swiglu", "rotary", "attention"):
        assert check["fusions"][family]["fused"] == check["fusions"][family]["expected"] == whole[family], check


# --- in this process: torch_compiler, and compilation disabled some other way -----------------------


def test_torch_compile_is_found_again_from_torchs_own_source(monkeypatch, caplog):
    original = torch.compile
    monkeypatch.setattr(torch_compiler, "_AT_IMPORT", None)

    def dummy_compile(*args, **kwargs):
        return args[0]

    monkeypatch.setattr(torch, "compile", dummy_compile)
    with caplog.at_level(logging.INFO, logger="qwen_npu_compile"):
        found = torch_compiler.original_torch_compile()
    assert torch_compiler.is_torch_compile(found) and found.__code__.co_filename == original.__code__.co_filename
    assert torch_compiler.replaced_by() == f"{__name__}.test_torch_compile_is_found_again_from_torchs_own_source." \
                                          "<locals>.dummy_compile"
    assert [r.getMessage() for r in caplog.records if "not torch's own" in r.getMessage()] == [
        f"qwen_npu: torch.compile is {torch_compiler.replaced_by()}, not torch's own; qwen_npu compiles with torch's "
        f"own torch.compile (the definition in {Path(torch.__file__)} re-run)"]
    compiled = torch_compiler.torch_compile(lambda x: x * 2, backend="eager")
    assert torch_compiler.is_dynamo_compiled(compiled)
    torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 2.0))


def test_torch_compile_seen_at_import_is_used_without_a_patch_record(monkeypatch, caplog):
    original = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: args[0])  # no manager, no __wrapped__
    with caplog.at_level(logging.INFO, logger="qwen_npu_compile"):
        assert torch_compiler.original_torch_compile() is original
    [message] = [r.getMessage() for r in caplog.records if "not torch's own" in r.getMessage()]
    assert message.endswith("(torch.compile as bound when qwen_npu_compile was imported)"), message


def test_a_wrapper_of_torch_compile_is_unwrapped(monkeypatch):
    original = torch.compile

    @functools.wraps(original)
    def compile_wrapper(*args, **kwargs):  # e.g. a MindSpeed-style "...wrapper" around the original
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", compile_wrapper)
    code = compile_wrapper.__code__  # functools.wraps copies the name: the wrapper's own code tells it apart
    assert torch_compiler.replaced_by() == \
        f"torch.compile (a wrapper defined at {code.co_filename}:{code.co_firstlineno})"
    assert torch_compiler.original_torch_compile() is original


def _tiny_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(num_hidden_layers=LAYERS)).train()


def _forward(model) -> None:
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)


def test_safety_net_names_dynamo_config_disable(monkeypatch, caplog):
    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    model = _tiny_model()
    compiled = maybe_compile(model, environ={ENV_COMPILE: "1"})
    with caplog.at_level(logging.INFO, logger="qwen_npu_compile"):
        _forward(model)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    cause = "compilation is disabled: torch._dynamo.config.disable is True; nothing is compiled or fused"
    assert [r.getMessage() for r in warned] == [
        f"qwen_npu: decoder layer model.layers.0 ran without a qwen_npu graph ({cause})",
        f"qwen_npu: decoder layer model.layers.1 ran without a qwen_npu graph ({cause})",
        f"qwen_npu: 0 of 2 decoder layer(s) of Qwen2ForCausalLM produced qwen_npu graphs at their first call ({cause})",
    ]
    assert compiled.with_graphs() == [] and compiled.not_compiled() == ["model.layers.0", "model.layers.1"]


def test_safety_net_is_an_error_in_strict_mode(monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    model = _tiny_model()
    maybe_compile(model, {"strict": True}, environ={ENV_COMPILE: "1"})
    with pytest.raises(RuntimeError) as info:
        _forward(model)
    assert str(info.value) == ("qwen_npu: decoder layer model.layers.0 ran without a qwen_npu graph (compilation is "
                               "disabled: torch._dynamo.config.disable is True; nothing is compiled or fused) [strict]")


def test_safety_net_names_a_layer_call_dynamo_did_not_compile(monkeypatch, caplog):
    # a layer whose compiled call is not Dynamo's (as if torch.compile had been MindSpeed's dummy_compile)
    model = _tiny_model()
    maybe_compile(model, environ={ENV_COMPILE: "1"})

    def uncompiled(impl):
        def wrapper(*args, **kwargs):
            return impl(*args, **kwargs)
        return wrapper

    for layer in model.model.layers:
        layer._compiled_call_impl.compiled = uncompiled(layer._call_impl)

    def dummy_compile(*args, **kwargs):
        return args[0]

    monkeypatch.setattr(torch, "compile", dummy_compile)
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        _forward(model)
    first = [r.getMessage() for r in caplog.records][0]
    assert first == (
        f"qwen_npu: decoder layer model.layers.0 ran without a qwen_npu graph (its call {__name__}."
        "test_safety_net_names_a_layer_call_dynamo_did_not_compile.<locals>.uncompiled.<locals>.wrapper was not compiled by Dynamo; "
        f"torch.compile is {__name__}.test_safety_net_names_a_layer_call_dynamo_did_not_compile.<locals>."
        "dummy_compile, not torch's own (MindSpeed?): compile with qwen_npu_compile.maybe_compile or "
        "qwen_npu_compile.torch_compile)"
    )
    assert all(not record.reports for record in layer_reports(model).values())
