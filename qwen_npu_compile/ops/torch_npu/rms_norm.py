"""Stand-in for ``npu_rms_norm`` / ``npu_rms_norm_backward`` (torch_npu 2.13.0).

Semantics (torch_npu 2.13.0 ``_op_plugin_docs.py``; ``docs/npu-op-contracts.md``):
``rstd = 1/sqrt(mean(x^2 over the trailing gamma.dim() dims) + eps)``, ``y = x * rstd * gamma``,
computed in fp32 and rounded once to x's dtype. ``rstd`` is fp32 with shape
``x.shape[:-gamma.dim()] + (1,) * gamma.dim()``. Backward: ``dx`` in x's dtype, ``dgamma`` always fp32.
"""

from __future__ import annotations

import torch

from qwen_npu_compile.compat import guard_or_false
from qwen_npu_compile.ops.define import define_op

#: Ops of this module that ``recompute="cheap"`` may recompute in the backward instead of saving
#: (:mod:`qwen_npu_compile.handoff.recompute`): one memory-bound pass over the hidden state (reads x and gamma, writes y and
#: rstd), no matmul.
RECOMPUTE_CHEAP: tuple[str, ...] = ("npu::npu_rms_norm",)
RMS_NORM_SCHEMA = "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)"
RMS_NORM_BACKWARD_SCHEMA = (
    "npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) -> (Tensor, Tensor)"
)

#: (x dtype, gamma dtype) pairs the kernel supports on Atlas A2/A3 (torch_npu 2.13.0 docs).
SUPPORTED_DTYPES = frozenset(
    {
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
    }
)


def _norm_dims(gamma: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(-gamma.dim(), 0))


def _rstd_shape(x: torch.Tensor, gamma: torch.Tensor) -> list:
    return [*x.shape[: x.dim() - gamma.dim()], *([1] * gamma.dim())]


def rms_norm_violation(x, gamma, *, downstream: str | None = None) -> str | None:
    """Why ``npu_rms_norm(x, gamma)`` (and its backward) would fail, or None: the one home of this op's
    limits, used by the stand-in's validation, ``patterns/rms_norm.py`` and the GE conversion check.

    Kernel limits (torch_npu 2.13.0 ``_op_plugin_docs.py`` ``npu_rms_norm``): an (x, gamma) dtype pair in
    :data:`SUPPORTED_DTYPES`; gamma of x's trailing shape. torchair's converters
    (``ge_converter/custom/npu_rms_norm.py`` -> RmsNorm, ``npu_rms_norm_backward.py`` -> RmsNormGrad,
    torch_npu 2.13.0 and 2.9.0) pass their arguments through unchecked, so ``downstream`` adds nothing.

    Args:
        x: ``[..., *gamma.shape]`` (tensor or FakeTensor; sizes may be symbolic).
        gamma: the weight.
        downstream: the backend the graph is handed to (no extra limits today).

    Returns:
        None when supported, else a one-line reason.
    """
    del downstream  # the GE converters add no limits (see above)
    if (x.dtype, gamma.dtype) not in SUPPORTED_DTYPES:
        return (
            f"unsupported dtype pair (x={x.dtype}, gamma={gamma.dtype}); npu_rms_norm takes "
            "(fp16|bf16, fp32), (fp16, fp16), (bf16, bf16), (fp32, fp32)"
        )
    trailing = tuple(x.shape[x.dim() - gamma.dim() :]) if gamma.dim() <= x.dim() else None
    if trailing is None or len(trailing) != gamma.dim() or not all(
        guard_or_false(a == b) for a, b in zip(trailing, gamma.shape)
    ):
        return f"gamma shape {tuple(gamma.shape)} != trailing x shape {tuple(x.shape)}"
    return None


def _check(x: torch.Tensor, gamma: torch.Tensor) -> None:
    reason = rms_norm_violation(x, gamma)
    if reason is not None:
        raise RuntimeError(f"npu_rms_norm: {reason}")


def reference_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """CPU reference of ``npu_rms_norm``.

    Args:
        x: ``[..., *gamma.shape]``, fp16/bf16/fp32.
        gamma: the weight, fp32 or x's dtype.
        epsilon: added to the mean square.

    Returns:
        ``(y, rstd)``: y like x; rstd fp32 of shape ``x.shape[:-gamma.dim()] + (1,)*gamma.dim()``.

    Raises:
        RuntimeError: a dtype pair outside :data:`SUPPORTED_DTYPES` or a gamma shape mismatch.
    """
    _check(x, gamma)
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(_norm_dims(gamma), keepdim=True) + epsilon)
    y = (xf * rstd * gamma.float()).to(x.dtype)
    return y, rstd


def reference_rms_norm_backward(dy, x, gamma, rstd):
    """CPU reference of ``npu_rms_norm_backward``: returns ``(dx in x's dtype, dgamma fp32)``."""
    dims = _norm_dims(gamma)
    xhat = x.float() * rstd
    dxhat = dy.float() * gamma.float()
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(dims, keepdim=True))
    lead = tuple(range(x.dim() - gamma.dim()))
    dgamma = (dy.float() * xhat).sum(lead) if lead else dy.float() * xhat
    return dx.to(x.dtype), dgamma.reshape(gamma.shape)


def _fake_rms_norm(x, gamma, epsilon=1e-6):
    _check(x, gamma)
    return torch.empty_like(x), x.new_empty(_rstd_shape(x, gamma), dtype=torch.float32)


def _fake_rms_norm_backward(dy, x, gamma, rstd):
    return torch.empty_like(x), gamma.new_empty(gamma.shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, gamma, _ = inputs
    ctx.save_for_backward(x, gamma, output[1])


def _backward(ctx, grad_y, grad_rstd):
    x, gamma, rstd = ctx.saved_tensors
    dx, dgamma = torch.ops.npu.npu_rms_norm_backward.default(grad_y, x, gamma, rstd)
    # dgamma is fp32 by contract; autograd needs it in gamma's dtype.
    return dx, dgamma.to(gamma.dtype), None


def register(lib: torch.library.Library) -> None:
    """Define both ops in ``lib`` (the ``npu`` namespace) with kernels, fakes and autograd."""
    define_op(lib, RMS_NORM_SCHEMA, reference_rms_norm, _fake_rms_norm, _backward, _setup_context)
    define_op(lib, RMS_NORM_BACKWARD_SCHEMA, reference_rms_norm_backward, _fake_rms_norm_backward)
