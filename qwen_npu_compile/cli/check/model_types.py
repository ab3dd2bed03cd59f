"""The model families ``check`` builds, by ``model_type``: the bottom of ``cli/check/`` (no import of its siblings;
:mod:`.memory` and :mod:`.models` import it). Re-exported by :mod:`.models`."""

from __future__ import annotations

from typing import Any

#: model_type -> (transformers config class, causal-LM class, q/k/v bias). Llama and Mistral have no
#: q/k/v bias. (RMSNorms per layer: :func:`rms_norms_per_layer`, from the rms_norm fusion family.)
FAMILIES: dict[str, tuple[str, str, bool]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", False),
    "llama": ("LlamaConfig", "LlamaForCausalLM", False),
    "mistral": ("MistralConfig", "MistralForCausalLM", False),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", True),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", False),
    # hybrid Gated DeltaNet + gated attention: transformers 5.x (Qwen3.5), 4.57+ (Qwen3-Next)
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", False),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", False),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", False),
}


#: The hybrid model types (Gated DeltaNet layers with a full-attention layer every ``full_attention_interval``).
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


#: Multimodal ``model_type`` -> the text model type of its ``text_config`` (the released Qwen3.5 checkpoints are
#: ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``); ``check`` builds the text model.
MULTIMODAL_TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


#: The ``model_type`` values of a local ``config.json`` this module builds.
SUPPORTED_MODEL_TYPES = tuple(FAMILIES) + tuple(MULTIMODAL_TEXT_TYPES)


def _family(config: Any) -> tuple[str, str, bool]:
    """The :data:`FAMILIES` row of ``config`` (Qwen2's for an unknown model_type)."""
    return FAMILIES.get(getattr(config, "model_type", "qwen2"), FAMILIES["qwen2"])


def rms_norms_per_layer(config: Any) -> int:
    """RMSNorms per decoder layer of ``config``'s family: 2, or 4 for Qwen3 (q_norm and k_norm); as the
    rms_norm fusion family declares it (``RmsNormFamily.expected_per_layer``)."""
    from qwen_npu_compile.patterns.rms_norm import RmsNormFamily

    return RmsNormFamily.expected_per_layer(config)

