"""``FSDPTurboConfig`` and ``_dict_to_dataclass``, the two names verl 0.9.1 imports from here."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any


@dataclasses.dataclass
class FSDPPlanConfig:
    """How the model is sharded (verl's ``fsdp.yaml`` ``turbo_config.distributed.fsdp_plan`` keys).

    Attributes:
        param_dtype / reduce_dtype / output_dtype: ``bf16``, ``fp16`` or ``fp32``: FSDP2's mixed precision.
        fsdp_implementation: ``native`` (torch's ``fully_shard``) is the only one modelled.
        num_to_forward_prefetch / num_to_backward_prefetch: accepted, not modelled (one rank).
        cpu_offload: set by verl from ``engine_config.offload_policy``; True is refused (a CPU has no pinned memory).
    """

    param_dtype: str = "bf16"
    reduce_dtype: str = "fp32"
    output_dtype: str = "bf16"
    fsdp_implementation: str = "native"
    num_to_forward_prefetch: int = 1
    num_to_backward_prefetch: int = 1
    cpu_offload: bool = False


@dataclasses.dataclass
class DistributedConfig:
    """Parallel sizes (verl's ``turbo_config.distributed`` keys); only data parallelism is modelled."""

    fully_shard_parallel_size: int = 1
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    expert_fully_shard_parallel_size: int = 1
    ulysses_parallel_size: int = 1
    fsdp_plan: FSDPPlanConfig = dataclasses.field(default_factory=FSDPPlanConfig)


@dataclasses.dataclass
class FSDPTurboConfig:
    """The whole ``turbo_config``.

    Attributes:
        distributed: parallel sizes and the FSDP plan.
        module_patches: dotted path of an attribute to replace (``pkg.module.Class.forward``) -> dotted path of
            its replacement (``pkg.module.function``): the stand-in's form of FSDP-Turbo's model patches.
    """

    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    module_patches: dict[str, str] = dataclasses.field(default_factory=dict)


def _dict_to_dataclass(cls: type, data: Any) -> Any:
    """``cls`` built from a (nested) mapping: nested dataclass fields from nested mappings.

    Raises:
        TypeError: ``data`` has a key that ``cls`` has no field for.
    """
    if data is None:
        return cls()
    if dataclasses.is_dataclass(data):
        return data
    data = dict(data)
    hints = typing.get_type_hints(cls)
    fields = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {unknown}")
    values = {}
    for name, value in data.items():
        hint = hints[name]
        values[name] = _dict_to_dataclass(hint, value) if dataclasses.is_dataclass(hint) else (
            dict(value) if isinstance(value, typing.Mapping) else value)
    return cls(**values)
