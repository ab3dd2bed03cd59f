"""Stand-in of flash-linear-attention 0.5.2 (test infrastructure; see tests/stand_ins/README.md)."""

__version__ = "0.5.2"
