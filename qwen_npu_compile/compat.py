"""Every difference between the torch versions this package supports, in one place.

Supported: torch 2.7.1 to 2.15 and transformers 4.57.6 to 5.25 (the ranges are :data:`TESTED_TORCH` and
:data:`TESTED_TRANSFORMERS`, which ``pyproject.toml`` admits; ``tools/stack_matrix.py`` lists the stacks CI runs).
On a torch outside its range, importing the package warns once (:class:`UntestedTorchWarning`, one line naming
the tested range and what to do; :func:`warn_if_untested_torch`), and likewise on a transformers outside its
range (:class:`UntestedTransformersWarning`; :func:`warn_if_untested_transformers`, read from the installed
distribution's metadata, without importing transformers), and goes on: a graph the retrace cannot follow
compiles unfused with its own warning, so an untested stack costs fusions, not correctness. Nothing else in the package
reads ``torch.__version__`` or probes private torch APIs; it imports what it needs from here. Where
possible a difference is detected from the API itself (a signature, an attribute), not from a version
number, so a backport or a later change is followed automatically.

What differs, and how it is absorbed:

* ``torch._inductor.pattern_matcher.register_replacement`` gained ``pattern_name`` after torch 2.10
  (present in 2.13.0, absent in 2.7.1, 2.9.0 and 2.10.0; it only names the pattern in Inductor's
  counters), and ``get_decomp_fn`` with it. :func:`register_replacement` passes only the keywords the
  installed signature has; ``skip_duplicates`` and ``search_fn_pattern`` are in every supported version.
* ``torch.vmap`` as Dynamo records it: up to torch 2.8 the graph calls the C++ functions
  ``torch._C._functorch._vmap_increment_nesting`` / ``_add_batch_dim`` / ``_remove_batch_dim`` /
  ``_vmap_decrement_nesting`` (plus ``torch._functorch.vmap.lazy_load_decompositions``); since 2.9
  it calls the Python wrappers of the same names in ``torch._functorch.predispatch``.
  :data:`VMAP_ENTER`, :data:`VMAP_EXIT` and :data:`VMAP_LAZY_LOAD` hold both spellings.
* The functorch interpreter stack (``torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters``,
  the same in every supported version): :func:`functorch_levels_restored` pops vmap levels that a
  failed trace left pushed (Dynamo's guards check that stack).
* ``torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing`` (present in 2.7.1 to 2.13.0;
  a no-op where missing): :func:`saved_tensors_hooks_disabled`.
* ``torch.fx.experimental.symbolic_shapes.guard_or_false`` exists since torch 2.8; torch 2.7 calls it
  ``definitely_true``: :data:`guard_or_false`.
* ``torch._dynamo.disable`` around a compiled graph unwraps ``_torchdynamo_orig_callable`` in torch
  2.7-2.10, so a wrapper must not carry that marker over from what it wraps: :func:`wraps_compiled`.
* The pre-dispatch tracing rule of ``torch.ops.higher_order.tag_activation_checkpoint`` (the HOP Dynamo
  records for a non-reentrant ``torch.utils.checkpoint`` region) reads ``body.meta["_checkpoint_context_fn"]``
  unconditionally in torch 2.10-2.13 (a KeyError for a plain checkpoint, which Dynamo records without
  it); torch 2.7-2.9 do not retrace the body at all. :func:`checkpoint_bodies_retraceable` gives such
  bodies torch's own default policy (recompute everything) for the duration of a retrace.
* One transformers difference that Dynamo trips on: transformers 5.10.4's MoE experts
  (``integrations/moe.py`` ``_can_use_grouped_mm``) call ``is_torch_less_or_equal`` while traced, which
  reaches ``importlib.util.find_spec`` (torch 2.11) or ``import_utils.logger.debug`` (2.13): a graph break per
  MoE block (Qwen3-MoE: 21 graphs for 2 layers, experts unfused). The probes are marked constant for Dynamo
  (``assume_constant_result``'s marker): :func:`transformers_version_probes_constant`.
* How Dynamo hands a backend's exception to the caller of the compiled model: any exception becomes
  ``BackendCompilerFailed`` (a multi-line message, Dynamo's frames in the traceback and PyTorch's "reporting a
  bug to PyTorch" footer), except ``torch._dynamo.exc.ShortenTraceback`` (torch's own user-facing backend errors,
  e.g. Inductor's ``TritonMissing``), which passes through unchanged with Dynamo's frames cut.
  :func:`through_dynamo` makes a :class:`~qwen_npu_compile.config.QwenNpuConfigError` pass as one.
* AOTAutograd's ``default_partition`` asserts on 2.9.0 on the scalar-tensorification nodes that lack
  ``tensor_meta`` (dynamic shapes, training); 2.13.0 accepts them: :func:`default_partition`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.fx
import torch.utils.checkpoint

if TYPE_CHECKING:  # Inductor's pattern matcher is imported when first used (the ops/ modules import this module)
    from torch._inductor import pattern_matcher as pm

__all__ = [
    "TESTED_TORCH",
    "TESTED_TRANSFORMERS",
    "UntestedTorchWarning",
    "UntestedTransformersWarning",
    "untested_torch_message",
    "untested_transformers_message",
    "warn_if_untested_torch",
    "warn_if_untested_transformers",
    "VMAP_ENTER",
    "VMAP_EXIT",
    "VMAP_LAZY_LOAD",
    "CHECKPOINT_CONTEXT_FN",
    "CHECKPOINT_HOP",
    "checkpoint_bodies_retraceable",
    "default_partition",
    "functorch_depth",
    "functorch_levels_restored",
    "guard_or_false",
    "transformers_version_probes_constant",
    "install_tracing_fixes",
    "register_replacement",
    "saved_tensors_hooks_disabled",
    "strip_default_context_fn",
    "through_dynamo",
    "wraps_compiled",
]


# --------------------------------------------------------------------------------------------------
# the tested torch and transformers ranges (forward compatibility, stated)

#: The torch releases the stack matrix tests (``tools/stack_matrix.py``); ``pyproject.toml``'s dependencies pin
#: exactly this (``tests/test_version_check.py`` keeps the two equal).
TESTED_TORCH = ">=2.7.1,<2.16"
#: The transformers releases the stack matrix tests (4.50-4.57.5 have known mask-construction gaps);
#: ``pyproject.toml``'s dependencies pin exactly this (``tests/test_version_check.py``).
TESTED_TRANSFORMERS = ">=4.57.6,<5.26"


class UntestedTorchWarning(UserWarning):
    """The installed torch is outside :data:`TESTED_TORCH` (filter it by this category to silence it)."""


class UntestedTransformersWarning(UserWarning):
    """The installed transformers is outside :data:`TESTED_TRANSFORMERS` (filter it by this category to silence it)."""


def _release(version: str) -> tuple[int, ...] | None:
    """``(major, minor, patch)`` of a version string (``"2.15.0.dev20261201+cpu"`` → ``(2, 15, 0)``, ``"5.26.0.dev0"``
    → ``(5, 26, 0)``); None when it does not start with ``N.N``."""
    match = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    return None if match is None else tuple(int(part or 0) for part in match.groups())


def _tested_bounds(spec: str | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(lower, upper)`` releases of a ``">=A.B.C,<D.E"`` range (default :data:`TESTED_TORCH`)."""
    lower, upper = (clause.strip() for clause in (TESTED_TORCH if spec is None else spec).split(","))
    return _release(lower.removeprefix(">=")), _release(upper.removeprefix("<"))


