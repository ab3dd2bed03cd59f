"""``qwen_npu::varlen_attention``: causal attention over packed sequences (TND), offsets as a tensor.

verl's ``use_remove_padding`` packs a micro-batch into one row of ``T`` tokens whose ``position_ids``
restart for each sequence (verl 0.9.1 ``verl/workers/engine/fsdp/transformer_impl.py``
``prepare_model_inputs``; transformers' ``prepare_fa_kwargs_from_position_ids``). Varlen attention computes
each sequence's ``Si x Si`` scores (``sum Si^2`` work) and never a ``T x T`` tensor. Ascend's kernel for it
is ``npu_fusion_attention(..., input_layout="TND", actual_seq_qlen=..., actual_seq_kvlen=...)``, whose
offsets are Python int lists; this op takes them as an int64 tensor instead, so a new packing is a new
input value, not a new graph, and no ``.tolist()`` sits in a traced graph::

    out, softmax_max, softmax_sum = varlen_attention(q, k, v, seq_ends, head_num, scale, sparse_mode=3)
    # q [T, Nq, D], k [T, Nkv, D], v [T, Nkv, Dv]; seq_ends int64 [B] (cumulative ends, last == T)
    dq, dk, dv = varlen_attention_backward(dy, q, k, v, out, softmax_max, softmax_sum, seq_ends, ...)
    seq_ends = seq_ends_from_positions(position_ids, "restart")   # int64 CPU [B], B data-dependent

The kernels call ``torch.ops.npu.npu_fusion_attention(_grad)`` in TND after :func:`~.ensure_npu_ops`: the
real torch_npu kernels on an Ascend host, the CPU stand-in (:mod:`.torch_npu.fusion_attention_tnd`, sequence by
sequence) elsewhere. ``sparse_mode`` 3 (right-down causal, what transformers' NPU FA2 path passes) and 2
(left-up) take the compressed 2048x2048 causal mask (:func:`~.attention_contract.compressed_causal_mask`)
and agree here since every sequence has Sq == Skv; 0 is attention without any mask (non-causal).
Autograd: ``torch.library.register_autograd`` calls ``varlen_attention_backward``, so AOTAutograd's
backward graph holds that op (and no recomputation in ATen). The fake kernels take symbolic ``T`` and a
``seq_ends`` of unbacked length.

Limits: :func:`varlen_violation`, the one home of the varlen kernel's limits (the stand-in's TND path
uses it too), which lives with the other attention limits in :mod:`.attention_contract` (the bottom of the
attention ops: this module and :mod:`.torch_npu.fusion_attention_tnd` import it, not each other) and is importable here.
Contract: ``docs/npu-op-contracts.md`` ("The varlen (TND) form").
"""

from __future__ import annotations

import functools

import torch

from qwen_npu_compile.compat import guard_or_false
from qwen_npu_compile.ops import ensure_npu_ops
from qwen_npu_compile.ops.attention_contract import (
    COMPRESSED_MASK_MODES,
    MAX_SEGMENTS,
    MAX_TOKENS,
    SOFTMAX_STAT_WIDTH,
    SPARSE_MODES,
    _ends_tensor_violation,
    compressed_causal_mask,
    offsets_violation,
    tnd_violation,
    varlen_violation,
)
from qwen_npu_compile.ops.define import QWEN_NPU_LIBRARY, define_op

NAMESPACE = "qwen_npu"
SCHEMA = (
    "varlen_attention(Tensor query, Tensor key, Tensor value, Tensor seq_ends, int head_num, float scale, "
    "int sparse_mode=3) -> (Tensor, Tensor, Tensor)"
)
BACKWARD_SCHEMA = (
    "varlen_attention_backward(Tensor dy, Tensor query, Tensor key, Tensor value, Tensor out, "
    "Tensor softmax_max, Tensor softmax_sum, Tensor seq_ends, int head_num, float scale, int sparse_mode=3) "
    "-> (Tensor, Tensor, Tensor)"
)
SEQ_ENDS_SCHEMA = "seq_ends_from_positions(Tensor position_ids, str rule) -> Tensor"

#: The rules of :func:`seq_ends_from_positions` (see there).
RULES = ("restart", "zero")


# --------------------------------------------------------------------------------------------------
# limits


def _host_ends(op: str, seq_ends: torch.Tensor) -> list[int]:
    """The kernels' offsets as a host list (one copy for a device tensor), after checking the tensor."""
    reason = _ends_tensor_violation(seq_ends) if isinstance(seq_ends, torch.Tensor) else "seq_ends must be a tensor"
    if reason is not None:
        raise RuntimeError(f"{NAMESPACE}::{op}: {reason}")
    return [int(e) for e in seq_ends.tolist()]


