"""What ``qwen-npu-compile check`` holds in memory, from a model config alone (nothing is built): the parameter
count (:func:`estimate_num_parameters`), every tensor of every run (:func:`memory_plan`, :class:`MemoryPlan`),
the peak (:func:`estimate_memory_bytes`) and the memory the host has free (:func:`available_memory_bytes`), so
that the caller can refuse a run that would not fit. Imports :mod:`.model_types`; re-exported by :mod:`.models`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from qwen_npu_compile.cli.check.model_types import HYBRID_MODEL_TYPES, _family, rms_norms_per_layer

_GIB = 1024**3


def estimate_num_parameters(config: Any, *, layers: int | None = None) -> int:
    """Number of parameters of a causal LM of :data:`~qwen_npu_compile.cli.check.model_types.FAMILIES`, from its config alone (Qwen2 described here).

    Per decoder layer: q/k/v projections with bias (``h·h + h`` and ``2·(h·kv + kv)``, ``kv =
    num_key_value_heads · head_dim``), o projection without bias (``h·h``), the SwiGLU MLP
    (``3·h·I``), two RMSNorm weights (``2·h``). Plus the embedding (``V·h``), the final norm (``h``)
    and, when the embeddings are not tied, the LM head (``V·h``).

    Args:
        config: A :class:`transformers.Qwen2Config` (or an object with the same attributes).
        layers: Decoder layers to count; ``None`` uses ``config.num_hidden_layers``.

    Hybrid models (:data:`HYBRID_MODEL_TYPES`: Qwen3.5, Qwen3.5-MoE, Qwen3-Next) are counted per layer kind by
    :func:`_hybrid_num_parameters`.

    Returns:
        The parameter count (elements, not bytes).
    """
    n_layers = config.num_hidden_layers if layers is None else layers
    if getattr(config, "model_type", None) in HYBRID_MODEL_TYPES:
        return _hybrid_num_parameters(config, n_layers)
    h = config.hidden_size
    inter = config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q = heads * head_dim
    kv = kv_heads * head_dim
    _, _, bias = _family(config)
    norms = rms_norms_per_layer(config)
    per_layer = (h * q) + 2 * (h * kv) + q * h + 3 * h * inter + 2 * h
    sparse = len(_moe_sparse_layers(config, n_layers))
    if sparse:  # MoE layers: router [E, h] + E experts (3·h·I_moe) + Qwen2-MoE's shared expert and its gate
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        moe_mlp = config.num_experts * (h + 3 * h * config.moe_intermediate_size) + (3 * h * shared + h if shared else 0)
        per_layer_sparse_delta = moe_mlp - 3 * h * inter
    else:
        per_layer_sparse_delta = 0
    if bias:  # Qwen2's q/k/v projections have a bias
        per_layer += q + 2 * kv
    if norms == 4:  # Qwen3's q_norm and k_norm weights
        per_layer += 2 * head_dim
    vocab = config.vocab_size
    lm_head = 0 if config.tie_word_embeddings else vocab * h
    return n_layers * per_layer + sparse * per_layer_sparse_delta + vocab * h + h + lm_head


def _hybrid_num_parameters(config: Any, layers: int) -> int:
    """Parameters of the first ``layers`` decoder layers of a hybrid causal LM (Qwen3.5 / Qwen3.5-MoE /
    Qwen3-Next, transformers 5.x modeling), plus embedding, final norm and LM head (unless tied).

    A formula, not a meta-device build: ``check`` evaluates it for every preset before building anything (the
    memory refusal), and the first import of a transformers modeling module alone costs ~5 s.
    ``tests/cli/test_hybrid_presets.py`` pins it to ``sum(p.numel())`` of the model built on the meta device,
    for every hybrid preset, whole and cut to 4 layers. Per layer, with ``h`` hidden, ``K = linear_num_key_heads
    · linear_key_head_dim``, ``Vd = linear_num_value_heads · linear_value_head_dim``, ``nv`` value heads:

    * ``linear_attention`` (Gated DeltaNet): ``in_proj_qkv`` ``h·(2K + Vd)`` (Qwen3-Next's ``in_proj_qkvz`` and
      ``in_proj_ba`` hold the same), ``in_proj_z`` ``h·Vd``, ``in_proj_b`` and ``in_proj_a`` ``h·nv`` each, the
      depthwise ``conv1d`` ``(2K + Vd)·linear_conv_kernel_dim``, ``A_log`` and ``dt_bias`` ``nv`` each, the gated
      norm's weight ``linear_value_head_dim``, ``out_proj`` ``Vd·h``;
    * ``full_attention`` (gated attention): ``q_proj`` ``h·2·a·d`` (query and output gate), ``k_proj`` and
      ``v_proj`` ``h·kv·d`` each, ``o_proj`` ``a·d·h``, ``q_norm`` and ``k_norm`` ``d`` each (with
      ``attention_bias``: ``2·a·d + 2·kv·d + h`` more);
    * the MLP: dense SwiGLU ``3·h·I``; a sparse layer (:func:`_moe_sparse_layers`) the router ``E·h``, ``E``
      experts ``3·h·I_moe`` each, the shared expert ``3·h·I_shared`` and its sigmoid gate ``h``;
    * two RMSNorm weights ``2·h``.
    """
    h = config.hidden_size
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    nv = config.linear_num_value_heads
    conv_dim = 2 * key_dim + value_dim
    linear = (h * conv_dim + h * value_dim + 2 * h * nv + conv_dim * config.linear_conv_kernel_dim + 2 * nv
              + config.linear_value_head_dim + value_dim * h)
    heads, d = config.num_attention_heads, config.head_dim
    kv = (config.num_key_value_heads or heads) * d
    full = 2 * h * heads * d + 2 * h * kv + heads * d * h + 2 * d
    if getattr(config, "attention_bias", False):
        full += 2 * heads * d + 2 * kv + h
    sparse = set(_moe_sparse_layers(config, layers))
    layer_types = list(getattr(config, "layer_types", None) or [])
    total = 0
    for i in range(layers):
        kind = layer_types[i] if i < len(layer_types) else "full_attention"
        total += (linear if kind == "linear_attention" else full) + 2 * h
        if i in sparse:
            experts = config.num_experts
            shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
            total += experts * h + experts * 3 * h * config.moe_intermediate_size + (3 * h * shared + h if shared else 0)
        else:
            total += 3 * h * config.intermediate_size
    vocab = config.vocab_size
    return total + vocab * h + h + (0 if config.tie_word_embeddings else vocab * h)


def _moe_sparse_layers(config: Any, layers: int) -> list[int]:
    """The sparse MoE layers among the first ``layers`` (the moe fusion family's rule)."""
    from qwen_npu_compile.patterns.moe import _sparse_layers

    return [i for i in _sparse_layers(config) if i < layers]


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What ``qwen-npu-compile check`` holds in memory, run by run (:func:`memory_plan`).

    Attributes:
        phases: per run, in the order the check runs them (``"fp32 reference"`` for half precision,
            ``"eager"``, ``"compiled"``, then ``"comparing"``), the bytes alive at its peak: everything
            kept from the runs before it plus its own parameters, gradients, saved activations and
            vocab-sized logits (comparing: the kept results and the error's fp32 temporaries).
        parts: the named components of the peak phase, in bytes (they add up to its value).
        runtime: the fixed allowance for Python, torch, transformers and the compiler, bytes.
    """

    phases: dict[str, int]
    parts: dict[str, int]
    runtime: int

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)

    @property
    def total(self) -> int:
        """The estimated peak resident memory of the check, bytes."""
        return self.phases[self.peak_phase] + self.runtime

    def describe(self, parts: int = 3) -> str:
        """The largest parts of the peak, e.g. ``"in the fp32 reference run: parameters 2.8 GiB, ..."``."""
        largest = sorted(self.parts.items(), key=lambda item: -item[1])[:parts]
        return f"peak in the {self.peak_phase} run: " + ", ".join(f"{name} {value / _GIB:.1f} GiB" for name, value in largest)


def memory_plan(
    config: Any,
    *,
    layers: int | None,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    train: bool,
    reference: bool = False,
    autocast: bool = False,
) -> MemoryPlan:
    """Every tensor the check creates, run by run, from the config alone (nothing is built).

    The check (:func:`qwen_npu_compile.cli.check.harness.run_check`) runs, in order: the fp32 reference
    (``reference``: an fp32 copy of the model, half precision only), eager, then compiled; each run's
    logits (fp32, ``T·V·4`` bytes) and gradients (one copy, moved out of the parameters) are kept for
    the comparison. With ``P`` = :func:`estimate_num_parameters`, ``b`` = bytes per parameter element
    (``dtype``; 4 with ``autocast``, whose weights stay fp32), ``c`` = bytes per activation element
    (``dtype``), ``T = B·S`` tokens, ``V`` vocab, ``h`` hidden, ``a`` heads, ``I`` intermediate, ``L``
    layers, a run holds:

    * parameters ``P·b`` (the model; ``P·4`` more for the reference copy) and, in train mode, their
      gradients, one copy (``P·b``; ``P·4`` for the reference);
    * train, saved activations: ``L · T·(34·h + 5·a·S + max(0, 6·I − 16·h)) · c/2`` (Korthikanti et
      al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023,
      arXiv:2205.05198, Eq. 1, ``s·b·h·(34 + 5·a·s/h)`` bytes per layer in half precision; the third
      term turns its 4h GeLU MLP, 16·h bytes per token, into SwiGLU's gate, up and product, 6·I);
      inference, one layer's working set ``T·(4·h + 3·I)·c + B·a·S²·c``;
    * train with tied embeddings, the ``[V, h]`` gradient of the shared matrix twice more while autograd
      sums the embedding's and the LM head's contributions (``2·V·h`` elements of the gradient dtype);
    * vocab-sized logits: the LM head's output ``T·V·c``, and in train the loss's fp32 copy, its
      log-softmax and their two gradients (``4·T·V·4``; transformers' ``ForCausalLMLoss`` upcasts the
      logits), in inference the harness's fp32 copy (``T·V·4``).

    Comparing the runs adds, to everything kept, the fp32 temporaries of the error (both sides cast,
    their difference, its absolute value) of one block of :data:`.parity.BLOCK_ELEMENTS` elements.

    The peak is the largest phase plus a fixed 1 GiB (:attr:`MemoryPlan.runtime`). Checked against the
    peak resident set measured by ``tests/cli/test_check_memory.py`` (``ru_maxrss`` of a ``check``
    subprocess) on presets of different vocab and width; see docs/check.md, "Memory".

    Raises:
        ValueError: ``batch`` or ``seq_len`` < 1, or ``layers`` < 1.
    """
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch and seq_len must be >= 1, got batch={batch}, seq_len={seq_len}")
    n_layers = config.num_hidden_layers if layers is None else layers
    if n_layers < 1:
        raise ValueError(f"layers must be >= 1, got {n_layers}")
    c = torch.empty((), dtype=dtype).element_size()
    b = 4 if autocast else c
    h, heads, inter, vocab = config.hidden_size, config.num_attention_heads, _mlp_width(config), config.vocab_size
    tokens = batch * seq_len
    n_params = estimate_num_parameters(config, layers=n_layers)

    def activations(e: int) -> int:
        if train:
            return (n_layers * tokens * (34 * h + 5 * heads * seq_len + max(0, 6 * inter - 16 * h)) * e // 2
                    + _delta_net_activations(config, n_layers, tokens, e))
        return tokens * (4 * h + 3 * inter) * e + batch * heads * seq_len * seq_len * e

    def logits(e: int) -> int:
        return tokens * vocab * (e + (16 if train else 4))

    tied = bool(getattr(config, "tie_word_embeddings", False))
    kept_logits = tokens * vocab * 4
    phases: dict[str, int] = {}
    parts_by_phase: dict[str, dict[str, int]] = {}
    kept: dict[str, int] = {}
    runs = (["fp32 reference"] if reference else []) + ["eager", "compiled"]
    for run in runs:
        e = 4 if run == "fp32 reference" else c
        parts = {"parameters": n_params * b}
        if run == "fp32 reference":
            parts["fp32 reference parameters"] = n_params * 4
        parts.update(kept)
        if train:
            parts[f"{run} gradients"] = n_params * (4 if run == "fp32 reference" else b)
        if train and tied:
            parts[f"{run} tied-embedding gradient sum"] = 2 * vocab * h * (4 if run == "fp32 reference" else b)
        parts[f"{run} activations"] = activations(e)
        parts[f"{run} logits"] = logits(e)
        phases[run] = sum(parts.values())
        parts_by_phase[run] = parts
        if train:
            kept[f"kept {run} gradients"] = parts[f"{run} gradients"]
        kept[f"kept {run} logits"] = kept_logits
    # comparing: every kept result, plus the error's fp32 temporaries (check.parity works in blocks)
    from qwen_npu_compile.cli.check.parity import BLOCK_ELEMENTS

    parts = {"parameters": n_params * b, **kept, "comparison temporaries": 4 * BLOCK_ELEMENTS * 4}
    phases["comparing"] = sum(parts.values())
    parts_by_phase["comparing"] = parts
    peak = max(phases, key=phases.__getitem__)
    return MemoryPlan(phases=phases, parts=parts_by_phase[peak], runtime=_GIB)


def _mlp_width(config: Any) -> int:
    """The MLP width per token of the activation estimate: ``intermediate_size``; for a hybrid MoE model (which may
    have no ``intermediate_size``: Qwen3.5-MoE) the routed experts' ``num_experts_per_tok · moe_intermediate_size``
    plus the shared expert's width."""
    if getattr(config, "model_type", None) in HYBRID_MODEL_TYPES and getattr(config, "num_experts", 0):
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        return config.num_experts_per_tok * config.moe_intermediate_size + shared
    return config.intermediate_size


def _delta_net_activations(config: Any, layers: int, tokens: int, e: int) -> int:
    """Saved activations of the Gated DeltaNet layers among the first ``layers`` of a hybrid model beyond the
    per-layer term of :func:`memory_plan` (training), bytes; 0 for other models.

    Per token: the projections and the conv output (``2·(2K + Vd) + 2·Vd`` elements of the activation dtype, ``e``
    bytes) and transformers' ``torch_chunk_gated_delta_rule``, which works in fp32 on q and k repeated to the value
    heads (``nv·dk`` each) and v (``nv·dv``), saving about 8 and 4 copies of them, the chunk-of-64 attention
    matrices (about 4 of ``nv·64``) and one recurrent state ``[nv, dk, dv]`` per chunk of 64 tokens. An estimate
    that errs high (the check's peaks at ``--layers 4`` are the parameters, exactly counted).
    """
    if getattr(config, "model_type", None) not in HYBRID_MODEL_TYPES:
        return 0
    kinds = list(getattr(config, "layer_types", None) or [])[:layers]
    linear = sum(kind == "linear_attention" for kind in kinds)
    nv, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    key_dim, value_dim = config.linear_num_key_heads * dk, nv * dv
    projections = (2 * (2 * key_dim + value_dim) + 2 * value_dim) * e
    rule = (8 * nv * dk + 4 * nv * dv + 4 * nv * 64 + -(-nv * dk * dv // 64)) * 4
    return linear * tokens * (projections + rule)


def estimate_memory_bytes(config: Any, **plan: Any) -> int:
    """The estimated peak memory of ``check``, bytes: :attr:`MemoryPlan.total` of :func:`memory_plan`
    (``plan`` is its keyword arguments: ``layers``, ``batch``, ``seq_len``, ``dtype``, ``train``, ``reference``,
    ``autocast``; ``reference`` adds the fp32 reference run of half precision). It errs high.

    Raises:
        ValueError: ``batch`` or ``seq_len`` < 1, or ``layers`` < 1.
    """
    return memory_plan(config, **plan).total


def available_memory_bytes() -> int:
    """Memory available to a new process on this host, in bytes.

    Reads ``MemAvailable`` from ``/proc/meminfo`` (Linux, kB); falls back to
    ``os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")`` (free pages, which undercounts
    reclaimable cache). No psutil dependency.

    Returns:
        Available bytes, or 0 when neither source exists (callers should read 0 as "unknown").
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    fields = line.split()
                    unit = fields[2].lower() if len(fields) > 2 else "kb"
                    scale = 1024 if unit == "kb" else 1
                    return int(fields[1]) * scale
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return 0

