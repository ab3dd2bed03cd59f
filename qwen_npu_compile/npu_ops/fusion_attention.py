"""Stand-in for ``npu_fusion_attention`` / ``npu_fusion_attention_grad`` (torch_npu 2.13.0).

Semantics (torch_npu 2.13.0 ``_op_plugin_docs.py`` and Meta kernels; the op-plugin doc page
``torch_npu-npu_fusion_attention.md``; ``shared/reference/npu-op-contracts.md``)::

    out = Dropout(Softmax(Mask(scale * (pse + Q @ K^T), atten_mask)), keep_prob) @ V

computed here in fp32 and rounded once to q's dtype.

- ``head_num`` is the number of **query** heads. GQA is native: Nq % Nkv == 0, query head ``h`` reads
  key/value head ``h // (Nq // Nkv)`` (what HF ``repeat_kv`` builds).
- Layouts: BNSD, BSND, BSH and SBH (``H = N * D``; head_num splits it), and TND (varlen: ``[T, N, D]``
  with ``actual_seq_qlen``/``actual_seq_kvlen`` cumulative ends, computed sequence by sequence, never
  ``T x T``; no dropout, softmax_max/sum ``[T, Nq, 8]``): :mod:`.fusion_attention_tnd`, whose limits are
  :func:`~.varlen_attention.tnd_violation`. The rest of this docstring is about the other four layouts.
  q, k, v share one dtype (fp16/bf16/fp32); Dq == Dk ≤ :data:`MAX_HEAD_DIM`, Dv ≤ Dk; Nq ≤
  :data:`MAX_QUERY_HEADS`.
- ``atten_mask`` is bool/uint8 with **True (non-zero) = masked out**, the opposite of PyTorch SDPA.
  When it is None nothing is masked and ``sparse_mode``/``pre_tockens``/``next_tockens`` have no effect
  (as documented). ``sparse_mode`` 0: the mask (BNSS/B1SS/11SS/SS) is used as given, and keys outside
  the band ``i - pre_tockens <= j <= i + next_tockens`` (left-up origin) are masked too. 2 / 3: the mask
  must be the compressed :func:`compressed_causal_mask` (2048 x 2048 ``triu(ones, 1)``) and the kernel
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
- The grad op recomputes the probabilities from q, k, v (it ignores softmax_max / softmax_sum /
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

import functools

import torch
from ..compat import guard_or_false
from .define import define_op

FUSION_ATTENTION_SCHEMA = (
    "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
    "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
    "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
    "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
    'bool gen_mask_parallel=True, bool sync=False, str softmax_layout="", Tensor? sink=None, '
    "Tensor? dropout_mask=None, int seed=0, int offset=0) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)"
)
FUSION_ATTENTION_GRAD_SCHEMA = (
    "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
    "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
    "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, Tensor? attention_in=None, "
    "float scale_value=1., float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, "
    "int inner_precise=0, int seed=0, int offset=0, int numels=0, int[]? prefix=None, "
    "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
    'bool gen_mask_parallel=True, bool sync=False, str softmax_layout="", Tensor? sink=None) '
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)

#: q/k/v dtypes the kernel takes (all three equal).
SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
#: Layouts simulated here by the dense path; TND (varlen) goes to :mod:`.fusion_attention_tnd`.
SUPPORTED_LAYOUTS = ("BNSD", "BSND", "BSH", "SBH")
#: Layouts the torchair GE converter accepts (and only with keep_prob == 1).
GE_LAYOUTS = ("BSH", "BNSD")
#: sparse_mode values simulated: 0 defaultMask, 2 leftUpCausal, 3 rightDownCausal.
SUPPORTED_SPARSE_MODES = (0, 2, 3)
#: sparse_mode values that take the compressed causal mask instead of a full one.
COMPRESSED_MASK_MODES = (2, 3)
#: Side of the compressed causal mask that modes 2/3 take, whatever the real sequence lengths.
COMPRESSED_MASK_SIZE = 2048
#: The real op accepts inner_precise 0..3 (0/1 reserved, 2 = compute fully masked rows correctly).
SUPPORTED_INNER_PRECISE = (0, 1, 2, 3)
#: Dq == Dk must lie in 1..MAX_HEAD_DIM (A2 docs); Dv <= Dk.
MAX_HEAD_DIM = 768
#: Nq must lie in 1..MAX_QUERY_HEADS (A2 docs).
MAX_QUERY_HEADS = 256
#: Default pre_tockens / next_tockens: no band.
NO_BAND = 2147483647
#: Last dim of softmax_max / softmax_sum (the row value repeated), as torch_npu's Meta kernel returns.
SOFTMAX_STAT_WIDTH = 8

_SOFTMAX_STAT_DTYPE = torch.float32


#: q/k/v dtypes torchair's GE op FlashAttentionScore(Grad) takes (its REG_OP, torchair
#: ``_ge_concrete_graph/auto_generated_ge_raw_ops.py``): fp32 is refused there, though the aclnn kernel
#: behind eager ``torch_npu.npu_fusion_attention`` takes it.
GE_DTYPES = frozenset({torch.float16, torch.bfloat16})
#: Where the GE limits come from (named in every refusal they cause).
GE_CONVERTER = (
    "torchair GE converter of npu_fusion_attention (torch_npu 2.13.0/2.9.0 "
    "ge_converter/custom/npu_fusion_attention.py, FlashAttentionScore)"
)


def _holds(condition) -> bool:
    """A size condition, symbolic sizes included: decided on this graph's sizes, with a guard."""
    return guard_or_false(condition)


