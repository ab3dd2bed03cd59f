"""Options and QWEN_NPU_* environment variables: parsing, precedence and clear errors."""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qwen_npu_compile.config import ALL_FAMILIES, QwenNpuConfig, QwenNpuConfigError, parse_bool, parse_fusions
from tests.helpers import REPO


def test_defaults():
    config = QwenNpuConfig.from_options(None, environ={})
    assert config.fusions == frozenset(ALL_FAMILIES)
    assert (config.dump_dir, config.downstream, config.strict) == (None, None, False)


def test_env_sets_everything():
    env = {"QWEN_NPU_FUSIONS": "rms_norm, SwiGLU", "QWEN_NPU_DUMP_DIR": "/tmp/d", "QWEN_NPU_DOWNSTREAM": "eager",
           "QWEN_NPU_STRICT": "yes"}
    config = QwenNpuConfig.from_options({}, environ=env)
    assert config == QwenNpuConfig(frozenset({"rms_norm", "swiglu"}), Path("/tmp/d"), "eager", True)


def test_options_win_over_env():
    env = {"QWEN_NPU_FUSIONS": "none", "QWEN_NPU_STRICT": "1", "QWEN_NPU_DOWNSTREAM": "inductor"}
    config = QwenNpuConfig.from_options({"fusions": ["swiglu"], "strict": False, "downstream": "aot_eager"}, environ=env)
    assert (config.fusions, config.strict, config.downstream) == (frozenset({"swiglu"}), False, "aot_eager")


@pytest.mark.parametrize("value,expected", [("all", set(ALL_FAMILIES)), ("none", set()), ("NONE", set()),
                                            ("rotary,attention", {"rotary", "attention"}), ([], set())])
def test_parse_fusions(value, expected):
    assert parse_fusions(value) == expected


@pytest.mark.parametrize("options,env,message", [
    ({"fusionz": "all", "bogus": 1}, {}, r"unknown option\(s\) \['bogus', 'fusionz'\]; valid options are \['downstream', 'dump_dir', 'fusions', 'recompute', 'strict', 'torchair_dump', 'torchair_mode', 'torchair_run_eagerly'\]"),
    ({"fusions": "rmsnorm"}, {}, r"unknown fusion family \['rmsnorm'\] \(did you mean 'rms_norm'\?\); valid: 'all'"),
    ({"fusions": "rmsnorm,swigly,bogus"}, {}, r"\(did you mean 'rms_norm' for 'rmsnorm', 'swiglu' for 'swigly'\?\)"),
    ({"fusion": "all"}, {}, r"\['fusion'\] \(did you mean 'fusions'\?\); valid options"),
    ({"downstream": "aot-eager"}, {}, r"'aot-eager' is not a known downstream backend \(did you mean 'aot_eager'\?\)"),
    ({"downstream": "tensorrt"}, {}, r"'tensorrt' is not a known downstream backend; choose one of"),
    ({}, {"QWEN_NPU_STRICT": "ture"}, r"'ture' is not a boolean \(did you mean 'true'\?\)"),
    ({"torchair_mode": "max_autotune"}, {}, r"is not valid \(did you mean 'max-autotune'\?\); choose one of"),
    ({}, {"QWEN_NPU_FUSIONS": "all,rotary"}, r"QWEN_NPU_FUSIONS names unknown fusion family \['all'\]"),
    ({}, {"QWEN_NPU_FUSIONS": " "}, r"QWEN_NPU_FUSIONS is empty; use 'all', 'none'"),
    ({"downstream": "npu"}, {}, r"not a known downstream backend; choose one of \['torchair', 'aot_eager', 'eager', 'inductor'\]"),
    ({}, {"QWEN_NPU_STRICT": "maybe"}, r"QWEN_NPU_STRICT = 'maybe' is not a boolean"),
    ({"fusions": 3}, {}, r"must be a string or a list"),
    ({"dump_dir": 123}, {}, r"option 'dump_dir' must be a folder path"),
    ("all", {}, r"options must be a dict"),
])
def test_bad_values_raise_value_error_naming_choices(options, env, message):
    with pytest.raises(QwenNpuConfigError, match=message) as caught:
        QwenNpuConfig.from_options(options, environ=env)
    assert isinstance(caught.value, ValueError) and "\n" not in str(caught.value)


def test_parse_bool():
    assert parse_bool("On", "x") is True and parse_bool("0", "x") is False and parse_bool(True, "x") is True


def test_bad_option_through_torch_compile_names_choices(npu_ops):
    compiled = torch.compile(lambda x: x + 1, backend="qwen_npu", options={"fusionz": "all"})
    with pytest.raises(QwenNpuConfigError, match=r"unknown option\(s\) \['fusionz'\] \(did you mean 'fusions'\?\)") as caught:
        compiled(torch.ones(2))
    # not wrapped: what the user catches and sees is our error, its message one line
    assert not isinstance(caught.value, torch._dynamo.exc.BackendCompilerFailed)
    assert str(caught.value).startswith("qwen_npu: unknown option(s)") and "\n" not in str(caught.value)
    again = pickle.loads(pickle.dumps(caught.value))  # e.g. sent back from a Ray worker
    assert type(again) is QwenNpuConfigError and str(again) == str(caught.value)


def test_bad_env_through_torch_compile(npu_ops, monkeypatch):
    monkeypatch.setenv("QWEN_NPU_FUSIONS", "rms_norm,bogus")
    with pytest.raises(QwenNpuConfigError, match=r"QWEN_NPU_FUSIONS names unknown fusion family \['bogus'\]"):
        torch.compile(lambda x: x * 2, backend="qwen_npu")(torch.ones(2))


