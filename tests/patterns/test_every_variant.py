"""Every registered pattern variant of every family fuses some realistic graph.

A variant nothing matches is dead weight or a gap in the tests. So a small corpus of graphs from
transformers' real modeling code (tiny random configs, 1 decoder layer) is captured by Dynamo,
canonicalized and fused with the public :func:`qwen_npu_compile.fuse.fuse`, and the applied
replacements are counted per variant (:attr:`FuseResult.variants`). The test iterates the registry
(``qwen_npu_compile.patterns.FAMILIES``), so a new variant must bring the graph it exists for.

The checks run for an Ascend host handing off to aot_eager (``CompileTarget("aot_eager",
simulated=False)``): the simulated kernels refuse training dropout in attention (their dropout mask
is not random), the real ones do not, and the dropout variants exist for them. Nothing fused runs here:
the backend returns Dynamo's graph unchanged.

The corpus is built for the primary stack (``requirements.txt``: transformers 5.24.0). Older
transformers (5.10.4, 4.57.6 measured) build an explicit mask for KV-cache steps under torch.compile
too, so there the mask-free SDPA variants (``sdpa_causal_*``, ``sdpa_none_*``) match nothing and
``TRANSFORMERS_SDPA_FORCE_GQA`` does not exist; the test runs on 5.24 and newer only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import Counter
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import transformers
from packaging.version import Version

from qwen_npu_compile import canonicalize
from qwen_npu_compile.config import QwenNpuConfig
from qwen_npu_compile.fuse import FuseResult, fuse
from qwen_npu_compile.fusion import CompileTarget
from qwen_npu_compile.patterns import FAMILIES, get_family_pass

pytestmark = pytest.mark.skipif(
    Version(transformers.__version__).release < (5, 24),
    reason="the corpus reproduces transformers >= 5.24 graphs (mask-free KV-cache steps, TRANSFORMERS_SDPA_FORCE_GQA)",
)

TARGET = CompileTarget("aot_eager", simulated=False)
CONFIG = QwenNpuConfig()  # every family
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=256, use_cache=False)  # fmt: skip
MHA = dict(TINY, num_key_value_heads=4)

#: Variants no graph of the corpus reaches, with why they are kept. The test fails when one of them
#: starts matching (then remove it here) and when a variant outside this list matches nothing.
UNMATCHED: dict[str, str] = {}  # none: swiglu_linear_silu_right and rotary_bnsd matched nothing and were removed


@contextlib.contextmanager
def _force_gqa():
    """``TRANSFORMERS_SDPA_FORCE_GQA=1``, transformers' switch (XPU and MPS do it by default): enable_gqa with a mask."""
    with mock.patch.dict(os.environ, {"TRANSFORMERS_SDPA_FORCE_GQA": "1"}):
        yield


@dataclasses.dataclass(frozen=True)
class Case:
    """One graph of the corpus: a 1-layer tiny model (hidden 64, 4 heads) run once under torch.compile."""

    config: dict
    attn: str
    dtype: torch.dtype
    train: bool
    dynamic: bool = False
    run: str = "forward"  # "forward" (no KV cache), "prefill" (empty cache), "decode" (1 token after a prefill)
    context: Callable[[], contextlib.AbstractContextManager] | None = None
    model: str = "qwen2"  # a key of MODELS