def fusion_attention_violation(
    query_bnsd: tuple,
    key_bnsd: tuple,
    value_bnsd: tuple,
    dtypes: tuple,
    *,
    input_layout: str,
    head_num: int | None = None,
    mask_shape: tuple | None = None,
    sparse_mode: int = 0,
    keep_prob: float = 1.0,
    downstream: str | None = None,
) -> str | None:
    """Why ``npu_fusion_attention`` (and its grad) would refuse these arguments, or None: the one home of
    this op's limits, used by the stand-in's validation, ``patterns/attention.py`` and the GE conversion
    check.

    Kernel limits (torch_npu 2.13.0 ``_op_plugin_docs.py``, the op-plugin page
    ``torch_npu-npu_fusion_attention.md``; ``npu-op-contracts.md``): one q/k/v dtype in fp16/bf16/fp32;
    one batch; k and v of one head count and length; Dq == Dk, 1 <= Dv <= Dk <= :data:`MAX_HEAD_DIM`;
    ``head_num`` == Nq <= :data:`MAX_QUERY_HEADS`, Nq % Nkv == 0 (native GQA); ``atten_mask`` BNSS / B1SS /
    11SS / SS (or the compressed 2048x2048 mask for sparse modes 2/3); keep_prob in (0, 1].

    With ``downstream="torchair"`` also the GE converter's (:data:`GE_CONVERTER`): layout BSH or BNSD only
    and keep_prob == 1 only (else NotImplementedError), and the GE op's q/k/v dtypes :data:`GE_DTYPES`.

    Args:
        query_bnsd: q's ``(B, Nq, Sq, D)`` (sizes may be symbolic), whatever the layout.
        key_bnsd: k's ``(B, Nkv, Skv, Dk)``.
        value_bnsd: v's ``(B, Nkv, Skv, Dv)``.
        dtypes: ``(q.dtype, k.dtype, v.dtype)``.
        input_layout: the layout passed to the op.
        head_num: the op's ``head_num`` argument, None when it is Nq by construction.
        mask_shape: ``atten_mask``'s shape, None without a mask.
        sparse_mode: the op's ``sparse_mode``.
        keep_prob: the op's ``keep_prob``.
        downstream: the backend the graph is handed to; ``"torchair"`` adds the GE limits.

    Returns:
        None when supported, else a one-line reason.
    """
    dtype = dtypes[0]
    if not all(d == dtype for d in dtypes):
        return f"dtype mismatch: query/key/value dtypes differ ({', '.join(map(str, dtypes))}); the kernel takes one dtype"
    if dtype not in SUPPORTED_DTYPES:
        return f"unsupported dtype {dtype}; npu_fusion_attention takes fp16, bf16, fp32"
    batch, q_heads, q_len, head_dim = query_bnsd
    kv_batch, kv_heads, kv_len, key_dim = key_bnsd
    v_batch, v_heads, v_len, value_dim = value_bnsd
    if not (_holds(kv_batch == batch) and _holds(v_batch == batch)):
        return f"batch sizes differ: query {batch}, key {kv_batch}, value {v_batch}"
    if not (_holds(v_heads == kv_heads) and _holds(v_len == kv_len)):
        return f"key (N={kv_heads}, S={kv_len}) and value (N={v_heads}, S={v_len}) differ in heads or length"
    if not _holds(key_dim == head_dim):
        return f"query head dim {head_dim} != key head dim {key_dim}"
    if not (_holds(1 <= value_dim) and _holds(value_dim <= head_dim) and _holds(head_dim <= MAX_HEAD_DIM)):
        return f"head dims D={head_dim}, Dv={value_dim}: npu_fusion_attention needs 1 <= Dv <= D <= {MAX_HEAD_DIM}"
    if head_num is not None and not _holds(q_heads == head_num):
        return f"head_num={head_num} != query's head count {q_heads} ({input_layout})"
    if not _holds(q_heads <= MAX_QUERY_HEADS):
        return f"Nq={q_heads} query heads > {MAX_QUERY_HEADS}"
    if not (_holds(kv_heads >= 1) and _holds(q_heads % kv_heads == 0)):
        return f"Nq={q_heads} is not a multiple of Nkv={kv_heads}; npu_fusion_attention's GQA needs Nq % Nkv == 0"
    if mask_shape is not None:
        reason = _mask_shape_violation(tuple(mask_shape), sparse_mode, batch, q_heads, q_len, kv_len)
        if reason is not None:
            return reason
    if not 0.0 < keep_prob <= 1.0:
        return f"keep_prob={keep_prob} must lie in (0, 1]"
    if downstream == "torchair":
        if input_layout not in GE_LAYOUTS:
            return f"input_layout {input_layout!r}: the {GE_CONVERTER} takes {'/'.join(GE_LAYOUTS)} only"
        if keep_prob != 1.0:
            return (
                f"keep_prob {keep_prob:g}: the {GE_CONVERTER} takes keep_prob == 1 only (NotImplementedError in GE "
                "mode); train without attention dropout or use another downstream"
            )
        if dtype not in GE_DTYPES:
            return (
                f"dtype {dtype}: the {GE_CONVERTER} emits the GE op FlashAttentionScore, whose q/k/v are fp16/bf16 "
                "only (the eager aclnn kernel takes fp32, GE does not); compute attention in bf16/fp16"
            )
    return None


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
        return _tnd().call_violation(query, key, value, head_num, atten_mask=atten_mask, sparse_mode=sparse_mode,
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


def _mask_shape_violation(shape: tuple, sparse_mode: int, batch, heads, q_len, kv_len) -> str | None:
    if sparse_mode in COMPRESSED_MASK_MODES:
        n = COMPRESSED_MASK_SIZE
        if shape != (n, n):
            return (
                f"sparse_mode={sparse_mode} takes the compressed {n}x{n} causal mask "
                f"(torch.triu(torch.ones({n}, {n}), diagonal=1).bool()), got shape {shape}"
            )
        return None
    if len(shape) == 2:
        lead_ok = True
    elif len(shape) == 4:
        # BNSS, B1SS, 11SS (a 1NSS mask is not in the list)
        lead_ok = (_holds(shape[0] == 1) or _holds(shape[0] == batch)) and (
            _holds(shape[1] == 1) or (_holds(shape[1] == heads) and _holds(shape[0] == batch))
        )
    else:
        lead_ok = False
    if not (lead_ok and _holds(shape[-2] == q_len) and _holds(shape[-1] == kv_len)):
        return (
            f"attention mask shape {shape} is none of BNSS/B1SS/11SS/SS for B={batch}, N={heads}, "
            f"Sq={q_len}, Skv={kv_len} (npu_fusion_attention does not broadcast masks)"
        )
    return None


def compressed_causal_mask(device: torch.device | str | None = None) -> torch.Tensor:
    """The compressed causal mask sparse modes 2/3 take: ``torch.triu(ones(2048, 2048), diagonal=1).bool()``.

    Args:
        device: where to build it.

    Returns:
        A ``[2048, 2048]`` bool tensor, True above the diagonal (True = masked out).
    """
    n = COMPRESSED_MASK_SIZE
    return torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), diagonal=1)


