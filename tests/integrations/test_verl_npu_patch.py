"""verl's ``npu_patch`` and ``QWEN_NPU_COMPILE=1``: verl's own patch functions run, and our fusions are not
pre-empted (:mod:`qwen_npu_compile.integrations.verl_npu_patch`).

On an Ascend host ``FSDPEngine.__init__`` runs verl 0.9.1's ``npu_patch.apply_npu_patches`` before our hook
compiles. Here verl's real module is imported with a throwaway ``torch_npu`` whose functions are our
``torch.ops.npu`` stand-ins (:func:`tests.helpers.verl_npu_patch.stand_in_torch_npu`), the hook is installed as
``VERL_USE_EXTERNAL_MODULES=qwen_npu_compile.verl`` installs it (:func:`qwen_npu_compile.verl.install`: a
post-import hook on ``npu_patch``), and verl's ``apply_npu_patches`` patches every model class it knows, as
``apply_npu_fsdp_patches`` does. Then tiny bf16 Qwen2, Qwen3-MoE and Qwen3.5 models (transformers' own
``flash_attention_2``, which takes its NPU path with our stand-ins: packed rows as verl's
``use_remove_padding`` feeds them, TND varlen; padded batches with a mask) are compiled per layer
(``maybe_compile``) and trained one step:

* each layer graph fuses exactly what the same layer fuses without ``npu_patch`` (packed: the families'
  declared per-layer counts, which tests/substitutions/test_packed_layers.py, test_moe_layers.py and
  test_hybrid_models.py pin without any patch), no layer compiles unfused, ``already_fused`` is empty (nothing
  of verl's stays in a layer graph) -- and without the takeover verl's patches pre-empt them (the contrast);
* losses and gradients match the unset run (``QWEN_NPU_COMPILE`` unset: verl's patched model, eagerly);
* eager code (the final norm) keeps verl's fused op; a family switched off by ``QWEN_NPU_FUSIONS`` stays verl's;
* one INFO line names what was taken over and what stays verl's.

Runs in the verl venv (``tools/verl_env_check.sh``); skipped without verl.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys

import pytest
import torch

pytest.importorskip("verl")

import transformers  # noqa: E402

import qwen_npu_compile.verl as hook  # noqa: E402
from qwen_npu_compile import ensure_npu_ops, maybe_compile  # noqa: E402
from qwen_npu_compile.cli.check.harness import fp32_reference, run_model  # noqa: E402
from qwen_npu_compile.cli.check.models import tiny_qwen2  # noqa: E402
from qwen_npu_compile.integrations import verl_npu_patch  # noqa: E402
from qwen_npu_compile.patterns import FAMILIES, expected_fusions  # noqa: E402
from qwen_npu_compile.worker import ENV_COMPILE  # noqa: E402
from tests.helpers.models import tiny_hybrid, tiny_moe  # noqa: E402
from tests.helpers.npu_host import simulated_npu_host  # noqa: E402
from tests.helpers.numerics import assert_runs_match  # noqa: E402
from tests.helpers.verl_npu_patch import HISTC, NPU_PATCH, histc_any_dtype, stand_in_torch_npu  # noqa: E402

ZERO = dict.fromkeys(FAMILIES, 0)


def _modeling_modules() -> list:
    modules = []
    for key in ("qwen2", "qwen2_5_vl", "qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe", "qwen3_next", "qwen3_5",
                "qwen3_5_moe"):
        with contextlib.suppress(ImportError):
            modules.append(importlib.import_module(f"transformers.models.{key}.modeling_{key}"))
    return modules


@contextlib.contextmanager
def verl_npu_patches(compile_on: bool):
    """verl's real ``npu_patch.apply_npu_patches()`` (every model it knows), imported after our hook was
    installed (``compile_on``: as with ``QWEN_NPU_COMPILE=1``) or not; every transformers name restored on exit."""
    if not ensure_npu_ops().simulated:
        pytest.skip("real torch_npu present: verl's npu_patch runs on it as is")
    import verl.models.transformers  # noqa: F401

    saved = [(module, dict(vars(module)), {name: dict(vars(cls)) for name, cls in vars(module).items()
                                           if isinstance(cls, type) and cls.__module__ == module.__name__})
             for module in _modeling_modules()]
    sys.modules.pop(NPU_PATCH, None)
    pending = dict(hook._after_import.actions)
    if compile_on:
        assert hook.install({ENV_COMPILE: "1"})  # the post-import hook on npu_patch (and verl's engine package)
    sys.modules["torch_npu"] = stand_in_torch_npu()
    try:
        npu_patch = importlib.import_module(NPU_PATCH)
    finally:
        del sys.modules["torch_npu"]
    torch.histc = histc_any_dtype
    try:
        npu_patch.apply_npu_patches()  # what apply_npu_fsdp_patches runs on an Ascend host
        yield npu_patch
    finally:
        for module, names, classes in saved:
            for name, attributes in classes.items():
                for attribute, value in attributes.items():
                    if names[name].__dict__.get(attribute) is not value:
                        setattr(names[name], attribute, value)
            for name, value in names.items():
                if vars(module).get(name) is not value:
                    setattr(module, name, value)
        torch.histc = HISTC
        sys.modules.pop(NPU_PATCH, None)
        for name in set(hook._after_import.actions) - set(pending):  # install()'s engine hook, never imported here
            hook._after_import.actions.pop(name)


# ----------------------------------------------------------------------------------------------------
# models and inputs

QWEN2 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)  # head_dim 64


def build(family: str):
    if family == "qwen2":
        return tiny_qwen2(torch.bfloat16, "flash_attention_2", **QWEN2).train()
    if family == "qwen3_moe":
        return tiny_moe("qwen3_moe", torch.bfloat16, "flash_attention_2").train()
    return tiny_hybrid("qwen3_5", torch.bfloat16, "flash_attention_2").train()


def inputs(kind: str) -> dict:
    """verl's packed row (``use_remove_padding``: ``(1, T)``, positions restarting per sequence, no mask) or a
    padded batch of two rows (``use_remove_padding=False``: the mask)."""
    generator = torch.Generator().manual_seed(0)
    if kind == "packed":
        lengths = [13, 29, 6, 16]
        ids = torch.randint(0, 128, (1, sum(lengths)), generator=generator)
        return {"input_ids": ids, "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)}
    ids = torch.randint(0, 128, (2, 16), generator=generator)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def step(model, batch: dict):
    batch = dict(batch)
    return run_model(model, model, batch.pop("input_ids"), True, **batch)


def per_layer(layers) -> dict[str, tuple[dict, dict, list]]:
    """Per compiled layer: fusions and already-fused ops summed over its graphs, and the graphs' fallbacks."""
    out = {}
    for name, record in layers.records.items():
        fused, already = dict(ZERO), dict(ZERO)
        for report in record.reports:
            for family in FAMILIES:
                fused[family] += report.fusions.get(family, 0)
                already[family] += report.already_fused.get(family, 0)
        out[name] = (fused, already, [report.fallback_stage for report in record.reports if report.fallback])
    return out


