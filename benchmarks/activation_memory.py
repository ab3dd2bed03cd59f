"""Activation memory per decoder layer: what each way of running a Qwen layer keeps for its backward.

Usage (from the repository root)::

    python -m benchmarks.run --parts activation_memory --out benchmarks/results   # full shapes, S = 4096
    python -m benchmarks.run --parts activation_memory --quick --out /tmp/am       # tiny shapes, seconds
    python -m benchmarks.activation_memory --plot docs/figures/activation_memory.png   # the figure, from the JSON

writes ``<out>/activation_memory.json``; ``python -m benchmarks.markdown benchmarks/results/activation_memory.json``
prints the docs/performance.md table ("Activation memory").

Layers (training, bf16, one row of ``S`` tokens, B = 1; full run S = 4096): Qwen2.5-7B's dense decoder layer
(``qwen2.5-7b`` preset), Qwen3-30B-A3B's MoE layer (``qwen3-30b-a3b``), Qwen3.5-27B's Gated DeltaNet layer and its
full-attention layer (``qwen3.5-27b``; widths from :mod:`qwen_npu_compile.cli.check.presets`). Each model is built with
one decoder layer (Qwen3.5: ``layer_types = [kind]``); its forward is stopped at that layer's call to read the
layer's arguments as the model builds them (hidden states = ``inputs_embeds``, a leaf that requires grad; the rotary
cos/sin; the mask, ``None`` for one causal sequence), and the layer is then called on them in each setting
(:data:`SETTINGS`):

* ``eager``: transformers as is (SDPA; the MoE experts as transformers 5.24's ``grouped_mm``; the DeltaNet's torch
  chunked delta rule);
* ``verl``: verl-style, the same patches as the traffic tables' verl-style rows (:mod:`benchmarks.verl_patch`,
  :mod:`benchmarks.verl_moe_patch`, :mod:`benchmarks.verl_qwen3_5_patch`: verl 0.9.1's ``npu_patch`` modelled on the
  npu stand-ins) and transformers' NPU flash attention (:func:`benchmarks.verl_patch.npu_flash_attention_2`), eager;
* ``qwen_npu_none`` / ``qwen_npu_cheap``: the layer compiled as ``maybe_compile`` compiles it (one graph per decoder
  layer) through qwen_npu's passes (:func:`qwen_npu_compile.fusion.manager.fuse`, every family, checks as for torchair on an NPU,
  as the traffic tables), then AOTAutograd with qwen_npu's partition (:func:`qwen_npu_compile.handoff.recompute.partition_fn`
  around ``default_partition``) for ``recompute="none"`` / ``"cheap"``; the AOT graphs run eagerly;
* ``hf_checkpointing``: transformers' gradient checkpointing (``gradient_checkpointing_enable(use_reentrant=False)``:
  the layer under non-reentrant :func:`torch.utils.checkpoint.checkpoint`), which saves the layer's positional inputs.

**How saved bytes are counted** (:class:`benchmarks.saved_tensors.SavedStorages`): the layer call runs under
:func:`torch.autograd.graph.saved_tensors_hooks`, whose pack hook sees every tensor autograd saves for the backward
(ATen ops' saved variables, ``ctx.save_for_backward`` of the npu stand-ins and of AOTAutograd's compiled function,
checkpoint's saved inputs). Tensors are grouped by storage (views of one buffer count once, the whole storage's
``nbytes``), then split into: parameters (excluded: alive anyway), per-forward inputs shared by all layers (rotary
cos/sin, mask: excluded, reported in ``excluded``), the layer input (``hidden_states``), and the layer's own
activations. **The activation figure counts the layer's own activations plus the layer input when the layer saves
it**: in a stack of layers the input is the previous layer's output, freed after the residual add unless saved (e.g.
by ``npu_rms_norm``), and it is all that gradient checkpointing keeps. ``activation_excluding_input_bytes`` is the
figure without it.

**Fake tensors.** The full shapes run under :class:`~torch._subclasses.fake_tensor.FakeTensorMode` (parameters and
inputs are fake: shapes, dtypes and storages, no data): a fake tensor has a storage of the real size, views share it,
and autograd saves the same tensors, so the counts are those of a real run. :func:`cross_check` proves it on the
tiny configs (real tensors, S = 64, against fake ones: equal bytes per setting and layer), and for the compiled
settings the hook count is checked against the AOT backward graph's saved inputs
(:func:`benchmarks.saved_tensors.graph_saved`, their
producers through views deduplicated) in every run.

**Modelled time** (Atlas A2: 1.6 TB/s HBM, 353.9 TFLOPS BF16 Cube, the CANN developer guide's figures,
:data:`benchmarks.cost_model.BANDWIDTH` / :data:`benchmarks.cost_model.PEAK`; roofline
:func:`benchmarks.cost_model.kernel_time` per kernel, the traffic tables' model): ``recompute_ms`` = the roofline time of the AOT graphs of ``recompute="cheap"`` minus that of ``"none"``
(forward + backward; the recomputed kernels in the backward, :func:`recompute_ops` lists them), the Gated DeltaNet's
delta rule costed on FLA's kernels (:func:`benchmarks.qwen3_5_traffic.cost_delta_rule`, identical in both).
Checkpointing recomputes the whole layer forward: its ``recompute_ms`` is qwen_npu's forward roofline
(``maybe_compile`` fuses inside checkpointed layers). ``layer_ms`` per setting: eager's and verl-style's from the
traffic results at the same shape (``benchmarks/results/{kernel_traffic,moe_traffic,qwen3_5_traffic}.json``: their
``eager`` / ``verl`` rows; ``None`` when no traffic result of the same shape exists, e.g. ``--quick``); qwen_npu's
from its own graphs here (``none``; ``cheap`` = none + recompute; checkpointing = none + the forward).

**Per verl step** (:func:`largest_micro_batch`): the largest micro-batch (tokens) whose decoder layers' activations
fit ``budget`` (default 32 GiB): ``floor(budget / Σ_layers bytes per token)``, all ``num_hidden_layers`` layers
(Qwen3.5-27B: 48 DeltaNet + 16 full-attention layers, its ``layer_types``); activations grow linearly in the tokens
here (flash attention and the chunked delta rule save nothing of size S²; checked at two S by :func:`cross_check`
on the tiny shapes). Not counted: the embedding, final norm, LM head and loss, parameters, gradients and optimizer
state, allocator fragmentation, and the forward's transient peak within a layer.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from qwen_npu_compile import compat, ensure_npu_ops
from qwen_npu_compile.cli.check.models import resolve_model_config, tiny_qwen2_config, with_layers
from qwen_npu_compile.config import ALL_FAMILIES
from qwen_npu_compile.handoff import recompute

from . import moe_traffic, qwen3_5_traffic
from .capture import LayerVariant, fresh_capture, fused_aten_graph, record_aot
from .common import MIB
from .cost_model import BANDWIDTH, PEAK
from .saved_tensors import SavedStorages, graph_saved, split_saved
from .tables import subtract
from .verl_moe_patch import verl_moe_patches
from .verl_patch import npu_flash_attention_2, verl_patches
from .verl_qwen3_5_patch import verl_qwen3_5_patches

log = logging.getLogger(__name__)

GIB = 1024**3
#: Tokens of the full run (one row) and of the quick run.
TOKENS = 4096
QUICK_TOKENS = 128
#: The token count activation figures are normalised to (``MiB per layer per 1k tokens``).
PER_TOKENS = 1024
#: The default activation budget of :func:`largest_micro_batch` (bytes): 32 GiB.
BUDGET_BYTES = 32 * GIB

#: The settings, in table order, with their labels (the plot's and the table's).
SETTINGS = {
    "eager": "eager",
    "verl": "verl-style",
    "qwen_npu_none": "qwen_npu none",
    "qwen_npu_cheap": "qwen_npu cheap",
    "hf_checkpointing": "HF checkpointing",
}

#: The goals this benchmark checks (:func:`goals`): ``cheap`` at most 110 MiB per 7B layer per 1k tokens, at most 3 %
#: more modelled layer time than ``none``; the MoE and Qwen3.5 layers at least 25 % below verl-style.
DENSE_GOAL_MIB = 110.0
TIME_GOAL = 0.03
CUT_GOAL = 0.25


@dataclasses.dataclass(frozen=True)
class LayerCase:
    """One decoder layer to measure.

    Attributes:
        key: key in the results (``"qwen2.5-7b"``, ``"qwen3.5-27b linear_attention"``).
        label: the table's and plot's label.
        preset: the :mod:`qwen_npu_compile.cli.check.presets` name of the full run.
        family: ``"dense"``, ``"moe"`` or ``"qwen3_5"`` (model class, verl patches, tiny config, traffic results).
        kind: the Qwen3.5 ``layer_types`` value, else None.
    """

    key: str
    label: str
    preset: str
    family: str
    kind: str | None = None


CASES = (
    LayerCase("qwen2.5-7b", "Qwen2.5-7B dense", "qwen2.5-7b", "dense"),
    LayerCase("qwen3-30b-a3b", "Qwen3-30B-A3B MoE", "qwen3-30b-a3b", "moe"),
    LayerCase("qwen3.5-27b linear_attention", "Qwen3.5-27B Gated DeltaNet", "qwen3.5-27b", "qwen3_5", "linear_attention"),
    LayerCase("qwen3.5-27b full_attention", "Qwen3.5-27B full attention", "qwen3.5-27b", "qwen3_5", "full_attention"),
)


def _model_class(case: LayerCase):
    if case.family == "dense":
        from transformers.models.qwen2.modeling_qwen2 import Qwen2Model
        return Qwen2Model
    if case.family == "moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeModel
        return Qwen3MoeModel
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel
    return Qwen3_5TextModel


def _verl_patches(case: LayerCase) -> Callable[[], contextlib.AbstractContextManager]:
    return {"dense": verl_patches, "moe": verl_moe_patches, "qwen3_5": verl_qwen3_5_patches}[case.family]


def full_config(case: LayerCase, quick: bool):
    """The model's full config (all its layers): the preset, or the quick run's tiny config (the traffic benchmarks'
    tiny shapes: ``tiny_qwen2_config``, :func:`benchmarks.moe_traffic.tiny_config`,
    :func:`benchmarks.qwen3_5_traffic.tiny_config` with 4 layers, alternating kinds)."""
    if not quick:
        return resolve_model_config(case.preset)
    if case.family == "dense":
        return tiny_qwen2_config(num_hidden_layers=2, use_cache=False)
    if case.family == "moe":
        return moe_traffic.tiny_config()
    return qwen3_5_traffic.tiny_config(layer_types=["linear_attention", "full_attention"] * 2)


def one_layer_config(case: LayerCase, config):
    """``config`` with one decoder layer (of ``case.kind`` for Qwen3.5)."""
    cfg = with_layers(config, 1)
    if case.kind is not None:
        cfg.layer_types = [case.kind]
    return cfg


# ----------------------------------------------------------------------------------------------------
# running one layer


def _tensors_in(value) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]



class _Stop(Exception):
    """Raised by the pre-hook once the layer's arguments are read (the model's forward goes no further)."""


@contextlib.contextmanager
def _setting_context(case: LayerCase, setting: str, model, tokens: int) -> Iterator[None]:
    """verl's patches and NPU flash attention for ``verl``; for qwen_npu, the DeltaNet substitution (decided while
    Dynamo traces: :func:`benchmarks.capture.fresh_capture`); nothing else."""
    if setting == "verl":
        with _verl_patches(case)(), npu_flash_attention_2(model, (tokens,)):
            yield
    elif setting.startswith("qwen_npu"):
        variant = LayerVariant(setting, tuple(ALL_FAMILIES), False, setting)
        with fresh_capture([variant], _verl_patches(case)):
            yield
        torch._dynamo.reset()
    else:
        yield


def _layer_arguments(model, inputs_embeds: torch.Tensor) -> tuple[tuple, dict]:
    """The positional and keyword arguments the model passes its first decoder layer."""
    found = {}

    def hook(module, args, kwargs):
        found["args"], found["kwargs"] = args, kwargs
        raise _Stop

    handle = model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(inputs_embeds=inputs_embeds)
    except _Stop:
        pass
    finally:
        handle.remove()
    return found["args"], found["kwargs"]


def _qwen_npu_backend(setting: str, slot: dict):
    """A torch.compile backend: qwen_npu's passes (every family, torchair's checks), then AOTAutograd with
    qwen_npu's partition for ``recompute`` = ``setting``; records the AOT graphs and the recompute counts in
    ``slot`` and returns the compiled function (so that running it saves what the partition saves)."""
    def backend(gm: torch.fx.GraphModule, example_inputs):
        graph, inputs, result = fused_aten_graph(gm, example_inputs, ALL_FAMILIES)
        slot["fusions"] = {f: n for f, n in result.fusions.items() if n}
        slot["recomputed"] = {}
        partition = recompute.partition_fn(setting, compat.default_partition,
                                           lambda counts: slot["recomputed"].update(counts))
        return record_aot(slot, graph, inputs, partition)

    return backend


def measure_layer(case: LayerCase, config, setting: str, tokens: int, dtype: torch.dtype = torch.bfloat16,
                  fake: bool = True) -> dict:
    """Saved-for-backward storages of one decoder layer of ``case`` in ``setting`` (module docstring).

    Args:
        config: the model's full config (one layer of it is built).
        setting: a key of :data:`SETTINGS`.
        tokens: S (one row, B = 1).
        fake: build and run under a FakeTensorMode (False: real tensors, seeded: the cross-check).

    Returns:
        :func:`~benchmarks.saved_tensors.split_saved`'s dict plus ``tokens``; the qwen_npu settings add ``graph``
        (:func:`~benchmarks.saved_tensors.graph_saved`),
        ``fusions``, ``recomputed`` (per cheap op, its forward calls recomputed) and, not JSON, ``_graphs``
        (the AOT forward and backward graphs).
    """
    ensure_npu_ops()
    cfg = one_layer_config(case, config)
    torch.manual_seed(0)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with mode:
        model = _model_class(case)._from_config(cfg, attn_implementation="sdpa", dtype=dtype)
        inputs_embeds = torch.randn(1, tokens, cfg.hidden_size, dtype=dtype).requires_grad_()
    model.train()
    slot: dict = {}
    with _setting_context(case, setting, model, tokens):
        args, kwargs = _layer_arguments(model, inputs_embeds)
        layer = model.layers[0]
        if setting == "hf_checkpointing":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        call = layer
        if setting.startswith("qwen_npu"):
            call = torch.compile(layer, backend=_qwen_npu_backend(setting.removeprefix("qwen_npu_"), slot),
                                 fullgraph=True)
        saved = SavedStorages()
        with saved.recording():
            out = call(*args, **kwargs)
        layer_input = args[0] if args else kwargs["hidden_states"]
        shared = [t for t in _tensors_in((args[1:], kwargs)) if t is not layer_input]
        if setting == "verl":  # transformers' per-device compressed mask: one tensor per process, all layers share it
            from transformers.integrations import npu_flash_attention
            shared += list(npu_flash_attention.ATTN_MASK_NPU_CACHE.values())
        result = {"tokens": tokens, **split_saved(saved, list(model.parameters()), layer_input, shared)}
        del out
        saved.release()
    if slot:
        result["graph"] = graph_saved(slot["forward"], slot["backward"])
        result["fusions"] = slot["fusions"]
        result["recomputed"] = dict(slot["recomputed"])
        result["_graphs"] = {"forward": slot["forward"], "backward": slot["backward"]}
    return result


# ----------------------------------------------------------------------------------------------------
# modelled time


def _counts(gm: torch.fx.GraphModule) -> dict[str, dict]:
    """Per-op roofline table of an AOT graph (:func:`benchmarks.qwen3_5_traffic.counts`: the traffic tables' counting,
    with the DeltaNet delta rule op on FLA's kernels)."""
    return qwen3_5_traffic.cost_delta_rule(qwen3_5_traffic.counts(gm), gm, "fla")


def _roofline_ms(table: dict[str, dict]) -> float:
    return sum(row["roofline_ps"] for row in table.values()) * 1e-9


def layer_roofline(graphs: dict[str, torch.fx.GraphModule]) -> dict[str, float]:
    """``{"forward", "backward", "total"}`` roofline ms of one layer's AOT graphs (Atlas A2 figures,
    :func:`benchmarks.cost_model.kernel_time`)."""
    fw, bw = _roofline_ms(_counts(graphs["forward"])), _roofline_ms(_counts(graphs["backward"]))
    return {"forward": fw, "backward": bw, "total": fw + bw}


def recompute_ops(none: dict[str, torch.fx.GraphModule], cheap: dict[str, torch.fx.GraphModule]) -> list[dict]:
    """The kernels ``recompute="cheap"`` adds: per op, the kernels, bytes and roofline ms of cheap's graphs beyond
    none's (forward and backward together), largest first."""
    rows = []
    for kind in ("forward", "backward"):
        for op, row in subtract(_counts(cheap[kind]), _counts(none[kind])).items():
            rows.append({"graph": kind, "op": op, "kernels": row["kernels"],
                         "bytes": row["bytes_read"] + row["bytes_written"], "roofline_ms": row["roofline_ps"] * 1e-9})
    return sorted(rows, key=lambda r: -r["roofline_ms"])


_TRAFFIC_FILES = {"dense": "kernel_traffic.json", "moe": "moe_traffic.json", "qwen3_5": "qwen3_5_traffic.json"}


def traffic_layer_ms(case: LayerCase, config, tokens: int, results: Path) -> dict[str, dict | None]:
    """eager's and verl-style's per-layer roofline ms (training, ``{"forward", "backward", "total"}``) from the
    traffic results in ``results``, when they hold this model at this shape; else None each."""
    path = results / _TRAFFIC_FILES[case.family]
    none = {"eager": None, "verl": None, "source": None}
    if not path.exists():
        return none
    data = json.loads(path.read_text())
    hidden = config.hidden_size
    if case.family == "dense":
        entry = data.get("models", {}).get(case.preset)
        if not entry or entry["shape"]["seq_len"] != tokens or entry["shape"]["hidden_size"] != hidden:
            return none
        pick = {name: entry["variants"][name]["roofline_ms_per_layer"] for name in ("eager", "verl")}
    else:
        entry = data.get("models", {}).get(case.preset)
        if not entry or entry["shape"]["tokens"] != tokens or entry["shape"]["hidden_size"] != hidden:
            return none
        rows = (entry["modes"]["training"] if case.family == "moe"
                else entry["layer_kinds"][case.kind]["modes"]["training"])
        pick = {"eager": rows["transformers" if case.family == "moe" else "eager"]["roofline_ms"], "verl": rows["verl"]["roofline_ms"]}
    return {name: {k: ms[k] for k in ("forward", "backward", "total")} for name, ms in pick.items()} | {
        "source": f"benchmarks/results/{path.name}"}


# ----------------------------------------------------------------------------------------------------
# the rows


def _per_1k(num_bytes: int, tokens: int) -> float:
    """MiB per 1,024 tokens."""
    return num_bytes / MIB * PER_TOKENS / tokens


def layer_counts(config, case: LayerCase) -> int:
    """How many layers of ``case``'s kind the model has (Qwen3.5: its ``layer_types``)."""
    if case.kind is None:
        return config.num_hidden_layers
    return sum(kind == case.kind for kind in config.layer_types)


def measure_case(case: LayerCase, config, tokens: int, results: Path) -> dict:
    """Every setting's row for one layer: saved storages, MiB per 1k tokens, modelled ms (module docstring)."""
    rows, graphs = {}, {}
    for setting in SETTINGS:
        start = time.perf_counter()
        row = measure_layer(case, config, setting, tokens)
        graphs[setting] = row.pop("_graphs", None)
        row["seconds"] = round(time.perf_counter() - start, 2)
        row["mib_per_1k_tokens"] = _per_1k(row["activation_bytes"], tokens)
        row["mib_per_1k_tokens_excluding_input"] = _per_1k(row["activation_excluding_input_bytes"], tokens)
        if "graph" in row:
            hooked = row["activation_excluding_input_bytes"]
            if row["graph"]["intermediate_bytes"] != hooked:
                raise RuntimeError(f"{case.key} {setting}: the hooks saw {hooked} bytes of activations, the AOT "
                                   f"graph saves {row['graph']['intermediate_bytes']}")
        rows[setting] = row
        log.info("activation memory: %s %s: %.2f MiB/layer/1k tokens (%d storages, layer input %s; %.1fs)",
                 case.key, setting, row["mib_per_1k_tokens"], row["storages"],
                 "saved" if row["layer_input_bytes"] else "not saved", row["seconds"])
    none_ms = layer_roofline(graphs["qwen_npu_none"])
    cheap_ms = layer_roofline(graphs["qwen_npu_cheap"])
    rows["qwen_npu_cheap"]["recompute_ops"] = recompute_ops(graphs["qwen_npu_none"], graphs["qwen_npu_cheap"])
    base = traffic_layer_ms(case, config, tokens, results)
    layer_ms = {
        "eager": base["eager"],
        "verl": base["verl"],
        "qwen_npu_none": none_ms,
        "qwen_npu_cheap": cheap_ms,
        "hf_checkpointing": {"forward": none_ms["forward"], "backward": none_ms["backward"] + none_ms["forward"],
                             "total": none_ms["total"] + none_ms["forward"]},
    }
    extra = {"eager": 0.0, "verl": 0.0, "qwen_npu_none": 0.0,
             "qwen_npu_cheap": cheap_ms["total"] - none_ms["total"], "hf_checkpointing": none_ms["forward"]}
    for setting, row in rows.items():
        row["layer_ms"] = layer_ms[setting]
        row["recompute_ms"] = extra[setting]
        row["recompute_fraction"] = extra[setting] / none_ms["total"] if setting != "eager" and setting != "verl" else 0.0
    return {"label": case.label, "layers_in_model": layer_counts(config, case), "layer_ms_source": base["source"],
            "settings": rows}


def largest_micro_batch(parts: Sequence[tuple[int, float, int]], budget: int) -> dict:
    """The largest micro-batch (tokens) whose decoder layers' activations fit ``budget`` bytes.

    Args:
        parts: per layer kind of the model, ``(layers, bytes per token per layer, constant bytes per layer)``
            (constant: the compressed causal mask a per-layer graph builds and saves, whatever the tokens).
        budget: bytes.

    Returns:
        ``{"bytes_per_token", "constant_bytes"}`` over all layers and ``"tokens"`` = ``floor((budget - constant) /
        bytes_per_token)`` (ints / float).
    """
    per_token = sum(n * b for n, b, _ in parts)
    constant = sum(n * c for n, _, c in parts)
    tokens = math.floor((budget - constant) / per_token) if per_token else None
    return {"bytes_per_token": per_token, "constant_bytes": constant, "tokens": tokens}


#: Which layer cases make up each model's step (:func:`verl_step`).
MODELS = {"qwen2.5-7b": ("qwen2.5-7b",), "qwen3-30b-a3b": ("qwen3-30b-a3b",),
          "qwen3.5-27b": ("qwen3.5-27b linear_attention", "qwen3.5-27b full_attention")}


def verl_step(layers: dict[str, dict], budget: int) -> dict:
    """Per model and setting: all layers' activation bytes per token and the largest micro-batch within ``budget``."""
    out = {}
    for model, keys in MODELS.items():
        if not all(k in layers for k in keys):
            continue
        out[model] = {}
        for setting in SETTINGS:
            rows = [(layers[k]["layers_in_model"], layers[k]["settings"][setting]) for k in keys]
            parts = [(n, (r["activation_bytes"] - r["constant_bytes"]) / r["tokens"], r["constant_bytes"])
                     for n, r in rows]
            out[model][setting] = {"layers": sum(p[0] for p in parts), **largest_micro_batch(parts, budget)}
    return out


def goals(layers: dict[str, dict]) -> dict:
    """Whether ``recompute="cheap"`` meets the goals (:data:`DENSE_GOAL_MIB`, :data:`TIME_GOAL`, :data:`CUT_GOAL`)."""
    out = {}
    for key, entry in layers.items():
        s = entry["settings"]
        cheap, verl = s["qwen_npu_cheap"]["mib_per_1k_tokens"], s["verl"]["mib_per_1k_tokens"]
        cut = 1 - cheap / verl
        fraction = s["qwen_npu_cheap"]["recompute_fraction"]
        goal = {"cheap_mib_per_1k_tokens": cheap, "verl_mib_per_1k_tokens": verl, "cut_vs_verl": cut,
                "recompute_fraction": fraction, "time_ok": fraction <= TIME_GOAL}
        if key == "qwen2.5-7b":
            goal["memory_ok"] = cheap <= DENSE_GOAL_MIB
            goal["memory_goal"] = f"<= {DENSE_GOAL_MIB} MiB per layer per 1k tokens"
        else:
            goal["memory_ok"] = cut >= CUT_GOAL
            goal["memory_goal"] = f">= {CUT_GOAL:.0%} below verl-style"
        goal["holds"] = goal["memory_ok"] and goal["time_ok"]
        out[key] = goal
    return out


def cross_check(tokens: Sequence[int] = (32, 64), cases: Sequence[LayerCase] = CASES) -> dict:
    """Fake against real tensors on the tiny configs: per case, setting and S, the counted bytes both ways (they must
    be equal), and the bytes per token at both S (linear in S: equal per token).

    Raises:
        RuntimeError: a fake count differs from the real one.
    """
    out = {}
    for case in cases:
        config = full_config(case, quick=True)
        for setting in SETTINGS:
            for s in tokens:
                real = measure_layer(case, config, setting, s, fake=False)
                fake = measure_layer(case, config, setting, s, fake=True)
                pair = {"real": real["activation_bytes"], "fake": fake["activation_bytes"],
                        "real_storages": real["storages"], "fake_storages": fake["storages"]}
                if pair["real"] != pair["fake"] or pair["real_storages"] != pair["fake_storages"]:
                    raise RuntimeError(f"{case.key} {setting} S={s}: fake {pair} differs from real")
                out.setdefault(case.key, {}).setdefault(setting, {})[str(s)] = pair
    return out


def run(quick: bool = False, budget: int = BUDGET_BYTES, results: Path = Path("benchmarks/results"),
        check: bool = True) -> dict:
    """The ``activation_memory.json`` payload (without run metadata): every layer case at S = 4096 under fake tensors
    (quick: the tiny configs at S = 128), the verl-step micro-batches within ``budget``, the goals, and the fake
    vs real cross-check on the tiny configs (``check``; quick: one case, to stay a smoke test)."""
    tokens = QUICK_TOKENS if quick else TOKENS
    layers = {}
    for case in CASES:
        config = full_config(case, quick)
        layers[case.key] = {"model": case.preset, "kind": case.kind, **measure_case(case, config, tokens, results)}
    payload = {
        "kind": "activation_memory",
        "tokens": tokens,
        "dtype": "bfloat16",
        "per_tokens": PER_TOKENS,
        "budget_bytes": budget,
        "bandwidth": BANDWIDTH,
        "peak": PEAK,
        "settings": SETTINGS,
        "definitions": {
            "activation_bytes": "saved-for-backward storages of one decoder layer (saved_tensors_hooks, unique "
            "storage, whole storage nbytes), parameters and per-forward shared inputs (rotary cos/sin, mask) "
            "excluded, the layer input included when the layer saves it",
            "activation_excluding_input_bytes": "activation_bytes without the layer input",
            "mib_per_1k_tokens": "activation_bytes / MiB * 1024 / tokens",
            "graph": "qwen_npu settings: the AOT backward graph's saved inputs, traced through views to the forward "
            "node that made each buffer (intermediate_bytes equals the hooks' activation_excluding_input_bytes)",
            "layer_ms": "per-layer roofline ms, training (forward, backward, total): eager / verl from the traffic "
            "results at this shape (None without), qwen_npu from its AOT graphs here, HF checkpointing = qwen_npu "
            "none + its forward once more",
            "recompute_ms": "modelled extra ms per layer: cheap's graphs' roofline minus none's; HF checkpointing: "
            "qwen_npu's forward roofline",
            "recompute_fraction": "recompute_ms / qwen_npu none's layer roofline",
            "verl_step": "largest micro-batch (tokens) whose num_hidden_layers layers' activation_bytes fit "
            "budget_bytes: floor(budget / sum over layers of bytes per token)",
        },
        "layers": layers,
        "verl_step": verl_step(layers, budget),
        "goals": goals(layers),
    }
    if check:
        payload["fake_vs_real"] = cross_check(cases=CASES[:1] if quick else CASES)
    return payload


# ----------------------------------------------------------------------------------------------------
# the figure


def plot(data: dict, path: Path) -> Path:
    """``path``: MiB per layer per 1k tokens against modelled layer ms (S = ``data["tokens"]``), one panel per layer,
    one labelled point per setting with a layer time (matplotlib, imported here)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("the activation-memory plot needs matplotlib: pip install matplotlib") from exc
    layers = data["layers"]
    columns = 2
    fig, grid = plt.subplots(math.ceil(len(layers) / columns), columns, figsize=(10, 8), squeeze=False)
    axes = grid.flatten()
    markers = {"eager": "o", "verl": "s", "qwen_npu_none": "^", "qwen_npu_cheap": "D", "hf_checkpointing": "v"}
    for ax, (key, entry) in zip(axes, layers.items()):
        for setting, row in entry["settings"].items():
            if row["layer_ms"] is None:
                continue
            x, y = row["layer_ms"]["total"], row["mib_per_1k_tokens"]
            ax.scatter([x], [y], marker=markers[setting], s=40)
            # verl-style and qwen_npu none sit close together: their labels go below and above the points
            offset = {"verl": (6, -11), "qwen_npu_none": (-10, 7)}.get(setting, (6, 4))
            ax.annotate(SETTINGS[setting], (x, y), textcoords="offset points", xytext=offset, fontsize=8)
        ax.set_title(entry["label"], fontsize=10)
        ax.set_xlabel(f"modelled layer time, ms (A2 roofline, S={data['tokens']})", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.set_ylabel("activation memory, MiB / layer / 1k tokens", fontsize=8)
        ax.margins(x=0.15)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """``--plot PATH``: draw the figure from ``--results``'s activation_memory.json (no measurement)."""
    parser = argparse.ArgumentParser(description="qwen_npu activation memory per decoder layer")
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results/activation_memory.json"))
    parser.add_argument("--plot", type=Path, required=True, help="write the figure here")
    args = parser.parse_args(argv)
    print(plot(json.loads(args.results.read_text()), args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