def _untested_message(package: str, version: str, spec: str) -> str | None:
    """The one-line warning for ``package`` ``version`` outside ``spec``, or None inside it.

    Raises:
        ValueError: ``version`` is not a version string (``"N.N[.N]…"``).
    """
    release = _release(str(version))
    if release is None:
        raise ValueError(f"cannot read a {package} version from {version!r}; expected 'MAJOR.MINOR[.PATCH]...'")
    lower, upper = _tested_bounds(spec)
    if lower <= release < upper:
        return None
    side = "newer" if release >= upper else "older"
    newest = f"{upper[0]}.{upper[1] - 1}"
    return (f"qwen_npu_compile: {package} {version} is {side} than the tested range ({package}{spec}, i.e. "
            f"{'.'.join(map(str, lower))} to {newest}.x); fusions may be missing or compiles may fall back unfused. "
            f"Install a tested {package} (pip install '{package}{spec}'), or run `qwen-npu-compile check MODEL` "
            f"to see what fuses here (docs/supported-stacks.md)")


def untested_torch_message(version: str | None = None) -> str | None:
    """The one-line warning for a torch outside :data:`TESTED_TORCH`, or None inside it.

    Args:
        version: a torch version string; default ``torch.__version__``. Pre-releases and local builds count
            by their release (``2.15.0.dev…`` is 2.15, ``2.14.0+cu130`` is 2.14.0).

    Raises:
        ValueError: ``version`` is not a version string (``"N.N[.N]…"``).
    """
    return _untested_message("torch", torch.__version__ if version is None else version, TESTED_TORCH)


