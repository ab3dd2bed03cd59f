"""Step 1 of the pipeline: retrace a Dynamo graph to the canonical pre-autograd ATen graph.

Dynamo's torch-IR graphs spell one computation many ways (``x.pow(2)`` / ``torch.pow`` / ``**``,
call_method vs call_function, autocast and grad-mode nodes), so patterns are matched one level lower:
``make_fx(..., pre_dispatch=True)`` run under Dynamo's own fake mode gives ``aten.linear``,
``aten.pow.Tensor_Scalar``, ``aten.rsqrt``, ``aten.scaled_dot_product_attention`` ... *before*
autograd, so that the fused ops we put there are differentiated through their own backward ops.
``shared/reference/qwen2-graph-notes.md`` records why this level and how it was shown to work,
including under ``dynamic=True`` (symbolic sizes kept, no new guards).

The graph is then normalised so that one subgraph has one spelling: no-op ``aten.to`` casts (an fp32
tensor cast to fp32) are removed. The same normalisation runs on every traced pattern
(:func:`trace_pattern`), so patterns and graphs always agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

aten = torch.ops.aten

#: ``aten.to`` overloads: they return ``self`` when nothing changes, so erasing them is exact.
_TO_OPS = (aten.to.dtype, aten.to.dtype_layout)


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
    return [fake_mode.from_tensor(value) if isinstance(value, torch.Tensor) else value for value in example_inputs]


def _saved_tensors_hooks_disabled():
    disable = getattr(torch._dynamo.utils, "_disable_saved_tensors_hooks_during_tracing", None)
    return disable() if disable is not None else contextlib.nullcontext()


def to_aten_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> torch.fx.GraphModule:
    """Retrace a Dynamo GraphModule into the normalised pre-autograd ATen graph.

    Args:
        gm: the GraphModule Dynamo hands to a backend (parameters arrive as placeholders).
        example_inputs: the backend's example inputs (real or fake tensors, SymInts).

    Returns:
        A GraphModule with the same placeholders and outputs, whose nodes are ATen ops carrying
        ``meta["val"]`` (FakeTensors) and ``meta["stack_trace"]`` back to the model source.
    """
    fake_mode = _fake_mode_for(example_inputs)
    fake_args = _fake_inputs(example_inputs, fake_mode)

    def run(*args):
        return torch.fx.Interpreter(gm).run(*args)

    # Saved-tensor hooks of an enclosing non-reentrant checkpoint / activation offload must not see
    # the retrace's fake saves (AOTAutograd guards its own tracing the same way).
    with torch.fx.traceback.preserve_node_meta(), fake_mode, _saved_tensors_hooks_disabled():
        aten_gm = make_fx(run, pre_dispatch=True)(*fake_args)
    fake_constants = sorted(
        {node.target for node in aten_gm.graph.find_nodes(op="get_attr")
         if isinstance(getattr(aten_gm, node.target, None), torch._subclasses.FakeTensor)}
    )
    if fake_constants:
        # make_fx lost track of a computed tensor and froze its *fake* value into the graph: the
        # retraced graph would be wrong (seen with the torch.vmap-built attention masks of
        # transformers 4.5x masking_utils).
        raise CanonicalizationError(
            f"the pre-dispatch retrace froze computed tensors into constants ({', '.join(fake_constants)}); "
            "this happens with torch.vmap in the model (transformers 4.5x builds attention masks with it)"
        )
    normalize(aten_gm)
    return aten_gm


class CanonicalizationError(RuntimeError):
    """The Dynamo graph cannot be retraced faithfully; the backend falls back to the unfused graph."""


def lift_tensor_constants(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Turn the real tensor constants make_fx folded into ``gm`` into trailing graph inputs.

    make_fx keeps constants it computed while tracing (e.g. the scalar tensors of transformers 4.57's
    mask construction) as plain *real* tensor attributes ``_tensor_constantN``; AOTAutograd, which
    traces under a fake mode, rejects them ("expected FakeTensor for arg, got Tensor"). As inputs
    they are fakeified like every other input. The caller passes the returned tensors after the
    original inputs (``backend.bind_trailing_inputs``).

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


def remove_noop_casts(graph: torch.fx.Graph) -> int:
    """Erase ``aten.to`` nodes whose input already has the requested dtype.

    Only plain dtype casts are removed (no layout, device, memory_format or ``copy=True``).

    Returns:
        The number of casts removed.
    """
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _TO_OPS:
            continue
        source = node.args[0] if node.args else None
        if not isinstance(source, torch.fx.Node):
            continue
        val_in, val_out = source.meta.get("val"), node.meta.get("val")
        if not isinstance(val_in, torch.Tensor) or not isinstance(val_out, torch.Tensor):
            continue
        if node.kwargs.get("copy") or (len(node.args) > 3 and node.args[3]):
            continue
        if node.kwargs.get("memory_format") not in (None, torch.preserve_format):
            continue
        same = (
            val_in.dtype == val_out.dtype
            and val_in.device == val_out.device
            and val_in.layout == val_out.layout
            and val_in.shape == val_out.shape
        )
        if same:
            node.replace_all_uses_with(source)
            graph.erase_node(node)
            removed += 1
    return removed


def normalize(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Apply every normalisation in place (currently: :func:`remove_noop_casts`) and recompile."""
    remove_noop_casts(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm


def trace_pattern(fn: Callable[..., object], args: Sequence[object], **_ignored) -> torch.fx.GraphModule:
    """Trace a pattern or replacement function exactly as :func:`to_aten_graph` traces models.

    This is the ``trace_fn`` given to Inductor's ``register_replacement``; it must accept (and here
    ignores) the ``get_decomp_fn`` keyword: pre-dispatch graphs are matched undecomposed.
    """
    with torch.fx.traceback.preserve_node_meta():
        gm = make_fx(fn, pre_dispatch=True)(*args)
    return normalize(gm)
