"""What the training integrations share. The integrations themselves decide *where* a model is compiled and live at
the paths users import: :mod:`qwen_npu_compile.worker` (:func:`~qwen_npu_compile.maybe_compile`: each decoder layer
compiled in place, switched by ``QWEN_NPU_COMPILE``), :mod:`qwen_npu_compile.verl` (the hook inside an unmodified
verl's FSDP engine, ``VERL_USE_EXTERNAL_MODULES=qwen_npu_compile.verl``) and :mod:`qwen_npu_compile.hf_trainer`
(the Hugging Face ``Trainer`` callback).

* :mod:`.torch_compiler` -- ``torch.compile`` with this backend, without looking ``torch.compile`` up (MindSpeed
  replaces it);
* :mod:`.fsdp1` -- FSDP1's flattened parameters, refused with one line naming the fix;
* :mod:`.verl_npu_patch` -- verl's ``npu_patch`` and this backend side by side.

Importing this package imports none of them.
"""
