"""Every registered pattern variant of every family fuses some realistic graph.

A variant nothing matches is dead weight or a gap in the tests. Two sources of evidence, each compiled
from transformers' real modeling code (tiny random configs, nothing from a model hub):

* The attention family's variants are the rows of its declarative table (``patterns/attention.py:
  SPELLINGS``). ``tests/patterns/test_attention_variants.py`` compiles every row alone on transformers'
  own ``sdpa_attention_forward`` / ``eager_attention_forward`` in the setting its ``why`` names (GQA
  switch, mask kind, dropout, symbolic length) and asserts that row, not an earlier one, fuses it. Here
  the test only asserts that the family declares exactly the table's rows, so a variant added outside
  the table fails.
* Every other family's variants (RMSNorm, SwiGLU, rotary) must match in a small corpus of whole-model
  graphs (1 decoder layer) captured by Dynamo, canonicalized and fused with the public
  :func:`qwen_npu_compile.fusion.manager.fuse`; the applied replacements are counted per variant
  (:attr:`FuseResult.variants`) and pinned exactly per case, the attention rows included (one whole-model
  graph per attention implementation, static and dynamic, training and a KV-cache decode step).

The checks run for an Ascend host handing off to aot_eager (``CompileTarget("aot_eager",
simulated=False)``). Nothing fused runs here: the backend returns Dynamo's graph unchanged.

The corpus is built for the primary stack (``requirements.txt``: transformers 5.24.0). Older
transformers (5.10.4, 4.57.6 measured) build an explicit mask for KV-cache steps under torch.compile,
so their decode step hits other attention rows; the test runs on 5.24 and newer only.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
import transformers
from packaging.version import Version

from qwen_npu_compile.config import QwenNpuConfig
from qwen_npu_compile.fusion.family import CompileTarget
from qwen_npu_compile.fusion.manager import FuseResult, fuse
from qwen_npu_compile.graph import canonicalize
from qwen_npu_compile.patterns import FAMILIES, attention, get_family_pass
from qwen_npu_compile.substitutions import deltanet

pytestmark = pytest.mark.skipif(
    Version(transformers.__version__).release < (5, 24),
    reason="the corpus reproduces transformers >= 5.24 graphs (a mask-free KV-cache decode step)",
)

TARGET = CompileTarget("aot_eager", simulated=False)
CONFIG = QwenNpuConfig()  # every family
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=256, use_cache=False)  # fmt: skip
MHA = dict(TINY, num_key_value_heads=4)

#: Variants no graph of the corpus reaches, with why they are kept. The test fails when one of them
#: starts matching (then remove it here) and when a variant outside this list matches nothing.
UNMATCHED: dict[str, str] = {}  # none: swiglu_linear_silu_right and rotary_bnsd matched nothing and were removed


@dataclasses.dataclass(frozen=True)
class Case:
    """One graph of the corpus: a 1-layer tiny model (hidden 64, 4 heads) run once under torch.compile."""

    config: dict
    attn: str
    dtype: torch.dtype
    train: bool
    dynamic: bool = False
    run: str = "forward"  # "forward" (no KV cache), "prefill" (empty cache), "decode" (1 token after a prefill)
    model: str = "qwen2"  # a key of MODELS


#: Model families of the corpus besides Qwen2, for the MLP spellings Qwen2 does not have.
MODELS = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    # LlamaMLP with mlp_bias=True: gate/up linears with a bias, so only silu(gate) * up matches
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    # Phi3MLP: gate, up = gate_up_proj(x).chunk(2, -1); up * silu(gate), the commuted product ; its
    # apply_rotary_pos_emb rotates q[..., :rotary_dim] and cats the rest back: no rotary variant for that
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    # MoE experts (grouped_mm, transformers >= 5): aten._grouped_mm in bf16, grouped_mm_fallback in fp32
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    # Qwen3.5 (1 layer: a Gated DeltaNet layer): (1 + w) RMSNorms and the gated RMSNorm
    # (transformers >= 5; on 4.57 the file is collected by the stack matrix, which runs none of its cases)
    "qwen3_5": (getattr(transformers, "Qwen3_5TextConfig", None), getattr(transformers, "Qwen3_5ForCausalLM", None)),
}
MOE = dict(TINY, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
QWEN3_5 = dict(TINY, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=16)  # fmt: skip


BF16, FP32 = torch.bfloat16, torch.float32
#: name -> (case, the variants its graphs fuse, with counts). The non-attention variants each appear in
#: at least one case; each attention implementation appears in a whole-model graph.
CASES: dict[str, tuple[Case, dict[str, int]]] = {
    # training with transformers' explicit mask: bf16 norms, the linear SwiGLU form, rotary, repeat_kv'd SDPA
    "sdpa_bf16_train": (
        Case(TINY, "sdpa", BF16, True),
        {"rms_norm_half": 3, "swiglu_linear_silu_left": 1, "rotary_bsnd": 2, "sdpa_mask_repeat_kv": 1},
    ),
    # the same under a symbolic sequence length (eps and sizes become graph inputs)
    "sdpa_dynamic": (
        Case(TINY, "sdpa", BF16, True, dynamic=True),
        {"rms_norm_half": 3, "swiglu_linear_silu_left": 1, "rotary_bsnd": 2, "sdpa_mask_repeat_kv_symbolic": 1},
    ),
    # fp32 norms; MHA
    "sdpa_mha_fp32": (
        Case(MHA, "sdpa", FP32, False),
        {"rms_norm_fp32": 3, "swiglu_linear_silu_left": 1, "rotary_bsnd": 2, "sdpa_mask_mha": 1},
    ),
    # KV-cache decode step (1 token after a prefill): SDPA without a mask
    "sdpa_decode": (
        Case(TINY, "sdpa", FP32, False, run="decode"),
        {"rms_norm_fp32": 3, "swiglu_linear_silu_left": 1, "rotary_bsnd": 2, "sdpa_none_gqa": 1},
    ),
    # LlamaMLP with mlp_bias=True: gate/up linears with a bias, so only silu(gate) * up matches
    "llama_mlp_bias": (
        Case(dict(TINY, mlp_bias=True), "sdpa", FP32, False, model="llama"),
        {"rms_norm_fp32": 3, "swiglu_silu_left": 1, "rotary_bsnd": 2, "sdpa_mask_repeat_kv": 1},
    ),
    # Phi3MLP: gate, up = gate_up_proj(x).chunk(2, -1); up * silu(gate), the commuted product ; its
    # apply_rotary_pos_emb rotates q[..., :rotary_dim] and cats the rest back: no rotary variant for that
    "phi3": (
        Case(dict(TINY, pad_token_id=0, eos_token_id=1, bos_token_id=1), "sdpa", FP32, False, model="phi3"),
        {"rms_norm_fp32": 3, "swiglu_silu_right": 1, "sdpa_mask_repeat_kv": 1},
    ),
    # Qwen3-MoE's bf16 experts (aten._grouped_mm): gate_up + activation, down; q_norm/k_norm
    "qwen3_moe_bf16_train": (
        Case(MOE, "sdpa", BF16, True, model="qwen3_moe"),
        {"rms_norm_half": 5, "moe_grouped_mm_swiglu": 1, "moe_grouped_mm": 1, "rotary_bsnd": 2, "sdpa_mask_repeat_kv": 1},
    ),
    # Qwen2-MoE's fp32 experts (transformers::grouped_mm_fallback) and its shared expert (plain linears)
    "qwen2_moe_fp32": (
        Case(dict(MOE, shared_expert_intermediate_size=64), "sdpa", FP32, False, model="qwen2_moe"),
        {"rms_norm_fp32": 3, "moe_fallback_swiglu": 1, "moe_fallback": 1, "swiglu_linear_silu_left": 1,
         "rotary_bsnd": 2, "sdpa_mask_repeat_kv": 1},
    ),
    # Qwen3.5's linear-attention layer: (1 + w) norms (input, post-attention, final) and the DeltaNet's gated norm
    "qwen3_5_bf16_train": (
        Case(QWEN3_5, "sdpa", BF16, True, model="qwen3_5"),
        {"rms_norm_one_plus_weight_half": 3, "rms_norm_gated_half": 1, "swiglu_linear_silu_left": 1},
    ),
    "qwen3_5_fp32": (
        Case(QWEN3_5, "sdpa", FP32, False, model="qwen3_5"),
        {"rms_norm_one_plus_weight_fp32": 3, "rms_norm_gated_fp32": 1, "swiglu_linear_silu_left": 1},
    ),
    # Qwen3.5's full-attention layer: partial rotary (rotated width head_dim / 4) after the q/k (1 + w) norms,
    # gated attention (q_proj -> query and gate)
    "qwen3_5_full_attention_fp32": (
        Case(dict(QWEN3_5, layer_types=["full_attention"]), "sdpa", FP32, False, model="qwen3_5"),
        {"rms_norm_one_plus_weight_fp32": 5, "swiglu_linear_silu_left": 1, "rotary_partial_bsnd": 2,
         "sdpa_mask_repeat_kv": 1},
    ),
    # eager_attention_forward (repeat_kv, additive mask) in training
    "eager_bf16_train": (
        Case(TINY, "eager", BF16, True),
        {"rms_norm_half": 3, "swiglu_linear_silu_left": 1, "rotary_bsnd": 2, "eager_repeat_kv_bf16_train": 1},
    ),
}


@pytest.fixture(scope="module")
def corpus(npu_ops) -> dict[str, list[FuseResult]]:
    """Fuse every case once; per case, the fuse result of each graph Dynamo captured."""
    return {name: _fuse_case(case) for name, (case, _) in CASES.items()}


def _fuse_case(case: Case) -> list[FuseResult]:
    seen: list[FuseResult] = []

    def backend(gm, example_inputs):
        aten_gm = canonicalize.to_aten_graph(gm, example_inputs)
        seen.append(fuse(aten_gm, CONFIG, target=TARGET))
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    config_class, model_class = MODELS[case.model]
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {case.model}")
    config = config_class(**{**case.config, "use_cache": case.run != "forward"})
    model = model_class._from_config(config, attn_implementation=case.attn).to(case.dtype)
    model.train(case.train)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend=backend, dynamic=case.dynamic or None)
    # the corpus is the FX pattern variants': the Gated DeltaNet is traced as transformers' Python, whatever an earlier
    # test of this process left installed (its substitution, a trace-time step, is tested by the DeltaNet files)
    with torch.set_grad_enabled(case.train), deltanet.switched(False):
        if case.run == "decode":
            cache = model(input_ids=ids, use_cache=True).past_key_values
            compiled(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
        else:
            compiled(input_ids=ids, use_cache=case.run == "prefill")
    torch._dynamo.reset()
    return seen


def _matched(results: list[FuseResult]) -> Counter[str]:
    matched: Counter[str] = Counter()
    for result in results:
        matched.update(result.variants)
    return matched


def _declared(family: str) -> list[str]:
    return [variant.name for variant in get_family_pass(family).declared_variants]


@pytest.mark.parametrize("name", sorted(CASES))
def test_case_fuses_exactly_its_variants(corpus, name):
    assert corpus[name], f"{name}: no graph captured"
    assert dict(_matched(corpus[name])) == CASES[name][1]


def test_every_registered_variant_matches_a_realistic_graph(corpus):
    matched = sum((_matched(results) for results in corpus.values()), Counter())
    declared = [name for family in FAMILIES if family != "attention" for name in _declared(family)]
    unmatched = [name for name in declared if matched[name] == 0 and name not in UNMATCHED]
    assert unmatched == [], f"variants no graph of the corpus matches (dead, or add the graph they exist for): {unmatched}"
    stale = [name for name in UNMATCHED if matched[name] > 0 or name not in declared]
    assert stale == [], f"listed as unmatched but matched (or no longer declared): {stale}"


def test_attention_declares_exactly_its_table_rows(npu_ops):
    """Each row is compiled alone on transformers' attention functions by test_attention_variants.py; the
    packed-sequence variants come first, one per row a packed graph shows (test_attention_varlen.py)."""
    from qwen_npu_compile.patterns.attention import varlen as attention_varlen

    varlen = [attention_varlen.variant_name(row) for row in attention_varlen.VARLEN_ROWS]
    assert _declared("attention") == varlen + [row.name for row in attention.SPELLINGS]


def test_variant_counts_add_up_to_the_fusions(corpus):
    families_of = {variant: family for family in FAMILIES for variant in _declared(family)}
    for name, results in corpus.items():
        for result in results:
            per_family = Counter()
            for variant, count in result.variants.items():
                per_family[families_of[variant]] += count
            assert {f: per_family[f] for f in result.fusions} == result.fusions, (name, result.variants)
