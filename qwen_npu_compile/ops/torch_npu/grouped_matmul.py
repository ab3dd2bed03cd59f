"""``npu_grouped_matmul``: the stand-in with torch_npu's schema, and the kernel's limits.

**``npu_grouped_matmul``** (torch_npu 2.13.0, schema from ``npu_native_functions_by_codegen.yaml``; meta
kernel ``op_plugin/meta/_meta_registrations.py``; semantics and limits ``_op_plugin_docs.py``) multiplies
row groups of ``x`` by per-group weights. The stand-in implements the two forms MoE training uses, with a
single ``x`` and a single ``weight`` and ``split_item`` 2 or 3 (one output tensor); other forms raise:

- ``group_type=0`` (M-axis groups): ``x [M, K]``, ``weight [E, K, N]``, ``group_list`` int64 ``[E]``;
  ``y [M, N]`` with ``y[s_e:t_e] = x[s_e:t_e] @ weight[e]``;
- ``group_type=2`` (K-axis groups, the weight gradient): ``x [K, M]``, ``weight [M, N]``;
  ``y [E, K, N]`` with ``y[e] = x[:, s_e:t_e] @ weight[s_e:t_e]`` (0 for an empty group).

``group_list_type=0``: ``group_list`` holds the cumulative group ends (the last == M); ``1``: the group
sizes. torch_npu gives the op no autograd (op-plugin ``derivatives.yaml``).

The project's op with autograd around it is :mod:`qwen_npu_compile.ops.qwen_npu.grouped_matmul`. The kernel's limits:
:func:`grouped_matmul_violation` (the one home of them) and :func:`npu_call_violation`.
"""

from __future__ import annotations

import torch

from qwen_npu_compile.compat import guard_or_false
from qwen_npu_compile.ops.define import define_op

#: torch_npu 2.13.0's schema, verbatim (``tests/torchair/test_torchair_offline.py`` compares it with the wheel's).
NPU_SCHEMA = (
    "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
    "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
    "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
    "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
    "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
    "int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, "
    "int? per_token_scale_dtype=None) -> Tensor[]"
)

#: x/weight dtypes of the non-quantized kernel (torch_npu 2.13.0 docs, "非量化": fp16, bf16, fp32; one
#: dtype for x, weight and y).
SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
#: Most groups (experts) of ``group_type=0`` with a single 3-D weight: "group_list第1维最大支持1024".
MAX_GROUPS = 1024
#: "内轴限制InnerLimit为65536": every x's and weight's last dim (K of x, N of weight, or K of a
#: transposed weight; M of a transposed x, as the weight gradient passes) must be below it.
INNER_LIMIT = 65536
#: ``group_list``'s dtype: "数据类型支持torch.int64" (VeOmni: int32 raises EZ1001 on hardware).
GROUP_LIST_DTYPE = torch.int64


def is_transposed(weight: torch.Tensor) -> bool:
    """A ``[..., K, N]`` tensor that is a transposed view (the meta kernel's ``is_transpose_weight``)."""
    return weight.dim() >= 2 and weight.stride()[-2] == 1 and weight.stride()[-1] == weight.shape[-2]


