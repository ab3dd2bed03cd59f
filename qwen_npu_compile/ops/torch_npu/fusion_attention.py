"""Stand-in for ``npu_fusion_attention`` / ``npu_fusion_attention_grad`` (torch_npu 2.13.0).

Semantics (torch_npu 2.13.0 ``_op_plugin_docs.py`` and Meta kernels; the op-plugin doc page
``torch_npu-npu_fusion_attention.md``; summarised in ``docs/npu-op-contracts.md``)::

    out = Dropout(Softmax(Mask(scale * (pse + Q @ K^T), atten_mask)), keep_prob) @ V

computed here in fp32 and rounded once to q's dtype. Without dropout the dense layouts are computed blockwise
(:mod:`.attention_blockwise`: torch's CPU flash attention for no mask and the left-up causal mask, else online
softmax over key blocks; never an ``[Sq, Skv]`` fp32 tensor; softmax_max / softmax_sum are the row max and the
sum of ``exp(score - max)``); with dropout (``keep_prob < 1``, whose keep mask is
``[B, Nq, Sq, Skv]`` anyway) by the dense formula of :mod:`.attention_contract`.

Layering: the schemas, the limits (:func:`fusion_attention_violation`), the compressed causal mask and the
softmax math are :mod:`.attention_contract`'s (re-exported here); this module adds the dense layouts and
hands TND calls to :mod:`.fusion_attention_tnd`, which imports the contract only.

- ``head_num`` is the number of **query** heads. GQA is native: Nq % Nkv == 0, query head ``h`` reads
  key/value head ``h // (Nq // Nkv)`` (what HF ``repeat_kv`` builds).
- Layouts: BNSD, BSND, BSH and SBH (``H = N * D``; head_num splits it), and TND (varlen: ``[T, N, D]``
  with ``actual_seq_qlen``/``actual_seq_kvlen`` cumulative ends, computed sequence by sequence, never
  ``T x T``; no dropout, softmax_max/sum ``[T, Nq, 8]``): :mod:`.fusion_attention_tnd`, whose limits are
  :func:`~.attention_contract.tnd_violation`. The rest of this docstring is about the other four layouts.
  q, k, v share one dtype (fp16/bf16/fp32); Dq == Dk ≤ :data:`~qwen_npu_compile.ops.attention_contract.MAX_HEAD_DIM`, Dv ≤ Dk; Nq ≤
  :data:`~qwen_npu_compile.ops.attention_contract.MAX_QUERY_HEADS`.
- ``atten_mask`` is bool/uint8 with **True (non-zero) = masked out**, the opposite of PyTorch SDPA.
  When it is None nothing is masked and ``sparse_mode``/``pre_tockens``/``next_tockens`` have no effect
  (as documented). ``sparse_mode`` 0: the mask (BNSS/B1SS/11SS/SS) is used as given, and keys outside
  the band ``i - pre_tockens <= j <= i + next_tockens`` (left-up origin) are masked too. 2 / 3: the mask
  must be the compressed :func:`~qwen_npu_compile.ops.attention_contract.compressed_causal_mask` (2048 x 2048 ``triu(ones, 1)``) and the kernel
  builds the real causal mask: left-up masks ``j > i``, right-down masks ``j > i + (Skv - Sq)``.
  Other modes raise.
- Fully masked rows give 0 output, ``softmax_max = -inf`` and ``softmax_sum = 0``, and no gradient,
  whatever ``inner_precise`` (0..3 accepted). On the real chip only ``inner_precise=2`` (or mode 3 with
  Sq > Skv, where the kernel turns it on itself) computes such rows correctly; a rewrite that may
  produce them must still pass 2: the stand-in cannot tell the two apart numerically.
- Dropout (``keep_prob < 1``): the stand-in draws its keep mask from a private CPU generator seeded
  from the ``seed``/``offset`` *inputs* (:func:`dropout_keep_mask`) and returns those same values as
  the ``seed``/``offset`` outputs, so the grad op regenerates the identical mask. It never draws from a
  global RNG (the real kernel takes a fresh Philox seed each call): with the default seed=offset=0 every
  call drops the same positions. Deterministic, and safe to trace (the fake kernel returns the same ints).
- Outputs: ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``.
  attention_out has q's dtype and the input layout (Dv in place of D); softmax_max / softmax_sum are fp32
  ``[B, Nq, Sq, 8]``, the row value repeated over the last dim of 8 (torch_npu's Meta kernel shape);
  softmax_out is reserved: an empty ``[0]`` tensor of q's dtype; numels is ``B*Nq*Sq*Skv`` when
  ``keep_prob < 1`` else 0.
- The grad op recomputes the probabilities from q, k, v, tile by tile (it ignores softmax_max / softmax_sum /
  softmax_in / attention_in) and returns ``(dq, dk, dv, dpse, dsink)``: dq/dk/dv in the input layouts
  and shapes (dk/dv summed over each KV group) in q's dtype; ``dpse`` is an empty ``[0]`` tensor and
  ``dsink`` an empty ``[0]`` fp32 tensor, as torch_npu 2.13.0's Meta kernel gives without a ``sink`` (2.9.0's
  gives a 0-dim one). Gradients w.r.t. ``pse`` are therefore
  not produced: autograd raises if pse requires grad.
- Not simulated (RuntimeError): ``padding_mask`` (unsupported by the real op too), ``prefix``,
  ``actual_seq_qlen``/``actual_seq_kvlen`` (TND only), ``sink``, ``dropout_mask``, a non-empty
  ``softmax_layout``. ``gen_mask_parallel`` and ``sync`` only tune the real dropout-mask generator and are
  ignored.
"""

