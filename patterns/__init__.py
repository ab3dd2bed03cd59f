"""Fusion families, one file each; installed as the subpackage ``qwen_npu_compile.patterns``.

:data:`FAMILIES` is the explicit registry (no import-time side effects): family name -> class.
See ``README.md`` in this folder for how to add a family.
"""

from __future__ import annotations

import functools

from qwen_npu_compile.config import ALL_FAMILIES
from qwen_npu_compile.fusion import FamilyPass, FusionFamily

from .attention import AttentionFamily
from .rms_norm import RmsNormFamily
from .rotary import RotaryFamily
from .swiglu import SwiGluFamily

FAMILIES: dict[str, type[FusionFamily]] = {
    RmsNormFamily.name: RmsNormFamily,
    SwiGluFamily.name: SwiGluFamily,
    RotaryFamily.name: RotaryFamily,
    AttentionFamily.name: AttentionFamily,
}

assert tuple(FAMILIES) == ALL_FAMILIES, "config.ALL_FAMILIES must list the families of FAMILIES in pass order"


@functools.cache
def get_family_pass(name: str) -> FamilyPass:
    """The process-wide pass of family ``name`` (its patterns are registered once, at first apply): the
    family's ``pass_class`` (a :class:`FamilyPass` subclass, e.g. rms_norm's add-fusing pass) or FamilyPass.

    Raises:
        KeyError: ``name`` is not in :data:`FAMILIES`.
    """
    family = FAMILIES[name]
    return getattr(family, "pass_class", FamilyPass)(family())
