"""The Qwen3.5 / Qwen3.5-MoE / Qwen3-Next presets of ``check``: their sourced config fields (exact),
their parameter counts (the formula against the model built on the meta device, and the published totals), a
multimodal Qwen3.5 directory (its text model is built, its weights loaded), and ``check`` PASS on a Qwen3.5
preset with exact counts. The presets are data (:mod:`qwen_npu_compile.cli.check.presets`, sources in its comments).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch
import transformers

from qwen_npu_compile import cli
from qwen_npu_compile.cli.check import memory, models, presets
from qwen_npu_compile.patterns import expected_fusions

pytestmark = pytest.mark.skipif(not hasattr(transformers, "Qwen3_5ForCausalLM"),
                                reason=f"transformers {transformers.__version__} has no Qwen3.5")

GIB = 2**30
#: Fields every hybrid preset has as published (head_dim 256, 16 linear key heads of 128, value heads of 128,
#: conv kernel 4, eps 1e-6, no attention bias, 262144 positions).
COMMON = dict(head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4, rms_norm_eps=1e-6, attention_bias=False, max_position_embeddings=262144)
#: The dense Qwen3.5 presets' sourced fields, one row each in :data:`_DENSE_FIELDS` order (vocabulary 248320).
_DENSE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "linear_num_value_heads", "tie_word_embeddings")
_DENSE = {
    "qwen3.5-0.8b": (1024, 3584, 24, 8, 2, 16, True),
    "qwen3.5-2b": (2048, 6144, 24, 8, 2, 16, True),
    "qwen3.5-4b": (2560, 9216, 32, 16, 4, 32, True),
    "qwen3.5-9b": (4096, 12288, 32, 16, 4, 32, False),
    "qwen3.5-27b": (5120, 17408, 64, 24, 4, 48, False),
}
#: The Qwen3.5-MoE presets' sourced fields in :data:`_MOE_FIELDS` order (vocabulary 248320, untied embeddings).
_MOE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "linear_num_value_heads",
               "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
_MOE = {
    "qwen3.5-35b-a3b": (2048, 40, 16, 2, 32, 256, 8, 512, 512),
    "qwen3.5-122b-a10b": (3072, 48, 32, 2, 64, 256, 8, 1024, 1024),
    "qwen3.5-397b-a17b": (4096, 60, 32, 2, 64, 512, 10, 1024, 1024),
}
#: preset -> (config class, sourced fields); see the comments in cli/check/presets.py for the sources.
SOURCED = {
    **{name: ("Qwen3_5TextConfig", dict(zip(_DENSE_FIELDS, row), vocab_size=248320)) for name, row in _DENSE.items()},
    **{name: ("Qwen3_5MoeTextConfig", dict(zip(_MOE_FIELDS, row), vocab_size=248320, tie_word_embeddings=False))
       for name, row in _MOE.items()},
    "qwen3-next-80b-a3b": ("Qwen3NextConfig", dict(hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
                           num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32, num_experts=512,
                           num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                           tie_word_embeddings=False)),
}
#: Whole-model parameters of the text causal LM (exact: the formula, pinned to the meta-device build below).
PARAMETERS = {
    "qwen3.5-0.8b": 752_393_024, "qwen3.5-2b": 1_881_825_088, "qwen3.5-4b": 4_205_751_296,
    "qwen3.5-9b": 8_953_803_264, "qwen3.5-27b": 26_895_998_464, "qwen3.5-35b-a3b": 34_660_610_688,
    "qwen3.5-122b-a10b": 122_111_526_912, "qwen3.5-397b-a17b": 396_346_350_336, "qwen3-next-80b-a3b": 79_674_391_296,
}
#: Published totals (billions, the model names; Qwen3.5-35B-A3B: its text parameters as a workloads README
#: publishes them, 34,660,610,688). The published Qwen3.5 totals include the vision tower (and the MTP layer), so
#: only the sizes where the text model dominates are within 1%; 0.8B / 2B / 4B (vision tower ~0.1-0.4B) are not.
PUBLISHED_BILLIONS = {"qwen3.5-9b": 9, "qwen3.5-27b": 27, "qwen3.5-35b-a3b": 34.660610688, "qwen3.5-122b-a10b": 122,
                      "qwen3.5-397b-a17b": 397, "qwen3-next-80b-a3b": 80}


def test_hybrid_presets_are_data_and_models_reexports_them():
    tree = ast.parse(Path(presets.__file__).read_text())
    imported = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert all(isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in {"__future__", "typing"}
               for node in imported), [ast.dump(node) for node in imported]
    assert set(SOURCED) <= set(models.preset_names())


@pytest.mark.parametrize("name", sorted(SOURCED))
def test_preset_resolves_to_its_published_fields(name):
    class_name, fields = SOURCED[name]
    config = models.resolve_model_config(name.replace("qwen3.5", "Qwen/Qwen3.5").replace("qwen3-next", "Qwen/Qwen3-Next"))
    assert type(config).__name__ == class_name
    for field, value in {**COMMON, **fields}.items():
        assert getattr(config, field) == value, (field, getattr(config, field))
    # every 4th layer full attention (full_attention_interval 4); a quarter of the head rotates, base 1e7
    assert config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * (config.num_hidden_layers // 4)
    assert config.rope_parameters["rope_theta"] == 10000000 and config.rope_parameters["partial_rotary_factor"] == 0.25
    if class_name != "Qwen3NextConfig":
        assert config.rope_parameters["mrope_section"] == [11, 11, 10]
    assert not hasattr(config, "intermediate_size") if class_name == "Qwen3_5MoeTextConfig" else True


@pytest.mark.parametrize("name", sorted(SOURCED))
def test_parameter_count_is_the_meta_device_models(name):
    config = models.resolve_model_config(name)
    for layers in (4, None):
        built = config if layers is None else models.with_layers(config, layers)
        with torch.device("meta"):
            model = models._model_class(built)._from_config(built)
        assert memory.estimate_num_parameters(config, layers=layers) == sum(p.numel() for p in model.parameters())
    assert memory.estimate_num_parameters(config) == PARAMETERS[name]


def test_parameter_counts_match_the_published_totals():
    for name, billions in PUBLISHED_BILLIONS.items():
        assert PARAMETERS[name] / 1e9 == pytest.approx(billions, rel=0.01), name
    assert PARAMETERS["qwen3.5-35b-a3b"] == 34_660_610_688


def test_memory_plan_of_a_moe_hybrid_and_its_refusal(monkeypatch, capsys):
    # Qwen3.5-MoE has no intermediate_size; 4 layers of Qwen3-Next are 7.2 B parameters (experts: 6.4 B)
    config = models.with_vocab_size(models.resolve_model_config("qwen3.5-35b-a3b"), 4096)
    plan = memory.memory_plan(config, layers=4, batch=1, seq_len=16, dtype=torch.bfloat16, train=True, reference=True)
    assert plan.parts["parameters"] == memory.estimate_num_parameters(config, layers=4) * 2
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 20 * GIB)
    assert cli.main(["check", "qwen3-next-80b-a3b", "--layers", "4", "--vocab-size", "4096", "--seq-len", "16"]) == 2
    err = capsys.readouterr().err
    assert "GiB needed for 4 layer(s) of qwen3-next-80b-a3b" in err and "try --layers 1" in err


def _tiny_multimodal(folder: Path, **text) -> transformers.PreTrainedModel:
    """A tiny Qwen3_5ForConditionalGeneration (4 text layers, a 1-block vision tower) saved to ``folder``."""
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, vocab_size=256, **text)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(3)
    model = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False))
    model.save_pretrained(folder)
    return model


def test_a_multimodal_qwen3_5_directory_builds_its_text_model_with_its_weights(tmp_path):
    original = _tiny_multimodal(tmp_path / "vl")
    saved = json.loads((tmp_path / "vl" / "config.json").read_text())
    assert saved["model_type"] == "qwen3_5" and "text_config" in saved
    config = models.resolve_model_config(str(tmp_path / "vl"))
    assert type(config).__name__ == "Qwen3_5TextConfig" and config.num_hidden_layers == 4
    model, info = models.build_model(str(tmp_path / "vl"), layers=None, dtype=torch.float32, attn="sdpa")
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and info["source"] == "local-weights"
    text = original.model.language_model
    assert torch.equal(model.model.layers[3].self_attn.q_proj.weight, text.layers[3].self_attn.q_proj.weight)
    assert torch.equal(model.model.layers[0].linear_attn.A_log, text.layers[0].linear_attn.A_log)
    assert torch.equal(model.lm_head.weight, original.lm_head.weight)
    # without weights: random, like any config-only directory
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(saved))
    assert models.build_model(str(tmp_path / "cfg"), layers=2, dtype=torch.float32, attn="sdpa")[1]["source"] == "local-random"


def test_multimodal_directory_without_text_config_and_unknown_types_are_one_line_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}))
    with pytest.raises(ValueError) as excinfo:
        models.resolve_model_config(str(tmp_path))
    assert "no text_config" in str(excinfo.value) and "\n" not in str(excinfo.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4"}))
    with pytest.raises(ValueError) as excinfo:
        models.resolve_model_config(str(tmp_path))
    for model_type in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_moe"):
        assert model_type in str(excinfo.value)


def test_check_passes_on_a_qwen3_5_preset_with_exact_counts(npu_ops, tmp_path, capsys):
    """``check`` sets the DeltaNet substitution from its own ``--fusions``, whatever an earlier compile in the process
    left (a benchmark capture or a check without the family switches it off), and puts that setting back after."""
    import qwen_npu_compile.backend  # noqa: F401  (its import installs the substitution once, from QWEN_NPU_FUSIONS)
    from qwen_npu_compile.substitutions import deltanet

    out = tmp_path / "result.json"
    with deltanet.switched(False):  # what an earlier compile without the family leaves behind
        status = cli.main(["check", "qwen3.5-0.8b", "--layers", "4", "--vocab-size", "4096", "--seq-len", "16",
                           "--json", str(out)])
        assert deltanet._enabled is False  # restored after the check
    printed = capsys.readouterr().out
    assert status == 0, printed
    result = json.loads(out.read_text())
    fusions = {family: row["fused"] + row["already_fused"] for family, row in result["fusions"].items()}
    # 3 DeltaNet layers (a gated norm each) + 1 full-attention layer; (1+w) norms 2 per layer + q/k norms + final
    assert fusions == {"gated_delta_rule": 3, "rms_norm_gated": 3, "rms_norm": 11, "moe": 0, "swiglu": 4, "rotary": 2, "attention": 1}
    assert fusions == expected_fusions(models.with_layers(models.resolve_model_config("qwen3.5-0.8b"), 4))
    assert result["backward_ops"] == {"npu_fusion_attention_grad": 1, "npu_rms_norm_backward": 14,
                                      "npu_rotary_mul_backward": 2, "npu_swiglu_backward": 7,
                                      "qwen_npu.chunk_gated_delta_rule_backward": 3}
    assert result["model"]["config"]["model_type"] == "qwen3_5_text" and result["verdict"] == "PASS"
    assert re.search(r"^  rms_norm_gated +3 +3  ok$", printed, re.MULTILINE), printed
    assert re.search(r"^  gated_delta_rule +3 +3  ok$", printed, re.MULTILINE), printed
