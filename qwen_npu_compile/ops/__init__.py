"""The fused Ascend ops this project emits, in two kinds: torch_npu's ops (:mod:`.torch_npu`: the real ones on an
Ascend host, simulated stand-ins elsewhere) and this project's own ``qwen_npu::`` ops built on them
(:mod:`.qwen_npu`, each with its GE converter). Shared: :mod:`.define` (``torch.library`` registration),
:mod:`.limits` (each op's limits by name, for the graph audits), :mod:`.scalars`, :mod:`.attention_contract`,
:mod:`.ge` (torchair's converter API, imported lazily).

Every rewrite emits ``torch.ops.npu.<op>.default`` (never ``torch_npu.<op>``: ``import torch_npu.onnx``
rebinds those names; see ``docs/npu-op-contracts.md``). On an Ascend host those ops come
from torch_npu. Everywhere else :func:`ensure_npu_ops` registers stand-ins in the same ``npu``
namespace with the exact torch_npu 2.13.0 schemas, a CPU reference kernel that follows the documented
semantics, a fake (meta) kernel and autograd that calls the backward op, so that graphs, counts and
numerics can be checked on a CPU. Reports then say ``simulated``.

The stand-ins are never registered when the real torch_npu imports.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging

import torch

log = logging.getLogger(__name__)

#: Ops this project emits, with their backward ops (torch_npu 2.13.0 names).
EMITTED_OPS = (
    "npu_rms_norm",
    "npu_rms_norm_backward",
    "npu_add_rms_norm",  # no backward op: inference graphs only
    "npu_swiglu",
    "npu_swiglu_backward",
    "npu_rotary_mul",
    "npu_rotary_mul_backward",
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
    "npu_grouped_matmul",  # no backward op: qwen_npu::grouped_matmul's backward is npu_grouped_matmul again
)


@dataclasses.dataclass(frozen=True)
class NpuOpsStatus:
    """Where the ``torch.ops.npu`` ops come from in this process.

    Attributes:
        simulated: True when the stand-ins of this package are in use (no usable torch_npu).
        reason: why (e.g. "torch_npu is not installed", or the ImportError text).
        torch_npu_version: the real torch_npu version, or None when simulated.
    """

    simulated: bool
    reason: str
    torch_npu_version: str | None = None

    @property
    def kind(self) -> str:
        """``"simulated"`` or ``"real"``, as written in every report."""
        return "simulated" if self.simulated else "real"


def _try_import_torch_npu() -> tuple[object | None, str]:
    if importlib.util.find_spec("torch_npu") is None:
        return None, "torch_npu is not installed"
    try:
        module = importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError: libhccl.so, RuntimeError: two accelerators, ...
        return None, f"import torch_npu failed: {type(exc).__name__}: {exc}"
    return module, "torch_npu imported"


#: The ``npu`` library holding the simulated stand-ins once registered (kept alive for the process).
_SIMULATED_LIBRARY: torch.library.Library | None = None


@functools.cache
def ensure_npu_ops() -> NpuOpsStatus:
    """Make every op in :data:`EMITTED_OPS` callable as ``torch.ops.npu.<name>.default``.

    Imports torch_npu when it can (only here, lazily: importing this package never imports it).
    When it cannot, registers the simulated stand-ins once per process.

    Returns:
        NpuOpsStatus: whether the ops are real or simulated, and why.

    Raises:
        RuntimeError: torch_npu failed to import but some ``npu`` ops exist anyway (a half-initialised
            torch_npu); mixing real and simulated ops would be silently wrong.
    """
    module, reason = _try_import_torch_npu()
    if module is not None:
        missing = [name for name in EMITTED_OPS if not hasattr(torch.ops.npu, name)]
        if missing:
            log.warning("torch_npu %s lacks %s; those fusions will fail to emit", module.__version__, missing)
        return NpuOpsStatus(False, reason, getattr(module, "__version__", "unknown"))

    present = [name for name in EMITTED_OPS if _op_exists(name)]
    if present:
        raise RuntimeError(
            f"torch_npu could not be imported ({reason}) but the ops {present} already exist in the "
            "'npu' namespace. Fix the torch_npu installation (source the CANN set_env.sh) or run in a "
            "process where torch_npu is not half-imported."
        )
    from qwen_npu_compile.ops import simulated

    global _SIMULATED_LIBRARY
    _SIMULATED_LIBRARY = simulated.register()

    log.info("qwen_npu: using simulated npu ops (%s)", reason)
    return NpuOpsStatus(True, reason, None)


def _op_exists(name: str) -> bool:
    return hasattr(torch.ops.npu, name)
