"""The GE converters of :mod:`.varlen_attention`'s ops: TND FlashAttentionScore(Grad) and the offsets.

torchair's own converter of ``npu_fusion_attention(_grad)`` (torch_npu 2.13.0 and torchair master,
``ge_converter/custom/npu_fusion_attention.py``) raises ``NotImplementedError`` for every layout but BSH
and BNSD, TND included, although the GE IR it emits does not exclude TND: ``FlashAttentionScore`` and
``FlashAttentionScoreGrad`` (``_ge_concrete_graph/auto_generated_ge_raw_ops.py``) take ``input_layout`` as a
string attribute and ``actual_seq_qlen`` / ``actual_seq_kvlen`` as optional ``DT_INT64`` **tensor** inputs
(CANN's op definition ``flash_attention_score_def.cpp`` marks them ``ValueDepend(OPTIONAL)``: GE reads their
values for tiling; the eager aclnn varlen path launches the same op with the host list converted to an
INT64 tensor). So this project converts its own ops, defined in
:mod:`qwen_npu_compile.ops.qwen_npu.varlen_attention`, with torchair's GE op builders (``ge_apis``) and
registration API (``torchair.register_fx_node_ge_converter``, through
:func:`qwen_npu_compile.torchair.converters.register_converters`); nothing of torchair is copied:

- ``qwen_npu.varlen_attention(q [T,Nq,D], k [T,Nkv,D], v [T,Nkv,Dv], seq_ends int64 [B], head_num, scale,
  sparse_mode=3) -> (out [T,Nq,Dv], softmax_max [T,Nq,8] fp32, softmax_sum [T,Nq,8] fp32)`` ->
  ``FlashAttentionScore(q, k, v, real_shift=None, drop_mask=None, padding_mask=None, atten_mask=M,
  prefix=None, actual_seq_qlen=seq_ends, actual_seq_kvlen=seq_ends, q_start_idx=0, kv_start_idx=0,
  head_num, input_layout="TND", scale_value=scale, keep_prob=1, pre_tockens=next_tockens=2147483647,
  inner_precise=0, sparse_mode)``, outputs reordered from the IR's (softmax_max, softmax_sum,
  softmax_out, attention_out) to the op's (attention_out, softmax_max, softmax_sum). The argument order,
  the start indices 0 and keep_prob 1 mirror torchair's BSH/BNSD converter; pre/next_tockens and
  inner_precise are the defaults of ``npu_fusion_attention`` that the op's kernel calls it with.
- ``qwen_npu.varlen_attention_backward(dy, q, k, v, out, softmax_max, softmax_sum, seq_ends, head_num,
  scale, sparse_mode=3) -> (dq, dk, dv)`` -> ``FlashAttentionScoreGrad`` with the same attributes,
  ``attention_in=out``, ``softmax_in=None``, its 4th output (dpse, no pse here) dropped.
- ``qwen_npu.seq_ends_from_positions(position_ids [1,T], rule) -> int64 [B]`` -> the boundaries of
  ``position_ids[1:]`` (rule ``"restart"``: ``NotEqual(p[1:] - p[:-1], 1)``; rule ``"zero"``:
  ``Equal(p[1:], 0)``) through ``NonZero`` (data-dependent length), ``+ 1``, then ``ConcatV2`` with
  ``Shape(p)`` (= ``[T]``): the cumulative ends, the last one T.

``M``, the compressed causal mask (modes 2/3; none for mode 0), is built once per GE graph and shared by
every layer in it (:func:`_causal_mask`: ``[2048, 2048]`` bool, True above the diagonal, as
:func:`qwen_npu_compile.ops.attention_contract.compressed_causal_mask`).

Limits: the converter calls the op's one home of limits,
``varlen_attention.varlen_violation(..., downstream="torchair")`` (the kernel's limits plus the GE IR's
q/k/v dtypes fp16/bf16), on the FakeTensors torchair attaches to the inputs, and raises
``NotImplementedError`` with its reason, so an unsupported graph (fp32, say) is reported by the
conversion check (:mod:`qwen_npu_compile.torchair.offline.convert`) instead of building a GE graph that
cannot run.

What is verified without an NPU (``tests/torchair/test_torchair_varlen.py``, torchair of the torch_npu 2.13.0
wheel, off-NPU): that forward and backward graphs holding these ops convert with 0 failures, static and
dynamic T, bf16 and fp16; the GE node types, their ``input_layout``/``sparse_mode``/``head_num`` attributes
and the inputs wired to ``actual_seq_qlen``/``actual_seq_kvlen``/``atten_mask``; that a CPU int64 graph
input becomes a host (``placement='CPU'``) ``Data`` (torchair's ``fx2ge_converter.parse_input`` places a
tensor input by its FakeTensor's device; off-NPU every tensor is a CPU tensor, so only the rule, not the
q/k/v placement, is exercised); output counts and dtypes against the ops' meta outputs; and the
sequence-ends and mask subgraphs evaluated with a NumPy model of each GE op (TF slice rules, NonZero
``[N, rank]``) against the ops' kernels (both rules, int64/int32 positions, single-token and single-sequence
rows).

What is **not** verified (needs CANN on an NPU): GE compilation of ``FlashAttentionScore(Grad)`` in TND
(shape inference: CANN documents the softmax statistics as ``[N, T, 8]`` where torch_npu's meta gives
``[T, N, 8]``; both only pass between these two ops), the ValueDepend read of ``actual_seq_*`` from a
host ``Data`` or from the device output of ``NonZero`` with a dynamic length, tiling, the kernels'
numerics, the ``StridedSliceV2`` end index ``-1`` (TF semantics: counts from the end), where torchair places
the ends a forward graph computes (``NonZero`` on the device) and saves for the backward graph (the op's
meta says a CPU tensor, so the backward's ``Data`` is host-placed), and Atlas A3 (CANN's varlen table lists
A2 only).
"""

