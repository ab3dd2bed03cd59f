"""The ``hccl`` process-group backend for ``npu`` tensors, as torch_npu 2.13.0 registers it at import
(``torch_npu/_init/registry/distributed.py``: ``Backend.register_backend("hccl", ..., extended_api=True,
devices=["npu"])``), for the simulated host's one device: world size 1 only.

With one rank every collective is a local copy or nothing (all-reduce, broadcast and barrier leave the tensor as
it is; all-gather, reduce-scatter and all-to-all copy the input into the output), which is what torch's
``FakeProcessGroup`` does (its "collective semantics" note: outputs derivable from local inputs are copied, never
left uninitialised). A group of more than one rank is refused: there is no HCCL to move data between processes.
So ``init_process_group("cpu:gloo,npu:hccl")`` (verl's ``initialize_global_process_group``) gives a group whose
npu collectives run, as FSDP2 and ``torch.distributed.checkpoint`` need (gloo takes CPU and CUDA tensors only:
"ProcessGroupGloo::broadcast: unsupported device type npu").
"""

from __future__ import annotations

import torch.distributed as dist


def _new_process_group_hccl(common_opts, backend_opts):
    from torch._C._distributed_c10d import FakeProcessGroup

    if common_opts.group_size != 1:
        raise RuntimeError(f"hccl (simulated Ascend host): one rank only, got a group of {common_opts.group_size}; "
                           "use gloo for CPU tensors, or world size 1")
    return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size, backend_opts)


def register() -> None:
    """Register ``hccl`` for ``npu`` (once per process)."""
    if "hccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hccl", _new_process_group_hccl, extended_api=True, devices=["npu"])
