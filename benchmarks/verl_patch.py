"""The "verl-style" baseline: what verl runs on Ascend, transformers' Qwen2 patched by verl's ``npu_patch``
with attention through transformers' NPU flash attention.

verl's ``verl/models/transformers/npu_patch.py`` defines three patches (``rms_norm_forward``,
``silu_forward``, ``apply_rotary_pos_emb_*_npu``) and assigns them to the Qwen-family HF classes it
supports (``Qwen2RMSNorm``; ``Qwen2_5_VLMLP`` / ``Qwen3MLP``; Qwen3-MoE rotary; verl 0.9.1's
``_patch_qwen2`` patches the text Qwen2 classes). Here the same three patches are applied to
transformers' text Qwen2 classes (:func:`verl_patches`); attention runs as verl's default
``attn_implementation="flash_attention_2"`` does on an NPU host (:func:`npu_flash_attention_2`:
``npu_fusion_attention`` in BSND, or TND when packed):

* ``Qwen2RMSNorm.forward``  -> ``npu_rms_norm(x, weight, epsilon)[0]``
* ``Qwen2MLP.forward``      -> ``down_proj(npu_swiglu(cat([gate_proj(x), up_proj(x)], -1), -1))``
* ``apply_rotary_pos_emb``  -> ``npu_rotary_mul(q, cos.unsqueeze(1), sin.unsqueeze(1))`` (and k), on HF's
  head-first BNSD q/k (a transposed, non-contiguous view)

The functions below are those patches, written against ``torch.ops.npu.*`` (the simulated stand-ins
here, the real torch_npu ops on an NPU; same schemas). :func:`verl_patches` applies them for the
duration of a ``with`` block and restores transformers' originals afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers.models.qwen2 import modeling_qwen2

#: Where the patched functions come from (cited in the results).
SOURCES = ("https://github.com/volcengine/verl/blob/main/verl/models/transformers/npu_patch.py",)


def rms_norm_forward(self, x):
    """verl's ``rms_norm_forward``: the fused kernel on the input as it comes (no dtype cast)."""
    return torch.ops.npu.npu_rms_norm.default(x, self.weight, self.variance_epsilon)[0]


def silu_forward(self, hidden_state):
    """verl's ``silu_forward``: gate and up projections concatenated (gate first), then ``npu_swiglu``."""
    gate_up = torch.cat((self.gate_proj(hidden_state), self.up_proj(hidden_state)), dim=-1)
    return self.down_proj(torch.ops.npu.npu_swiglu.default(gate_up, -1))


