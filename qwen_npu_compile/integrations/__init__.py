"""Training integrations of the ``qwen_npu`` backend: they decide *where* a model is compiled.

* :mod:`.worker` -- :func:`~qwen_npu_compile.maybe_compile`: each decoder layer compiled in place,
  switched by ``QWEN_NPU_COMPILE`` (FSDP1/FSDP2, activation checkpointing, verl's monkey patches);
* :mod:`.verl` -- the hook that calls it inside an unmodified verl's FSDP engine;
* :mod:`.hf_trainer` -- :class:`~qwen_npu_compile.hf_trainer.QwenNpuCompileCallback` for a Hugging Face ``Trainer``.

Users import them by their stable paths ``qwen_npu_compile.worker``, ``qwen_npu_compile.verl``
(``VERL_USE_EXTERNAL_MODULES=qwen_npu_compile.verl``) and ``qwen_npu_compile.hf_trainer``: those are
aliases of these modules (the same module objects). Importing this package imports none of them.
"""
