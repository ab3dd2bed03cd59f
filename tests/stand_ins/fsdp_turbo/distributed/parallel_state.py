"""The parallel state verl 0.9.1 reads (``init_parallel_state``, ``get_parallel_state``): data parallel over all
ranks; context parallelism (``ulysses``) is not modelled."""

from __future__ import annotations

import torch.distributed as dist

_STATE: ParallelState | None = None


class ParallelState:
    """Groups of the process (the methods ``FSDPTurboEngineWithLMHead`` calls)."""

    def __init__(self, config) -> None:
        distributed = config.distributed
        for name in ("tensor_parallel_size", "expert_parallel_size", "ulysses_parallel_size"):
            if getattr(distributed, name) != 1:
                raise NotImplementedError(f"the fsdp_turbo stand-in models data parallelism only ({name} must be 1)")
        world = dist.get_world_size()
        if distributed.fully_shard_parallel_size != world:
            raise ValueError(f"fully_shard_parallel_size={distributed.fully_shard_parallel_size} but the world has "
                             f"{world} rank(s)")

    def is_group_enable(self, name: str) -> bool:
        return False

    def get_ulysses_group_size(self) -> int:
        return 1

    def get_ulysses_group(self):
        return None

    def get_ulysses_rank(self) -> int:
        return 0

    def get_data_rank(self) -> int:
        return dist.get_rank()

    def get_data_group_size(self) -> int:
        return dist.get_world_size()

    def get_data_group(self):
        return dist.group.WORLD


def init_parallel_state(config) -> None:
    """Build the process's state from ``config`` (an ``FSDPTurboConfig``); the process group must exist."""
    global _STATE
    _STATE = ParallelState(config)


def get_parallel_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("init_parallel_state was not called")
    return _STATE
