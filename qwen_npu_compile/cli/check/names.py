"""Preset names as a user types them: normalising, the closest presets to a typo, the one-line answer to a name
that is neither a preset nor a folder, the preset listing. Imports no torch (``qwen-npu-compile check`` answers a
typo or a hub id at once; :mod:`.presets` stays data only)."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from qwen_npu_compile.cli.check.presets import _ALIASES, _ORG_PREFIXES, PRESETS

#: The command that lists the presets (named in every "unknown model" line).
LIST_COMMAND = "qwen-npu-compile presets"

#: A Hugging Face hub id: ``org/name`` (letters, digits, ``-``, ``_``, ``.``).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def normalize_preset_name(model: str) -> str:
    """``model`` lower-cased, an organisation prefix (:data:`_ORG_PREFIXES`) dropped, an alias resolved:
    ``"Qwen/Qwen2.5-0.5B"`` -> ``"qwen2.5-0.5b"``."""
    name = model.strip().lower()
    for prefix in _ORG_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
    return _ALIASES.get(name, name)


def closest_presets(model: str, n: int = 3) -> list[str]:
    """Up to ``n`` preset names closest to ``model`` (:func:`difflib.get_close_matches`, cutoff 0.6), best first."""
    name = normalize_preset_name(model)
    return difflib.get_close_matches(name, list(PRESETS), n=n, cutoff=0.6)


def unknown_model_message(model: str) -> str | None:
    """Why ``model`` is neither a preset nor an existing folder, in one short line, or None when it is one of them.
    Imports nothing (no torch): ``qwen-npu-compile check`` answers a typo at once.

    * ``org/name`` that is not a folder here: a Hugging Face hub id. ``check`` reads no hub: the line says how to
      download it into a folder (``hf download ... --local-dir``: huggingface_hub 2.x no longer ships
      ``huggingface-cli``) and names the preset of its shapes
      when one is close (an ``-Instruct`` model shares its base model's shapes).
    * a path (``/``, ``./``, ``~``, or several ``/``): no such folder.
    * anything else: the closest preset names and :data:`LIST_COMMAND`.
    """
    if normalize_preset_name(model) in PRESETS or Path(model).expanduser().is_dir():
        return None
    close = closest_presets(model)
    if _HUB_ID.match(model.strip()) and not model.startswith((".", "~")):
        local = model.strip().split("/")[-1]
        hint = f", or check the preset of its shapes: {close[0]}" if close else ""
        return (f"{model!r} is not a folder here; check reads no model hub: download it into a folder and pass the "
                f"folder (hf download {model.strip()} --local-dir {local}; then check ./{local}){hint}")
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:
        return f"no such folder: {model!r} (a model is a local Hugging Face model folder or a preset: {LIST_COMMAND})"
    guess = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown model {model!r}: not a preset or a folder{guess} (list: {LIST_COMMAND})"


def preset_lines() -> list[str]:
    """One line per preset, sorted: name, model type, layers, hidden size, heads/KV heads (``qwen-npu-compile
    presets``)."""
    lines = []
    for name in sorted(PRESETS):
        p = PRESETS[name]
        experts = f", {p['num_experts']} experts top-{p['num_experts_per_tok']}" if "num_experts" in p else ""
        lines.append(f"{name:<20} {p.get('model_type', 'qwen2'):<18} {p['num_hidden_layers']:>3} layers, hidden "
                     f"{p['hidden_size']}, heads {p['num_attention_heads']}/{p['num_key_value_heads']}{experts}")
    return lines
