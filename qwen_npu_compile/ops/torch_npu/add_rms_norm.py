"""Stand-in for ``npu_add_rms_norm`` (torch_npu 2.13.0): residual add + RMSNorm, inference only.

Semantics (``docs/npu-op-contracts.md``; torch_npu 2.13.0 Meta kernel
``op_plugin/meta/_meta_registrations.py`` ``npu_add_rms_norm_meta``; torchair converter
``ge_converter/custom/npu_add_rms_norm.py`` -> GE ``AddRmsNorm``)::

    s = x1 + x2
    rstd = 1 / sqrt(mean(s^2 over the trailing gamma.dim() dims) + epsilon)
    returns (y = s * rstd * gamma in x1's dtype, rstd fp32 of shape x1.shape[:-gamma.dim()] + (1,)*gamma.dim(), s in x1's dtype)

The stand-in computes the sum and the norm in fp32 and rounds each output once (as the fused kernel
does). In fp32 that is exactly HF's ``residual + h`` followed by ``Qwen2RMSNorm``; in bf16/fp16 HF
normalises the *rounded* sum, so y may differ by about 1 ulp (as ``npu_rms_norm`` already does).

The op has **no autograd** in torch_npu (no ``derivatives.yaml`` entry, no backward op), so it may only
appear in graphs that are never differentiated.
"""

from __future__ import annotations

import torch

from qwen_npu_compile.compat import guard_or_false
from qwen_npu_compile.ops.define import define_op

#: Ops of this module that ``recompute="cheap"`` may recompute in the backward instead of saving
#: (:mod:`qwen_npu_compile.handoff.recompute`): a residual add fused into npu_rms_norm: memory-bound, no matmul.
RECOMPUTE_CHEAP: tuple[str, ...] = ("npu::npu_add_rms_norm",)
ADD_RMS_NORM_SCHEMA = "npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)"

#: x1/x2/gamma dtypes (one dtype for all three: the contract says gamma's must equal x1's).
SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})


def add_rms_norm_violation(x1, x2, gamma, *, needs_grad: bool = False, downstream: str | None = None) -> str | None:
    """Why ``npu_add_rms_norm(x1, x2, gamma)`` would fail or be wrong, or None: the one home of this op's
    limits, used by the stand-in, ``patterns/rms_norm.py`` and the GE conversion check.

    Limits (torch_npu 2.13.0 contract, ``docs/npu-op-contracts.md``): x1, x2 of one shape
    and dtype (no broadcasting), fp16/bf16/fp32; gamma of x1's dtype and trailing shape; no empty
    tensors; no autograd (inference only). torchair's converter (``ge_converter/custom/npu_add_rms_norm.py``
    -> AddRmsNorm, torch_npu 2.13.0) passes its arguments through unchecked: ``downstream`` adds nothing.

    Args:
        x1, x2: ``[..., *gamma.shape]`` (tensors or FakeTensors; sizes may be symbolic).
        gamma: the weight.
        needs_grad: whether the graph holding the call is differentiated.
        downstream: the backend the graph is handed to (no extra limits today).

    Returns:
        None when supported, else a one-line reason.
    """
    del downstream  # the GE converter adds no limits (see above)
    if needs_grad:
        return "npu_add_rms_norm has no backward (torch_npu registers no autograd for it): inference graphs only"
    if x1.dtype not in SUPPORTED_DTYPES:
        return f"unsupported dtype {x1.dtype}; npu_add_rms_norm takes fp16, bf16, fp32"
    if x2.dtype != x1.dtype or gamma.dtype != x1.dtype:
        return f"dtypes differ (x1={x1.dtype}, x2={x2.dtype}, gamma={gamma.dtype}); gamma's must equal x1's"
    if x1.dim() != x2.dim() or not all(guard_or_false(a == b) for a, b in zip(x1.shape, x2.shape)):
        return f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} differ in shape (no broadcasting)"
    trailing = tuple(x1.shape[x1.dim() - gamma.dim() :]) if 0 < gamma.dim() <= x1.dim() else None
    if trailing is None or not all(guard_or_false(a == b) for a, b in zip(trailing, gamma.shape)):
        return f"gamma shape {tuple(gamma.shape)} != trailing x shape {tuple(x1.shape)}"
    if any(guard_or_false(size == 0) for size in x1.shape):
        return "empty input (npu_add_rms_norm takes no empty tensors)"
    return None


def _check(x1, x2, gamma) -> None:
    reason = add_rms_norm_violation(x1, x2, gamma)
    if reason is not None:
        raise RuntimeError(f"npu_add_rms_norm: {reason}")


def _rstd_shape(x: torch.Tensor, gamma: torch.Tensor) -> list:
    return [*x.shape[: x.dim() - gamma.dim()], *([1] * gamma.dim())]


def reference_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """CPU reference of ``npu_add_rms_norm``.

    Args:
        x1, x2: ``[..., *gamma.shape]``, one dtype (fp16/bf16/fp32).
        gamma: the weight, x1's dtype.
        epsilon: added to the mean square.

    Returns:
        ``(y, rstd, s)``: y and s = x1 + x2 in x1's dtype; rstd fp32 of shape
        ``x1.shape[:-gamma.dim()] + (1,)*gamma.dim()``.

    Raises:
        RuntimeError: a limit of :func:`add_rms_norm_violation` is broken.
    """
    _check(x1, x2, gamma)
    s = x1.float() + x2.float()
    dims = tuple(range(-gamma.dim(), 0))
    rstd = torch.rsqrt(s.pow(2).mean(dims, keepdim=True) + epsilon)
    return (s * rstd * gamma.float()).to(x1.dtype), rstd, s.to(x1.dtype)


def _fake_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    _check(x1, x2, gamma)
    return torch.empty_like(x1), x1.new_empty(_rstd_shape(x1, gamma), dtype=torch.float32), torch.empty_like(x1)


def register(lib: torch.library.Library) -> None:
    """Define the op in ``lib`` (the ``npu`` namespace) with its kernel and fake; no autograd (as torch_npu)."""
    define_op(lib, ADD_RMS_NORM_SCHEMA, reference_add_rms_norm, _fake_add_rms_norm)
