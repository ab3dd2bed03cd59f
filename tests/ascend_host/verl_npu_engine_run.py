"""verl 0.9.1's FSDP engine on the simulated Ascend host, taking its own NPU branches (issue 36).

Run by test_verl_npu_patch.py in a fresh interpreter (``VERL_USE_EXTERNAL_MODULES`` is read by ``import verl``;
verl's npu_patch patches transformers for the whole process)::

    PYTHONPATH=tests/ascend_host/stand_in:. VERL_USE_EXTERNAL_MODULES=qwen_npu_compile.verl [QWEN_NPU_COMPILE=1] \\
        python tests/ascend_host/verl_npu_engine_run.py OUT.json

Nothing of verl is patched or re-implemented: ``import torch_npu`` is the stand-in, so verl's
``is_npu_available`` is true by itself, its platform is the NPU one (device ``npu``), and
``FSDPEngineWithLMHead.__init__`` runs ``apply_npu_fsdp_patches`` itself (verl's real ``npu_patch`` on the
stand-in's ``torch_npu`` functions). The process group is gloo (world size 1; ``init_device_mesh("npu")``
takes it). Per model (tiny Qwen2, Qwen3-MoE, Qwen3.5 saved with ``save_pretrained``; verl's default
``flash_attention_2``, which transformers resolves to its NPU functions by itself here):

1. ``engine.initialize()`` -- verl's model build, our hook's compile in ``_build_fsdp_module``, FSDP2. On this
   host it stops in FSDP2's ``fully_shard`` (recorded in ``OUT.json`` as ``initialize_error``): moving the
   CPU-built parameters to ``npu`` assigns ``param.data`` across the CPU and PrivateUse1 tensor types, which
   the stand-in refuses ("incompatible tensor type");
2. so the pieces as far as they go: ``engine._build_module()`` (verl's: ``from_pretrained``,
   ``apply_monkey_patch``, gradient checkpointing), then the hooked ``engine._build_fsdp_module(module)``,
   which compiles the decoder layers (``maybe_compile``) before the same FSDP2 error; the compiled module is
   moved to ``npu`` in bf16 and trained one step on verl's packed row (``use_remove_padding``: ``(1, T)``,
   positions restarting per sequence) and on a padded batch (mask), as separate models.

``OUT.json``: per model and input kind, the loss, gradient norms, per-layer fusions / already-fused ops /
fallbacks, and the hook's INFO line about verl's npu_patch.

The stand-in lacks ``torch_npu.npu.mstx`` and ``torch_npu.profiler``, which verl's profiler module imports at
import time (used only when profiling is on); empty modules stand in for them here.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import types
from pathlib import Path

import torch_npu  # noqa: F401  (the stand-in: PrivateUse1 is npu)

import torch

for _owner, _name in ((torch_npu.npu, "mstx"), (torch_npu, "profiler")):
    if not hasattr(_owner, _name):
        _module = types.ModuleType(f"{_owner.__name__}.{_name}")
        setattr(_owner, _name, _module)
        sys.modules[_module.__name__] = _module

import verl  # noqa: E402  (imports VERL_USE_EXTERNAL_MODULES)

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "e2e")]
LENGTHS = (13, 29, 6, 16)


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def save(family: str, folder: str) -> None:
    from conftest import tiny_hybrid, tiny_moe

    from qwen_npu_compile.check.models import tiny_qwen2

    if family == "qwen2":
        model = tiny_qwen2(torch.float32, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                           num_key_value_heads=2, tie_word_embeddings=False)
    elif family == "qwen3_moe":
        model = tiny_moe("qwen3_moe")
    else:
        model = tiny_hybrid("qwen3_5")
    model.save_pretrained(folder)


def inputs(kind: str, device) -> dict:
    generator = torch.Generator().manual_seed(0)
    if kind == "packed":
        ids = torch.randint(0, 128, (1, sum(LENGTHS)), generator=generator)
        positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
        return {"input_ids": ids.to(device), "position_ids": positions.to(device), "labels": ids.to(device)}
    ids = torch.randint(0, 128, (2, 16), generator=generator)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device),
            "labels": ids.masked_fill(mask == 0, -100).to(device)}


def engine_for(folder: str):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    model_config = HFModelConfig(path=folder, load_tokenizer=False, use_remove_padding=True,
                                 enable_gradient_checkpointing=True)
    engine_config = FSDPEngineConfig(strategy="fsdp2", mixed_precision={"param_dtype": "bf16"})
    return FSDPEngineWithLMHead(model_config, engine_config, FSDPOptimizerConfig(lr=1e-3, total_training_steps=2),
                                CheckpointConfig())


def one(folder: str, kind: str) -> dict:
    from qwen_npu_compile.worker import layer_reports

    engine = engine_for(folder)  # FSDPEngine.__init__: apply_npu_fsdp_patches, device mesh
    out = {"device": engine.device_name if hasattr(engine, "device_name") else None}
    try:
        engine.initialize()
        out["initialize_error"] = None
    except Exception as exc:  # noqa: BLE001 - what stops verl's engine here, recorded
        out["initialize_error"] = f"{type(exc).__name__}: {exc}"
    torch._dynamo.reset()
    module = engine._build_module()
    try:
        engine._build_fsdp_module(module)  # our hook compiles the layers, then verl's FSDP2 wrap
        out["wrap_error"] = None
    except Exception as exc:  # noqa: BLE001
        out["wrap_error"] = f"{type(exc).__name__}: {exc}"
    device = torch.device("npu", 0)
    module = module.to(device=device, dtype=torch.bfloat16).train()
    result = module(**inputs(kind, device), use_cache=False)
    result.loss.backward()
    out["loss"] = result.loss.item()
    out["grads"] = {name: p.grad.float().norm().item() for name, p in module.named_parameters() if p.grad is not None}
    out["param_device"] = str(next(module.parameters()).device)
    out["layers"] = {}
    for name, record in layer_reports(module).items():
        out["layers"][name] = [{"fusions": dict(r.fusions), "already_fused": dict(r.already_fused),
                                "fallback": r.fallback} for r in record.reports]
    return out


def main(out_path: str) -> int:
    import torch.distributed as dist
    from verl.utils.device import get_device_name, is_npu_available

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    lines = Lines()
    logging.getLogger("qwen_npu_compile").addHandler(lines)
    logging.getLogger("qwen_npu_compile").setLevel(logging.INFO)
    results = {"verl": verl.__version__, "is_npu_available": bool(is_npu_available), "device_name": get_device_name(),
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