def grouped_matmul_violation(x, weight, group_list, *, backward: bool = False,
                             downstream: str | None = None) -> str | None:
    """Why ``qwen_npu::grouped_matmul(x, weight, group_list)`` (and, with ``backward``, its two backward
    grouped matmuls) would fail, or None: the one home of the limits, used by the kernels, the fake
    kernels, ``patterns/moe.py`` and the GE conversion check (:mod:`.limits`).

    Limits (torch_npu 2.13.0 ``npu_grouped_matmul`` docs, non-quantized, group_type 0, "单单单"): x 2-D
    ``[M, K]``; weight 3-D ``[E, K, N]`` (a transposed view is supported); group_list 1-D int64 ``[E]``,
    ``E <= MAX_GROUPS``; x and weight of one dtype in :data:`SUPPORTED_DTYPES`, on one device; K and N
    below :data:`INNER_LIMIT`; with ``backward`` also M below it (the weight gradient passes ``x.t()``,
    whose last dim is M; ``group_type=2`` is in the meta kernel and used by verl, its limits are not
    documented). The values of group_list (non-decreasing, the last == M) are a runtime contract: the
    stand-in checks them, the real kernel's behaviour otherwise is undefined. torchair's converter
    (``ge_converter/custom/grouped_matmul.py``) passes the arguments through, so ``downstream`` adds
    nothing.

    Args:
        x, weight, group_list: tensors or FakeTensors (sizes may be symbolic).
        backward: also check the backward's grouped matmuls (a training graph).
        downstream: the backend the graph is handed to (no extra limits today).

    Returns:
        None when supported, else a one-line reason.
    """
    del downstream
    if not all(isinstance(t, torch.Tensor) for t in (x, weight, group_list)):
        return "x, weight and group_list must be tensors"
    if x.dim() != 2 or weight.dim() != 3:
        return f"x must be 2-D [M, K] and weight 3-D [E, K, N], got {tuple(x.shape)} and {tuple(weight.shape)}"
    if group_list.dim() != 1 or group_list.dtype != GROUP_LIST_DTYPE:
        return f"group_list must be 1-D {GROUP_LIST_DTYPE}, got {group_list.dtype} {tuple(group_list.shape)}"
    if not guard_or_false(group_list.shape[0] == weight.shape[0]):
        return f"group_list has {group_list.shape[0]} groups but weight {weight.shape[0]} experts"
    if not guard_or_false(weight.shape[0] <= MAX_GROUPS):
        return f"{weight.shape[0]} groups; npu_grouped_matmul takes at most {MAX_GROUPS}"
    if not guard_or_false(x.shape[1] == weight.shape[1]):
        return f"x's K {x.shape[1]} != weight's K {weight.shape[1]}"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"unsupported dtype {x.dtype}; npu_grouped_matmul takes fp16, bf16, fp32"
    if weight.dtype != x.dtype:
        return f"dtypes differ (x {x.dtype}, weight {weight.dtype}); cast them to one dtype"
    if weight.device != x.device:
        return f"devices differ (x {x.device}, weight {weight.device})"
    weight_inner = weight.shape[1] if is_transposed(weight) else weight.shape[2]
    inner = [("x's K", x.shape[1]), ("weight's last dim", weight_inner)]
    if backward:
        inner += [("M (the weight gradient's x.t() last dim)", x.shape[0]), ("N", weight.shape[2])]
    for what, size in inner:
        if not guard_or_false(size < INNER_LIMIT):
            return f"{what} is {size}; npu_grouped_matmul needs it below {INNER_LIMIT} (InnerLimit)"
    return None


# --------------------------------------------------------------------------------------------------
# the npu_grouped_matmul stand-in


def _group_ends(group_list: torch.Tensor, group_list_type: int | None, rows: int) -> list[int]:
    if group_list.dtype != GROUP_LIST_DTYPE:
        raise RuntimeError(f"npu_grouped_matmul: group_list must be int64, got {group_list.dtype}")
    values = group_list.tolist()
    if group_list_type == 1:
        if any(v < 0 for v in values):
            raise RuntimeError("npu_grouped_matmul: group sizes must be non-negative")
        ends, total = [], 0
        for v in values:
            total += v
            ends.append(total)
    elif group_list_type in (0, None):
        ends = values
        if any(b < a for a, b in zip([0, *ends], ends)):
            raise RuntimeError("npu_grouped_matmul: group_list (group_list_type=0) must be non-decreasing and >= 0")
    else:
        raise RuntimeError(f"npu_grouped_matmul: group_list_type must be 0 or 1, got {group_list_type}")
    if ends and ends[-1] != rows:
        raise RuntimeError(f"npu_grouped_matmul: the groups cover {ends[-1]} rows, the grouped axis has {rows}")
    return ends


def _supported_form(x, weight, group_list, split_item, group_type, unsupported) -> None:
    if any(value is not None for value in unsupported):
        raise NotImplementedError("npu_grouped_matmul stand-in: only the non-quantized form without bias/activation")
    if len(x) != 1 or len(weight) != 1 or split_item not in (2, 3) or group_list is None:
        raise NotImplementedError(
            "npu_grouped_matmul stand-in: only a single x, a single weight, split_item 2/3 and a group_list tensor"
        )
    if group_type == 0 and not (x[0].dim() == 2 and weight[0].dim() == 3):
        raise RuntimeError("npu_grouped_matmul: group_type=0 needs x [M, K] and weight [E, K, N]")
    if group_type == 2 and not (x[0].dim() == 2 and weight[0].dim() == 2):
        raise RuntimeError("npu_grouped_matmul: group_type=2 needs x [K, M] and weight [M, N]")
    if group_type not in (0, 2):
        raise NotImplementedError(f"npu_grouped_matmul stand-in: group_type {group_type} (0 and 2 are implemented)")
    if x[0].dtype not in SUPPORTED_DTYPES or weight[0].dtype != x[0].dtype:
        raise RuntimeError(f"npu_grouped_matmul: x {x[0].dtype} and weight {weight[0].dtype} must be one of fp16/bf16/fp32")


