"""The tested torch range, stated: one warning at import on a torch outside it (qwen_npu_compile.compat).

The version strings are mocked (``torch.__version__`` monkeypatched, or passed in); one case imports the package
in a fresh interpreter whose torch claims 2.15.0, as a user of a newer torch would see it.
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
from qwen_npu_compile.compat import TESTED_TORCH, UntestedTorchWarning

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["2.7.1", "2.9.0+cpu", "2.13.0+cpu", "2.14.0+cu130", "2.14.1", "2.14.0a0+git1234"])
def test_tested_releases_do_not_warn(version, monkeypatch):
    monkeypatch.setattr(torch, "__version__", version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.untested_torch_message() is None
        assert compat.warn_if_untested_torch() is False


@pytest.mark.parametrize(("version", "side"), [("2.15.0", "newer"), ("2.15.0.dev20261201+cpu", "newer"), ("3.0.0", "newer"),
                                               ("2.7.0", "older"), ("2.6.0+cu124", "older")])
def test_untested_torch_warns_once_in_one_line_naming_the_range(version, side, monkeypatch):
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.warns(UntestedTorchWarning) as caught:
        assert compat.warn_if_untested_torch() is True
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "\n" not in message
    assert message.startswith(f"qwen_npu_compile: torch {version} is {side} than the tested range (torch>=2.7.1,<2.15, "
                              "i.e. 2.7.1 to 2.14.x)")
    assert "pip install 'torch>=2.7.1,<2.15'" in message and "qwen-npu-compile check MODEL" in message


def test_a_version_that_is_no_version_is_a_clear_error():
    with pytest.raises(ValueError, match=r"cannot read a torch version from 'nightly'; expected 'MAJOR.MINOR\[.PATCH\]...'"):
        compat.untested_torch_message("nightly")


def test_pyproject_admits_exactly_the_tested_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    torch_pins = [d for d in project["project"]["dependencies"] if re.match(r"torch\b", d)]
    npu_pins = project["project"]["optional-dependencies"]["npu"]
    assert torch_pins == [f"torch{TESTED_TORCH}"]
    # torch_npu in the tested range; the Gated DeltaNet's trainable Ascend kernel beside it (FLA's triton-ascend
    # backend ships from 0.5.2: npu_ops/gated_delta_rule_kernels.py)
    assert [d for d in npu_pins if re.match(r"torch_npu\b", d)] == [f"torch_npu{TESTED_TORCH}"]
    assert sorted(d for d in npu_pins if not re.match(r"torch_npu\b", d)) == ["flash-linear-attention>=0.5.2",
                                                                             "triton-ascend>=3.2.0"]


@pytest.mark.stack_compat
def test_this_stack_imports_without_the_warning():
    """Every stack of the matrix is inside the tested range: importing the package there warns nothing."""
    done = subprocess.run([sys.executable, "-c", "import qwen_npu_compile"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "UntestedTorchWarning" not in done.stderr


def test_import_on_a_newer_torch_prints_one_warning_not_a_traceback():
    code = "import torch; torch.__version__ = '2.15.0'; import qwen_npu_compile; print('imported')"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONWARNINGS"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "imported"
    lines = [line for line in done.stderr.splitlines() if "UntestedTorchWarning" in line]
    assert len(lines) == 1, done.stderr
    assert "torch 2.15.0 is newer than the tested range" in lines[0] and "Traceback" not in done.stderr