def without_npu_patch(family: str, kind: str, layer: int) -> tuple[dict, dict]:
    """What layer ``layer`` fuses without verl's npu_patch: ``(fused, already fused)``.

    Packed: the families' declared per-layer counts (pinned without any patch by test_packed_layers.py,
    test_moe_layers.py, test_hybrid_models.py). Padded: transformers' NPU flash attention with a mask breaks a
    layer into 13 graphs (unpad and pad around ``npu_fusion_attention``, which transformers calls itself:
    already fused); the other families fuse their declared counts across those graphs (measured without
    npu_patch, tools: this file's ``test_padded_counts_equal_the_run_without_npu_patch``).
    """
    config = build_config(family)
    layer_type = getattr(config, "layer_types", None)
    declared = {**ZERO, **expected_fusions(config, per_layer=True,
                                           layer_type=layer_type[layer] if layer_type else None)}
    if kind == "packed" or declared["attention"] == 0:
        return declared, dict(ZERO)
    return {**declared, "attention": 0}, {**ZERO, "attention": declared["attention"]}


def build_config(family: str):
    if family == "qwen2":
        from qwen_npu_compile.cli.check.models import tiny_qwen2_config

        return tiny_qwen2_config(**QWEN2)
    if family == "qwen3_moe":
        return tiny_moe("qwen3_moe").config
    return tiny_hybrid("qwen3_5").config


