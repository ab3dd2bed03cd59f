"""``qwen_npu::gate_up_proj``: gate_proj and up_proj written into the two halves of one buffer.

``Qwen2MLP`` computes ``silu(x @ w_gate.T) * (x @ w_up.T)``. ``npu_swiglu(t, dim)`` splits ``t`` along
*any* ``dim`` into A (first half) and B (second half) and needs ``t`` contiguous (torch_npu 2.13.0
``npu_swiglu`` docs, ``docs/npu-op-contracts.md``). Splitting along a new leading dim::

    buf = gate_up_proj(x, w_gate, w_up)       # [2, *x.shape[:-1], I]: buf[0] = x @ w_gate.T, buf[1] = x @ w_up.T
    y = npu_swiglu(buf, 0).squeeze(0)         # [*x.shape[:-1], I]; squeeze is a view

Each half ``buf[i]`` is a contiguous block of ``T·I`` elements, so each projection writes straight into
it (``torch.mm(..., out=buf[i])``): no ``cat`` of the activations (``2·T·2I`` elements moved) and no
``cat`` of the weights (``2·2I·H``), and the parameters and state-dict keys stay as they are.
``npu_swiglu`` with ``dim=0`` sees rows = 1, columns = T·I (CANN ops-nn ``swi_glu_tiling.cpp``
``SetTotalShape``: rows = product of the dims before ``dim``, columns = the rest / 2), and its tiling
splits the columns across the cores.

Backward (``torch.library.register_autograd``, plain ATen, so AOTAutograd records it as ``mm``/``add``
that every downstream, torchair included, converts natively; ``g = [g_gate, g_up]`` the gradient of
``buf``, tokens flattened to ``T``)::

    dx      = g_gate @ w_gate + g_up @ w_up     # mm, mm, add: as autograd accumulates two linears' dx
    dw_gate = g_gate^T @ x                      # [I, H]
    dw_up   = g_up^T @ x

Gradients are only computed for the inputs that need them (a frozen weight gets none). The kernel runs
on any device (``CompositeExplicitAutograd``), so the op is registered on every host, with or without
torch_npu; :mod:`qwen_npu_compile.torchair.converters` converts it for torchair (two matmuls and a ``ConcatD``
along axis 0). Its limits: :func:`gate_up_proj_violation`.
"""

from __future__ import annotations

import math

import torch

from qwen_npu_compile.compat import guard_or_false
from qwen_npu_compile.ops import ge as ge_api
from qwen_npu_compile.ops.define import QWEN_NPU_LIBRARY, define_op

NAMESPACE = "qwen_npu"
SCHEMA = "gate_up_proj(Tensor x, Tensor w_gate, Tensor w_up) -> Tensor"

#: Dtypes of x and the weights (one dtype for all three): those of ``npu_swiglu``, which reads the
#: output, and of GE's BatchMatMulV2 (float, float16, bfloat16).
SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})

#: x's rank range. The GE converter feeds x with a leading 1 to BatchMatMulV2, whose batch form CANN
#: documents for 2-6-D inputs (ops-nn BatchMatMulV3/MatMulV3 IR docs; assumed for V2), so x has at most 5
#: dims; the output (x's rank + 1) then stays within npu_swiglu's 1-8 dims.
MAX_RANK = 5


def gate_up_proj_violation(x, w_gate, w_up, *, downstream: str | None = None) -> str | None:
    """Why ``gate_up_proj(x, w_gate, w_up)`` would fail, or None: the one home of this op's limits, used by
    the kernel and fake kernel, ``patterns/swiglu.py`` and the GE conversion check.

    Limits: x ``[..., H]`` with 1 to :data:`MAX_RANK` dims; w_gate and w_up ``[I, H]`` (2-D, equal
    shapes); x, w_gate, w_up of one dtype in :data:`SUPPORTED_DTYPES` (no promotion: ``torch.mm`` and
    GE's matmuls take one dtype) and on one device. The GE converter adds no further limit.

    Args:
        x, w_gate, w_up: tensors or FakeTensors (sizes may be symbolic).
        downstream: the backend the graph is handed to (no extra limits today).

    Returns:
        None when supported, else a one-line reason.
    """
    del downstream  # the GE converter (torchair/converters.py) adds no limits of its own
    if not all(isinstance(t, torch.Tensor) for t in (x, w_gate, w_up)):
        return "x, w_gate and w_up must be tensors"
    if not 1 <= x.dim() <= MAX_RANK:
        return f"x must have 1 to {MAX_RANK} dims, got {x.dim()}"
    if w_gate.dim() != 2 or w_up.dim() != 2:
        return f"w_gate and w_up must be 2-D [I, H], got {tuple(w_gate.shape)} and {tuple(w_up.shape)}"
    if not all(guard_or_false(a == b) for a, b in zip(w_gate.shape, w_up.shape)):
        return f"w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} differ (I or H)"
    if not guard_or_false(x.shape[-1] == w_gate.shape[1]):
        return f"x's last dim {x.shape[-1]} != the weights' H {w_gate.shape[1]}"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"unsupported dtype {x.dtype}; gate_up_proj takes fp16, bf16, fp32"
    if w_gate.dtype != x.dtype or w_up.dtype != x.dtype:
        return f"dtypes differ (x {x.dtype}, w_gate {w_gate.dtype}, w_up {w_up.dtype}); cast them to one dtype"
    if w_gate.device != x.device or w_up.device != x.device:
        return f"devices differ (x {x.device}, w_gate {w_gate.device}, w_up {w_up.device})"
    return None