def _warn_if(message: str | None, category: type[Warning]) -> bool:
    """Warn ``message`` as ``category`` at the caller of the ``warn_if_untested_*`` function; True when it warned."""
    if message is None:
        return False
    warnings.warn(message, category, stacklevel=3)
    return True


def warn_if_untested_torch(version: str | None = None) -> bool:
    """Warn once (:class:`UntestedTorchWarning`) when torch is outside :data:`TESTED_TORCH`; runs at package import.

    A warning, not an error: the package keeps working where it can (an untested release usually works, and any
    graph the retrace cannot follow compiles unfused with its own warning), and a user who knows better can
    filter it (``warnings.filterwarnings("ignore", category=UntestedTorchWarning)``).

    Returns:
        True when it warned.
    """
    return _warn_if(untested_torch_message(version), UntestedTorchWarning)


def installed_transformers_version() -> str | None:
    """The installed transformers' version from its distribution metadata (transformers is not imported: that
    takes seconds, and the CLI's ``report`` needs none of it); None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def untested_transformers_message(version: str | None = None) -> str | None:
    """The one-line warning for a transformers outside :data:`TESTED_TRANSFORMERS`, or None inside it (or when
    transformers is not installed and no ``version`` is given).

    Args:
        version: a transformers version string; default the installed one
            (:func:`installed_transformers_version`). Pre-releases count by their release (``5.26.0.dev0`` is 5.26).

    Raises:
        ValueError: ``version`` is not a version string (``"N.N[.N]…"``).
    """
    version = installed_transformers_version() if version is None else version
    return None if version is None else _untested_message("transformers", version, TESTED_TRANSFORMERS)


def warn_if_untested_transformers(version: str | None = None) -> bool:
    """Warn once (:class:`UntestedTransformersWarning`) when transformers is outside :data:`TESTED_TRANSFORMERS`;
    runs at package import, next to :func:`warn_if_untested_torch` and for the same reasons (a warning, not an
    error: the modeling code a new release changed compiles unfused, with its own warning, where a pattern no
    longer matches). Silence it with ``warnings.filterwarnings("ignore", category=UntestedTransformersWarning)``.

    Returns:
        True when it warned.
    """
    return _warn_if(untested_transformers_message(version), UntestedTransformersWarning)


def untested_mark(package: str, version: str | None) -> str:
    """What ``check``'s "ran with" line appends to ``package``'s version: ``" (untested; tested >=2.7.1,<2.16)"``
    outside the tested range of ``package`` (``"torch"`` or ``"transformers"``), ``""`` inside it, for a missing
    package (None) and for a version that cannot be read.

    Raises:
        KeyError: ``package`` is neither ``"torch"`` nor ``"transformers"``.
    """
    message, spec = {"torch": (untested_torch_message, TESTED_TORCH),
                     "transformers": (untested_transformers_message, TESTED_TRANSFORMERS)}[package]
    if version is None:
        return ""
    try:
        return "" if message(version) is None else f" (untested; tested {spec})"
    except ValueError:
        return ""


# Before anything below touches a private torch API that a newer torch may have changed.
warn_if_untested_torch()
warn_if_untested_transformers()


# --------------------------------------------------------------------------------------------------
# transformers code Dynamo traces


def transformers_version_probes_constant() -> bool:
    """Mark transformers' torch-version probes (``import_utils.is_torch_less_or_equal`` /
    ``is_torch_greater_or_equal``, ``lru_cache``-wrapped) as constant for Dynamo
    (``torch.compiler.assume_constant_result``'s marker on the wrapped function, which Dynamo traces): it then
    calls them while tracing and keeps the result, instead of tracing into ``importlib.util.find_spec`` and
    ``logger.debug``, which break the graph. transformers 5.10.4's grouped-mm MoE experts
    (``integrations/moe.py`` ``_can_use_grouped_mm``) probe the version while traced: a graph break per MoE
    block (torch 2.11: ``find_spec``; 2.13: ``logger.debug``). A version comparison is constant in a process;
    eager calls are unchanged.

    Run at package import, by ``maybe_compile`` and at the start of Dynamo frame compiles
    (:func:`install_tracing_fixes`; ``torch._dynamo.reset()`` clears that callback, not the marks), so a
    transformers imported after this package is covered too; a no-op when transformers is not imported.
    Returns whether a probe is marked.
    """
    import sys

    module = sys.modules.get("transformers.utils.import_utils")
    marked = False
    for name in ("is_torch_less_or_equal", "is_torch_greater_or_equal"):
        probe = getattr(module, name, None)
        for target in (probe, getattr(probe, "__wrapped__", None)):
            if callable(target):
                try:
                    target._dynamo_marked_constant = True
                    marked = True
                except (AttributeError, TypeError):  # a builtin without __dict__
                    pass
    return marked


def _on_compile_start(*args) -> None:
    transformers_version_probes_constant()


def install_tracing_fixes() -> None:
    """Apply :func:`transformers_version_probes_constant` now and register it as a Dynamo compile-start callback
    (before a frame is traced: the backend itself only sees the finished graph), unless it is registered already.

    Idempotent and cheap, so it is called again where a ``torch._dynamo.reset()`` may have run in between (reset
    clears the callbacks, ``callback_handler.clear()``, not the marks): at package import, by the backend for each
    graph, by ``maybe_compile``. torch 2.7-2.14 have ``torch._dynamo.callback_handler.register_start_callback``;
    where missing the marks are applied at each call only."""
    transformers_version_probes_constant()
    handler = getattr(torch._dynamo, "callback_handler", None)
    register = getattr(handler, "register_start_callback", None)
    if register is not None and _on_compile_start not in getattr(handler, "start_callbacks", ()):
        register(_on_compile_start)


def trace_kernels_bookkeeping_under_checkpoint() -> bool:
    """Let Dynamo trace, inside activation-checkpointed regions, the per-forward bookkeeping of the ``kernels``
    package (transformers 5.25's hard dependency); True when this changed the setting.

    kernels 0.19's ``use_kernelized_func`` wraps the forward of every module it decorates (transformers 5.25: the
    attention of each Qwen model, the Gated DeltaNet) in a ``CompileableContextVar.set`` / ``reset`` pair, which
    under ``torch.compile`` writes a Python attribute (``kernels/_internals/layer/layer.py``). transformers 5.25
    checkpoints each decoder layer's ``forward`` (``GradientCheckpointingLayer``), so with gradient checkpointing
    that write lands inside a ``tag_activation_checkpoint`` region, where Dynamo refuses side effects: every
    checkpointed layer graph-breaks and runs eagerly, unfused, in a whole-model ``torch.compile`` (nothing would
    say so). ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` (torch's own switch for this,
    named in its error) traces them in the forward without replaying them in the backward's recompute: the pair
    sets and restores the same attribute, so there is nothing to replay. Set only where ``kernels`` is installed
    and the switch exists (torch >= 2.6) and is off; per-layer compiles (``maybe_compile``) never meet the case.
    """
    config, switch = torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"
    if importlib.util.find_spec("kernels") is None or getattr(config, switch, True):
        return False  # no kernels, a torch without the switch, or already on
    setattr(config, switch, True)
    return True


# --------------------------------------------------------------------------------------------------
# Inductor's pattern matcher


def _register_replacement_parameters(register: Callable[..., object]) -> frozenset[str] | None:
    """The keyword names ``register`` accepts; None when it takes ``**kwargs`` (a wrapper: trusted to
    forward them). Signatures follow ``functools.wraps`` to the wrapped function."""
    parameters = inspect.signature(register).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return frozenset(parameters)


def register_replacement(
    search_fn: Callable[..., object],
    replace_fn: Callable[..., object],
    example_inputs: Sequence[object],
    trace_fn: Callable[..., torch.fx.GraphModule],
    pass_dict: pm.PatternMatcherPass,
    *,
    extra_check: Callable[[pm.Match], bool],
    scalar_workaround: dict[str, float | int],
    search_fn_pattern: pm.PatternExpr | None,
    name: str,
) -> None:
    """``pm.register_replacement`` with the keywords the installed torch accepts.

    Duplicates (two variants tracing to the same pattern) are skipped, not an error
    (``skip_duplicates=True``). ``name`` becomes ``pattern_name`` where that exists (torch > 2.10).

    Raises:
        RuntimeError: a keyword this package relies on (``search_fn_pattern`` when given,
            ``skip_duplicates``) is missing from the installed torch, i.e. torch older than 2.7.
    """
    from torch._inductor import pattern_matcher as pm

    accepted = _register_replacement_parameters(pm.register_replacement)
    wanted = {"skip_duplicates": True, "pattern_name": name}
    if search_fn_pattern is not None:
        wanted["search_fn_pattern"] = search_fn_pattern
    if accepted is not None:
        required = {"skip_duplicates", "search_fn_pattern"} & set(wanted)
        missing = sorted(required - accepted)
        if missing:
            raise RuntimeError(
                f"qwen_npu: torch {torch.__version__}'s register_replacement has no {', '.join(missing)}; "
                "this package needs torch 2.7 or newer"
            )
        wanted = {key: value for key, value in wanted.items() if key in accepted}
    pm.register_replacement(
        search_fn, replace_fn, list(example_inputs), trace_fn, pass_dict,
        extra_check=extra_check, scalar_workaround=dict(scalar_workaround), **wanted,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# torch.vmap in Dynamo graphs


def _vmap_targets() -> tuple[frozenset, frozenset, frozenset]:
    import torch._functorch.vmap as functorch_vmap

    enter = {torch._C._functorch._vmap_increment_nesting}
    leave = {torch._C._functorch._vmap_decrement_nesting}
    lazy = {functorch_vmap.lazy_load_decompositions}
    try:  # torch >= 2.9: Dynamo records these Python wrappers instead
        from torch._functorch import predispatch
    except ImportError:
        predispatch = None
    if predispatch is not None:
        enter.add(predispatch._vmap_increment_nesting)
        leave.add(predispatch._vmap_decrement_nesting)
        if hasattr(predispatch, "lazy_load_decompositions"):
            lazy.add(predispatch.lazy_load_decompositions)
    return frozenset(enter), frozenset(leave), frozenset(lazy)


#: Targets of the call that opens a vmap level (``_vmap_increment_nesting``, both spellings).
#: The call that closes it, and functorch's one-time loading of its batching decompositions.
VMAP_ENTER, VMAP_EXIT, VMAP_LAZY_LOAD = _vmap_targets()


def functorch_depth() -> int:
    """How many functorch interpreters (vmap, grad, jvp, functionalize levels) are active."""
    return len(torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters())


@contextlib.contextmanager
def functorch_levels_restored() -> Iterator[None]:
    """Pop vmap levels pushed inside the block and left behind (a trace that failed mid-vmap).

    Dynamo's guards include the functorch interpreter stack: a level left pushed would make every
    later compiled call miss its guards. Only vmap levels are popped (the only ones a vmap region
    pushes); anything else left on the stack is a torch bug and is left to torch.
    """
    before = functorch_depth()
    try:
        yield
    finally:
        while functorch_depth() > before:
            top = torch._functorch.pyfunctorch.retrieve_current_functorch_interpreter()
            if top is None or top.key() != torch._C._functorch.TransformType.Vmap:
                break
            torch._C._functorch._vmap_decrement_nesting()


# --------------------------------------------------------------------------------------------------
# tracing


def saved_tensors_hooks_disabled() -> contextlib.AbstractContextManager:
    """Keep ambient saved-tensor hooks (non-reentrant checkpoint, activation offload) off a trace.

    AOTAutograd guards its own tracing with ``torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing``
    (torch 2.7.1 to 2.13.0); where torch lacks it, nothing is disabled.
    """
    disable = getattr(torch._dynamo.utils, "_disable_saved_tensors_hooks_during_tracing", None)
    return disable() if disable is not None else contextlib.nullcontext()


#: The higher-order op Dynamo records for a non-reentrant ``torch.utils.checkpoint`` region (every
#: supported torch version): ``tag_activation_checkpoint(body_graph_module, *inputs, **checkpoint_kwargs)``.
CHECKPOINT_HOP = torch.ops.higher_order.tag_activation_checkpoint

#: Where Dynamo keeps a region's ``context_fn`` (selective activation checkpointing) on its body.
CHECKPOINT_CONTEXT_FN = "_checkpoint_context_fn"


def _recompute_everything(ctx, op, *args, **kwargs):
    return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


#: torch 2.13's own policy for a plain checkpoint region (``torch._higher_order_ops.wrap``'s
#: ``_always_prefer_recompute``): every op of the region is recomputed in the backward.
_DEFAULT_CONTEXT_FN = functools.partial(
    torch.utils.checkpoint.create_selective_checkpoint_contexts, _recompute_everything
)


@contextlib.contextmanager
def checkpoint_bodies_retraceable(bodies: Sequence[torch.fx.GraphModule]) -> Iterator[None]:
    """Let a pre-dispatch ``make_fx`` trace ``tag_activation_checkpoint`` calls of ``bodies``.

    torch 2.10-2.13's tracing rule (``torch/_higher_order_ops/wrap.py::proxy_mode_key``) copies
    ``body.meta["_checkpoint_context_fn"]`` onto the retraced body and raises ``KeyError`` when Dynamo
    recorded none (a plain ``checkpoint(..., use_reentrant=False)``, what transformers' gradient
    checkpointing does). For the trace, each body without one gets :data:`_DEFAULT_CONTEXT_FN` (the
    policy torch applies to such regions anyway); afterwards :func:`strip_default_context_fn` removes
    it from the traced graph's bodies, so that AOTAutograd later takes the same path as for Dynamo's
    own graph. The given bodies get their meta back on exit.
    """
    added = [body for body in bodies if CHECKPOINT_CONTEXT_FN not in body.meta]
    for body in added:
        body.meta[CHECKPOINT_CONTEXT_FN] = _DEFAULT_CONTEXT_FN
    # torch warns that "context_fn is passed to torch.utils.checkpoint": not by the user, by us, with
    # the policy torch uses without one; keep that out of the user's log.
    wrap_log = logging.getLogger("torch._higher_order_ops.wrap")
    quiet = _DropMessage("Detected that context_fn is passed") if added else None
    if quiet is not None:
        wrap_log.addFilter(quiet)
    try:
        yield
    finally:
        if quiet is not None:
            wrap_log.removeFilter(quiet)
        for body in added:
            body.meta.pop(CHECKPOINT_CONTEXT_FN, None)


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def strip_default_context_fn(gm: torch.fx.GraphModule) -> None:
    """Remove the policy :func:`checkpoint_bodies_retraceable` lent from every submodule of ``gm``."""
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule) and module.meta.get(CHECKPOINT_CONTEXT_FN) is _DEFAULT_CONTEXT_FN:
            del module.meta[CHECKPOINT_CONTEXT_FN]


# --------------------------------------------------------------------------------------------------
# symbolic shapes


def _guard_or_false():
    from torch.fx.experimental import symbolic_shapes

    found = getattr(symbolic_shapes, "guard_or_false", None)
    return found if found is not None else symbolic_shapes.definitely_true


#: ``guard_or_false(condition)``: the condition's value, guarding on backed symbols; False where it
#: depends on an unbacked symbol. ``torch.fx.experimental.symbolic_shapes.guard_or_false`` since torch
#: 2.8; torch 2.7 has the same semantics under the name ``definitely_true``.
guard_or_false = _guard_or_false()


# --------------------------------------------------------------------------------------------------
# wrapping what a backend returns


def wraps_compiled(compiled: Callable[..., object]) -> Callable[[Callable[..., object]], Callable[..., object]]:
    """``functools.wraps(compiled)`` for a wrapper a backend returns around its compiled callable.

    Carries the callable's attributes (``_boxed_call`` etc.: Dynamo calls the wrapper as it would call
    ``compiled``) except Dynamo's own ``_torchdynamo_*`` markers: copied onto the wrapper, torch 2.7 to
    2.10 ``torch._dynamo.disable`` (which Dynamo puts around every compiled graph) follows
    ``_torchdynamo_orig_callable`` back to ``compiled`` itself and never calls the wrapper (torch 2.13
    does not unwrap it).
    """

    def decorate(wrapper: Callable[..., object]) -> Callable[..., object]:
        wrapper = functools.wraps(compiled)(wrapper)
        for name in [name for name in vars(wrapper) if name.startswith("_torchdynamo_")]:
            delattr(wrapper, name)
        return wrapper

    return decorate


# --------------------------------------------------------------------------------------------------
# a bad setting, raised from inside the backend


@functools.cache
def _passthrough_class(base: type[Exception]) -> type[Exception] | None:
    """``base`` made a ``torch._dynamo.exc.ShortenTraceback`` too, shown under ``base``'s name; None where
    this torch has no usable ``ShortenTraceback`` (then Dynamo wraps the error as it wraps any other)."""
    try:
        from torch._dynamo.exc import ShortenTraceback
    except ImportError:
        return None
    if not callable(getattr(ShortenTraceback, "remove_dynamo_frames", None)):
        return None

    def __init__(self, message: str, first_useful_frame) -> None:
        # not ShortenTraceback.__init__, whose signature is torch's to change: remove_dynamo_frames() reads
        # only this attribute
        Exception.__init__(self, message)
        self.first_useful_frame = first_useful_frame
        self._message = message

    def __str__(self) -> str:
        # Dynamo appends "from user code: ..." and its footer to args[0] (exc.augment_exc_message) of every
        # error it passes on; the message stays the one line we wrote
        return self._message

    def __reduce__(self):
        # pickled (multiprocessing, Ray) as the public class: this one takes a frame, which does not pickle
        return base, (self._message,)

    try:
        cls = type(base.__name__, (base, ShortenTraceback), {
            "__init__": __init__, "__str__": __str__, "__reduce__": __reduce__, "__module__": base.__module__,
            "__qualname__": base.__qualname__, "__doc__": base.__doc__,
        })
    except TypeError:  # the two bases' layouts conflict in some future torch
        return None
    return cls


def through_dynamo(error: Exception, frame) -> Exception:
    """``error`` as an exception that Dynamo hands to the caller of the compiled model unchanged.

    Raised inside a backend, any exception reaches the user as ``BackendCompilerFailed`` with Dynamo's frames
    and footer; an instance of ``torch._dynamo.exc.ShortenTraceback`` is re-raised as it is (``output_graph._call_user_compiler``,
    since torch 2.7), its traceback cut to start at ``first_useful_frame``
    (``eval_frame``'s compile wrapper: ``raise e.remove_dynamo_frames() from None``; not under
    ``TORCHDYNAMO_VERBOSE=1``). Raise the result ``from None``.

    Args:
        error: the exception to pass on; its type's name and its ``str`` are what the user sees.
        frame: the raising frame (``inspect.currentframe()`` of the backend function), where the traceback
            the user sees ends.

    Returns:
        An instance of a subclass of ``type(error)`` and ``ShortenTraceback`` with the same message (``isinstance``
        checks against ``type(error)`` hold), or ``error`` itself where this torch has no ``ShortenTraceback``.
    """
    cls = _passthrough_class(type(error))
    return error if cls is None else cls(str(error), frame)


# --------------------------------------------------------------------------------------------------
# AOTAutograd


def default_partition(joint_module: torch.fx.GraphModule, joint_inputs, **kwargs):
    """AOTAutograd's ``default_partition``, after giving every tensor-valued node its ``tensor_meta``.

    Under ``dynamic=True`` a float module attribute (transformers' rotary ``attention_scaling``) is a
    graph input that AOTAutograd tensorifies (``tensorify_python_scalars``), inserting
    ``prims.convert_element_type`` nodes that carry ``val`` but no ``tensor_meta``. torch 2.9.0's
    ``default_partition`` takes such a node for a tuple and asserts (``partitioners.py``: "we can't save
    tuple of tensor values"); torch 2.13.0 no longer asserts. The metadata is what make_fx records for
    every other tensor node, so the partition is the one torch intends.
    """
    from torch._functorch.partitioners import default_partition as partition
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    for node in joint_module.graph.nodes:
        value = node.meta.get("val")
        if node.op == "call_function" and "tensor_meta" not in node.meta and isinstance(value, torch.Tensor):
            node.meta["tensor_meta"] = _extract_tensor_metadata(value)
    return partition(joint_module, joint_inputs, **kwargs)
