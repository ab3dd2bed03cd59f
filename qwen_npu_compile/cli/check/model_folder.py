"""What ``check`` refuses about a model before building it: a config it cannot build from, a local model folder
whose weight files cannot be read, and a folder that fails to build for any other reason. Each is a
:class:`ModelFolderError` (a ``ValueError``: ``qwen-npu-compile check`` prints it as one line and exits 2, the
status of bad input; 1 is kept for "fusion or parity failed").

The model itself is resolved and built by :mod:`qwen_npu_compile.cli.check.models`; this module only looks at what
those return and read, so that a broken folder ends in one line naming the file and field, not in a
``ZeroDivisionError`` of the memory estimate or a ``SafetensorError`` of the weight loader.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class ModelFolderError(ValueError):
    """A model (config or local folder) ``check`` cannot build or check; the message is one line."""


#: Config fields that must be positive integers where present (None: not used by the model).
POSITIVE_INT_FIELDS = (
    "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "max_position_embeddings", "num_experts_per_tok", "moe_intermediate_size",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "full_attention_interval",
)

#: Largest safetensors header a reader accepts (the ``safetensors`` library's own limit, 100 MB).
_MAX_HEADER = 100_000_000


#: Architecture fields a checkpoint's ``config.json`` (or its ``text_config``) states; one left out is filled in by
#: transformers' config class defaults (Qwen2Config's: 32 layers of 4096), never what a checkpoint has. ``intermediate_size`` is not a field of Qwen3.5-MoE's text config.
ARCHITECTURE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_NO_INTERMEDIATE_SIZE = ("qwen3_5_moe_text",)
#: Multimodal model types whose architecture is in ``text_config`` (:data:`.model_types.MULTIMODAL_TEXT_TYPES`).
_MULTIMODAL = ("qwen3_5", "qwen3_5_moe")


def architecture_problem(model: str) -> str | None:
    """For a local model folder: the one-line refusal of a ``config.json`` that leaves architecture fields
    (:data:`ARCHITECTURE_FIELDS`) to transformers' defaults, e.g. ``{"model_type": "qwen2"}`` alone, which
    would build transformers' default model (Qwen2Config's: 32 layers of 4096, billions of parameters) instead of
    the checkpoint's; None for a preset, a folder without a readable config.json (:mod:`.models` says why) or a
    complete one. Reads the JSON only (no torch): ``qwen-npu-compile check`` refuses at once, exit status 2."""
    config_file = Path(model).expanduser() / "config.json"
    if not config_file.is_file():
        return None
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    where = str(config_file)
    if data.get("model_type") in _MULTIMODAL:
        if not isinstance(data.get("text_config"), dict):
            return None  # models._text_config_data names it
        data, where = data["text_config"], f"{config_file} (text_config)"
    fields = [f for f in ARCHITECTURE_FIELDS if not (f == "intermediate_size" and data.get("model_type") in
                                                     _NO_INTERMEDIATE_SIZE)]
    missing = [f for f in fields if f not in data]
    if not missing:
        return None
    return (f"{where} leaves {', '.join(missing)} to transformers' defaults, which would build transformers' default "
            "model, not a checkpoint's; use the checkpoint's own config.json (or set these fields)")


def one_line(text: object) -> str:
    """``text`` with its lines joined by ``"; "`` (transformers' config errors span several lines)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return "; ".join(lines)


def _where(model: str) -> str:
    path = Path(model).expanduser()
    return str(path / "config.json") if path.is_dir() else f"preset {model!r}"


def config_problems(config: Any) -> list[str]:
    """What in ``config`` (a transformers config) ``check`` cannot build a model from: non-positive or non-integer
    sizes, heads that do not divide the hidden size (without ``head_dim``) or by the key/value heads, a
    non-positive or non-finite ``rms_norm_eps``."""
    problems = []
    for field in POSITIVE_INT_FIELDS:
        value = getattr(config, field, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{field} must be a positive integer, got {value!r}")
    if problems:
        return problems
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if heads and hidden and getattr(config, "head_dim", None) is None and hidden % heads:
        problems.append(f"hidden_size {hidden} is not divisible by num_attention_heads {heads} (and no head_dim is set)")
    if heads and kv_heads and heads % kv_heads:
        problems.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    eps = getattr(config, "rms_norm_eps", None)
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps)
                            or eps <= 0):
        problems.append(f"rms_norm_eps must be a positive number, got {eps!r}")
    return problems


def check_config(model: str, config: Any) -> None:
    """Raise :class:`ModelFolderError` naming ``model``'s config file (or preset) and every problem
    :func:`config_problems` finds; nothing when there is none."""
    problems = config_problems(config)
    if problems:
        raise ModelFolderError(f"{_where(model)}: {'; '.join(problems)}")


def resolve_config(model: str) -> Any:
    """:func:`qwen_npu_compile.cli.check.models.resolve_model_config` of ``model``, checked (:func:`check_config`);
    its errors as one line.

    Raises:
        ModelFolderError: an unknown model, a folder without a readable, valid config, a config that leaves
            the architecture to transformers' defaults (:func:`architecture_problem`), or a config with sizes no
            model can have.
    """
    from qwen_npu_compile.cli.check import models

    problem = architecture_problem(model)
    if problem is not None:
        raise ModelFolderError(problem)
    try:
        config = models.resolve_model_config(model)
    except ValueError as exc:
        raise ModelFolderError(one_line(exc)) from exc
    check_config(model, config)
    return config


def weight_file_problem(path: Path) -> str | None:
    """Why ``path`` (a ``*.safetensors`` file) cannot be read, or None. Reads only its header: 8 bytes of
    length, then a JSON object of tensor entries whose data ranges must lie inside the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            head = file.read(8)
            if len(head) < 8:
                return f"{size} bytes: too short for a safetensors header"
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER, size - 8):
                return f"header length {length} does not fit the file ({size} bytes): not a safetensors file or truncated"
            header = json.loads(file.read(length).decode("utf-8"))
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"its header is not JSON ({exc})"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    data = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"tensor {name!r} has no data_offsets"
        if not 0 <= offsets[0] <= offsets[1] <= data:
            return f"tensor {name!r} lies outside the file (data_offsets {offsets}, {data} bytes of data): truncated?"
    return None


def _weight_files(directory: Path) -> Iterator[Path]:
    yield from sorted(directory.glob("*.safetensors"))


def check_weights(model: str) -> None:
    """For a local model folder: every ``*.safetensors`` file holds a readable header whose tensors lie inside
    the file (a corrupt or truncated download). Nothing for a preset.

    Raises:
        ModelFolderError: the first unreadable file, named.
    """
    directory = Path(model).expanduser()
    if not directory.is_dir():
        return
    for path in _weight_files(directory):
        problem = weight_file_problem(path)
        if problem is not None:
            raise ModelFolderError(f"{path}: {problem}; download the model again (or remove the file to check "
                                   "random weights)")


@contextlib.contextmanager
def building(model: str) -> Iterator[None]:
    """Around building a local folder's model: any error transformers or torch raise there (a weight of the
    wrong shape, a missing shard, an unreadable file) becomes one :class:`ModelFolderError` line naming the
    folder. A preset's build error is a bug, and propagates."""
    directory = Path(model).expanduser()
    try:
        yield
    except ModelFolderError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to build a user's folder is bad input
        if not directory.is_dir():
            raise
        if isinstance(exc, ValueError) and str(directory) in str(exc):  # models' own one-line refusals
            raise ModelFolderError(one_line(exc)) from exc
        raise ModelFolderError(f"cannot build the model in {directory}: {type(exc).__name__}: {one_line(exc)}") from exc
