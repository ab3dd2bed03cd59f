"""``FSDPTurbo(config, module).model``: FSDP-Turbo's model patches, then FSDP2 sharding (see the package docstring)."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: (owner, attribute name, the value before the patch) of every patch applied in this process, in order.
APPLIED: list[tuple[object, str, object]] = []


def resolve(path: str):
    """The object a dotted path names: the longest importable module prefix, then attributes.

    Raises:
        ImportError / AttributeError: nothing by that path.
    """
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            target = getattr(target, name)
        return target
    raise ImportError(f"no module in {path!r}")


def apply_module_patches(patches: dict[str, str]) -> list[str]:
    """Set each ``target -> replacement`` (dotted paths) on the target's owner; returns the targets patched."""
    done = []
    for target, replacement in patches.items():
        owner_path, _, attribute = target.rpartition(".")
        owner = resolve(owner_path)
        APPLIED.append((owner, attribute, owner.__dict__.get(attribute) if isinstance(owner, type)
                        else getattr(owner, attribute)))
        setattr(owner, attribute, resolve(replacement))
        done.append(target)
    return done


def undo_module_patches() -> None:
    """Put back what :func:`apply_module_patches` replaced in this process (latest first); for tests."""
    while APPLIED:
        owner, attribute, before = APPLIED.pop()
        if before is None and isinstance(owner, type):
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, before)


def _device_type() -> str:
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cpu"


class FSDPTurbo:
    """Patch, then shard ``module`` in place; ``.model`` is ``module`` itself, sharded (names and keys unchanged).

    Args:
        config: an ``FSDPTurboConfig`` (``fsdp_turbo_config``).
        module: a Hugging Face model whose ``_no_split_modules`` names its decoder layer class(es).

    Raises:
        NotImplementedError: ``fsdp_implementation`` is not ``native``, or ``cpu_offload`` is on.
        ValueError: the model names no layer class to shard.
    """

    def __init__(self, config, module: torch.nn.Module) -> None:
        plan = config.distributed.fsdp_plan
        if plan.fsdp_implementation != "native":
            raise NotImplementedError(f"fsdp_implementation={plan.fsdp_implementation!r}: "
                                      "the stand-in has 'native' only")
        if plan.cpu_offload:
            raise NotImplementedError("cpu_offload: not modelled by the stand-in")
        self.patched = apply_module_patches(config.module_patches)
        classes = set(getattr(module, "_no_split_modules", None) or [])
        if not classes:
            raise ValueError(f"{type(module).__name__} has no _no_split_modules: no layer to shard")
        mesh = init_device_mesh(_device_type(), (dist.get_world_size(),))
        mp_policy = MixedPrecisionPolicy(param_dtype=DTYPES[plan.param_dtype], reduce_dtype=DTYPES[plan.reduce_dtype],
                                         output_dtype=DTYPES[plan.output_dtype], cast_forward_inputs=True)
        layers = [m for m in module.modules() if type(m).__name__ in classes]
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(module, mesh=mesh, mp_policy=mp_policy)
        self.model = module
