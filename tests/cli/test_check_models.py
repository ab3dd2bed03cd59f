"""Tests for qwen_npu_compile.cli.check.models: presets, local directories, layer overrides, memory estimate."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from qwen_npu_compile.cli.check import memory, models
from qwen_npu_compile.cli.check.memory import estimate_memory_bytes, estimate_num_parameters
from qwen_npu_compile.cli.check.models import build_model, resolve_model_config
from qwen_npu_compile.cli.check.models import tiny_qwen2_config as tiny_config
from qwen_npu_compile.cli.check.presets import PRESETS

REQUIRED_PRESETS = {
    "qwen2-0.5b",
    "qwen2-1.5b",
    "qwen2-7b",
    "qwen2.5-0.5b",
    "qwen2.5-1.5b",
    "qwen2.5-3b",
    "qwen2.5-7b",
    "qwen2.5-14b",
    "qwen2.5-32b",
    "qwen2.5-72b",
}


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """A directory holding only the config.json of a tiny 2-layer Qwen2."""
    path = tmp_path_factory.mktemp("tiny_config")
    tiny_config().save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen2"
    return path


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    """A directory holding a saved tiny Qwen2 (config.json + model.safetensors), and that model."""
    path = tmp_path_factory.mktemp("tiny_weights")
    torch.manual_seed(1234)
    model = Qwen2ForCausalLM(tiny_config())
    model.save_pretrained(path)
    assert list(path.glob("*.safetensors"))
    return path, model


# --- presets -----------------------------------------------------------------------------------


def test_required_presets_are_lower_case_keys():
    assert REQUIRED_PRESETS <= set(PRESETS)
    assert all(name == name.lower() for name in PRESETS)


@pytest.mark.parametrize(
    "spelling", ["qwen2.5-0.5b", "Qwen2.5-0.5B", "QWEN2.5-0.5B", "Qwen/Qwen2.5-0.5B", "qwen/qwen2.5-0.5b"]
)
def test_preset_lookup_is_case_insensitive_and_accepts_qwen_prefix(spelling):
    config = resolve_model_config(spelling)
    assert isinstance(config, Qwen2Config)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (896, 14, 2)
    assert config.num_hidden_layers == 24
    assert config.vocab_size == 151936
    assert config.tie_word_embeddings is True


def test_preset_values_that_differ_between_sizes():
    eps = {name: resolve_model_config(name).rms_norm_eps for name in REQUIRED_PRESETS}
    assert {n for n, e in eps.items() if e == 1e-5} == {"qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b"}
    assert all(e == 1e-6 for n, e in eps.items() if n not in {"qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b"})
    for name in REQUIRED_PRESETS:
        config = resolve_model_config(name)
        big = name.endswith(("7b", "14b", "32b", "72b"))
        assert config.vocab_size == (152064 if big else 151936), name
        assert config.tie_word_embeddings is (not big), name


def test_preset_parameter_counts_match_published_sizes():
    # Qwen2.5 model cards: 0.49B, 1.54B, 3.09B, 7.61B, 14.7B, 32.5B (card; 32.76B counted), 72.7B.
    billions = {n: estimate_num_parameters(resolve_model_config(n)) / 1e9 for n in REQUIRED_PRESETS}
    assert billions["qwen2.5-0.5b"] == pytest.approx(0.49, abs=0.01)
    assert billions["qwen2.5-1.5b"] == pytest.approx(1.54, abs=0.01)
    assert billions["qwen2.5-3b"] == pytest.approx(3.09, abs=0.01)
    assert billions["qwen2.5-7b"] == pytest.approx(7.62, abs=0.01)
    assert billions["qwen2.5-14b"] == pytest.approx(14.77, abs=0.01)
    assert estimate_num_parameters(resolve_model_config("qwen2.5-32b")) == 32_763_876_352
    assert billions["qwen2.5-72b"] == pytest.approx(72.71, abs=0.01)


def test_unknown_name_lists_presets_sorted_and_mentions_local_dirs():
    with pytest.raises(ValueError) as excinfo:
        resolve_model_config("qwen9-1b")
    message = str(excinfo.value)
    assert "qwen9-1b" in message
    assert ", ".join(sorted(PRESETS)) in message
    assert "config.json" in message and "director" in message


def test_preset_builds_two_layer_qwen25_05b():
    model, info = build_model("Qwen/Qwen2.5-0.5B", layers=2, dtype=torch.bfloat16, attn="sdpa")
    assert isinstance(model, Qwen2ForCausalLM)
    assert len(model.model.layers) == 2
    assert model.config.hidden_size == 896
    assert model.config.num_attention_heads == 14
    assert model.config.use_cache is False
    assert model.config._attn_implementation == "sdpa"
    assert model.training is False
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert info["name"] == "qwen2.5-0.5b"
    assert info["source"] == "preset"
    assert info["layers"] == 2
    assert info["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert info["config"]["num_hidden_layers"] == 2
    assert info["config"]["hidden_size"] == 896
    assert info["config"]["rope_theta"] == 1000000.0
    assert info["config"]["rms_norm_eps"] == 1e-6


# --- local directories ---------------------------------------------------------------------------


def test_local_config_dir_builds_random_and_deterministic(config_dir):
    model, info = build_model(str(config_dir), layers=None, dtype=torch.float32, attn="eager")
    assert info["source"] == "local-random"
    assert info["layers"] == 2
    assert info["name"] == str(config_dir.resolve())
    assert info["config"]["hidden_size"] == 64
    assert model.config._attn_implementation == "eager"
    assert model.config.use_cache is False
    again, _ = build_model(str(config_dir), layers=None, dtype=torch.float32, attn="eager")
    for (name, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), name
    logits = model(torch.randint(0, 128, (2, 5))).logits
    assert logits.shape == (2, 5, 128)


def test_local_dir_with_weights_loads_them(weights_dir, config_dir):
    path, original = weights_dir
    model, info = build_model(str(path), layers=None, dtype=torch.float32, attn="sdpa")
    assert info["source"] == "local-weights"
    expected = original.model.layers[1].mlp.up_proj.weight
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, expected)
    assert torch.equal(model.model.embed_tokens.weight, original.model.embed_tokens.weight)
    # ... and not what the seed-0 random initialisation of the same config gives.
    random_model, _ = build_model(str(config_dir), layers=None, dtype=torch.float32, attn="sdpa")
    assert not torch.equal(random_model.model.layers[1].mlp.up_proj.weight, expected)


def test_local_dir_with_weights_and_fewer_layers(weights_dir):
    path, original = weights_dir
    model, info = build_model(str(path), layers=1, dtype=torch.bfloat16, attn="eager")
    assert info["source"] == "local-weights"
    assert info["layers"] == 1 and len(model.model.layers) == 1
    loaded = model.model.layers[0].self_attn.q_proj.weight
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded, original.model.layers[0].self_attn.q_proj.weight.to(torch.bfloat16))


def test_unsupported_model_type_is_rejected_clearly(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    for call in (lambda: resolve_model_config(str(tmp_path)),
                 lambda: build_model(str(tmp_path), layers=None, dtype=torch.float32, attn="sdpa")):
        with pytest.raises(ValueError) as excinfo:
            call()
        message = str(excinfo.value)
        assert "'bert'" in message
        assert "qwen2" in message
        assert ", ".join(sorted(PRESETS)) in message


def test_directory_without_config_json_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_config(str(tmp_path))


# --- layers / attn / dtype validation ----------------------------------------------------------------


def test_layers_override(config_dir):
    model, info = build_model(str(config_dir), layers=1, dtype=torch.float32, attn="sdpa")
    assert len(model.model.layers) == 1
    assert model.config.num_hidden_layers == 1
    assert info["layers"] == 1 and info["config"]["num_hidden_layers"] == 1


def test_too_many_layers_names_the_maximum(config_dir):
    with pytest.raises(ValueError, match="maximum is 2"):
        build_model(str(config_dir), layers=3, dtype=torch.float32, attn="sdpa")
    with pytest.raises(ValueError, match="maximum is 24"):
        build_model("qwen2.5-0.5b", layers=25, dtype=torch.float32, attn="sdpa")


@pytest.mark.parametrize("layers", [0, -1])
def test_layers_below_one_rejected(config_dir, layers):
    with pytest.raises(ValueError, match=">= 1"):
        build_model(str(config_dir), layers=layers, dtype=torch.float32, attn="sdpa")


def test_bad_attn_and_dtype_rejected(config_dir):
    with pytest.raises(ValueError, match="sdpa"):
        build_model(str(config_dir), layers=1, dtype=torch.float32, attn="flash_attention_2")
    with pytest.raises(ValueError, match="dtype"):
        build_model(str(config_dir), layers=1, dtype=torch.int32, attn="sdpa")


def test_vocab_size_override_changes_only_the_vocab(config_dir):
    _, base = build_model(str(config_dir), layers=1, dtype=torch.float32, attn="sdpa")
    model, info = build_model(str(config_dir), layers=1, dtype=torch.float32, attn="sdpa", vocab_size=96)
    assert model.model.embed_tokens.weight.shape == (96, 64)
    assert model.lm_head.weight.shape == (96, 64)
    assert info["config"]["vocab_size"] == 96
    changed = {k for k in info["config"] if info["config"][k] != base["config"][k]}
    assert changed == {"vocab_size"}


def test_vocab_size_override_refused_with_weights_and_below_one(weights_dir):
    path, _ = weights_dir
    with pytest.raises(ValueError, match="--vocab-size needs random weights"):
        build_model(str(path), layers=1, dtype=torch.float32, attn="sdpa", vocab_size=96)
    with pytest.raises(ValueError, match="positive integer"):
        models.with_vocab_size(tiny_config(), 0)


# --- parameter count / memory estimate ------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_estimate_num_parameters_matches_the_model(tied):
    config = tiny_config(tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(config)
    assert estimate_num_parameters(config) == sum(p.numel() for p in model.parameters())
    assert estimate_num_parameters(config, layers=1) < estimate_num_parameters(config)


def test_estimate_memory_grows_with_layers_batch_and_training():
    config = resolve_model_config("qwen2.5-7b")

    def est(**kw):
        args = dict(layers=2, batch=1, seq_len=256, dtype=torch.bfloat16, train=False)
        args.update(kw)
        return estimate_memory_bytes(config, **args)

    assert est(layers=4) > est(layers=2)
    assert est(batch=4) > est(batch=1)
    assert est(seq_len=1024) > est(seq_len=256)
    assert est(train=True) > est(train=False)
    assert est(dtype=torch.float32) > est(dtype=torch.bfloat16)
    assert est(layers=None) > est(layers=27)
    base = est()
    assert isinstance(base, int)
    # At least the parameters plus the fixed 1 GiB overhead.
    assert base > estimate_num_parameters(config, layers=2) * 2 + 2**30


def test_estimate_memory_validates():
    config = tiny_config()
    with pytest.raises(ValueError):
        estimate_memory_bytes(config, layers=1, batch=0, seq_len=8, dtype=torch.float32, train=False)
    with pytest.raises(ValueError):
        estimate_memory_bytes(config, layers=0, batch=1, seq_len=8, dtype=torch.float32, train=False)


def test_available_memory_bytes_positive():
    assert memory.available_memory_bytes() > 0


def test_invalid_qwen2_config_json_is_a_value_error(tmp_path):
    data = tiny_config().to_dict()
    data["num_hidden_layers"] = 3  # layer_types still lists 2 layers: rejected by transformers 5.x
    (tmp_path / "config.json").write_text(json.dumps(data))
    if len(data.get("layer_types") or []) != 2:
        pytest.skip("this transformers version writes no layer_types")
    with pytest.raises(ValueError, match="not a valid Qwen2 config"):
        resolve_model_config(str(tmp_path))