def apply_rotary_pos_emb_npu(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """verl's ``apply_rotary_pos_emb_npu``: ``npu_rotary_mul`` on HF's BNSD q and k."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = torch.ops.npu.npu_rotary_mul.default(q, cos, sin)
    k_embed = torch.ops.npu.npu_rotary_mul.default(k, cos, sin)
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


@contextlib.contextmanager
def replaced(*replacements: tuple[object, str, object]) -> Iterator[None]:
    """Set each ``(owner, attribute, value)`` inside the block only (the originals are restored on exit): how the
    verl patches of every benchmark (Qwen2 here, :mod:`.verl_moe_patch`, :mod:`.verl_qwen3_5_patch`) apply."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


@contextlib.contextmanager
def verl_patches() -> Iterator[None]:
    """Patch transformers' Qwen2 like verl does, inside the block only (originals restored on exit)."""
    with replaced((modeling_qwen2.Qwen2RMSNorm, "forward", rms_norm_forward),
                  (modeling_qwen2.Qwen2MLP, "forward", silu_forward),
                  (modeling_qwen2, "apply_rotary_pos_emb", apply_rotary_pos_emb_npu)):
        yield


# ----------------------------------------------------------------------------------------------------
# attention: what verl's FSDP engine runs on Ascend (transformers' flash_attention_2 on NPU)

#: transformers' NPU flash attention, which verl's default ``attn_implementation="flash_attention_2"``
#: resolves to on an Ascend host: with torch_npu available, transformers' flash-attention utilities take their
#: kernels from ``integrations/npu_flash_attention.py`` (the two files below).
FA2_SOURCES = (
    "https://github.com/huggingface/transformers/blob/main/src/transformers/integrations/npu_flash_attention.py",
    "https://github.com/huggingface/transformers/blob/main/src/transformers/modeling_flash_attention_utils.py",
)


class HostOffsets:
    """Cumulative sequence offsets as the host holds them: what ``cu_seqlens[1:].cpu().numpy().tolist()`` reads.

    transformers derives ``cu_seqlens`` from ``position_ids`` on the device (``nonzero``) and
    ``npu_flash_attn_varlen_func`` copies them to the host as a Python list: data-dependent, so neither
    Dynamo (``fullgraph``) nor fake tensors can trace it. The benchmark knows the packing, so it hands
    transformers an object with the same four operations (``[1:]``, ``.cpu()``, ``.numpy()``,
    ``.tolist()``), which Dynamo inlines to constants: the kernel gets ``actual_seq_qlen`` as constant ints,
    as in verl's captured graph (``verl-default-path.md`` §3).

    Args:
        offsets: ``[0, end_1, ..., end_B]`` (ints, strictly increasing, ``end_B == T``).
    """

    def __init__(self, offsets):
        self.offsets = [int(o) for o in offsets]

    def __getitem__(self, index):
        return HostOffsets(self.offsets[index])

    def cpu(self):
        return self

    def numpy(self):
        return self

    def tolist(self):
        return list(self.offsets)

    def __repr__(self):
        return f"HostOffsets({self.offsets})"


def packing_offsets(lengths) -> list[int]:
    """``[0, l_1, l_1 + l_2, ..., T]`` for sequence lengths ``lengths`` (transformers' ``cu_seqlens``)."""
    out = [0]
    for length in lengths:
        out.append(out[-1] + int(length))
    return out


@contextlib.contextmanager
def npu_flash_attention_2(model: torch.nn.Module, lengths) -> Iterator[None]:
    """Run ``model``'s attention as verl does on Ascend: transformers' ``flash_attention_2`` on NPU.

    What verl's FSDP engine runs (``verl-default-path.md`` §1–2): ``attn_implementation="flash_attention_2"``,
    which on an NPU host resolves (``modeling_flash_attention_utils._lazy_imports``) to
    ``integrations.npu_flash_attention.npu_flash_attn_func`` (one sequence: ``npu_fusion_attention`` in
    BSND with the 2048² compressed mask, ``sparse_mode=3``) and ``npu_flash_attn_varlen_func`` (packed:
    TND with ``actual_seq_qlen/kvlen`` = the cumulative ends). transformers' own functions run unchanged
    (``flash_attention_forward`` → ``_flash_attention_forward`` → ``_prepare_from_posids``, whose
    ``.contiguous()`` copies of q/k/v are counted). Inside the block:

    * transformers takes its NPU path with our ``npu`` ops
      (:func:`tests.helpers.npu_host.simulated_npu_host`), and the NPU functions are loaded
      before compiling (transformers requires that for ``fullgraph``);
    * the compressed mask is in transformers' per-device cache (verl builds it once per process), so it
      is an input of the graph, not built in it;
    * the two data-dependent steps, ``_is_packed_sequence`` (a device tensor used as a Python bool) and
      ``prepare_fa_kwargs_from_position_ids`` (``nonzero`` and ``max().item()``), which a ``fullgraph``
      capture under fake tensors cannot trace, return the answers for the known packing ``lengths``
      (:class:`HostOffsets`, ints). Their small kernels on ``[1, T]`` integers, which verl runs in every
      layer, are therefore not counted (about ten per layer, a few MiB at T=16k): this favours verl;
    * ``model.config._attn_implementation`` is ``"flash_attention_2"``.

    Everything is restored on exit.

    Args:
        model: a transformers model whose attention layers read ``config._attn_implementation``.
        lengths: the packed sequence lengths, summing to the sequence length (``(T,)`` for one sequence).
    """
    from unittest import mock

    from transformers import modeling_flash_attention_utils as fa_utils
    from transformers.integrations import npu_flash_attention

    from tests.helpers.npu_host import simulated_npu_host

    lengths = [int(n) for n in lengths]
    offsets = packing_offsets(lengths)
    packed = len(lengths) > 1
    saved_impl = model.config._attn_implementation
    device = next(model.parameters()).device
    mask = torch.triu(torch.ones(2048, 2048, device="cpu"), diagonal=1).bool()  # real: 4 MiB, outside any fake mode

    def is_packed_sequence(position_ids, batch_size):
        return packed and position_ids is not None and batch_size == 1

    def prepare_fa_kwargs_from_position_ids(position_ids):
        cu = HostOffsets(offsets)
        return (cu, cu), (max(lengths), max(lengths))

    with contextlib.ExitStack() as stack:
        stack.enter_context(simulated_npu_host())
        stack.enter_context(mock.patch.dict(npu_flash_attention.ATTN_MASK_NPU_CACHE, {device: mask}))
        stack.enter_context(mock.patch.object(fa_utils, "_is_packed_sequence", is_packed_sequence))
        stack.enter_context(mock.patch.object(fa_utils, "prepare_fa_kwargs_from_position_ids",
                                              prepare_fa_kwargs_from_position_ids))
        try:
            fa_utils.lazy_import_flash_attention("flash_attention_2")
            model.config._attn_implementation = "flash_attention_2"
            yield
        finally:
            model.config._attn_implementation = saved_impl
