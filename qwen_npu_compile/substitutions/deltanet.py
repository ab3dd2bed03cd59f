"""The Gated DeltaNet inside the graph, per packed sequence: Dynamo substitutions that put
``qwen_npu::chunk_gated_delta_rule`` where transformers' and verl's DeltaNet code runs the chunked delta rule.

Without this, a Qwen3.5 / Qwen3-Next linear-attention layer reaches the graph as transformers'
``torch_chunk_gated_delta_rule`` traced op by op (a ``T/64``-step scan unrolled into ``select_scatter``
copies, the graph specialised on ``T``), or as a graph break at FLA's ``@torch.compiler.disable`` kernel, and
verl 0.9.1's packed forward breaks the graph at ``int(cu_seqlens[-1].item())`` and splits the row on the host
with ``.tolist()`` (a recompile per packing). Installed once per process by :func:`install`, these change only
what Dynamo traces; eager calls run the original code untouched.

**One semantics: each packed sequence runs as if alone** (its conv and its recurrent state start from zero),
as FLA's kernel, transformers <= 5.8.1 + verl and the op's reference compute it. Eager does not everywhere
(upstream defects; one warning per process names the versions): transformers 5.9-5.10.4 + verl 0.9.1 hand
``cu_seqlens`` to the torch fallback, which ignores it (the state leaks into the next sequence); transformers
5.24's hub wrapper raises ``ValueError`` for ``cu_seq_lens_q`` without FLA, and with FLA runs the conv across
sequence boundaries; a row packed only by ``position_ids`` reaches transformers' DeltaNet as one sequence (under
``maybe_compile`` the pre-hook passes its sequence ends; in a whole-model graph the fuse stage gives the op the
ends of attention's packing proof and restarts the conv: ``patterns/gated_delta_rule_packed.py``, which warns
through :func:`warn_eager_differs_for_positions`).

1. **transformers' torch reference** ``torch_chunk_gated_delta_rule`` of ``modeling_qwen3_5``,
   ``modeling_qwen3_5_moe`` and ``modeling_qwen3_next`` (5.10.4 and 4.57.6 bind it to
   ``self.chunk_gated_delta_rule``; 5.24 calls it module-level, where it is the hub wrapper that dispatches to
   FLA when FLA imported) is registered with ``torch.compiler.substitute_in_graph``: Dynamo traces
   ``_traced_chunk_gated_delta_rule`` (built by :func:`_substitute_for`) instead, one ``qwen_npu.chunk_gated_delta_rule`` call with GQA
   expanded in ATen and the packed row's offsets (``cu_seqlens`` / ``cu_seq_lens_q``, or the host sequence ends
   that :mod:`.varlen_attention`'s pre-hook proves from ``position_ids`` and passes down as ``qwen_npu_seq_ends``) as a
   tensor. transformers 5.24's module-level ``causal_conv1d_fn`` (the hub wrapper, which drops the offsets) is
   substituted alike (``_traced_causal_conv1d_fn``, built by :func:`_conv_substitute_for`): the conv restarts per sequence. FLA's
   ``chunk_gated_delta_rule`` (``@torch.compiler.disable``), where transformers 5.10.4 / 4.57.6 import it
   module-level and bind it on the module, is substituted too (:func:`_fla_substitute_for`), so an FLA-bound
   DeltaNet keeps the op in the graph; its offsets are FLA's own ``cu_seqlens``.
2. **verl 0.9.1's packed forward** ``qwen3_5_gated_delta_net_forward``
   (``verl/models/transformers/qwen3_5.py``, installed by verl as ``Qwen3_5GatedDeltaNet.forward`` and
   ``Qwen3_5MoeGatedDeltaNet.forward``): Dynamo cannot substitute a module's ``forward`` (it inlines the class
   attribute directly), so the class attribute is wrapped (:func:`_verl_forward_takeover`). Eager calls go to
   verl's function unchanged. A compiled packed call that :func:`packed_call_refusal` accepts (``cu_seqlens``
   given, no cache, batch 1, Ulysses sp 1, the family on; whatever kernel is bound on the module: FLA,
   ``causal-conv1d`` or the torch fallback) runs :func:`_traced_packed_forward`: verl's arithmetic with the
   offsets kept a tensor (the conv by :func:`packed_causal_conv1d`, the delta rule by the op with
   ``cu_seqlens``), no ``.item()``, no ``.tolist()``. A compiled packed call it declines (the family off, Ulysses
   sp > 1: verl 0.9.1 runs Qwen3.5 context parallelism through FLA's ``cp_context``) runs verl's own function
   outside the graph (``torch.compiler.disable``: one graph break around the DeltaNet), so the offsets that
   :func:`~qwen_npu_compile.substitutions.varlen_attention.packed_layer_call` marks unbacked never reach verl's
   ``.tolist()`` (which raised ``GuardOnDataDependentSymNode``); a layer whose DeltaNet still runs verl's
   forward untaken (:func:`offsets_traceable`) gets no such mark.

What this relies on is checked by :func:`install` (parameter names of the substituted functions, the
attributes of the DeltaNet module, verl's forward signature); a mismatch refuses that substitution with one
warning naming the versions, and the code runs as before. Nothing here crashes a training step.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from qwen_npu_compile.ops.qwen_npu import gated_delta_rule as op_module

log = logging.getLogger("qwen_npu_compile")

#: transformers modules whose ``torch_chunk_gated_delta_rule`` is substituted.
TRANSFORMERS_MODULES = (
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.qwen3_next.modeling_qwen3_next",
)

#: verl's packed Qwen3.5 module and the function it installs as ``Qwen3_5GatedDeltaNet.forward``.
VERL_MODULE = "verl.models.transformers.qwen3_5"
VERL_FORWARD = "qwen3_5_gated_delta_net_forward"
#: The DeltaNet classes whose ``forward`` verl 0.9.1's ``apply_monkey_patch`` sets to :data:`VERL_FORWARD`.
VERL_CLASSES = (
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
)

#: Parameters of transformers' ``torch_chunk_gated_delta_rule`` the substitute reads (4.57.6, 5.10.4, 5.24.0).
_HF_PARAMETERS = ("query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
                  "use_qk_l2norm_in_kernel")
#: Leading parameters of FLA's ``chunk_gated_delta_rule`` (0.5.x, 0.6.0) the FLA substitute reads.
_FLA_PARAMETERS = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                   "use_qk_l2norm_in_kernel")
#: Leading parameters of transformers >= 5.15's module-level ``causal_conv1d_fn`` (the hub wrapper's torch function).
_CONV_PARAMETERS = ("hidden_states", "weight", "bias", "activation")
#: Parameters of verl 0.9.1's ``qwen3_5_gated_delta_net_forward``.
_VERL_PARAMETERS = ("self", "hidden_states", "cache_params", "attention_mask", "cu_seqlens", "cu_seqlens_cpu")
#: Attributes of the DeltaNet module the traced packed forward reads.
_MODULE_ATTRIBUTES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm",
                      "out_proj", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "num_k_heads", "num_v_heads",
                      "activation", "causal_conv1d_fn", "chunk_gated_delta_rule")

#: Whether traced code takes the substitutes (the ``gated_delta_rule`` family's switch, set by :func:`install`).
_enabled = True
#: What :func:`install` put in place, by key (``"<module>.<function>"``).
_installed: dict[str, str] = {}
#: What eager transformers does with a packed row's offsets, by module (for :func:`warn_eager_differs`).
_eager_behaviour: dict[str, str] = {}
#: Refusals already logged.
_refused: set[str] = set()
#: How transformers bound ``torch_chunk_gated_delta_rule``, by module (:func:`resolve_binding`'s kind).
_bindings: dict[str, str] = {}


def _versions() -> str:
    import transformers

    verl = sys.modules.get("verl")
    return f"transformers {transformers.__version__}" + (f", verl {getattr(verl, '__version__', '?')}" if verl else "")


#: Why a substitution could not be set up, by key: the one warning's text, also named by the family's near miss.
_setup_problems: dict[str, str] = {}


def _refuse(key: str, reason: str) -> None:
    if key not in _refused:
        _refused.add(key)
        _setup_problems[key] = f"{key}: {reason} ({_versions()})"
        log.warning("qwen_npu: the gated_delta_rule family cannot fuse the Gated DeltaNet, which keeps its traced "
                    "Python code (%s): %s (%s)", key, reason, _versions())


def setup_problems() -> list[str]:
    """Why substitutions could not be set up in this process (one line each; empty when all were): what a graph
    whose delta rule was traced as Python names as the cause (``patterns/gated_delta_rule.py``)."""
    return list(_setup_problems.values())


def _unsubstituted(function: types.FunctionType) -> types.FunctionType:
    """A copy of ``function`` (same code, globals, defaults, closure) that Dynamo inlines as it is: the way back
    to the original arithmetic from inside a substitute, without recursing into the substitute."""
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


# --------------------------------------------------------------------------------------------------
# 1. transformers' torch reference


#: The keyword argument the packed-sequence pre-hook passes every decoder layer (host sequence ends, int64 ``[N]``;
#: :data:`qwen_npu_compile.substitutions.varlen_attention.SEQ_ENDS_KWARG`): transformers >= 5.15's DeltaNet hands its
#: ``**kwargs`` on to the module-level conv and delta rule, so a packed row's offsets reach the substitutes.
SEQ_ENDS_KWARG = "qwen_npu_seq_ends"


def _offsets(kwargs: dict, device) -> torch.Tensor | None:
    """The packed row's ``cu_seqlens`` ``[N + 1]`` from a call's keyword arguments: transformers' own
    (``cu_seqlens``, ``cu_seq_lens_q``: flash-attention kwargs of a packed batch) or the pre-hook's host ends."""
    for name in ("cu_seqlens", "cu_seq_lens_q"):
        if isinstance(kwargs.get(name), torch.Tensor):
            return kwargs[name]
    ends = kwargs.get(SEQ_ENDS_KWARG)
    if isinstance(ends, torch.Tensor):
        return F.pad(ends, (1, 0)).to(device)
    return None


