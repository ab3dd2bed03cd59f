"""The attention family (SDPA and the eager chain -> ``npu_fusion_attention``; packed sequences ->
``qwen_npu.varlen_attention``), one package whose modules depend one way (each imports only those above it
in this list)::

    spellings   the variant table (SPELLINGS), the search side; row -> variant
    masks       proving, converting and sharing attention masks
    packed      the proof that a mask is the packed causal mask of the position ids   (masks)
    dense       a row's replacement (one npu_fusion_attention call) and check         (spellings, masks)
    varlen      the packed-sequence variants and their replacement (varlen_attention) (spellings, dense, packed)
    family      AttentionFamily and its pass                                          (all of the above)

The package exports the family's public names below; everything else is imported from its module.
"""

from __future__ import annotations

from .dense import check_attention, fused_attention
from .family import (
    TAKEOVER_VARIANT,
    AttentionFamily,
    AttentionPass,
    count_varlen_takeovers,
    is_linear_logits_softmax,
    spell_key_transposes,
)
from .spellings import SPELLINGS, Spelling, row_variant

__all__ = [
    "SPELLINGS", "TAKEOVER_VARIANT", "AttentionFamily", "AttentionPass", "Spelling", "check_attention",
    "count_varlen_takeovers", "fused_attention", "is_linear_logits_softmax", "row_variant", "spell_key_transposes",
]
