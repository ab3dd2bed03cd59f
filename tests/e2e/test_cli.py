"""The ``qwen-npu-compile check`` command on small local models."""

import json
import shutil
import subprocess

import pytest
import torch

from qwen_npu_compile import cli
from qwen_npu_compile.check import harness, models
from qwen_npu_compile.check.models import tiny_qwen2_config


@pytest.fixture
def tiny_model_dir(tmp_path):
    folder = tmp_path / "tiny-qwen2"
    tiny_qwen2_config().save_pretrained(folder)
    return folder


def test_check_passes_on_a_local_config_and_writes_json(npu_ops, tiny_model_dir, tmp_path, capsys):
    out_json = tmp_path / "result.json"
    status = cli.main(["check", str(tiny_model_dir), "--seq-len", "16", "--batch", "2", "--fusions", "rms_norm,swiglu",
                       "--json", str(out_json), "--dump-dir", str(tmp_path / "dump")])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "[1/6] building" in printed and "verdict: PASS" in printed
    result = json.loads(out_json.read_text())
    assert result["simulated"] is True
    assert result["fusions"]["rms_norm"] == {"fused": 5, "already_fused": 0, "expected": 5}
    assert result["fusions"]["swiglu"] == {"fused": 2, "already_fused": 0, "expected": 2}
    assert result["backward_ops"] == {"npu_rms_norm_backward": 5, "npu_swiglu_backward": 2}
    assert result["parity"]["gradients"]["ok"] and result["parity"]["logits"]["ok"]
    assert (tmp_path / "dump" / "summary.json").exists()


def test_check_vocab_size_override_is_named_and_recorded(npu_ops, tiny_model_dir, tmp_path, capsys):
    out_json = tmp_path / "result.json"
    status = cli.main(["check", str(tiny_model_dir), "--seq-len", "8", "--dtype", "fp32", "--mode", "infer",
                       "--vocab-size", "40", "--json", str(out_json)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "(2 layers, vocab 40)" in printed
    result = json.loads(out_json.read_text())
    assert result["settings"]["vocab_size"] == 40 and result["settings"]["vocab_override"] is True
    assert result["model"]["config"]["vocab_size"] == 40
    assert result["fusions"]["rms_norm"]["fused"] == 5


def test_check_fp32_infer(npu_ops, tiny_model_dir, capsys):
    status = cli.main(["check", str(tiny_model_dir), "--dtype", "fp32", "--mode", "infer", "--attn", "eager",
                       "--fusions", "rms_norm,swiglu"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "[1/5] building" in printed  # no fp32 reference stage in fp32


def test_missing_fusion_fails_the_verdict(npu_ops, tiny_model_dir, capsys, monkeypatch):
    from qwen_npu_compile.patterns import get_family_pass

    monkeypatch.setattr(get_family_pass("swiglu"), "apply", lambda gm, recorder: 0)
    status = cli.main(["check", str(tiny_model_dir), "--mode", "infer", "--fusions", "rms_norm,swiglu"])
    printed = capsys.readouterr().out
    assert status == 1
    assert "problem: swiglu: fused 0 (+0 already fused), expected 2" in printed and "verdict: FAIL" in printed


def test_unknown_model_is_a_one_line_error(capsys):
    assert cli.main(["check", "qwen9-1b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qwen-npu-compile: error:") and "qwen2.5-0.5b" in err


def test_memory_refusal_suggests_layers(monkeypatch, capsys):
    monkeypatch.setattr(models, "available_memory_bytes", lambda: 8 * 2**30)
    assert cli.main(["check", "qwen2.5-72b"]) == 2
    err = capsys.readouterr().err
    assert "GiB needed" in err and "try --layers" in err


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as info:
        cli.main(["check", "qwen2.5-0.5b", "--dtype", "int8"])
    assert info.value.code == 2


def test_expected_counts_follow_the_config():
    assert harness.expected_fusions(models.resolve_model_config("qwen2.5-0.5b"), {"rms_norm", "swiglu", "rotary", "attention"}) == {
        "rms_norm": 49, "swiglu": 24, "rotary": 48, "attention": 24}


def test_console_script_is_installed():
    exe = shutil.which("qwen-npu-compile")
    assert exe is not None
    out = subprocess.run([exe, "check", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--layers" in out.stdout and "--json" in out.stdout


def test_backend_settings_are_validated_before_building(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("QWEN_NPU_TORCHAIR_MODE", "reduce-overhead")
    assert cli.main(["check", "qwen2.5-0.5b", "--downstream", "torchair"]) == 2
    assert "captures an ACL graph" in capsys.readouterr().err
    monkeypatch.delenv("QWEN_NPU_TORCHAIR_MODE")
    monkeypatch.setenv("QWEN_NPU_STRICT", "maybe")
    assert cli.main(["check", "qwen2.5-0.5b"]) == 2
    assert "QWEN_NPU_STRICT = 'maybe' is not a boolean" in capsys.readouterr().err
    monkeypatch.delenv("QWEN_NPU_STRICT")
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    assert cli.main(["check", "qwen2.5-0.5b", "--dump-dir", str(not_a_folder)]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_fusions_default_comes_from_the_environment(npu_ops, tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("QWEN_NPU_FUSIONS", "bogus")
    assert cli.main(["check", str(tiny_model_dir)]) == 2
    assert "unknown fusion family ['bogus']" in capsys.readouterr().err
    monkeypatch.setenv("QWEN_NPU_FUSIONS", "rms_norm")
    assert cli.main(["check", str(tiny_model_dir), "--mode", "infer", "--dtype", "fp32"]) == 0
    printed = capsys.readouterr().out
    assert "rms_norm           5         5  ok" in printed and "swiglu" not in printed.split("verdict")[0].split("family")[1].split("parity")[0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_check_with_left_padding_and_dynamic_length(npu_ops, tiny_model_dir, tmp_path, attn, capsys):
    """--left-padding: the mask and -100 labels reach the model; real-token logits and gradients match eager."""
    out = tmp_path / "padded.json"
    status = cli.main(["check", str(tiny_model_dir), "--dtype", "fp32", "--attn", attn, "--seq-len", "12",
                       "--batch", "2", "--left-padding", "3", "--dynamic", "--json", str(out)])
    result = json.loads(out.read_text())
    assert status == 0, result["problems"]
    assert result["settings"]["left_padding"] == 3 and result["settings"]["dynamic"] is True
    assert {f: row["fused"] for f, row in result["fusions"].items()} == {"gated_delta_rule": 0, "rms_norm_gated": 0, "moe": 0, "rms_norm": 5, "swiglu": 2, "rotary": 4, "attention": 2}
    assert result["parity"]["logits"]["ok"] and result["parity"]["gradients"]["ok"]


@pytest.mark.parametrize("padding", ["-1", "12"])
def test_left_padding_must_leave_a_real_token(padding, capsys):
    assert cli.main(["check", "qwen2.5-0.5b", "--seq-len", "12", "--left-padding", padding]) == 2
    assert "--left-padding must be >= 0 and below --seq-len 12" in capsys.readouterr().err