def _check(x, w_gate, w_up) -> None:
    reason = gate_up_proj_violation(x, w_gate, w_up)
    if reason is not None:
        raise RuntimeError(f"{NAMESPACE}::gate_up_proj: {reason}")


def gate_up_proj(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Both projections of ``x`` into one buffer, gate first (the kernel; module docstring).

    Args:
        x: ``[..., H]``, 1 to 5 dims, any strides; fp16/bf16/fp32.
        w_gate, w_up: ``[I, H]``, x's dtype and device.

    Returns:
        ``[2, *x.shape[:-1], I]`` contiguous, x's dtype: ``[0] = x @ w_gate.T``, ``[1] = x @ w_up.T``
        (each computed by ``torch.mm`` exactly as ``F.linear`` without bias computes it).

    Raises:
        RuntimeError: a limit of :func:`gate_up_proj_violation` is broken (the message names it).
    """
    _check(x, w_gate, w_up)
    inter, hidden = w_gate.shape
    tokens = math.prod(x.shape[:-1])
    out = x.new_empty((2, *x.shape[:-1], inter))
    flat = x.reshape(tokens, hidden)
    torch.mm(flat, w_gate.t(), out=out[0].view(tokens, inter))
    torch.mm(flat, w_up.t(), out=out[1].view(tokens, inter))
    return out


def _fake(x, w_gate, w_up):
    _check(x, w_gate, w_up)
    return x.new_empty((2, *x.shape[:-1], w_gate.shape[0]))


def _setup_context(ctx, inputs, output):
    x, w_gate, w_up = inputs
    ctx.save_for_backward(x, w_gate, w_up)


def _backward(ctx, grad):
    x, w_gate, w_up = ctx.saved_tensors
    inter, hidden = w_gate.shape
    g_gate = grad[0].reshape(-1, inter)
    g_up = grad[1].reshape(-1, inter)
    dx = dw_gate = dw_up = None
    if ctx.needs_input_grad[0]:
        dx = (torch.mm(g_gate, w_gate) + torch.mm(g_up, w_up)).view(x.shape)
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        flat = x.reshape(-1, hidden)
        if ctx.needs_input_grad[1]:
            dw_gate = torch.mm(g_gate.t(), flat)
        if ctx.needs_input_grad[2]:
            dw_up = torch.mm(g_up.t(), flat)
    return dx, dw_gate, dw_up


#: The op overload graphs hold.
OP = define_op(QWEN_NPU_LIBRARY, SCHEMA, gate_up_proj, _fake, _backward, _setup_context)


def register_ge_converter() -> None:
    """Register the GE converter of :data:`OP` with the imported torchair."""
    register, ge = ge_api.torchair_api()

    def convert(x, w_gate, w_up, meta_outputs=None):
        """qwen_npu.gate_up_proj -> ``ConcatD([BatchMatMulV2(x1, w_gate), BatchMatMulV2(x1, w_up)], 0)``.

        ``x1 = Unsqueeze(x, axes=[0])`` (``[1, ..., H]``, as torchair's ``aten.unsqueeze`` converter
        builds it), so each matmul (``adj_x2``: ``x1 @ w.T``, the 2-D weight broadcast over the batch
        dims, as torchair's ``aten.matmul`` converter relies on for 3-D @ 2-D) writes a ``[1, ..., I]``
        half, and the concatenation is along the outermost axis with the matmuls as its direct inputs.

        Whether GE then writes both matmul outputs into the concat's output without a copy is **not
        verified here** (it needs GE compilation on an NPU). Evidence: GE's "Concat No Task" feature
        (CANN GE design doc ``docs/en/design/features/concat_no_task.md``, gitcode.com/cann/ge) turns a
        ConcatD/ConcatV2D into a virtual op whose inputs are laid out in its output when: every dim
        before ``concat_dim`` is 1 (true here: axis 0), no padding along it, every input 32-byte
        aligned (``T·I·itemsize``: true for Qwen2 widths), inputs not from DATA/VARIABLE/CONST nodes nor
        graph outputs, one memory type, and **static shapes only** ("不支持 Unknown Shape"). So with
        ``dynamic=True`` (or any symbolic dim) the ConcatD is a real copy of ``2·T·I`` elements (what
        the activation ``cat`` moved before); with static shapes we expect none. GE's own graph passes
        (e.g. BatchMatMulV2ReshapeFusionPass, 3-D @ 2-D -> MatMul) may restructure the matmuls first;
        whether the no-task condition then still holds is an assumption.
        """
        x1 = ge.Unsqueeze(x, axes=[0])
        gate = ge.BatchMatMulV2(x1, w_gate, None, None, adj_x2=True)
        up = ge.BatchMatMulV2(x1, w_up, None, None, adj_x2=True)
        return ge.ConcatD([gate, up], concat_dim=0, N=2)

    register(OP)(convert)


#: GE converters of this module's op, by ``"namespace.op"`` (registered by
#: :func:`qwen_npu_compile.torchair.converters.register_converters`).
GE_CONVERTERS = {"qwen_npu.gate_up_proj": register_ge_converter}
