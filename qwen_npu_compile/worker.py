"""Switch the backend on inside a training worker: ``QWEN_NPU_COMPILE`` and per-layer compile.

verl's FSDP workers are Ray actors that build the Hugging Face model themselves, so the backend is
switched on by an environment variable that reaches every worker, and by one call in the worker's
model build, after the model is created and before FSDP wraps it::

    model = AutoModelForCausalLM.from_pretrained(...)
    model.gradient_checkpointing_enable(...)           # optional, before or after
    qwen_npu_compile.maybe_compile(model)              # no-op unless QWEN_NPU_COMPILE=1
    fully_shard(layer) for each layer; fully_shard(model)   # or FSDP(model, use_orig_params=True)

:func:`maybe_compile` compiles each decoder layer *in place* (as ``nn.Module.compile`` does, but with torch's
own ``torch.compile`` even where MindSpeed replaced it: :mod:`qwen_npu_compile.integrations.torch_compiler`) and the
``qwen_npu`` backend: the modules keep their classes and the model keeps its state-dict keys, so FSDP
wrap policies (which find layers by class name), checkpoints and rollout weight sync are unaffected.
All layers share one compiled graph (Dynamo caches the layer's code once, its parameters are graph
inputs), so a model compiles one graph per input shape, not one per layer.

Three situations are handled outside the compiled ``__call__`` of a layer:

* **Activation (gradient) checkpointing** (``model.gradient_checkpointing_enable()``; verl's default):
  the checkpoint stays outside the compiled function (a whole-model compile instead sees it as a
  ``tag_activation_checkpoint`` region and fuses inside it). While checkpointing is active (layer in training mode, grad
  enabled) the layer's hooks (FSDP's included) and the checkpoint run eagerly and the function being
  checkpointed, the layer's ``forward``, runs compiled (the same fusions; recomputation reruns it).
* **A KV cache** passed to the layer (``use_cache=True`` / generation): the cache's per-layer state
  would make Dynamo recompile once per layer until its recompile limit; such calls run eagerly (one
  warning per process). Training forwards pass ``use_cache=False`` (verl does). A training forward that
  does not (train mode, grad enabled: a model from ``from_pretrained`` / ``from_config`` keeps
  ``use_cache=True`` in its config) is given an *empty* cache, which changes nothing it computes: such
  calls run compiled without the cache (one warning per process; the returned ``past_key_values`` stay
  empty). Generation runs under ``no_grad`` and keeps its cache.
* **FSDP1 with** ``use_orig_params=False``: the layer's parameters become one ``FlatParameter``, which
  a compiled layer cannot use (Dynamo breaks the layer's graph apart; nothing fuses). :func:`maybe_compile`
  refuses such a model when called after wrapping, and a layer compiled before wrapping refuses at
  its first call, with what to change.

The backend given to ``compile`` is ``qwen_npu`` (:func:`qwen_npu_compile.backend.qwen_npu_backend`)
behind a thin wrapper, one per process: every call of a compiled graph is attributed to the layer
running it, so :func:`layer_reports` (or
:meth:`CompiledLayers.reports`) says, per decoder layer, which :class:`~qwen_npu_compile.GraphReport`
it ran; a layer that ran without one is logged once, naming the cause (compilation disabled,
a layer call Dynamo did not compile, or Dynamo's fallback to eager), and an error in strict mode when the
cause is the setup. When every layer has been called once, one line says how many produced graphs.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
import os
import types
from collections.abc import Mapping

import torch
from torch import nn

from qwen_npu_compile import compat, substitutions
from qwen_npu_compile.config import ENV_COMPILE, QwenNpuConfig, parse_bool
from qwen_npu_compile.integrations import fsdp1, torch_compiler
from qwen_npu_compile.layers import clean_name, find_decoder_layers
from qwen_npu_compile.report import SUMMARY, GraphReport
from qwen_npu_compile.substitutions.varlen_attention import packed_layer_call

log = logging.getLogger("qwen_npu_compile")


#: Keyword arguments through which Hugging Face layers receive a KV cache (4.x and 5.x spellings).
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")



# --------------------------------------------------------------------------------------------------
# the switch


def compile_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``QWEN_NPU_COMPILE`` asks for compilation.

    Unset, ``""``, ``0``, ``false``, ``no``, ``off`` mean no; ``1``, ``true``, ``yes``, ``on`` mean yes
    (case and surrounding blanks ignored).

    Args:
        environ: the environment to read (default ``os.environ``).

    Raises:
        ValueError: any other value; the message names the variable and the valid values.
    """
    environ = os.environ if environ is None else environ
    return parse_bool(environ.get(ENV_COMPILE, ""), f"environment variable {ENV_COMPILE}")


