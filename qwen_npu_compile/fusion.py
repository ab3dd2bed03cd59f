"""Step 2 of the pipeline: the machinery every fusion family is built on.

A *family* (one file in ``patterns/``) describes one kind of subgraph (RMSNorm, SwiGLU, ...): the
anchor op that betrays its presence, the fused ops it produces, and a generator of
:class:`PatternVariant` objects (one per dtype family / spelling), in the style of Inductor's
``fx_passes/fuse_attention.py::_get_sfdp_patterns``.

A :class:`FamilyPass` owns one Inductor ``PatternMatcherPass`` per family (never the global Inductor
pattern tables), registers the variants lazily on first use with ``register_replacement`` (through
:func:`qwen_npu_compile.compat.register_replacement`: its keywords differ by torch version) and
:func:`qwen_npu_compile.canonicalize.trace_pattern` (so patterns are traced exactly like the graphs),
and wraps each variant's ``check`` so that every refusal is recorded with its reason and model source
line. After matching, every anchor op left in the graph is a *near miss* and gets a recorded reason too.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.fx
from torch._inductor import pattern_matcher as pm

from . import compat
from .canonicalize import trace_pattern

log = logging.getLogger(__name__)

#: A variant's check: returns None to accept a match, or the reason to refuse it.
CheckFn = Callable[[pm.Match], "str | None"]


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
            that can bind only one of several independent symbolic sizes; see ``patterns/attention.py``).
    """

    name: str
    search_fn: Callable[..., object]
    replace_fn: Callable[..., object]
    example_inputs: Callable[[], Sequence[object]]
    check: CheckFn | None = None
    scalar_workaround: dict[str, float | int] = dataclasses.field(default_factory=dict)
    why: str = ""
    search_fn_pattern: pm.PatternExpr | None = None


class FusionFamily:
    """Base class of a fusion family; subclass it in ``patterns/<family>.py``.

    Class attributes:
        name: the family name used in options, env vars and reports (``"rms_norm"``).
        anchor_ops: ATen ops whose presence means the subgraph is in the graph (``aten.rsqrt``);
            any left after matching is reported as a near miss.
        fused_op_names: names of the ``torch.ops.npu`` ops this family emits; when the captured graph
            already holds them (a monkey-patched model), they are counted as "already fused".
    """

    name: str = ""
    anchor_ops: tuple = ()
    fused_op_names: tuple[str, ...] = ()

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


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_TORCH_DIR = os.path.dirname(torch.__file__)


def node_source(node: torch.fx.Node) -> str:
    """``file:line`` of the model code that produced ``node``, or ``"<unknown>"``.

    The innermost frame of a transformers ``modeling_*.py`` file wins (``modeling_qwen2.py:63`` is
    more useful than the ``activations.py`` line of ``nn.SiLU``); otherwise the innermost frame
    outside torch itself.
    """
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return "<unknown>"
    modeling = [frame for frame in frames if frame[0].rsplit("/", 1)[-1].startswith("modeling_")]
    outside_torch = [frame for frame in frames if not frame[0].startswith(_TORCH_DIR)]
    path, line = (modeling or outside_torch or frames)[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}"


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
    """The pattern pass of one family: owned ``PatternMatcherPass``, lazy one-time registration."""

    def __init__(self, family: FusionFamily) -> None:
        self.family = family
        self.matcher = pm.PatternMatcherPass(pass_name=f"qwen_npu_{family.name}_fusion")
        self.variants: list[PatternVariant] = []
        self.registration_seconds: float | None = None

    def ensure_registered(self) -> None:
        """Trace and register every variant once (Inductor asserts on duplicate registration)."""
        if self.registration_seconds is not None:
            return
        start = time.perf_counter()
        for variant in self.family.iter_variants():
            compat.register_replacement(
                variant.search_fn,
                variant.replace_fn,
                list(variant.example_inputs()),
                trace_pattern,
                self.matcher,
                extra_check=self._wrap_check(variant),
                scalar_workaround=variant.scalar_workaround,
                search_fn_pattern=variant.search_fn_pattern,
                name=variant.name,
            )
            self.variants.append(variant)
        self.registration_seconds = time.perf_counter() - start
        log.debug("qwen_npu: registered %d %s variants in %.2fs", len(self.variants), self.family.name,
                  self.registration_seconds)

    def _wrap_check(self, variant: PatternVariant) -> Callable[[pm.Match], bool]:
        family = self.family

        def extra_check(match: pm.Match) -> bool:
            reason = variant.check(match) if variant.check is not None else None
            if reason is None:
                return True
            recorder = _ACTIVE_RECORDER.get()
            if recorder is not None:
                recorder.refuse(family.name, match_anchor(match, family.anchor_ops), reason)
            log.debug("qwen_npu: %s refused at %s: %s", variant.name, node_source(match.nodes[-1]), reason)
            return False

        return extra_check

    def apply(self, gm: torch.fx.GraphModule, recorder: RefusalRecorder) -> int:
        """Fuse every match in ``gm`` in place; record refusals and near misses in ``recorder``.

        Returns:
            The number of subgraphs replaced.
        """
        self.ensure_registered()
        with recording(recorder):
            count = self.matcher.apply(gm)
        for anchor in self.anchor_nodes(gm.graph):
            if not recorder.has(self.family.name, anchor):
                recorder.refuse(self.family.name, anchor, "near miss: " + self.family.explain_near_miss(anchor))
        return count

    def anchor_nodes(self, graph: torch.fx.Graph) -> list[torch.fx.Node]:
        """Every node of ``graph`` that calls one of the family's anchor ops."""
        return [node for op in self.family.anchor_ops for node in graph.find_nodes(op="call_function", target=op)]

    def count_anchors(self, graph: torch.fx.Graph) -> int:
        return len(self.anchor_nodes(graph))

    def count_fused(self, graph: torch.fx.Graph) -> int:
        return sum(len(graph.find_nodes(op="call_function", target=op)) for op in self.family.fused_ops)
