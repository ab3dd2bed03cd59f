"""A stand-in ``torch_npu`` 2.13.0 for the simulated Ascend host (test infrastructure of qwen_npu_compile).

Never installed and never imported by the package: tests put ``tests/ascend_host/stand_in`` on ``sys.path``
(``PYTHONPATH``) so that ``import torch_npu`` finds this, and then everything an Ascend host does on that
import happens here (torch_npu 2.13.0 wheel, ``torch_npu/__init__.py`` and ``torch_npu/dynamo/__init__.py``):

- PrivateUse1 is renamed ``npu``; tensors on ``npu`` are real tensors in CPU memory (``csrc/npu_sim.cpp``, a
  C++ extension built once into a cache, see :mod:`._build`), every aten op runs through a CPU fallback;
- ``torch.npu`` (= ``torch_npu.npu``): device count 1, ``npu:0``, memory statistics, seeds, streams;
- the ``npu`` op namespace with the wheel's schemas, kernels for ``npu`` tensors ONLY, fake kernels,
  autograd and the documented limits (:mod:`._ops`); ``torch_npu.npu_rms_norm`` etc. as attributes;
- the ``hccl`` process-group backend for ``npu`` tensors, world size 1 (:mod:`._distributed`);
- the lazy ``torchair`` module in ``sys.modules`` (:mod:`.dynamo`), over the wheel's torchair with the CANN
  extension modules stubbed, and the ``npu`` Dynamo backend.

Importing it is irreversible for the process (the PrivateUse1 rename): run such tests in a process of their own.
"""

from __future__ import annotations

import torch

__version__ = "2.13.0"
#: marks this package as the simulated host's stand-in (tests/ascend_host/sim.py reads it)
SIMULATED = True

from . import _build  # noqa: E402

_C = _build.load()
if torch._C._get_privateuse1_backend_name() != "npu":
    torch.utils.rename_privateuse1_backend("npu")

from . import npu  # noqa: E402

torch._register_device_module("npu", npu)
torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_packed_sequence=True,
                                                     for_storage=True)

from . import _ops  # noqa: E402

_LIBRARY = _ops.register_all()

# torch_npu binds its ops as module attributes (verl's npu_patch calls torch_npu.npu_rms_norm, transformers
# `from torch_npu import npu_fusion_attention`)
for _name in ("npu_rms_norm", "npu_rms_norm_backward", "npu_add_rms_norm", "npu_swiglu", "npu_swiglu_backward",
              "npu_rotary_mul", "npu_rotary_mul_backward", "npu_fusion_attention", "npu_fusion_attention_grad",
              "npu_grouped_matmul", "npu_moe_token_permute", "npu_moe_token_unpermute", "npu_chunk_gated_delta_rule"):
    globals()[_name] = getattr(torch.ops.npu, _name)

def get_npu_format(tensor: torch.Tensor) -> int:
    """The ACL storage format of an npu tensor: the base format torch_npu gives a fresh tensor (ND = 2; NCHW = 0
    for 4-D; NCDHW = 30 for 5-D): the simulated device never makes private formats (NZ, ...)."""
    return {4: 0, 5: 30}.get(tensor.dim(), 2)


def get_storage_size(tensor: torch.Tensor) -> int:
    """Elements of ``tensor``'s storage (torch_npu: of its NPU storage)."""
    return tensor.untyped_storage().nbytes() // tensor.element_size()


from . import _distributed  # noqa: E402

_distributed.register()  # the "hccl" process-group backend for npu tensors (one rank)

from . import dynamo  # noqa: E402  (the lazy torchair module and the "npu" Dynamo backend)

dynamo._install_lazy_torchair()
dynamo._register_backends()
