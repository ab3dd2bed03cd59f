"""The presets of ``qwen-npu-compile check MODEL``: the architecture fields of published Hugging Face
``config.json`` files, as data (:data:`PRESETS`, keyed by lower-case name). Imports nothing from this package;
:mod:`.models` builds configs and models from them.

The Qwen2/Qwen2.5 presets are the *base* models (``Qwen/Qwen2-0.5B``, ..., ``Qwen/Qwen2.5-72B``), not the
``-Instruct`` ones: those share every shape, but differ in ``max_position_embeddings`` / ``sliding_window``
(32768 for most Instruct models) and, for Qwen2.5-14B/32B/72B, in ``rms_norm_eps`` (Instruct 1e-6, base 1e-5).
Other families: ``qwen3-0.6b``, ``qwen3-8b`` (per-head q_norm/k_norm, head_dim 128), ``llama-3.1-8b`` (llama3
RoPE scaling), ``mistral-7b`` (sliding window 4096), the MoE presets (``qwen3-30b-a3b``, ``qwen3-235b-a22b``,
``qwen1.5-moe-a2.7b``, ``qwen2-57b-a14b``) and the hybrid Gated DeltaNet ones (``qwen3.5-*``,
``qwen3-next-80b-a3b``). Each preset's sources are in the comment above it; where a field could not be
sourced, the comment says so.
"""

from __future__ import annotations

from typing import Any

#: Organisation prefixes accepted before a preset name (``Qwen/Qwen3-8B``, ``meta-llama/Llama-3.1-8B``).
_ORG_PREFIXES = ("qwen/", "meta-llama/", "mistralai/")
#: Other spellings of preset names (the Hugging Face repository names).
_ALIASES = {"meta-llama-3.1-8b": "llama-3.1-8b", "mistral-7b-v0.1": "mistral-7b"}

# Fields every Qwen2/Qwen2.5 base config.json shares (attention_dropout 0.0, SiLU gate, RoPE base 1e6,
# no sliding window in use).
_COMMON = {
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
}


def _preset(**fields: Any) -> dict[str, Any]:
    return {**_COMMON, **fields}