# --------------------------------------------------------------------------------------------------
# what was compiled, and what each layer ran


@dataclasses.dataclass
class LayerRecord:
    """One decoder layer compiled by :func:`maybe_compile`.

    Attributes:
        name: the layer's qualified name in the model given to :func:`maybe_compile`, without wrapper
            prefixes (``model.layers.0``).
        class_name: the layer's class (``Qwen2DecoderLayer``).
        reports: every ``qwen_npu`` graph report this layer has run, first run first (one per input
            shape family; all layers normally share them).
        calls: the layer's calls so far by path: ``compiled`` (the compiled ``__call__``),
            ``checkpointed`` (activation checkpointing: eager checkpoint around the compiled forward),
            ``eager`` (a KV cache was passed).
        expected: per enabled family, the fusions one graph of this layer's kind declares
            (``qwen_npu_compile.patterns.expected_fusions(..., per_layer=True)``); empty where the model's config
            is not one the families know.
    """

    name: str
    class_name: str
    reports: list[GraphReport] = dataclasses.field(default_factory=list)
    calls: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"compiled": 0, "checkpointed": 0, "eager": 0}
    )
    expected: dict[str, int] = dataclasses.field(default_factory=dict)

    def shortfall(self) -> dict[str, tuple[int, int, bool]]:
        """Families whose fusions over the graphs this layer has run fall short of :attr:`expected`:
        ``{family: (fused, expected, whether a refusal, or a graph compiled unfused, names why)}`` (fusions counted
        with what a monkey patch had already fused)."""
        short = {}
        unfused = any(r.fallback for r in self.reports)  # a graph compiled unfused has logged its own warning
        for family, want in self.expected.items():
            got = sum(r.fusions.get(family, 0) + r.already_fused.get(family, 0) for r in self.reports)
            if got < want:
                short[family] = (got, want,
                                 unfused or any(x.family == family for r in self.reports for x in r.refused))
        return short

    def note(self, reports: tuple[GraphReport, ...]) -> None:
        """Add ``reports`` (a graph this layer just ran) unless already recorded."""
        for report in reports:
            if all(report is not seen for seen in self.reports):
                self.reports.append(report)

    @property
    def fusions(self) -> dict[str, int]:
        """The fusions of the latest graph this layer ran (empty before its first compiled call)."""
        return dict(self.reports[-1].fusions) if self.reports else {}


class CompiledLayers(list):
    """What :func:`maybe_compile` compiled: a list of layer names, plus a record per layer.

    Compares equal to the plain list of names (``[]`` when nothing was compiled).

    Attributes:
        records: layer name -> :class:`LayerRecord`.
        varlen: what :func:`qwen_npu_compile.substitutions.varlen_attention.install` put in place for packed
            micro-batches (the base model's pre-hook, the taken-over attention entry point); ``[]`` when none.
    """

    def __init__(self, records: list[LayerRecord] | None = None) -> None:
        records = list(records or [])
        super().__init__(record.name for record in records)
        self.records: dict[str, LayerRecord] = {record.name: record for record in records}
        self.varlen: list[str] = []
        self.compiler: _Compiler | None = None

    def reports(self) -> dict[str, list[GraphReport]]:
        """Layer name -> the graph reports it has run so far."""
        return {name: list(record.reports) for name, record in self.records.items()}

    def not_compiled(self) -> list[str]:
        """Layers that were called but never ran a ``qwen_npu`` graph (Dynamo fell back to eager)."""
        return [
            name
            for name, record in self.records.items()
            if not record.reports and (record.calls["compiled"] or record.calls["checkpointed"])
        ]

    def with_graphs(self) -> list[str]:
        """Layers that have run at least one ``qwen_npu`` graph so far."""
        return [name for name, record in self.records.items() if record.reports]

    def announce_first_pass(self, level: int, prefix: str) -> None:
        """Log the line "N of M decoder layer(s) ... produced qwen_npu graphs" at ``level``, after ``prefix``.

        The line is logged once, when every layer of this result has been called (without a KV cache);
        by default at INFO with no prefix. The verl hook raises it to WARNING (verl's log level) and names
        the engine. No effect on a result that compiled nothing.
        """
        if self.compiler is not None:
            self.compiler.first_pass_level, self.compiler.first_pass_prefix = level, prefix


