"""verl 0.9.1 on the simulated Ascend host, taking its own NPU branches, with ``QWEN_NPU_COMPILE=1``.

verl's ``is_npu_available`` is true by itself (the stand-in ``torch_npu``), its device is ``npu``,
``FSDPEngineWithLMHead.__init__`` applies verl's real ``npu_patch`` itself (``apply_npu_fsdp_patches``), our hook
is imported by verl (``VERL_USE_EXTERNAL_MODULES=qwen_npu_compile.verl``) and compiles in the engine's
``_build_fsdp_module``; transformers finds its NPU flash-attention functions by itself (no
``simulated_npu_host``). Driven by ``verl_npu_engine_run.py`` in two fresh interpreters (compile on / unset).

verl's whole engine runs there: ``engine.initialize()`` (model build, our hook's compile, FSDP2's
``fully_shard`` moving the CPU-built parameters to ``npu`` by ``param.data = ...``, which the stand-in allows as
torch_npu does with its ``_has_compatible_shallow_copy_type`` kernel, the full state dict loaded through the
process group, optimizer) and one training step as ``BaseEngine.train_batch`` runs it (``forward_backward_batch``
with verl's ``sft_loss`` over two micro-batches, ``optimizer_step``). The process group is verl's
``initialize_global_process_group_ray`` (``cpu:gloo,npu:hccl``: the stand-in's one-rank ``hccl``). Checked:
parameters on ``npu:0`` inside verl's FSDP2 module, per layer and per graph exactly what the layer fuses without
npu_patch (tests/integrations/test_verl_npu_patch.py), no layer unfused, nothing of verl's left in a layer graph, and the
loss and gradients of the unset run (verl's patched model, eagerly, on ``npu``); tiny bf16 Qwen2, Qwen3-MoE,
Qwen3.5, verl's packed micro-batches (``use_remove_padding``) and padded ones.

Needs verl in the interpreter (the verl venv); skipped without it. CI::

    PYTHONPATH=tests/ascend_host/stand_in /work/venv-verl/bin/python -m pytest -q -p no:cacheprovider \\
        tests/ascend_host/test_verl_npu_patch_on_npu.py
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
MODEL_CLASS = {"qwen2": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM"}
CASES = [f"{family}-{kind}" for family in ("qwen2", "qwen3_moe", "qwen3_5") for kind in ("packed", "padded")]
ZERO = dict.fromkeys(FAMILIES, 0)
GRAPHS_PER_LAYER = 2


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
    from qwen_npu_compile.cli.check.models import tiny_qwen2_config
    from tests.helpers.models import tiny_hybrid, tiny_moe

    if family == "qwen2":
        return tiny_qwen2_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    return (tiny_moe("qwen3_moe") if family == "qwen3_moe" else tiny_hybrid("qwen3_5")).config


def without_npu_patch(family: str, kind: str, index: int) -> tuple[dict, dict]:
    """``(fused, already fused)`` of layer ``index`` without npu_patch (tests/integrations/test_verl_npu_patch.py): the
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
        assert run["backend"] == "cpu:gloo,npu:hccl"  # verl's initialize_global_process_group_ray on npu
        assert sorted(run["runs"]) == sorted(CASES)
        for name, case in run["runs"].items():  # verl's whole engine: initialize() and a step, on npu
            family = name.split("-")[0]
            assert (case["param_devices"], case["module_class"]) == (["npu:0"], f"FSDP{MODEL_CLASS[family]}"), name
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
        want = without_npu_patch(family, kind, index)
        assert [r["fallback"] for r in reports if r["fallback"]] == [], name
        if kind == "packed":
            # verl's default: one graph per micro-batch (2 micro-batches of 2 sequences: T = 42, then 22),
            # each fused exactly as without npu_patch
            assert len(reports) == GRAPHS_PER_LAYER, (name, reports)
            graphs = reports
        else:
            # padded micro-batches: transformers' NPU flash attention unpads and re-pads with data-dependent
            # indexing, so an attention layer breaks into 5 graphs (each recompiled per shape); a linear-attention
            # layer stays one graph. The distinct graphs together fuse exactly what the layer fuses.
            graphs = [json.loads(g) for g in sorted({json.dumps(r, sort_keys=True) for r in reports})]
            assert len(graphs) == (5 if want[0]["attention"] or want[1]["attention"] else 1), (name, graphs)
            graphs = [{key: {f: sum(g[key].get(f, 0) for g in graphs) for f in FAMILIES}
                       for key in ("fusions", "already_fused")}]
        for graph in graphs:
            fused = {f: graph["fusions"].get(f, 0) for f in FAMILIES}
            already = {f: graph["already_fused"].get(f, 0) for f in FAMILIES}
            assert (fused, already) == want, (name, fused, already)
    assert len(on["layers"]) == (4 if family == "qwen3_5" else 2)
    assert abs(on["loss"] - unset["loss"]) <= 2e-2 * abs(unset["loss"])
    assert on["grads"].keys() == unset["grads"].keys()
    scale = max(unset["grads"].values())
    worst = max(abs(on["grads"][n] - unset["grads"][n]) / max(unset["grads"][n], 1e-2 * scale) for n in unset["grads"])
    assert worst <= 5e-2, worst