# Sources checked (through the code search index; no model hub is reachable here). "HF copy" means a
# verbatim copy of the model's huggingface.co config.json found in a public repository:
#   [mlc]   mlc-ai/mlc-llm python/mlc_llm/model/model_preset.py (Instruct configs: shapes, eps, tying)
#   [i6]    rwth-i6/i6_experiments users/juanola/.../configurations/qwen2/qwen2_configs.py ("Qwen2-0_5B")
#   [kqi]   a torchKQI script in the index holding Qwen2_7B / Qwen2_72B base config.json dicts
#   [prof]  citsjtu2020/LLM-Prof sglang/Model_Config.md (Qwen2.5-3B/7B/14B/32B base config.json)
#   [goog]  a Google-LLC-licensed file in the index transcribing
#           https://huggingface.co/Qwen/Qwen2.5-{0.5B,1.5B,3B,7B,14B,32B,72B}/blob/main/config.json
#           into transformers.Qwen2Config(...) calls
#   [lit]   Lightning-AI/litgpt litgpt/config.py (Qwen2.5-14B/32B/72B: norm_eps=1e-5, block_size 131072)
#   [cache] a script printing ~/.cache/.../models--Qwen--Qwen2.5-0.5B/snapshots/060db64.../config.json
#   [pin]   a pinned loader's EXPECTED_CONFIG for the Qwen2.5-1.5B base snapshot
#   [blog]  a "FLOPs of Qwen2.5-32B" write-up quoting its config.json (rms_norm_eps 1e-05)
#   [table] an HTML model table linking huggingface.co/Qwen/Qwen2-*/blob/main/config.json (context,
#           layers, hidden, intermediate, heads, kv heads, tying)
PRESETS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2-0.5B: [i6] HF copy (base: eos 151643, max_position_embeddings 131072); [table] 128K,
    # tied; shapes also in [mlc] qwen2_0_5b.
    "qwen2-0.5b": _preset(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        sliding_window=131072,
        max_window_layers=24,
    ),
    # Qwen/Qwen2-1.5B: shapes, vocab, eps and tying from [mlc] qwen2_1_5b (the Instruct config.json,
    # same weights' shapes); 28 layers / 1536 / 8960 / 12 / 2 / tied / 128K context from [table];
    # eps 1e-6 also in a code comment citing the base config.json. max_position_embeddings 131072 is
    # corroborated ([table], and a page noting the base config.json exceeds the 32K of the blog) but
    # not seen in a verbatim copy; sliding_window and max_window_layers are inferred (unverified) from
    # the other Qwen2 base configs, where sliding_window == max_position_embeddings.
    "qwen2-1.5b": _preset(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        sliding_window=131072,
        max_window_layers=28,
    ),
    # Qwen/Qwen2-7B: [kqi] HF copy (Qwen2_7B: vocab 152064, untied, eps 1e-6, 131072); shapes also in
    # [mlc] qwen2_7b and [table].
    "qwen2-7b": _preset(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        sliding_window=131072,
        max_window_layers=28,
    ),
    # Qwen/Qwen2.5-0.5B: [cache] HF copy and [goog] (max_position_embeddings 32768, sliding 32768).
    "qwen2.5-0.5b": _preset(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        sliding_window=32768,
        max_window_layers=24,
    ),
    # Qwen/Qwen2.5-1.5B: [goog] and [pin] (131072, tied, eps 1e-6).
    "qwen2.5-1.5b": _preset(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        sliding_window=131072,
        max_window_layers=28,
    ),
    # Qwen/Qwen2.5-3B: [prof] HF copy and [goog] (32768, tied, eps 1e-6).
    "qwen2.5-3b": _preset(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        sliding_window=32768,
        max_window_layers=36,
    ),
    # Qwen/Qwen2.5-7B: [prof] HF copy and [goog] (vocab 152064, untied, eps 1e-6, 131072).
    "qwen2.5-7b": _preset(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        sliding_window=131072,
        max_window_layers=28,
    ),
    # Qwen/Qwen2.5-14B: [prof] HF copy, [goog], [lit] (eps 1e-5 in the base config).
    "qwen2.5-14b": _preset(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=131072,
        max_window_layers=48,
    ),
    # Qwen/Qwen2.5-32B: [prof] HF copy, [goog], [lit], [blog] (eps 1e-5).
    "qwen2.5-32b": _preset(
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=131072,
        max_window_layers=64,
    ),
    # Qwen/Qwen2.5-72B: [goog], [lit] (eps 1e-5, 131072); shapes also in [table].
    "qwen2.5-72b": _preset(
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=152064,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=131072,
        max_window_layers=80,
    ),
    # Qwen/Qwen3-0.6B config.json (transformers 4.51.0), as quoted verbatim in public copies found with the
    # code search (e.g. a "Constants for Qwen/Qwen3-0.6B (.../raw/main/config.json)" header; torchtune's
    # qwen3_0_6b builder agrees on the shapes): head_dim 128 (not hidden/heads = 64), 40960 context, tied.
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        sliding_window=None, use_sliding_window=False, max_window_layers=28, attention_bias=False,
        attention_dropout=0.0, hidden_act="silu",
    ),
    # Qwen/Qwen3-8B config.json: 36 layers, 4096/12288, 32 heads / 8 KV heads of 128, untied.
    "qwen3-8b": dict(
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        sliding_window=None, use_sliding_window=False, max_window_layers=36, attention_bias=False,
        attention_dropout=0.0, hidden_act="silu",
    ),
    # meta-llama/Llama-3.1-8B config.json: llama3 RoPE scaling (factor 8, low/high freq factor 1/4,
    # original context 8192), rope_theta 500000, eps 1e-5, vocab 128256, untied.
    "llama-3.1-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, attention_dropout=0.0, hidden_act="silu",
    ),
    # mistralai/Mistral-7B-v0.1 config.json: sliding window 4096, rope_theta 10000, vocab 32000, eps 1e-5.
    "mistral-7b": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32000,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
        tie_word_embeddings=False, attention_dropout=0.0, hidden_act="silu",
    ),
    # MoE (the moe fusion family). Shapes of the published config.json files (huggingface.co/Qwen/<name>):
    # the Qwen3-MoE shapes agree with THUDM/slime scripts/models/qwen3-{30B-A3B,235B-A22B}.sh (hidden, FFN, MoE
    # FFN, heads/groups, kv-channels 128, layers, experts 128, top-8, eps 1e-6, rope 1e6, vocab 151936, untied);
    # Qwen1.5-MoE-A2.7B with a config.json copy (Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4 model card: 60 experts, top-4,
    # moe_intermediate 1408, max_window_layers 21, context 32768); the shared-expert widths and Qwen2-57B-A14B's
    # config were not found in the index (from the published configs as recalled: the parameter counts they give,
    # tests/patterns/test_moe.py, match the published totals 30.5B / 235B / 14.3B / 57.4B within 1%).
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        sliding_window=None, use_sliding_window=False, max_window_layers=48, attention_bias=False,
        attention_dropout=0.0, hidden_act="silu",
    ),
    "qwen3-235b-a22b": dict(
        model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        sliding_window=None, use_sliding_window=False, max_window_layers=94, attention_bias=False,
        attention_dropout=0.0, hidden_act="silu",
    ),
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False, sliding_window=32768, use_sliding_window=False, max_window_layers=21,
        attention_dropout=0.0, hidden_act="silu",
    ),
    "qwen2-57b-a14b": dict(
        model_type="qwen2_moe", hidden_size=3584, intermediate_size=18944, moe_intermediate_size=2560,
        shared_expert_intermediate_size=20480, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=151936, max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False, sliding_window=131072, use_sliding_window=False, max_window_layers=28,
        attention_dropout=0.0, hidden_act="silu",
    ),
}