# ----------------------------------------------------------------------------------------------------
# the tests


def test_one_info_line_names_what_is_taken_over_and_what_stays_verls(compile_on, caplog):
    """verl's patch functions all ran (verl's names are set), then the names our families fuse became
    dispatchers; one INFO line says which, and what stays verl's; a second apply (the reference engine's
    ``FSDPEngine.__init__``) gives the same dispatcher objects (Dynamo's guards on them hold)."""
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_moe import modeling_qwen3_moe
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    with caplog.at_level(logging.INFO, logger="qwen_npu_compile"), verl_npu_patches(True) as npu_patch:
        lines = [r.getMessage() for r in caplog.records if "npu_patch kept from the compiled" in r.getMessage()]
        assert len(lines) == 1, lines
        record = verl_npu_patch.last
        taken = {(model, label): family for model, label, family in record.taken}
        assert {k: v for k, v in taken.items() if k[0] in ("qwen2", "qwen3_moe", "qwen3_5")} == {
            ("qwen2", "Qwen2RMSNorm.forward"): "rms_norm", ("qwen2", "Qwen2MLP.forward"): "swiglu",
            ("qwen2", "apply_rotary_pos_emb"): "rotary",
            ("qwen3_moe", "Qwen3MoeRMSNorm.forward"): "rms_norm",
            ("qwen3_moe", "Qwen3MoeSparseMoeBlock.forward"): "moe",
            ("qwen3_moe", "apply_rotary_pos_emb"): "rotary",
            ("qwen3_5", "Qwen3_5RMSNormGated.forward"): "rms_norm_gated",
            ("qwen3_5", "Qwen3_5RMSNorm.forward"): "rms_norm", ("qwen3_5", "apply_rotary_pos_emb"): "rotary"}
        assert ("qwen3_vl", "Qwen3VLTextMLP.forward") in record.verls and record.off == []
        assert taken[("qwen3_next", "Qwen3NextSparseMoeBlock.forward")] == "moe"
        assert "stays verl's: " in lines[0] and "Qwen3VLTextMLP.forward" in lines[0].split("stays verl's: ")[1]
        assert "Qwen2MLP.forward (swiglu)" in lines[0].split(" | ")[0]
        # taken over: a dispatcher over transformers' function and verl's; stays verl's: verl's function
        original, verls = getattr(modeling_qwen2.Qwen2MLP.forward, verl_npu_patch._MARK)
        assert verls is npu_patch.silu_forward_npu and original.__module__ == modeling_qwen2.__name__
        assert getattr(modeling_qwen3_moe.Qwen3MoeSparseMoeBlock.forward, verl_npu_patch._MARK)[1] is (
            npu_patch.qwen3_moe_sparse_moe_block_forward_npu)
        assert getattr(modeling_qwen3_5.Qwen3_5RMSNormGated.forward, verl_npu_patch._MARK)[1] is (
            npu_patch.qwen3_next_rms_norm_forward_gated_npu)
        assert modeling_qwen3_vl.Qwen3VLTextMLP.forward is npu_patch.silu_forward_npu
        dispatchers = (modeling_qwen2.Qwen2MLP.forward, modeling_qwen2.apply_rotary_pos_emb)
        npu_patch.apply_npu_patches()
        assert (modeling_qwen2.Qwen2MLP.forward, modeling_qwen2.apply_rotary_pos_emb) == dispatchers
        assert modeling_qwen2.Qwen2MLP.forward is dispatchers[0]


def test_unset_leaves_verls_patches_as_they_are(monkeypatch, caplog):
    """``QWEN_NPU_COMPILE`` unset when verl applies its patches: verl's functions, no line."""
    from transformers.models.qwen2 import modeling_qwen2

    monkeypatch.delenv(ENV_COMPILE, raising=False)
    with caplog.at_level(logging.INFO, logger="qwen_npu_compile"), verl_npu_patches(True) as npu_patch:
        assert modeling_qwen2.Qwen2RMSNorm.forward is npu_patch.rms_norm_forward_npu
        assert modeling_qwen2.apply_rotary_pos_emb is npu_patch.apply_rotary_pos_emb_npu
        assert not [r for r in caplog.records if "npu_patch kept" in r.getMessage()]


