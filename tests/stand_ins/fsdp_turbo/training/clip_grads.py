"""``clip_grad_norm(model=..., max_norm=...)`` as verl 0.9.1's ``FSDPTurboEngineWithLMHead.optimizer_step`` calls it."""

from __future__ import annotations

import torch


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the gradients of ``model`` (DTensor shards under FSDP2) to a total L2 norm of ``max_norm``.

    Returns:
        The total norm before clipping, as a Python float (inf or nan when a gradient is not finite).
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if hasattr(norm, "full_tensor"):  # a DTensor's partial norm: reduce it over the mesh
        norm = norm.full_tensor()
    total = float(norm)
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1.0:  # (a plain float scales DTensor shards and tensors alike)
        for grad in grads:
            grad.mul_(coefficient)
    return total