# Hybrid Gated DeltaNet + gated attention: Qwen3.5 dense (model_type ``qwen3_5_text``), Qwen3.5-MoE
# (``qwen3_5_moe_text``) and Qwen3-Next (``qwen3_next``). The released Qwen3.5 checkpoints are multimodal
# (``Qwen3_5ForConditionalGeneration``, ``model_type`` qwen3_5 / qwen3_5_moe); a preset is the published
# config.json's ``text_config`` (what ``Qwen3_5ForCausalLM`` builds). Every 4th layer is full attention
# (``full_attention_interval`` 4, ``layer_types`` derived by the config class), rotary on a quarter of the
# head (``partial_rotary_factor`` 0.25), RoPE base 1e7, q/k norms and an output gate (``attn_output_gate``).
# Fields each published config.json sets the same way in every size (the sources below agree on them):
_HYBRID_COMMON = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
}
#: Qwen3.5's ``text_config.rope_parameters`` as published (transformers 5.x spelling; ``mrope_section`` is
#: what ``Qwen3_5TextRotaryEmbedding`` uses for text-only position ids too, where it equals plain RoPE).
_QWEN3_5_ROPE = {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                 "rope_theta": 10000000, "partial_rotary_factor": 0.25}


def _qwen3_5(**fields: Any) -> dict[str, Any]:
    """A Qwen3.5 ``text_config`` preset: :data:`_HYBRID_COMMON`, the published ``rope_parameters``, vocab 248320."""
    return {**_HYBRID_COMMON, "rope_parameters": dict(_QWEN3_5_ROPE), "vocab_size": 248320, **fields}


