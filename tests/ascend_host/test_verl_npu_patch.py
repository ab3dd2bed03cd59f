"""verl 0.9.1 on the simulated Ascend host, taking its own NPU branches, with ``QWEN_NPU_COMPILE=1`` (issue 36).

verl's ``is_npu_available`` is true by itself (the stand-in ``torch_npu``), its device is ``npu``,
``FSDPEngineWithLMHead.__init__`` applies verl's real ``npu_patch`` itself (``apply_npu_fsdp_patches``), our hook
is imported by verl (``VERL_USE_EXTERNAL_MODULES=qwen_npu_compile.verl``) and compiles in the engine's
``_build_fsdp_module``; transformers finds its NPU flash-attention functions by itself (no
``simulated_npu_host``). Driven by ``verl_npu_engine_run.py`` in two fresh interpreters (compile on / unset).

verl's whole engine stops in FSDP2's ``fully_shard`` here (:data:`FSDP_STOP`: moving a CPU-built parameter to
``npu`` assigns ``param.data`` across tensor types, which the stand-in refuses); the driver then runs the
engine's pieces as far as they go (``_build_module``, the hooked ``_build_fsdp_module``'s compile) and trains
the compiled model on ``npu`` one step. Checked: per layer, exactly what the layer fuses without npu_patch
(tests/e2e/test_verl_npu_patch.py), no layer unfused, nothing of verl's left in a layer graph, and the losses and
gradients of the unset run (verl's patched model, eagerly, on ``npu``); tiny bf16 Qwen2, Qwen3-MoE, Qwen3.5,
verl's packed row and a padded batch.

Needs verl in the interpreter (the verl venv); skipped without it. CI::

    PYTHONPATH=tests/ascend_host/stand_in /work/venv-verl/bin/python -m pytest -q -p no:cacheprovider \\
        tests/ascend_host/test_verl_npu_patch.py
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed here (run in the verl venv: tools/verl_env_check.sh)", allow_module_level=True)

import sim  # noqa: E402
from qwen_npu_compile.patterns import FAMILIES, expected_fusions  # noqa: E402

DRIVER = sim.HERE / "verl_npu_engine_run.py"
FSDP_STOP = "RuntimeError: Attempted to call `variable.set_data(tensor)`, but `variable` and `tensor` have incompatible"
CASES = [f"{family}-{kind}" for family in ("qwen2", "qwen3_moe", "qwen3_5") for kind in ("packed", "padded")]
ZERO = dict.fromkeys(FAMILIES, 0)


def _start(tmp_path, name: str, **env):
    out = tmp_path / f"{name}.json"
    base = sim.subprocess_env(VERL_USE_EXTERNAL_MODULES="qwen_npu_compile.verl", QWEN_NPU_DOWNSTREAM="aot_eager", **env)
    base = {k: v for k, v in base.items() if k not in ("QWEN_NPU_COMPILE", "QWEN_NPU_FUSIONS") or k in env}
    proc = subprocess.Popen([sys.executable, str(DRIVER), str(out)], env=base, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    return proc, out


def _finish(started) -> dict:
    proc, out = started
    output, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, output[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The two runs, side by side (each imports verl and builds three models: most of the time is imports)."""
    tmp = tmp_path_factory.mktemp("verl_npu")
    on, unset = _start(tmp, "on", QWEN_NPU_COMPILE="1"), _start(tmp, "unset")
    return _finish(on), _finish(unset)


def _config(family: str):
    sys.path.insert(0, str(sim.HERE.parent))
    from conftest import tiny_hybrid, tiny_moe

    from qwen_npu_compile.check.models import tiny_qwen2_config

    if family == "qwen2":
        return tiny_qwen2_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    return (tiny_moe("qwen3_moe") if family == "qwen3_moe" else tiny_hybrid("qwen3_5")).config


def without_npu_patch(family: str, kind: str, index: int) -> tuple[dict, dict]:
    """``(fused, already fused)`` of layer ``index`` without npu_patch (tests/e2e/test_verl_npu_patch.py): the
    declared per-layer counts; padded, transformers' own ``npu_fusion_attention`` call is already fused."""
    config = _config(family)
    types = getattr(config, "layer_types", None)
    declared = {**ZERO, **expected_fusions(config, per_layer=True, layer_type=types[index] if types else None)}
    if kind == "packed" or declared["attention"] == 0:
        return declared, dict(ZERO)
    return {**declared, "attention": 0}, {**ZERO, "attention": declared["attention"]}


def test_verl_takes_its_npu_branches(runs):
    for run in runs:
        assert (run["verl"], run["is_npu_available"], run["device_name"], run["hook_imported_by_verl"]) == (
            "0.9.1", True, "npu", True)
        for name, case in run["runs"].items():
            assert case["initialize_error"] in (None,) or case["initialize_error"].startswith(FSDP_STOP), (name, case)
            assert case["param_device"] == "npu:0"
    on, unset = runs
    assert len(on["npu_patch_lines"]) == len(CASES)  # one per apply_npu_patches: one FSDPEngine.__init__ per case
    assert len(set(on["npu_patch_lines"])) == 1
    line = on["npu_patch_lines"][0]
    assert "qwen2: " in line and "Qwen2RMSNorm.forward (rms_norm)" in line and "stays verl's: " in line
    assert unset["npu_patch_lines"] == [] and unset["qwen2_rms_norm_forward"] == "rms_norm_forward_npu"


@pytest.mark.parametrize("case", CASES)
def test_layers_fuse_as_without_npu_patch_with_parity(runs, case):
    on, unset = (run["runs"][case] for run in runs)
    family, kind = case.split("-")
    assert unset["layers"] == {}  # the unset run compiles nothing: verl's patched model, eagerly
    for index, (name, reports) in enumerate(on["layers"].items()):
        fused = {f: sum(r["fusions"].get(f, 0) for r in reports) for f in FAMILIES}
        already = {f: sum(r["already_fused"].get(f, 0) for r in reports) for f in FAMILIES}
        assert [r["fallback"] for r in reports if r["fallback"]] == [], name
        assert (fused, already) == without_npu_patch(family, kind, index), (name, fused, already)
    assert len(on["layers"]) == (4 if family == "qwen3_5" else 2)
    assert abs(on["loss"] - unset["loss"]) <= 2e-2 * abs(unset["loss"])
    assert on["grads"].keys() == unset["grads"].keys()
    scale = max(unset["grads"].values())
    worst = max(abs(on["grads"][n] - unset["grads"][n]) / max(unset["grads"][n], 1e-2 * scale) for n in unset["grads"])
    assert worst <= 5e-2, worst