def _check(op: str, query, key, value, seq_ends, head_num, sparse_mode) -> None:
    if head_num < 1:
        raise RuntimeError(f"{NAMESPACE}::{op}: head_num must be positive, got {head_num}")
    reason = varlen_violation(query, key, value, seq_ends, head_num, sparse_mode=sparse_mode)
    if reason is not None:
        raise RuntimeError(f"{NAMESPACE}::{op}: {reason}")


@functools.lru_cache(maxsize=8)
def _mask_on(device: str) -> torch.Tensor:
    return compressed_causal_mask(device)


def _mask_for(sparse_mode: int, device: torch.device) -> torch.Tensor | None:
    return _mask_on(str(device)) if sparse_mode in COMPRESSED_MASK_MODES else None


def _tnd_kernel(name: str, tensors: tuple, head_num: int, ends: list[int], sparse_mode: int, **options):
    """``torch.ops.npu.<name>`` (``npu_fusion_attention`` or its grad) in TND over one packing, after
    :func:`~.ensure_npu_ops`; its first three outputs."""
    ensure_npu_ops()
    return getattr(torch.ops.npu, name).default(
        *(t.contiguous() for t in tensors), head_num, "TND", atten_mask=_mask_for(sparse_mode, tensors[0].device),
        actual_seq_qlen=ends, actual_seq_kvlen=ends, sparse_mode=sparse_mode, **options,
    )[:3]


# --------------------------------------------------------------------------------------------------
# varlen_attention


