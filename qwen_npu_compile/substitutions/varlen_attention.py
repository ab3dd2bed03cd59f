"""Packed micro-batches under per-layer compile: sequence offsets once per micro-batch, varlen attention.

verl packs every micro-batch into one row (``use_remove_padding``, its default): ``input_ids (1, T)``,
``position_ids (1, T)`` restarting at 0 for each sequence, ``attention_mask=None``, ``use_cache=False``
(verl 0.9.1 ``verl/workers/engine/fsdp/transformer_impl.py`` ``prepare_model_inputs``).
With :func:`~qwen_npu_compile.maybe_compile` each
decoder layer is its own graph and never sees how the row was packed, only a mask (``sdpa``: the
``[1, 1, T, T]`` block-diagonal mask transformers builds eagerly) or nothing (``flash_attention_2``:
transformers re-derives the offsets in every layer with ``nonzero``, ``.item()`` and ``.tolist()``: 13
graphs per layer, a recompile per number of sequences: ``docs/verl.md``).

What :func:`install` puts in place instead (the design MindSpeed and vllm-ascend use: host offsets
computed once per step, read by every layer):

1. **A forward pre-hook on the base model** (the module that owns the decoder layers). When the call is
   provably a packed causal batch (no ``attention_mask``, no KV cache, ``position_ids`` of shape
   ``(1, T)``, every layer full attention: no sliding window, and the model's attention implementation
   is ``sdpa`` or ``flash_attention_2``), it computes the cumulative sequence ends **on the host**
   (:func:`~qwen_npu_compile.ops.qwen_npu.varlen_attention.host_seq_ends`: one device-to-host copy per
   micro-batch, not per layer) with the rule of the implementation whose result it replaces
   (``sdpa``: a sequence starts where ``diff(position_ids) != 1``, as transformers'
   ``find_packed_sequence_indices`` builds the packed mask; ``flash_attention_2``: where
   ``position_ids == 0``, as ``prepare_fa_kwargs_from_position_ids`` does), passes them to the layers as
   the keyword argument :data:`SEQ_ENDS_KWARG` (an int64 CPU tensor ``[B]``, its length marked unbacked
   so that no packing recompiles), and passes ``attention_mask`` as transformers' own per-layer-type
   mapping ``{"full_attention": None}`` so that no ``T x T`` mask is built at all. Under verl's Ulysses
   sequence parallelism the local ``position_ids`` are all-gathered first (one collective per
   micro-batch), so the offsets are global, as verl's wrapper computes them.
2. **Takeovers** of the two attention entry points that receive that keyword (installed once per
   process; each passes any call without it to the original untouched):

   * ``flash_attention_2``: transformers' ``_flash_attention_forward`` as
     ``integrations/flash_attention.py`` calls it, or, when verl's Ulysses wrapper has replaced that
     name, the ``_flash_attention_forward`` the wrapper calls (``verl/models/transformers/monkey_patch.py``)
     so that verl's all-to-all stays around it;
   * ``sdpa``: ``ALL_ATTENTION_FUNCTIONS["sdpa"]``.

   Both call ``qwen_npu.varlen_attention`` (TND views of q/k/v, GQA native, ``sparse_mode=3`` with the
   compressed causal mask; :mod:`qwen_npu_compile.ops.qwen_npu.varlen_attention`) after checking its limits
   (``varlen_violation``). A call the op cannot take goes to transformers' own code (flash attention: its
   varlen path; sdpa: a per-sequence loop, since the mask was not built), with one warning.

The layer's graph therefore holds one ``qwen_npu.varlen_attention`` per layer and no ``T x T`` tensor;
the attention family counts it as a fusion of the variant ``varlen_packed_offsets``
(``patterns/attention/family.py`` ``TAKEOVER_VARIANT``).

What this relies on is checked at :func:`install` (a changed transformers or verl fails loudly there,
naming the version): the ``_flash_attention_forward`` name and parameters, ``ALL_ATTENTION_FUNCTIONS``,
the base model's ``forward`` taking ``attention_mask`` / ``position_ids``. Whether it also takes a mask mapping
indexed by ``config.layer_types`` (the dense decoders of transformers 4.57.6-5.24: ``if not
isinstance(attention_mask, dict)``) decides step 1's ``attention_mask``; a base model that does not (the MoE
models of 5.24) keeps building its own mask from the same position ids, which the takeovers then ignore
(:data:`MASK_BUILT_KWARG`). With Ulysses sp > 1 the layers trace with Dynamo's nested graph breaks
(:func:`ulysses_tracing`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys

import torch
from torch import nn

log = logging.getLogger("qwen_npu_compile")

#: The keyword argument that carries the host sequence ends from the base model to attention.
SEQ_ENDS_KWARG = "qwen_npu_seq_ends"

#: Passed (``True``) beside the ends when the base model builds its mask itself from the call's
#: ``position_ids`` (no mask mapping accepted: Qwen3-MoE / Qwen2-MoE of transformers 5.24). ``flash_attention_2``
#: then gets no mask (transformers builds none without padding); ``sdpa`` gets the ``[1, 1, T, T]`` packed
#: causal mask of those same position ids (no padding mask, no cache: the pre-hook checked), which varlen
#: attention replaces exactly; only its construction, outside the layers, stays ``T x T``.
MASK_BUILT_KWARG = "qwen_npu_mask_from_positions"


#: Attention implementations whose packed path is taken over, with the rule their packing follows.
RULES = {"sdpa": "restart", "flash_attention_2": "zero"}

#: Parameters of transformers' ``_flash_attention_forward`` the takeover reads (4.57.6, 5.10.4, 5.24.0).
_FA_PARAMETERS = ("query_states", "key_states", "value_states", "attention_mask", "query_length", "is_causal",
                  "dropout", "position_ids", "softmax_scale", "sliding_window", "softcap", "target_dtype")

#: KV-cache keyword spellings of a base model's forward (transformers 4.x ``past_key_values``, 5.2x ``cache``).
_CACHE_KWARGS = ("past_key_values", "cache", "past_key_value")

_warned: set[str] = set()


class VarlenIntegrationError(RuntimeError):
    """transformers or verl no longer has what the packed-sequence integration relies on."""


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def _versions() -> str:
    import transformers

    verl = sys.modules.get("verl")
    return f"transformers {transformers.__version__}" + (f", verl {getattr(verl, '__version__', '?')}" if verl else "")


# --------------------------------------------------------------------------------------------------
# the pre-hook: offsets once per micro-batch


def _attn_implementation(config) -> str | None:
    return getattr(config, "_attn_implementation", None)


def _full_attention_only(config) -> bool:
    """Every attention layer is full (causal) attention: no sliding window in use (Qwen2 ``use_sliding_window``,
    Mistral ``sliding_window``, ``layer_types`` with ``sliding_attention``). Gated DeltaNet layers
    (``linear_attention``: Qwen3.5 / Qwen3-Next) have no attention to take over; their packed rows are
    :mod:`.deltanet`'s."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t not in ("full_attention", "linear_attention") for t in layer_types):
        return False
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return False
    if getattr(config, "use_sliding_window", None) is None and getattr(config, "sliding_window", None):
        return False  # Mistral/Mixtral: sliding_window alone switches it on
    return True


