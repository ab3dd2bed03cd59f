"""Stage 2, fuse: a pass per enabled family over the canonical ATen graph; the families themselves are the
top-level ``patterns/`` folder (installed as :mod:`qwen_npu_compile.patterns`).

* :mod:`.manager` -- :class:`~.manager.FusionPasses` (the passes a config enables, in the registry's order),
  :func:`~.manager.fuse`, :class:`~.manager.FuseResult`; a pass that raises is named by
  :class:`~.manager.FusionPassError`.
* :mod:`.family` -- what a family is made of: :class:`~.family.FusionFamily`, :class:`~.family.PatternVariant`
  (one spelling, its replacement, its check, the :class:`~.family.CheckDecision` objects its replacement reads),
  :class:`~.family.FamilyPass` (lazy registration on Inductor's pattern matcher, exact per-variant counts),
  refusals with their reasons, and the pattern helpers.
* :mod:`.near_miss` -- anchor ops that belong to another computation, left out of a family's near misses.
"""