from __future__ import annotations

import torch

from qwen_npu_compile.ops.attention_contract import (
    COMPRESSED_MASK_MODES,
    FUSION_ATTENTION_GRAD_SCHEMA,
    FUSION_ATTENTION_SCHEMA,
    GE_CONVERTER,
    NO_BAND,
    SOFTMAX_STAT_WIDTH,
    SUPPORTED_INNER_PRECISE,
    SUPPORTED_SPARSE_MODES,
    _mask_shape_violation,
    _probabilities,
    compressed_mask_shift,
    fusion_attention_violation,
    probability_grads,
    weighted_values,
)
from qwen_npu_compile.ops.define import define_op
from qwen_npu_compile.ops.torch_npu import attention_blockwise as blockwise
from qwen_npu_compile.ops.torch_npu import fusion_attention_tnd as tnd

#: Layouts simulated here by the dense path; TND (varlen) goes to :mod:`.fusion_attention_tnd`.
SUPPORTED_LAYOUTS = ("BNSD", "BSND", "BSH", "SBH")

_SOFTMAX_STAT_DTYPE = torch.float32


def call_violation(
    query,
    key,
    value,
    head_num: int,
    input_layout: str,
    *,
    atten_mask=None,
    sparse_mode: int = 0,
    keep_prob: float = 1.0,
    softmax_layout: str = "",
    sink=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    downstream: str | None = None,
) -> str | None:
    """:func:`fusion_attention_violation` for the arguments of one ``npu_fusion_attention(_grad)`` call
    (the tensors in ``input_layout``), e.g. a node of a graph handed to torchair. With
    ``downstream="torchair"`` also: the converters of torch_npu 2.13.0/2.9.0 take neither ``sink`` nor a
    non-empty ``softmax_layout`` (their signatures lack them). TND calls (with their ``actual_seq_qlen`` /
    ``actual_seq_kvlen``) are checked by :func:`.fusion_attention_tnd.call_violation`.

    Returns:
        None when supported, else a one-line reason (a layout the stand-in cannot parse included).
    """
    if input_layout == "TND":
        return tnd.call_violation(query, key, value, head_num, atten_mask=atten_mask, sparse_mode=sparse_mode,
                                     keep_prob=keep_prob, softmax_layout=softmax_layout, sink=sink,
                                     actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
                                     downstream=downstream)
    try:
        b, nq, nkv, sq, skv, d, dv = _dims(query, key, value, head_num, input_layout, "npu_fusion_attention")
    except RuntimeError as exc:
        return str(exc)
    if downstream == "torchair" and (sink is not None or softmax_layout):
        return f"the {GE_CONVERTER} takes neither sink nor softmax_layout"
    return fusion_attention_violation(
        (b, nq, sq, d), (b, nkv, skv, d), (b, nkv, skv, dv), (query.dtype, key.dtype, value.dtype),
        input_layout=input_layout, head_num=head_num,
        mask_shape=tuple(atten_mask.shape) if atten_mask is not None else None,
        sparse_mode=sparse_mode, keep_prob=keep_prob, downstream=downstream,
    )