def _ulysses_group():
    """verl's Ulysses group and size when sequence parallelism is active in this process, else (None, 1)."""
    ulysses = sys.modules.get("verl.utils.ulysses")
    if ulysses is None:
        return None, 1
    size = ulysses.get_ulysses_sequence_parallel_world_size()
    return (ulysses.get_ulysses_sequence_parallel_group(), size) if size > 1 else (None, 1)


def _global_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """The packed row's global position ids: verl's Ulysses slices ``(1, T)`` into ``(1, T/sp)`` per rank
    and its attention wrapper all-gathers them (``monkey_patch._ulysses_flash_attention_forward``)."""
    group, size = _ulysses_group()
    if size == 1:
        return position_ids
    parts = [torch.empty_like(position_ids) for _ in range(size)]
    torch.distributed.all_gather(parts, position_ids.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def packing_refusal(module: nn.Module, kwargs: dict) -> str | None:
    """Why this base-model call is not a provably packed causal batch (None when it is).

    Args:
        module: the base model (``Qwen2Model``, ...); its ``config`` is read.
        kwargs: the call's keyword arguments.
    """
    config = getattr(module, "config", None)
    implementation = _attn_implementation(config)
    if implementation not in RULES:
        return f"attn_implementation {implementation!r} (taken over: {sorted(RULES)})"
    if kwargs.get("attention_mask") is not None:
        return "an attention_mask is given (padding or a user mask): transformers' own mask path"
    if any(kwargs.get(name) is not None for name in _CACHE_KWARGS) or kwargs.get("use_cache"):
        return "a KV cache is in use"
    position_ids = kwargs.get("position_ids")
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        shape = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else None
        return f"position_ids {shape} is not one packed row (1, T)"
    if position_ids.dtype.is_floating_point:
        return f"position_ids dtype {position_ids.dtype}"
    if not _full_attention_only(config):
        return "the model uses sliding-window attention"
    if getattr(config, "attention_dropout", 0.0) and module.training:
        return f"attention_dropout={config.attention_dropout} in training (varlen attention takes keep_prob 1)"
    return None


def _limits_refusal(module: nn.Module, tokens: int) -> str | None:
    """The varlen kernel's limits (``varlen_violation``) for this model's attention at ``tokens`` tokens,
    checked on meta tensors before the layers run: heads, KV heads and head dim from the config, the dtype
    attention will see (autocast's, else the parameters')."""
    from qwen_npu_compile.ops.qwen_npu.varlen_attention import varlen_violation

    config = module.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    parameter = next(module.parameters(), None)
    device = parameter.device.type if parameter is not None else "cpu"
    dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
             else (parameter.dtype if parameter is not None else torch.float32))
    q = torch.empty(tokens, heads, head_dim, dtype=dtype, device="meta")
    kv = torch.empty(tokens, kv_heads, head_dim, dtype=dtype, device="meta")
    return varlen_violation(q, kv, kv, None, head_num=heads)


