"""Stand-in of FSDP-Turbo, as far as verl 0.9.1's ``fsdp_turbo`` strategy uses it (test infrastructure only).

verl 0.9.1's ``verl/workers/engine/fsdp/fsdp_turbo_impl.py`` (``FSDPTurboEngineWithLMHead``) reaches FSDP-Turbo
through exactly these names, all modelled here:

* ``fsdp_turbo.fsdp_turbo_config``: ``FSDPTurboConfig`` and ``_dict_to_dataclass(FSDPTurboConfig, turbo_config)``
  (the engine config's ``turbo_config`` dict); verl then sets ``config.distributed.fsdp_plan.cpu_offload``.
* ``fsdp_turbo.distributed.parallel_state``: ``init_parallel_state(config)``, ``get_parallel_state()`` and, on
  that object, ``is_group_enable("ulysses")``, ``get_ulysses_group_size()``, ``get_ulysses_group()``,
  ``get_ulysses_rank()``, ``get_data_rank()``, ``get_data_group_size()``, ``get_data_group()``.
* ``fsdp_turbo.fsdp_turbo.FSDPTurbo(config, module).model``: the wrapped model, into which verl then loads the
  full state dict it took before (``fsdp2_load_full_state_dict``): names and keys must not change.
* ``fsdp_turbo.training.clip_grads.clip_grad_norm(model=..., max_norm=...)``: the gradient norm before clipping.

FSDP-Turbo itself is not on PyPI; what it does inside ``FSDPTurbo`` beyond sharding is not visible from verl
(verl's comment: "FSDP-Turbo's post-fusion model patch"). This stand-in models that as ``module_patches``: a
mapping of dotted paths (``"transformers.models.qwen2.modeling_qwen2.Qwen2MLP.forward"``) to dotted paths of
replacement functions, set on their owners before sharding, as a monkey patch would (process-wide, until
:func:`fsdp_turbo.fsdp_turbo.undo_module_patches`). Then every decoder layer (``model._no_split_modules``) and
the root are sharded with torch's FSDP2 ``fully_shard`` on one mesh over all ranks (gloo on a CPU), with the
``fsdp_plan`` dtypes as its ``MixedPrecisionPolicy``. Context parallelism (``ulysses_parallel_size`` > 1),
tensor and expert parallelism are not modelled (refused).
"""
