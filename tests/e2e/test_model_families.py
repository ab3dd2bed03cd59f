"""Other model families with Qwen2's blocks: Qwen3, Llama 3.x, Mistral fuse with the
expected counts and parity on tiny random configs of transformers' real modeling code; GPT-2 (none of
the blocks but attention) compiles with one report line, no warnings; the ``check`` presets."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import transformers

from qwen_npu_compile import ALL_FAMILIES
from qwen_npu_compile.cli.check import memory, model_types, models
from qwen_npu_compile.patterns import expected_fusions
from tests.helpers.numerics import assert_parity

LAYERS = 2
TINY = dict(models.TINY_QWEN2, num_hidden_layers=LAYERS)


def _tiny(family: str, attn: str):
    torch.manual_seed(0)
    if family == "qwen3":  # head_dim 16 given explicitly, as Qwen3 configs do
        config = transformers.Qwen3Config(**TINY, head_dim=16)
        cls = transformers.Qwen3ForCausalLM
    elif family == "llama":  # llama3 RoPE scaling, as Llama 3.1
        rope = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_type": "llama3"}  # fmt: skip
        config = transformers.LlamaConfig(**TINY, rope_scaling=rope)
        cls = transformers.LlamaForCausalLM
    else:  # a sliding window shorter than the sequence: the mask is banded, not just causal
        config = transformers.MistralConfig(**TINY, sliding_window=8)
        cls = transformers.MistralForCausalLM
    return cls._from_config(config, attn_implementation=attn)


def _totals(reports):
    return {f: sum(r.fusions.get(f, 0) for r in reports) for f in ALL_FAMILIES}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["qwen3", "llama", "mistral"])
def test_family_fuses_with_parity(family, attn):
    model = _tiny(family, attn)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    reports = assert_parity(model, ids, True, torch.float32)
    assert _totals(reports) == expected_fusions(model.config)
    assert [r.reason for report in reports for r in report.refused] == []


def test_gpt2_compiles_with_one_line_per_graph_and_no_warnings(caplog):
    """GPT-2 has no RMSNorm, SwiGLU or rotary: nothing of those is fused or refused; its SDPA attention
    (MHA, causal mask) fuses; every graph logs one INFO line and nothing else warns."""
    config = transformers.GPT2Config(n_embd=64, n_layer=LAYERS, n_head=4, vocab_size=128, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="qwen_npu_compile"):
        warnings.simplefilter("always")
        reports = assert_parity(model, ids, True, torch.float32)
    ours = [r for r in caplog.records if r.name.startswith("qwen_npu_compile") and r.levelno >= logging.INFO
            and not r.getMessage().startswith("qwen_npu: using")]  # the once-per-process npu ops line
    assert [r.levelno for r in ours] == [logging.INFO] * len(reports), [r.getMessage() for r in ours]
    assert [str(w.message) for w in caught if "qwen_npu" in str(w.message)] == []
    assert _totals(reports) == {**dict.fromkeys(ALL_FAMILIES, 0), "attention": LAYERS}
    assert [r.reason for report in reports for r in report.refused] == []


# Published sizes: Qwen3-0.6B 0.6B (card), Qwen3-8B 8.2B, Llama-3.1-8B 8.03B, Mistral-7B-v0.1 7.24B.
@pytest.mark.parametrize(
    ("spelling", "config_class", "billions", "norms"),
    [
        ("Qwen/Qwen3-0.6B", "Qwen3Config", 0.596, 4),
        ("qwen3-8b", "Qwen3Config", 8.19, 4),
        ("meta-llama/Llama-3.1-8B", "LlamaConfig", 8.03, 2),
        ("mistralai/Mistral-7B-v0.1", "MistralConfig", 7.24, 2),
        ("mistral-7b", "MistralConfig", 7.24, 2),
    ],
)
def test_family_presets(spelling, config_class, billions, norms):
    config = models.resolve_model_config(spelling)
    assert type(config).__name__ == config_class
    assert memory.estimate_num_parameters(config) / 1e9 == pytest.approx(billions, abs=0.01)
    assert model_types.rms_norms_per_layer(config) == norms
    assert config.head_dim == 128


def test_qwen3_preset_builds_two_layers():
    model, info = models.build_model("qwen3-0.6b", layers=2, dtype=torch.bfloat16, attn="sdpa")
    assert isinstance(model, transformers.Qwen3ForCausalLM) and len(model.model.layers) == 2
    assert info["config"]["model_type"] == "qwen3" and info["config"]["head_dim"] == 128
    assert info["num_parameters"] == memory.estimate_num_parameters(model.config, layers=2)