@functools.cache
def _cpu_compressed_causal_mask() -> torch.Tensor:
    return compressed_causal_mask("cpu")


def _tnd():
    """The TND path (imported on first use: it imports :mod:`.varlen_attention`, which imports this module)."""
    from . import fusion_attention_tnd

    return fusion_attention_tnd


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
    pse,
    padding_mask,
    atten_mask,
    keep_prob,
    inner_precise,
    prefix,
    actual_seq_qlen,
    actual_seq_kvlen,
    sparse_mode,
    softmax_layout,
    sink,
    dropout_mask=None,
    query_dtype=None,
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
        expected = _cpu_compressed_causal_mask().to(atten_mask.device)
        if not torch.equal(atten_mask.bool(), expected):
            raise RuntimeError(
                f"npu_fusion_attention: sparse_mode={sparse_mode} needs the compressed causal mask "
                "torch.triu(torch.ones(2048, 2048), diagonal=1).bool(); got another 2048x2048 mask"
            )
        shift = 0 if sparse_mode == 2 else skv - sq
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


def _probabilities(q, k, pse, masked, scale, group):
    """fp32 [B, Nq, Sq, Skv] softmax probabilities (0 on fully masked rows), row max and row sum."""
    k = k.repeat_interleave(group, dim=1) if group > 1 else k
    scores = q @ k.transpose(-1, -2)
    if pse is not None:
        scores = scores + pse.float()
    scores = scores * scale
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    safe_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    e = torch.exp(scores - safe_max)
    row_sum = e.sum(-1, keepdim=True)
    p = e / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
    return p, row_max, row_sum


