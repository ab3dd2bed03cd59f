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

The memory estimate (:func:`estimate_memory_bytes`) lets the caller refuse a run that would not fit
(:func:`available_memory_bytes`).

:data:`TINY_QWEN2`, :func:`tiny_qwen2_config` and :func:`tiny_qwen2` are the one tiny Qwen2 of the tests,
examples and quick benchmarks (transformers' real modeling code, random weights, CPU-sized).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

from .presets import _ALIASES, _ORG_PREFIXES, PRESETS  # noqa: F401  (PRESETS: this module's public name)

log = logging.getLogger(__name__)

#: model_type -> (transformers config class, causal-LM class, q/k/v bias). Llama and Mistral have no
#: q/k/v bias. (RMSNorms per layer: :func:`rms_norms_per_layer`, from the rms_norm fusion family.)
FAMILIES: dict[str, tuple[str, str, bool]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", False),
    "llama": ("LlamaConfig", "LlamaForCausalLM", False),
    "mistral": ("MistralConfig", "MistralForCausalLM", False),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", True),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", False),
    # hybrid Gated DeltaNet + gated attention (issue 25): transformers 5.x (Qwen3.5), 4.57+ (Qwen3-Next)
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", False),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", False),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", False),
}

#: The hybrid model types (Gated DeltaNet layers with a full-attention layer every ``full_attention_interval``).
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")

#: Multimodal ``model_type`` -> the text model type of its ``text_config`` (the released Qwen3.5 checkpoints are
#: ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``); ``check`` builds the text model.
MULTIMODAL_TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}

#: The ``model_type`` values of a local ``config.json`` this module builds.
SUPPORTED_MODEL_TYPES = tuple(FAMILIES) + tuple(MULTIMODAL_TEXT_TYPES)


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

_GIB = 1024**3


def _family(config: Any) -> tuple[str, str, bool]:
    """The :data:`FAMILIES` row of ``config`` (Qwen2's for an unknown model_type)."""
    return FAMILIES.get(getattr(config, "model_type", "qwen2"), FAMILIES["qwen2"])


def rms_norms_per_layer(config: Any) -> int:
    """RMSNorms per decoder layer of ``config``'s family: 2, or 4 for Qwen3 (q_norm and k_norm); as the
    rms_norm fusion family declares it (``RmsNormFamily.expected_per_layer``)."""
    from ..patterns.rms_norm import RmsNormFamily

    return RmsNormFamily.expected_per_layer(config)


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


def _normalize_preset_name(model: str) -> str:
    """Lower-cases ``model`` and drops an optional ``Qwen/`` prefix.

    ``"Qwen/Qwen2.5-0.5B"`` → ``"qwen2.5-0.5b"``.
    """
    name = model.strip().lower()
    for prefix in _ORG_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return _ALIASES.get(name, name)


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


def estimate_num_parameters(config: Any, *, layers: int | None = None) -> int:
    """Number of parameters of a causal LM of :data:`FAMILIES`, from its config alone (Qwen2 described here).

    Per decoder layer: q/k/v projections with bias (``h·h + h`` and ``2·(h·kv + kv)``, ``kv =
    num_key_value_heads · head_dim``), o projection without bias (``h·h``), the SwiGLU MLP
    (``3·h·I``), two RMSNorm weights (``2·h``). Plus the embedding (``V·h``), the final norm (``h``)
    and, when the embeddings are not tied, the LM head (``V·h``).

    Args:
        config: A :class:`transformers.Qwen2Config` (or an object with the same attributes).
        layers: Decoder layers to count; ``None`` uses ``config.num_hidden_layers``.

    Hybrid models (:data:`HYBRID_MODEL_TYPES`: Qwen3.5, Qwen3.5-MoE, Qwen3-Next) are counted per layer kind by
    :func:`_hybrid_num_parameters`.

    Returns:
        The parameter count (elements, not bytes).
    """
    n_layers = config.num_hidden_layers if layers is None else layers
    if getattr(config, "model_type", None) in HYBRID_MODEL_TYPES:
        return _hybrid_num_parameters(config, n_layers)
    h = config.hidden_size
    inter = config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q = heads * head_dim
    kv = kv_heads * head_dim
    _, _, bias = _family(config)
    norms = rms_norms_per_layer(config)
    per_layer = (h * q) + 2 * (h * kv) + q * h + 3 * h * inter + 2 * h
    sparse = len(_moe_sparse_layers(config, n_layers))
    if sparse:  # MoE layers: router [E, h] + E experts (3·h·I_moe) + Qwen2-MoE's shared expert and its gate
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        moe_mlp = config.num_experts * (h + 3 * h * config.moe_intermediate_size) + (3 * h * shared + h if shared else 0)
        per_layer_sparse_delta = moe_mlp - 3 * h * inter
    else:
        per_layer_sparse_delta = 0
    if bias:  # Qwen2's q/k/v projections have a bias
        per_layer += q + 2 * kv
    if norms == 4:  # Qwen3's q_norm and k_norm weights
        per_layer += 2 * head_dim
    vocab = config.vocab_size
    lm_head = 0 if config.tie_word_embeddings else vocab * h
    return n_layers * per_layer + sparse * per_layer_sparse_delta + vocab * h + h + lm_head


