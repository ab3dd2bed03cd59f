"""Stand-ins for torchair's four CANN-linked extension modules, so its Python runs without an NPU.

torchair (``torch_npu/dynamo/torchair`` in the torch_npu wheel) is pure Python except
``torchair/core/{_torchair,_npu_graph_executor,_npu_utils,_abi_compat_ge_apis}.so``, which link
CANN (libge_runner, libgraph, libascendcl) and libtorch_npu. FX→GE conversion touches only a few of
their entry points (torch_npu 2.13.0):

- ``_torchair.InitializeGraphEngine(options)`` (``core/_backend.py: initialize_graph_engine``, called
  when a GE graph is created): recorded in :data:`GRAPH_ENGINE_OPTIONS`, nothing started.
- ``_torchair.TorchNpuGraphBase``: base class of the GE session wrapper ``core/_backend.TorchNpuGraph``;
  constructing it is fine, every method (load, compile, run, ...) raises :class:`CannRequiredError`.
- ``_torchair.check_cann_compat(optype, inputs, attrs)`` (``_ge_concrete_graph/compat_ir.py``): asks the
  installed CANN whether an op's optional inputs/attrs exist. The stand-in answers "compatible" (``""``):
  off-NPU the converter's own output is checked, not the CANN release it would meet.
- ``_torchair.get_registered_ir_def(op_type)``: CANN's op registry. The stand-in answers ``"ERROR"``
  (not registered), so an op without a torchair converter fails conversion instead of getting an
  auto-generated one (``fx2ge_converter.get_or_auto_gen_converter``).
- ``_torchair.TorchDataType``: enum read at import by ``llm_datadist/_tensor_utils.py``.
- ``_torchair.SetDebugLogPath``, ``FinalizeGraphEngine``: no-ops.

Every other attribute of the four modules is a callable that raises :class:`CannRequiredError` when
called, naming the entry point: a conversion that needs one is reported, not silently faked.
"""

from __future__ import annotations

import sys
import types

#: Names of the extension modules replaced, under the ``torchair.core`` package.
EXTENSION_MODULES: tuple[str, ...] = ("_torchair", "_npu_graph_executor", "_npu_utils", "_abi_compat_ge_apis")

#: Every ``options`` dict torchair passed to ``InitializeGraphEngine`` in this process.
GRAPH_ENGINE_OPTIONS: list[dict] = []


class CannRequiredError(RuntimeError):
    """A torchair entry point that needs CANN (an Ascend NPU host) was called off-NPU."""


def _needs_cann(qualified_name: str):
    def call(*args, **kwargs):
        raise CannRequiredError(
            f"{qualified_name} needs CANN (an Ascend NPU host); off-NPU only torchair's FX→GE conversion "
            "runs (torchair.core extension modules are stand-ins here)"
        )

    call.__qualname__ = call.__name__ = qualified_name.rsplit(".", 1)[-1]
    return call


class _ExtensionStandIn(types.ModuleType):
    """A stand-in module: defined entry points behave as documented above, others raise when called."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _needs_cann(f"{self.__name__}.{name}")


class _TorchDataType:
    """``_torchair.TorchDataType``: the enum values are only stored in dicts off-NPU."""

    def __getattr__(self, name: str) -> str:
        if name.startswith("__"):
            raise AttributeError(name)
        return name


def _torchair_module() -> types.ModuleType:
    module = _ExtensionStandIn("torchair.core._torchair")

    def InitializeGraphEngine(options):  # noqa: N802  (the C entry point's name)
        GRAPH_ENGINE_OPTIONS.append(dict(options))

    def FinalizeGraphEngine():  # noqa: N802
        return None

    def SetDebugLogPath(path):  # noqa: N802
        return None

    def check_cann_compat(optype, runtime_optional_inputs, runtime_optional_attrs):
        return ""

    def get_registered_ir_def(op_type):
        return ("ERROR", [], [], [])

    class TorchNpuGraphBase:
        """Base of ``torchair.core._backend.TorchNpuGraph``: constructible; load/compile/run need CANN."""

        def __init__(self, name: str = ""):
            self._name = name

        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return _needs_cann(f"torchair.core._torchair.TorchNpuGraphBase.{name}")

    # torchair's TorchNpuGraph calls these through super(), which never reaches __getattr__
    for method in ("load", "set_hint_shape", "compile", "auto_tune", "run", "summary"):
        setattr(TorchNpuGraphBase, method, _needs_cann(f"torchair.core._torchair.TorchNpuGraphBase.{method}"))

    for function in (InitializeGraphEngine, FinalizeGraphEngine, SetDebugLogPath, check_cann_compat,
                     get_registered_ir_def):
        setattr(module, function.__name__, function)
    module.TorchNpuGraphBase = TorchNpuGraphBase
    module.TorchDataType = _TorchDataType()
    return module


def install_stubs() -> None:
    """Put the stand-ins in ``sys.modules`` as ``torchair.core.<name>`` (idempotent).

    Must run before ``torchair`` is imported: ``torchair.core`` then imports them from
    ``sys.modules`` instead of loading the ``.so`` files (which are not extracted anyway).

    Raises:
        RuntimeError: a real (non-stand-in) extension module is already loaded, e.g. the real torchair
            of an installed torch_npu: mixing them would be silently wrong.
    """
    for name in EXTENSION_MODULES:
        qualified = f"torchair.core.{name}"
        present = sys.modules.get(qualified)
        if present is not None and not isinstance(present, _ExtensionStandIn):
            raise RuntimeError(f"{qualified} is already loaded from {getattr(present, '__file__', '?')}; "
                               "the off-NPU torchair cannot be used in a process that imported the real one")
        if present is None:
            sys.modules[qualified] = _torchair_module() if name == "_torchair" else _ExtensionStandIn(qualified)