#: The layer whose call is running, so that the compiled graphs it runs are attributed to it.
_RUNNING_LAYER: contextvars.ContextVar[LayerRecord | None] = contextvars.ContextVar(
    "qwen_npu_running_layer", default=None
)


def _attributing(compiled, reports: tuple[GraphReport, ...]):
    """Wrap a compiled graph so that each call notes ``reports`` in the running layer's record.

    The wrapper forwards its arguments unchanged and carries the callable's attributes
    (``compat.wraps_compiled``), so Dynamo calls it exactly as it would call ``compiled`` (boxed or not).
    """

    @compat.wraps_compiled(compiled)
    def run(*args, **kwargs):
        record = _RUNNING_LAYER.get()
        if record is not None:
            record.note(reports)
        return compiled(*args, **kwargs)

    return run


class _AttributingBackend:
    """The ``qwen_npu`` backend, plus attribution of each compiled graph's calls to the running layer.

    One instance per process, so that Dynamo sees the same backend for every layer (equal
    ``torch.compile`` wrappers share cache entries) and compiles a layer's code once.
    """

    def __call__(self, gm, example_inputs, options=None, mode=None):
        from qwen_npu_compile.backend import qwen_npu_backend

        first = SUMMARY.next_index()
        # (the retrace in canonicalize keeps ambient saved-tensor hooks, e.g. a non-reentrant
        # checkpoint's, away from its fake saves; AOTAutograd does the same for its own tracing)
        compiled = qwen_npu_backend(gm, example_inputs, options=options, mode=mode)
        reports = tuple(SUMMARY.graphs[first:])  # the report this compile published
        return _attributing(compiled, reports)

    def __repr__(self) -> str:
        return "qwen_npu"


_BACKEND = _AttributingBackend()


# --------------------------------------------------------------------------------------------------
# the compiled layer call


class _Compiler:
    """The compile settings of one :func:`maybe_compile` call, shared by its layers."""

    def __init__(self, options: dict | None, strict: bool = False) -> None:
        self.options = options
        self.strict = strict
        self._functions: dict[object, object] = {}
        self._warned_uncompilable = False
        self.records: list[LayerRecord] = []
        self.model_name = "the model"
        self.first_pass_level = logging.INFO
        self.first_pass_prefix = ""
        self._first_pass_done = False

    def compile(self, function):
        """``function`` compiled by torch's own ``torch.compile`` (never a replacement such as MindSpeed's)."""
        return torch_compiler.original_torch_compile()(function, **self.compile_kwargs())

    def after_call(self) -> None:
        """Once every layer has been called: log how many produced ``qwen_npu`` graphs (and why not, if not)."""
        if self._first_pass_done:
            return
        if not all(record.calls["compiled"] or record.calls["checkpointed"] for record in self.records):
            return
        self._first_pass_done = True
        with_graphs = sum(1 for record in self.records if record.reports)
        missing = "" if with_graphs == len(self.records) else f" ({_no_graph_cause(None)[0]})"
        level = self.first_pass_level
        if with_graphs != len(self.records):
            level = max(level, logging.WARNING)
        fusions = ""
        judged = [record for record in self.records if record.expected and record.reports]
        if judged:
            shorts = {record.name: record.shortfall() for record in judged}
            short = {name: families for name, families in shorts.items() if families}
            fusions = f"; {len(judged) - len(short)} of {len(judged)} reached their expected fusions"
            if short:
                # a refused fusion already logged its reason; a shortfall nobody explained is a lost fusion: warn
                silent = any(not explained for families in short.values() for *_, explained in families.values())
                if silent:
                    level = max(level, logging.WARNING)
                named = [f"{name}: " + ", ".join(
                    f"{family} {got} of {want}{'' if explained else ' (no reason recorded)'}"
                    for family, (got, want, explained) in families.items()) for name, families in short.items()]
                fusions += f" ({'; '.join(named[:3])}{'; ...' if len(named) > 3 else ''}"
                fusions += ("; QWEN_NPU_DUMP_DIR=<dir> keeps the graphs)" if silent else
                            "; each refusal's reason was logged)")
        log.log(
            level,
            "qwen_npu: %s%d of %d decoder layer(s) of %s produced qwen_npu graphs at their first call%s%s",
            self.first_pass_prefix, with_graphs, len(self.records), self.model_name, missing, fusions,
        )

    def compile_kwargs(self) -> dict:
        return {"backend": _BACKEND, "options": self.options} if self.options else {"backend": _BACKEND}

    def compiled_function(self, function):
        """``function`` (what a checkpoint is about to run) with its Python function compiled.

        Hugging Face checkpoints ``functools.partial(forward, self, **kwargs)``: the plain function is
        compiled once (shared by all layers) and re-bound to the same arguments. Anything else runs as is.
        """
        target = function.func if isinstance(function, functools.partial) else function
        if not isinstance(target, types.FunctionType):
            if not self._warned_uncompilable:
                self._warned_uncompilable = True
                log.warning(
                    "qwen_npu: activation checkpointing runs %r, which is not a plain function; "
                    "checkpointed layers run eagerly (no fusion)", function,
                )
            return function
        compiled = self._functions.get(target)
        if compiled is None:
            compiled = self._functions[target] = self.compile(target)
        if isinstance(function, functools.partial):
            return functools.partial(compiled, *function.args, **function.keywords)
        return compiled


