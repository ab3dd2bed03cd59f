"""verl 0.9.1's FSDP engine on the simulated Ascend host, taking its own NPU branches.

Run by test_verl_npu_patch_on_npu.py in a fresh interpreter (``VERL_USE_EXTERNAL_MODULES`` is read by ``import verl``;
verl's npu_patch patches transformers for the whole process)::

    PYTHONPATH=tests/ascend_host/stand_in:. VERL_USE_EXTERNAL_MODULES=qwen_npu_compile.verl [QWEN_NPU_COMPILE=1] \\
        python tests/ascend_host/verl_npu_engine_run.py OUT.json

Nothing of verl is patched or re-implemented: ``import torch_npu`` is the stand-in, so verl's
``is_npu_available`` is true by itself, its platform is the NPU one (device ``npu``), and
``FSDPEngineWithLMHead.__init__`` runs ``apply_npu_fsdp_patches`` itself (verl's real ``npu_patch`` on the
stand-in's ``torch_npu`` functions). The process group is verl's own ``initialize_global_process_group_ray``
(``cpu:gloo,npu:hccl``, world size 1: the stand-in's one-rank ``hccl`` for npu tensors, as torch_npu registers
``hccl``; gloo takes CPU and CUDA tensors only). Per model (tiny Qwen2, Qwen3-MoE, Qwen3.5 saved with
``save_pretrained``; verl's default ``flash_attention_2``, which transformers resolves to its NPU functions by
itself here) and per input kind (``packed``: ``use_remove_padding``, verl's default; ``padded``), verl's whole
engine (as tests/drivers/verl_engine_run.py drives it on a CPU):

1. ``engine.initialize()`` -- verl's model build, our hook's compile in ``_build_fsdp_module``, FSDP2's
   ``fully_shard`` (moving the CPU-built parameters to ``npu`` with ``param.data = ...``: the stand-in allows it
   as torch_npu does, with its ``_has_compatible_shallow_copy_type`` kernel), ``fsdp2_load_full_state_dict``
   (a broadcast through the process group), optimizer and scheduler;
2. one step as ``BaseEngine.train_batch`` runs it: ``optimizer_zero_grad``, ``forward_backward_batch`` (4
   sequences, 2 micro-batches, verl's ``sft_loss``), gradients read, ``optimizer_step``.

``OUT.json``: per model and input kind, the loss, gradient norms, the parameters' devices and verl's FSDP2
module class, per-layer (per-graph) fusions / already-fused ops / fallbacks; the process group's backend and the
hook's INFO line about verl's npu_patch.

The stand-in lacks ``torch_npu.npu.mstx`` and ``torch_npu.profiler``, which verl's profiler module imports at
import time (used only when profiling is on); empty modules stand in for them here.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import tempfile
import types
from pathlib import Path

import torch
import torch_npu  # noqa: F401  (the stand-in: PrivateUse1 is npu)

for _owner, _name in ((torch_npu.npu, "mstx"), (torch_npu, "profiler")):
    if not hasattr(_owner, _name):
        _module = types.ModuleType(f"{_owner.__name__}.{_name}")
        setattr(_owner, _name, _module)
        sys.modules[_module.__name__] = _module

import verl  # noqa: E402  (imports VERL_USE_EXTERNAL_MODULES)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root: tests.helpers
LENGTHS = (13, 29, 6, 16)


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def save(family: str, folder: str) -> None:
    from qwen_npu_compile.cli.check.models import tiny_qwen2
    from tests.helpers.models import tiny_hybrid, tiny_moe

    if family == "qwen2":
        model = tiny_qwen2(torch.float32, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                           num_key_value_heads=2, tie_word_embeddings=False)
    elif family == "qwen3_moe":
        model = tiny_moe("qwen3_moe")
    else:
        model = tiny_hybrid("qwen3_5")
    model.save_pretrained(folder)


def batch(kind: str):
    """The step's sequences as verl's trainer hands them to the engine (nested, no padding) + its meta info, as
    tests/drivers/verl_engine_run.py: ``packed`` = ``use_remove_padding`` (verl packs each micro-batch into one
    ``(1, T)`` row, positions restarting per sequence), ``padded`` = verl pads each micro-batch (a mask)."""
    from verl.utils import tensordict_utils as tu

    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 128, (n,), generator=generator) for n in LENGTHS]
    nested = functools.partial(torch.nested.as_nested_tensor, layout=torch.jagged)
    return tu.get_tensordict(
        tensor_dict={"input_ids": nested(ids), "position_ids": nested([torch.arange(n) for n in LENGTHS]),
                     "loss_mask": nested([torch.ones(n, dtype=torch.long) for n in LENGTHS])},
        non_tensor_dict={"use_remove_padding": kind == "packed", "use_dynamic_bsz": False,
                         "micro_batch_size_per_gpu": 2, "temperature": 1.0, "global_batch_size": len(LENGTHS),
                         "pad_mode": "no_padding", "pad_token_id": 0, "sp_size": 1})


def engine_for(folder: str, kind: str):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    model_config = HFModelConfig(path=folder, load_tokenizer=False, use_remove_padding=kind == "packed",
                                 enable_gradient_checkpointing=True)
    engine_config = FSDPEngineConfig(strategy="fsdp2", mixed_precision={"param_dtype": "bf16"})
    return FSDPEngineWithLMHead(model_config, engine_config, FSDPOptimizerConfig(lr=1e-3, total_training_steps=2),
                                CheckpointConfig())


def full(tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().float()


def one(folder: str, kind: str) -> dict:
    """verl's whole engine: ``FSDPEngine.__init__`` (apply_npu_fsdp_patches, device mesh), ``initialize()``
    (model build, our hook's compile in ``_build_fsdp_module``, FSDP2 ``fully_shard`` onto ``npu``, the full
    state dict loaded, optimizer), then one step as ``BaseEngine.train_batch`` runs it (``optimizer_zero_grad``,
    ``forward_backward_batch`` with verl's ``sft_loss``, ``optimizer_step``), gradients read before the update."""
    from verl.workers.utils.losses import sft_loss

    from qwen_npu_compile.layers import clean_name
    from qwen_npu_compile.worker import layer_reports

    torch._dynamo.reset()
    engine = engine_for(folder, kind)
    engine.initialize()
    with engine.train_mode():
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(batch(kind), functools.partial(sft_loss, None), forward_only=False)
        grads = {clean_name(name): full(p.grad).norm().item()
                 for name, p in engine.module.named_parameters() if p.grad is not None}
        devices = sorted({str(p.device) for p in engine.module.parameters()})
        engine.optimizer_step()
    result = {"loss": float(sum(out["loss"])), "grads": grads, "param_devices": devices,
              "module_class": type(engine.module).__name__, "layers": {}}
    for name, record in layer_reports(engine.module).items():
        result["layers"][name] = [{"fusions": dict(r.fusions), "already_fused": dict(r.already_fused),
                                   "fallback": r.fallback} for r in record.reports]
    return result


def main(out_path: str) -> int:
    import torch.distributed as dist
    from verl.utils.device import get_device_name, is_npu_available
    from verl.utils.distributed import initialize_global_process_group_ray

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.update(RANK="0", WORLD_SIZE="1")
    initialize_global_process_group_ray()  # verl's: "cpu:gloo,npu:hccl" (the stand-in's one-rank hccl)
    lines = Lines()
    logging.getLogger("qwen_npu_compile").addHandler(lines)
    logging.getLogger("qwen_npu_compile").setLevel(logging.INFO)
    results = {"backend": dist.get_backend(), "verl": verl.__version__, "is_npu_available": bool(is_npu_available), "device_name": get_device_name(),
               "hook_imported_by_verl": "qwen_npu_compile.verl" in sys.modules, "runs": {}}
    families = os.environ.get("VERL_NPU_RUN_FAMILIES", "qwen2,qwen3_moe,qwen3_5").split(",")
    kinds = os.environ.get("VERL_NPU_RUN_KINDS", "packed,padded").split(",")
    for family in families:
        with tempfile.TemporaryDirectory() as folder:
            save(family, folder)
            for kind in kinds:
                torch.manual_seed(0)
                results["runs"][f"{family}-{kind}"] = one(folder, kind)
    results["npu_patch_lines"] = [line for line in lines.lines if "npu_patch" in line]
    from transformers.models.qwen2 import modeling_qwen2

    results["qwen2_rms_norm_forward"] = getattr(modeling_qwen2.Qwen2RMSNorm.forward, "__qualname__", "?")
    Path(out_path).write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
