"""Finding a model's decoder layers and cleaning wrapper parts out of module names.

The piece :mod:`.worker` (per-layer compile) and :mod:`.substitutions.varlen_attention` (packed micro-batches)
share; both import it, it imports neither, so they depend one way (worker -> varlen_attention -> layers).
"""

from __future__ import annotations

from torch import nn

#: Name parts that wrappers (FSDP1, activation checkpoint wrapper, torch.compile) add to module names.
_WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def _class_names(module: nn.Module) -> set[str]:
    # FSDP2 swaps a layer's class for a subclass "FSDP<Layer>": match every class in the MRO.
    return {cls.__name__ for cls in type(module).__mro__}


def clean_name(name: str) -> str:
    """``name`` without the parts FSDP1, checkpoint wrappers and ``torch.compile`` insert.

    ``_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module`` -> ``model.layers.0``.
    """
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def _no_split_module_names(model: nn.Module) -> list[str]:
    names = getattr(model, "_no_split_modules", None)
    if not names:
        return []
    if isinstance(names, str):
        return [names]
    return sorted(str(name) for name in names)  # a list on HF classes, a set on HF 5.x instances


def _outermost(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    kept: list[tuple[str, nn.Module]] = []
    for name, module in found:
        if not any(name.startswith(outer + ".") for outer, _ in kept):
            kept.append((name, module))
    return kept


def _is_block_list(module: nn.Module) -> bool:
    if not isinstance(module, nn.ModuleList) or len(module) == 0:
        return False
    blocks = list(module)
    first = type(blocks[0])
    return all(type(block) is first for block in blocks) and any(True for _ in blocks[0].parameters())


def find_decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder layers of ``model`` with their qualified names, in model order.

    Looked for, in order: submodules whose class (or a base class: FSDP2 renames it) is named in
    ``model._no_split_modules`` (Hugging Face models list their decoder layer class there; verl's wrap
    policies use the same list); then ``model.model.layers`` or ``model.layers``; then the longest
    ``nn.ModuleList`` of same-class blocks that hold parameters.

    Args:
        model: a Hugging Face model (``Qwen2ForCausalLM``, possibly PEFT- or FSDP-wrapped) or any
            module holding a list of identical blocks.

    Returns:
        ``[(qualified name, layer module), ...]``; a match nested in another match is dropped.

    Raises:
        ValueError: nothing found; the message says what was looked for.
    """
    names = _no_split_module_names(model)
    if names:
        wanted = set(names)
        found = [(n, m) for n, m in model.named_modules() if n and _class_names(m) & wanted]
        if found:
            return _outermost(found)
    for path in ("model.layers", "layers"):
        holder = model
        for part in path.split("."):
            holder = getattr(holder, part, None) if isinstance(holder, nn.Module) else None
        if holder is not None and _is_block_list(holder):
            prefix = dict((id(m), n) for n, m in model.named_modules())[id(holder)]
            return [(f"{prefix}.{i}", block) for i, block in enumerate(holder)]
    lists = [(n, m) for n, m in model.named_modules() if _is_block_list(m)]
    if lists:
        prefix, holder = max(lists, key=lambda item: len(item[1]))  # first of the longest
        return [(f"{prefix}.{i}" if prefix else str(i), block) for i, block in enumerate(holder)]
    raise ValueError(
        f"qwen_npu: cannot find the decoder layers of {type(model).__name__}: no submodule's class is "
        f"named in its _no_split_modules ({names or 'not set'}), it has no model.model.layers or "
        "model.layers, and no nn.ModuleList of same-class blocks; maybe_compile supports Hugging Face "
        "decoder-only models such as Qwen2ForCausalLM"
    )