def reference_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = NO_BAND,
    next_tockens: int = NO_BAND,
    inner_precise: int = 0,
    prefix: list[int] | None = None,
    actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
):
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
    if input_layout == "TND":
        return _tnd().forward(
            query, key, value, head_num, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask, scale=scale,
            keep_prob=keep_prob, inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
            actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, softmax_layout=softmax_layout, sink=sink,
            dropout_mask=dropout_mask, seed=seed, offset=offset,
        )  # fmt: skip
    op = "npu_fusion_attention"
    dims = _dims(query, key, value, head_num, input_layout, op)
    _check_options(
        op, dims, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask, keep_prob=keep_prob,
        inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, softmax_layout=softmax_layout, sink=sink,
        dropout_mask=dropout_mask, query_dtype=query.dtype,
    )  # fmt: skip
    b, nq, nkv, sq, skv, _, _ = dims
    group = nq // nkv
    q = _to_bnsd(query, input_layout, nq).float()
    k = _to_bnsd(key, input_layout, nkv).float()
    v = _to_bnsd(value, input_layout, nkv).float()
    masked = _masked_positions(atten_mask, sparse_mode, pre_tockens, next_tockens, sq, skv, query.device)
    p, row_max, row_sum = _probabilities(q, k, pse, masked, scale, group)
    if keep_prob < 1.0:
        keep = dropout_keep_mask((b, nq, sq, skv), keep_prob, seed, offset, query.device)
        p = p * keep / keep_prob
    v = v.repeat_interleave(group, dim=1) if group > 1 else v
    out = _from_bnsd((p @ v).to(query.dtype), input_layout)
    stat_shape = (b, nq, sq, SOFTMAX_STAT_WIDTH)
    softmax_max = row_max.expand(stat_shape).contiguous()
    softmax_sum = row_sum.expand(stat_shape).contiguous()
    softmax_out = query.new_empty([0])
    return out, softmax_max, softmax_sum, softmax_out, seed, offset, _numels(dims, keep_prob)


