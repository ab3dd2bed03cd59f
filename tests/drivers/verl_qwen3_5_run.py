"""Driver of tests/integrations/test_verl_qwen3_5.py: verl 0.9.1's packed Qwen3.5 path on a tiny Qwen3.5, with or without
``QWEN_NPU_COMPILE=1``, or each sequence run alone (the per-sequence truth).

verl's own functions are installed as its ``apply_monkey_patch`` installs them for ``qwen3_5``
(``verl/models/transformers/monkey_patch.py``: ``Qwen3_5DecoderLayer.forward`` and ``Qwen3_5GatedDeltaNet.forward``),
and every step is what verl's FSDP engine hands the model with ``use_remove_padding`` (its default):
``input_ids``/``position_ids`` ``[1, T]`` restarting per sequence, ``attention_mask=None``, ``cu_seqlens`` and
``cu_seqlens_cpu`` (``workers/engine/fsdp/transformer_impl.py``), flash_attention_2 through transformers' own
NPU flash-attention functions on the simulated npu ops, gradient checkpointing. ``N`` packings of 1-4 sequences
of 1-89 tokens (a new T and a new number of sequences nearly every step). The loss is the sum over tokens of the
logits' logsumexp divided by T, so a packing's loss and gradients are the sums of its sequences' run alone.
Writes losses, gradient norms, the compiled graphs' fusions and the expected per-layer counts to ``argv[1]``, and
the first ``LOGITS`` packings' logits per sequence to ``argv[1]`` + ``.pt``.

Environment: ``QWEN_NPU_COMPILE`` (1: maybe_compile the layers), ``DT`` (``bf16`` or fp32), ``N`` (packings),
``ALONE`` (1: run each sequence of a packing alone, eager), ``FLA`` (1: bind an FLA-like ``@torch.compiler.disable``
``chunk_gated_delta_rule`` of FLA 0.5.2's signature on every DeltaNet module, as transformers 5.10.4 binds FLA where
it is available), ``QWEN_NPU_FUSIONS``.
"""
import itertools
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import transformers
import verl.models.transformers.qwen3_5 as VQ
from transformers.models.qwen3_5 import modeling_qwen3_5 as M

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.helpers
from tests.helpers.fla import fla_like_chunk_gated_delta_rule as fla_like_kernel
from tests.helpers.npu_host import simulated_npu_host

LOGITS = 3
FLA_CALLS = []
fla_like_chunk_gated_delta_rule = fla_like_kernel(FLA_CALLS)


def build(dtype):
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=1024)
    m = transformers.Qwen3_5ForCausalLM._from_config(cfg, attn_implementation="flash_attention_2")
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n and n.endswith("weight"):
                p.normal_(0.0 if "linear_attn" not in n else 1.0, 0.5)
            if n.endswith("conv1d.weight"):
                p.normal_(0.0, 0.5)  # a conv that mixes neighbours visibly (a leak across sequences shows)
    if os.environ.get("FLA") == "1":
        for module in m.modules():
            if isinstance(module, M.Qwen3_5GatedDeltaNet):
                module.chunk_gated_delta_rule = fla_like_chunk_gated_delta_rule
    return m.to(dtype)

def packings(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        k = int(torch.randint(1, 5, (1,), generator=g))
        lens = torch.randint(1, 90, (k,), generator=g).tolist()
        yield lens

def step(model, lens, alone):
    """A packing: packed (one row) or each sequence alone, with the same token ids per sequence."""
    T = sum(lens)
    ids = torch.randint(0, 512, (1, T), generator=torch.Generator().manual_seed(T))
    if not alone:
        loss, logits = run_ids(model, ids, lens, T)
        return loss, list(logits.split(lens))
    losses, logits, start = 0.0, [], 0
    for l in lens:
        loss, out = run_ids(model, ids[:, start:start + l], [l], T)
        losses += loss
        logits.append(out)
        start += l
    return losses, logits

def run_ids(model, ids, lens, total):
    pos = torch.cat([torch.arange(l) for l in lens])[None]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    out = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False, cu_seqlens=cu,
                cu_seqlens_cpu=cu.clone())
    loss = out.logits.float().logsumexp(-1).sum() / total
    loss.backward()
    return float(loss), out.logits.detach()[0]

if __name__ == "__main__":
    on = os.environ.get("QWEN_NPU_COMPILE") == "1"
    alone = os.environ.get("ALONE") == "1"
    dtype = torch.bfloat16 if os.environ.get("DT") == "bf16" else torch.float32
    M.Qwen3_5DecoderLayer.forward = VQ.qwen3_5_decoder_layer_forward
    M.Qwen3_5GatedDeltaNet.forward = VQ.qwen3_5_gated_delta_net_forward
    logging.basicConfig(level=logging.WARNING); logging.getLogger("qwen_npu_compile").setLevel(os.environ.get("QLOG", "WARNING"))
    with simulated_npu_host():
        model = build(dtype)
        model.gradient_checkpointing_enable()
        model.train()
        model.config.use_cache = False
        if on:
            from qwen_npu_compile import maybe_compile
            from qwen_npu_compile.report import SUMMARY
            compiled = maybe_compile(model)
        losses, logits = [], []
        t = time.time()
        for i, lens in enumerate(packings(int(os.environ.get("N", "10")))):
            loss, per_sequence = step(model, lens, alone)
            losses.append(loss)
            if i < LOGITS:
                logits.append([x.float() for x in per_sequence])
        grads = {n: p.grad.float().norm().item() for n, p in model.named_parameters() if p.grad is not None}
        res = {"losses": losses, "grads": grads, "seconds": time.time() - t, "fla_calls": FLA_CALLS}
        if on:
            from qwen_npu_compile.patterns import expected_fusions

            res["compiled"] = compiled
            res["graphs"] = [(r.name, r.fusions) for r in SUMMARY.graphs]
            res["expected"] = {kind: expected_fusions(model.config, per_layer=True, layer_type=kind)
                               for kind in ("linear_attention", "full_attention")}
        json.dump(res, open(sys.argv[1], "w"))
        torch.save({"logits": logits, "grads": {n: p.grad.float() for n, p in model.named_parameters()
                                                if p.grad is not None}}, sys.argv[1] + ".pt")