def _mark_unbacked(tensor: torch.Tensor, dim: int) -> None:
    """No guard on the number of sequences: an unbacked size (no 0/1 specialisation, so a single-sequence
    micro-batch reuses the graph); torch releases without ``mark_unbacked`` get ``maybe_mark_dynamic``."""
    decorators = torch._dynamo.decorators
    mark = getattr(decorators, "mark_unbacked", None) or decorators.maybe_mark_dynamic
    mark(tensor, dim)


def mark_tokens_dynamic(args: tuple, kwargs: dict) -> None:
    """Before a decoder layer's compiled call that carries the offsets: mark the token dim of its inputs
    dynamic (``maybe_mark_dynamic``), so that the first packing already compiles the graph every later T
    reuses (a static first graph, then a dynamic one, then a third for the checkpoint's recomputation
    would exceed verl's 2 graphs per call site: measured with verl 0.9.1's engine, gradient checkpointing).

    Args:
        args, kwargs: the layer call's arguments: ``hidden_states [1, T, H]``, ``position_ids [1, T]``,
            ``position_embeddings`` (cos, sin ``[1, T, D]``).
    """
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        return
    tokens = hidden.shape[1]
    candidates = [hidden, kwargs.get("position_ids"), *(kwargs.get("position_embeddings") or ())]
    for tensor in candidates:
        if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[1] == tokens and tokens > 1:
            torch._dynamo.maybe_mark_dynamic(tensor, 1)


def _mask_mapping(config) -> dict:
    return {kind: None for kind in set(getattr(config, "layer_types", None) or ["full_attention"])}


def _packed_pre_hook(module: nn.Module, args: tuple, kwargs: dict):
    """The base model's forward pre-hook (``with_kwargs=True``): see the module docstring, step 1."""
    from qwen_npu_compile.ops.qwen_npu.varlen_attention import host_seq_ends, offsets_violation

    if args or SEQ_ENDS_KWARG in kwargs:
        if args:
            _warn_once("positional", "qwen_npu: %s called with positional arguments; packed-sequence offsets "
                       "are only derived from keyword calls (verl's)", type(module).__name__)
        return None
    reason = packing_refusal(module, kwargs)
    if reason is not None:
        log.debug("qwen_npu: no varlen offsets for this call: %s", reason)
        return None
    rule = RULES[_attn_implementation(module.config)]
    positions = _global_positions(kwargs["position_ids"]).cpu()  # the one device-to-host copy
    if rule == "zero" and int(positions[0, 0]) != 0:
        log.debug("qwen_npu: no varlen offsets: the packed row does not start at position 0")
        return None
    ends = host_seq_ends(positions, rule)
    reason = offsets_violation(ends, positions.shape[-1]) or _limits_refusal(module, positions.shape[-1])
    if reason is not None:
        _warn_once(f"offsets:{reason}", "qwen_npu: packed micro-batch keeps transformers' attention path: %s", reason)
        return None
    _mark_unbacked(ends, 0)
    kwargs = dict(kwargs)
    kwargs[SEQ_ENDS_KWARG] = ends
    if getattr(module, "_qwen_npu_mask_mapping", True):
        kwargs["attention_mask"] = _mask_mapping(module.config)
    else:
        kwargs[MASK_BUILT_KWARG] = True
    return args, kwargs


