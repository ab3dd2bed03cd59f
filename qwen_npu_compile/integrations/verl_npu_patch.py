"""verl's ``npu_patch`` and the ``qwen_npu`` families: compiled decoder layers see transformers' own code.

On an Ascend host verl's ``FSDPEngine.__init__`` calls ``apply_npu_fsdp_patches`` (``verl/workers/engine/
fsdp/utils.py``), which runs ``verl.models.transformers.npu_patch.apply_npu_patches``: every entry of its
``NPU_PATCHES`` dict (model type -> patch function) replaces module-class forwards and ``apply_rotary_pos_emb``
of a transformers modeling module with hand-fused ones (``npu_rms_norm``, ``npu_swiglu(cat(gate, up))``,
``npu_rotary_mul``, the MoE block on ``NPUGmmFunction``, the Qwen3.5 norms on an fp32 copy). That runs
*before* ``qwen_npu_compile.verl`` compiles the decoder layers, so Dynamo would capture verl's forms: a Qwen2
layer then fuses attention only, a Qwen3-MoE layer compiles unfused (``NPUGmmFunction`` is a custom
``autograd.Function``), a Qwen3.5 keeps verl's eager fp32 gated norm.

With ``QWEN_NPU_COMPILE=1`` (:func:`take_over`, installed by :mod:`qwen_npu_compile.verl` when
verl imports ``npu_patch``) each patch function of ``NPU_PATCHES`` still runs, and then every name it changed
that a switched-on ``qwen_npu`` family fuses from transformers' own code (:data:`TAKEN_OVER`) becomes a
dispatcher: inside a Dynamo capture (``torch.compiler.is_compiling()``) it calls transformers' original, which
the family rewrites into its fused op; everywhere else (the final norm outside the decoder layers, a layer that
runs eagerly, a graph break's eager part) it calls verl's patched function, so nothing runs slower than with
verl alone. Names outside :data:`TAKEN_OVER` (the VL models), and names whose family
``QWEN_NPU_FUSIONS`` switches off, stay verl's: there verl's fused op is better than nothing, and a compiled
graph counts it in its report's ``already_fused`` (for a switched-on family). One INFO line per
``apply_npu_patches`` call names what was taken over and what stays verl's.

Nothing here imports verl or torch_npu; verl's functions are found on the ``npu_patch`` module it imported.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
from collections.abc import Callable, Mapping

import torch

from qwen_npu_compile.worker import compile_requested

from ..config import ENV_FUSIONS, parse_fusions

log = logging.getLogger("qwen_npu_compile")

#: verl's module holding the patches (verl 0.9.1 ``verl/models/transformers/npu_patch.py``).
NPU_PATCH_MODULE = "verl.models.transformers.npu_patch"
#: Its dict of model type -> patch function, and the function that runs them all (``apply_npu_fsdp_patches``).
PATCHES_NAME = "NPU_PATCHES"
APPLY_NAME = "apply_npu_patches"
#: Marks a function this module installed: ``(transformers' original, verl's)`` for a dispatcher, True else.
_MARK = "__qwen_npu_takeover__"


@dataclasses.dataclass(frozen=True)
class Target:
    """A name a verl patch function sets in ``transformers.models.<model>.modeling_<model>``.

    Attributes:
        owner: the class whose attribute it is; None for a module-level function (``apply_rotary_pos_emb``).
        name: the attribute (``"forward"``) or function name.
        family: the ``qwen_npu`` family that fuses transformers' own form of it.
    """

    owner: str | None
    name: str
    family: str

    @property
    def label(self) -> str:
        return f"{self.owner}.{self.name}" if self.owner else self.name


def _dense(prefix: str) -> tuple[Target, ...]:
    return (Target(f"{prefix}RMSNorm", "forward", "rms_norm"), Target(f"{prefix}MLP", "forward", "swiglu"),
            Target(None, "apply_rotary_pos_emb", "rotary"))


def _hybrid(prefix: str) -> tuple[Target, ...]:
    return (Target(f"{prefix}RMSNormGated", "forward", "rms_norm_gated"),
            Target(f"{prefix}RMSNorm", "forward", "rms_norm"),
            Target(None, "apply_rotary_pos_emb", "rotary"))


#: Per verl 0.9.1 ``NPU_PATCHES`` key: the names its patch function sets whose transformers form a family fuses
#: in a decoder layer graph (exact per-layer counts with and without verl's patch: tests/integrations/test_verl_npu_patch.py).
#: Everything else a patch function sets stays verl's: ``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_vl_moe`` (not checked
#: per layer against verl's; Qwen2.5-VL's vision blocks share its MLP class; ``qwen3_vl_moe`` replaces the sparse MoE
#: block *class*, which a compiled layer then holds: it compiles unfused, as without the takeover).
TAKEN_OVER: dict[str, tuple[Target, ...]] = {
    "qwen2": _dense("Qwen2"),
    "qwen3": _dense("Qwen3"),
    "qwen3_moe": (Target("Qwen3MoeRMSNorm", "forward", "rms_norm"), Target("Qwen3MoeSparseMoeBlock", "forward", "moe"),
                  Target(None, "apply_rotary_pos_emb", "rotary")),
    "qwen3_5": _hybrid("Qwen3_5"),
    "qwen3_5_moe": (Target("Qwen3_5MoeExperts", "forward", "moe"), *_hybrid("Qwen3_5Moe")),
    "qwen3_next": (Target("Qwen3NextSparseMoeBlock", "forward", "moe"), *_hybrid("Qwen3Next")),
}


@dataclasses.dataclass
class Takeover:
    """What one ``apply_npu_patches`` call left to whom.

    Attributes:
        taken: ``(model type, label, family)`` of each name compiled layers trace in transformers' form.
        verls: ``(model type, label)`` of each other name verl's patch changed (verl's everywhere).
        off: ``(model type, label, family)`` of the names :data:`TAKEN_OVER` lists whose family is switched off.
        skipped: model types whose patch function raised (verl logs it; transformers without that model).
    """

    taken: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    verls: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    off: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)

    def line(self, verl_version: str) -> str:
        """The one INFO line."""

        def grouped(rows) -> str:
            models: dict[str, list[str]] = {}
            for row in rows:
                models.setdefault(row[0], []).append(row[1] + (f" ({row[2]})" if len(row) > 2 else ""))
            return "; ".join(f"{model}: {', '.join(names)}" for model, names in models.items()) or "nothing"

        stays = grouped(self.verls)
        if self.off:
            stays += f"; switched off by {ENV_FUSIONS}: {grouped(self.off)}"
        return (f"qwen_npu: QWEN_NPU_COMPILE=1: verl {verl_version}'s npu_patch kept from the compiled decoder "
                f"layers (they trace transformers' own code, qwen_npu fuses it; eager code keeps verl's): "
                f"{grouped(self.taken)} | stays verl's: {stays}")


#: The record of the latest ``apply_npu_patches`` call (None before any).
last: Takeover | None = None
_current: Takeover | None = None


def dispatcher(original: Callable, verls: Callable) -> Callable:
    """``original`` (transformers') inside a Dynamo capture, ``verls`` (verl's patched function) elsewhere."""

    @functools.wraps(original)
    def compiled_or_verls(*args, **kwargs):
        if torch.compiler.is_compiling():
            return original(*args, **kwargs)
        return verls(*args, **kwargs)

    setattr(compiled_or_verls, _MARK, (original, verls))
    return compiled_or_verls


def _snapshot(module) -> dict[str, object]:
    """``label -> value`` of the module's names and of the attributes of the classes it defines."""
    names: dict[str, object] = {}
    for name, value in vars(module).items():
        names[name] = value
        if isinstance(value, type) and value.__module__ == module.__name__:
            names.update((f"{name}.{attr}", v) for attr, v in vars(value).items())
    return names


