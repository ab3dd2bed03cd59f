"""Stand-in of flash-linear-attention 0.5.2 or 0.6.0 (test infrastructure; see tests/stand_ins/README.md).

Which release it pretends to be is module-level: :data:`__version__` (0.5.2 unless the environment variable
``QWEN_NPU_FLA_STAND_IN`` names another of :data:`VERSIONS` at import), switched by :func:`pretend`, which also
rebinds ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (and ``chunk_gdn``) to that release's signature.
"""

from __future__ import annotations

import os
import sys

#: The releases the stand-in speaks (each one's entry signature read from its ``fla-core`` wheel).
VERSIONS = ("0.5.2", "0.6.0")

#: 0.5.2 by default: the oldest release the op's Ascend kernel binding supports (its minimum), and the one the
#: existing tests pin the stand-in's signature to; 0.6.0 by :func:`pretend` or ``QWEN_NPU_FLA_STAND_IN=0.6.0``.
__version__ = os.environ.get("QWEN_NPU_FLA_STAND_IN", "0.5.2")
if __version__ not in VERSIONS:
    raise ImportError(f"QWEN_NPU_FLA_STAND_IN={__version__!r}: the FLA stand-in speaks {', '.join(VERSIONS)}")


def pretend(version: str) -> str:
    """Pretend to be FLA ``version`` (one of :data:`VERSIONS`) from now on: sets :data:`__version__` and binds that
    release's ``chunk_gated_delta_rule`` in ``fla.ops.gated_delta_rule``. Returns the version it pretended before.
    Callers that hold the old entry (``from fla.ops.gated_delta_rule import chunk_gated_delta_rule``) keep it."""
    global __version__
    if version not in VERSIONS:
        raise ValueError(f"the FLA stand-in speaks {', '.join(VERSIONS)}, not {version!r}")
    before, __version__ = __version__, version
    entry = sys.modules.get(f"{__name__}.ops.gated_delta_rule")
    if entry is not None:
        entry.bind(version)
    return before