def _base_model(model: nn.Module) -> nn.Module | None:
    """The module whose forward builds the masks and runs the decoder layers (``model.model``)."""
    from qwen_npu_compile.layers import find_decoder_layers

    layers = find_decoder_layers(model)
    layer_ids = {id(layer) for _, layer in layers}
    best = None
    for module in model.modules():
        for child in module.children():
            if isinstance(child, nn.ModuleList) and any(id(m) in layer_ids for m in child):
                best = module
    return best


def _takes_mask_mapping(base: nn.Module) -> bool:
    """Whether the base model's ``forward`` accepts a per-layer-type mask mapping as ``attention_mask`` (and then
    builds no mask), as the dense decoders of transformers 4.57.6-5.24 do (``isinstance(attention_mask, dict)``).
    Qwen3-MoE and Qwen2-MoE of transformers 5.24 call ``create_causal_mask`` on it directly: see
    :data:`MASK_BUILT_KWARG`.

    Raises:
        VarlenIntegrationError: ``forward`` takes no ``attention_mask`` or ``position_ids`` (names the versions).
    """
    parameters = inspect.signature(type(base).forward).parameters
    missing = [name for name in ("attention_mask", "position_ids") if name not in parameters]
    if missing:
        raise VarlenIntegrationError(
            f"qwen_npu: {type(base).__name__}.forward has no {missing} ({_versions()}); the packed-sequence "
            "integration supports transformers 4.57.6-5.24 decoder models"
        )
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False
    return "attention_mask, dict)" in source


# --------------------------------------------------------------------------------------------------
# the takeovers


def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ends: torch.Tensor, scale: float):
    """``[1, T, N, D]`` (BSND) q/k/v -> varlen attention output ``[1, T, Nq, Dv]``, or None when refused."""
    from qwen_npu_compile.ops.qwen_npu import varlen_attention as varlen

    heads = query.shape[2]
    q, k, v = (t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3]) for t in (query, key, value))
    # The pre-hook checked every limit on the host (the offsets' values and the shapes it can know,
    # _limits_refusal); while Dynamo traces the layer nothing more is checked (no .tolist() of the offsets
    # in the graph, and torch 2.7's guard_or_false is a function Dynamo refuses to trace: a graph break).
    reason = None if torch.compiler.is_compiling() else varlen.varlen_violation(q, k, v, None, head_num=heads)
    if reason is not None:
        _warn_once(f"refused:{reason}", "qwen_npu: packed attention not fused into varlen attention (%s); "
                   "using transformers' path", reason)
        return None
    out = varlen.OP(q, k, v, ends, heads, float(scale), 3)[0]
    return out.view(query.shape[0], query.shape[1], heads, value.shape[-1])


