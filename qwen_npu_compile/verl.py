"""Switch ``qwen_npu`` on inside an unmodified verl, by environment variables only.

verl imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` (comma-separated) from
``verl/__init__.py``, in every process that imports verl (Ray workers included), and the module named
by ``actor_rollout_ref.model.external_lib`` from ``HFModelConfig.__post_init__``
(``verl/workers/config/model.py``), before the model is built. Naming this module there, with
``QWEN_NPU_COMPILE=1`` in the workers' environment (Ray ``runtime_env``)::

    VERL_USE_EXTERNAL_MODULES=qwen_npu_compile.verl  QWEN_NPU_COMPILE=1

makes every FSDP engine compile its model's decoder layers in place (:func:`~qwen_npu_compile.maybe_compile`)
right before FSDP wraps them. With ``QWEN_NPU_COMPILE`` unset or off, importing this module does
nothing at all (no verl import, no patch).

The hook (checked against verl 0.9.1, also present in 0.7.1 and 0.8.0):

* **FSDP engine** -- ``verl.workers.engine.fsdp.transformer_impl.FSDPEngine._build_fsdp_module(self, module)``.
  ``FSDPEngine._build_model_optimizer`` calls it with the complete Hugging Face model
  (``_build_module``: ``from_pretrained``, ``apply_monkey_patch``, ``.to(dtype)``,
  ``gradient_checkpointing_enable``; then LoRA and QAT) and it wraps that model with FSDP1 or
  FSDP2. The method is replaced on the class by one that calls ``maybe_compile(module)`` and then the
  original; the LM-head (actor, reference) and value-head (critic) engines inherit it. Engine classes
  that override it without calling it are refused loudly when they build a model, except verl 0.9.1's
  ``FSDPTurboEngineWithLMHead`` (strategy ``fsdp_turbo``).
* **FSDP-Turbo engine** -- ``verl.workers.engine.fsdp.fsdp_turbo_impl.FSDPTurboEngineWithLMHead._build_fsdp_module``
  (verl 0.9.1) takes the state dict, wraps with ``FSDPTurbo(config, module).model`` (which may also replace
  Hugging Face forwards: FSDP-Turbo's model patches) and loads the state dict back. Its replacement runs it
  first, then compiles the decoder layers of the wrapped model in place, so that what is compiled is what
  FSDP-Turbo left. Where that would not be safe (a replaced forward of a decoder layer, of its attention or of
  the base model: each receives the packed-row arguments the compiled layers rely on; sequence parallelism; a
  model without the layers it had), the layers stay uncompiled, with one warning saying why and what to do.
* **Legacy workers** (verl <= 0.7: ``verl/workers/fsdp_workers.py``, which 0.8.0 and 0.9.1 no longer
  ship) -- the module-level name ``get_fsdp_wrap_policy`` that ``ActorRolloutRefWorker._build_model_optimizer``
  and ``CriticWorker._build_critic_model_optimizer`` call with the complete model right before
  ``FSDP(...)`` / ``apply_fsdp2(...)``. Replaced by one that compiles ``module`` first.

* **verl's npu_patch** (Ascend hosts) -- ``verl.models.transformers.npu_patch``, which ``FSDPEngine.__init__``
  imports and applies (``apply_npu_fsdp_patches``) before the model is built: its patch functions still run,
  then the names a switched-on ``qwen_npu`` family fuses from transformers' own code (RMSNorm, SwiGLU MLP,
  rotary, the MoE block, the Qwen3.5 norms) dispatch to transformers' function inside a Dynamo capture and to
  verl's elsewhere, so that compiled layers fuse what they fuse without verl's patches; one INFO line names
  what was taken over and what stays verl's (:mod:`qwen_npu_compile.integrations.verl_npu_patch`).

The verl modules are patched when Python has executed them (a post-import hook on ``sys.meta_path``),
or at once when they are already imported, so importing this module from ``verl/__init__.py`` pulls
in none of verl's engine code (peft, tensordict, FSDP) in processes that never build a model.

Loud failures, all raised where verl imports or calls the hooked code:

* :class:`VerlHookError` -- the installed verl has neither ``verl/workers/engine/fsdp/transformer_impl.py``
  nor ``verl/workers/fsdp_workers.py``, or they no longer define the hooked function with the
  expected parameters; the message names the verl version and the missing function.
* ``ValueError`` -- the engine is configured with FSDP1 and ``use_orig_params=False`` (verl's
  default; a compiled layer cannot use a FlatParameter), naming the verl settings to change.

The FSDP-Turbo engine never raises for what FSDP-Turbo did to the model: it warns and trains uncompiled.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from torch import nn

from qwen_npu_compile.config import ENV_COMPILE
from qwen_npu_compile.integrations import torch_compiler, verl_npu_patch
from qwen_npu_compile.integrations.fsdp1 import FIX as FSDP1_FIX
from qwen_npu_compile.layers import clean_name, find_decoder_layers
from qwen_npu_compile.worker import compile_requested, maybe_compile

log = logging.getLogger("qwen_npu_compile")

#: The verl release the hook was checked against (the engine code read and driven by tests/integrations/test_verl_hook.py).
CHECKED_VERL_VERSION = "0.9.1"
#: The package whose import completes the FSDP engine classes (``transformer_impl`` and ``fsdp_turbo_impl``).
ENGINE_PACKAGE = "verl.workers.engine.fsdp"
ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
ENGINE_CLASS = "FSDPEngine"
ENGINE_METHOD = "_build_fsdp_module"
ENGINE_PARAMETERS = ("self", "module")
#: verl 0.9.1's FSDP-Turbo engine (strategy ``fsdp_turbo``): its own FSDP step, compiled after it.
TURBO_MODULE = "verl.workers.engine.fsdp.fsdp_turbo_impl"
TURBO_CLASS = "FSDPTurboEngineWithLMHead"
#: The legacy FSDP workers (verl <= 0.7).
LEGACY_MODULE = "verl.workers.fsdp_workers"
LEGACY_FUNCTION = "get_fsdp_wrap_policy"

#: Marks a function this module installed, so that a second install leaves it as it is.
_MARK = "__qwen_npu_hook__"


class VerlHookError(RuntimeError):
    """The installed verl does not have the function ``qwen_npu_compile.verl`` hooks."""


# --------------------------------------------------------------------------------------------------
# verl's version and files, without importing verl's engine


def verl_version() -> str:
    """The installed verl's version (``verl.__version__`` when verl is imported, else its metadata)."""
    module = sys.modules.get("verl")
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    try:
        from importlib.metadata import version as dist_version

        return dist_version("verl")
    except Exception:  # not installed as a distribution (a source checkout on sys.path)
        return "unknown"


