"""The *canonicalize* stage (canonicalize → fuse → emit → hand off): retrace a Dynamo graph to the
canonical pre-autograd ATen graph.

Dynamo's torch-IR graphs spell one computation many ways (``x.pow(2)`` / ``torch.pow`` / ``**``,
call_method vs call_function, autocast and grad-mode nodes), so patterns are matched one level lower:
``make_fx(..., pre_dispatch=True)`` run under Dynamo's own fake mode gives ``aten.linear``,
``aten.pow.Tensor_Scalar``, ``aten.rsqrt``, ``aten.scaled_dot_product_attention`` ... *before*
autograd, so that the fused ops we put there are differentiated through their own backward ops.
Why this level: after AOTAutograd, forward-only patterns no longer match in training (the intermediates
are saved for backward) and SDPA is already a device-specific op. Measured on a tiny Qwen2 (torch 2.13.0,
transformers 4.57.6 and 5.24.0), the retrace also works under ``dynamic=True`` (symbolic sizes kept, no
new guards); see ``docs/how-it-works.md``.

The graph is then normalised so that one subgraph has one spelling: no-op ``aten.to`` casts (an fp32
tensor cast to fp32) are removed. The same normalisation runs on every traced pattern
(:func:`~qwen_npu_compile.graph.utils.trace_pattern`), so patterns and graphs always agree. Graphs also lose the full slices of
static dimensions that torch 2.7 records and later versions do not (:func:`remove_noop_slices`).

``torch.vmap`` in the model (transformers 4.53-4.57 build every attention mask with it) is desugared
region by region before the retrace, as AOTAutograd would (see :class:`VmapRegion`). The body of each
activation-checkpointed region (``tag_activation_checkpoint``, non-reentrant ``torch.utils.checkpoint``)
is canonicalized on its own and kept a region (:func:`canonical_checkpoint_bodies`,
:func:`~qwen_npu_compile.graph.utils.fusion_graphs`). Every way the retrace can fail raises :class:`CanonicalizationError`; the
backend then compiles the graph unfused.

The normalisations, :func:`~qwen_npu_compile.graph.utils.trace_pattern`, the checkpointed-region walks and :func:`node_source` live in
:mod:`qwen_npu_compile.graph.utils` (below this module and :mod:`qwen_npu_compile.fusion.family`); they are importable
from here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from qwen_npu_compile import compat
from qwen_npu_compile.graph.utils import (
    checkpoint_bodies,
    checkpoint_calls,
    custom_autograd_function_applies,
    node_source,
    normalize,
    remove_noop_slices,
)


def _fake_mode_for(example_inputs: Sequence[object]):
    context = torch._guards.TracingContext.try_get()
    if context is not None and context.fake_mode is not None:
        return context.fake_mode
    detected = torch._guards.detect_fake_mode(example_inputs)
    if detected is not None:
        return detected
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _fake_inputs(example_inputs: Sequence[object], fake_mode) -> list[object]:
    """Fakeify tensors in the tracing context's fake mode, which owns the SymInt inputs' shape env.

    (Placeholder ``example_value`` metas belong to another fake mode and cannot be mixed with them.)
    """
    return [
        value if isinstance(value, torch._subclasses.FakeTensor) and value.fake_mode is fake_mode
        else fake_mode.from_tensor(value) if isinstance(value, torch.Tensor) else value
        for value in example_inputs
    ]


def to_aten_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> torch.fx.GraphModule:
    """Retrace a Dynamo GraphModule into the normalised pre-autograd ATen graph.

    Args:
        gm: the GraphModule Dynamo hands to a backend (parameters arrive as placeholders).
        example_inputs: the backend's example inputs (real or fake tensors, SymInts).

    Returns:
        A GraphModule with the same placeholders and outputs, whose nodes are ATen ops carrying
        ``meta["val"]`` (FakeTensors) and ``meta["stack_trace"]`` back to the model source.

    Raises:
        CanonicalizationError: the graph cannot be retraced, or not faithfully (any error of the
            trace is wrapped in it; Dynamo's ``RestartAnalysis`` passes through untouched).
    """
    refuse_custom_autograd_functions(gm)
    fake_mode = _fake_mode_for(example_inputs)
    fake_args = _fake_inputs(example_inputs, fake_mode)
    regions = [expand_vmap_region(gm, region) for region in find_vmap_regions(gm.graph)]
    bodies = canonical_checkpoint_bodies(gm, dict(zip(gm.graph.find_nodes(op="placeholder"), fake_args)))

    def run(*args):
        return _Retracer(gm, regions, bodies).run(*args)

    # Saved-tensor hooks of an enclosing non-reentrant checkpoint / activation offload must not see
    # the retrace's fake saves (AOTAutograd guards its own tracing the same way).
    with (
        torch.fx.traceback.preserve_node_meta(), fake_mode, compat.saved_tensors_hooks_disabled(),
        compat.checkpoint_bodies_retraceable(list(bodies.values())),
    ):
        aten_gm = _traced("the pre-dispatch retrace", lambda: make_fx(run, pre_dispatch=True)(*fake_args))
    compat.strip_default_context_fn(aten_gm)
    if len(checkpoint_bodies(aten_gm)) != len(bodies):
        # torch 2.7's pre-dispatch tracer inlines the regions: fused, the backward would save every
        # activation the user asked to recompute. Keeping their memory plan beats fusing.
        raise CanonicalizationError(
            f"the pre-dispatch retrace inlined {len(bodies)} activation-checkpointed region(s) (torch "
            f"{torch.__version__}); compiling unfused keeps them recomputed. qwen_npu_compile.maybe_compile "
            "(per-layer compile) fuses inside checkpointed layers on this torch"
        )
    for body in checkpoint_bodies(aten_gm):  # torch 2.10+ retraced them once more inside the HOP's rule
        remove_noop_slices(body.graph)
        normalize(body)
    fake_constants = sorted(
        {node.target for node in aten_gm.graph.find_nodes(op="get_attr")
         if isinstance(getattr(aten_gm, node.target, None), torch._subclasses.FakeTensor)}
    )
    if fake_constants:
        # make_fx lost track of a computed tensor and froze its *fake* value into the graph: the
        # retraced graph would be wrong (this is what an undesugared torch.vmap region did; another
        # functorch transform in the model would do the same).
        raise CanonicalizationError(
            f"the pre-dispatch retrace froze computed tensors into constants ({', '.join(fake_constants)}); "
            "a functorch transform (torch.vmap, grad, jvp) in the model that the retrace cannot follow"
        )
    remove_noop_slices(aten_gm.graph)
    normalize(aten_gm)
    return aten_gm


def refuse_custom_autograd_functions(gm: torch.fx.GraphModule) -> None:
    """Refuse a graph that applies a custom ``torch.autograd.Function`` (Dynamo's ``autograd_function_apply``
    HOP, e.g. verl's ``NPUGmmFunction`` in its ``npu_patch`` MoE block): the pre-dispatch retrace keeps only
    its forward, under ``no_grad``, and drops its backward, so the parameters it reads got no gradient at
    all (silently; found with verl 0.9.1's patched Qwen3-MoE). Unfused, AOTAutograd traces the function's
    own backward and the gradients are right.

    Raises:
        CanonicalizationError: naming the function's model source line.
    """
    for _, node in custom_autograd_function_applies(gm):
        raise CanonicalizationError(
            f"the graph applies a custom torch.autograd.Function at {node_source(node)}: the pre-dispatch "
            "retrace would drop its backward (no gradient for what it reads); compiling unfused keeps it"
        )


class CanonicalizationError(RuntimeError):
    """The Dynamo graph cannot be retraced faithfully; the backend falls back to the unfused graph."""


def _traced(what: str, trace: Callable[[], torch.fx.GraphModule]) -> torch.fx.GraphModule:
    """Run ``trace``; any error of it becomes a :class:`CanonicalizationError` saying ``what`` failed.

    Functorch levels the trace leaves pushed are popped. Dynamo's ``RestartAnalysis`` (a request to
    recapture, not a failure) and a :class:`CanonicalizationError` pass through unchanged.
    """
    try:
        with compat.functorch_levels_restored():
            return trace()
    except (CanonicalizationError, torch._dynamo.exc.RestartAnalysis):
        raise
    except Exception as exc:  # noqa: BLE001 - any failure here means: compile unfused, never crash or be wrong
        raise CanonicalizationError(f"{what} failed: {type(exc).__name__}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


# --------------------------------------------------------------------------------------------------
# torch.vmap in the Dynamo graph
#
# transformers 4.53-4.57 ``masking_utils._vmap_for_bhqkv`` build every attention mask with a 4-fold
# torch.vmap. Dynamo inlines it as a flat run of nodes: lazy_load_decompositions,
# _vmap_increment_nesting, _add_batch_dim, the per-example body, _remove_batch_dim,
# _vmap_decrement_nesting (spellings by torch version: compat.VMAP_ENTER / VMAP_EXIT). The pre-dispatch
# tracer runs *above* functorch's batching layer, so it cannot follow the batched tensors: on torch
# 2.7-2.8 and 2.13 they are frozen into the graph as constants, on 2.9-2.11 the retrace crashes.
# AOTAutograd's tracer runs *below* the batching layer and records the plain ATen ops the batching
# rules emit. So each vmap region is traced that way on its own (expand_vmap_region), and the
# pre-dispatch retrace runs those plain ops in the region's place (_Retracer): the canonical graph
# holds no functorch calls at all.


@dataclasses.dataclass
class VmapRegion:
    """An outermost ``_vmap_increment_nesting`` .. matching ``_vmap_decrement_nesting`` run of nodes.

    Attributes:
        nodes: the region's nodes in graph order, the increment first and the decrement last.
        inputs: nodes outside the region that it reads (tensors, SymInts), in first-use order.
        outputs: region nodes read outside the region (normally the one ``_remove_batch_dim``).
        expanded: the region as plain ATen ops (:func:`expand_vmap_region`): a GraphModule taking
            ``inputs`` and returning a tuple of ``outputs``' values; None before expansion.
    """

    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node]
    outputs: list[torch.fx.Node]
    expanded: torch.fx.GraphModule | None = None


def _calls(node: torch.fx.Node, targets: frozenset) -> bool:
    return node.op == "call_function" and node.target in targets


def find_vmap_regions(graph: torch.fx.Graph) -> list[VmapRegion]:
    """The outermost vmap regions of ``graph``, in graph order (nested vmaps belong to their outer one).

    Raises:
        CanonicalizationError: the increment and decrement calls do not balance.
    """
    regions: list[VmapRegion] = []
    current: list[torch.fx.Node] | None = None
    depth = 0
    for node in graph.nodes:
        if _calls(node, compat.VMAP_ENTER):
            if depth == 0:
                current = []
            depth += 1
        if current is not None:
            current.append(node)
        if _calls(node, compat.VMAP_EXIT):
            depth -= 1
            if depth < 0:
                raise CanonicalizationError("unbalanced torch.vmap nesting calls in the Dynamo graph")
            if depth == 0:
                inside = set(current)
                inputs = list(dict.fromkeys(i for n in current for i in n.all_input_nodes if i not in inside))
                outputs = [n for n in current if any(user not in inside for user in n.users)]
                regions.append(VmapRegion(current, inputs, outputs))
                current = None
    if depth != 0:
        raise CanonicalizationError("unbalanced torch.vmap nesting calls in the Dynamo graph")
    return regions


def _example_value(node: torch.fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def expand_vmap_region(gm: torch.fx.GraphModule, region: VmapRegion) -> VmapRegion:
    """Trace ``region`` as AOTAutograd would (below the batching layer) into plain ATen ops.

    The region is copied into a graph of its own and traced with plain ``make_fx`` on Dynamo's own
    ``example_value`` metas of its inputs, in Dynamo's fake mode; symbolic sizes stay symbolic (the
    traced graph reads them off its inputs).

    Returns:
        ``region``, with ``expanded`` set.

    Raises:
        CanonicalizationError: an input has no example value, the inputs come from different fake
            modes, the trace fails, or it leaves functorch calls or tensor constants behind.
    """
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in region.inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta.update(node.meta)
    for node in region.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[node] for node in region.outputs))
    region_gm = torch.fx.GraphModule(gm, graph)

    examples = [_example_value(node) for node in region.inputs]
    missing = [node.name for node, value in zip(region.inputs, examples) if value is None]
    if missing:
        raise CanonicalizationError(f"torch.vmap region inputs without example values: {', '.join(missing)}")
    modes = {id(v.fake_mode): v.fake_mode for v in examples if isinstance(v, torch._subclasses.FakeTensor)}
    if len(modes) > 1:
        raise CanonicalizationError("torch.vmap region inputs come from different fake modes")
    fake_mode = next(iter(modes.values()), None)

    def run(*args):
        return torch.fx.Interpreter(region_gm).run(*args)

    with (
        torch.fx.traceback.preserve_node_meta(),
        fake_mode if fake_mode is not None else contextlib.nullcontext(),
        compat.saved_tensors_hooks_disabled(),
    ):
        expanded = _traced(f"tracing the torch.vmap region at {region.nodes[0].name}", lambda: make_fx(run)(*examples))
    leftovers = [
        n.name for n in expanded.graph.nodes
        if n.op == "get_attr" or _calls(n, compat.VMAP_ENTER | compat.VMAP_EXIT)
    ]  # fmt: skip
    if leftovers:
        raise CanonicalizationError(
            f"the torch.vmap region at {region.nodes[0].name} did not trace to plain ATen ops "
            f"({', '.join(leftovers)} left)"
        )
    region.expanded = expanded
    return region


class _Retracer(torch.fx.Interpreter):
    """Runs the Dynamo graph for make_fx, with each vmap region replaced by its plain-ATen expansion
    and each checkpointed region's body by its canonical graph (``bodies``: attribute name -> graph)."""

    def __init__(
        self, gm: torch.fx.GraphModule, regions: Sequence[VmapRegion], bodies: dict[str, torch.fx.GraphModule]
    ):
        super().__init__(gm)
        self._bodies = bodies
        self._starts = {region.nodes[0]: region for region in regions}
        self._inside = {node for region in regions for node in region.nodes}
        self._results: dict[torch.fx.Node, object] = {}

    def run_node(self, n: torch.fx.Node):
        region = self._starts.get(n)
        if region is not None:
            outputs = torch.fx.Interpreter(region.expanded).run(*(self.env[node] for node in region.inputs))
            self._results.update(zip(region.outputs, outputs))
        if n in self._inside:
            return self._results.pop(n, None)
        if _calls(n, compat.VMAP_LAZY_LOAD) and not n.users:
            return None  # loads functorch's batching decompositions: the expansion no longer needs them
        return super().run_node(n)

    def fetch_attr(self, target: str):
        body = self._bodies.get(target)
        return body if body is not None else super().fetch_attr(target)


# --------------------------------------------------------------------------------------------------
# Activation-checkpointed regions
#
# Non-reentrant ``torch.utils.checkpoint`` (transformers' gradient_checkpointing_enable, HF Trainer's
# gradient_checkpointing=True) reaches the backend as one call per region,
# ``tag_activation_checkpoint(wrap_body_N, *inputs, use_reentrant=False)``, whose body is a Dynamo
# GraphModule attribute. The pre-dispatch retrace keeps that call (AOTAutograd later decides what the
# backward recomputes from it), so each body is canonicalized on its own first, from the example
# values Dynamo recorded on the call's inputs, and the retrace runs the canonical body in its place
# (torch 2.7-2.9 keep the body they are given; torch 2.10+ retrace it once more, which leaves a
# canonical graph canonical). The fusion passes then run on the top-level graph and on every body
# (:func:`~qwen_npu_compile.graph.utils.fusion_graphs`): the recomputation in the backward runs the same fused ops.


def canonical_checkpoint_bodies(
    gm: torch.fx.GraphModule, inputs_of: dict[torch.fx.Node, object]
) -> dict[str, torch.fx.GraphModule]:
    """Canonicalize the body of every checkpointed region of the Dynamo graph ``gm``.

    ``inputs_of`` maps ``gm``'s placeholders to the values the retrace runs on: a region input that is
    a graph input gets that value (under ``dynamic=True`` a float such as RMSNorm's eps is a 0-d tensor
    input whose ``.item()`` only that value can answer); any other input its recorded example value.

    Returns:
        Attribute name (``wrap_body_0``) -> the body's canonical ATen graph (same placeholders).

    Raises:
        CanonicalizationError: a body cannot be retraced (its error names the region).
    """
    bodies: dict[str, torch.fx.GraphModule] = {}
    for call in checkpoint_calls(gm.graph):
        name = call.args[0].target
        if name in bodies:
            continue
        inputs = [
            (inputs_of[arg] if arg in inputs_of else _example_value(arg)) if isinstance(arg, torch.fx.Node) else arg
            for arg in call.args[1:]
        ]
        if any(value is None for value in inputs):
            raise CanonicalizationError(f"checkpointed region {name}: an input has no example value to retrace it with")
        body = getattr(gm, name)
        try:
            bodies[name] = to_aten_graph(body, inputs)
        except CanonicalizationError as exc:
            raise CanonicalizationError(f"checkpointed region {name}: {exc}") from exc
        # A user's selective-checkpointing policy (checkpoint(..., context_fn=...)) travels with the body.
        bodies[name].meta.update({k: v for k, v in body.meta.items() if k == compat.CHECKPOINT_CONTEXT_FN})
    return bodies


def lift_tensor_constants(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Turn the real tensor constants make_fx folded into ``gm`` into trailing graph inputs.

    make_fx keeps constants it computed while tracing (e.g. the scalar tensors of transformers 4.57's
    mask construction) as plain *real* tensor attributes ``_tensor_constantN``; AOTAutograd, which
    traces under a fake mode, rejects them ("expected FakeTensor for arg, got Tensor"). As inputs
    they are fakeified like every other input. The caller passes the returned tensors after the
    original inputs (:func:`qwen_npu_compile.graph.emit.bind_trailing_inputs`).

    Returns:
        The constants, in the order of the placeholders appended to ``gm``.
    """
    constants: list[torch.Tensor] = []
    placeholders = gm.graph.find_nodes(op="placeholder")
    by_target: dict[str, torch.fx.Node] = {}
    for node in list(gm.graph.find_nodes(op="get_attr")):
        value = getattr(gm, node.target, None)
        if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
            continue
        if node.target not in by_target:
            anchor = by_target[next(reversed(by_target))] if by_target else placeholders[-1]
            with gm.graph.inserting_after(anchor):
                placeholder = gm.graph.placeholder(f"lifted{node.target}")
            placeholder.meta.update(node.meta)
            by_target[node.target] = placeholder
            constants.append(value)
        node.replace_all_uses_with(by_target[node.target])
        gm.graph.erase_node(node)
    for target in by_target:
        delattr(gm, target)
    if constants:
        gm.graph.lint()
        gm.recompile()
    return constants