def _flash_takeover(original, positional: tuple[str, ...]):
    """``_flash_attention_forward(query_states [1, T, N, D], ...)`` -> varlen attention when the pre-hook
    passed the offsets and the call is plain causal packed attention; else ``original``.

    ``positional``: the names of ``original``'s parameters after ``query_length``, in order (read from its
    signature at install time: no ``inspect`` in the traced path)."""

    @functools.wraps(original)
    def _flash_attention_forward(query_states, key_states, value_states, attention_mask, query_length, *args,
                                 **kwargs):
        ends = kwargs.pop(SEQ_ENDS_KWARG, None)
        kwargs.pop(MASK_BUILT_KWARG, None)  # flash attention: transformers built no mask (no padding)
        if ends is None:
            return original(query_states, key_states, value_states, attention_mask, query_length, *args, **kwargs)
        bound = dict(zip(positional, args))
        bound.update(kwargs)
        plain = (attention_mask is None and bound.get("is_causal", True) and not bound.get("dropout")
                 and bound.get("sliding_window") is None and bound.get("softcap") is None
                 and query_states.shape[0] == 1 and bound.get("cu_seq_lens_q") is None
                 and query_states.shape[1] == key_states.shape[1])
        if plain:
            target = bound.get("target_dtype")
            if target is not None and query_states.dtype == torch.float32:
                # what transformers' fa_peft_integration_check does for fp32 (PEFT-cast) inputs
                query_states, key_states, value_states = (t.to(target) for t in (query_states, key_states,
                                                                                 value_states))
            scale = bound.get("softmax_scale") or query_states.shape[-1] ** -0.5
            out = _varlen(query_states, key_states, value_states, ends, scale)
            if out is not None:
                return out
        else:
            _warn_once("fa-not-plain", "qwen_npu: a flash-attention call with offsets is not plain causal packed "
                       "attention (mask, dropout, sliding window or softcap); using transformers' path")
        return original(query_states, key_states, value_states, attention_mask, query_length, *args, **kwargs)

    _flash_attention_forward._qwen_npu_original = original
    return _flash_attention_forward


def _per_sequence_sdpa(query, key, value, ends: torch.Tensor, scale, groups: int) -> torch.Tensor:
    """Exact packed causal attention without a mask when varlen attention is refused (rare): one SDPA per
    sequence. ``query [1, N, T, D]`` (BNSD) -> ``[1, T, N, Dv]``."""
    outs, start = [], 0
    key = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    value = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    for end in ends.tolist():
        sl = slice(start, end)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, sl], key[:, :, sl], value[:, :, sl], is_causal=True, scale=scale))
        start = end
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _sdpa_takeover(original):
    """``sdpa_attention_forward(module, query [1, N, T, D], ...)`` -> varlen attention when the pre-hook
    passed the offsets; else ``original``."""

    @functools.wraps(original)
    def sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
        ends = kwargs.pop(SEQ_ENDS_KWARG, None)
        if kwargs.pop(MASK_BUILT_KWARG, False):
            attention_mask = None  # transformers' packed causal mask of the offsets' own position ids
        if ends is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        dropout = args[0] if args else kwargs.get("dropout", 0.0)
        scaling = args[1] if len(args) > 1 else kwargs.get("scaling")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if attention_mask is None and not dropout and query.shape[0] == 1:
            out = _varlen(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), ends, scale)
            if out is not None:
                return out, None
        if attention_mask is not None:
            raise VarlenIntegrationError(
                "qwen_npu: sdpa got both packed-sequence offsets and an attention mask; the pre-hook passes no "
                f"mask ({_versions()}): report this"
            )
        return _per_sequence_sdpa(query, key, value, ends, scale, query.shape[1] // key.shape[1]), None

    sdpa_attention_forward._qwen_npu_original = original
    return sdpa_attention_forward


def _fa2_interface_takeover(original):
    """``ALL_ATTENTION_FUNCTIONS["flash_attention_2"](module, query [1, N, T, D], ...)`` -> varlen attention when
    the pre-hook passed the offsets and no Ulysses all-to-all is needed (sp == 1); else ``original``
    (transformers' ``flash_attention_forward``, which reaches the ``_flash_attention_forward`` takeover).

    Taking over here, not only inside, keeps ``module.layer_idx`` out of the traced code: transformers'
    ``flash_attention_forward`` reads it, and torch <= 2.9 guards integer module attributes as constants, so
    every decoder layer recompiled the shared layer graph (transformers 4.57.6 + torch 2.9: one graph per
    layer, eager after ``recompile_limit``)."""

    @functools.wraps(original)
    def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                sliding_window=None, softcap=None, is_causal=None, **kwargs):
        ends = kwargs.get(SEQ_ENDS_KWARG)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        plain = (ends is not None and attention_mask is None and not dropout and sliding_window is None
                 and softcap is None and causal and kwargs.get("s_aux") is None and query.shape[0] == 1
                 and not kwargs.get("output_attentions") and _ulysses_group()[1] == 1)
        if plain:
            if query.dtype == torch.float32 and torch.is_autocast_enabled(query.device.type):
                # what transformers' get_target_dtype + fa_peft_integration_check do for fp32 under autocast
                dtype = torch.get_autocast_dtype(query.device.type)
                query, key, value = (t.to(dtype) for t in (query, key, value))
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            out = _varlen(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), ends, scale)
            if out is not None:
                return out, None
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        sliding_window=sliding_window, softcap=softcap, is_causal=is_causal, **kwargs)

    flash_attention_forward._qwen_npu_original = original
    return flash_attention_forward


