"""torchair GE converters this project supplies or corrects (registered before any torchair hand-off).

:func:`register_converters` is called by the torchair hand-off (real torchair on an Ascend host, or
the off-NPU conversion check) before torchair converts a graph. It is idempotent.
"""

from __future__ import annotations


def register_converters() -> None:
    """Register this project's GE converters with the imported torchair (idempotent)."""
