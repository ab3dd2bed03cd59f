"""Switch ``qwen_npu`` on in a Hugging Face ``Trainer``: one callback, switched by ``QWEN_NPU_COMPILE``.

``TrainingArguments(torch_compile=True, torch_compile_backend="qwen_npu")`` does not work:
``Trainer.__init__`` hands the backend name to Accelerate's ``TorchDynamoPlugin``, whose
``__post_init__`` converts it to its ``DynamoBackend`` enum (accelerate/utils/dataclasses.py,
accelerate 1.15.0) and raises ``ValueError: 'QWEN_NPU' is not a valid DynamoBackend``. Instead, add the callback::

    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=...,
                      callbacks=[QwenNpuCompileCallback()])      # QWEN_NPU_COMPILE=1 switches it on

When training begins (``on_train_begin``: after the Trainer has enabled activation checkpointing and
wrapped the model, before the first step) it calls :func:`qwen_npu_compile.maybe_compile` on the
Trainer's model: each decoder layer is compiled in place with the ``qwen_npu`` backend (activation
checkpointing, DDP and FSDP2 handled as in verl's workers). With ``QWEN_NPU_COMPILE`` unset or off it
does nothing. Calling ``maybe_compile(model)`` yourself before creating the Trainer does the same,
except for models the Trainer builds itself (``model_init``, or a model name given to TRL trainers).

This module imports ``transformers.TrainerCallback``; ``import qwen_npu_compile`` does not import it.
"""

from __future__ import annotations

from collections.abc import Mapping

from transformers import TrainerCallback

from qwen_npu_compile.config import ENV_COMPILE
from qwen_npu_compile.worker import CompiledLayers, compile_requested, maybe_compile


class QwenNpuCompileCallback(TrainerCallback):
    """Compile the Trainer's model per decoder layer with ``qwen_npu`` when training begins.

    Args:
        options: backend options (``fusions``, ``dump_dir``, ``downstream``, ``strict``), checked at once;
            unset ones come from the ``QWEN_NPU_*`` environment variables.
        environ: where to read ``QWEN_NPU_COMPILE`` (default ``os.environ``, read when training begins).

    Attributes:
        compiled: what :func:`~qwen_npu_compile.maybe_compile` compiled at the last ``on_train_begin``
            (layer names, plus per-layer records and reports; empty when switched off).

    Raises (from ``Trainer.train``):
        ValueError: ``QWEN_NPU_COMPILE=1`` together with ``TrainingArguments(torch_compile=True)``
            (whole-model compile on top of per-layer compile); anything :func:`maybe_compile` raises
            (a bad ``QWEN_NPU_COMPILE`` value or options, FSDP1 with ``use_orig_params=False``).
    """

    def __init__(self, options: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None):
        from qwen_npu_compile.config import QwenNpuConfig

        QwenNpuConfig.from_options(options)  # a bad option fails where the callback is made
        self.options = dict(options) if options else None
        self.environ = environ
        self.compiled = CompiledLayers()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not compile_requested(self.environ):
            return
        if getattr(args, "torch_compile", False):
            raise ValueError(
                f"qwen_npu: {ENV_COMPILE}=1 compiles each decoder layer with qwen_npu; the Trainer would also "
                f"compile the whole model (TrainingArguments torch_compile=True, backend "
                f"{getattr(args, 'torch_compile_backend', None)!r}). Leave torch_compile, torch_compile_backend and "
                f"torch_compile_mode unset, or unset {ENV_COMPILE}"
            )
        if model is None:
            raise ValueError("qwen_npu: QwenNpuCompileCallback got no model from the Trainer at on_train_begin")
        self.compiled = maybe_compile(model, self.options, environ=self.environ)