def _owner(module, target: Target):
    return module if target.owner is None else getattr(module, target.owner)


def _families(environ: Mapping[str, str]) -> frozenset[str]:
    return parse_fusions(environ.get(ENV_FUSIONS, "all"), f"environment variable {ENV_FUSIONS}")


def _taking_over(key: str, patch: Callable) -> Callable:
    """verl's ``patch`` for model type ``key``, then its :data:`TAKEN_OVER` names as :func:`dispatcher`."""

    @functools.wraps(patch)
    def patch_then_take_over():
        if not compile_requested():
            return patch()
        module = importlib.import_module(f"transformers.models.{key}.modeling_{key}")  # ImportError: verl's skip
        families = _families(os.environ)
        before = _snapshot(module)
        try:
            return patch()
        finally:
            after = _snapshot(module)
            for label, value in after.items():
                previous = before.get(label, _MISSING)
                if previous is value:
                    continue
                previous = getattr(previous, _MARK, (previous,))[0]  # a dispatcher: its transformers original
                _history[key, label] = (_history.get((key, label), (previous,))[0], value)
            _settle(key, module, families, _current if _current is not None else Takeover())

    setattr(patch_then_take_over, _MARK, True)
    return patch_then_take_over


_MISSING = object()
#: ``(model type, label) -> (transformers' original, verl's function)`` of every name a verl patch changed
#: (verl's patch sets the same function again at each call: what it set once is known from here on).
_history: dict[tuple[str, str], tuple[object, object]] = {}
_dispatchers: dict[tuple[str, str], Callable] = {}