def reference_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                             antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                             activation_quant_scale=None, activation_quant_offset=None, split_item=0,
                             group_type=None, group_list_type=0, act_type=0, tuning_config=None, output_dtype=None,
                             x_dtype=None, weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None):
    """CPU reference of ``npu_grouped_matmul`` for ``group_type`` 0 and 2 (module docstring).

    Each group is one ``torch.mm`` in the input dtype (as ``aten._grouped_mm``'s CPU path computes it).

    Returns:
        ``[y]``: ``[M, N]`` (group_type 0) or ``[E, K, N]`` (group_type 2), x's dtype.

    Raises:
        NotImplementedError: a form the stand-in does not implement (quantized, bias, several tensors).
        RuntimeError: broken limits (dtypes, shapes, group_list not int64, groups not covering the axis).
    """
    unsupported = (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input,
                   activation_quant_scale, activation_quant_offset, output_dtype, x_dtype, weight_dtype,
                   scale_dtype, per_token_scale_dtype)
    _supported_form(x, weight, group_list, split_item, group_type, unsupported)
    if act_type not in (0, None):
        raise NotImplementedError("npu_grouped_matmul stand-in: act_type must be 0")
    a, b = x[0], weight[0]
    if group_type == 0:
        ends = _group_ends(group_list, group_list_type, a.shape[0])
        if len(ends) != b.shape[0] or len(ends) > MAX_GROUPS:
            raise RuntimeError(f"npu_grouped_matmul: {len(ends)} groups for {b.shape[0]} weights (at most {MAX_GROUPS})")
        out = a.new_empty((a.shape[0], b.shape[2]))
        start = 0
        for e, end in enumerate(ends):
            if end > start:
                torch.mm(a[start:end], b[e], out=out[start:end])
            start = end
        return [out]
    ends = _group_ends(group_list, group_list_type, a.shape[1])
    out = a.new_zeros((len(ends), a.shape[0], b.shape[1]))
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            torch.mm(a[:, start:end], b[start:end], out=out[e])
        start = end
    return [out]


def _fake_grouped_matmul(x, weight, *, group_list=None, split_item=0, group_type=None, **kwargs):
    unsupported = [kwargs.get(name) for name in ("bias", "scale", "offset", "antiquant_scale", "antiquant_offset",
                                                  "per_token_scale", "activation_input", "activation_quant_scale",
                                                  "activation_quant_offset", "output_dtype", "x_dtype",
                                                  "weight_dtype", "scale_dtype", "per_token_scale_dtype")]
    _supported_form(x, weight, group_list, split_item, group_type, unsupported)
    a, b = x[0], weight[0]
    if group_type == 0:
        return [a.new_empty((a.shape[0], b.shape[2]))]
    return [a.new_empty((group_list.shape[0], a.shape[0], b.shape[1]))]


def register(lib: torch.library.Library) -> None:
    """Define the ``npu_grouped_matmul`` stand-in in ``lib`` (the ``npu`` namespace): kernel and fake; no
    autograd, as in torch_npu."""
    define_op(lib, NPU_SCHEMA, reference_grouped_matmul, _fake_grouped_matmul)


def npu_call_violation(x, weight, group_list, group_type, *, downstream: str | None = None) -> str | None:
    """Why a call ``npu_grouped_matmul(x, weight, group_list=..., group_type=...)`` of the two forms this
    project emits (the forward and dx: ``group_type=0``; dW: ``group_type=2``) would fail, or None; the
    limits are :func:`grouped_matmul_violation`'s.

    Args:
        x, weight: the op's tensor lists (tensors or FakeTensors).
        group_list: the group ends tensor; group_type: 0 or 2.
        downstream: the backend the graph is handed to.
    """
    if len(x) != 1 or len(weight) != 1:
        return "only a single x and a single weight are emitted"
    a, b = x[0], weight[0]
    if group_type == 0:
        return grouped_matmul_violation(a, b, group_list, downstream=downstream)
    if group_type != 2:
        return f"group_type {group_type} is not emitted (0 and 2 are)"
    if a.dim() != 2 or b.dim() != 2:
        return f"group_type=2 needs x [K, M] and weight [M, N], got {tuple(a.shape)} and {tuple(b.shape)}"
    # the weight gradient of grouped_matmul(x [M, K], w [E, K, N]): x.t() [K, M] and g [M, N]
    as_forward = grouped_matmul_violation(a.t(), b.new_empty((group_list.shape[0], a.shape[0], b.shape[1])),
                                          group_list, backward=True, downstream=downstream)
    return as_forward
