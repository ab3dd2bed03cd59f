"""Import torchair from extracted wheel sources, with stand-ins for its extension modules.

The extracted ``torchair/`` is loaded as the top-level package ``torchair`` (its own imports say
``from torchair...``) through ``importlib`` without touching ``sys.path``. The project's npu ops are
registered first: torchair's converters for them (``ge_converter/custom/*.py``) are registered at
import by ``torch.ops.npu.<op>`` lookups. Import side effects of ``torchair.core._backend`` that only
make sense with CANN are undone: its SIGINT/SIGTERM handlers (they finalise the graph engine and then
ignore the signal) and its ``atexit`` finaliser.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import logging
import signal
import sys
import threading
import time
import types
import warnings

from qwen_npu_compile.torchair.offline.stubs import install_stubs
from qwen_npu_compile.torchair.offline.wheel import TorchairSources, TorchairUnavailableError

log = logging.getLogger("qwen_npu_compile")

#: Attribute set on the imported package to tell the off-NPU copy from a real torchair.
OFFLINE_MARK = "__qwen_npu_offline_sources__"


@dataclasses.dataclass(frozen=True)
class OfflineTorchair:
    """The imported off-NPU torchair.

    Attributes:
        module: the ``torchair`` package.
        sources: where it came from (torch_npu version, wheel, extracted files).
        import_seconds: wall time of the import (0.0 when it was already imported).
    """

    module: types.ModuleType
    sources: TorchairSources
    import_seconds: float

    @property
    def torch_npu_version(self) -> str:
        return self.sources.torch_npu_version


#: What to install when protobuf is missing (the pin of the project's requirements.txt).
PROTOBUF_HINT = "pip install 'qwen_npu_compile[torchair-offline]' (or pip install 'protobuf>=3.13'; requirements.txt pins the tested version)"


def missing_protobuf() -> str | None:
    """Why protobuf cannot be imported (torchair builds GE graphs with it), or None when it can.

    ``importlib.util.find_spec("google.protobuf")`` imports the parent package ``google`` first and
    raises ``ModuleNotFoundError`` when no ``google`` package is installed at all (a plain
    ``pip install -e .``), so both a missing parent and a missing ``protobuf`` are answered here.

    Returns:
        A one-line message naming what to install, or None.
    """
    try:
        found = importlib.util.find_spec("google.protobuf") is not None
    except (ImportError, ValueError):  # no `google` package at all; or google.__spec__ is None
        found = False
    if found:
        return None
    return f"torchair needs protobuf (>=3.13) to build GE graphs, and it is not installed: {PROTOBUF_HINT}"


def import_torchair(sources: TorchairSources) -> OfflineTorchair:
    """Import ``torchair`` from ``sources`` once per process (later calls return the same module).

    Raises:
        TorchairUnavailableError: another ``torchair`` (e.g. a real one, or one from another wheel) is already
            imported; protobuf is missing; or torchair's import failed (the cause is chained).
    """
    present = sys.modules.get("torchair")
    if present is not None:
        loaded_from = getattr(present, OFFLINE_MARK, None)
        if loaded_from is None or loaded_from.wheel != sources.wheel:
            where = getattr(loaded_from, "wheel", None) or getattr(present, "__file__", "?")
            raise TorchairUnavailableError(f"a torchair from {where} is already imported in this process; the off-NPU check "
                               f"cannot load the one of {sources.wheel} beside it (use a fresh process)")
        return OfflineTorchair(present, loaded_from, 0.0)
    missing = missing_protobuf()
    if missing is not None:
        raise TorchairUnavailableError(missing)

    from qwen_npu_compile.ops import ensure_npu_ops

    ensure_npu_ops()
    install_stubs()
    spec = importlib.machinery.PathFinder.find_spec("torchair", [str(sources.import_root)])
    if spec is None or spec.loader is None:
        raise TorchairUnavailableError(f"no torchair package under {sources.import_root}; delete that folder to extract it again")
    on_main_thread = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if on_main_thread else {}
    start = time.perf_counter()
    module = importlib.util.module_from_spec(spec)
    sys.modules["torchair"] = module
    try:
        # torchair warns for each converter module whose op this torch lacks ("Failed to import ...");
        # keep them out of the user's output, at debug level.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            spec.loader.exec_module(module)
            # Load the converters of torch_npu's own ops now, not at the first converter lookup that
            # misses (fx2ge_converter._get_converter): a later import would re-register torchair's
            # converters over the ones this project registers (torchair.converters.register_converters).
            importlib.import_module("torchair._ge_concrete_graph.ge_converter.custom")
        for warning in caught:
            log.debug("torchair import: %s", warning.message)
    except BaseException as exc:
        for name in [name for name in sys.modules if name == "torchair" or name.startswith("torchair.")]:
            if not name.startswith("torchair.core._") or name.rsplit(".", 1)[-1] in ("_backend", "_concrete_graph"):
                sys.modules.pop(name, None)
        raise TorchairUnavailableError(f"importing torchair from {sources.import_root} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    backend = sys.modules.get("torchair.core._backend")
    if backend is not None and hasattr(backend, "finalize_graph_engine"):
        atexit.unregister(backend.finalize_graph_engine)
    setattr(module, OFFLINE_MARK, sources)
    from qwen_npu_compile.report import note_offline_torchair

    note_offline_torchair(sources.torch_npu_version)
    return OfflineTorchair(module, sources, time.perf_counter() - start)