def reference_fusion_attention_grad(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dy: torch.Tensor,
    head_num: int,
    input_layout: str,
    *,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    softmax_max: torch.Tensor | None = None,
    softmax_sum: torch.Tensor | None = None,
    softmax_in: torch.Tensor | None = None,
    attention_in: torch.Tensor | None = None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = NO_BAND,
    next_tockens: int = NO_BAND,
    inner_precise: int = 0,
    seed: int = 0,
    offset: int = 0,
    numels: int = 0,
    prefix: list[int] | None = None,
    actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
):
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
    if input_layout == "TND":
        return _tnd().grad(
            query, key, value, dy, head_num, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
            scale_value=scale_value, keep_prob=keep_prob, inner_precise=inner_precise, prefix=prefix,
            actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode,
            softmax_layout=softmax_layout, sink=sink,
        )  # fmt: skip
    op = "npu_fusion_attention_grad"
    dims = _dims(query, key, value, head_num, input_layout, op)
    _check_options(
        op, dims, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask, keep_prob=keep_prob,
        inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, softmax_layout=softmax_layout, sink=sink,
        query_dtype=query.dtype,
    )  # fmt: skip
    b, nq, nkv, sq, skv, d, dv_dim = dims
    out_shape = _out_shape(query, input_layout, nq, dv_dim)
    if list(dy.shape) != out_shape:
        raise RuntimeError(f"{op}: dy shape {tuple(dy.shape)} != attention_out shape {tuple(out_shape)}")
    group = nq // nkv
    q = _to_bnsd(query, input_layout, nq).float()
    k = _to_bnsd(key, input_layout, nkv).float()
    v = _to_bnsd(value, input_layout, nkv).float()
    do = _to_bnsd(dy, input_layout, nq).float()
    masked = _masked_positions(atten_mask, sparse_mode, pre_tockens, next_tockens, sq, skv, query.device)
    p, _, _ = _probabilities(q, k, pse, masked, scale_value, group)
    k_rep = k.repeat_interleave(group, dim=1) if group > 1 else k
    v_rep = v.repeat_interleave(group, dim=1) if group > 1 else v
    if keep_prob < 1.0:
        keep = dropout_keep_mask((b, nq, sq, skv), keep_prob, seed, offset, query.device) / keep_prob
        p_drop = p * keep
    else:
        keep, p_drop = None, p
    dv_full = p_drop.transpose(-1, -2) @ do  # [B, Nq, Skv, Dv]
    dp = do @ v_rep.transpose(-1, -2)  # [B, Nq, Sq, Skv]
    if keep is not None:
        dp = dp * keep
    ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale_value
    dq = ds @ k_rep
    dk_full = ds.transpose(-1, -2) @ q
    if group > 1:
        dk_full = dk_full.reshape(b, nkv, group, skv, d).sum(2)
        dv_full = dv_full.reshape(b, nkv, group, skv, dv_dim).sum(2)
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
    if input_layout == "TND":
        return _tnd().fake_forward(
            query, key, value, head_num, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask, scale=scale,
            keep_prob=keep_prob, inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
            actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, softmax_layout=softmax_layout, sink=sink,
            dropout_mask=dropout_mask, seed=seed, offset=offset,
        )  # fmt: skip
    op = "npu_fusion_attention"
    dims = _dims(query, key, value, head_num, input_layout, op)
    _check_options(
        op, dims, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask, keep_prob=keep_prob,
        inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, softmax_layout=softmax_layout, sink=sink,
        dropout_mask=dropout_mask, query_dtype=query.dtype,
    )  # fmt: skip
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
        return _tnd().fake_grad(query, key, value, dy, head_num, **kwargs)
    op = "npu_fusion_attention_grad"
    dims = _dims(query, key, value, head_num, input_layout, op)
    _check_options(
        op, dims, pse=kwargs.get("pse"), padding_mask=kwargs.get("padding_mask"),
        atten_mask=kwargs.get("atten_mask"), keep_prob=kwargs.get("keep_prob", 1.0),
        inner_precise=kwargs.get("inner_precise", 0), prefix=kwargs.get("prefix"),
        actual_seq_qlen=kwargs.get("actual_seq_qlen"), actual_seq_kvlen=kwargs.get("actual_seq_kvlen"),
        sparse_mode=kwargs.get("sparse_mode", 0), softmax_layout=kwargs.get("softmax_layout", ""),
        sink=kwargs.get("sink"), query_dtype=query.dtype,
    )  # fmt: skip
    out_shape = _out_shape(query, input_layout, dims[1], dims[6])
    if list(dy.shape) != out_shape:
        raise RuntimeError(f"{op}: dy shape {tuple(dy.shape)} != attention_out shape {tuple(out_shape)}")
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