from __future__ import annotations

import weakref

import torch

from qwen_npu_compile.ops.ge import torchair_api

#: ``pre_tockens`` / ``next_tockens``: npu_fusion_attention's defaults (no band), what the op's kernel uses.
NO_BAND = 2147483647
#: ``inner_precise``: npu_fusion_attention's default, what the op's kernel uses.
INNER_PRECISE = 0
#: End index of "to the end" for StridedSliceV2, as torchair's ``aten.slice`` converter writes it.
SLICE_TO_END = 2147483647
#: Rules of ``seq_ends_from_positions`` and the GE comparison that marks a sequence start in ``p[1:]``.
RULES = ("restart", "zero")

#: GE graph -> its compressed causal mask Const (one per graph, whatever the number of layers).
_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _causal_mask(ge):
    """The compressed causal mask, ``[2048, 2048]`` bool True above the diagonal, built once per GE graph.

    ``Greater(Reshape(r, [1, n]), Reshape(r, [n, 1]))`` with ``r = Range(0, n, 1)``: element ``[i, j]`` is
    ``j > i``, i.e. ``torch.triu(ones(n, n, bool), diagonal=1)``
    (:func:`qwen_npu_compile.ops.attention_contract.compressed_causal_mask`, what the op's kernel passes).
    Built from three Consts rather than held as one: a 4 MiB ``Const`` made the GE graph's pbtxt dump 21 MB
    and its conversion 8 s on this host. All inputs are constant, so GE can fold it at compile time (not
    verified off-NPU; unfolded it is one 4M-element compare per graph run).
    """
    from qwen_npu_compile.ops.attention_contract import COMPRESSED_MASK_SIZE

    graph = ge.get_default_ge_graph()
    mask = _MASKS.get(graph)
    if mask is None:
        n, int32 = COMPRESSED_MASK_SIZE, ge.DataType.DT_INT32
        index = ge.Range(ge.Const(0, dtype=int32), ge.Const(n, dtype=int32), ge.Const(1, dtype=int32))
        mask = ge.Greater(ge.Reshape(index, ge.Const([1, n], dtype=ge.DataType.DT_INT64)),
                          ge.Reshape(index, ge.Const([n, 1], dtype=ge.DataType.DT_INT64)),
                          node_name="qwen_npu_compressed_causal_mask")
        _MASKS[graph] = mask
    return mask


