"""What one ``check`` run is asked to do: :class:`CheckSpec`, the parsed ``check`` arguments as typed fields,
and the refusals that need nothing but those fields (no torch, no model config).

The command line builds it from argparse's ``Namespace`` (:meth:`CheckSpec.from_args`); the harness
(:func:`qwen_npu_compile.cli.check.harness.run_check`) takes either.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class CheckSpec:
    """One ``check`` run. Field names and defaults are the ``check`` flags' (``--seq-len`` is ``seq_len``).

    Attributes:
        model: a preset name or a local model folder (``config.json``, optional weights).
        layers: decoder layers to build; None builds all of them.
        batch: sequences per step (B).
        seq_len: tokens per sequence (S).
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``: the parameters' dtype, or autocast's with ``autocast``.
        mode: ``"train"`` (forward and the LM loss's backward) or ``"infer"`` (forward only).
        attn: transformers' ``attn_implementation``: ``"sdpa"`` or ``"eager"``.
        fusions: the backend's ``fusions`` option (comma-separated families, ``"all"``, ``"none"``), or None for
            the backend's default (``QWEN_NPU_FUSIONS``, else all).
        downstream: the backend's ``downstream`` option, or None for its default.
        dynamic: mark the sequence length dynamic (``torch._dynamo.mark_dynamic`` on dim 1 of the inputs).
        left_padding: leading pad tokens of row 0 (0: no ``attention_mask``).
        autocast: fp32 weights under ``torch.autocast`` to ``dtype``, as HF Trainer's ``bf16=True``.
        grad_checkpointing: HF gradient checkpointing (``use_reentrant=False``), train only.
        vocab_size: replaces the model's ``vocab_size`` (random weights only), or None.
        dump_dir: the backend's ``dump_dir`` option, or None.
    """

    model: str
    layers: int | None = None
    batch: int = 1
    seq_len: int = 64
    dtype: str = "bf16"
    mode: str = "train"
    attn: str = "sdpa"
    fusions: str | None = None
    downstream: str | None = None
    dynamic: bool = False
    left_padding: int = 0
    autocast: bool = False
    grad_checkpointing: bool = False
    vocab_size: int | None = None
    dump_dir: Path | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CheckSpec:
        """The spec of parsed ``check`` arguments; flags a ``Namespace`` lacks take their defaults."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in vars(args).items() if name in names})

    @property
    def train(self) -> bool:
        return self.mode == "train"

    @property
    def half(self) -> bool:
        """Half precision (bf16/fp16): parity is judged against an fp32 reference run."""
        return self.dtype != "fp32"

    def backend_options(self) -> dict:
        """The ``options`` of ``torch.compile(backend="qwen_npu")``: only the settings given (the rest come from
        ``QWEN_NPU_*`` variables or the defaults)."""
        options = {"fusions": self.fusions, "downstream": self.downstream,
                   "dump_dir": str(self.dump_dir) if self.dump_dir is not None else None}
        return {key: value for key, value in options.items() if value is not None}

    def problem(self) -> str | None:
        """Why these settings cannot run together, in one line naming the flag to change; None when they can."""
        if self.autocast and not self.half:
            return "--autocast needs --dtype bf16 or fp16 (the autocast dtype; the weights stay fp32)"
        if self.grad_checkpointing and not self.train:
            return "--grad-checkpointing needs --mode train"
        if not 0 <= self.left_padding < self.seq_len:
            return f"--left-padding must be >= 0 and below --seq-len {self.seq_len}, got {self.left_padding}"
        if self.train and self.seq_len < 2:
            return (f"--mode train needs --seq-len >= 2, got {self.seq_len}: the LM loss predicts each token from "
                    "the ones before it, so 1 token leaves no target (use --mode infer for a forward-only check)")
        if self.train and self.batch == 1 and self.left_padding >= self.seq_len - 1:  # only row 0 is padded
            return (f"--left-padding {self.left_padding} leaves no token with a target in any row (--seq-len "
                    f"{self.seq_len}, --batch {self.batch}): the LM loss is undefined; pad less or add tokens")
        if self.dynamic and self.seq_len < 2:
            return "--dynamic needs --seq-len >= 2 (Dynamo specialises sizes 0 and 1)"
        return None