def _settle(key: str, module, families: frozenset[str], record: Takeover) -> None:
    """Each name model type ``key``'s patch has set: a dispatcher (taken over) or verl's function (stays)."""
    targets = {target.label: target for target in TAKEN_OVER.get(key, ())}
    for (model, label), (original, verls) in _history.items():
        if model != key:
            continue
        target = targets.get(label)
        if target is None:
            record.verls.append((key, label))
            continue
        owner = _owner(module, target)
        if target.family in families and original is not _MISSING:
            made = _dispatchers.get((key, label))
            if made is None or getattr(made, _MARK) != (original, verls):  # one object: Dynamo's guards hold
                made = _dispatchers[key, label] = dispatcher(original, verls)
            setattr(owner, target.name, made)
            record.taken.append((key, label, target.family))
        else:
            setattr(owner, target.name, verls)
            record.off.append((key, label, target.family))


def take_over(npu_patch, verl_version: str = "unknown") -> bool:
    """Wrap the patch functions of verl's ``npu_patch`` module (idempotent).

    Every value of ``npu_patch.NPU_PATCHES`` is replaced by one that runs it and then turns the names of
    :data:`TAKEN_OVER` it changed into :func:`dispatcher` s (only while ``QWEN_NPU_COMPILE`` is on and the name's
    family is in ``QWEN_NPU_FUSIONS``, both read at each call); ``npu_patch.apply_npu_patches`` by one that runs
    it and logs one INFO line (:meth:`Takeover.line`). ``apply_npu_fsdp_patches`` imports both names from the
    module at each call, so verl's engine runs the wrapped ones.

    Args:
        npu_patch: ``verl.models.transformers.npu_patch`` (or a module with the same two names).
        verl_version: named in the INFO line.

    Returns:
        True when it wrapped them now, False when they were wrapped already or the module lacks them (then a
        warning says that verl's patches pre-empt the families).
    """
    patches = getattr(npu_patch, PATCHES_NAME, None)
    apply = getattr(npu_patch, APPLY_NAME, None)
    if not isinstance(patches, dict) or not callable(apply):
        log.warning("qwen_npu: verl %s's %s has no %s dict or %s function; its monkey patches are applied as they "
                    "are and compiled layers fuse only what they leave", verl_version, NPU_PATCH_MODULE,
                    PATCHES_NAME, APPLY_NAME)
        return False
    if getattr(apply, _MARK, False):
        return False
    for key, patch in list(patches.items()):
        if callable(patch) and not getattr(patch, _MARK, False):
            patches[key] = _taking_over(key, patch)

    @functools.wraps(apply)
    def apply_npu_patches(*args, **kwargs):
        global _current, last
        if not compile_requested():
            return apply(*args, **kwargs)
        _families(os.environ)  # a malformed QWEN_NPU_FUSIONS fails here, before any patch
        _current = Takeover()
        try:
            return apply(*args, **kwargs)
        finally:
            record, _current = _current, None
            record.skipped = [key for key in patches if key not in {row[0] for row in
                                                                       (*record.taken, *record.verls, *record.off)}]
            last = record
            log.info(record.line(verl_version))

    setattr(apply_npu_patches, _MARK, True)
    setattr(npu_patch, APPLY_NAME, apply_npu_patches)
    log.debug("qwen_npu: wrapped verl %s %s.%s", verl_version, NPU_PATCH_MODULE, APPLY_NAME)
    return True
