"""The machinery every fusion family is built on (the *fuse* stage runs it: :mod:`qwen_npu_compile.fusion.manager`).

A *family* (one file in ``patterns/``) says everything about one kind of subgraph (RMSNorm, SwiGLU, ...)
in one :class:`FusionFamily` subclass: the anchor op that betrays its presence, the fused ops it
produces and the backward op they bring, how many fusions a model config must give, and a generator
of :class:`PatternVariant` objects (one per dtype family / spelling), in the style of Inductor's
``fx_passes/fuse_attention.py::_get_sfdp_patterns``.

A :class:`FamilyPass` owns one Inductor ``PatternMatcherPass`` per family (never the global Inductor
pattern tables) and registers a variant with ``register_replacement`` (through
:func:`qwen_npu_compile.compat.register_replacement`: its keywords differ by torch version) and
:func:`qwen_npu_compile.graph.utils.trace_pattern` (so patterns are traced exactly like the graphs)
lazily: the first time one of its anchor ops occurs in a graph being fused. It wraps each variant's
``check`` so that every refusal is recorded with its reason and model source line, and every applied
replacement is counted per variant. After matching, every anchor op left in the graph is a *near
miss* and gets a recorded reason too.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch
import torch.fx
from torch._inductor import pattern_matcher as pm

from qwen_npu_compile import compat
from qwen_npu_compile.fusion import near_miss
from qwen_npu_compile.graph.utils import node_source, trace_pattern

log = logging.getLogger(__name__)

#: ``node.meta`` key naming the family whose pass emitted a fused op (set where it matters: :meth:`FamilyPass.count_fused`).
EMITTED_BY = "qwen_npu_emitted_by"

T = TypeVar("T")

#: A variant's check: returns None to accept a match, or the reason to refuse it.
CheckFn = Callable[[pm.Match], "str | None"]


class CheckDecision(Generic[T]):
    """A value a variant's check decides for one match and its replacement reads: how a check's decision (a
    constant read off the graph, the form to emit, a dtype to cast to) reaches the replacement.

    The replacement receives only the matched tensors and scalars. Inductor's pattern matcher calls a match's
    ``extra_check`` (the variant's check) and, when it accepts, traces the replacement for that same match right
    away, in the same thread (``torch/_inductor/pattern_matcher.py``: ``PatternMatcherPass.apply`` →
    ``ReplacementPatternEntry.apply`` → ``replace_by_example``). So the check calls :meth:`decide` and the
    replacement calls :meth:`get`. A variant lists the decisions its replacement reads in
    :attr:`PatternVariant.decides`; :class:`FamilyPass` resets them to their defaults before each match is
    checked, so that no decision outlives its match. Values live in a ``contextvars.ContextVar`` (per thread).

    Args:
        name: what is decided (for ``repr`` and the ContextVar's name).
        default: the value before any check decided (the replacement's plain behaviour).
    """

    def __init__(self, name: str, default: T) -> None:
        self.name = name
        self.default = default
        self._value: contextvars.ContextVar[T] = contextvars.ContextVar(f"qwen_npu_{name}", default=default)

    def decide(self, value: T) -> None:
        """Called by a check: the value the replacement of the match being checked reads."""
        self._value.set(value)

    def get(self) -> T:
        """Called by a replacement: the decision of its match's check, else :attr:`default`."""
        return self._value.get()

    def reset(self) -> None:
        """Back to :attr:`default` (before each check, by :class:`FamilyPass`)."""
        self._value.set(self.default)

    def __repr__(self) -> str:
        return f"CheckDecision({self.name!r}, default={self.default!r})"


@dataclasses.dataclass(frozen=True)
class PatternVariant:
    """One spelling of a family's subgraph and its fused replacement.

    Attributes:
        name: unique, descriptive (``rms_norm_bf16``); shows up in dumps and logs.
        search_fn: the subgraph as the model computes it (traced with :func:`trace_pattern`).
        replace_fn: the fused computation, emitting ``torch.ops.npu.<op>.default`` calls.
        example_inputs: builds small example inputs for the trace (called once, at registration).
        check: refuses a match with a reason (dtype, shape, layout constraints of the fused op).
        scalar_workaround: float/int arguments that must match any value, not a baked-in literal
            (e.g. ``{"eps": 1e-6}``: eps is a graph input under ``dynamic=True``).
        why: one line on why this variant exists.
        search_fn_pattern: optional prebuilt pattern used as is, for the first match and as the exact
            pattern (Inductor then skips re-tracing ``search_fn`` with the match's shapes, a re-trace
            that can bind only one of several independent symbolic sizes; see ``patterns/attention/spellings.py``),
            or a function without arguments that builds it (called at registration, so that a variant
            no graph needs is never traced).
        anchor_ops: ATen ops of which one must occur in a graph before this variant is registered
            (traced) for it; empty means the family's :attr:`FusionFamily.anchor_ops`.
        decides: the :class:`CheckDecision` objects ``check`` sets and ``replace_fn`` reads; reset before each
            check.
    """

    name: str
    search_fn: Callable[..., object]
    replace_fn: Callable[..., object]
    example_inputs: Callable[[], Sequence[object]]
    check: CheckFn | None = None
    scalar_workaround: dict[str, float | int] = dataclasses.field(default_factory=dict)
    why: str = ""
    search_fn_pattern: pm.PatternExpr | Callable[[], pm.PatternExpr] | None = None
    anchor_ops: tuple = ()
    decides: tuple[CheckDecision, ...] = ()


#: The dtype families a normalisation traces to: half precision casts to fp32 and back; in fp32 the casts are
#: no-ops and are removed, so the two graphs differ structurally. Each with the dtype its pattern is traced in.
DTYPE_FAMILIES = (("half", torch.bfloat16), ("fp32", torch.float32))


def per_dtype_family(name: str, example_inputs: Callable[[torch.dtype], Sequence[object]], why: dict[str, str],
                     **fields: Any) -> Iterator[PatternVariant]:
    """One :class:`PatternVariant` per :data:`DTYPE_FAMILIES` entry: named ``f"{name}_{label}"``, traced on
    ``example_inputs(dtype)``, explained by ``why[label]``; ``fields`` (search, replace, check, ...) shared.

    Raises:
        KeyError: ``why`` lacks a label (``"half"``, ``"fp32"``).
    """
    for label, dtype in DTYPE_FAMILIES:
        yield PatternVariant(name=f"{name}_{label}", example_inputs=functools.partial(example_inputs, dtype),
                             why=why[label], **fields)


def layer_kinds(model_config: Any) -> list[str | None]:
    """Each decoder layer's kind, in order: ``model_config.layer_types[:num_hidden_layers]`` where a hybrid
    config has them (Qwen3.5 / Qwen3-Next: ``"linear_attention"`` / ``"full_attention"``; transformers
    5.x also gives uniform models ``layer_types`` of ``"full_attention"`` / ``"sliding_attention"``,
    which change no fusion count and read as None), else ``[None] * num_hidden_layers``.

    Raises:
        AttributeError: ``model_config`` has no ``num_hidden_layers``.
    """
    layers = model_config.num_hidden_layers
    kinds = list(getattr(model_config, "layer_types", None) or [])[:layers]
    if "linear_attention" not in kinds:
        return [None] * layers
    return kinds + [None] * (layers - len(kinds))


class FusionFamily:
    """Base class of a fusion family; subclass it in ``patterns/<family>.py``. The subclass declares everything
    about the family but its name's place in the pass order (:data:`qwen_npu_compile.config.ALL_FAMILIES`, torch-free):
    the registry (``qwen_npu_compile.patterns``), the ``check`` command's expected counts and backward ops are derived
    from it.

    Class attributes:
        name: the family name used in options, env vars and reports (``"rms_norm"``).
        anchor_ops: ATen ops whose presence means the subgraph is in the graph (``aten.rsqrt``);
            any left after matching is reported as a near miss.
        fused_op_names: names of the ``torch.ops.npu`` ops this family emits; when the captured graph
            already holds them (a monkey-patched model), they are counted as "already fused".
        backward_op_name: the ``torch.ops.npu`` op that reaches the AOT backward graph once per fusion
            when training (``npu_rms_norm_backward``).
        backward_per_fusion: how many times it does per fusion (moe: 2, dx and dW, both ``npu_grouped_matmul``).
        per_layer: fusions in one decoder layer of a Qwen2 model (see :meth:`expected_per_layer`).
        per_linear_attention_layer_of: ``model_type`` values in whose linear-attention layers the family
            fuses exactly once, and nowhere else (the Gated DeltaNet's parts of Qwen3.5 / Qwen3-Next); when
            set, it replaces ``per_layer`` for every model.
        outside_layers: fusions of a whole model outside its decoder layers (the final norm: 1).
        pass_class: the :class:`FamilyPass` subclass that runs the family (None: ``FamilyPass``).
    """

    name: str = ""
    anchor_ops: tuple = ()
    fused_op_names: tuple[str, ...] = ()
    backward_op_name: str = ""
    backward_per_fusion: int = 1
    per_layer: int = 0
    per_linear_attention_layer_of: frozenset[str] = frozenset()
    outside_layers: int = 0
    pass_class: type[FamilyPass] | None = None

    @classmethod
    def expected_per_layer(cls, model_config: Any, layer_type: str | None = None) -> int:
        """Fusions one decoder layer of ``model_config`` (a transformers ``PretrainedConfig``) must give;
        override when it depends on the architecture (Qwen3's q_norm/k_norm) or on the layer's kind.

        Args:
            layer_type: the layer's entry of ``model_config.layer_types`` in hybrid models (Qwen3.5,
                Qwen3-Next: ``"linear_attention"`` or ``"full_attention"``); None for uniform models.
        """
        if cls.per_linear_attention_layer_of:
            hybrid = getattr(model_config, "model_type", None) in cls.per_linear_attention_layer_of
            return 1 if hybrid and layer_type == "linear_attention" else 0
        return cls.per_layer

    @classmethod
    def backward_op_counts(cls, fusions: int) -> dict[str, int]:
        """The npu ops ``fusions`` fusions of this family bring into a training graph's AOT backward graph:
        ``{backward_op_name: fusions * backward_per_fusion}``; override when a fusion brings several ops."""
        return {cls.backward_op_name: fusions * cls.backward_per_fusion} if cls.backward_op_name else {}

    @classmethod
    def expected_count(cls, model_config: Any, *, per_layer: bool = False, layer_type: str | None = None) -> int:
        """Fusions a model of ``model_config`` must give: one decoder layer's graph (``per_layer``, as
        ``maybe_compile`` compiles them; ``layer_type`` picks the kind in hybrid models) or the whole
        model's (every decoder layer, by its entry of ``layer_types`` where the config has them, + what
        lies outside them).

        Raises:
            AttributeError: ``model_config`` has no ``num_hidden_layers`` (whole model only).
        """
        if per_layer:
            return cls.expected_per_layer(model_config, layer_type)
        return sum(cls.expected_per_layer(model_config, kind) for kind in layer_kinds(model_config)) + cls.outside_layers

    def make_pass(self) -> FamilyPass:
        """A new pass running this family (:attr:`pass_class`, else :class:`FamilyPass`)."""
        return (self.pass_class or FamilyPass)(self)

    @property
    def fused_ops(self) -> tuple:
        """The ``OpOverload`` of every fused op (resolved lazily: the ops exist after ensure_npu_ops)."""
        return tuple(getattr(torch.ops.npu, name).default for name in self.fused_op_names)

    def iter_variants(self) -> Iterator[PatternVariant]:
        """Yield every variant of the subgraph; called once per process, at first use."""
        raise NotImplementedError

    def explain_near_miss(self, anchor: torch.fx.Node) -> str:
        """Say why ``anchor`` is not part of any matched subgraph; override for a better reason."""
        reused = find_reused_intermediate(anchor, depth=6)
        if reused is not None:
            node, users = reused
            return (
                f"intermediate {node.name} ({node.target}) is also used outside the {self.name} subgraph "
                f"by {', '.join(u.name for u in users)}; fusing would need it materialised"
            )
        return f"{anchor.target} at {node_source(anchor)} is not inside a complete {self.name} subgraph"


@dataclasses.dataclass
class Refusal:
    """One fusion that did not happen: the family, why, and where in the model source."""

    family: str
    reason: str
    source: str
    node: str

    def as_dict(self) -> dict[str, str]:
        return {"family": self.family, "reason": self.reason, "source": self.source, "node": self.node}


class RefusalRecorder:
    """Collects refusals of one compiled graph (and of the checkpointed-region bodies it calls), keyed
    by anchor node so each is reported once."""

    def __init__(self) -> None:
        self._by_anchor: dict[tuple[str, int, str], Refusal] = {}

    @staticmethod
    def _key(family: str, node: torch.fx.Node) -> tuple[str, int, str]:
        return family, id(node.graph), node.name  # node names repeat across a graph and its region bodies

    def refuse(self, family: str, node: torch.fx.Node, reason: str) -> None:
        self._by_anchor.setdefault(self._key(family, node), Refusal(family, reason, node_source(node), node.name))

    def has(self, family: str, node: torch.fx.Node) -> bool:
        return self._key(family, node) in self._by_anchor

    def live(self, graphs: torch.fx.Graph | Sequence[torch.fx.Graph]) -> list[Refusal]:
        """Refusals whose anchor is still in ``graphs`` (a later variant may have fused it after all)."""
        graphs = [graphs] if isinstance(graphs, torch.fx.Graph) else graphs
        alive = {(id(graph), node.name) for graph in graphs for node in graph.nodes}
        return [refusal for (_, graph, name), refusal in self._by_anchor.items() if (graph, name) in alive]


_ACTIVE_RECORDER: contextvars.ContextVar[RefusalRecorder | None] = contextvars.ContextVar(
    "qwen_npu_refusals", default=None
)


@contextlib.contextmanager
def _set_within(var: contextvars.ContextVar, value):
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def recording(recorder: RefusalRecorder):
    """Route the refusals of the checks that run inside this block to ``recorder``."""
    return _set_within(_ACTIVE_RECORDER, recorder)


_ACTIVE_MATCHES: contextvars.ContextVar[Counter[str] | None] = contextvars.ContextVar(
    "qwen_npu_matches", default=None
)


def counting_matches(counter: Counter[str]):
    """Count the replacements applied inside this block in ``counter``, per variant name."""
    return _set_within(_ACTIVE_MATCHES, counter)


def count_applied(variant_name: str, count: int = 1) -> None:
    """Count ``count`` replacements of ``variant_name`` that a pass applied itself (not through a
    registered pattern) into the counter of an enclosing :func:`counting_matches`."""
    counter = _ACTIVE_MATCHES.get()
    if counter is not None and count:
        counter[variant_name] += count


_REGION_OPERANDS: contextvars.ContextVar[dict[torch.fx.Node, list[object]] | None] = contextvars.ContextVar(
    "qwen_npu_region_operands", default=None
)


def binding_region_operands(operands: dict[torch.fx.Node, list[object]]):
    """Let checks inside this block follow a checkpointed body's placeholder to what its callers pass
    (:func:`qwen_npu_compile.graph.utils.checkpoint_operands`)."""
    return _set_within(_REGION_OPERANDS, operands)


def region_operands(node: torch.fx.Node) -> list[object]:
    """The operands the calling graphs bind to ``node``, a placeholder of a checkpointed region's body;
    ``[]`` for any other node, or outside :func:`binding_region_operands`."""
    operands = _REGION_OPERANDS.get()
    return list(operands.get(node, ())) if operands else []


def graph_needs_autograd(graph: torch.fx.Graph) -> bool:
    """Whether the graph being compiled may be differentiated: grad mode is on (now, at compile time:
    Dynamo guards it) and some graph input requires grad (guarded per input by Dynamo)."""
    if not torch.is_grad_enabled():
        return False
    for node in graph.find_nodes(op="placeholder"):
        # make_fx's placeholder FakeTensors drop requires_grad; its tensor_meta records the input's
        tensor_meta = node.meta.get("tensor_meta")
        value = node.meta.get("val")
        if getattr(tensor_meta, "requires_grad", False) or (isinstance(value, torch.Tensor) and value.requires_grad):
            return True
    return False


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """What the rewritten graph will run on, for checks whose answer depends on it.

    Attributes:
        downstream: the backend the rewritten graph is handed to (``torchair``, ``aot_eager``, ...).
        simulated: True when the ``npu`` ops are this package's CPU stand-ins.
    """

    downstream: str
    simulated: bool


_ACTIVE_TARGET: contextvars.ContextVar[CompileTarget | None] = contextvars.ContextVar(
    "qwen_npu_target", default=None
)


def targeting(target: CompileTarget):
    """Make ``target`` what :func:`current_target` returns inside this block (``backend.rewrite`` sets it)."""
    return _set_within(_ACTIVE_TARGET, target)


def current_target() -> CompileTarget | None:
    """The target of the rewrite in progress; None outside ``backend.rewrite`` (checks must then be conservative)."""
    return _ACTIVE_TARGET.get()


def find_reused_intermediate(anchor: torch.fx.Node, depth: int):
    """Follow single-consumer chains from ``anchor`` forward; return the first node with >1 users.

    Returns:
        ``(node, users)`` or None when every node within ``depth`` steps has a single user.
    """
    node = anchor
    for _ in range(depth):
        users = list(node.users)
        if len(users) != 1:
            return (node, users) if len(users) > 1 else None
        node = users[0]
    return None


def match_anchor(match: pm.Match, anchor_ops: tuple) -> torch.fx.Node:
    """The anchor node of a match (falls back to its output node)."""
    for node in match.nodes:
        if node.target in anchor_ops:
            return node
    return match.output_nodes()[0]


def meta_val(node: object):
    """The FakeTensor (or SymInt/float) a node computes, or the literal itself."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


class FamilyPass:
    """The pattern pass of one family: an owned ``PatternMatcherPass``, lazy once-only registration.

    A variant is traced and registered the first time one of its anchor ops
    (:attr:`PatternVariant.anchor_ops`, else the family's) occurs in a graph given to :meth:`apply`,
    and never again in the process (Inductor asserts on duplicate registration). Variants registered
    later go into the same ``PatternMatcherPass`` (Inductor's ``PatternEntry.register`` appends to its
    per-op lists; ``apply`` reads them afresh each time); the lists are then put back in declaration
    order, because the matcher tries the entries of one op in list order.

    Attributes:
        family: the family run by this pass.
        matcher: the Inductor ``PatternMatcherPass`` holding the registered variants.
        variants: the registered variants, in declaration order.
        duplicates: names of registered variants that traced to a pattern registered before them (Inductor
            skips them: ``skip_duplicates=True``), so they can never match.
        registration_seconds: wall time spent registering, summed over every registration; None before
            the first.
        matched_count: applied replacements per variant name over the process (vLLM's ``matched_count``).
    """

    def __init__(self, family: FusionFamily) -> None:
        self.family = family
        self.matcher = pm.PatternMatcherPass(pass_name=f"qwen_npu_{family.name}_fusion")
        self.variants: list[PatternVariant] = []
        self.duplicates: set[str] = set()
        self.registration_seconds: float | None = None
        self.matched_count: Counter[str] = Counter()
        self._declared: list[PatternVariant] | None = None
        self._registered: set[str] = set()
        self._entry_rank: dict[int, int] = {}

    @property
    def declared_variants(self) -> list[PatternVariant]:
        """Every variant the family yields (built once; building one does not trace its pattern).

        Raises:
            ValueError: two variants share a name.
        """
        if self._declared is None:
            declared = list(self.family.iter_variants())
            names = [variant.name for variant in declared]
            repeated = sorted({name for name in names if names.count(name) > 1})
            if repeated:
                raise ValueError(f"qwen_npu: {self.family.name} declares variant name(s) {repeated} more than once")
            self._declared = declared
        return self._declared

    def variant_anchor_ops(self, variant: PatternVariant) -> tuple:
        """The ops whose presence gets ``variant`` registered: its own, else the family's."""
        return variant.anchor_ops or self.family.anchor_ops

    def ensure_registered(self, graph: torch.fx.Graph | None = None) -> list[PatternVariant]:
        """Register the variants ``graph`` needs (one of their anchor ops occurs in it) that are not yet
        registered; every variant when ``graph`` is None.

        Returns:
            The variants registered by this call (empty when nothing was missing).
        """
        present = None if graph is None else {node.target for node in graph.nodes if node.op == "call_function"}
        wanted = [
            (rank, variant) for rank, variant in enumerate(self.declared_variants)
            if variant.name not in self._registered
            and (present is None or any(op in present for op in self.variant_anchor_ops(variant)))
        ]  # fmt: skip
        if not wanted:
            return []
        start = time.perf_counter()
        for rank, variant in wanted:
            before = {id(entry) for entries in self.matcher.patterns.values() for entry in entries}
            pattern = variant.search_fn_pattern
            if pattern is not None and not isinstance(pattern, pm.PatternExpr):
                pattern = pattern()  # built on demand: a variant no graph needs is never traced
            compat.register_replacement(
                variant.search_fn,
                variant.replace_fn,
                list(variant.example_inputs()),
                trace_pattern,
                self.matcher,
                extra_check=self._wrap_check(variant),
                scalar_workaround=variant.scalar_workaround,
                search_fn_pattern=pattern,
                name=variant.name,
            )
            added = [entry for entries in self.matcher.patterns.values() for entry in entries if id(entry) not in before]
            if not added:
                self.duplicates.add(variant.name)
                log.debug("qwen_npu: %s traces to a pattern registered before it; Inductor skipped it", variant.name)
            self._entry_rank.update((id(entry), rank) for entry in added)
            self._registered.add(variant.name)
        for entries in self.matcher.patterns.values():  # declaration order, as one registration would give
            entries.sort(key=lambda entry: self._entry_rank.get(id(entry), -1))
        self.variants = [variant for variant in self.declared_variants if variant.name in self._registered]
        seconds = time.perf_counter() - start
        self.registration_seconds = (self.registration_seconds or 0.0) + seconds
        log.debug("qwen_npu: registered %d %s variant(s) in %.2fs (%d of %d now)", len(wanted), self.family.name,
                  seconds, len(self.variants), len(self.declared_variants))
        return [variant for _, variant in wanted]

    def _wrap_check(self, variant: PatternVariant) -> Callable[[pm.Match], bool]:
        family = self.family

        def extra_check(match: pm.Match) -> bool:
            # Inductor's register_replacement calls this last, on a match that is complete; when it
            # returns True the replacement is applied right away (PatternMatcherPass.apply), so
            # counting here counts applied replacements, not merely checked ones.
            for decision in variant.decides:
                decision.reset()
            reason = variant.check(match) if variant.check is not None else None
            if reason is None:
                self.matched_count[variant.name] += 1
                counter = _ACTIVE_MATCHES.get()
                if counter is not None:
                    counter[variant.name] += 1
                return True
            recorder = _ACTIVE_RECORDER.get()
            if recorder is not None:
                recorder.refuse(family.name, match_anchor(match, family.anchor_ops), reason)
            log.debug("qwen_npu: %s refused at %s: %s", variant.name, node_source(match.nodes[-1]), reason)
            return False

        return extra_check

    def apply(self, gm: torch.fx.GraphModule, recorder: RefusalRecorder) -> int:
        """Fuse every match in ``gm`` in place; record refusals and near misses in ``recorder``.

        The variants the graph needs are registered first (:meth:`ensure_registered`); applied
        replacements are counted per variant into the counter of an enclosing :func:`counting_matches`.

        Returns:
            The number of subgraphs replaced.
        """
        self.ensure_registered(gm.graph)
        with recording(recorder):
            count = self.matcher.apply(gm)
        for anchor in self.anchor_nodes(gm.graph):
            if recorder.has(self.family.name, anchor):
                continue
            other = near_miss.foreign(anchor)
            if other is not None:  # e.g. the Gated DeltaNet's l2norm rsqrt: not a near miss of this family
                log.debug("qwen_npu: %s anchor %s at %s: %s", self.family.name, anchor.name, node_source(anchor), other)
                continue
            recorder.refuse(self.family.name, anchor, "near miss: " + self.family.explain_near_miss(anchor))
        return count

    def anchor_nodes(self, graph: torch.fx.Graph) -> list[torch.fx.Node]:
        """Every node of ``graph`` that calls one of the family's anchor ops."""
        return [node for op in self.family.anchor_ops for node in graph.find_nodes(op="call_function", target=op)]

    def count_anchors(self, graph: torch.fx.Graph) -> int:
        """Anchor ops that could be this family's subgraph: those in another role (:mod:`.near_miss`) left out."""
        return sum(1 for anchor in self.anchor_nodes(graph) if near_miss.foreign(anchor) is None)

    def count_fused(self, graph: torch.fx.Graph) -> int:
        """The family's fused ops already in ``graph`` (a monkey-patched model), less those an earlier family's
        pass emitted in this compile (``node.meta["qwen_npu_emitted_by"]``: moe's npu_swiglu is not swiglu's)."""
        return sum(1 for op in self.family.fused_ops for node in graph.find_nodes(op="call_function", target=op)
                   if node.meta.get(EMITTED_BY, self.family.name) == self.family.name)


# --------------------------------------------------------------------------------------------------
# Helpers for writing patterns (family-agnostic).
# --------------------------------------------------------------------------------------------------

#: The list types FX stores a node's list arguments as (size lists of view/expand/reshape).
SIZE_LIST_TYPES = (list, torch.fx.immutable_collections.immutable_list)


def exact_pattern(
    search_fn: Callable[..., object],
    example_inputs: Sequence[object],
    scalar_workaround: dict[str, float | int] | None = None,
    *,
    ignore_types: tuple[type, ...] = SIZE_LIST_TYPES,
) -> pm.PatternExpr:
    """The pattern of ``search_fn`` traced like the graphs (:func:`trace_pattern`), exact in every literal
    except the values of ``ignore_types`` (by default size lists), for ``PatternVariant.search_fn_pattern``.

    Inductor's ``register_replacement`` would match a first pattern that ignores every int, float, dtype
    and list, then re-trace ``search_fn`` with the match's shapes for the exact comparison; under
    ``dynamic=True`` that re-trace binds only one of several independent symbolic sizes (B and S) as an
    input and spells the other ``sym_size(x, i)``, which never equals the graph's SymInt placeholder inside
    a size list (e.g. repeat_kv's expand/reshape). A prebuilt exact pattern skips the re-trace; the
    variant's check must then verify what was left out (the sizes) from the matched nodes' shapes.

    Args:
        search_fn: the subgraph as the model computes it; its parameter names become the pattern's
            argument names (``match.kwargs``).
        example_inputs: one value per parameter (tensors, or the magic floats of ``scalar_workaround``).
        scalar_workaround: ``{parameter: magic float}`` for scalars that are graph inputs under
            ``dynamic=True`` (Inductor's ``scalar_workaround``).
        ignore_types: literal types that match anything (``pm.fx_to_pattern``'s ``ignore_types``).
    """
    argnames = list(inspect.signature(search_fn).parameters)
    gm = trace_pattern(search_fn, list(example_inputs))
    return pm.fx_to_pattern(gm, ignore_types=ignore_types, argnames=argnames, scalar_workaround=scalar_workaround or {})


def with_parameters(fn: Callable[..., object], names: Sequence[str]) -> Callable[..., object]:
    """``fn(**kwargs)`` as a function of exactly the positional parameters ``names``.

    A pattern's inputs are its search function's parameters (Inductor reads ``inspect.signature``) and a
    parameter the traced subgraph does not use breaks the match, so variants that differ in which inputs
    they have (a mask or not, a dropout probability or not) each need their own signature; this builds
    it from a table instead of one hand-written function per combination (the ``__signature__`` technique
    of Inductor's ``pattern_matcher._wrap_bound_method``).
    """
    names = tuple(names)

    def bound(*args):
        if len(args) != len(names):
            raise TypeError(f"{getattr(fn, '__name__', fn)} takes {names}, got {len(args)} arguments")
        return fn(**dict(zip(names, args)))

    bound.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names]
    )
    bound.__name__ = bound.__qualname__ = f"{getattr(fn, '__name__', 'fn')}_{'_'.join(names)}"
    return bound


def view_key(value):
    """A hashable key that is equal for equal views of one tensor (and for equal literals).

    A view node (an ``OpOverload`` with ``is_view``) is keyed by its op and its arguments' keys, any other
    node by itself, lists and tuples item by item. Two nodes with equal keys compute the same values, so a
    computation of one can stand in for the same computation of the other (e.g. every layer's
    ``mask[:, :, :, :k_len]`` slice of one shared mask in transformers 4.5x).
    """
    if isinstance(value, (list, tuple)):
        return tuple(view_key(item) for item in value)
    if (
        isinstance(value, torch.fx.Node)
        and value.op == "call_function"
        and isinstance(value.target, torch._ops.OpOverload)
        and value.target.is_view
    ):
        return (value.target, view_key(value.args), view_key(tuple(sorted(value.kwargs.items()))))
    return value
