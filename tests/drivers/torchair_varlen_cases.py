"""Subprocess of tests/torchair/test_torchair_varlen.py: torchair's FX->GE conversion (off-NPU) of graphs holding
the varlen ops, with the GE graphs' FlashAttentionScore(Grad) / NonZero / RotaryMul(Grad) nodes described for the test.

    python tests/drivers/torchair_varlen_cases.py '["toy-train-bf16-static", ...]'

Prints one JSON line: ``{"unavailable": reason}`` when no torch_npu wheel can be obtained, else
``{"cases": {name: result}, "ir": {...}}``. Each case compiles with ``downstream="torchair"`` (torchair's
real AOTAutograd and converters, ``run_eagerly``: the FX graphs then run with the simulated ops) and
records the conversion (:class:`qwen_npu_compile.torchair.offline.GeResults`), the GE nodes of interest
(attributes, the op types feeding each input, Data placements), the seconds spent and the largest
deviation from the eager run. ``ir`` evaluates the GE subgraphs our converters build for the sequence
ends and the compressed causal mask with NumPy (a model of each GE op's documented semantics: TF slice
rules for StridedSliceV2, ``[N, rank]`` for NonZero) against the ops' own kernels.

Case names: ``toy-<infer|train>-<bf16|fp16|fp32>-<static|dynamic>`` (q/k/v projections and
``qwen_npu.varlen_attention`` with ``seq_ends`` a CPU int64 graph input), ``positions-<mode>-bf16-static``
(the same with ``seq_ends_from_positions(position_ids, "restart")`` in the graph), ``qwen2-<mode>-bf16-<shape>``
(a packed tiny Qwen2, whole-model compile) and ``layers-<mode>-bf16-static`` (the same model under
``maybe_compile``, one graph per decoder layer, offsets from the base model's pre-hook).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 64, 64
PACKINGS = ([5, 7, 4], [3, 3, 3, 5, 6])  # the dynamic cases run both (T 16 then 20, 3 then 5 sequences)
MODEL_PACKING = [13, 29, 6, 16]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INTERESTING = ("FlashAttentionScore", "FlashAttentionScoreGrad", "NonZero", "RotaryMul", "RotaryMulGrad")
CAPTURED: list[dict] = []


def _proto_dtype_name(value: int) -> str:
    from torchair._ge_concrete_graph.ge_ir_pb2 import DataType as ProtoDataType

    return ProtoDataType.Name(value)


def _digest(graph) -> dict:
    """The GE graph's nodes of :data:`INTERESTING`: attributes, each input's producer type, output metas."""
    ops = {op.name: op for op in graph.op}

    def producer(edge: str) -> dict | None:
        if not edge or edge.endswith(":-1"):
            return None
        op = ops[edge.rsplit(":", 1)[0]]
        found = {"type": op.type, "name": op.name}
        if op.type == "Data":
            desc = op.output_desc[0]
            found.update(placement=desc.device_type, dtype=_proto_dtype_name(desc.dtype), shape=list(desc.shape.dim))
        return found

    nodes = []
    for op in graph.op:
        if op.type not in INTERESTING:
            continue
        attrs = {key: (value.s.decode() if value.WhichOneof("value") == "s" else
                       value.i if value.WhichOneof("value") == "i" else
                       value.f if value.WhichOneof("value") == "f" else None)
                 for key, value in op.attr.items()
                 if key in ("input_layout", "sparse_mode", "head_num", "keep_prob", "scale_value", "inner_precise",
                            "pre_tockens", "next_tockens", "transpose")}
        inputs = {desc.name: producer(edge) for desc, edge in zip(op.input_desc, op.input)}
        outputs = [{"name": desc.name, "dtype": _proto_dtype_name(desc.dtype), "meta": desc.attr["_meta"].s.decode()}
                   for desc in op.output_desc]
        nodes.append({"type": op.type, "attrs": attrs, "inputs": inputs, "outputs": outputs})
    masks = sum(1 for op in graph.op if op.name.startswith("qwen_npu_compressed_causal_mask"))
    return {"name": graph.name, "nodes": nodes, "causal_masks": masks}


def _install_capture(fx2ge) -> None:
    cls = fx2ge.GeConcreteGraph
    original = cls.optimize_graph_without_runtime

    def optimize_and_capture(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        CAPTURED.append(_digest(self.graph))
        return result

    cls.optimize_graph_without_runtime = optimize_and_capture


# ----------------------------------------------------------------------------------------------------
# the cases


class Toy(torch.nn.Module):
    """q/k/v projections of x [T, HIDDEN] and varlen attention (GQA 4/2, head_dim 64)."""

    def __init__(self, dtype, from_positions: bool):
        super().__init__()
        self.q = torch.nn.Linear(HIDDEN, HEADS * HEAD_DIM, dtype=dtype)
        self.kv = torch.nn.Linear(HIDDEN, 2 * KV_HEADS * HEAD_DIM, dtype=dtype)
        self.from_positions = from_positions

    def forward(self, x, offsets):
        from qwen_npu_compile.ops.qwen_npu import varlen_attention

        tokens = x.shape[0]
        q = self.q(x).view(tokens, HEADS, HEAD_DIM)
        k, v = self.kv(x).view(tokens, 2, KV_HEADS, HEAD_DIM).unbind(1)
        ends = varlen_attention.SEQ_ENDS_OP(offsets, "restart") if self.from_positions else offsets
        out = varlen_attention.OP(q, k, v, ends, HEADS, HEAD_DIM ** -0.5)[0]
        return out.reshape(tokens, HEADS * HEAD_DIM)


def _toy_inputs(lens, dtype, train, from_positions, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), HIDDEN, generator=generator).to(dtype).requires_grad_(train)
    if from_positions:
        offsets = torch.cat([torch.arange(n) for n in lens])[None]
    else:
        offsets = torch.tensor(lens).cumsum(0)
    return x, offsets


def _toy_case(mode, dtype, shape, from_positions):
    train = mode == "train"
    torch.manual_seed(0)
    model = Toy(dtype, from_positions)
    compiled = torch.compile(model, backend="qwen_npu", options={"downstream": "torchair"},
                             dynamic=True if shape == "dynamic" else None)
    worst = 0.0
    for seed, lens in enumerate(PACKINGS if shape == "dynamic" else PACKINGS[:1]):
        x, offsets = _toy_inputs(lens, dtype, train, from_positions, seed)
        with torch.set_grad_enabled(train):
            got = compiled(x, offsets)
            expected = model(x, offsets)
            worst = max(worst, (got.float() - expected.float()).abs().max().item())
            if train:
                grad = torch.randn_like(got)
                got_dx = torch.autograd.grad(got, x, grad)[0]
                expected_dx = torch.autograd.grad(expected, x, grad)[0]
                worst = max(worst, (got_dx.float() - expected_dx.float()).abs().max().item())
    return worst


def _qwen2(dtype):
    from transformers import Qwen2ForCausalLM

    from qwen_npu_compile.cli.check.models import tiny_qwen2_config

    torch.manual_seed(0)
    config = tiny_qwen2_config(hidden_size=256, intermediate_size=512, num_attention_heads=HEADS,
                               num_key_value_heads=KV_HEADS, num_hidden_layers=2)
    return Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa").to(dtype)


def _packed_batch(packing):
    positions = torch.cat([torch.arange(n) for n in packing])[None]
    ids = torch.randint(0, 128, positions.shape, generator=torch.Generator().manual_seed(0))
    return ids, positions


def _model_step(model, train, packing=MODEL_PACKING):
    ids, positions = _packed_batch(packing)
    if train:
        model.train()
        loss = model(input_ids=ids, position_ids=positions, labels=ids).loss
        loss.backward()
        return loss.detach()
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, position_ids=positions).logits


def _model_case(kind, mode, dtype, shape):
    """Whole model (``qwen2``) or per decoder layer (``layers``); ``dynamic``: two packings of other T and
    sequence counts through ``torch.compile(dynamic=True)`` (whole model only: maybe_compile's own setting)."""
    import copy

    train = mode == "train"
    model = _qwen2(dtype)
    reference = copy.deepcopy(model)
    packings = [MODEL_PACKING, [11, 30, 7]] if shape == "dynamic" else [MODEL_PACKING]
    if kind == "qwen2":
        step = torch.compile(model, backend="qwen_npu", options={"downstream": "torchair"},
                             dynamic=True if shape == "dynamic" else None)
    else:
        from qwen_npu_compile import maybe_compile
        from qwen_npu_compile.worker import ENV_COMPILE

        os.environ[ENV_COMPILE] = "1"
        try:
            maybe_compile(model, {"downstream": "torchair"})
        finally:
            os.environ.pop(ENV_COMPILE)
        step = model
    worst = 0.0
    for packing in packings:
        got, expected = _model_step(step, train, packing), _model_step(reference, train, packing)
        worst = max(worst, (got.float() - expected.float()).abs().max().item())
    return worst


def run_case(name: str) -> dict:
    from qwen_npu_compile import get_reports
    from qwen_npu_compile.report import SUMMARY

    kind, mode, dtype_name, shape = name.split("-")
    torch._dynamo.reset()
    SUMMARY.clear()
    CAPTURED.clear()
    began = time.perf_counter()
    if kind == "toy":
        worst = _toy_case(mode, DTYPES[dtype_name], shape, from_positions=False)
    elif kind == "positions":
        # The backend inserts seq_ends_from_positions after Dynamo (patterns/attention/varlen.py), so its
        # graphs hold no runtime assert of the op's unbacked size; Dynamo tracing a user's call of it emits
        # `sym_size >= 1` asserts, which torchair 2.13.0 cannot interpret (operator.ge on its ValuePack).
        with torch._dynamo.config.patch(do_not_emit_runtime_asserts=True):
            worst = _toy_case(mode, DTYPES[dtype_name], shape, from_positions=True)
    else:
        worst = _model_case(kind, mode, DTYPES[dtype_name], shape)
    reports = get_reports()
    return {
        "seconds": round(time.perf_counter() - began, 2),
        "max_abs_error": worst,
        "reports": [{
            "downstream": report.downstream,
            "downstream_fallbacks": report.downstream_fallbacks,
            "fusions": report.fusions,
            "variants": dict(report.variants),
            "graphs": [{"kind": g.kind, "ops": g.ops, "seconds": round(g.seconds, 3)} for g in report.ge.graphs],
            "failures": [{"op": f.op, "error": f.error, "kind": f.kind} for f in report.ge.failures],
        } for report in reports],
        "ge_nodes": list(CAPTURED),
    }


# ----------------------------------------------------------------------------------------------------
# the GE subgraphs of our converters, evaluated with NumPy


def _evaluate(graph, output, feeds: dict[int, "object"]):
    """Value of GE tensor ``output`` ("name:index") in ``graph`` given ``{Data index: numpy array}``."""
    import numpy as np
    from torchair._ge_concrete_graph.ge_ir_pb2 import DataType as ProtoDataType

    numpy_types = {"DT_INT64": np.int64, "DT_INT32": np.int32, "DT_BOOL": np.bool_, "DT_FLOAT": np.float32}
    ops = {op.name: op for op in graph.op}
    cache: dict[str, object] = {}

    def value(edge: str):
        name, index = edge.rsplit(":", 1)
        if edge not in cache:
            cache[edge] = compute(ops[name])[int(index)]
        return cache[edge]

    def compute(op):
        args = [value(edge) for edge in op.input if edge and not edge.endswith(":-1")]
        kind = op.type
        if kind == "Data":
            return [feeds[op.attr["index"].i]]
        if kind == "Const":
            tensor = op.attr["value"].t
            dtype = numpy_types[ProtoDataType.Name(tensor.desc.dtype)]
            return [np.frombuffer(tensor.data, dtype=dtype).reshape(list(tensor.desc.shape.dim)).copy()]
        if kind == "Reshape":
            return [np.reshape(args[0], args[1])]
        if kind == "Cast":
            return [args[0].astype(numpy_types[ProtoDataType.Name(_proto_of(op.attr["dst_type"].i))])]
        if kind == "StridedSliceV2":  # x, begin, end, axes, strides: TF/Python slice rules on each axis
            x, begin, end, axes, strides = args
            index = [slice(None)] * x.ndim
            for b, e, a, s in zip(begin, end, axes, strides):
                index[int(a)] = slice(int(b), int(e), int(s))
            return [x[tuple(index)]]
        if kind in ("Sub", "Add", "NotEqual", "Equal", "Greater"):
            function = {"Sub": np.subtract, "Add": np.add, "NotEqual": np.not_equal, "Equal": np.equal,
                        "Greater": np.greater}[kind]
            return [function(args[0], args[1])]
        if kind == "NonZero":
            found = np.argwhere(args[0]).astype(np.int64)  # [N, rank]
            return [found.T if op.attr["transpose"].b else found]
        if kind == "Shape":
            return [np.array(args[0].shape, dtype=np.int64)]
        if kind == "ConcatV2":
            return [np.concatenate(args[:-1], axis=int(args[-1]))]
        if kind == "Range":
            return [np.arange(args[0], args[1], args[2])]
        raise NotImplementedError(f"no NumPy model of GE op {kind}")

    return value(output)


def _proto_of(ge_dtype: int) -> int:
    from torchair.ge._ge_graph import _ge_dtype_to_ge_proto_dtype

    return _ge_dtype_to_ge_proto_dtype(ge_dtype)


def ir_checks() -> dict:
    """Our converters' GE subgraphs for the sequence ends and the causal mask, evaluated with NumPy."""
    import numpy as np
    from torchair._ge_concrete_graph import ge_apis as ge
    from torchair.ge._ge_graph import GeGraph, default_ge_graph

    from qwen_npu_compile.ops.attention_contract import compressed_causal_mask
    from qwen_npu_compile.ops.qwen_npu import varlen_attention

    rows = [
        [0, 1, 2, 0, 1, 0, 1, 2, 3],
        [0, 1, 2, 7, 8, 0, 1],  # "restart": 3 sequences, "zero": 2
        [0, 1, 2, 3],
        [0],
        [5, 6, 0, 0, 0],  # restarts at every 0; the row need not start at 0
        [0, 1, 0, 1, 2, 3, 4, 5, 6, 0],
    ]
    converter = varlen_attention.SEQ_ENDS_OP._ge_converter
    results = {"rows": 0, "mismatches": []}
    for rule in varlen_attention.RULES:
        for dtype in (torch.int64, torch.int32):
            for row in rows:
                graph = GeGraph(name="qwen_npu_ir_check")
                with default_ge_graph(graph):
                    positions = ge.Data(index=0, dtype=ge.DataType.DT_INT64 if dtype == torch.int64 else ge.DataType.DT_INT32,
                                        shape=[1, -1], placement="CPU")
                    ends = converter(positions, rule, meta_outputs=None)
                feed = np.array([row], dtype=np.int64 if dtype == torch.int64 else np.int32)
                got = _evaluate(graph, ends.tensor, {0: feed}).tolist()
                expected = varlen_attention.seq_ends_from_positions(torch.tensor([row], dtype=dtype), rule).tolist()
                results["rows"] += 1
                if got != expected:
                    results["mismatches"].append({"rule": rule, "dtype": str(dtype), "row": row, "ge": got,
                                                  "kernel": expected})
    from qwen_npu_compile.ops.qwen_npu import varlen_attention_ge as ge_converters_varlen

    graph = GeGraph(name="qwen_npu_mask_check")
    with default_ge_graph(graph):
        mask = ge_converters_varlen._causal_mask(ge)
        again = ge_converters_varlen._causal_mask(ge)
    value = _evaluate(graph, mask.tensor, {})
    results["mask_equal"] = bool(value.dtype == np.bool_ and
                                 np.array_equal(value, compressed_causal_mask("cpu").numpy()))
    results["mask_shape"] = list(value.shape)
    results["mask_built_once"] = again is mask and sum(op.type == "Greater" for op in graph.op) == 1
    return results


def main(argv: list[str]) -> int:
    from qwen_npu_compile.torchair.offline import TorchairUnavailableError, load_offline_torchair

    try:
        load_offline_torchair()
    except TorchairUnavailableError as exc:
        print(json.dumps({"unavailable": str(exc)}))
        return 0
    _install_capture(sys.modules["torchair._ge_concrete_graph.fx2ge_converter"])
    began = time.perf_counter()
    out = {"ir": ir_checks(), "cases": {}}
    for name in json.loads(argv[0]):
        out["cases"][name] = run_case(name)
    out["seconds"] = round(time.perf_counter() - began, 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