def _attention_mask(ge, sparse_mode: int):
    """The atten_mask input: the compressed causal mask for modes 2/3, none for mode 0 (others refused)."""
    from qwen_npu_compile.ops.attention_contract import COMPRESSED_MASK_MODES

    if sparse_mode in COMPRESSED_MASK_MODES:
        return _causal_mask(ge)
    if sparse_mode == 0:
        return None
    raise NotImplementedError(f"qwen_npu.varlen_attention: sparse_mode {sparse_mode} has no GE conversion (0, 2, 3 only)")


def _int64(ge, tensor):
    """``tensor`` as DT_INT64 (the type of FlashAttentionScore's actual_seq_* inputs)."""
    if tensor.dtype != ge.DataType.DT_INT64:
        return ge.Cast(tensor, dst_type=ge.DataType.DT_INT64)
    return tensor


def _refuse_outside_limits(op: str, query, key, value, seq_ends, head_num: int, sparse_mode: int) -> None:
    """Raise NotImplementedError with ``varlen_violation``'s reason (downstream torchair), if any.

    ``query`` etc. are torchair GE tensors; their ``meta`` is the FakeTensor of the FX node's value
    (torchair's ``set_meta``). Without metas (a caller outside torchair's conversion) nothing is checked.
    """
    from qwen_npu_compile.ops.qwen_npu import varlen_attention

    metas = [getattr(t, "meta", None) for t in (query, key, value, seq_ends)]
    if not all(isinstance(m, torch.Tensor) for m in metas[:3]):
        return
    ends = metas[3] if isinstance(metas[3], torch.Tensor) else None
    reason = varlen_attention.varlen_violation(metas[0], metas[1], metas[2], ends, head_num, sparse_mode=sparse_mode,
                                               downstream="torchair")
    if reason is not None:
        raise NotImplementedError(f"{op} cannot convert to GE FlashAttentionScore (TND): {reason}")


def _tnd_arguments(ge, op: str, query, key, value, seq_ends, head_num: int, scale, sparse_mode: int) -> dict:
    """The keyword arguments FlashAttentionScore and FlashAttentionScoreGrad share for one TND packing (the
    offsets, mask, layout and options), after :func:`_refuse_outside_limits`."""
    _refuse_outside_limits(op, query, key, value, seq_ends, head_num, sparse_mode)
    ends = _int64(ge, seq_ends)
    return dict(
        drop_mask=None, padding_mask=None, atten_mask=_attention_mask(ge, sparse_mode), prefix=None,
        actual_seq_qlen=ends, actual_seq_kvlen=ends, q_start_idx=0, kv_start_idx=0, head_num=head_num,
        input_layout="TND", scale_value=scale, keep_prob=1.0, pre_tockens=NO_BAND, next_tockens=NO_BAND,
        inner_precise=INNER_PRECISE, sparse_mode=sparse_mode,
    )


def _register_varlen_attention() -> None:
    from qwen_npu_compile.ops.qwen_npu import varlen_attention

    register, ge = torchair_api()

    def convert(query, key, value, seq_ends, head_num, scale, sparse_mode=3, meta_outputs=None):
        """qwen_npu.varlen_attention -> FlashAttentionScore(input_layout="TND"); see the module docstring."""
        arguments = _tnd_arguments(ge, "qwen_npu.varlen_attention", query, key, value, seq_ends, head_num, scale,
                                   sparse_mode)
        softmax_max, softmax_sum, _softmax_out, attention_out = ge.FlashAttentionScore(
            query, key, value, real_shift=None, **arguments
        )
        return attention_out, softmax_max, softmax_sum

    register(varlen_attention.OP)(convert)