def varlen_attention(  # SCHEMA's arguments, in order (data, as the backward's)
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq_ends: torch.Tensor, head_num: int, scale: float,
    sparse_mode: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Causal attention of each packed sequence (the kernel; module docstring).

    Args:
        query: ``[T, Nq, D]`` (TND), fp16/bf16/fp32.
        key: ``[T, Nkv, D]``, query's dtype (Nq % Nkv == 0: GQA without repeat_kv).
        value: ``[T, Nkv, Dv]``, Dv <= D.
        seq_ends: int64 ``[B]`` cumulative end offsets (strictly increasing, last == T), normally on the
            CPU (read as a host list: no device sync).
        head_num: Nq.
        scale: multiplies ``Q @ K^T`` (pass the module's scaling, e.g. ``D ** -0.5``).
        sparse_mode: 3 right-down causal (default), 2 left-up causal, 0 no mask.

    Returns:
        ``(out [T, Nq, Dv] q.dtype, softmax_max [T, Nq, 8] fp32, softmax_sum [T, Nq, 8] fp32)``: the
        kernel's row max and row sum of the scaled scores (the row value repeated over the last dim of 8).

    Raises:
        RuntimeError: a limit of :func:`varlen_violation` is broken (the message names it).
    """
    ends = _host_ends("varlen_attention", seq_ends)
    _check("varlen_attention", query, key, value, ends, head_num, sparse_mode)
    out, softmax_max, softmax_sum = _tnd_kernel(
        "npu_fusion_attention", (query, key, value), head_num, ends, sparse_mode, scale=scale
    )
    return out, softmax_max, softmax_sum


def _fake(query, key, value, seq_ends, head_num, scale, sparse_mode=3):
    _check("varlen_attention", query, key, value, seq_ends, head_num, sparse_mode)
    tokens, heads = query.shape[0], query.shape[1]
    stats = (tokens, heads, SOFTMAX_STAT_WIDTH)
    return (
        query.new_empty((tokens, heads, value.shape[2])),
        query.new_empty(stats, dtype=torch.float32),
        query.new_empty(stats, dtype=torch.float32),
    )


def varlen_attention_backward(  # BACKWARD_SCHEMA's arguments, in order (data)
    dy: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
    softmax_max: torch.Tensor, softmax_sum: torch.Tensor, seq_ends: torch.Tensor, head_num: int, scale: float,
    sparse_mode: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gradients of :func:`varlen_attention` (``npu_fusion_attention_grad`` in TND).

    Args:
        dy: gradient of ``out``, ``[T, Nq, Dv]``.
        query, key, value, seq_ends, head_num, scale, sparse_mode: as given to the forward.
        out, softmax_max, softmax_sum: the forward's outputs (the real kernel reads them; the CPU stand-in
            recomputes the probabilities).

    Returns:
        ``(dq [T, Nq, D], dk [T, Nkv, D], dv [T, Nkv, Dv])`` in q's dtype (dk/dv summed over each GQA group).

    Raises:
        RuntimeError: a limit of :func:`varlen_violation` is broken, or dy is not shaped like the output.
    """
    ends = _host_ends("varlen_attention_backward", seq_ends)
    _check_backward(dy, query, key, value, ends, head_num, sparse_mode)
    dq, dk, dv = _tnd_kernel(
        "npu_fusion_attention_grad", (query, key, value, dy), head_num, ends, sparse_mode,
        softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=out, scale_value=scale,
    )
    return dq, dk, dv


def _check_backward(dy, query, key, value, seq_ends, head_num, sparse_mode) -> None:
    _check("varlen_attention_backward", query, key, value, seq_ends, head_num, sparse_mode)
    expected = (query.shape[0], query.shape[1], value.shape[2])
    if dy.dim() != 3 or not all(guard_or_false(a == b) for a, b in zip(dy.shape, expected)):
        raise RuntimeError(f"{NAMESPACE}::varlen_attention_backward: dy shape {list(dy.shape)} != out shape "
                           f"{list(expected)}")


def _fake_backward(dy, query, key, value, out, softmax_max, softmax_sum, seq_ends, head_num, scale, sparse_mode=3):
    _check_backward(dy, query, key, value, seq_ends, head_num, sparse_mode)
    return query.new_empty(query.shape), query.new_empty(key.shape), query.new_empty(value.shape)


def _setup_context(ctx, inputs, output):
    query, key, value, seq_ends, head_num, scale, sparse_mode = inputs
    out, softmax_max, softmax_sum = output
    ctx.save_for_backward(query, key, value, out, softmax_max, softmax_sum, seq_ends)
    ctx.head_num, ctx.scale, ctx.sparse_mode = head_num, scale, sparse_mode
    ctx.mark_non_differentiable(softmax_max, softmax_sum)


def _backward(ctx, grad_out, _grad_max, _grad_sum):
    query, key, value, out, softmax_max, softmax_sum, seq_ends = ctx.saved_tensors
    dq, dk, dv = BACKWARD_OP(grad_out, query, key, value, out, softmax_max, softmax_sum, seq_ends,
                             ctx.head_num, ctx.scale, ctx.sparse_mode)
    return dq, dk, dv, None, None, None, None


# --------------------------------------------------------------------------------------------------
# seq_ends_from_positions


def _position_row(position_ids, op: str):
    """position_ids ``[1, T]`` or ``[T]`` of an integer dtype -> the ``[T]`` row; RuntimeError otherwise."""
    if not isinstance(position_ids, torch.Tensor):
        raise RuntimeError(f"{op}: position_ids must be a tensor, got {type(position_ids).__name__}")
    if position_ids.dtype.is_floating_point or position_ids.dtype.is_complex or position_ids.dtype == torch.bool:
        raise RuntimeError(f"{op}: position_ids must be an integer tensor, got {position_ids.dtype}")
    if position_ids.dim() == 2 and guard_or_false(position_ids.shape[0] == 1):
        row = position_ids[0]
    elif position_ids.dim() == 1:
        row = position_ids
    else:
        raise RuntimeError(
            f"{op}: position_ids of shape {list(position_ids.shape)}: packed sequences need one row ([1, T] or [T]); "
            "pack the micro-batch into batch 1 (verl use_remove_padding) or use the padded attention path"
        )
    if guard_or_false(row.shape[0] == 0):
        raise RuntimeError(f"{op}: position_ids is empty (T = 0)")
    return row


def _check_rule(rule: str, op: str) -> None:
    if rule not in RULES:
        raise RuntimeError(f"{op}: rule {rule!r} is none of {RULES}")


def _ends_of_row(row: torch.Tensor, rule: str) -> torch.Tensor:
    """int64 CPU ``[B]`` end offsets of the sequences in ``row`` (a CPU ``[T]`` integer tensor)."""
    row = row.to(torch.int64)
    if rule == "restart":
        starts = torch.nonzero(row[1:] - row[:-1] != 1).flatten() + 1
    else:
        starts = torch.nonzero(row[1:] == 0).flatten() + 1
    return torch.cat([starts, starts.new_tensor([row.shape[0]])])


def seq_ends_from_positions(position_ids: torch.Tensor, rule: str) -> torch.Tensor:
    """Cumulative end offsets of the sequences packed in ``position_ids`` (the kernel of the op).

    Rules (position 0 always starts a sequence):

    - ``"restart"``: a sequence starts where ``position_ids[i] - position_ids[i-1] != 1``: the packed mask of
      transformers' SDPA/eager path (``masking_utils.find_packed_sequence_indices``, ``diff != 1``);
    - ``"zero"``: a sequence starts where ``position_ids[i] == 0``: FA2's
      ``prepare_fa_kwargs_from_position_ids`` (``(position_ids == 0).nonzero()``). A row ``[0, 1, 2, 7, 8]``
      is two sequences by "restart" and one by "zero".

    Args:
        position_ids: ``[1, T]`` or ``[T]``, any integer dtype, any device (copied to the host once).
        rule: ``"restart"`` or ``"zero"``.

    Returns:
        int64 CPU ``[B]``: strictly increasing ends, the last == T.

    Raises:
        RuntimeError: position_ids is not one integer row (batch > 1, wrong rank or dtype, empty), or an
            unknown rule.
    """
    op = f"{NAMESPACE}::seq_ends_from_positions"
    _check_rule(rule, op)
    row = _position_row(position_ids, op)
    return _ends_of_row(row.to("cpu"), rule)


def _fake_seq_ends(position_ids, rule):
    op = f"{NAMESPACE}::seq_ends_from_positions"
    _check_rule(rule, op)
    row = _position_row(position_ids, op)
    return position_ids.new_empty((_sequence_count(position_ids, row.shape[0]),), dtype=torch.int64, device="cpu")


def _sequence_count(position_ids, tokens):
    """The data-dependent B (an unbacked SymInt, 1 <= B <= T) of :func:`_fake_seq_ends`.

    ``torch.library.get_ctx().new_dynamic_size`` refuses when the shape environment disallows
    data-dependent output shapes, which is Dynamo's default without ``fullgraph`` (torch 2.13
    ``_dynamo/output_graph.py``: ``allow_dynamic_output_shape_ops=one_graph or
    config.capture_dynamic_output_shape_ops``). This op is mostly inserted by the backend into a graph
    Dynamo already captured, whose AOTAutograd trace shares that environment; there the size is created
    from the FakeTensor's shape environment directly (as torch's own ``device_mesh`` op does), bounded
    with ``torch._check``. Dynamo tracing a user's call without ``fullgraph`` gets the same size, so it
    keeps the op in the graph too.
    """
    bound = tokens if isinstance(tokens, int) else None
    try:
        return torch.library.get_ctx().new_dynamic_size(min=1, max=bound)
    except torch._subclasses.fake_tensor.DynamicOutputShapeException:
        shape_env = getattr(getattr(position_ids, "fake_mode", None), "shape_env", None)
        if shape_env is None:
            raise
    count = shape_env.create_unbacked_symint()
    torch._check(count >= 1)
    torch._check(count <= tokens)
    return count


def host_seq_ends(position_ids: torch.Tensor, rule: str = "restart") -> torch.Tensor:
    """:func:`seq_ends_from_positions` eagerly (outside any graph): one device-to-host copy of the row.

    For a forward pre-hook that computes the offsets once per micro-batch (as MindSpeed's
    ``compute_actual_seq_len`` and vllm-ascend's ``attention_v1.py`` do) and passes them to every layer's attention.

    Args:
        position_ids: ``[1, T]`` or ``[T]`` integer, any device.
        rule: ``"restart"`` (default) or ``"zero"``.

    Returns:
        int64 CPU ``[B]`` cumulative end offsets.

    Raises:
        RuntimeError: as :func:`seq_ends_from_positions`.
    """
    with torch.no_grad():
        return seq_ends_from_positions(position_ids.detach(), rule)


#: The op overloads graphs hold.
OP = define_op(QWEN_NPU_LIBRARY, SCHEMA, varlen_attention, _fake, _backward, _setup_context)
BACKWARD_OP = define_op(QWEN_NPU_LIBRARY, BACKWARD_SCHEMA, varlen_attention_backward, _fake_backward)
SEQ_ENDS_OP = define_op(QWEN_NPU_LIBRARY, SEQ_ENDS_SCHEMA, seq_ends_from_positions, _fake_seq_ends)

__all__ = [
    "BACKWARD_OP", "MAX_SEGMENTS", "MAX_TOKENS", "OP", "RULES", "SEQ_ENDS_OP", "SPARSE_MODES", "host_seq_ends",
    "offsets_violation", "seq_ends_from_positions", "tnd_violation", "varlen_attention", "varlen_attention_backward",
    "varlen_violation",
]