#: Model families of the corpus besides Qwen2, for the MLP spellings Qwen2 does not have.
MODELS = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    # LlamaMLP with mlp_bias=True: gate/up linears with a bias, so only silu(gate) * up matches
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    # Phi3MLP: gate, up = gate_up_proj(x).chunk(2, -1); up * silu(gate), the commuted product
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
}


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DROPOUT = dict(TINY, attention_dropout=0.1)
MHA_DROPOUT = dict(MHA, attention_dropout=0.1)
CASES: dict[str, Case] = {
    # SDPA with transformers' explicit mask (training, log-prob forwards)
    "sdpa_bf16_train": Case(TINY, "sdpa", BF16, True),
    "sdpa_dynamic": Case(TINY, "sdpa", BF16, True, dynamic=True),
    "sdpa_mha": Case(MHA, "sdpa", FP32, False),
    "sdpa_dropout": Case(DROPOUT, "sdpa", FP32, True),
    "sdpa_dropout_dynamic": Case(DROPOUT, "sdpa", FP32, True, dynamic=True),
    "sdpa_mha_dropout": Case(MHA_DROPOUT, "sdpa", FP32, True),
    "sdpa_force_gqa": Case(TINY, "sdpa", FP32, False, context=_force_gqa),
    "sdpa_force_gqa_dropout": Case(DROPOUT, "sdpa", FP32, True, context=_force_gqa),
    # SDPA without a mask: generation with a KV cache (prefill is_causal, decode neither)
    "sdpa_prefill": Case(TINY, "sdpa", FP32, False, run="prefill"),
    "sdpa_decode": Case(TINY, "sdpa", FP32, False, run="decode"),
    "sdpa_prefill_mha": Case(MHA, "sdpa", FP32, False, run="prefill"),
    "sdpa_decode_mha": Case(MHA, "sdpa", FP32, False, run="decode"),
    "sdpa_prefill_dropout": Case(DROPOUT, "sdpa", FP32, True, run="prefill"),
    "sdpa_prefill_mha_dropout": Case(MHA_DROPOUT, "sdpa", FP32, True, run="prefill"),
    # MLP spellings of other models
    "llama_mlp_bias": Case(dict(TINY, mlp_bias=True), "sdpa", FP32, False, model="llama"),
    "phi3": Case(dict(TINY, pad_token_id=0, eos_token_id=1, bos_token_id=1), "sdpa", FP32, False, model="phi3"),
    # eager_attention_forward: GQA (repeat_kv), under a symbolic S, MHA; each dtype, train and eval dropout
    **{
        f"eager_{kv}_{label}_{'train' if train else 'infer'}": Case(
            MHA if kv == "mha" else TINY, "eager", dtype, train, dynamic=kv == "symbolic"
        )
        for kv in ("gqa", "symbolic", "mha")
        for label, dtype in (("bf16", BF16), ("fp16", FP16), ("fp32", FP32))
        for train in (True, False)
    },
}


@pytest.fixture(scope="module")
def corpus(npu_ops) -> dict[str, list[FuseResult]]:
    """Fuse every case once; per case, the fuse result of each graph Dynamo captured."""
    results: dict[str, list[FuseResult]] = {}
    for name, case in CASES.items():
        results[name] = _fuse_case(case)
    return results


def _fuse_case(case: Case) -> list[FuseResult]:
    seen: list[FuseResult] = []

    def backend(gm, example_inputs):
        aten_gm = canonicalize.to_aten_graph(gm, example_inputs)
        seen.append(fuse(aten_gm, CONFIG, target=TARGET))
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    config_class, model_class = MODELS[case.model]
    config = config_class(**{**case.config, "use_cache": case.run != "forward"})
    model = model_class._from_config(config, attn_implementation=case.attn).to(case.dtype)
    model.train(case.train)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend=backend, dynamic=case.dynamic or None)
    context = case.context() if case.context is not None else contextlib.nullcontext()
    with context, torch.set_grad_enabled(case.train):
        if case.run == "decode":
            cache = model(input_ids=ids, use_cache=True).past_key_values
            compiled(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
        else:
            compiled(input_ids=ids, use_cache=case.run == "prefill")
    torch._dynamo.reset()
    return seen


def _matched(corpus) -> Counter[str]:
    matched: Counter[str] = Counter()
    for results in corpus.values():
        for result in results:
            matched.update(result.variants)
    return matched


def test_every_registered_variant_matches_a_realistic_graph(corpus):
    matched = _matched(corpus)
    declared = [variant.name for family in FAMILIES for variant in get_family_pass(family).declared_variants]
    unmatched = [name for name in declared if matched[name] == 0 and name not in UNMATCHED]
    assert unmatched == [], f"variants no graph of the corpus matches (dead, or add the graph they exist for): {unmatched}"
    stale = [name for name in UNMATCHED if matched[name] > 0 or name not in declared]
    assert stale == [], f"listed as unmatched but matched (or no longer declared): {stale}"


def test_variant_counts_add_up_to_the_fusions(corpus):
    families_of = {variant.name: family for family in FAMILIES for variant in get_family_pass(family).declared_variants}
    for name, results in corpus.items():
        assert results, f"{name}: no graph captured"
        for result in results:
            per_family = Counter()
            for variant, count in result.variants.items():
                per_family[families_of[variant]] += count
            assert {f: per_family[f] for f in result.fusions} == result.fusions, (name, result.variants)
