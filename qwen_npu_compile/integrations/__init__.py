"""Training integrations of the ``qwen_npu`` backend: they decide *where* a model is compiled.

* :mod:`.worker` -- :func:`~qwen_npu_compile.maybe_compile`: each decoder layer compiled in place,
  switched by ``QWEN_NPU_COMPILE`` (FSDP1/FSDP2, activation checkpointing, verl's monkey patches);
* :mod:`.verl` -- the hook that calls it inside an unmodified verl's FSDP engine;
* :mod:`.hf_trainer` -- :class:`~qwen_npu_compile.hf_trainer.QwenNpuCompileCallback` for a Hugging Face ``Trainer``.

Users import them by their stable paths ``qwen_npu_compile.worker``, ``qwen_npu_compile.verl``
(``VERL_USE_EXTERNAL_MODULES=qwen_npu_compile.verl``) and ``qwen_npu_compile.hf_trainer``. Each of those
modules puts the integration module in its own place in ``sys.modules``; Python's import binds
whatever ``sys.modules`` holds once a module has run (importlib ``_load_unlocked``), so both paths name
the same module object: import side effects (the verl hook) run once, and a monkeypatch through either
path is seen by both. Importing this package imports none of them.
"""