def test_bad_env_is_overridden_by_a_valid_option(npu_ops, monkeypatch):
    monkeypatch.setenv("QWEN_NPU_FUSIONS", "rmsnorm")
    assert torch.compile(lambda x: x * 2, backend="qwen_npu", options={"fusions": "rms_norm"})(torch.ones(2)).sum() == 4


#: A user's script: a tiny RMSNorm module compiled with options from argv[1] and the environment.
_SCRIPT = """
import sys, torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
options = eval(sys.argv[1])
compiled = torch.compile(Qwen2RMSNorm(16), backend="qwen_npu", **options)
print("compiled", flush=True)
compiled(torch.randn(2, 3, 16))
"""

#: The most lines a bad setting's traceback may have: the user's line, torch's call wrappers of the compiled
#: module (eval_frame, nn.Module, Dynamo's compile wrapper) and the backend's raise, 2 or 3 lines each.
MAX_TRACEBACK_LINES = 20


@pytest.mark.parametrize(("kwargs", "env", "last_line"), [
    ({}, {"QWEN_NPU_FUSIONS": "rmsnorm"},
     "qwen_npu_compile.config.QwenNpuConfigError: qwen_npu: environment variable QWEN_NPU_FUSIONS names unknown "
     "fusion family ['rmsnorm'] (did you mean 'rms_norm'?); valid: 'all', 'none' or a comma-separated subset of "
     f"{list(ALL_FAMILIES)}"),
    ({"options": {"downstream": "tensorrt"}}, {},
     "qwen_npu_compile.config.QwenNpuConfigError: qwen_npu: option 'downstream' = 'tensorrt' is not a known "
     "downstream backend; choose one of ['torchair', 'aot_eager', 'eager', 'inductor']"),
    ({"options": {"fusion": "all"}}, {},
     "qwen_npu_compile.config.QwenNpuConfigError: qwen_npu: unknown option(s) ['fusion'] (did you mean 'fusions'?); "
     "valid options are ['downstream', 'dump_dir', 'fusions', 'recompute', 'strict', 'torchair_dump', 'torchair_mode', "
     "'torchair_run_eagerly']"),
    ({}, {"QWEN_NPU_STRICT": "ture"},
     "qwen_npu_compile.config.QwenNpuConfigError: qwen_npu: environment variable QWEN_NPU_STRICT = 'ture' is not a "
     "boolean (did you mean 'true'?); use one of 1/true/yes/on or 0/false/no/off"),
    ({"mode": "max-autotune"}, {},
     "qwen_npu_compile.config.QwenNpuConfigError: qwen_npu: torch.compile(mode='max-autotune') is not supported; "
     "choose the downstream backend with options={'downstream': 'torchair'|'aot_eager'|'eager'|'inductor'}"),
], ids=["env-fusions", "option-downstream", "option-key", "env-strict", "mode"])
def test_a_bad_setting_ends_in_one_line_without_dynamos_traceback(kwargs, env, last_line):
    environ = {key: value for key, value in os.environ.items()
               if not key.startswith(("QWEN_NPU_", "TORCHDYNAMO_", "TORCH_LOGS"))}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, repr(kwargs)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**environ, **env})
    assert done.returncode == 1, done.stdout + done.stderr
    # torch.compile(...) itself looks the backend up and returns; the first call raises
    assert done.stdout.strip() == "compiled"
    lines = done.stderr.rstrip("\n").splitlines()
    assert lines[-1] == last_line, done.stderr
    assert "reporting a bug to PyTorch" not in done.stderr and "BackendCompilerFailed" not in done.stderr
    assert "During handling" not in done.stderr and "direct cause" not in done.stderr
    traceback = lines[lines.index("Traceback (most recent call last):"):]
    assert len(traceback) <= MAX_TRACEBACK_LINES + 1, done.stderr
    assert not any("output_graph.py" in line or "convert_frame.py" in line for line in traceback), done.stderr


def test_mode_is_refused_with_a_pointer_to_downstream(npu_ops):
    with pytest.raises(QwenNpuConfigError, match=r"mode='max-autotune'.*options=\{'downstream'"):
        torch.compile(lambda x: x * 2, backend="qwen_npu", mode="max-autotune")(torch.ones(2))


def test_torchair_reduce_overhead_off_npu_is_a_clear_error(simulated_npu_ops):
    # off-NPU, downstream torchair is the FX->GE conversion check (tests/torchair/test_torchair_offline.py);
    # torchair's ACL-graph mode has no conversion to check
    options = {"downstream": "torchair", "torchair_mode": "reduce-overhead"}
    with pytest.raises(QwenNpuConfigError, match=r"torchair_mode 'reduce-overhead' captures an ACL graph on the NPU"):
        torch.compile(lambda x: x * 2, backend="qwen_npu", options=options)(torch.ones(2))


@pytest.mark.parametrize("downstream", ["eager", "inductor"])
def test_other_downstreams_run_the_fused_graph(npu_ops, downstream):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    norm = Qwen2RMSNorm(16)
    x = torch.randn(2, 3, 16)
    out = torch.compile(norm, backend="qwen_npu", options={"downstream": downstream, "fusions": "rms_norm"})(x)
    torch.testing.assert_close(out, norm(x))
    from qwen_npu_compile import get_reports

    assert [(r.downstream, r.fusions["rms_norm"]) for r in get_reports()] == [(downstream, 1)]