def _dims(query, key, value, head_num: int, input_layout: str, op: str):
    """Returns (B, Nq, Nkv, Sq, Skv, D, Dv) after checking layouts, ranks, dtypes and head counts."""
    if input_layout not in SUPPORTED_LAYOUTS:
        raise RuntimeError(f"{op}: unknown input_layout {input_layout!r} (expected one of {SUPPORTED_LAYOUTS})")
    rank = 4 if input_layout in ("BNSD", "BSND") else 3
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != rank:
            raise RuntimeError(f"{op}: {name} must be {rank}-D for layout {input_layout}, got {tuple(t.shape)}")
    if head_num < 1:
        raise RuntimeError(f"{op}: head_num must be positive, got {head_num}")
    if input_layout in ("BNSD", "BSND"):
        n_dim, s_dim = (1, 2) if input_layout == "BNSD" else (2, 1)
        b, nq, sq, d = query.shape[0], query.shape[n_dim], query.shape[s_dim], query.shape[3]
        bk, nkv, skv, dk = key.shape[0], key.shape[n_dim], key.shape[s_dim], key.shape[3]
        bv, nv, sv, dv = value.shape[0], value.shape[n_dim], value.shape[s_dim], value.shape[3]
        if nq != head_num:
            raise RuntimeError(f"{op}: head_num={head_num} != query's head count {nq} ({input_layout})")
    else:
        b_dim, s_dim = (0, 1) if input_layout == "BSH" else (1, 0)
        b, sq, hq = query.shape[b_dim], query.shape[s_dim], query.shape[2]
        bk, skv, hk = key.shape[b_dim], key.shape[s_dim], key.shape[2]
        bv, sv, hv = value.shape[b_dim], value.shape[s_dim], value.shape[2]
        if hq % head_num != 0:
            raise RuntimeError(f"{op}: query hidden size {hq} is not a multiple of head_num={head_num}")
        nq, d = head_num, hq // head_num
        if hk % d != 0:
            raise RuntimeError(f"{op}: key hidden size {hk} is not a multiple of the head dim {d}")
        nkv, dk = hk // d, d
        if hv % nkv != 0:
            raise RuntimeError(f"{op}: value hidden size {hv} is not a multiple of the KV head count {nkv}")
        nv, dv = nkv, hv // nkv
    reason = fusion_attention_violation(
        (b, nq, sq, d), (bk, nkv, skv, dk), (bv, nv, sv, dv), (query.dtype, key.dtype, value.dtype),
        input_layout=input_layout,
    )
    if reason is not None:
        raise RuntimeError(f"{op}: {reason}")
    return b, nq, nkv, sq, skv, d, dv