def _hybrid_num_parameters(config: Any, layers: int) -> int:
    """Parameters of the first ``layers`` decoder layers of a hybrid causal LM (Qwen3.5 / Qwen3.5-MoE /
    Qwen3-Next, transformers 5.x modeling), plus embedding, final norm and LM head (unless tied).

    A formula, not a meta-device build: ``check`` evaluates it for every preset before building anything (the
    memory refusal), and the first import of a transformers modeling module alone costs ~5 s.
    ``tests/e2e/test_hybrid_presets.py`` pins it to ``sum(p.numel())`` of the model built on the meta device,
    for every hybrid preset, whole and cut to 4 layers. Per layer, with ``h`` hidden, ``K = linear_num_key_heads
    · linear_key_head_dim``, ``Vd = linear_num_value_heads · linear_value_head_dim``, ``nv`` value heads:

    * ``linear_attention`` (Gated DeltaNet): ``in_proj_qkv`` ``h·(2K + Vd)`` (Qwen3-Next's ``in_proj_qkvz`` and
      ``in_proj_ba`` hold the same), ``in_proj_z`` ``h·Vd``, ``in_proj_b`` and ``in_proj_a`` ``h·nv`` each, the
      depthwise ``conv1d`` ``(2K + Vd)·linear_conv_kernel_dim``, ``A_log`` and ``dt_bias`` ``nv`` each, the gated
      norm's weight ``linear_value_head_dim``, ``out_proj`` ``Vd·h``;
    * ``full_attention`` (gated attention): ``q_proj`` ``h·2·a·d`` (query and output gate), ``k_proj`` and
      ``v_proj`` ``h·kv·d`` each, ``o_proj`` ``a·d·h``, ``q_norm`` and ``k_norm`` ``d`` each (with
      ``attention_bias``: ``2·a·d + 2·kv·d + h`` more);
    * the MLP: dense SwiGLU ``3·h·I``; a sparse layer (:func:`_moe_sparse_layers`) the router ``E·h``, ``E``
      experts ``3·h·I_moe`` each, the shared expert ``3·h·I_shared`` and its sigmoid gate ``h``;
    * two RMSNorm weights ``2·h``.
    """
    h = config.hidden_size
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    nv = config.linear_num_value_heads
    conv_dim = 2 * key_dim + value_dim
    linear = (h * conv_dim + h * value_dim + 2 * h * nv + conv_dim * config.linear_conv_kernel_dim + 2 * nv
              + config.linear_value_head_dim + value_dim * h)
    heads, d = config.num_attention_heads, config.head_dim
    kv = (config.num_key_value_heads or heads) * d
    full = 2 * h * heads * d + 2 * h * kv + heads * d * h + 2 * d
    if getattr(config, "attention_bias", False):
        full += 2 * heads * d + 2 * kv + h
    sparse = set(_moe_sparse_layers(config, layers))
    layer_types = list(getattr(config, "layer_types", None) or [])
    total = 0
    for i in range(layers):
        kind = layer_types[i] if i < len(layer_types) else "full_attention"
        total += (linear if kind == "linear_attention" else full) + 2 * h
        if i in sparse:
            experts = config.num_experts
            shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
            total += experts * h + experts * 3 * h * config.moe_intermediate_size + (3 * h * shared + h if shared else 0)
        else:
            total += 3 * h * config.intermediate_size
    vocab = config.vocab_size
    return total + vocab * h + h + (0 if config.tie_word_embeddings else vocab * h)


