"""Options and QWEN_NPU_* environment variables: parsing, precedence and clear errors."""

from pathlib import Path

import pytest
import torch

from qwen_npu_compile.config import ALL_FAMILIES, QwenNpuConfig, parse_bool, parse_fusions


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
    ({"fusion": "all"}, {}, r"unknown option\(s\) \['fusion'\]; valid options are \['downstream', 'dump_dir', 'fusions', 'strict', 'torchair_dump', 'torchair_mode', 'torchair_run_eagerly'\]"),
    ({"fusions": "rmsnorm"}, {}, r"unknown fusion family \['rmsnorm'\].*'rms_norm'"),
    ({}, {"QWEN_NPU_FUSIONS": "all,rotary"}, r"QWEN_NPU_FUSIONS names unknown fusion family \['all'\]"),
    ({}, {"QWEN_NPU_FUSIONS": " "}, r"QWEN_NPU_FUSIONS is empty; use 'all', 'none'"),
    ({"downstream": "npu"}, {}, r"not a known downstream backend; choose one of \['torchair', 'aot_eager', 'eager', 'inductor'\]"),
    ({}, {"QWEN_NPU_STRICT": "maybe"}, r"QWEN_NPU_STRICT = 'maybe' is not a boolean"),
    ({"fusions": 3}, {}, r"must be a string or a list"),
    ({"dump_dir": 123}, {}, r"option 'dump_dir' must be a folder path"),
    ("all", {}, r"options must be a dict"),
])
def test_bad_values_raise_value_error_naming_choices(options, env, message):
    with pytest.raises(ValueError, match=message):
        QwenNpuConfig.from_options(options, environ=env)


def test_parse_bool():
    assert parse_bool("On", "x") is True and parse_bool("0", "x") is False and parse_bool(True, "x") is True


def test_bad_option_through_torch_compile_names_choices(npu_ops):
    compiled = torch.compile(lambda x: x + 1, backend="qwen_npu", options={"fusionz": "all"})
    with pytest.raises(Exception, match=r"unknown option\(s\) \['fusionz'\]"):
        compiled(torch.ones(2))


def test_bad_env_through_torch_compile(npu_ops, monkeypatch):
    monkeypatch.setenv("QWEN_NPU_FUSIONS", "rms_norm,bogus")
    with pytest.raises(Exception, match=r"QWEN_NPU_FUSIONS names unknown fusion family \['bogus'\]"):
        torch.compile(lambda x: x * 2, backend="qwen_npu")(torch.ones(2))


def test_mode_is_refused_with_a_pointer_to_downstream(npu_ops):
    with pytest.raises(Exception, match=r"mode='max-autotune'.*options=\{'downstream'"):
        torch.compile(lambda x: x * 2, backend="qwen_npu", mode="max-autotune")(torch.ones(2))


def test_torchair_reduce_overhead_off_npu_is_a_clear_error(simulated_npu_ops):
    # off-NPU, downstream torchair is the FX->GE conversion check (tests/e2e/test_torchair_offline.py);
    # torchair's ACL-graph mode has no conversion to check
    options = {"downstream": "torchair", "torchair_mode": "reduce-overhead"}
    with pytest.raises(Exception, match=r"torchair_mode 'reduce-overhead' captures an ACL graph on the NPU"):
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