class _CompilingCheckpoint:
    """Stands in for a layer's ``_gradient_checkpointing_func``: checkpoints a compiled forward."""

    def __init__(self, checkpoint, compiler: _Compiler) -> None:
        self.checkpoint = checkpoint
        self.compiler = compiler

    def __call__(self, function, *args, **kwargs):
        return self.checkpoint(self.compiler.compiled_function(function), *args, **kwargs)

    def __reduce__(self):
        # Copies and pickles of the layer get the plain checkpoint function back, as torch drops a
        # module's _compiled_call_impl when it is copied or pickled.
        return (_same, (self.checkpoint,))


def _same(value):
    return value


_warned_cache_eager = False


def _passes_cache(kwargs: dict) -> bool:
    return any(kwargs.get(key) is not None for key in _CACHE_KWARGS)


_said_cache_dropped = False


def _cache_is_empty(cache) -> bool:
    """Whether ``cache`` holds nothing yet: no attention tokens (``get_seq_length() == 0``) and no linear-attention
    (Gated DeltaNet) state. Anything this cannot read counts as not empty."""
    try:
        if cache.get_seq_length() != 0:
            return False
        for layer in getattr(cache, "layers", ()) or ():  # transformers 5.x: one object per layer
            state = getattr(layer, "has_previous_state", None)
            if state is True or (isinstance(state, dict) and any(state.values())):
                return False
        return getattr(cache, "has_previous_state", False) is not True  # transformers 4.57's hybrid caches
    except Exception:  # noqa: BLE001 - a cache of another kind: keep it
        return False


def _training_with_an_unused_cache(layer: nn.Module, kwargs: dict) -> bool:
    """A training forward (layer in train mode, grad enabled) given an *empty* KV cache: what a model from
    ``from_pretrained`` / ``from_config`` does in a plain training loop, its config keeping ``use_cache=True``.

    Such a call computes exactly what it computes without the cache (an empty cache only collects this call's
    keys and values), so it runs compiled without it. Generation (``generate`` runs under ``no_grad``) and a
    cache that already holds tokens keep the cache and run eagerly.
    """
    if not (layer.training and torch.is_grad_enabled()):
        return False
    caches = [kwargs[key] for key in _CACHE_KWARGS if kwargs.get(key) is not None]
    return all(_cache_is_empty(cache) for cache in caches)