def _check_options(
    op,
    dims,
    *,
    pse=None,
    padding_mask=None,
    atten_mask=None,
    keep_prob=1.0,
    inner_precise=0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode=0,
    softmax_layout="",
    sink=None,
    dropout_mask=None,
    query_dtype=None,
    **_not_checked,
):
    b, nq, _, sq, skv, _, _ = dims
    if padding_mask is not None:
        raise RuntimeError(f"{op}: padding_mask is not supported (torch_npu 2.13.0 docs)")
    for name, value in (
        ("prefix", prefix),
        ("actual_seq_qlen", actual_seq_qlen),
        ("actual_seq_kvlen", actual_seq_kvlen),
        ("sink", sink),
        ("dropout_mask", dropout_mask),
    ):
        if value is not None:
            raise RuntimeError(f"{op}: argument {name!r} is not simulated by the CPU stand-in (pass None)")
    if softmax_layout != "":
        raise RuntimeError(f"{op}: softmax_layout={softmax_layout!r} applies to TND only (pass '')")
    if sparse_mode not in SUPPORTED_SPARSE_MODES:
        raise RuntimeError(
            f"{op}: sparse_mode={sparse_mode} is not simulated (supported: {SUPPORTED_SPARSE_MODES})"
        )
    if inner_precise not in SUPPORTED_INNER_PRECISE:
        raise RuntimeError(f"{op}: inner_precise={inner_precise} not in {SUPPORTED_INNER_PRECISE}")
    if not (0.0 < keep_prob <= 1.0):
        raise RuntimeError(f"{op}: keep_prob={keep_prob} must lie in (0, 1]")
    if pse is not None:
        if pse.dtype != query_dtype:
            raise RuntimeError(f"{op}: pse dtype {pse.dtype} != query dtype {query_dtype}")
        full = (b, nq, sq, skv)
        if pse.dim() != 4 or any(p != f and p != 1 for p, f in zip(pse.shape, full)):
            raise RuntimeError(f"{op}: pse shape {tuple(pse.shape)} does not broadcast to [B, N, Sq, Skv] {full}")
    if atten_mask is not None:
        if atten_mask.dtype not in (torch.bool, torch.uint8):
            raise RuntimeError(f"{op}: atten_mask must be bool or uint8 (True = masked out), got {atten_mask.dtype}")
        reason = _mask_shape_violation(tuple(atten_mask.shape), sparse_mode, b, nq, sq, skv)
        if reason is not None:
            raise RuntimeError(f"{op}: {reason}")


#: The arguments of both ops that are not options (:func:`_options` leaves them out).
_OPERANDS = frozenset({"query", "key", "value", "dy", "head_num", "input_layout"})


def _options(arguments: dict) -> dict:
    """The options of one call (an op's ``locals()`` on entry): every argument but the tensors and layout."""
    return {name: value for name, value in arguments.items() if name not in _OPERANDS}


def _checked_dims(op: str, query, key, value, head_num: int, input_layout: str, options: dict):
    """:func:`_dims`, then :func:`_check_options` on the call's ``options``: the dense layouts' validation."""
    dims = _dims(query, key, value, head_num, input_layout, op)
    _check_options(op, dims, query_dtype=query.dtype, **options)
    return dims


def _checked_dy(op: str, query, dy, input_layout: str, dims) -> None:
    out_shape = _out_shape(query, input_layout, dims[1], dims[6])
    if list(dy.shape) != out_shape:
        raise RuntimeError(f"{op}: dy shape {tuple(dy.shape)} != attention_out shape {tuple(out_shape)}")


