"""The ``qwen-npu-compile check`` command on small local models."""

import json
import shutil
import subprocess
import sys

import pytest

from qwen_npu_compile import cli
from qwen_npu_compile.cli.check import harness, memory, models, presets
from qwen_npu_compile.cli.check.models import tiny_qwen2_config


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
    assert cli.main(["check", "qwen2.5-05b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qwen-npu-compile: error:") and err.count("\n") == 1 and len(err) < 200, err
    assert "did you mean qwen2.5-0.5b," in err and "qwen-npu-compile presets" in err


#: In a fresh interpreter: each refusal's exit status and first stderr line, and whether torch was imported.
_NO_TORCH = """
import contextlib, io, json, sys
from qwen_npu_compile import cli
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli.main(argv)
    out.append([status, err.getvalue()])
print(json.dumps({"results": out, "torch": "torch" in sys.modules}))
"""


def test_typos_hub_ids_and_default_configs_are_refused_without_torch(tmp_path):
    """A preset typo, a hub id and a config.json that leaves the architecture to transformers' defaults: one line
    each, exit status 2, and torch never imported (the answer comes at once, not after torch's import)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    multimodal = tmp_path / "vl"
    multimodal.mkdir()
    (multimodal / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 8}}))
    argvs = [["check", "qwen3.5-08b"], ["check", "Qwen/Qwen2.5-0.5B-Instruct"], ["check", str(tmp_path)],
             ["check", str(multimodal)], ["check", "./no/such/folder"]]
    done = subprocess.run([sys.executable, "-c", _NO_TORCH, json.dumps(argvs)], capture_output=True, text=True,
                          timeout=120, check=True)
    data = json.loads(done.stdout)
    assert data["torch"] is False
    (typo, hub, default, vl, missing) = data["results"]
    assert all(status == 2 and err.count("\n") == 1 for status, err in data["results"]), data
    assert "did you mean qwen3.5-0.8b," in typo[1] and "(list: qwen-npu-compile presets)" in typo[1]
    assert ("hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir Qwen2.5-0.5B-Instruct" in hub[1]
            and "preset of its shapes: qwen2.5-0.5b" in hub[1]), hub
    assert (f"{tmp_path / 'config.json'} leaves hidden_size, num_hidden_layers, num_attention_heads, "
            "intermediate_size, vocab_size to transformers' defaults") in default[1]
    assert "(text_config) leaves intermediate_size, vocab_size to transformers' defaults" in vl[1]
    assert "no such folder: './no/such/folder'" in missing[1]


def test_version_presets_and_python_dash_m(capsys):
    done = subprocess.run([sys.executable, "-m", "qwen_npu_compile", "--version"], capture_output=True, text=True,
                          timeout=120)
    from qwen_npu_compile import __version__

    assert (done.returncode, done.stdout.strip()) == (0, f"qwen-npu-compile {__version__}")
    assert cli.main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(presets.PRESETS)
    assert any(line.startswith("qwen3.5-0.8b") and "qwen3_5_text" in line and "24 layers, hidden 1024" in line
               for line in lines)


def test_transformers_kernel_fallback_warnings_become_one_note(capsys):
    """The eager Qwen3.5 / Qwen3-Next reference on a host without CUDA makes transformers warn once per missing
    package (causal_conv1d, flash-linear-attention; older versions: "The fast path is not available"); check
    prints one line of its own instead and lets every other warning through."""
    import logging

    from transformers.utils import logging as hf_logging

    logger = hf_logging.get_logger("transformers.integrations.hub_kernels")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    hf_logging.get_logger("transformers").addHandler(handler)  # what the user's terminal would show
    try:
        with cli.explained_kernel_fallbacks():
            for package in ("causal_conv1d", "flash-linear-attention"):
                logger.warning(f"`f` is falling back to its reference PyTorch implementation because `{package}` is "
                               f"not installed. This is correct but much slower; install `{package}` for the kernel.")
            logger.warning("The fast path is not available because one of the required library is not installed.")
            logger.warning("`chunk_gated_delta_rule` is falling back to its reference PyTorch implementation because "
                           "`flash-linear-attention` is either not installed or doesn't support the device of the "
                           "inputs. This is correct but much slower.")  # transformers 5.25's wording
            logger.warning("another warning")
        assert capsys.readouterr().err.count(cli.KERNEL_FALLBACK_NOTE) == 1
        assert seen == ["another warning"]
        logger.warning("The fast path is not available because one of the required library is not installed.")
        assert len(seen) == 2  # the filter is gone after the check
    finally:
        hf_logging.get_logger("transformers").removeHandler(handler)


def test_the_delta_rules_backward_op_is_expected_once_per_fusion():
    from qwen_npu_compile.patterns import FAMILIES

    assert FAMILIES["gated_delta_rule"].backward_op_counts(3) == {"qwen_npu.chunk_gated_delta_rule_backward": 3}


def test_memory_refusal_suggests_layers(monkeypatch, capsys):
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 8 * 2**30)
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