def _verl_dirs() -> list[Path]:
    """verl's package folders, found without importing it (``verl`` may be half-imported: we are in its __init__)."""
    module = sys.modules.get("verl")
    paths = getattr(module, "__path__", None)
    if paths is None:
        spec = importlib.util.find_spec("verl")
        paths = spec.submodule_search_locations if spec is not None else None
    return [Path(p) for p in paths or []]


def _has_file(relative: str) -> bool:
    return any((folder / relative).is_file() for folder in _verl_dirs())


def _error(what: str) -> VerlHookError:
    return VerlHookError(
        f"qwen_npu: {ENV_COMPILE}=1 and qwen_npu_compile.verl is imported, but verl {verl_version()} {what}; "
        f"the hook was checked against verl {CHECKED_VERL_VERSION} "
        f"({ENGINE_MODULE}.{ENGINE_CLASS}.{ENGINE_METHOD}(self, module)). Install verl {CHECKED_VERL_VERSION}, "
        f"call qwen_npu_compile.maybe_compile(model) in your verl's model build before FSDP wrapping "
        f"(docs/verl.md), or unset {ENV_COMPILE}"
    )


# --------------------------------------------------------------------------------------------------
# the compile step both hooks run


def _compile_before_wrap(module, where: str, when: str = "before FSDP wrapping", note: str = "",
                         model_name: str | None = None) -> None:
    """``maybe_compile(module)`` (torch's own ``torch.compile``, even under MindSpeed's patch), and two lines.

    At build: how many decoder layers of ``model_name`` (default: the module's class) were set to compile (no
    graph exists yet), ``when``, then ``note``. At
    the first forward, once every layer has been called: how many of them produced ``qwen_npu`` graphs, with
    the cause when not all did. Both at WARNING: verl runs its processes at WARNING (``verl/__init__.py``:
    ``set_basic_config``).
    """
    compiled = maybe_compile(module)
    model_name = model_name or type(module).__name__
    if compiled:
        if compiled.compiler is not None:  # (wrapped by FSDP2 already: its class is FSDP<model>)
            compiled.compiler.model_name = model_name
        replaced = torch_compiler.replaced_by()
        log.warning("qwen_npu: verl %s: %s set %d decoder layer(s) of %s to compile %s "
                    "(graphs at the first forward)%s%s", verl_version(), where, len(compiled), model_name,
                    when, f"; torch.compile is {replaced}, compiled with torch's own" if replaced else "", note)
        compiled.announce_first_pass(logging.WARNING, f"verl {verl_version()}: {where} ")


