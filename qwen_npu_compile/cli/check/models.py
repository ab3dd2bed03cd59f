"""Qwen2 / Qwen2.5 (and Qwen3, Llama 3.x, Mistral, the Qwen MoE models, Qwen3.5 and Qwen3-Next) models for
``qwen-npu-compile check MODEL``.

``MODEL`` is either a preset name (:data:`PRESETS`, the data of :mod:`.presets` with their sources;
case-insensitive, an optional ``Qwen/``, ``meta-llama/`` or ``mistralai/`` prefix is accepted, e.g.
``Qwen/Qwen2.5-0.5B``) or a local Hugging Face model directory holding a ``config.json`` whose ``model_type``
is one of :data:`SUPPORTED_MODEL_TYPES` (:data:`FAMILIES`: config class, causal-LM class, q/k/v bias). A preset
builds a model with random weights (no model hub is needed); a local directory builds random weights too
unless it also holds weights (``*.safetensors`` or ``pytorch_model.bin``), which are then loaded. A
multimodal Qwen3.5 directory (``model_type`` qwen3_5 / qwen3_5_moe, a ``text_config``) builds its text model
(``Qwen3_5(Moe)ForCausalLM``; :func:`_text_config_data`).

The memory estimate that lets the caller refuse a run that would not fit is :mod:`.memory`'s
(:func:`~qwen_npu_compile.cli.check.memory.estimate_memory_bytes`,
:func:`~qwen_npu_compile.cli.check.memory.available_memory_bytes`); the families by ``model_type`` are
:mod:`.model_types`'.

:data:`TINY_QWEN2`, :func:`tiny_qwen2_config` and :func:`tiny_qwen2` are the one tiny Qwen2 of the tests,
examples and quick benchmarks (transformers' real modeling code, random weights, CPU-sized).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

from qwen_npu_compile.cli.check.model_types import (
    FAMILIES,
    MULTIMODAL_TEXT_TYPES,
    SUPPORTED_MODEL_TYPES,
    _family,
)
from qwen_npu_compile.cli.check.names import normalize_preset_name as _normalize_preset_name
from qwen_npu_compile.cli.check.presets import PRESETS

log = logging.getLogger(__name__)


#: ``attn_implementation`` values :func:`build_model` accepts.
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")

#: The architecture fields reported in :func:`build_model`'s info dict (and set by the presets).
ARCH_FIELDS = (
    "model_type",
    "head_dim",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "attention_dropout",
    "hidden_act",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    # hybrid models (Qwen3.5, Qwen3-Next): the Gated DeltaNet's shape and which layers are full attention
    "layer_types",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)

#: Weight files that make a local directory a "local-weights" model.
_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model.bin", "pytorch_model-*.bin")


def _transformers_class(name: str, model_type: str):
    """``transformers.<name>``; a one-line ValueError naming the model type where this transformers lacks it
    (Qwen3.5 needs transformers 5.x, Qwen3-Next 4.57)."""
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no {name}: model_type {model_type!r} needs a "
                         "newer transformers (Qwen3-Next: 4.57 or later; Qwen3.5: 5.x)")
    return cls


def _config_class(model_type: str):
    return _transformers_class(FAMILIES[model_type][0], model_type)


def _model_class(config: Any):
    return _transformers_class(_family(config)[1], getattr(config, "model_type", "qwen2"))


def preset_names() -> list[str]:
    """The preset names, sorted.

    Returns:
        The keys of :data:`PRESETS` (lower case, e.g. ``"qwen2.5-0.5b"``), sorted.
    """
    return sorted(PRESETS)


def _presets_text() -> str:
    return ", ".join(preset_names())


def _rope_theta(config: Any) -> float | None:
    """RoPE base of ``config``.

    ``config.rope_theta`` on transformers 4.x, ``config.rope_parameters["rope_theta"]`` on 5.x.
    """
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        params = getattr(config, "rope_parameters", None)
        if isinstance(params, dict):
            theta = params.get("rope_theta")
    return theta


def _arch_subset(config: Any) -> dict[str, Any]:
    """The :data:`ARCH_FIELDS` of ``config`` as a plain dict (``rope_theta`` resolved on 4.x and 5.x)."""
    d = config.to_dict()
    out = {k: d.get(k) for k in ARCH_FIELDS}
    out["rope_theta"] = _rope_theta(config)
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "partial_rotary_factor" in params:  # Qwen3.5 / Qwen3-Next (5.x)
        out["partial_rotary_factor"] = params["partial_rotary_factor"]
    return out


def _local_dir(model: str) -> Path | None:
    """``model`` as a directory path when it names an existing directory, else ``None``."""
    path = Path(model).expanduser()
    return path if path.is_dir() else None


def _has_weights(directory: Path) -> bool:
    return any(any(directory.glob(pattern)) for pattern in _WEIGHT_GLOBS)


def _config_from_dir(directory: Path) -> Qwen2Config:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"{directory} is a directory but holds no config.json; a model is a preset "
            f"({_presets_text()}) or a local Hugging Face model directory with a config.json."
        )
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {config_file}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{config_file} does not hold a JSON object")
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{config_file} has model_type {model_type!r}; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (Qwen2/Qwen2.5, Qwen3, Llama, Mistral, Qwen1.5/Qwen2-MoE, Qwen3-MoE, "
            f"Qwen3.5 and Qwen3.5-MoE (multimodal: their text model), Qwen3-Next checkpoints). "
            f"Presets: {_presets_text()}."
        )
    if model_type in MULTIMODAL_TEXT_TYPES:
        data = _text_config_data(data, config_file, model_type)
        model_type = data["model_type"]
    config_class = _config_class(model_type)
    try:
        return config_class.from_dict(data)
    except Exception as exc:  # transformers 5.x raises huggingface_hub's StrictDataclass*Error here
        name = FAMILIES[model_type][0].removesuffix("Config")  # Qwen2, Qwen3, Llama, Mistral
        raise ValueError(f"{config_file} is not a valid {name} config: {exc}") from exc


def _text_config_data(data: dict, config_file: Path, model_type: str) -> dict:
    """The ``text_config`` of a multimodal Qwen3.5 ``config.json`` as a text model's config dict.

    The released Qwen3.5 checkpoints are ``Qwen3_5(Moe)ForConditionalGeneration`` (vision tower + text model);
    ``check`` builds and compares the text model (``Qwen3_5(Moe)ForCausalLM``), which is what the fusions see: its
    ``model_type`` is set to the text type (``qwen3_5_text`` / ``qwen3_5_moe_text``) and a top-level
    ``tie_word_embeddings`` the text_config lacks is carried over. transformers' loading maps the checkpoint's
    ``model.language_model.*`` weights onto the text model and skips ``model.visual.*`` / ``mtp.*``.

    Raises:
        ValueError: no ``text_config`` object in the file (one line, saying what to do).
    """
    text = data.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(
            f"{config_file} has model_type {model_type!r} but no text_config object; check builds the text model of a "
            f"multimodal Qwen3.5 checkpoint from its text_config (or give a directory whose config.json is a "
            f"{MULTIMODAL_TEXT_TYPES[model_type]!r} config)"
        )
    out = dict(text)
    out["model_type"] = MULTIMODAL_TEXT_TYPES[model_type]
    if "tie_word_embeddings" not in out and "tie_word_embeddings" in data:
        out["tie_word_embeddings"] = data["tie_word_embeddings"]
    return out


def resolve_model_config(model: str) -> Qwen2Config:
    """The full Hugging Face config of ``model`` (all its layers).

    An existing directory wins over a preset of the same spelling.

    Args:
        model: A preset name (a key of :data:`PRESETS`, case-insensitive, optional ``Qwen/`` prefix,
            e.g. ``"Qwen/Qwen2.5-0.5B"``), or a path to a local Hugging Face model directory holding a
            ``config.json`` whose ``model_type`` is one of :data:`SUPPORTED_MODEL_TYPES` (a multimodal Qwen3.5
            ``config.json`` gives its ``text_config``'s text model).

    Returns:
        A new config of the model's family (:data:`FAMILIES`; :class:`transformers.Qwen2Config` for Qwen2)
        with the preset's / directory's values.

    Raises:
        ValueError: ``model`` is a directory without ``config.json``, with an unreadable or invalid one,
            or with a ``model_type`` not in :data:`SUPPORTED_MODEL_TYPES` (the message names the supported model types and lists
            the presets); or ``model`` is neither a directory nor a preset (the message lists the
            presets, sorted, and says a local directory with a ``config.json`` is also accepted).
    """
    directory = _local_dir(model)
    if directory is not None:
        return _config_from_dir(directory)
    name = _normalize_preset_name(model)
    if name in PRESETS:
        fields = dict(PRESETS[name])
        return _config_class(fields.pop("model_type", "qwen2"))(**fields)
    raise ValueError(
        f"unknown model {model!r}: not a preset and not a directory. Presets: {_presets_text()}. "
        "A local Hugging Face model directory holding a config.json is also accepted (model types: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)})."
    )


def with_layers(config: Qwen2Config, layers: int) -> Qwen2Config:
    """A copy of ``config`` with ``num_hidden_layers=layers`` and ``use_cache=False``.

    transformers 5.x validates ``len(layer_types) == num_hidden_layers``, so a ``layer_types`` list is
    cut to the first ``layers`` entries (it is rebuilt from the new count when absent).
    """
    data = config.to_dict()
    data["num_hidden_layers"] = layers
    data["use_cache"] = False
    layer_types = data.get("layer_types")
    if isinstance(layer_types, list):
        data["layer_types"] = layer_types[:layers]
    return type(config).from_dict(data)


def with_vocab_size(config: Qwen2Config, vocab_size: int) -> Qwen2Config:
    """A copy of ``config`` with ``vocab_size`` rows in the embedding and the LM head.

    No fused op and no converter sees the vocab dimension (it is the LM head's matmul and the loss), so a
    smaller vocab leaves every fusion and GE conversion as it is and only shortens CPU runs: on a CPU without
    AVX512-BF16 (torch 2.13.0+cpu, AVX2 only), the LM head's bf16 input gradient ``[S, V] @ [V, H]`` at
    V = 151,936 takes ~130 s (fp32: 0.4 s; measured, ``tools/ge_matrix.py``).

    Raises:
        ValueError: ``vocab_size`` < 1.
    """
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    data = config.to_dict()
    data["vocab_size"] = vocab_size
    return type(config).from_dict(data)


#: The tiny Qwen2 of the tests, examples and quick benchmarks: 2 decoder layers, hidden 64, 4 attention
#: heads and 2 KV heads (GQA, head_dim 16), intermediate 128, vocab 128, no KV cache. Other families'
#: configs (Qwen3, Llama, Mistral) accept the same fields.
TINY_QWEN2: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, max_position_embeddings=256, use_cache=False,
)  # fmt: skip


def tiny_qwen2_config(**overrides: Any) -> Qwen2Config:
    """:data:`TINY_QWEN2` as a :class:`transformers.Qwen2Config`, with ``overrides`` (any config field) applied."""
    return Qwen2Config(**{**TINY_QWEN2, **overrides})


def tiny_qwen2(dtype: torch.dtype = torch.float32, attn: str = "sdpa", **overrides: Any) -> Qwen2ForCausalLM:
    """A random-weight tiny :class:`transformers.Qwen2ForCausalLM` (:func:`tiny_qwen2_config` ``(**overrides)``).

    Weights come from ``torch.manual_seed(0)`` and transformers' initialisation (equal calls, equal
    weights), then are cast to ``dtype``; ``attn`` is the ``attn_implementation`` (``"sdpa"`` or ``"eager"``).
    The model is in transformers' default mode (``.train()`` is the caller's).
    """
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(tiny_qwen2_config(**overrides), attn_implementation=attn)
    return model.to(dtype)


def _transformers_major_minor() -> tuple[int, int]:
    parts = transformers.__version__.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):  # pragma: no cover - unusual version strings
        return (5, 0)


def _dtype_kwarg() -> str:
    """The dtype keyword of ``from_pretrained`` / ``_from_config``: ``dtype`` from transformers 4.56 on
    (5.x still accepts ``torch_dtype`` with a deprecation warning), ``torch_dtype`` before."""
    return "dtype" if _transformers_major_minor() >= (4, 56) else "torch_dtype"


def _check_layers(layers: int | None, max_layers: int) -> int:
    if layers is None:
        return max_layers
    if isinstance(layers, bool) or not isinstance(layers, int):
        raise ValueError(f"layers must be an integer, got {layers!r}")
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if layers > max_layers:
        raise ValueError(f"layers={layers} is more than the model has: the maximum is {max_layers}")
    return layers


def build_model(
    model: str,
    *,
    layers: int | None,
    dtype: torch.dtype,
    attn: str,
    vocab_size: int | None = None,
) -> tuple[Qwen2ForCausalLM, dict[str, Any]]:
    """Builds a Qwen2/Qwen2.5 causal LM on the CPU, in eval mode, with ``use_cache=False``.

    Random weights come from ``torch.manual_seed(0)`` followed by the transformers initialisation, so
    two calls with the same arguments give the same weights. A local directory that also holds weights
    (``*.safetensors``, ``pytorch_model.bin`` or its shards) is loaded with
    ``Qwen2ForCausalLM.from_pretrained`` instead (with ``layers`` set, only the first ``layers`` decoder
    layers are loaded; the remaining checkpoint tensors are ignored). The model is returned in
    ``.eval()`` mode: the caller calls ``.train()`` when it wants training mode (the presets have no
    dropout, ``attention_dropout`` is 0.0). A KV cache is off (``config.use_cache = False``); the caller
    passes one explicitly when it wants one.

    Args:
        model: A preset name or a local model directory; see :func:`resolve_model_config`.
        layers: Number of decoder layers to build, ``1 <= layers <= config.num_hidden_layers``; ``None``
            keeps all of the config's layers.
        dtype: Floating parameter dtype (``torch.float32``, ``torch.bfloat16`` or ``torch.float16``).
        attn: ``attn_implementation``: ``"sdpa"`` or ``"eager"``.
        vocab_size: replaces the config's ``vocab_size`` (embedding and LM head rows; :func:`with_vocab_size`),
            random weights only; ``None`` keeps the model's.

    Returns:
        ``(model, info)``: the :class:`transformers.Qwen2ForCausalLM` (on the CPU, parameters in
        ``dtype``), and ``info`` = ``{"name": preset key or resolved directory path, "source":
        "preset" | "local-random" | "local-weights", "layers": int, "num_parameters": int (unique
        parameters, tied embeddings counted once), "config": the :data:`ARCH_FIELDS` of the built
        config}``.

    Raises:
        ValueError: ``model`` is not resolvable (see :func:`resolve_model_config`); ``layers`` is not
            an integer, is < 1, or exceeds the config's ``num_hidden_layers`` (the message names the
            maximum); ``attn`` is not ``"sdpa"``/``"eager"``; ``dtype`` is not a floating torch dtype;
            ``vocab_size`` is given for a directory that holds weights, or is < 1.
    """
    if attn not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn must be one of {', '.join(ATTN_IMPLEMENTATIONS)}; got {attn!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")

    full_config = resolve_model_config(model)
    n_layers = _check_layers(layers, full_config.num_hidden_layers)
    config = with_layers(full_config, n_layers)
    directory = _local_dir(model)
    if vocab_size is not None:
        if directory is not None and _has_weights(directory):
            raise ValueError(f"--vocab-size needs random weights, but {directory} holds weights (they fix the vocab)")
        config = with_vocab_size(config, vocab_size)
    dtype_kw = {_dtype_kwarg(): dtype}
    torch.manual_seed(0)
    if directory is not None and _has_weights(directory):
        source = "local-weights"
        # The config object (not num_hidden_layers=...) so that layer_types stays consistent (5.x).
        net = _model_class(config).from_pretrained(
            directory,
            config=config,
            attn_implementation=attn,
            local_files_only=True,
            **dtype_kw,
        )
    else:
        source = "local-random" if directory is not None else "preset"
        net = _model_class(config)._from_config(config, attn_implementation=attn, **dtype_kw)
    net.config.use_cache = False
    net.eval()

    name = str(directory.resolve()) if directory is not None else _normalize_preset_name(model)
    info = {
        "name": name,
        "source": source,
        "layers": n_layers,
        "num_parameters": sum(p.numel() for p in net.parameters()),
        "config": _arch_subset(net.config),
    }
    log.info(
        "built %s (%s): %d layers, %d parameters, %s, attn=%s",
        name, source, n_layers, info["num_parameters"], dtype, attn,
    )
    return net, info