def _substitute_for(original: types.FunctionType):
    fallback = _unsubstituted(original)

    def _traced_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                       output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        """What Dynamo traces for transformers' ``torch_chunk_gated_delta_rule`` (same arguments and results; a
        packed row's offsets honoured, each sequence from a zero state)."""
        heads, k_heads = value.shape[-2], key.shape[-2]
        offsets = _offsets(kwargs, query.device)
        if (not _enabled or heads % k_heads
                or (offsets is not None and (initial_state is not None or query.shape[0] != 1))):
            return fallback(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                            use_qk_l2norm_in_kernel, **kwargs)
        if heads != k_heads:
            query = query.repeat_interleave(heads // k_heads, dim=2)
            key = key.repeat_interleave(heads // k_heads, dim=2)
        out, state = torch.ops.qwen_npu.chunk_gated_delta_rule(
            query, key, value, g, beta, offsets, initial_state, query.shape[-1] ** -0.5,
            bool(use_qk_l2norm_in_kernel))
        return out, (state if output_final_state else None)

    return _traced_chunk_gated_delta_rule


def _conv_substitute_for(original: types.FunctionType):
    fallback = _unsubstituted(original)

    def _traced_causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        """What Dynamo traces for transformers' module-level ``causal_conv1d_fn`` (>= 5.15, ``[B, C, T]``,
        ``weight [C, K]``): a packed row's offsets in ``kwargs`` make the conv restart per sequence
        (:func:`packed_causal_conv1d`); anything else is transformers' code."""
        offsets = _offsets(kwargs, hidden_states.device)
        if (not _enabled or offsets is None or hidden_states.shape[0] != 1 or activation not in ("silu", "swish")
                or kwargs.get("seq_idx") is not None):
            return fallback(hidden_states, weight, bias, activation, **kwargs)
        return packed_causal_conv1d(hidden_states, weight.unsqueeze(1), bias, offsets)

    return _traced_causal_conv1d_fn


def _fla_substitute_for(original):
    fallback = _unsubstituted(original)

    def _traced_fla_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                                           allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
                                           cu_seqlens_cpu=None, cp_context=None, chunk_indices=None, **kwargs):
        """What Dynamo traces for FLA's ``chunk_gated_delta_rule`` (0.5.2 / 0.6.0 ``fla/ops/gated_delta_rule/chunk.py``,
        ``[B, T, H, K]``, per-sequence ``cu_seqlens``) where transformers bound it module-level: the op, which
        computes what FLA's kernel computes; FLA's options outside the op's contract keep FLA (a graph break).
        0.6.0's ``chunk_indices`` is the chunk table FLA would otherwise derive from ``cu_seqlens``: the op derives
        its own, so it is dropped."""
        if chunk_indices is not None:
            kwargs = {**kwargs, "chunk_indices": chunk_indices}  # only for FLA itself, if it runs
        heads, k_heads = v.shape[-2], k.shape[-2]
        if (not _enabled or heads % k_heads or use_beta_sigmoid_in_kernel or allow_neg_eigval or state_v_first
                or cp_context is not None or set(kwargs) - {"chunk_indices"}
                or (cu_seqlens is not None and q.shape[0] != 1)):
            return fallback(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                            state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                            cp_context=cp_context, **kwargs)
        if heads != k_heads:
            q = q.repeat_interleave(heads // k_heads, dim=2)
            k = k.repeat_interleave(heads // k_heads, dim=2)
        out, state = torch.ops.qwen_npu.chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens, initial_state, q.shape[-1] ** -0.5 if scale is None else scale,
            bool(use_qk_l2norm_in_kernel))
        return out, (state if output_final_state else None)

    return _traced_fla_chunk_gated_delta_rule


def _install_fla(module_name: str) -> str | None:
    """Substitute the FLA ``chunk_gated_delta_rule`` that transformers 5.10.4 / 4.57.6 import module-level (and
    bind to ``self.chunk_gated_delta_rule``) where FLA is available; its leading parameters must be 0.5.2's (0.6.0
    keeps them and adds ``chunk_indices`` after ``cu_seqlens_cpu``, which the substitute accepts and drops)."""
    function = getattr(sys.modules.get(module_name), "chunk_gated_delta_rule", None)
    if function is None or not callable(function):
        return None
    key = f"fla:{id(function)}"
    if key in _installed:
        return _installed[key] or None
    try:
        names = tuple(inspect.signature(function).parameters)[:len(_FLA_PARAMETERS)]
    except (TypeError, ValueError):
        names = ()
    if names != _FLA_PARAMETERS:
        _refuse(key, f"{module_name}.chunk_gated_delta_rule's parameters are {names}, expected {_FLA_PARAMETERS}")
        _installed[key] = ""
        return None
    torch.compiler.substitute_in_graph(function, skip_signature_check=True)(_fla_substitute_for(function))
    _installed[key] = f"{module_name.rsplit('.', 1)[-1]}.chunk_gated_delta_rule (FLA) -> {op_module.NAME}"
    return _installed[key]


def _eager_packed_behaviour(function) -> str:
    """What transformers' eager code does with a packed row's offsets, for the one warning (5.24's hub wrapper:
    FLA when it imported, else ``ValueError``; earlier the torch fallback ignores them)."""
    closure = inspect.getclosurevars(function).nonlocals if hasattr(function, "__wrapped__") else {}
    if closure.get("is_new_implementation"):
        return ("eager dispatches the delta rule to FLA (per sequence) but runs the causal conv across sequence "
                "boundaries (the conv wrapper drops cu_seq_lens_q)")
    if hasattr(function, "__wrapped__"):
        return ("eager raises ValueError (chunk_gated_delta_rule can't keep packed sequences apart without "
                "flash-linear-attention) for cu_seq_lens_q, and runs a row packed by position_ids alone as one "
                "sequence")
    return "eager's torch fallback ignores cu_seqlens: each sequence starts from the previous one's state"


def _closure_function(function, name: str):
    """The function held in the closure variable ``name`` of ``function`` (None when there is none)."""
    code = getattr(function, "__code__", None)
    if code is None or name not in code.co_freevars or not function.__closure__:
        return None
    try:
        return function.__closure__[code.co_freevars.index(name)].cell_contents
    except ValueError:  # an empty cell
        return None


def resolve_binding(bound) -> tuple[types.FunctionType | None, str]:
    """The plain Python function Dynamo reaches when traced code calls ``bound``, and what ``bound`` is.

    transformers binds its module-level kernel functions (``torch_chunk_gated_delta_rule``, ``causal_conv1d_fn``)
    three ways, by version and by what is installed:

    - a plain function (4.57.6, 5.10.4);
    - the hub wrapper of ``use_kernel_func_from_hub_with_fallback`` (>= 5.15 without the ``kernels`` package): a
      plain function with ``__wrapped__`` that dispatches to the original package (FLA, ``causal-conv1d``) when it
      is installed and supports the inputs' device (5.25: by device, ``npu`` included for FLA), else to the torch
      function;
    - with ``kernels`` installed (a hard dependency of 5.25; optional on 5.24), that hub wrapper turned into a
      ``kernels`` ``Func`` module instance by ``use_kernel_forward_from_hub``: its ``forward`` calls the wrapper
      (closure variable ``func``) unless ``kernelize`` bound a hub kernel for the device and mode (kernels 0.19.1
      ``_internals/layer/layer.py`` ``_create_func_module``; transformers 5.25 maps the delta rule to a hub kernel
      for cuda, rocm and xpu only, so on an NPU or a CPU the wrapper runs).

    Substituting the returned function covers every device: Dynamo traces the substitute wherever the wrapper
    would have dispatched.

    Returns:
        ``(function, kind)``: ``kind`` is ``"plain function"``, ``"hub wrapper"`` or ``"kernels Func wrapper"``;
        ``function`` is None (and ``kind`` describes ``bound``) for anything else.
    """
    if isinstance(bound, types.FunctionType):
        return bound, "hub wrapper" if hasattr(bound, "__wrapped__") else "plain function"
    if isinstance(bound, torch.nn.Module) and hasattr(bound, "kernel_layer_name"):
        inner = _closure_function(type(bound).forward, "func")
        if isinstance(inner, types.FunctionType):
            return inner, "kernels Func wrapper"
        return None, f"a kernels Func module ({type(bound).__qualname__}) whose forward holds no function 'func'"
    return None, f"{type(bound).__module__}.{type(bound).__qualname__}"


def _install_transformers(module_name: str) -> str | None:
    module = sys.modules.get(module_name)
    if module is None:
        return None
    bound = getattr(module, "torch_chunk_gated_delta_rule", None)
    key = f"{module_name}.torch_chunk_gated_delta_rule"
    if key in _installed:
        return _installed[key]
    function, kind = resolve_binding(bound)
    if function is None or function.__name__ != "torch_chunk_gated_delta_rule":
        _installed[key] = ""
        _refuse(key, f"it is bound to {kind if function is None else repr(function)}, a binding this version of "
                     "qwen_npu_compile does not know (it knows a plain function, transformers' hub wrapper and the "
                     "kernels Func wrapper of it); upgrade qwen_npu_compile, or report the versions")
        return None
    names = tuple(inspect.signature(function).parameters)[:len(_HF_PARAMETERS)]
    if names != _HF_PARAMETERS:
        _refuse(key, f"its parameters are {names}, expected {_HF_PARAMETERS}")
        _installed[key] = ""
        return None
    torch.compiler.substitute_in_graph(function, skip_signature_check=True)(_substitute_for(function))
    _eager_behaviour[module_name] = _eager_packed_behaviour(function)
    _bindings[module_name] = kind
    line = f"{module_name.rsplit('.', 1)[-1]}.torch_chunk_gated_delta_rule -> {op_module.NAME}"
    conv, _ = resolve_binding(getattr(module, "causal_conv1d_fn", None))
    if (conv is not None and hasattr(conv, "__wrapped__")
            and tuple(inspect.signature(conv.__wrapped__).parameters)[:4] == _CONV_PARAMETERS):
        torch.compiler.substitute_in_graph(conv, skip_signature_check=True)(_conv_substitute_for(conv))
        line += " and causal_conv1d_fn -> per-sequence conv for packed rows"
    _installed[key] = line
    return line


def _op_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The op's calls in ``gm``: Dynamo's graph holds the overload packet, an ATen graph the ``.default``."""
    packet = torch.ops.qwen_npu.chunk_gated_delta_rule
    return [node for target in (packet, packet.default)
            for node in gm.graph.find_nodes(op="call_function", target=target)]


def warn_eager_differs(gm: torch.fx.GraphModule) -> None:
    """One warning per process when ``gm`` runs transformers' DeltaNet on a packed row per sequence (the op with
    offsets, traced from :func:`_substitute_for`), naming what eager does instead on these versions."""
    if "eager-differs" in _refused:
        return
    for node in _op_nodes(gm):
        trace = node.meta.get("stack_trace") or ""
        if node.args[5] is None or "_traced_chunk_gated_delta_rule" not in trace:
            continue
        module = next((name for name in TRANSFORMERS_MODULES if name.rsplit(".", 1)[-1] + ".py" in trace), None)
        behaviour = _eager_behaviour.get(module) or next(iter(_eager_behaviour.values()), "")
        _refused.add("eager-differs")
        log.warning("qwen_npu: %s: a packed row reaches the Gated DeltaNet (cu_seq_lens_q, or sequence ends proven "
                    "from position_ids); %s (an upstream defect). Compiled runs each sequence from a zero state and "
                    "restarts the causal conv per sequence, as if alone", _versions(), behaviour)
        return


def warn_eager_differs_for_positions(trace: str) -> None:
    """The one warning of :func:`warn_eager_differs` (shared: one per process) for a whole-model graph whose row
    is packed only by ``position_ids`` and whose DeltaNet the fuse stage gave attention's sequence ends
    (``patterns/gated_delta_rule_packed.py``); ``trace`` is the op node's stack trace (names the modeling file)."""
    if "eager-differs" in _refused:
        return
    _refused.add("eager-differs")
    module = next((name for name in TRANSFORMERS_MODULES if name.rsplit(".", 1)[-1] + ".py" in trace), None)
    log.warning("qwen_npu: %s: a row packed by position_ids (restarting per sequence, no cu_seq_lens_q) reaches "
                "%s's Gated DeltaNet, whose decoder layer passes it no position_ids: eager runs the DeltaNet's conv "
                "and recurrent state across the sequence boundaries while attention runs per sequence (an upstream "
                "defect). Compiled runs each sequence from a zero state and restarts the causal conv per sequence, "
                "as if alone (the sequence ends of attention's packing proof)", _versions(),
                (module or "transformers").rsplit(".", 1)[-1])


# --------------------------------------------------------------------------------------------------
# 2. verl's packed forward


def packed_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv1d over packed sequences, restarting at every sequence start, then SiLU.

    Equals verl 0.9.1's ``_packed_causal_conv1d_fallback`` (``F.silu(conv1d(segment)[..., :len])`` per
    sequence, the conv's left padding ``K - 1``), with the offsets as a tensor: each of the ``K`` taps reads
    the input shifted right by ``K - 1 - j`` and is masked where that crosses the token's sequence start.
    Accumulated in fp32, rounded once to ``x``'s dtype before the SiLU.

    Args:
        x: ``[1, C, T]`` (channels first, as the DeltaNet's conv sees ``in_proj_qkv``'s output).
        weight: ``[C, 1, K]`` (``nn.Conv1d(groups=C)``), bias ``[C]`` or None.
        cu_seqlens: ``[N + 1]`` int cumulative sequence ends from 0.

    Returns:
        ``[1, C, T]`` in ``x``'s dtype.
    """
    taps = weight.shape[-1]
    tokens = x.shape[-1]
    position = torch.arange(tokens, device=x.device)
    sequence = torch.searchsorted(cu_seqlens[1:].to(position.dtype), position, right=True)
    offset = position - cu_seqlens.to(position.dtype).gather(0, sequence.clamp(max=cu_seqlens.shape[0] - 1))
    padded = F.pad(x.float(), (taps - 1, 0))
    w = weight.float()
    out = torch.zeros_like(x, dtype=torch.float32) if bias is None else bias.float()[None, :, None].expand_as(x)
    for j in range(taps):
        shift = taps - 1 - j
        tap = padded[..., j:j + tokens] * (offset >= shift).to(torch.float32)
        out = out + w[:, 0, j, None] * tap
    return F.silu(out.to(x.dtype))


def _traced_packed_forward(self, hidden_states, attention_mask, cu_seqlens):
    """verl 0.9.1's ``qwen3_5_gated_delta_net_forward`` for a packed row without cache or context parallelism,
    with ``cu_seqlens`` kept a tensor and every sequence restarting the conv and the recurrent state (see the
    module docstring)."""
    module = sys.modules[type(self).__module__]
    hidden_states = module.apply_mask_to_padding_states(hidden_states, attention_mask)
    batch, tokens, _ = hidden_states.shape
    mixed = self.in_proj_qkv(hidden_states).transpose(1, 2)
    z = self.in_proj_z(hidden_states).reshape(batch, tokens, -1, self.head_v_dim)
    b = self.in_proj_b(hidden_states)
    a = self.in_proj_a(hidden_states)
    mixed = packed_causal_conv1d(mixed, self.conv1d.weight, self.conv1d.bias, cu_seqlens).transpose(1, 2)
    query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(batch, tokens, -1, self.head_k_dim)
    key = key.reshape(batch, tokens, -1, self.head_k_dim)
    value = value.reshape(batch, tokens, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    if self.num_v_heads // self.num_k_heads > 1:
        query = query.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
        key = key.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
    out, _ = torch.ops.qwen_npu.chunk_gated_delta_rule(query, key, value, g, beta, cu_seqlens, None,
                                                       self.head_k_dim ** -0.5, True)
    out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(batch, tokens, -1))


def _ulysses_size() -> int:
    verl_ulysses = sys.modules.get("verl.utils.ulysses")
    return verl_ulysses.get_ulysses_sequence_parallel_world_size() if verl_ulysses else 1


def packed_call_refusal(module, hidden_states, cache_params, cu_seqlens) -> str | None:
    """Why a compiled packed call of verl's DeltaNet forward does not run :func:`_traced_packed_forward` (None
    when it does). The one place for these conditions: the takeover and
    :func:`~qwen_npu_compile.substitutions.varlen_attention.packed_layer_call` (which marks the offsets unbacked) read it.

    What is bound on the module (FLA's ``@torch.compiler.disable`` ``chunk_gated_delta_rule``, ``causal-conv1d``'s
    kernel, transformers' torch fallback) does not matter: the traced path computes what FLA's kernel and a
    per-sequence conv compute, each sequence from a zero state.
    """
    if not _enabled:
        return "the gated_delta_rule family is off"
    if cu_seqlens is None:
        return "no cu_seqlens (not a packed row)"
    if cache_params is not None:
        return "a cache is passed (generation)"
    if hidden_states.shape[0] != 1:
        return f"batch {hidden_states.shape[0]} (a packed row has batch 1)"
    if _ulysses_size() != 1:
        return (f"Ulysses sp {_ulysses_size()} (verl 0.9.1 runs Qwen3.5 context parallelism through FLA's "
                "cp_context, outside any graph)")
    return check_module(module)


def _verl_forward_takeover(original):
    # verl's own code for the calls the traced path declines: its int(cu_seqlens[-1].item()) and .tolist() splits
    # run outside the graph (one graph break around the DeltaNet), so offsets marked unbacked never reach them
    island = torch.compiler.disable(original, recursive=True)

    @functools.wraps(original)
    def qwen3_5_gated_delta_net_forward(self, hidden_states, cache_params=None, attention_mask=None, cu_seqlens=None,
                                        cu_seqlens_cpu=None):
        if torch.compiler.is_compiling() and cu_seqlens is not None:
            if packed_call_refusal(self, hidden_states, cache_params, cu_seqlens) is None:
                return _traced_packed_forward(self, hidden_states, attention_mask, cu_seqlens)
            return island(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask,
                          cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        return original(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask,
                        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)

    qwen3_5_gated_delta_net_forward._qwen_npu_original = original
    return qwen3_5_gated_delta_net_forward


def offsets_traceable(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s traced code reads verl's ``cu_seqlens`` / ``cu_seqlens_cpu`` only through
    :func:`_verl_forward_takeover` (or not at all): False when one of its modules still runs verl's own packed
    DeltaNet forward (``int(cu_seqlens[-1].item())``, ``.tolist()``), where offsets marked unbacked raise
    ``GuardOnDataDependentSymNode`` (the takeover refused, or verl patched after :func:`install`).

    Called before each packed compiled call (outside the graph): the first DeltaNet met whose eager packed path
    leaks the state across sequences (:func:`_eager_leaks_state`) logs the one warning saying so."""
    for module in layer.modules():
        forward = getattr(type(module), "forward", None)
        if getattr(forward, "__name__", "") != VERL_FORWARD:
            continue
        if not hasattr(forward, "_qwen_npu_original"):
            return False
        if _enabled and "eager-leaks" not in _refused and _eager_leaks_state(module):
            _refused.add("eager-leaks")
            log.warning("qwen_npu: %s: verl's eager packed Qwen3.5 forward hands cu_seqlens to transformers' "
                        "torch_chunk_gated_delta_rule (its **kwargs pass verl's _call_accepts_kwarg), which "
                        "ignores it: in eager, each packed sequence starts from the previous one's DeltaNet state "
                        "(an upstream defect of transformers 5.9-5.10.4 + verl 0.9.1; transformers <= 5.8.1 + "
                        "verl, and FLA, restart per sequence). Compiled runs each sequence from a zero state, as "
                        "if alone: losses differ from the unset run by design", _versions())
    return True


def _eager_leaks_state(module) -> bool:
    """Whether verl's eager packed forward hands ``cu_seqlens`` to the torch fallback bound on ``module``, which
    ignores it (transformers 5.9-5.10.4: its ``**kwargs`` pass verl's ``_call_accepts_kwarg``)."""
    rule = getattr(module, "chunk_gated_delta_rule", None)
    if getattr(rule, "__name__", "") != "torch_chunk_gated_delta_rule":
        return False  # FLA (per sequence) or something else
    accepts = getattr(sys.modules.get(VERL_MODULE), "_call_accepts_kwarg", None)
    return bool(accepts and accepts(rule, "cu_seqlens"))


def _install_verl() -> str | None:
    verl_module = sys.modules.get(VERL_MODULE)
    if verl_module is None:
        return None
    key = f"{VERL_MODULE}.{VERL_FORWARD}"
    original = getattr(verl_module, VERL_FORWARD, None)
    names = tuple(inspect.signature(original).parameters) if callable(original) else ()
    if names != _VERL_PARAMETERS:
        _refuse(key, f"its parameters are {names or 'missing'}, expected {_VERL_PARAMETERS}")
        _installed[key] = ""
        return None
    taken = []
    for module_name, class_name in VERL_CLASSES:
        hf_module = sys.modules.get(module_name)
        cls = getattr(hf_module, class_name, None) if hf_module else None
        if cls is None or getattr(cls.forward, "_qwen_npu_original", None) is original:
            continue
        if cls.forward is not original:  # verl's monkey patch not applied (yet): nothing to take over
            continue
        cls.forward = _verl_forward_takeover(original)
        taken.append(class_name)
    if taken:
        _installed[key] = (f"verl {VERL_FORWARD} of {', '.join(taken)} (packed rows) -> {op_module.NAME} with "
                           "tensor cu_seqlens, per sequence")
    return _installed.get(key)


def warn_if_substituted_while_disabled(gm: torch.fx.GraphModule, fusions) -> None:
    """One warning when ``gm`` holds the op although the ``gated_delta_rule`` family is off in these options:
    Dynamo substitutes while it traces, before a backend sees ``torch.compile(options=...)``; the switch set now
    reaches the next trace (Dynamo's guard on it recompiles the frame). ``QWEN_NPU_FUSIONS`` and
    ``maybe_compile``'s options are read before tracing. Also :func:`warn_eager_differs`."""
    warn_eager_differs(gm)
    if "gated_delta_rule" in fusions or "disabled" in _refused:
        return
    if _op_nodes(gm):
        _refused.add("disabled")
        log.warning("qwen_npu: the gated_delta_rule family is off in torch.compile's options, but Dynamo had already "
                    "put %s in this graph (substitutions happen while it traces, before the backend reads options); "
                    "the frame recompiles without it at its next call. Switch the family off with QWEN_NPU_FUSIONS "
                    "or maybe_compile's options to avoid the first graph", op_module.NAME)


def check_module(module: torch.nn.Module) -> str | None:
    """Why the traced packed forward cannot run ``module`` (a ``Qwen3_5GatedDeltaNet``), None when it can."""
    missing = [name for name in _MODULE_ATTRIBUTES if not hasattr(module, name)]
    return f"{type(module).__name__} lacks {missing}" if missing else None


# --------------------------------------------------------------------------------------------------


class _InstallAfterImport:
    """A ``sys.meta_path`` entry that runs :func:`install` right after one of :data:`TRANSFORMERS_MODULES` is
    imported (a model built after ``qwen_npu_compile`` was imported still gets its substitution before Dynamo
    traces it). It finds nothing itself: it wraps the loader the other finders return."""

    def find_spec(self, name, path=None, target=None):
        if name not in TRANSFORMERS_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                loader = spec.loader

                class _Loader:
                    def create_module(self, spec):
                        return loader.create_module(spec)

                    def exec_module(self, module):
                        loader.exec_module(module)
                        install(_enabled)

                spec.loader = _Loader()
                return spec
        return None


def _watch_imports() -> None:
    if not any(isinstance(finder, _InstallAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _InstallAfterImport())


@contextlib.contextmanager
def switched(enabled: bool) -> Iterator[None]:
    """:func:`install` with ``enabled`` inside the block, the previous switch restored on exit: for a compile whose
    family choice must not outlive it (``check``, a benchmark capture; the switch is process-wide)."""
    previous = _enabled
    install(enabled)
    try:
        yield
    finally:
        install(previous)


def install(enabled: bool = True) -> list[str]:
    """Install the substitutions for the modules imported so far (idempotent; see the module docstring).

    Args:
        enabled: the ``gated_delta_rule`` family's switch: False makes traced code take the original Python
            (a process-wide setting read when Dynamo traces; a change recompiles through Dynamo's guards).

    Returns:
        What was put in place, one line each (for the log).
    """
    global _enabled
    _enabled = enabled
    _watch_imports()
    done = []
    for name in TRANSFORMERS_MODULES:
        try:
            line = _install_transformers(name)
        except Exception as exc:  # a changed transformers must not stop training
            _refuse(name, f"{type(exc).__name__}: {exc}")
            _installed[f"{name}.torch_chunk_gated_delta_rule"] = ""
            line = None
        try:
            fla_line = _install_fla(name)
        except Exception as exc:
            _refuse(f"fla:{name}", f"{type(exc).__name__}: {exc}")
            fla_line = None
        done += [entry for entry in (line, fla_line) if entry]
    try:
        line = _install_verl()
    except Exception as exc:
        _refuse(VERL_MODULE, f"{type(exc).__name__}: {exc}")
        line = None
    if line:
        done.append(line)
    return done
