"""What autograd saves for the backward of a block of code, counted by storage: the activation memory benchmark's
measurement (:mod:`benchmarks.activation_memory`).

Two independent counts, both in bytes (whole storages: ``untyped_storage().nbytes()``, each storage once, views
sharing their base's):

* :class:`SavedStorages`: the tensors ``torch.autograd.graph.saved_tensors_hooks``' pack hook sees while the block
  runs (ATen ops' saved variables, ``ctx.save_for_backward`` of custom functions and of AOTAutograd's compiled
  function, checkpoint's saved inputs); :func:`split_saved` sorts them into parameters, per-forward shared inputs,
  the layer input and the layer's own activations.
* :func:`graph_saved`: an AOT partition's saved tensors read from its graphs, the backward graph's non-tangent inputs
  traced through views to the forward node that made each buffer.

Under :class:`~torch._subclasses.fake_tensor.FakeTensorMode` a fake tensor has a storage of the real size and views
share it, so both counts are those of a real run at the same shapes (the benchmark cross-checks it on small ones).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef


def _storage_key(tensor: torch.Tensor) -> int:
    """One key per storage (fake tensors have storages too; views share their base's)."""
    return StorageWeakRef(tensor.untyped_storage()).cdata


def _storage_bytes(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().nbytes())


class SavedStorages:
    """The storages autograd saves for the backward inside the block (``saved_tensors_hooks``), by storage.

    ``entries[key] = {"bytes": storage bytes, "tensors": [(shape, dtype, producer)]}``; the tensors are kept
    referenced until :meth:`release`, so that no storage key is reused while counting.
    """

    def __init__(self):
        self.entries: dict[int, dict] = {}
        self._keep: list[torch.Tensor] = []

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        entry = self.entries.setdefault(key, {"bytes": _storage_bytes(tensor), "tensors": []})
        producer = type(tensor.grad_fn).__name__ if tensor.grad_fn is not None else None
        entry["tensors"].append((tuple(int(s) for s in tensor.shape), str(tensor.dtype).replace("torch.", ""),
                                 producer))
        self._keep.append(tensor)
        return tensor

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield

    def release(self) -> None:
        self._keep.clear()



def split_saved(saved: SavedStorages, params: Sequence[torch.Tensor], layer_input: torch.Tensor,
                shared: Sequence[torch.Tensor]) -> dict:
    """Sort the saved storages into parameters, per-forward shared inputs, the layer input and the layer's own.

    Returns:
        ``{"activation_bytes", "activation_excluding_input_bytes", "layer_input_bytes", "constant_bytes", "storages",
        "excluded": {"parameter_bytes", "shared_input_bytes"}, "tensors": [...]}``; bytes are ints.
        ``constant_bytes``: the part of ``activation_bytes`` that does not grow with the tokens, the compressed causal
        mask (:data:`COMPRESSED_MASK_SHAPE`) a per-layer graph builds and saves. ``tensors`` lists every counted
        storage (``bytes``, ``shape``, ``dtype``, ``producer``: the autograd node that made it, None for a tensor
        made without grad or by a compiled graph, whose producers :func:`graph_saved` names; ``role``; ``saved_as``:
        how many saved tensors view it), largest first.
    """
    param_keys = {_storage_key(p) for p in params}
    input_key = _storage_key(layer_input)
    shared_keys = {_storage_key(t) for t in shared} - {input_key}
    out = {"activation_bytes": 0, "activation_excluding_input_bytes": 0, "layer_input_bytes": 0, "constant_bytes": 0,
           "storages": 0,
           "excluded": {"parameter_bytes": 0, "shared_input_bytes": 0}, "tensors": []}
    for key, entry in saved.entries.items():
        if key in param_keys:
            out["excluded"]["parameter_bytes"] += entry["bytes"]
            continue
        if key in shared_keys:
            out["excluded"]["shared_input_bytes"] += entry["bytes"]
            continue
        role = "layer input" if key == input_key else "activation"
        shape, dtype, producer = entry["tensors"][0]
        if (shape, dtype) == (COMPRESSED_MASK_SHAPE, "bool"):
            role = "compressed causal mask"
            out["constant_bytes"] += entry["bytes"]
        out["activation_bytes"] += entry["bytes"]
        out["storages"] += 1
        if role == "layer input":
            out["layer_input_bytes"] += entry["bytes"]
        else:
            out["activation_excluding_input_bytes"] += entry["bytes"]
        out["tensors"].append({"bytes": entry["bytes"], "shape": list(shape), "dtype": dtype, "producer": producer,
                               "role": role, "saved_as": len(entry["tensors"])})
    out["tensors"].sort(key=lambda t: -t["bytes"])
    return out


#: ``npu_fusion_attention``'s compressed causal mask (sparse modes 2/3: ``[2048, 2048]`` bool, torch_npu 2.13.0 docs):
#: the one saved storage whose size does not grow with the tokens.
COMPRESSED_MASK_SHAPE = (2048, 2048)

_VIEW_LIKE = frozenset({torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default})


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose output buffer ``node`` views (through view ops), at runtime the same storage."""
    while (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
           and (node.target.is_view or node.target in _VIEW_LIKE)):
        node = node.args[0]
    return node


def graph_saved(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule) -> dict:
    """What an AOT partition saves, from its graphs: the backward graph's inputs other than tangents, each
    traced through views to the forward node that made its buffer (one entry per buffer).

    Returns:
        ``{"intermediate_bytes": bytes of buffers made in the forward graph, "input_saved": [shapes of forward
        graph inputs saved (parameters, the layer input, cos/sin)], "tensors": [{"node", "op", "shape", "dtype",
        "bytes"}], largest first}``.
    """
    nodes = {node.name: node for node in forward.graph.nodes}
    seen: dict[torch.fx.Node, dict] = {}
    inputs = []
    for placeholder in backward.graph.find_nodes(op="placeholder"):
        if placeholder.name.startswith("tangents") or not isinstance(placeholder.meta.get("val"), torch.Tensor):
            continue
        base = _base(nodes[placeholder.name])
        value = base.meta["val"]
        if base.op == "placeholder":
            inputs.append([int(s) for s in value.shape])
            continue
        if base not in seen:
            seen[base] = {"node": base.name, "op": str(base.target), "shape": [int(s) for s in value.shape],
                          "dtype": str(value.dtype).replace("torch.", ""),
                          "bytes": int(value.untyped_storage().nbytes())}
    tensors = sorted(seen.values(), key=lambda t: -t["bytes"])
    return {"intermediate_bytes": sum(t["bytes"] for t in tensors), "input_saved": inputs, "tensors": tensors}
