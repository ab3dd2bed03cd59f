"""Run torchair's own FX→GE conversion on a host without an Ascend NPU.

torchair's Python ships in the torch_npu wheel. Off-NPU, :func:`load_offline_torchair` obtains the
wheel that pairs with the installed torch (:mod:`.wheel`: download into a cache, verify, extract,
never install), replaces its four CANN-linked extension modules with stand-ins (:mod:`.stubs`),
imports it (:mod:`.importer`), registers this project's GE converters
(:func:`qwen_npu_compile.torchair.converters.register_converters`) and installs the conversion recorder
(:mod:`.convert`). The ``torchair`` downstream then runs torchair's real AOTAutograd, decompositions
and per-op GE converters on the rewritten graphs, builds the GE graphs, and (``debug.run_eagerly``)
runs the FX graphs with the simulated npu ops.

What this verifies: that every node converts with the converters of the torch_npu version named,
and which GE ops result. What it cannot: GE compilation (shape/format inference, op selection),
the kernels, numerics on the NPU, speed. Importing torchair also applies its process-wide patches
(meta kernels and decompositions of a few aten ops, the ones it applies on an NPU), so run the check
in a process of its own, as ``qwen-npu-compile check`` does.
"""

from __future__ import annotations

import functools
import sys

import torch

from qwen_npu_compile.torchair.offline.convert import GeFailure, GeGraph, GeResults, install_recording, watch
from qwen_npu_compile.torchair.offline.importer import OfflineTorchair, import_torchair
from qwen_npu_compile.torchair.offline.stubs import CannRequiredError
from qwen_npu_compile.torchair.offline.wheel import (
    ENV_CACHE,
    ENV_WHEEL,
    TorchairSources,
    TorchairUnavailableError,
    obtain_sources,
)

__all__ = [
    "ENV_CACHE",
    "ENV_WHEEL",
    "CannRequiredError",
    "GeFailure",
    "GeGraph",
    "GeResults",
    "OfflineTorchair",
    "TorchairSources",
    "TorchairUnavailableError",
    "install_recording",
    "load_offline_torchair",
    "loaded_offline_torchair",
    "watch",
]


@functools.cache
def load_offline_torchair() -> OfflineTorchair:
    """Obtain, import and prepare torchair for off-NPU conversion (once per process).

    Returns:
        the imported torchair, with the recorder installed and this project's converters registered.

    Raises:
        TorchairUnavailableError: no wheel could be obtained (no network and none cached/named) or it
            failed verification; the message says how to provide one.
        TorchairUnavailableError: also when another torchair is already imported, protobuf is missing, or
            the import failed.
    """
    sources = obtain_sources(torch.__version__)
    offline = import_torchair(sources)
    install_recording(sys.modules["torchair._ge_concrete_graph.fx2ge_converter"])
    from qwen_npu_compile.torchair.converters import register_converters

    register_converters()
    return offline


def loaded_offline_torchair() -> OfflineTorchair | None:
    """The off-NPU torchair if :func:`load_offline_torchair` already succeeded in this process."""
    return load_offline_torchair() if load_offline_torchair.cache_info().currsize else None