def _to_bnsd(t: torch.Tensor, layout: str, n: int) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.reshape(b, s, n, h // n).transpose(1, 2)
    s, b, h = t.shape  # SBH
    return t.reshape(s, b, n, h // n).permute(1, 2, 0, 3)


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    b, n, s, d = t.shape
    if layout == "BNSD":
        out = t
    elif layout == "BSND":
        out = t.transpose(1, 2)
    elif layout == "BSH":
        out = t.transpose(1, 2).reshape(b, s, n * d)
    else:  # SBH
        out = t.permute(2, 0, 1, 3).reshape(s, b, n * d)
    return out.contiguous()


def _out_shape(query: torch.Tensor, layout: str, nq: int, dv: int) -> list:
    shape = list(query.shape)
    shape[-1] = dv if layout in ("BNSD", "BSND") else nq * dv
    return shape


def _masked_positions(atten_mask, sparse_mode, pre_tockens, next_tockens, sq, skv, device):
    """Bool tensor broadcastable to [B, N, Sq, Skv], True = masked out; None when nothing is masked."""
    if atten_mask is None:
        return None  # documented: without a mask, sparse_mode / pre / next have no effect
    i = torch.arange(sq, device=device).unsqueeze(-1)
    j = torch.arange(skv, device=device)
    if sparse_mode in COMPRESSED_MASK_MODES:
        shift = compressed_mask_shift(atten_mask, sparse_mode, sq, skv)
        return j > i + shift
    masked = atten_mask.bool()
    if pre_tockens < NO_BAND or next_tockens < NO_BAND:
        masked = masked | (j - i > next_tockens) | (i - j > pre_tockens)
    return masked


def _mix_seed(seed: int, offset: int) -> int:
    return (int(seed) * 6364136223846793005 + int(offset) * 1442695040888963407 + 1) % (1 << 63)


def dropout_keep_mask(shape, keep_prob: float, seed: int, offset: int, device=None) -> torch.Tensor:
    """The stand-in's dropout keep mask: a pure function of (shape, keep_prob, seed, offset).

    Drawn on the CPU from a private ``torch.Generator`` seeded from ``seed`` and ``offset``, so the forward
    and the grad op (which receive the same seed/offset) regenerate the identical mask. It is not the
    real kernel's Philox stream.

    Args:
        shape: ``[B, Nq, Sq, Skv]``.
        keep_prob: probability that a position is kept, in (0, 1].
        seed: the op's ``seed``.
        offset: the op's ``offset``.
        device: where to put the mask.

    Returns:
        A bool tensor of ``shape``, True = kept.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_mix_seed(seed, offset))
    return (torch.rand(list(shape), generator=gen) < keep_prob).to(device)


def _numels(dims, keep_prob):
    b, nq, _, sq, skv, _, _ = dims
    return b * nq * sq * skv if keep_prob < 1.0 else 0


def reference_fusion_attention(  # the arguments of FUSION_ATTENTION_SCHEMA, in order (data, as the grad's)
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int, input_layout: str,
    pse: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None, scale: float = 1.0, keep_prob: float = 1.0,
    pre_tockens: int = NO_BAND, next_tockens: int = NO_BAND, inner_precise: int = 0,
    prefix: list[int] | None = None, actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None, sparse_mode: int = 0, gen_mask_parallel: bool = True,
    sync: bool = False, softmax_layout: str = "", sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None, seed: int = 0, offset: int = 0,
):  # fmt: skip
    """CPU reference of ``npu_fusion_attention``.

    Args:
        query: ``[B, Nq, Sq, D]`` (BNSD), ``[B, Sq, Nq, D]`` (BSND), ``[B, Sq, Nq*D]`` (BSH),
            ``[Sq, B, Nq*D]`` (SBH) or ``[T, Nq, D]`` (TND: :mod:`.fusion_attention_tnd`); fp16/bf16/fp32.
        key: the same layout with Nkv heads and Skv positions; query's dtype and head dim.
        value: key's layout, N and S; head dim Dv <= D.
        head_num: Nq, the number of query heads (Nq % Nkv == 0).
        input_layout: ``"BNSD"``, ``"BSND"``, ``"BSH"``, ``"SBH"`` or ``"TND"``.
        pse: optional additive bias (before scaling), broadcastable 4-D ``[B, Nq, Sq, Skv]``, q's dtype.
        padding_mask: must be None.
        atten_mask: bool/uint8, True = masked out. Mode 0: BNSS/B1SS/11SS/SS. Modes 2/3: the compressed
            2048x2048 causal mask. None: nothing masked (sparse_mode/pre/next then have no effect).
        scale: multiplies ``pse + Q @ K^T``; pass ``1/sqrt(D)`` explicitly.
        keep_prob: dropout keep probability in (0, 1].
        pre_tockens: mode 0 band: keys ``j < i - pre_tockens`` are masked too.
        next_tockens: mode 0 band: keys ``j > i + next_tockens`` are masked too.
        inner_precise: 0..3; fully masked rows give 0 output whatever the value.
        prefix: must be None.
        actual_seq_qlen: TND only (else None): cumulative end offsets of the query sequences (int list/tuple).
        actual_seq_kvlen: TND only (else None): those of the key/value sequences.
        sparse_mode: 0, 2 (left-up causal) or 3 (right-down causal).
        gen_mask_parallel: ignored.
        sync: ignored.
        softmax_layout: must be ``""``.
        sink: must be None.
        dropout_mask: must be None.
        seed: seeds the dropout keep mask (with offset); returned unchanged.
        offset: see seed; returned unchanged.

    Returns:
        ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``: attention_out in
        q's dtype and layout (Dv in place of D), contiguous; softmax_max/softmax_sum fp32
        ``[B, Nq, Sq, 8]`` (-inf / 0 on fully masked rows); softmax_out an empty ``[0]`` tensor of q's
        dtype; seed and offset as given; numels ``B*Nq*Sq*Skv`` if keep_prob < 1 else 0.

    Raises:
        RuntimeError: an unknown layout, a TND call outside the limits of the TND path, mismatched shapes/dtypes, Nq not a multiple of Nkv, a mask
            of the wrong dtype/shape (or not the compressed causal mask for modes 2/3), an unsupported
            sparse_mode/inner_precise/keep_prob, or any argument the stand-in does not simulate.
    """
    options = _options(locals())
    if input_layout == "TND":
        return tnd.forward(query, key, value, head_num, **options)
    dims = _checked_dims("npu_fusion_attention", query, key, value, head_num, input_layout, options)
    b, nq, nkv, sq, skv, _, _ = dims
    group = nq // nkv
    q = _to_bnsd(query, input_layout, nq).float()
    k = _to_bnsd(key, input_layout, nkv).float()
    v = _to_bnsd(value, input_layout, nkv).float()
    if keep_prob < 1.0:  # dropout: the keep mask is [B, Nq, Sq, Skv] anyway; the dense formula
        masked = _masked_positions(atten_mask, sparse_mode, pre_tockens, next_tockens, sq, skv, query.device)
        p, row_max, row_sum = _probabilities(q, k, pse, masked, scale, group)
        keep = dropout_keep_mask((b, nq, sq, skv), keep_prob, seed, offset, query.device)
        out = weighted_values(p * keep / keep_prob, v, group)
    else:
        masking = blockwise.Masking(atten_mask, sparse_mode, pre_tockens, next_tockens, sq, skv, nkv, group)
        out, row_max, row_sum = blockwise.forward(q, k, v, pse, masking, scale, group)
    out = _from_bnsd(out.to(query.dtype), input_layout)
    stat_shape = (b, nq, sq, SOFTMAX_STAT_WIDTH)
    softmax_max = row_max.expand(stat_shape).contiguous()
    softmax_sum = row_sum.expand(stat_shape).contiguous()
    softmax_out = query.new_empty([0])
    return out, softmax_max, softmax_sum, softmax_out, seed, offset, _numels(dims, keep_prob)


def reference_fusion_attention_grad(  # the arguments of FUSION_ATTENTION_GRAD_SCHEMA, in order (data)
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dy: torch.Tensor, head_num: int,
    input_layout: str, *, pse: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None, softmax_max: torch.Tensor | None = None,
    softmax_sum: torch.Tensor | None = None, softmax_in: torch.Tensor | None = None,
    attention_in: torch.Tensor | None = None, scale_value: float = 1.0, keep_prob: float = 1.0,
    pre_tockens: int = NO_BAND, next_tockens: int = NO_BAND, inner_precise: int = 0, seed: int = 0,
    offset: int = 0, numels: int = 0, prefix: list[int] | None = None,
    actual_seq_qlen: list[int] | None = None, actual_seq_kvlen: list[int] | None = None, sparse_mode: int = 0,
    gen_mask_parallel: bool = True, sync: bool = False, softmax_layout: str = "",
    sink: torch.Tensor | None = None,
):  # fmt: skip
    """CPU reference of ``npu_fusion_attention_grad``.

    Recomputes the softmax probabilities (and the dropout keep mask, from ``seed``/``offset``) from
    query/key/value; ``softmax_max``, ``softmax_sum``, ``softmax_in``, ``attention_in`` and ``numels`` are
    accepted and ignored. Every other argument means what it means for the forward (``scale_value`` is
    the forward's ``scale``) and is checked the same way.

    Args:
        query: as in the forward.
        key: as in the forward.
        value: as in the forward.
        dy: gradient of attention_out: the forward output's layout and shape.
        head_num: Nq.
        input_layout: as in the forward.

    Returns:
        ``(dq, dk, dv, dpse, dsink)``: dq/dk/dv shaped like query/key/value (dk/dv summed over each group of
        Nq/Nkv query heads), in q's dtype, computed in fp32; dpse an empty ``[0]`` tensor of q's dtype;
        dsink an empty ``[0]`` fp32 tensor (torch_npu 2.13.0's Meta kernel without ``sink``).

    Raises:
        RuntimeError: whatever the forward would raise for these arguments, or a dy of the wrong shape.
    """
    options = _options(locals())
    if input_layout == "TND":
        return tnd.grad(query, key, value, dy, head_num, **options)
    op = "npu_fusion_attention_grad"
    dims = _checked_dims(op, query, key, value, head_num, input_layout, options)
    b, nq, nkv, sq, skv, _, _ = dims
    _checked_dy(op, query, dy, input_layout, dims)
    group = nq // nkv
    q = _to_bnsd(query, input_layout, nq).float()
    k = _to_bnsd(key, input_layout, nkv).float()
    v = _to_bnsd(value, input_layout, nkv).float()
    do = _to_bnsd(dy, input_layout, nq).float()
    if keep_prob < 1.0:  # dropout: the dense formula (see the forward)
        masked = _masked_positions(atten_mask, sparse_mode, pre_tockens, next_tockens, sq, skv, query.device)
        p, _, _ = _probabilities(q, k, pse, masked, scale_value, group)
        keep = dropout_keep_mask((b, nq, sq, skv), keep_prob, seed, offset, query.device) / keep_prob
        dq, dk_full, dv_full = probability_grads(q, k, v, do, p, scale_value, group, keep)
    else:
        masking = blockwise.Masking(atten_mask, sparse_mode, pre_tockens, next_tockens, sq, skv, nkv, group)
        dq, dk_full, dv_full = blockwise.backward(q, k, v, do, pse, masking, scale_value, group)
    dtype = query.dtype
    return (
        _from_bnsd(dq.to(dtype), input_layout),
        _from_bnsd(dk_full.to(dtype), input_layout),
        _from_bnsd(dv_full.to(dtype), input_layout),
        query.new_empty([0]),
        query.new_zeros([0], dtype=torch.float32),
    )


def _fake_fusion_attention(
    query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None, scale=1.0,
    keep_prob=1.0, pre_tockens=NO_BAND, next_tockens=NO_BAND, inner_precise=0, prefix=None,
    actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
    softmax_layout="", sink=None, dropout_mask=None, seed=0, offset=0,
):  # fmt: skip
    options = _options(locals())
    if input_layout == "TND":
        return tnd.fake_forward(query, key, value, head_num, **options)
    dims = _checked_dims("npu_fusion_attention", query, key, value, head_num, input_layout, options)
    b, nq, _, sq, _, _, dv = dims
    stat_shape = [b, nq, sq, SOFTMAX_STAT_WIDTH]
    return (
        query.new_empty(_out_shape(query, input_layout, nq, dv)),
        query.new_empty(stat_shape, dtype=_SOFTMAX_STAT_DTYPE),
        query.new_empty(stat_shape, dtype=_SOFTMAX_STAT_DTYPE),
        query.new_empty([0]),
        seed,
        offset,
        _numels(dims, keep_prob),
    )


def _fake_fusion_attention_grad(query, key, value, dy, head_num, input_layout, **kwargs):
    if input_layout == "TND":
        return tnd.fake_grad(query, key, value, dy, head_num, **kwargs)
    op = "npu_fusion_attention_grad"
    dims = _checked_dims(op, query, key, value, head_num, input_layout, kwargs)
    _checked_dy(op, query, dy, input_layout, dims)
    return (
        query.new_empty(query.shape),
        query.new_empty(key.shape),
        query.new_empty(value.shape),
        query.new_empty([0]),
        query.new_empty([0], dtype=torch.float32),
    )


#: The forward's argument names, in schema order (setup_context receives them positionally).
_FORWARD_ARGS = (
    "query", "key", "value", "head_num", "input_layout", "pse", "padding_mask", "atten_mask", "scale",
    "keep_prob", "pre_tockens", "next_tockens", "inner_precise", "prefix", "actual_seq_qlen",
    "actual_seq_kvlen", "sparse_mode", "gen_mask_parallel", "sync", "softmax_layout", "sink",
    "dropout_mask", "seed", "offset",
)  # fmt: skip
_PSE_INDEX = _FORWARD_ARGS.index("pse")


def _setup_context(ctx, inputs, output):
    args = dict(zip(_FORWARD_ARGS, inputs))
    out, softmax_max, softmax_sum, _, seed, offset, numels = output
    ctx.save_for_backward(
        args["query"], args["key"], args["value"], args["pse"], args["atten_mask"], out, softmax_max, softmax_sum
    )
    for name in (
        "head_num", "input_layout", "scale", "keep_prob", "pre_tockens", "next_tockens", "inner_precise",
        "prefix", "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode", "gen_mask_parallel", "sync",
        "softmax_layout",
    ):  # fmt: skip
        setattr(ctx, name, args[name])
    # The seed/offset the forward *used* (outputs), which the grad op needs to rebuild the dropout mask.
    ctx.seed, ctx.offset, ctx.numels = seed, offset, numels


def _backward(ctx, grad_out, *unused_grads):
    # unused_grads: gradients of softmax_max / softmax_sum / softmax_out (the int outputs get none);
    # torch_npu's autograd ignores them too.
    if ctx.needs_input_grad[_PSE_INDEX]:
        raise RuntimeError("npu_fusion_attention: gradients w.r.t. pse are not produced (dpse is reserved)")
    query, key, value, pse, atten_mask, out, softmax_max, softmax_sum = ctx.saved_tensors
    dq, dk, dv, _, _ = torch.ops.npu.npu_fusion_attention_grad.default(
        query,
        key,
        value,
        grad_out,
        ctx.head_num,
        ctx.input_layout,
        pse=pse,
        atten_mask=atten_mask,
        softmax_max=softmax_max,
        softmax_sum=softmax_sum,
        attention_in=out,
        scale_value=ctx.scale,
        keep_prob=ctx.keep_prob,
        pre_tockens=ctx.pre_tockens,
        next_tockens=ctx.next_tockens,
        inner_precise=ctx.inner_precise,
        seed=ctx.seed,
        offset=ctx.offset,
        numels=ctx.numels,
        prefix=ctx.prefix,
        actual_seq_qlen=ctx.actual_seq_qlen,
        actual_seq_kvlen=ctx.actual_seq_kvlen,
        sparse_mode=ctx.sparse_mode,
        gen_mask_parallel=ctx.gen_mask_parallel,
        sync=ctx.sync,
        softmax_layout=ctx.softmax_layout,
    )
    return (dq, dk, dv) + (None,) * (len(_FORWARD_ARGS) - 3)


def register(lib: torch.library.Library) -> None:
    """Define both ops in ``lib`` (the ``npu`` namespace) with kernels, fakes and autograd."""
    define_op(lib, FUSION_ATTENTION_SCHEMA, reference_fusion_attention, _fake_fusion_attention, _backward, _setup_context)
    define_op(lib, FUSION_ATTENTION_GRAD_SCHEMA, reference_fusion_attention_grad, _fake_fusion_attention_grad)