def _install_interface_takeover(name: str, takeover) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS[name]
    if getattr(current, "_qwen_npu_original", None) is None:
        ALL_ATTENTION_FUNCTIONS[name] = takeover(current)


def _check_flash_signature(function, where: str):
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError) as exc:
        raise VarlenIntegrationError(f"qwen_npu: cannot read the signature of {where} ({_versions()}): {exc}")
    missing = [p for p in _FA_PARAMETERS if p not in parameters]
    if missing:
        raise VarlenIntegrationError(
            f"qwen_npu: {where} lacks the parameters {missing} ({_versions()}); the packed-sequence integration "
            "supports transformers 4.57.6-5.24 and verl 0.9.1"
        )
    return parameters


def _install_flash_takeover() -> str:
    """Wrap the ``_flash_attention_forward`` that transformers' (or verl's Ulysses) FA2 entry point calls."""
    import transformers.integrations.flash_attention as fa_integration

    current = getattr(fa_integration, "_flash_attention_forward", None)
    if current is None:
        raise VarlenIntegrationError(
            f"qwen_npu: transformers.integrations.flash_attention has no _flash_attention_forward ({_versions()})"
        )
    verl_patch = sys.modules.get("verl.models.transformers.monkey_patch")
    ulysses = getattr(verl_patch, "_ulysses_flash_attention_forward", None) if verl_patch else None
    if ulysses is not None and current is ulysses:
        # verl's apply_monkey_patch (run for every model it builds) put its wrapper in: take over what it calls
        where = "verl.models.transformers.monkey_patch._flash_attention_forward"
        inner = getattr(verl_patch, "_flash_attention_forward", None)
        if inner is None:
            raise VarlenIntegrationError(f"qwen_npu: {where} is missing ({_versions()})")
        if getattr(inner, "_qwen_npu_original", None) is None:
            verl_patch._flash_attention_forward = _flash_takeover(inner, _after_query_length(inner, where))
        fa_integration._flash_attention_forward = _ulysses_dispatch(ulysses)
        return where + " (inside verl's Ulysses wrapper; with sp > 1 the wrapper runs outside the graph)"
    where = "transformers.integrations.flash_attention._flash_attention_forward"
    if getattr(current, "_qwen_npu_original", None) is None:
        fa_integration._flash_attention_forward = _flash_takeover(current, _after_query_length(current, where))
    return where


def _after_query_length(function, where: str) -> tuple[str, ...]:
    names = tuple(_check_flash_signature(function, where))
    return names[names.index("query_length") + 1:]


def _ulysses_dispatch(ulysses_forward):
    """verl's Ulysses wrapper as flash attention's entry point: traced (sp == 1: it only calls the taken-over
    ``_flash_attention_forward``) or, with sp > 1, run outside Dynamo (``torch.compiler.disable``): its
    list-form ``dist.all_to_all`` (``verl/utils/ulysses.py`` ``SeqAllToAll``) is not traceable off torchair
    (torch 2.13 ``traceable_collective_remaps`` lacks it), so the all-to-all, the varlen attention between them
    and the all-to-all back run eagerly, once per layer, and the layer's graph splits around them."""
    island = torch.compiler.disable(ulysses_forward, recursive=True)

    @functools.wraps(ulysses_forward)
    def _flash_attention_forward(*args, **kwargs):
        if _ulysses_group()[1] > 1:
            return island(*args, **kwargs)
        return ulysses_forward(*args, **kwargs)

    _flash_attention_forward._qwen_npu_original = ulysses_forward
    return _flash_attention_forward


