"""``torch.npu`` (and ``torch_npu.npu``) of the simulated Ascend host: one device, ``npu:0``, CPU memory.

The functions transformers, accelerate and verl call on an Ascend host (torch_npu 2.13.0 names). Streams and
events exist and do nothing (the device computes synchronously); random numbers come from the CPU generator
(the simulated kernels run on the CPU).
"""

from __future__ import annotations

import contextlib
import types
from collections import namedtuple

import torch

from .. import _C

#: what ``get_device_name`` answers: an Atlas A2 training card (verl reads A2/A3 from it)
DEVICE_NAME = "Ascend910B2"
#: the simulated card's memory (an Atlas 800T A2: 64 GB HBM)
TOTAL_MEMORY = 64 * 1024**3

_DeviceProperties = namedtuple("_DeviceProperties", "name total_memory major minor multi_processor_count type")


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def init() -> None:
    return None


def device_count() -> int:
    return 1


def current_device() -> int:
    return _C.current_device()


def _index(device) -> int:
    if device is None:
        return current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "npu":
            raise ValueError(f"Expected a npu device, but got: {device}")
        return 0 if device.index is None else device.index
    return int(device)


def set_device(device) -> None:
    _C.set_device(_index(device))


class device:  # noqa: N801  (torch.cuda.device's name)
    """Context manager that selects a device (only ``npu:0`` exists)."""

    def __init__(self, device):
        self.idx = _index(device)

    def __enter__(self):
        self.prev = current_device()
        set_device(self.idx)

    def __exit__(self, *exc):
        set_device(self.prev)
        return False


def synchronize(device=None) -> None:
    return None


def get_device_name(device=None) -> str:
    _index(device)
    return DEVICE_NAME


def get_device_properties(device=None):
    _index(device)
    return _DeviceProperties(DEVICE_NAME, TOTAL_MEMORY, 0, 0, 24, "npu")


def get_device_capability(device=None):
    return None  # torch_npu answers None


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


# ---- memory (bytes of live npu tensors; no caching allocator) ----
def memory_allocated(device=None) -> int:
    return _C.memory_allocated()


def max_memory_allocated(device=None) -> int:
    return _C.max_memory_allocated()


def memory_reserved(device=None) -> int:
    return _C.memory_allocated()


def max_memory_reserved(device=None) -> int:
    return _C.max_memory_allocated()


def reset_peak_memory_stats(device=None) -> None:
    _C.reset_peak_memory_stats()


def reset_max_memory_allocated(device=None) -> None:
    _C.reset_peak_memory_stats()


def mem_get_info(device=None):
    return TOTAL_MEMORY - memory_allocated(), TOTAL_MEMORY


def memory_stats(device=None) -> dict:
    return {"allocated_bytes.all.current": memory_allocated(), "allocated_bytes.all.peak": max_memory_allocated(),
            "reserved_bytes.all.current": memory_reserved(), "reserved_bytes.all.peak": max_memory_reserved()}


def empty_cache() -> None:
    return None


def _submodule(name: str, *functions) -> types.ModuleType:
    """``torch.npu.<name>`` holding ``functions`` (torch_npu's ``torch.npu.memory`` and ``torch.npu.random`` hold
    the same functions as ``torch.npu``)."""
    module = types.ModuleType(f"{__name__}.{name}")
    for function in functions:
        setattr(module, function.__name__, function)
    return module


memory = _submodule("memory", memory_allocated, max_memory_allocated, memory_reserved, max_memory_reserved,
                    reset_peak_memory_stats, empty_cache, mem_get_info, memory_stats)


# ---- random numbers: the kernels run on the CPU, so the CPU generator is the device's ----
def manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))  # not torch.manual_seed: that calls this module back


def manual_seed_all(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def seed() -> None:
    torch.default_generator.seed()


def seed_all() -> None:
    torch.default_generator.seed()


def initial_seed() -> int:
    return torch.initial_seed()


def get_rng_state(device="npu"):
    return torch.default_generator.get_state()


def set_rng_state(new_state, device="npu") -> None:
    torch.default_generator.set_state(new_state)


def get_rng_state_all():
    return [get_rng_state()]


def set_rng_state_all(new_states) -> None:
    set_rng_state(new_states[0])


random = _submodule("random", manual_seed, manual_seed_all, get_rng_state, set_rng_state, get_rng_state_all,
                    set_rng_state_all, initial_seed, seed)


# ---- streams and events: synchronous device ----
class Stream:
    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = torch.device("npu", _index(device))

    def synchronize(self) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None):
        return event or Event()

    def query(self) -> bool:
        return True


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        pass

    def record(self, stream=None) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event) -> float:
        return 0.0


_DEFAULT_STREAM = Stream()


def current_stream(device=None) -> Stream:
    return _DEFAULT_STREAM


def default_stream(device=None) -> Stream:
    return _DEFAULT_STREAM


def set_stream(stream) -> None:
    return None


@contextlib.contextmanager
def stream(stream=None):
    yield


def is_current_stream_capturing() -> bool:
    """The simulated card never captures a stream (no ACL graphs); never in a bad fork, initialised at import."""
    return False


_is_in_bad_fork = is_current_stream_capturing
_lazy_init = init


# ---- autocast, as torch.npu.amp ----
class _Amp:
    @staticmethod
    def autocast(enabled: bool = True, dtype=torch.float16, cache_enabled: bool = True):
        return torch.autocast("npu", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


amp = _Amp()


def get_amp_supported_dtype():
    return [torch.float16, torch.bfloat16, torch.float32]


def is_autocast_enabled() -> bool:
    return torch.is_autocast_enabled("npu")


def set_autocast_enabled(enabled: bool) -> None:
    torch.set_autocast_enabled("npu", enabled)


def get_autocast_dtype():
    return torch.get_autocast_dtype("npu")


def set_autocast_dtype(dtype) -> None:
    torch.set_autocast_dtype("npu", dtype)


def _get_deterministic_level() -> int:
    """torch_npu's deterministic level (torchair guards on it and passes it to GE): 1 under
    ``torch.use_deterministic_algorithms(True)``, else 0."""
    return 1 if torch.are_deterministic_algorithms_enabled() else 0


class _Hf32Flag:
    """``torch.npu.matmul`` / ``torch.npu.conv``: whether HF32 may stand in for fp32 (torch_npu defaults: matmul
    False, conv True); torchair passes them to GE."""

    def __init__(self, allow_hf32: bool):
        self.allow_hf32 = allow_hf32


matmul = _Hf32Flag(False)
conv = _Hf32Flag(True)


def get_device_limit(device=None) -> dict:
    """Core counts of an Atlas A2 (Ascend910B2: 24 AI cores, 48 vector cores)."""
    return {"cube_core_num": 24, "vector_core_num": 48}


from . import utils  # noqa: E402,F401
