"""``torch_npu.dynamo`` of the simulated Ascend host: the lazy ``torchair`` module and the ``npu`` Dynamo backend.

As torch_npu 2.13.0's ``torch_npu/dynamo/__init__.py`` (``_install_lazy_torchair``): ``import torch_npu`` puts a
:class:`_LazyTorchair` proxy in ``sys.modules["torchair"]``; the first attribute read imports torchair and the
proxy forwards to it from then on. Here torchair is the wheel's own Python (the torch_npu 2.13.0 wheel, obtained
and verified by ``qwen_npu_compile.torchair.offline.wheel``: ``$QWEN_NPU_TORCH_NPU_WHEEL`` or the cache) with its
four CANN extension modules replaced by the project's stand-ins (``torchair_offline.stubs``): FX→GE conversion
runs as on a host; loading/running a GE graph raises ``CannRequiredError`` (what cannot run without an NPU).
"""

from __future__ import annotations

import atexit
import importlib
import importlib.machinery
import importlib.util
import signal
import sys
import threading
import warnings

import torch

NPUGRAPH_EX_BACKEND = "npugraph_ex"


def _import_wheel_torchair():
    """Import the wheel's torchair as the top-level package ``torchair`` (CANN modules stubbed)."""
    from qwen_npu_compile.torchair.offline.stubs import install_stubs

    from .._wheel import sources

    sources = sources()
    install_stubs()
    spec = importlib.machinery.PathFinder.find_spec("torchair", [str(sources.import_root)])
    if spec is None or spec.loader is None:
        raise ImportError(f"no torchair package under {sources.import_root}")
    on_main = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if on_main else {}
    module = importlib.util.module_from_spec(spec)
    proxy = sys.modules.get("torchair")
    sys.modules["torchair"] = module  # torchair's own `from torchair.x import ...` while it loads
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spec.loader.exec_module(module)
            importlib.import_module("torchair._ge_concrete_graph.ge_converter.custom")
    finally:
        if proxy is not None:
            sys.modules["torchair"] = proxy
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    backend = sys.modules.get("torchair.core._backend")
    if backend is not None and hasattr(backend, "finalize_graph_engine"):
        atexit.unregister(backend.finalize_graph_engine)
    module.__simulated_host_sources__ = sources
    return module


class _LazyTorchair:
    """torch_npu's ``_LazyTorchair``: ``__spec__``/``__path__`` (and any attribute) import torchair on first use."""

    def __init__(self, pkg_name: str):
        self._torchair = None
        self._pkg_name = pkg_name
        self._exception = None

    def __getattr__(self, name):
        if name.startswith("_") and name not in ("__spec__", "__path__", "__file__", "__version__") and \
                self._torchair is None and name.startswith("__"):
            raise AttributeError(name)
        if self._exception is not None:
            raise self._exception
        if self._torchair is None:
            try:
                self._torchair = _import_wheel_torchair()
            except Exception as exc:  # torch_npu records the error and replays it on every later use
                self._exception = exc
                raise
        return getattr(self._torchair, name)


def _install_lazy_torchair() -> bool:
    if "torchair" not in sys.modules:
        sys.modules["torchair"] = _LazyTorchair("torchair")
    return True


def _npu_backend(gm, example_inputs, **kwargs):
    import torchair

    return torchair.get_npu_backend()(gm, example_inputs)


def _register_backends() -> None:
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "npu" not in _COMPILER_FNS:
        register_backend(_npu_backend, "npu")