CASES = [(family, kind) for family in ("qwen2", "qwen3_moe", "qwen3_5") for kind in ("packed", "padded")]


@pytest.mark.parametrize(("family", "kind"), CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_layers_fuse_what_they_fuse_without_npu_patch_with_parity(compile_on, monkeypatch, family, kind):
    """Under verl's own patching: each layer fuses exactly what it fuses without npu_patch, no layer compiles
    unfused, nothing of verl's stays in a layer graph (``already_fused`` empty but transformers' own NPU
    attention when padded), and the step matches the unset run (verl's patched model, eagerly), logits and
    every gradient, against an fp32 yardstick."""
    batch = inputs(kind)
    with simulated_npu_host(), verl_npu_patches(True):
        model, reference = build(family), build(family)
        layers = maybe_compile(model, {})
        compiled = step(model, batch)
        monkeypatch.delenv(ENV_COMPILE)  # the unset run: verl's patched functions, eagerly
        eager = step(reference, batch)
        assert_runs_match(compiled, eager, fp32_reference(reference, **batch, train=True))
    got = per_layer(layers)
    assert len(got) == len(layers) == model.config.num_hidden_layers
    for index, (name, (fused, already, fallbacks)) in enumerate(got.items()):
        assert fallbacks == [], (name, fallbacks)
        assert (fused, already) == without_npu_patch(family, kind, index), (name, fused, already)


def test_without_the_takeover_verls_patches_pre_empt_the_families(compile_on):
    """The contrast (why the takeover exists): verl's patches applied with no hook installed, a Qwen2 layer fuses
    attention only, the rest is verl's (already fused)."""
    with simulated_npu_host(), verl_npu_patches(False):
        model = build("qwen2")
        layers = maybe_compile(model, {})
        step(model, inputs("packed"))
    for fused, already, fallbacks in per_layer(layers).values():
        assert fused == {**ZERO, "attention": 1} and already == {**ZERO, "rms_norm": 2, "swiglu": 1, "rotary": 2}


def test_eager_code_keeps_verls_fused_op(compile_on):
    """Outside a Dynamo capture the dispatcher calls verl's function: the final norm runs ``npu_rms_norm``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with simulated_npu_host(), verl_npu_patches(True):
        model = build("qwen2")
        with Ops() as ops, torch.no_grad():
            model.model.norm(torch.randn(1, 4, QWEN2["hidden_size"], dtype=torch.bfloat16))
    assert ops.seen.count("npu.npu_rms_norm.default") == 1, ops.seen


def test_a_family_switched_off_stays_verls(compile_on, monkeypatch, caplog):
    """``QWEN_NPU_FUSIONS`` without swiglu: verl's ``Qwen2MLP.forward`` stays (its ``npu_swiglu(cat)`` runs in the
    layer graph, better than nothing), the others are fused by qwen_npu; the INFO line says so."""
    from transformers.models.qwen2 import modeling_qwen2

    monkeypatch.setenv("QWEN_NPU_FUSIONS", "rms_norm,rotary,attention")
    with caplog.at_level(logging.INFO, logger="qwen_npu_compile"), simulated_npu_host(), \
            verl_npu_patches(True) as npu_patch:
        assert modeling_qwen2.Qwen2MLP.forward is npu_patch.silu_forward_npu
        model = build("qwen2")
        layers = maybe_compile(model, {})
        step(model, inputs("packed"))
    assert ("qwen2", "Qwen2MLP.forward", "swiglu") in verl_npu_patch.last.off
    (line,) = [r.getMessage() for r in caplog.records if "npu_patch kept" in r.getMessage()]
    assert "switched off by QWEN_NPU_FUSIONS: qwen2: Qwen2MLP.forward (swiglu)" in line
    for name, record in layers.records.items():
        (report,) = record.reports
        assert report.fusions == {"rms_norm": 2, "rotary": 2, "attention": 1}, (name, report.fusions)
        assert report.aot_ops["forward"]["npu_swiglu"] == 1  # verl's, in the compiled graph