def packed_layer_call(args: tuple, kwargs: dict, layer: nn.Module | None = None):
    """The context a decoder layer's compiled call runs in (``worker._CompiledLayerCall``): for a packed
    micro-batch (the offsets passed as :data:`SEQ_ENDS_KWARG`), its token dim marked dynamic
    (:func:`mark_tokens_dynamic`) and, with Ulysses sp > 1, :func:`ulysses_tracing`; otherwise nothing.

    verl's own offsets ``cu_seqlens`` / ``cu_seqlens_cpu`` (its packed Qwen3.5 forward) are marked unbacked (no
    recompile per number of sequences) only when ``layer``'s traced code reads them through the DeltaNet
    takeover (:func:`~qwen_npu_compile.substitutions.deltanet.offsets_traceable`): verl's own forward would call
    ``.tolist()`` on them, which an unbacked size turns into ``GuardOnDataDependentSymNode``. ``layer`` None
    (a caller that does not say): not marked."""
    import contextlib

    from qwen_npu_compile.substitutions import deltanet

    if SEQ_ENDS_KWARG not in kwargs:
        return contextlib.nullcontext()
    mark_tokens_dynamic(args, kwargs)
    if layer is not None and deltanet.offsets_traceable(layer):
        for name in ("cu_seqlens", "cu_seqlens_cpu"):
            if isinstance(kwargs.get(name), torch.Tensor):
                _mark_unbacked(kwargs[name], 0)
    return ulysses_tracing(kwargs)


def ulysses_tracing(kwargs: dict):
    """The context a decoder layer's compiled call runs in: with Ulysses sp > 1 and the offsets passed, Dynamo's
    ``nested_graph_breaks`` (torch 2.9-2.13), so that the break at verl's wrapper (:func:`_ulysses_dispatch`)
    splits only the layer's own frame, into the graph before attention (norm, projections, rotary) and the
    graph after it (output projection, residuals, norm, MLP), instead of bubbling up and splitting every frame
    on the way (verl 0.9.1's engine, sp = 2, 2 layers: 17 graphs without, 7 with: 2 per layer per shape
    family, losses equal the unset run). Otherwise (and on a torch without the option) nothing."""
    import contextlib

    if SEQ_ENDS_KWARG not in kwargs or _ulysses_group()[1] == 1 or not hasattr(torch._dynamo.config, "nested_graph_breaks"):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(nested_graph_breaks=True)


def _install_sdpa_takeover() -> str:
    _install_interface_takeover("sdpa", _sdpa_takeover)
    return "ALL_ATTENTION_FUNCTIONS['sdpa']"


def install(model: nn.Module) -> list[str]:
    """Put the packed-sequence path in place for ``model`` (see the module docstring).

    Called by :func:`~qwen_npu_compile.maybe_compile` when it compiles the layers and the attention
    family is enabled. Idempotent per model and per process.

    Args:
        model: a transformers decoder model (possibly PEFT/FSDP-wrapped).

    Returns:
        What was installed (for the log line): the hooked base model and the taken-over entry points;
        ``[]`` when the model's attention implementation is not taken over.

    Raises:
        VarlenIntegrationError: transformers or verl changed what this relies on (the message names the
            versions).
    """
    base = _base_model(model)
    if base is None:
        return []
    implementation = _attn_implementation(getattr(base, "config", None))
    if implementation not in RULES:
        log.info("qwen_npu: attn_implementation %r: packed micro-batches keep transformers' path", implementation)
        return []
    base._qwen_npu_mask_mapping = _takes_mask_mapping(base)
    if not base._qwen_npu_mask_mapping:
        log.info("qwen_npu: %s.forward builds its attention mask itself (no per-layer-type mapping, %s): %s",
                 type(base).__name__, _versions(),
                 "sdpa still builds the [1, 1, T, T] packed mask outside the layers; attention runs varlen"
                 if implementation == "sdpa" else "flash attention builds none; attention runs varlen")
    installed = []
    if not getattr(base, "_qwen_npu_varlen_hook", None):
        base._qwen_npu_varlen_hook = base.register_forward_pre_hook(_packed_pre_hook, with_kwargs=True)
    installed.append(f"{type(base).__name__} forward pre-hook")
    if implementation == "flash_attention_2":
        inner = _install_flash_takeover()  # checks transformers' / verl's signatures first
        _install_interface_takeover("flash_attention_2", _fa2_interface_takeover)
        installed += ["ALL_ATTENTION_FUNCTIONS['flash_attention_2']", inner]
    else:
        installed.append(_install_sdpa_takeover())
    return installed
