"""The tested torch and transformers ranges, stated: one warning at import on a release outside them
(qwen_npu_compile.compat), and ``check``'s "ran with" line marks it.

The version strings are mocked (``torch.__version__`` monkeypatched, the distribution metadata's version
monkeypatched, or passed in); two cases import the package in a fresh interpreter whose torch claims 2.16.0 or
whose transformers metadata claims 5.26.0, as a user of a newer release would see it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch

from qwen_npu_compile import compat
from qwen_npu_compile.cli.check.table import print_table
from qwen_npu_compile.compat import (
    TESTED_TORCH,
    TESTED_TRANSFORMERS,
    UntestedTorchWarning,
    UntestedTransformersWarning,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["2.7.1", "2.9.0+cpu", "2.13.0+cpu", "2.14.0+cu130", "2.14.1", "2.14.0a0+git1234",
                                     "2.15.0", "2.15.0+cpu", "2.15.1"])
def test_tested_releases_do_not_warn(version, monkeypatch):
    monkeypatch.setattr(torch, "__version__", version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.untested_torch_message() is None
        assert compat.warn_if_untested_torch() is False


@pytest.mark.parametrize(("version", "side"), [("2.16.0", "newer"), ("2.16.0.dev20261201+cpu", "newer"), ("3.0.0", "newer"),
                                               ("2.7.0", "older"), ("2.6.0+cu124", "older")])
def test_untested_torch_warns_once_in_one_line_naming_the_range(version, side, monkeypatch):
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.warns(UntestedTorchWarning) as caught:
        assert compat.warn_if_untested_torch() is True
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "\n" not in message
    assert message.startswith(f"qwen_npu_compile: torch {version} is {side} than the tested range (torch>=2.7.1,<2.16, "
                              "i.e. 2.7.1 to 2.15.x)")
    assert "pip install 'torch>=2.7.1,<2.16'" in message and "qwen-npu-compile check MODEL" in message


def test_a_version_that_is_no_version_is_a_clear_error():
    with pytest.raises(ValueError, match=r"cannot read a torch version from 'nightly'; expected 'MAJOR.MINOR\[.PATCH\]...'"):
        compat.untested_torch_message("nightly")


@pytest.mark.parametrize("version", ["4.57.6", "5.0.0", "5.10.4", "5.24.0", "5.25.0", "5.25.1", "5.25.0rc1"])
def test_tested_transformers_releases_do_not_warn(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.untested_transformers_message(version) is None
        assert compat.warn_if_untested_transformers(version) is False


@pytest.mark.parametrize(("version", "side"), [("5.26.0", "newer"), ("5.26.0.dev0", "newer"), ("6.0.0", "newer"),
                                               ("4.57.5", "older"), ("4.50.0", "older")])
def test_untested_transformers_warns_once_in_one_line_naming_the_range(version, side):
    with pytest.warns(UntestedTransformersWarning) as caught:
        assert compat.warn_if_untested_transformers(version) is True
    assert len(caught) == 1 and not issubclass(UntestedTransformersWarning, UntestedTorchWarning)
    message = str(caught[0].message)
    assert "\n" not in message
    assert message.startswith(f"qwen_npu_compile: transformers {version} is {side} than the tested range "
                              "(transformers>=4.57.6,<5.26, i.e. 4.57.6 to 5.25.x)")
    assert "pip install 'transformers>=4.57.6,<5.26'" in message and "qwen-npu-compile check MODEL" in message


def test_the_installed_transformers_is_read_from_its_metadata(monkeypatch):
    from importlib import metadata

    assert compat.installed_transformers_version() == metadata.version("transformers")
    monkeypatch.setattr(metadata, "version", lambda name: "5.26.0")
    assert "transformers 5.26.0 is newer" in compat.untested_transformers_message()

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert compat.untested_transformers_message() is None and compat.warn_if_untested_transformers() is False


def test_pyproject_admits_exactly_the_tested_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    dependencies = project["project"]["dependencies"]
    assert [d for d in dependencies if re.match(r"torch\b", d)] == [f"torch{TESTED_TORCH}"]
    assert [d for d in dependencies if re.match(r"transformers\b", d)] == [f"transformers{TESTED_TRANSFORMERS}"]
    # torch_npu: from the lowest tested torch, up to at most the newest (Ascend's releases trail torch's, so its
    # upper bound may be lower); the Gated DeltaNet's trainable Ascend kernel beside it (FLA's triton-ascend
    # backend ships from 0.5.2: ops/qwen_npu/gated_delta_rule_kernels.py)
    npu_pins = project["project"]["optional-dependencies"]["npu"]
    torch_npu = [d for d in npu_pins if re.match(r"torch_npu\b", d)]
    assert len(torch_npu) == 1, npu_pins
    npu_lower, npu_upper = compat._tested_bounds(torch_npu[0].removeprefix("torch_npu"))
    torch_lower, torch_upper = compat._tested_bounds(TESTED_TORCH)
    assert npu_lower == torch_lower and npu_upper <= torch_upper, (torch_npu, TESTED_TORCH)
    assert any(re.match(r"(flash-linear-attention|fla-core)>=0\.5\.2\b", d) for d in npu_pins), npu_pins
    assert any(re.match(r"triton-ascend>=3\.2\.0\b", d) for d in npu_pins), npu_pins


def _check_result(torch_version: str, transformers_version: str) -> dict:
    """The smallest ``run_check`` result ``print_table`` prints (field names of qwen_npu_compile/cli/check/harness.py)."""
    row = {"max_abs": 1e-3, "rel_l2": 1e-3, "bound": 1e-2, "ok": True}
    return {
        "simulated": True, "settings": {"dtype": "fp32", "mode": "train", "attn": "sdpa", "downstream": "aot_eager"},
        "model": {"name": "tiny", "layers": 1, "config": {}},
        "versions": {"torch": torch_version, "transformers": transformers_version, "torch_npu": None, "torchair": None},
        "fusions": {"rms_norm": {"expected": 3, "fused": 3, "already_fused": 0}},
        "parity": {"logits": row, "gradients": row, "metric": "rel l2"}, "backward_ops": {},
        "seconds": {"first_compiled_run": 1.0, "qwen_npu_canonicalize": 0.1, "qwen_npu_fuse": 0.1,
                    "steady_compiled_run": 0.5},
        "refused": [], "problems": [], "verdict": "PASS",
    }


@pytest.mark.parametrize(("torch_version", "transformers_version", "expected"), [
    ("2.13.0+cpu", "5.24.0", "  ran with torch 2.13.0+cpu, transformers 5.24.0, torch_npu none (npu ops simulated)"),
    ("2.15.0", "5.25.0", "  ran with torch 2.15.0, transformers 5.25.0, torch_npu none (npu ops simulated)"),
    ("2.16.0", "5.25.0", "  ran with torch 2.16.0 (untested; tested >=2.7.1,<2.16), transformers 5.25.0, "
                         "torch_npu none (npu ops simulated)"),
    ("2.13.0", "5.26.0.dev0", "  ran with torch 2.13.0, transformers 5.26.0.dev0 (untested; tested >=4.57.6,<5.26), "
                              "torch_npu none (npu ops simulated)"),
])
def test_checks_ran_with_line_marks_an_untested_release(torch_version, transformers_version, expected, capsys):
    print_table(_check_result(torch_version, transformers_version))
    lines = capsys.readouterr().out.splitlines()
    assert expected in lines, lines


@pytest.mark.stack_compat
def test_this_stack_imports_without_the_warning():
    """Every stack of the matrix is inside the tested range: importing the package there warns nothing."""
    done = subprocess.run([sys.executable, "-c", "import qwen_npu_compile"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "UntestedTorchWarning" not in done.stderr and "UntestedTransformersWarning" not in done.stderr


def _import_with(code: str) -> subprocess.CompletedProcess:
    """``code`` (ending in importing the package and printing 'imported') in a fresh interpreter, warnings shown."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONWARNINGS"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "imported"
    return done


def test_import_on_a_newer_torch_prints_one_warning_not_a_traceback():
    done = _import_with("import torch; torch.__version__ = '2.16.0'; import qwen_npu_compile; print('imported')")
    lines = [line for line in done.stderr.splitlines() if "UntestedTorchWarning" in line]
    assert len(lines) == 1, done.stderr
    assert "torch 2.16.0 is newer than the tested range" in lines[0] and "Traceback" not in done.stderr


def test_import_on_a_newer_transformers_prints_one_warning_not_a_traceback():
    done = _import_with("from importlib import metadata; real = metadata.version; "
                        "metadata.version = lambda name: '5.26.0' if name == 'transformers' else real(name); "
                        "import torch, qwen_npu_compile; print('imported')")
    lines = [line for line in done.stderr.splitlines() if "Untested" in line]
    assert len(lines) == 1, done.stderr
    assert "UntestedTransformersWarning: qwen_npu_compile: transformers 5.26.0 is newer than the tested range" in lines[0]
    assert "Traceback" not in done.stderr
