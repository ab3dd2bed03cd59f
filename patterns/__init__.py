"""Fusion families, one file each; installed as the subpackage ``qwen_npu_compile.patterns``.

:data:`FAMILIES` is the explicit registry (no import-time side effects): family name -> class, in
pass order, the order of the one list of names :data:`qwen_npu_compile.config.ALL_FAMILIES` (torch-free, so the
command line lists families without importing torch). Everything else about the families is derived from their
classes here: :func:`expected_fusions` (what a model config
must give, used by ``check`` and the tests) and :func:`backward_ops` (the fused backward op per
family). See ``README.md`` in this folder for how to add a family.

Import graph: this package imports :mod:`qwen_npu_compile.config`, :mod:`qwen_npu_compile.fusion` and the ops
(tests/test_layers.py holds the layering).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from qwen_npu_compile.config import ALL_FAMILIES
from qwen_npu_compile.fusion.family import FamilyPass, FusionFamily

from .attention import AttentionFamily
from .gated_delta_rule import GatedDeltaRuleFamily
from .moe import MoeFamily
from .rms_norm import RmsNormFamily
from .rms_norm_gated import RmsNormGatedFamily
from .rotary import RotaryFamily
from .swiglu import SwiGluFamily

_CLASSES = {family.name: family for family in (
    GatedDeltaRuleFamily, RmsNormGatedFamily, RmsNormFamily, MoeFamily, SwiGluFamily, RotaryFamily, AttentionFamily)}
if set(_CLASSES) != set(ALL_FAMILIES):  # a family added in one place only: fail at import, not at the first compile
    raise ImportError(f"qwen_npu_compile.config.ALL_FAMILIES {list(ALL_FAMILIES)} and the family classes "
                      f"{sorted(_CLASSES)} differ: declare a new family in both")
#: Every fusion family, in pass order (:data:`qwen_npu_compile.config.ALL_FAMILIES`).
FAMILIES: dict[str, type[FusionFamily]] = {name: _CLASSES[name] for name in ALL_FAMILIES}


@functools.cache
def get_family_pass(name: str) -> FamilyPass:
    """The process-wide pass of family ``name`` (a variant is registered once, when a graph first
    needs it): the family's ``pass_class`` (a :class:`FamilyPass` subclass, e.g. rms_norm's
    add-fusing pass) or FamilyPass.

    Raises:
        KeyError: ``name`` is not in :data:`FAMILIES`.
    """
    return FAMILIES[name]().make_pass()


def expected_fusions(model_config: Any, families: Iterable[str] | None = None, *, per_layer: bool = False,
                     layer_type: str | None = None) -> dict[str, int]:
    """Fusions a model of ``model_config`` must give, per family, in pass order.

    Whole model: RMSNorm 2 per decoder layer (4 with Qwen3's q_norm/k_norm) + the final norm,
    SwiGLU 1, rotary 2 (q and k), attention 1 per layer. ``per_layer``: one decoder layer's graph
    (``maybe_compile``): the same without the final norm.

    Args:
        model_config: a transformers ``PretrainedConfig`` (``model_type``; ``num_hidden_layers`` for the
            whole model), or a multimodal model's top-level config (``Qwen3_5Config`` of
            ``Qwen3_5ForConditionalGeneration``, ``Qwen2_5_VLConfig``): its ``text_config`` is read, the decoder
            layers that ``maybe_compile`` compiles (the vision tower is not counted).
        families: the enabled families (any order); None means all of :data:`FAMILIES`.
        per_layer: count one decoder layer instead of the whole model.
        layer_type: with ``per_layer``, the layer's kind in a hybrid model (Qwen3.5 / Qwen3-Next:
            ``"linear_attention"`` or ``"full_attention"``, the config's ``layer_types`` entry).

    Returns:
        ``{family: count}`` for the enabled families, e.g. ``{"rms_norm": 5, "swiglu": 2, "rotary": 4,
        "attention": 2}`` for a 2-layer Qwen2.

    Raises:
        KeyError: an unknown family name in ``families``.
    """
    model_config = getattr(model_config, "text_config", None) or model_config
    enabled = set(FAMILIES) if families is None else set(families)
    unknown = sorted(enabled - set(FAMILIES))
    if unknown:
        raise KeyError(f"unknown fusion famil{'y' if len(unknown) == 1 else 'ies'} {unknown}; known: {list(FAMILIES)}")
    return {
        name: family.expected_count(model_config, per_layer=per_layer, layer_type=layer_type)
        for name, family in FAMILIES.items() if name in enabled
    }  # fmt: skip


def backward_ops() -> dict[str, str]:
    """Per family, the npu op that must reach the AOT backward graph once per fusion (training):
    ``{"rms_norm": "npu_rms_norm_backward", ...}``, in pass order."""
    return {name: family.backward_op_name for name, family in FAMILIES.items()}
