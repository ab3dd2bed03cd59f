"""How the traffic benchmarks get a model's AOT forward and backward graphs, at real shapes, without running it.

1. A transformers model with ``L`` decoder layers is built under a
   :class:`~torch._subclasses.fake_tensor.FakeTensorMode` (parameters are CPU FakeTensors: shapes, no storage; a
   Qwen2.5-7B layer at S = 4096 costs about 0.5 GB of host RAM), ``attn_implementation="sdpa"``, in the run's dtype,
   and called with ``inputs_embeds``, so that neither the embedding nor the LM head is counted while the rotary
   cos/sin and the masks are built exactly as the model builds them. Training: ``train()``, the input requires grad
   and the final norm is ``Identity`` (decoder layers only); inference: ``eval()`` under ``no_grad``, the final norm
   kept (so that every layer's norms follow a residual add in both L = 1 and L = 2).
2. ``torch.compile(fullgraph=True)`` with a recording backend. Per variant, Dynamo's graph goes through
   :func:`qwen_npu_compile.graph.canonicalize.to_aten_graph`, the variant's family passes
   (:func:`qwen_npu_compile.fusion.manager.fuse`, checks as for torchair on an NPU: :data:`MODELLED_TARGET`) and
   :func:`qwen_npu_compile.graph.emit.finalize` (:func:`fused_aten_graph`), then AOTAutograd (default partitioner
   unless one is given, backward compiled eagerly) whose forward and backward compilers record the two graphs
   (:func:`record_aot`). Variants that run the same model code (the same verl patches and attention) share one
   Dynamo capture; each gets its own ATen graph, passes and AOT run.

Nothing here measures a kernel (:mod:`benchmarks.cost_model` counts the graphs); the one figure it reports is each
capture's wall time, ``"seconds"`` (float seconds, this host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers.models.qwen2 import modeling_qwen2

from qwen_npu_compile import ensure_npu_ops
from qwen_npu_compile.cli.check.models import with_layers
from qwen_npu_compile.config import QwenNpuConfig
from qwen_npu_compile.fusion.family import CompileTarget
from qwen_npu_compile.fusion.manager import FuseResult, fuse
from qwen_npu_compile.graph import canonicalize, emit
from qwen_npu_compile.substitutions import deltanet

from .verl_patch import npu_flash_attention_2, verl_patches

#: The checks run as they would for an Ascend host: torchair downstream, real npu ops.
MODELLED_TARGET = CompileTarget("torchair", simulated=False)

#: How a dense variant's model runs attention (which decides the captured model code; see :func:`build_graphs`).
ATTENTION_MODES = {
    "sdpa": "transformers' SDPA attention (attn_implementation='sdpa'; packed: the [1, 1, T, T] mask)",
    "npu_fa2": "transformers' flash_attention_2 on NPU (benchmarks.verl_patch.npu_flash_attention_2): "
    "npu_fusion_attention in BSND (one sequence) or TND with actual_seq_qlen (packed), sparse_mode 3",
}


@dataclasses.dataclass(frozen=True)
class LayerVariant:
    """One way of running a model's decoder layers (:mod:`benchmarks.moe_traffic`'s ``MoeVariant``,
    :mod:`benchmarks.qwen3_5_traffic`'s ``Qwen35Variant``, the dense :class:`Variant`; their module docstrings
    name them).

    Attributes:
        name: key in the results.
        families: the qwen_npu families whose passes run (empty: none).
        verl: the model's verl ``npu_patch`` and transformers' NPU flash attention (one capture of its own).
        description: one line for the results.
        varlen_recognition: False: the attention pass may not prove a packed mask (:func:`explicit_mask_only`).
    """

    name: str
    families: tuple[str, ...]
    verl: bool
    description: str
    varlen_recognition: bool = True


@dataclasses.dataclass(frozen=True)
class Variant(LayerVariant):
    """A dense Qwen2 variant (:mod:`benchmarks.traffic`), which also says how the model's attention runs
    (:data:`ATTENTION_MODES`)."""

    attention: str = "sdpa"

    @property
    def capture_key(self) -> tuple[bool, str]:
        """Variants with the same key run the same model code and share one Dynamo capture."""
        return self.verl, self.attention


@contextlib.contextmanager
def explicit_mask_only() -> Iterator[None]:
    """Within the block, no attention mask is proven packed: the attention pass fuses transformers'
    ``[1, 1, T, T]`` packed mask as an explicit ``atten_mask`` (qwen_npu before the varlen recognition,
    ``patterns/attention/varlen.py``). Its varlen variants then refuse with this reason."""
    from unittest import mock

    from qwen_npu_compile.patterns.attention import varlen as attention_varlen

    reason = "varlen recognition off (benchmarks.capture.explicit_mask_only: the explicit-mask configuration)"
    with mock.patch.object(attention_varlen, "packed_mask", lambda mask: reason):
        yield


@contextlib.contextmanager
def fresh_capture(variants: Sequence[LayerVariant], patches=verl_patches) -> Iterator[None]:
    """Reset Dynamo and, inside the block, what a new capture of ``variants`` traces: ``patches()`` (verl's patches of
    the model code captured; Qwen2's by default) for verl variants, and the DeltaNet substitution, decided while
    Dynamo traces, so set for the whole capture: on only if every variant has the ``gated_delta_rule`` family. The
    substitution's previous setting is restored on exit (it is process-wide: later compiles must not inherit it)."""
    torch._dynamo.reset()
    with deltanet.switched(all("gated_delta_rule" in v.families for v in variants)):
        with patches() if variants[0].verl else contextlib.nullcontext():
            yield


def recording_compiler(slot: dict, kind: str):
    """An AOTAutograd forward/backward compiler that keeps the graph it gets in ``slot[kind]`` and runs it as is."""
    from torch._functorch.aot_autograd import make_boxed_func

    def compiler(gm: torch.fx.GraphModule, example_inputs):
        slot[kind] = gm
        return make_boxed_func(gm.forward)

    return compiler


def fused_aten_graph(gm: torch.fx.GraphModule, example_inputs, families: Sequence[str],
                     varlen_recognition: bool = True) -> tuple[torch.fx.GraphModule, list, FuseResult]:
    """Dynamo's ``gm`` as the backend rewrites it for an Ascend host: the canonical ATen graph, the passes of
    ``families`` (:data:`MODELLED_TARGET`; under :func:`explicit_mask_only` unless ``varlen_recognition``) and
    :func:`~qwen_npu_compile.graph.emit.finalize`.

    Returns:
        ``(graph, inputs, fuse result)``: ``inputs`` are ``example_inputs`` plus the graph's tensor constants, lifted
        to trailing inputs as the backend lifts them (transformers 4.x's mask scalars).
    """
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    graph = canonicalize.to_aten_graph(gm, example_inputs)
    with contextlib.nullcontext() if varlen_recognition else explicit_mask_only():
        result = fuse(graph, QwenNpuConfig(fusions=frozenset(families)), target=MODELLED_TARGET)
    emit.finalize(graph)
    inputs = [*example_inputs, *(fake_mode.from_tensor(c) for c in emit.lift_constants(graph))]
    return graph, inputs, result


def record_aot(slot: dict, graph: torch.fx.GraphModule, inputs: Sequence, partition_fn=None):
    """AOTAutograd of ``graph`` (the default partitioner, or ``partition_fn``), its forward and backward graphs kept in
    ``slot["forward"]`` / ``slot["backward"]``; the backward is compiled eagerly (``force_non_lazy_backward_lowering``),
    so nothing has to run. Returns the compiled function."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch import config as functorch_config

    partition = {} if partition_fn is None else {"partition_fn": partition_fn}
    with functorch_config.patch(force_non_lazy_backward_lowering=True):
        return aot_autograd(fw_compiler=recording_compiler(slot, "forward"),
                            bw_compiler=recording_compiler(slot, "backward"), **partition)(graph, list(inputs))


def capture_layers(model_class, cfg, variants: Sequence[LayerVariant], tokens: int, dtype: torch.dtype,
                   inference: bool, patches, *, canonical: Callable[[LayerVariant], bool] = lambda variant: True,
                   batch: int = 1, packing: Sequence[int] | None = None,
                   flash_attention: bool | None = None) -> dict[str, dict]:
    """Capture the decoder layers of ``model_class`` built from ``cfg`` once under fake tensors (``batch`` rows of
    ``tokens``); each variant's AOT graphs (module docstring).

    The variants must agree on ``verl`` (one Dynamo capture of one model code; ``patches()``, verl's patches of this
    model, is entered for verl variants). Each gets :func:`fused_aten_graph` (unless ``canonical(variant)`` is False: a graph applying a
    custom ``autograd.Function``, which canonicalization refuses, is handed over as captured), then
    :func:`record_aot`.

    Args:
        packing: packed sequence lengths of one row (B = 1): the model also gets ``position_ids`` ``[1, T]`` (a fake
            int64 tensor: the graph is the same for any values; verl's restart at 0 per sequence), and the NPU flash
            attention the packing itself (:func:`benchmarks.verl_patch.npu_flash_attention_2`). Nothing of size
            T x T is allocated: every tensor is fake.
        flash_attention: run attention through transformers' NPU flash attention; None: for verl variants.

    Returns:
        Per variant name ``{"forward": GraphModule, "backward": GraphModule (training), "fusions": {family: n},
        "refusals": [reason, ...]}``, plus ``"seconds"`` (wall time of the whole capture, float).

    Raises:
        ValueError: the variants disagree on ``verl``. RuntimeError: AOTAutograd did not hand over the graphs.
    """
    if len({v.verl for v in variants}) != 1:
        raise ValueError("variants sharing one capture must agree on verl's patches")
    ensure_npu_ops()
    captured: dict[str, dict] = {v.name: {"fusions": {}, "refusals": []} for v in variants}

    def backend(gm: torch.fx.GraphModule, example_inputs):
        for variant in variants:
            slot = captured[variant.name]
            if not canonical(variant):
                record_aot(slot, gm, example_inputs)
                continue
            graph, inputs, result = fused_aten_graph(gm, example_inputs, variant.families, variant.varlen_recognition)
            slot["fusions"] = dict(result.fusions)
            slot["refusals"] = sorted({f"{r.family}: {r.reason}" for r in result.refusals
                                       if r.family in variant.families})
            record_aot(slot, graph, inputs)
        return gm.forward  # both graphs are recorded; Dynamo runs the captured graph once, on fake tensors

    start = time.perf_counter()
    with fresh_capture(variants, patches), contextlib.ExitStack() as stack:
        kwargs = {}
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = model_class._from_config(cfg, attn_implementation="sdpa", dtype=dtype)
            inputs_embeds = torch.empty(batch, tokens, cfg.hidden_size, dtype=dtype, requires_grad=not inference)
            if packing is not None:
                kwargs["position_ids"] = torch.empty(1, tokens, dtype=torch.int64)
        if variants[0].verl if flash_attention is None else flash_attention:
            stack.enter_context(npu_flash_attention_2(model, packing or (tokens,)))
        if not inference:
            model.norm = torch.nn.Identity()  # decoder layers only
        # inference keeps the final norm: every layer's two norms then follow a residual add in both L=1 and L=2
        # (npu_add_rms_norm), and the per-forward work holds layer 0's add-free input norm instead
        model.train(not inference)
        with torch.set_grad_enabled(not inference):
            torch.compile(model, backend=backend, fullgraph=True)(inputs_embeds=inputs_embeds, **kwargs)
    torch._dynamo.reset()
    for name, slot in captured.items():
        if "forward" not in slot or ("backward" not in slot and not inference):
            raise RuntimeError(f"{name}: AOTAutograd did not hand over both graphs ({sorted(slot)})")
    return {**captured, "seconds": time.perf_counter() - start}


def build_graphs(config, layers: int, variants: Sequence[Variant], batch: int, seq: int, dtype: torch.dtype,
                 inference: bool = False, packing: Sequence[int] | None = None) -> dict[str, dict]:
    """Capture ``layers`` dense Qwen2 decoder layers once under fake tensors; return each variant's AOT graphs
    (:func:`capture_layers` of :class:`transformers.Qwen2Model`, with ``B`` rows or one packed row).

    The variants share one Dynamo capture: they must agree on :attr:`Variant.capture_key` (verl's patches and the
    attention mode change the model code).

    Args:
        config: the full model config (only its shapes are used).
        layers: decoder layers to build (1 or 2 here).
        variants: the variants to build from this capture.
        batch: B; seq: S (tokens).
        dtype: parameter and activation dtype.
        inference: ``model.eval()`` under ``torch.no_grad()`` (a log-prob forward): only a forward graph.
        packing: packed sequence lengths summing to ``seq`` (B must be 1), or None (one sequence per row).

    Returns:
        :func:`capture_layers`'s dict.

    Raises:
        ValueError: the variants disagree on their capture key, or ``packing`` does not fit ``batch``/``seq``.
        RuntimeError: AOTAutograd did not hand over both graphs.
    """
    if len({v.capture_key for v in variants}) != 1:
        raise ValueError("variants sharing one capture must agree on the verl patches and the attention mode")
    if packing is not None and (batch != 1 or sum(packing) != seq):
        raise ValueError(f"packing {tuple(packing)} must sum to S={seq} in one row (B=1), got B={batch}")
    return capture_layers(modeling_qwen2.Qwen2Model, with_layers(config, layers), variants, seq, dtype, inference,
                          verl_patches, batch=batch, packing=packing,
                          flash_attention=variants[0].attention == "npu_fa2")