def _without_cache(kwargs: dict, class_name: str) -> dict:
    """``kwargs`` with the cache off (cache keywords None, ``use_cache=False``), as verl's calls are; said once."""
    global _said_cache_dropped
    if not _said_cache_dropped:
        _said_cache_dropped = True
        log.warning(
            "qwen_npu: %s layers in train mode were given an empty KV cache (the model config's use_cache=True): "
            "they run compiled without it, so the returned past_key_values stay empty; pass use_cache=False (or set "
            "model.config.use_cache = False) for training to silence this", class_name,
        )
    kwargs = {key: (None if key in _CACHE_KWARGS else value) for key, value in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return kwargs


def _checkpointing(layer: nn.Module) -> bool:
    # transformers' GradientCheckpointingLayer checkpoints under exactly this condition.
    return bool(
        getattr(layer, "gradient_checkpointing", False)
        and layer.training
        and torch.is_grad_enabled()
        and callable(getattr(layer, "_gradient_checkpointing_func", None))
    )


def _checkpoints_around_call(layer: nn.Module) -> bool:
    """Whether the layer's class checkpoints its whole ``__call__`` (hooks included), not its ``forward``.

    transformers 4.5x-5.1x (``GradientCheckpointingLayer.__call__``, transformers/modeling_layers.py in
    4.57.6 and 5.10.4) checkpoints ``partial(super().__call__, **kwargs)``: the layer's compiled call
    then runs *inside* the checkpoint (and again when it recomputes). Later releases checkpoint
    ``partial(forward, self, **kwargs)`` from inside ``forward`` instead.
    """
    return type(layer).__call__ is not nn.Module.__call__


def _in_backward() -> bool:
    # a checkpoint's recomputation runs during backward (torch/utils/checkpoint.py asks the same)
    return torch._C._current_graph_task_id() != -1


class _CompiledLayerCall:
    """A layer's ``_compiled_call_impl``: routes each call and attributes its graphs to the layer."""

    def __init__(self, layer: nn.Module, record: LayerRecord, compiled, compiler: _Compiler) -> None:
        self.layer = layer
        self.record = record
        self.compiled = compiled
        self.compiler = compiler
        self._had_parameters = any(True for _ in layer.parameters())
        self._checked = False
        self._warned_eager = False

    def _check(self) -> None:
        if fsdp1.has_flat_parameters(self.layer, self._had_parameters):
            where = f"decoder layer {self.record.name!r}, compiled by maybe_compile before wrapping,"
            raise ValueError(fsdp1.message(where))
        self._checked = True

    def __call__(self, *args, **kwargs):
        if not self._checked:
            self._check()
        token = _RUNNING_LAYER.set(self.record)
        try:
            # a packed micro-batch (substitutions/varlen_attention.py): one graph for every T; sp > 1: one split around
            # verl's all-to-all
            with packed_layer_call(args, kwargs, self.layer):
                if _passes_cache(kwargs):
                    if not _training_with_an_unused_cache(self.layer, kwargs):
                        return self._run_with_cache(args, kwargs)
                    kwargs = _without_cache(kwargs, type(self.layer).__name__)
                out = self._route(args, kwargs)
        finally:
            _RUNNING_LAYER.reset(token)
        if not self.record.reports and not self._warned_eager:
            self._warned_eager = True
            cause, setup = _no_graph_cause(self.compiled)
            message = f"qwen_npu: decoder layer {self.record.name} ran without a qwen_npu graph ({cause})"
            if setup and self.compiler.strict:
                raise RuntimeError(f"{message} [strict]")
            log.warning("%s", message)
        self.compiler.after_call()
        return out

    def _run_with_cache(self, args, kwargs):
        """A call with a KV cache runs eagerly (one warning per process)."""
        global _warned_cache_eager
        self.record.calls["eager"] += 1
        if not _warned_cache_eager:
            _warned_cache_eager = True
            log.warning(
                "qwen_npu: decoder layers called with a KV cache run eagerly (per-layer cache state "
                "would make Dynamo recompile for every layer); pass use_cache=False for training"
            )
        return self.layer._call_impl(*args, **kwargs)

    def _route(self, args, kwargs):
        """Run one call without a KV cache: through the checkpoint when it is on, else compiled."""
        layer, calls = self.layer, self.record.calls
        if _checkpointing(layer) and _checkpoints_around_call(layer):
            # already inside the checkpoint (older transformers): its function is this compiled call
            if not _in_backward():
                calls["checkpointed"] += 1
            out = self.compiled(*args, **kwargs)
        elif _checkpointing(layer):
            calls["checkpointed"] += 1
            if not isinstance(layer._gradient_checkpointing_func, _CompilingCheckpoint):
                layer._gradient_checkpointing_func = _CompilingCheckpoint(
                    layer._gradient_checkpointing_func, self.compiler
                )
            out = layer._call_impl(*args, **kwargs)
        else:
            calls["compiled"] += 1
            out = self.compiled(*args, **kwargs)
        return out


def _no_graph_cause(compiled) -> tuple[str, bool]:
    """Why a layer ran without a ``qwen_npu`` graph: ``(cause, whether the setup caused it)``.

    ``compiled`` is the layer's compiled call (None: judge by the environment only).
    """
    disabled = torch_compiler.compile_disabled()
    if disabled:
        return f"compilation is disabled: {disabled}; nothing is compiled or fused", True
    if compiled is not None and not torch_compiler.is_dynamo_compiled(compiled):
        replaced = torch_compiler.replaced_by()
        return (
            f"its call {torch_compiler.describe(compiled)} was not compiled by Dynamo"
            + (f"; torch.compile is {replaced}, not torch's own (MindSpeed?): compile with "
               "qwen_npu_compile.maybe_compile or qwen_npu_compile.torch_compile" if replaced else ""),
            True,
        )
    return ("Dynamo fell back to eager: recompile limit or graph break; run with "
            "TORCH_LOGS=recompiles,graph_breaks"), False


# --------------------------------------------------------------------------------------------------
# the entry point


def maybe_compile(
    model: nn.Module,
    options: Mapping[str, object] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> CompiledLayers:
    """Compile each decoder layer of ``model`` in place with the ``qwen_npu`` backend, if asked to.

    Asked to means ``QWEN_NPU_COMPILE`` is ``1``/``true``/``yes``/``on``; when it is unset or
    ``0``/``false``/``no``/``off`` (or empty) nothing is touched (one INFO line says so, and how to switch it
    on). A training forward whose config keeps ``use_cache=True`` runs compiled without its empty cache (module
    docstring; one warning). Each layer gets what
    ``layer.compile(backend=qwen_npu, options=options)`` would give it, compiled by torch's own
    ``torch.compile`` even where MindSpeed replaced ``torch.compile`` with its ``dummy_compile``
    (:func:`qwen_npu_compile.integrations.torch_compiler.original_torch_compile`; one INFO line names the replacement):
    classes, module names and state-dict keys are unchanged. Call it before FSDP wrapping (FSDP2 ``fully_shard`` per layer, or FSDP1 with
    ``use_orig_params=True``); after wrapping works too, except FSDP1 with ``use_orig_params=False``.
    Calling it twice leaves already-compiled layers as they are.

    Args:
        model: a Hugging Face decoder-only model (e.g. ``Qwen2ForCausalLM``), possibly PEFT- or
            FSDP-wrapped; layers are found by :func:`find_decoder_layers`.
        options: backend options (``fusions``, ``dump_dir``, ``downstream``, ``strict``); unset ones
            come from the ``QWEN_NPU_*`` environment variables at compile time.
        environ: the environment to read ``QWEN_NPU_COMPILE`` from (default ``os.environ``).

    Returns:
        The qualified names of the compiled layers (``["model.layers.0", ...]``, ``[]`` when switched
        off), as a :class:`CompiledLayers` whose ``records`` / ``reports()`` say what each layer ran.

    Raises:
        ValueError: ``QWEN_NPU_COMPILE`` has another value; ``options`` are invalid; no decoder layers
            are found; ``model`` holds FSDP1 units built with ``use_orig_params=False``.
        RuntimeError: ``torch.compile`` is replaced and torch's own cannot be found (the message says how to
            put it back).

    A layer that runs without a ``qwen_npu`` graph logs a warning naming the cause; when the cause is the
    setup (compilation disabled by ``torch._dynamo.config.disable`` / ``TORCHDYNAMO_DISABLE=1`` /
    ``set_stance("force_eager")``, or a layer call Dynamo did not compile) and ``strict`` is on, it raises
    ``RuntimeError`` instead.
    """
    if not compile_requested(environ):
        value = (os.environ if environ is None else environ).get(ENV_COMPILE)
        log.info("qwen_npu: maybe_compile left %s uncompiled: %s is %s; set %s=1 to compile its decoder layers "
                 "with the qwen_npu backend", type(model).__name__, ENV_COMPILE,
                 "unset" if value is None else repr(value), ENV_COMPILE)
        return CompiledLayers()
    config = QwenNpuConfig.from_options(options)  # validate now, not at the first forward
    compat.transformers_version_probes_constant()  # transformers is imported by now (the model is built)
    compat.install_tracing_fixes()  # where the package was imported before torch (its names load lazily)
    flat = fsdp1.without_orig_params(model)
    if flat:
        raise ValueError(fsdp1.message(f"the model (FSDP1 unit(s) {flat[:3]}{'...' if len(flat) > 3 else ''})"))
    layers = find_decoder_layers(model)
    compiler = _Compiler(dict(options) if options else None, strict=config.strict)
    compiler.model_name = type(model).__name__
    torch_compiler.original_torch_compile()  # fails before any layer is touched; logs a replaced torch.compile
    records = []
    earlier: _Compiler | None = None  # of layers an earlier call compiled (kept as they are)
    for name, layer in layers:
        name = clean_name(name)
        existing = layer._compiled_call_impl
        if isinstance(existing, _CompiledLayerCall):
            records.append(existing.record)
            earlier = earlier or existing.compiler
            continue
        if fsdp1.has_flat_parameters(layer, had_parameters=False):
            raise ValueError(fsdp1.message(f"decoder layer {name!r}"))
        if existing is not None:
            log.warning("qwen_npu: decoder layer %s was already compiled (%r); recompiling it with qwen_npu",
                        name, existing)
        record = LayerRecord(name=name, class_name=_layer_class_name(layer),
                             expected=_expected_per_layer(model, layer, config.fusions))
        # what nn.Module.compile does, without looking torch.compile up (MindSpeed replaces it)
        compiled = compiler.compile(layer._call_impl)
        layer._compiled_call_impl = _CompiledLayerCall(layer, record, compiled, compiler)
        records.append(record)
        compiler.records.append(record)
    result = CompiledLayers(records)
    result.compiler = compiler if compiler.records else earlier
    installed = substitutions.install(config.fusions, model)
    for line in installed.deltanet:
        log.info("qwen_npu: Gated DeltaNet: %s", line)
    result.varlen = installed.varlen
    classes = sorted({record.class_name for record in records})
    log.info(
        "qwen_npu: %s=1: set %d decoder layer(s) of %s to compile in place (%s; graphs at their first call)%s",
        ENV_COMPILE, len(result), type(model).__name__, ", ".join(classes),
        f" with options {dict(options)}" if options else "",
    )
    if result.varlen:
        log.info("qwen_npu: packed micro-batches run varlen attention (%s)", "; ".join(result.varlen))
    return result


def _expected_per_layer(model: nn.Module, layer: nn.Module, families) -> dict[str, int]:
    """The fusions one graph of ``layer`` declares for the enabled ``families`` (empty where ``model`` has no
    config the families can read: the summary then judges graphs only)."""
    from qwen_npu_compile.patterns import expected_fusions

    config = getattr(model, "config", None)
    # hybrid models name a decoder layer's kind block_type (Qwen3.5, Qwen3-Next) or layer_type; its DeltaNet is
    # linear_attn
    kind = getattr(layer, "block_type", None) or getattr(layer, "layer_type", None)
    if not isinstance(kind, str):
        kind = "linear_attention" if hasattr(layer, "linear_attn") else None
    try:
        return expected_fusions(config, families, per_layer=True, layer_type=kind)
    except Exception:  # a config the families do not know must not stop maybe_compile
        return {}


def _layer_class_name(layer: nn.Module) -> str:
    # FSDP2 swaps the class for a dynamic subclass "FSDP<Layer>" (FSDPModule first): report the model's own.
    for cls in type(layer).__mro__:
        if not cls.__name__.startswith("FSDP") and cls.__name__ != "ABC":
            return cls.__name__
    return type(layer).__name__


def layer_reports(model: nn.Module) -> dict[str, LayerRecord]:
    """Layer name -> :class:`LayerRecord` of every layer of ``model`` compiled by :func:`maybe_compile`.

    Works on the model as wrapped later (FSDP1/FSDP2): records live on the layer modules.
    """
    return {
        call.record.name: call.record
        for module in model.modules()
        if isinstance(call := getattr(module, "_compiled_call_impl", None), _CompiledLayerCall)
    }
