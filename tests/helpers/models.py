"""The tiny models of the tests and their inputs.

The tiny Qwen2 (``tiny_qwen2``, ``tiny_qwen2_config``) is the ``check`` harness's own
(:mod:`qwen_npu_compile.cli.check.models`); the tiny MoE and hybrid models are here: transformers' real modeling
code with random weights.
"""

from __future__ import annotations

import pytest
import torch

#: The tiny MoE models of the MoE tests: 2 layers, hidden 64, 4 heads / 2 KV heads, top-2 of 4 experts.
TINY_MOE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, use_cache=False, moe_intermediate_size=32,
                num_experts=4, num_experts_per_tok=2)  # fmt: skip


#: Why a bf16 MoE expert graph is not one graph on a CPU with transformers 5.10.4 and torch <= 2.10.
CPU_GROUPED_MM_BREAK = ("transformers reads CPU tensors' data_ptr() in _can_use_grouped_mm on this torch (<= 2.10): a "
                        "CPU-only graph break per MoE block (on an NPU the device check short-circuits it)")


def cpu_grouped_mm_alignment_break() -> bool:
    """Whether transformers' ``_can_use_grouped_mm`` (``integrations/moe.py``) reads ``data_ptr()`` of CPU tensors
    here: transformers 5.10.4 does on torch <= 2.10 (grouped_mm's 16-byte alignment before torch 2.11), a graph
    break per MoE block that exists on a CPU only (the condition starts with ``weight.device.type == "cpu"``;
    on an NPU it short-circuits) and only for bf16 (other dtypes return earlier under Dynamo)."""
    import importlib
    import inspect

    from transformers.utils.import_utils import is_torch_less_or_equal

    try:
        moe = importlib.import_module("transformers.integrations.moe")
    except ImportError:  # transformers 4.x: MoE experts are a per-expert loop, no grouped_mm
        return False
    probe = getattr(moe, "_can_use_grouped_mm", None)
    return probe is not None and "data_ptr()" in inspect.getsource(probe) and is_torch_less_or_equal("2.10.0", accept_dev=True)


def tiny_moe(family: str, dtype=torch.float32, attn: str = "sdpa", **kwargs):
    """A 2-layer tiny Qwen3-MoE (head_dim 64, top-2 of 4 experts, renormalised) or Qwen2-MoE (head_dim 16,
    shared expert and its sigmoid gate), random weights (seed 0), in ``dtype``; ``kwargs`` go to ``_from_config``."""
    import transformers

    torch.manual_seed(0)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**TINY_MOE, head_dim=64, norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.Qwen2MoeConfig(**TINY_MOE, shared_expert_intermediate_size=64)
        cls = transformers.Qwen2MoeForCausalLM
    return cls._from_config(config, attn_implementation=attn, **kwargs).to(dtype)


#: The tiny hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): 4 layers (3 Gated DeltaNet + 1 full attention,
#: transformers' default ``layer_types``), hidden 128, head_dim 64 (rotary on 16 dims, partial_rotary_factor 0.25).
TINY_HYBRID = dict(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                   linear_value_head_dim=32, linear_conv_kernel_dim=4, max_position_embeddings=256, use_cache=False)
_TINY_HYBRID_MOE = dict(moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2)

#: family -> (config class, causal-LM class, extra config), transformers names; Qwen3.5 needs transformers >= 5
HYBRID_FAMILIES = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(intermediate_size=256)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", _TINY_HYBRID_MOE),
    # dense MLPs (mlp_only_layers): transformers 4.57.6 runs Qwen3-Next's experts as a per-expert loop (a graph
    # break per expert, as Qwen3-MoE there); the MoE block of the hybrid models is qwen3_5_moe's
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(intermediate_size=256, mlp_only_layers=[0, 1, 2, 3], **_TINY_HYBRID_MOE)),
    "qwen3_next_moe": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(intermediate_size=256, **_TINY_HYBRID_MOE)),
}


def _hybrid_classes(family: str):
    """``(config class, causal-LM class, extra config)`` of ``family``; skips the test where this transformers has
    no such model."""
    import transformers

    config_name, model_name, extra = HYBRID_FAMILIES[family]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    return getattr(transformers, config_name), getattr(transformers, model_name), extra


def tiny_hybrid_config(family: str, layer_types=None, **overrides):
    """The config of :func:`tiny_hybrid` (``layer_types`` also sets the layer count); ``overrides`` win."""
    config_class, _, extra = _hybrid_classes(family)
    layers = {} if layer_types is None else dict(num_hidden_layers=len(layer_types), layer_types=layer_types)
    return config_class(**{**TINY_HYBRID, **extra, **layers, **overrides})


def tiny_hybrid(family: str, dtype=torch.float32, attn: str = "sdpa", seed: int = 0, **kwargs):
    """A tiny hybrid model of transformers' real modeling code (:data:`HYBRID_FAMILIES`), random weights (``seed``),
    the RMSNorm weights made random too (transformers initialises the (1+w) norms to 0 and the gated norm to 1,
    which would hide a wrong weight), in ``dtype``; ``kwargs`` override the config. Skips the test where this
    transformers has no such model."""
    config = tiny_hybrid_config(family, **kwargs)
    torch.manual_seed(seed)
    model = _hybrid_classes(family)[1]._from_config(config, attn_implementation=attn)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(0.0 if "linear_attn" not in name else 1.0, 0.5)
    return model.to(dtype)


def token_ids(vocab: int = 128, batch: int = 2, seq: int = 12, seed: int = 1) -> torch.Tensor:
    """Random token ids ``[batch, seq]`` below ``vocab``, from their own generator (``seed``)."""
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def packed_positions(lengths) -> torch.Tensor:
    """``position_ids [1, T]`` of sequences of ``lengths`` packed into one row: restarting at 0 for each sequence."""
    return torch.cat([torch.arange(n) for n in lengths])[None]


def packed_row(lengths, vocab: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [1, T], position_ids [1, T])`` of sequences of ``lengths`` packed into one row (verl's
    ``use_remove_padding`` input), the ids random below ``vocab`` (``seed``)."""
    return token_ids(vocab, 1, sum(lengths), seed), packed_positions(lengths)