def _refuse_flat_parameters(engine) -> None:
    config = getattr(engine, "engine_config", None)
    if getattr(config, "strategy", None) == "fsdp" and getattr(config, "use_orig_params", True) is False:
        raise ValueError(
            f"qwen_npu: {ENV_COMPILE}=1 but verl's {type(engine).__name__} wraps the model with FSDP1 and "
            "use_orig_params=False (verl's default, fsdp_config.use_orig_params: false); a compiled decoder "
            f"layer cannot use FSDP1's FlatParameter. To compile it, {FSDP1_FIX}"
        )


# --------------------------------------------------------------------------------------------------
# the engine hook


def _signature_problem(function) -> str | None:
    try:
        names = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return "has no inspectable signature"
    if names != ENGINE_PARAMETERS:
        return f"takes {names}, not {ENGINE_PARAMETERS}"
    return None


def _refuse_sdpa_with_ulysses(engine, module) -> None:
    """verl patches only the flash-attention entry point for Ulysses (``monkey_patch.apply_monkey_patch``
    replaces ``flash_attention._flash_attention_forward``); with ``sdpa`` (or ``eager``) and sp > 1 each rank
    would attend only within its T/sp slice, silently wrong (read from verl 0.9.1's code: nothing in
    ``verl/workers/config`` or ``monkey_patch.py`` ties ``attn_implementation`` to Ulysses)."""
    size = getattr(getattr(engine, "engine_config", None), "ulysses_sequence_parallel_size", 1) or 1
    config = getattr(module, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if size > 1 and implementation is not None and not str(implementation).startswith("flash_attention"):
        raise ValueError(
            f"qwen_npu: {ENV_COMPILE}=1 with ulysses_sequence_parallel_size={size} and attn_implementation="
            f"{implementation!r}: verl {verl_version()} sends only flash attention through its Ulysses all-to-all, "
            f"so every rank would attend within its own 1/{size} of the sequence. Use attn_implementation="
            "'flash_attention_2' (verl's default: drop override_config.attn_implementation) or "
            "ulysses_sequence_parallel_size=1"
        )


def _compiling_build_fsdp_module(original: Callable) -> Callable:
    @functools.wraps(original)
    def _build_fsdp_module(self, module):
        if compile_requested():
            _refuse_flat_parameters(self)
            _refuse_sdpa_with_ulysses(self, module)
            _compile_before_wrap(module, f"{type(self).__name__}.{ENGINE_METHOD}:")
        return original(self, module)

    setattr(_build_fsdp_module, _MARK, True)
    return _build_fsdp_module


def _refusing_build_fsdp_module(original: Callable, owner: type) -> Callable:
    @functools.wraps(original)
    def _build_fsdp_module(self, module):
        if compile_requested():
            raise VerlHookError(
                f"qwen_npu: {ENV_COMPILE}=1 but verl {verl_version()}'s {owner.__name__} overrides "
                f"{ENGINE_CLASS}.{ENGINE_METHOD} with its own FSDP wrapping (strategy "
                f"{getattr(getattr(self, 'engine_config', None), 'strategy', '?')!r}), which qwen_npu_compile.verl "
                f"does not hook; use actor_rollout_ref.actor.strategy=fsdp2 (or fsdp with use_orig_params=True), "
                f"or unset {ENV_COMPILE}"
            )
        return original(self, module)

    setattr(_build_fsdp_module, _MARK, True)
    return _build_fsdp_module


# --------------------------------------------------------------------------------------------------
# verl 0.9.1's FSDP-Turbo engine: compile what FSDPTurbo(config, module).model left, or warn why not


def _forward_function(module: nn.Module):
    """The function ``module.forward`` runs: an instance attribute's (bound method: its function), else the class's."""
    own = module.__dict__.get("forward")
    if own is not None:
        return getattr(own, "__func__", own)
    return getattr(type(module), "forward", None)


def _forwards(model: nn.Module) -> dict[str, tuple[nn.Module, type, object]]:
    """Qualified name -> (module, its class now, the function its forward runs), for every module of ``model``."""
    return {name: (sub, type(sub), _forward_function(sub)) for name, sub in model.named_modules()}


def _dotted(value) -> str:
    module = getattr(value, "__module__", None)
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or repr(value)
    return f"{module}.{name}" if module else name


def _takes_layer_arguments(function) -> bool:
    """Whether a forward receives what a decoder layer is called with (``attention_mask``, or ``**kwargs``, which
    carries the packed rows' offsets), as attention does; an MLP's or a norm's ``forward(x)`` does not."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == "attention_mask" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _turbo_changes(before: dict, wrapped: nn.Module, layers: list[str]) -> tuple[list[str], list[str]]:
    """What ``FSDPTurbo`` changed in the modules that run inside or around the decoder layers.

    Args:
        before: :func:`_forwards` of the model before ``FSDPTurbo`` saw it.
        wrapped: ``FSDPTurbo(config, module).model``.
        layers: the decoder layers' qualified names before.

    Returns:
        ``(unsafe, inside)``, each a list of "what was replaced by what (module names)": ``unsafe``, the
        changes to a decoder layer, to a module inside one that takes the layer's arguments (attention), to a
        module between the root and the layers (the base model, whose packed-row pre-hook passes those
        arguments), or a layer missing or replaced; ``inside``, forwards replaced inside a layer that take
        tensors only (an MLP, a norm), which a compiled layer traces as replaced. The root's and other
        modules' changes (embedding, LM head) are neither.
    """
    after = dict(wrapped.named_modules())
    ancestors = {".".join(name.split(".")[:cut]) for name in layers for cut in range(1, name.count(".") + 1)}
    unsafe: dict[str, list[str]] = {}
    inside: dict[str, list[str]] = {}
    for name, (module, cls, function) in before.items():
        now = after.get(name)
        if now is module and _forward_function(now) is function:
            continue
        if now is None:
            change = f"the {cls.__name__} module by nothing"
        elif now is not module:
            change = f"the {cls.__name__} module by a {type(now).__name__}"
        else:
            change = f"{_dotted(cls)}.forward by {_dotted(_forward_function(now))}"
        in_layer = any(name.startswith(layer + ".") for layer in layers)
        takes_layer_arguments = now is not module or _takes_layer_arguments(function)
        if name in layers or name in ancestors or (in_layer and takes_layer_arguments):
            unsafe.setdefault(change, []).append(name)
        elif in_layer:
            inside.setdefault(change, []).append(name)
    describe = lambda found: [f"{change} ({', '.join(names[:2])}{', ...' if len(names) > 2 else ''})"  # noqa: E731
                              for change, names in found.items()]
    return describe(unsafe), describe(inside)


def _turbo_sequence_parallel(engine) -> int:
    """The engine's sequence-parallel size: FSDP-Turbo's context parallelism sets verl's Ulysses fields."""
    size = getattr(engine, "ulysses_sequence_parallel_size", 1) or 1
    return max(int(size), 2 if getattr(engine, "use_ulysses_sp", False) else 1)


def _turbo_build_fsdp_module(original: Callable, owner: type) -> Callable:
    """``FSDPTurboEngineWithLMHead._build_fsdp_module``, then the decoder layers of its result compiled in place.

    Compiling after ``FSDPTurbo`` (rather than before, as for ``FSDPEngine``) means the compiled layers are the
    ones in the wrapped model, after verl reloaded the state dict into it, and that any forward FSDP-Turbo
    replaced is known before anything is compiled or installed. A compiled layer calls ``self.forward`` at its
    first call, so a replaced forward is what it traces. That is kept where it is safe: a replaced forward
    inside a layer that takes tensors only (an MLP, a norm) is traced as it is, its ops fused only where they
    keep transformers' form (the graph reports count fused ops of its own as already fused). It is refused where
    a replaced forward receives the layer's arguments (the decoder layer, its attention, the base model): the
    packed-row pre-hook passes attention the sequences' offsets as a keyword and no mask, which such a forward
    may drop, making attention run across the packed sequences. Refused also: sequence parallelism (FSDP-Turbo
    splits sequences in its own patched forwards) and a wrapped model whose layers cannot be found. A refusal
    is one WARNING at the build; the engine then trains uncompiled, exactly as with ``QWEN_NPU_COMPILE`` unset.
    """

    @functools.wraps(original)
    def _build_fsdp_module(self, module):
        if not compile_requested():
            return original(self, module)
        where = f"{type(self).__name__}.{ENGINE_METHOD}:"
        model_name = type(module).__name__  # (FSDP2 renames the class in place: FSDP<model>)
        refusal, layers, before = None, [], {}
        sp = _turbo_sequence_parallel(self)
        if sp > 1:
            refusal = (f"sequence parallelism of size {sp} (FSDP-Turbo's ulysses_parallel_size or verl's "
                       "ulysses_sequence_parallel_size) splits sequences in FSDP-Turbo's own forwards, which "
                       "qwen_npu_compile does not hook")
        else:
            try:
                layers = [clean_name(name) for name, _ in find_decoder_layers(module)]
            except ValueError as exc:
                refusal = f"no decoder layers found in {type(module).__name__} ({exc})"
            before = _forwards(module)
        wrapped = original(self, module)
        inside: list[str] = []
        if refusal is None and not isinstance(wrapped, nn.Module):
            refusal = f"FSDPTurbo(...).model is a {type(wrapped).__name__}, not a torch module"
        elif refusal is None:
            unsafe, inside = _turbo_changes(before, wrapped, layers)
            if unsafe:
                refusal = (f"FSDP-Turbo replaced {'; '.join(unsafe)}, which receive(s) the decoder layers' "
                           "arguments: the compiled layers pass attention the packed sequences' offsets as a "
                           "keyword and no mask, which a replaced forward may drop (attention across sequences)")
        if refusal is not None:
            log.warning("qwen_npu: verl %s: %s %s=1, but the decoder layers of %s are left uncompiled: %s. It "
                        "trains as with %s unset. To compile them, drop that from FSDP-Turbo's configuration "
                        "(turbo_config), or use actor_rollout_ref.actor.strategy=fsdp2; or unset %s to silence this",
                        verl_version(), where, ENV_COMPILE, model_name, refusal, ENV_COMPILE,
                        ENV_COMPILE)
            return wrapped
        note = ""
        if inside:
            note = (f"; FSDP-Turbo replaced {'; '.join(inside)} inside them: the layers compile the replacement, "
                    "fused by qwen_npu only where it keeps transformers' form (fused ops of its own count as "
                    "already fused in the graph reports)")
        _compile_before_wrap(wrapped, where, when="after FSDP-Turbo wrapped them", note=note, model_name=model_name)
        return wrapped

    setattr(_build_fsdp_module, _MARK, True)
    return _build_fsdp_module


def _is_turbo_engine(cls: type) -> bool:
    return cls.__name__ == TURBO_CLASS and cls.__module__ == TURBO_MODULE


def _subclasses(cls: type) -> list[type]:
    found, todo = [], list(cls.__subclasses__())
    while todo:
        sub = todo.pop(0)
        if sub not in found:
            found.append(sub)
            todo.extend(sub.__subclasses__())
    return found


def patch_engine(module) -> bool:
    """Hook ``FSDPEngine._build_fsdp_module`` in verl's ``transformer_impl`` module (idempotent).

    Also replaces the override of every ``FSDPEngine`` subclass defined so far that has its own
    ``_build_fsdp_module``: verl 0.9.1's ``FSDPTurboEngineWithLMHead`` (in ``fsdp_turbo_impl``) by one that
    compiles the layers FSDP-Turbo wrapped or warns why not (:func:`_turbo_build_fsdp_module`), any other by one
    that refuses with ``QWEN_NPU_COMPILE=1``.

    Args:
        module: ``verl.workers.engine.fsdp.transformer_impl`` (or a stand-in with an ``FSDPEngine`` class).

    Returns:
        True when it hooked the method now, False when it was hooked already.

    Raises:
        VerlHookError: ``FSDPEngine`` or its ``_build_fsdp_module(self, module)`` is missing or changed.
    """
    engine = getattr(module, ENGINE_CLASS, None)
    if not isinstance(engine, type):
        raise _error(f"has no class {ENGINE_CLASS} in {ENGINE_MODULE}")
    original = engine.__dict__.get(ENGINE_METHOD)
    if not callable(original):
        raise _error(f"has no method {ENGINE_CLASS}.{ENGINE_METHOD} in {ENGINE_MODULE}")
    hooked = not getattr(original, _MARK, False)
    if hooked:
        problem = _signature_problem(original)
        if problem:
            raise _error(f"changed {ENGINE_MODULE}.{ENGINE_CLASS}.{ENGINE_METHOD}: it {problem}")
        setattr(engine, ENGINE_METHOD, _compiling_build_fsdp_module(original))
    for sub in _subclasses(engine):
        override = sub.__dict__.get(ENGINE_METHOD)
        if callable(override) and not getattr(override, _MARK, False):
            if _is_turbo_engine(sub) and _signature_problem(override) is None:
                setattr(sub, ENGINE_METHOD, _turbo_build_fsdp_module(override, sub))
            else:
                setattr(sub, ENGINE_METHOD, _refusing_build_fsdp_module(override, sub))
    if hooked:
        log.info("qwen_npu: hooked verl %s %s.%s.%s", verl_version(), ENGINE_MODULE, ENGINE_CLASS, ENGINE_METHOD)
    return hooked


def _patch_engine_package(package) -> None:
    """After ``verl.workers.engine.fsdp`` ran: its ``transformer_impl`` and engine subclasses exist."""
    engine_module = sys.modules.get(ENGINE_MODULE)
    if engine_module is None:  # (verl 0.7.1-0.9.1 import it from the package; a release might not)
        try:
            engine_module = importlib.import_module(ENGINE_MODULE)
        except ImportError as exc:
            raise _error(f"has no importable {ENGINE_MODULE} ({exc})") from exc
    patch_engine(engine_module)


# --------------------------------------------------------------------------------------------------
# the legacy worker hook (verl <= 0.7)


def patch_legacy(module) -> bool:
    """Hook ``get_fsdp_wrap_policy`` as named in verl's legacy ``fsdp_workers`` module (idempotent).

    ``ActorRolloutRefWorker._build_model_optimizer`` and ``CriticWorker._build_critic_model_optimizer``
    (verl 0.7.1) call ``get_fsdp_wrap_policy(module=..., config=..., is_lora=...)`` with the complete model
    right before ``FSDP(...)`` / ``apply_fsdp2(...)``; the replacement compiles ``module`` first.

    Returns:
        True when it hooked the name now, False when it was hooked already.

    Raises:
        VerlHookError: the module has no callable ``get_fsdp_wrap_policy`` taking ``module``.
    """
    original = getattr(module, LEGACY_FUNCTION, None)
    if not callable(original):
        raise _error(f"has no {LEGACY_FUNCTION} in {LEGACY_MODULE}")
    if getattr(original, _MARK, False):
        return False
    try:
        takes_module = "module" in inspect.signature(original).parameters
    except (TypeError, ValueError):
        takes_module = False
    if not takes_module:
        raise _error(f"changed {LEGACY_MODULE}.{LEGACY_FUNCTION}: it takes no 'module' parameter")

    @functools.wraps(original)
    def get_fsdp_wrap_policy(module, *args, **kwargs):
        if compile_requested():
            _compile_before_wrap(module, f"{LEGACY_MODULE}.{LEGACY_FUNCTION}:")
        return original(module, *args, **kwargs)

    setattr(get_fsdp_wrap_policy, _MARK, True)
    setattr(module, LEGACY_FUNCTION, get_fsdp_wrap_policy)
    log.info("qwen_npu: hooked verl %s %s.%s", verl_version(), LEGACY_MODULE, LEGACY_FUNCTION)
    return True


# --------------------------------------------------------------------------------------------------
# running a patch when Python has executed a module


class _RunAfterExec(importlib.abc.Loader):
    """A module's own loader, then ``action(module)`` once the module's code has run."""

    def __init__(self, loader, action: Callable) -> None:
        self.loader = loader
        self.action = action

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.action(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, ... of the real loader
        if name == "loader":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """A post-import hook: finds the named modules with the other finders and wraps their loaders."""

    def __init__(self) -> None:
        self.actions: dict[str, Callable] = {}

    def find_spec(self, fullname, path, target=None):
        action = self.actions.pop(fullname, None)
        if action is None:
            return None
        if not self.actions and self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RunAfterExec(spec.loader, action)
        return spec


_after_import = _AfterImport()


def _when_imported(name: str, action: Callable) -> None:
    """Run ``action(module)`` now if ``name`` is imported, else right after Python executes it."""
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
        action(module)
        return
    if module is not None:  # half-imported (we are inside its import): wait for it
        raise _error(f"is importing {name} while qwen_npu_compile.verl installs its hook")
    _after_import.actions[name] = action
    if _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)


# --------------------------------------------------------------------------------------------------
# verl's npu_patch (Ascend hosts)


def _take_over_npu_patch(module) -> None:
    """After verl's ``npu_patch`` ran: its patch functions leave compiled layers transformers' own code
    (:mod:`qwen_npu_compile.integrations.verl_npu_patch`)."""
    verl_npu_patch.take_over(module, verl_version())


# --------------------------------------------------------------------------------------------------
# the switch


def install(environ: Mapping[str, str] | None = None) -> bool:
    """Hook verl's FSDP model build when ``QWEN_NPU_COMPILE`` is on; run at import (idempotent).

    Args:
        environ: the environment to read ``QWEN_NPU_COMPILE`` from (default ``os.environ``).

    Returns:
        False when ``QWEN_NPU_COMPILE`` is off (nothing is touched), True when the hooks are installed
        (or will be, when verl's modules are imported).

    Raises:
        ValueError: ``QWEN_NPU_COMPILE`` has an invalid value.
        VerlHookError: verl is not installed, or has neither the engine nor the legacy worker module.
    """
    if not compile_requested(environ):
        log.debug("qwen_npu: %s is off; verl left alone", ENV_COMPILE)
        return False
    if not _verl_dirs():
        raise VerlHookError(
            f"qwen_npu: {ENV_COMPILE}=1 and qwen_npu_compile.verl is imported, but verl is not installed"
        )
    engine = _has_file("workers/engine/fsdp/transformer_impl.py")
    legacy = _has_file("workers/fsdp_workers.py")
    if not engine and not legacy:
        raise _error(f"has no {ENGINE_MODULE} (and no legacy {LEGACY_MODULE})")
    if engine:
        _when_imported(ENGINE_PACKAGE, _patch_engine_package)
    if _has_file("models/transformers/npu_patch.py"):  # imported by apply_npu_fsdp_patches on an Ascend host
        _when_imported(verl_npu_patch.NPU_PATCH_MODULE, _take_over_npu_patch)
    if legacy:
        _when_imported(LEGACY_MODULE, patch_legacy)
    return True


install()
