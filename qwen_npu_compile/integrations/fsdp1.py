"""FSDP1's flattened parameters: a layer whose parameters FSDP1 (``FullyShardedDataParallel`` with
``use_orig_params=False``) replaced by a ``FlatParameter`` cannot be compiled usefully (Dynamo breaks its graph
apart and nothing fuses), so :func:`~qwen_npu_compile.maybe_compile` and the verl hook refuse it with one line
naming the fix."""

from __future__ import annotations

import sys

from torch import nn

from qwen_npu_compile.config import ENV_COMPILE
from qwen_npu_compile.layers import clean_name

#: How to make an FSDP1-wrapped model compile (the end of every FSDP1 error).
FIX = (
    "pass use_orig_params=True to FullyShardedDataParallel (verl: "
    "actor_rollout_ref.actor.fsdp_config.use_orig_params=True, likewise actor_rollout_ref.ref.fsdp_config and "
    "critic.model.fsdp_config), or use FSDP2 (fully_shard; verl: actor_rollout_ref.actor.strategy=fsdp2), "
    f"or leave {ENV_COMPILE} unset"
)


def without_orig_params(model: nn.Module) -> list[str]:
    """Names of FSDP1 ``FullyShardedDataParallel`` modules in ``model`` built with ``use_orig_params=False``."""
    fsdp_module = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    if fsdp_module is None:  # FSDP1 never imported: nothing can be wrapped by it
        return []
    fsdp_class = fsdp_module.FullyShardedDataParallel
    return [
        clean_name(name) or "<root>"
        for name, module in model.named_modules()
        if isinstance(module, fsdp_class) and not getattr(module, "_use_orig_params", True)
    ]


def has_flat_parameters(layer: nn.Module, had_parameters: bool) -> bool:
    """Whether FSDP1 (``use_orig_params=False``) replaced the layer's parameters with a FlatParameter.

    The FlatParameter is registered on the layer when it is its own FSDP unit; when an outer unit owns
    it, the layer keeps no parameters at all (only plain-tensor views during forward).
    """
    flat_module = sys.modules.get("torch.distributed.fsdp._flat_param")
    if flat_module is None:
        return False
    params = list(layer.parameters())
    if any(isinstance(p, flat_module.FlatParameter) for p in params):
        return True
    return had_parameters and not params


def message(where: str) -> str:
    """The one-line error for ``where`` (a layer or the model) wrapped by FSDP1 without ``use_orig_params``."""
    return (
        f"qwen_npu: {where} is wrapped by FSDP1 (FullyShardedDataParallel) with use_orig_params=False; its "
        "parameters are flattened into a FlatParameter that a compiled layer cannot use (Dynamo breaks the "
        f"layer's graph apart and nothing fuses). To compile it, {FIX}"
    )