def _moe_sparse_layers(config: Any, layers: int) -> list[int]:
    """The sparse MoE layers among the first ``layers`` (the moe fusion family's rule)."""
    from ..patterns.moe import _sparse_layers

    return [i for i in _sparse_layers(config) if i < layers]


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What ``qwen-npu-compile check`` holds in memory, run by run (:func:`memory_plan`).

    Attributes:
        phases: per run, in the order the check runs them (``"fp32 reference"`` for half precision,
            ``"eager"``, ``"compiled"``, then ``"comparing"``), the bytes alive at its peak: everything
            kept from the runs before it plus its own parameters, gradients, saved activations and
            vocab-sized logits (comparing: the kept results and the error's fp32 temporaries).
        parts: the named components of the peak phase, in bytes (they add up to its value).
        runtime: the fixed allowance for Python, torch, transformers and the compiler, bytes.
    """

    phases: dict[str, int]
    parts: dict[str, int]
    runtime: int

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)

    @property
    def total(self) -> int:
        """The estimated peak resident memory of the check, bytes."""
        return self.phases[self.peak_phase] + self.runtime

    def describe(self, parts: int = 3) -> str:
        """The largest parts of the peak, e.g. ``"in the fp32 reference run: parameters 2.8 GiB, ..."``."""
        largest = sorted(self.parts.items(), key=lambda item: -item[1])[:parts]
        return f"peak in the {self.peak_phase} run: " + ", ".join(f"{name} {value / _GIB:.1f} GiB" for name, value in largest)


def memory_plan(
    config: Any,
    *,
    layers: int | None,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    train: bool,
    reference: bool = False,
    autocast: bool = False,
) -> MemoryPlan:
    """Every tensor the check creates, run by run, from the config alone (nothing is built).

    The check (:func:`qwen_npu_compile.check.harness.run_check`) runs, in order: the fp32 reference
    (``reference``: an fp32 copy of the model, half precision only), eager, then compiled; each run's
    logits (fp32, ``T·V·4`` bytes) and gradients (one copy, moved out of the parameters) are kept for
    the comparison. With ``P`` = :func:`estimate_num_parameters`, ``b`` = bytes per parameter element
    (``dtype``; 4 with ``autocast``, whose weights stay fp32), ``c`` = bytes per activation element
    (``dtype``), ``T = B·S`` tokens, ``V`` vocab, ``h`` hidden, ``a`` heads, ``I`` intermediate, ``L``
    layers, a run holds:

    * parameters ``P·b`` (the model; ``P·4`` more for the reference copy) and, in train mode, their
      gradients, one copy (``P·b``; ``P·4`` for the reference);
    * train, saved activations: ``L · T·(34·h + 5·a·S + max(0, 6·I − 16·h)) · c/2`` (Korthikanti et
      al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023,
      arXiv:2205.05198, Eq. 1, ``s·b·h·(34 + 5·a·s/h)`` bytes per layer in half precision; the third
      term turns its 4h GeLU MLP, 16·h bytes per token, into SwiGLU's gate, up and product, 6·I);
      inference, one layer's working set ``T·(4·h + 3·I)·c + B·a·S²·c``;
    * train with tied embeddings, the ``[V, h]`` gradient of the shared matrix twice more while autograd
      sums the embedding's and the LM head's contributions (``2·V·h`` elements of the gradient dtype);
    * vocab-sized logits: the LM head's output ``T·V·c``, and in train the loss's fp32 copy, its
      log-softmax and their two gradients (``4·T·V·4``; transformers' ``ForCausalLMLoss`` upcasts the
      logits), in inference the harness's fp32 copy (``T·V·4``).

    Comparing the runs adds, to everything kept, the fp32 temporaries of the error (both sides cast,
    their difference, its absolute value) of one block of :data:`.parity.BLOCK_ELEMENTS` elements.

    The peak is the largest phase plus a fixed 1 GiB (:attr:`MemoryPlan.runtime`). Checked against the
    peak resident set measured by ``tests/e2e/test_check_memory.py`` (``ru_maxrss`` of a ``check``
    subprocess) on presets of different vocab and width; see the README's ``check`` section.

    Raises:
        ValueError: ``batch`` or ``seq_len`` < 1, or ``layers`` < 1.
    """
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch and seq_len must be >= 1, got batch={batch}, seq_len={seq_len}")
    n_layers = config.num_hidden_layers if layers is None else layers
    if n_layers < 1:
        raise ValueError(f"layers must be >= 1, got {n_layers}")
    c = torch.empty((), dtype=dtype).element_size()
    b = 4 if autocast else c
    h, heads, inter, vocab = config.hidden_size, config.num_attention_heads, _mlp_width(config), config.vocab_size
    tokens = batch * seq_len
    n_params = estimate_num_parameters(config, layers=n_layers)

    def activations(e: int) -> int:
        if train:
            return (n_layers * tokens * (34 * h + 5 * heads * seq_len + max(0, 6 * inter - 16 * h)) * e // 2
                    + _delta_net_activations(config, n_layers, tokens, e))
        return tokens * (4 * h + 3 * inter) * e + batch * heads * seq_len * seq_len * e

    def logits(e: int) -> int:
        return tokens * vocab * (e + (16 if train else 4))

    tied = bool(getattr(config, "tie_word_embeddings", False))
    kept_logits = tokens * vocab * 4
    phases: dict[str, int] = {}
    parts_by_phase: dict[str, dict[str, int]] = {}
    kept: dict[str, int] = {}
    runs = (["fp32 reference"] if reference else []) + ["eager", "compiled"]
    for run in runs:
        e = 4 if run == "fp32 reference" else c
        parts = {"parameters": n_params * b}
        if run == "fp32 reference":
            parts["fp32 reference parameters"] = n_params * 4
        parts.update(kept)
        if train:
            parts[f"{run} gradients"] = n_params * (4 if run == "fp32 reference" else b)
        if train and tied:
            parts[f"{run} tied-embedding gradient sum"] = 2 * vocab * h * (4 if run == "fp32 reference" else b)
        parts[f"{run} activations"] = activations(e)
        parts[f"{run} logits"] = logits(e)
        phases[run] = sum(parts.values())
        parts_by_phase[run] = parts
        if train:
            kept[f"kept {run} gradients"] = parts[f"{run} gradients"]
        kept[f"kept {run} logits"] = kept_logits
    # comparing: every kept result, plus the error's fp32 temporaries (check.parity works in blocks)
    from .parity import BLOCK_ELEMENTS

    parts = {"parameters": n_params * b, **kept, "comparison temporaries": 4 * BLOCK_ELEMENTS * 4}
    phases["comparing"] = sum(parts.values())
    parts_by_phase["comparing"] = parts
    peak = max(phases, key=phases.__getitem__)
    return MemoryPlan(phases=phases, parts=parts_by_phase[peak], runtime=_GIB)


def _mlp_width(config: Any) -> int:
    """The MLP width per token of the activation estimate: ``intermediate_size``; for a hybrid MoE model (which may
    have no ``intermediate_size``: Qwen3.5-MoE) the routed experts' ``num_experts_per_tok · moe_intermediate_size``
    plus the shared expert's width."""
    if getattr(config, "model_type", None) in HYBRID_MODEL_TYPES and getattr(config, "num_experts", 0):
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        return config.num_experts_per_tok * config.moe_intermediate_size + shared
    return config.intermediate_size


def _delta_net_activations(config: Any, layers: int, tokens: int, e: int) -> int:
    """Saved activations of the Gated DeltaNet layers among the first ``layers`` of a hybrid model beyond the
    per-layer term of :func:`memory_plan` (training), bytes; 0 for other models.

    Per token: the projections and the conv output (``2·(2K + Vd) + 2·Vd`` elements of the activation dtype, ``e``
    bytes) and transformers' ``torch_chunk_gated_delta_rule``, which works in fp32 on q and k repeated to the value
    heads (``nv·dk`` each) and v (``nv·dv``), saving about 8 and 4 copies of them, the chunk-of-64 attention
    matrices (about 4 of ``nv·64``) and one recurrent state ``[nv, dk, dv]`` per chunk of 64 tokens. An estimate
    that errs high (the check's peaks at ``--layers 4`` are the parameters, exactly counted).
    """
    if getattr(config, "model_type", None) not in HYBRID_MODEL_TYPES:
        return 0
    kinds = list(getattr(config, "layer_types", None) or [])[:layers]
    linear = sum(kind == "linear_attention" for kind in kinds)
    nv, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    key_dim, value_dim = config.linear_num_key_heads * dk, nv * dv
    projections = (2 * (2 * key_dim + value_dim) + 2 * value_dim) * e
    rule = (8 * nv * dk + 4 * nv * dv + 4 * nv * 64 + -(-nv * dk * dv // 64)) * 4
    return linear * tokens * (projections + rule)


def estimate_memory_bytes(
    config: Any,
    *,
    layers: int | None,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    train: bool,
    reference: bool = False,
    autocast: bool = False,
) -> int:
    """The estimated peak memory of ``check``, bytes: :attr:`MemoryPlan.total` of :func:`memory_plan`
    (same arguments; ``reference`` adds the fp32 reference run of half precision). It errs high.

    Raises:
        ValueError: ``batch`` or ``seq_len`` < 1, or ``layers`` < 1.
    """
    return memory_plan(config, layers=layers, batch=batch, seq_len=seq_len, dtype=dtype, train=train,
                       reference=reference, autocast=autocast).total


def available_memory_bytes() -> int:
    """Memory available to a new process on this host, in bytes.

    Reads ``MemAvailable`` from ``/proc/meminfo`` (Linux, kB); falls back to
    ``os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")`` (free pages, which undercounts
    reclaimable cache). No psutil dependency.

    Returns:
        Available bytes, or 0 when neither source exists (callers should read 0 as "unknown").
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    fields = line.split()
                    unit = fields[2].lower() if len(fields) > 2 else "kb"
                    scale = 1024 if unit == "kb" else 1
                    return int(fields[1]) * scale
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return 0