def _register_varlen_attention_backward() -> None:
    from qwen_npu_compile.ops.qwen_npu import varlen_attention

    register, ge = torchair_api()

    def convert(dy, query, key, value, out, softmax_max, softmax_sum, seq_ends, head_num, scale, sparse_mode=3,
                meta_outputs=None):
        """qwen_npu.varlen_attention_backward -> FlashAttentionScoreGrad(input_layout="TND") (dq, dk, dv)."""
        arguments = _tnd_arguments(ge, "qwen_npu.varlen_attention_backward", query, key, value, seq_ends, head_num,
                                   scale, sparse_mode)
        dq, dk, dv, _dpse = ge.FlashAttentionScoreGrad(
            query, key, value, dy, pse_shift=None, softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=None,
            attention_in=out, **arguments
        )
        return dq, dk, dv

    register(varlen_attention.BACKWARD_OP)(convert)


def _register_seq_ends_from_positions() -> None:
    from qwen_npu_compile.ops.qwen_npu import varlen_attention

    register, ge = torchair_api()
    int64 = ge.DataType.DT_INT64

    def convert(position_ids, rule, meta_outputs=None):
        """qwen_npu.seq_ends_from_positions -> NonZero of the starts in ``p[1:]``, + 1, ConcatV2 with [T].

        ``p = Reshape(position_ids, [-1])`` (int64 ``[T]``). A sequence starts at ``i >= 1`` where
        ``p[i] - p[i-1] != 1`` (``"restart"``) or ``p[i] == 0`` (``"zero"``); position 0 always starts
        one, so the ends are those ``i`` (the previous sequence's exclusive end) followed by T.
        ``NonZero`` of a 1-D input is ``[K, 1]`` (or ``[1, K]`` transposed): reshaped to ``[K]`` either way.
        """
        if rule not in RULES:
            raise NotImplementedError(f"qwen_npu.seq_ends_from_positions: rule {rule!r} is none of {RULES}")
        p = ge.Reshape(_int64(ge, position_ids), ge.Const([-1], dtype=int64))
        tail = ge.StridedSliceV2(p, ge.Const([1], dtype=int64), ge.Const([SLICE_TO_END], dtype=int64),
                                 ge.Const([0], dtype=int64), ge.Const([1], dtype=int64))
        if rule == "restart":
            head = ge.StridedSliceV2(p, ge.Const([0], dtype=int64), ge.Const([-1], dtype=int64),
                                     ge.Const([0], dtype=int64), ge.Const([1], dtype=int64))
            starts = ge.NotEqual(ge.Sub(tail, head), ge.Const(1, dtype=int64))
        else:
            starts = ge.Equal(tail, ge.Const(0, dtype=int64))
        index = ge.Reshape(ge.NonZero(starts, transpose=False, dtype=int64), ge.Const([-1], dtype=int64))
        inner_ends = ge.Add(index, ge.Const(1, dtype=int64))
        return ge.ConcatV2([inner_ends, ge.Shape(p, dtype=int64)], ge.Const(0, dtype=ge.DataType.DT_INT32), N=2)

    register(varlen_attention.SEQ_ENDS_OP)(convert)


#: ``"namespace.op"`` -> its registration (registered by
#: :func:`qwen_npu_compile.torchair.converters.register_converters`).
GE_CONVERTERS = {
    "qwen_npu.varlen_attention": _register_varlen_attention,
    "qwen_npu.varlen_attention_backward": _register_varlen_attention_backward,
    "qwen_npu.seq_ends_from_positions": _register_seq_ends_from_positions,
}