# Sources (code search index, 2026-12-02; no model hub is reachable here):
#   [slime]  THUDM/slime scripts/models/qwen3.5-{0.8B,35B-A3B,397B-A17B}.sh, qwen3-next-80B-A3B.sh (Megatron
#            args: layers, hidden, FFN, MoE FFN, shared expert FFN, heads/groups, kv-channels 256, rotary-percent
#            0.25, rotary-base 1e7, norm eps 1e-6, vocab, untied or not, linear-attention heads and dims); qwen3.5-27B.sh
#            as quoted by the search corpus (24 heads / 4 groups, 64 layers, 5120 / 17408).
#   [omega]  p-doom/omegalax, its Qwen3.5 config module: per-size text_config of Qwen/Qwen3.5-{0.8B,2B,4B,9B,27B,
#            35B-A3B,122B-A10B,397B-A17B} (hidden, layers, heads, kv heads, intermediate, linear value heads,
#            tying, experts) over the Qwen3_5TextConfig defaults (vocab 248320, head_dim 256, eps 1e-6, theta 1e7).
#   [2b]     a Rust test "qwen35_2b_hybrid_config_from_hf": the Qwen3.5-2B config.json verbatim (text_config and
#            top-level tie_word_embeddings true, max_position_embeddings 262144, rope_parameters as above).
#   [4b]     an mlx2 admission test of "the local Qwen3.5 4B topology" (config.json: 32 layers, 2560 / 9216,
#            16 / 4 heads of 256, 16 / 32 linear key / value heads, vocab 248320).
#   [9b]     a medrl test "run against the real Qwen3.5-9B config as a fixture": its text_config verbatim.
#   [27b]    a Qwen3_5Config(...) transcription (QwenImageBench) of the 27B config: text_config verbatim.
#   [35b]    mindspore-ai/hyper-parallel qwen3_5_moe defaults "taken from
#            https://huggingface.co/Qwen/Qwen3.5-35B-A3B/blob/main/config.json (text_config)"; a Rust test holding
#            the Qwen3.6-35B-A3B config.json verbatim (same architecture: every field below equal); a "shadowspill"
#            workloads README giving its text parameters, 34,660,610,688.
#   [122b]   a vLLM-Ascend-style test script's qwen3_5_moe_122B config (dim 3072, 48 layers, 32/2 heads, 64 value
#            heads, 256 experts top-8, MoE and shared FFN 1024); [omega]; an MLX gather-mm benchmark's
#            (3072, 1024, 256, 8) for qwen3.5-122b-a10b.
#   [397b]   a flash-pack model_config() of Qwen3.5-397B-A17B (60 layers, 4096, 32/2 heads, 512 experts top-10,
#            MoE and shared FFN 1024, 64 value heads) and a MoE table keyed "Qwen/Qwen3.5-397B-A17B" (same
#            values); [omega]. A Megatron-Bridge test fixture gives shared_expert_intermediate_size 4096 instead:
#            outvoted three to one (and by the A17B active count), not used.
#   [next]   a source-reading note's "Qwen/Qwen3-Next-80B-A3B-Instruct" config.json copy (every field except
#            num_hidden_layers / vocab_size, which that copy cut to 1 / 1519 for printing); a fixture comment on
#            revision 9c7f2fbe (intermediate 2.5x hidden, theta 1e7, factor 0.25, eps 1e-6, untied); [slime] (48
#            layers, vocab 151936). Qwen3-Coder-Next's config.json differs (rope_theta 5e6), not this preset.
# Not found verbatim: max_position_embeddings of 0.8B/4B/122B/397B (262144 in every Qwen3.5 config seen, used
# here); tie_word_embeddings of 4B ([omega]: true) and 122B ([omega]: false).
_HYBRID_PRESETS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3.5-0.8B: [omega], [slime] (no --untie-embeddings flag: tied); 1024 / 3584, 24 layers, 8 heads / 2 KV,
    # 16 value heads.
    "qwen3.5-0.8b": _qwen3_5(
        model_type="qwen3_5_text", hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, linear_num_value_heads=16, tie_word_embeddings=True,
    ),
    # Qwen/Qwen3.5-2B (verl's nightly NPU recipe): [2b] verbatim, [omega].
    "qwen3.5-2b": _qwen3_5(
        model_type="qwen3_5_text", hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, linear_num_value_heads=16, tie_word_embeddings=True,
    ),
    # Qwen/Qwen3.5-4B: [4b], [omega]; 2560 / 9216, 32 layers, 16 heads / 4 KV, 32 value heads, tied ([omega] only).
    "qwen3.5-4b": _qwen3_5(
        model_type="qwen3_5_text", hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32, tie_word_embeddings=True,
    ),
    # Qwen/Qwen3.5-9B: [9b] verbatim, [omega]; 4096 / 12288, 32 layers, 16 heads / 4 KV, 32 value heads, untied.
    "qwen3.5-9b": _qwen3_5(
        model_type="qwen3_5_text", hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32, tie_word_embeddings=False,
    ),
    # Qwen/Qwen3.5-27B: [27b] verbatim, [slime], [omega]; 5120 / 17408, 64 layers, 24 heads / 4 KV, 48 value heads.
    "qwen3.5-27b": _qwen3_5(
        model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48, tie_word_embeddings=False,
    ),
    # Qwen/Qwen3.5-35B-A3B (verl's FSDP NPU recipe): [35b], [slime], [omega]; 40 layers of 2048, 16 heads / 2 KV,
    # 32 value heads, 256 experts of 512 (top-8), shared expert 512 (every layer sparse), untied. Its text_config
    # has no intermediate_size (Qwen3_5MoeTextConfig has no such field).
    "qwen3.5-35b-a3b": _qwen3_5(
        model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
        num_key_value_heads=2, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, tie_word_embeddings=False,
    ),
    # Qwen/Qwen3.5-122B-A10B (verl's Megatron recipe): [122b], [omega]; untied.
    "qwen3.5-122b-a10b": _qwen3_5(
        model_type="qwen3_5_moe_text", hidden_size=3072, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=2, linear_num_value_heads=64, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=1024, shared_expert_intermediate_size=1024, tie_word_embeddings=False,
    ),
    # Qwen/Qwen3.5-397B-A17B: [397b], [slime], [omega]; untied.
    "qwen3.5-397b-a17b": _qwen3_5(
        model_type="qwen3_5_moe_text", hidden_size=4096, num_hidden_layers=60, num_attention_heads=32,
        num_key_value_heads=2, linear_num_value_heads=64, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=1024, shared_expert_intermediate_size=1024, tie_word_embeddings=False,
    ),
    # Qwen/Qwen3-Next-80B-A3B-Instruct (verl's FSDP NPU recipe; -Base and -Thinking share every field here): [next],
    # [slime]. The 4.57-era spelling (rope_theta, partial_rotary_factor; transformers 5.x folds them into
    # rope_parameters). intermediate_size 5120 is the dense MLP of mlp_only_layers (none): unused.
    "qwen3-next-80b-a3b": {
        **_HYBRID_COMMON, "model_type": "qwen3_next", "hidden_size": 2048, "intermediate_size": 5120,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "linear_num_value_heads": 32,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "vocab_size": 151936, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
        "tie_word_embeddings": False,
    },
}
PRESETS.update(_HYBRID_PRESETS)
