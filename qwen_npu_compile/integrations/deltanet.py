"""The Gated DeltaNet inside the graph: Dynamo substitutions that put ``qwen_npu::chunk_gated_delta_rule`` where
transformers' and verl's DeltaNet code runs the chunked delta rule in Python.

Without this, a Qwen3.5 / Qwen3-Next linear-attention layer reaches the graph as transformers'
``torch_chunk_gated_delta_rule`` traced op by op (a ``T/64``-step scan unrolled into ``select_scatter``
copies, the graph specialised on ``T``), and verl 0.9.1's packed forward breaks the graph at
``int(cu_seqlens[-1].item())`` and splits the row on the host with ``.tolist()`` (a recompile per packing).
Two substitutions, installed once per process by :func:`install`, change only what Dynamo traces; eager calls
run the original code untouched:

1. **transformers' torch reference** ``torch_chunk_gated_delta_rule`` of ``modeling_qwen3_5``,
   ``modeling_qwen3_5_moe`` and ``modeling_qwen3_next`` (5.x module-level function; 5.10.4 and 4.57.6 bind it
   to ``self.chunk_gated_delta_rule``: the same function object) is registered with
   ``torch.compiler.substitute_in_graph``: Dynamo traces :func:`_traced_chunk_gated_delta_rule` instead, one
   ``qwen_npu.chunk_gated_delta_rule`` call with GQA expanded in ATen. The result equals the reference's
   (same arithmetic). Like the reference, it ignores ``cu_seqlens`` in its ``**kwargs`` (transformers'
   torch fallback treats a packed row as one sequence; only FLA's kernel honours the offsets): compiled and
   eager agree. When FLA is installed transformers binds FLA's function instead, which is
   ``@torch.compiler.disable``: nothing is substituted (one INFO line).
2. **verl 0.9.1's packed forward** ``qwen3_5_gated_delta_net_forward``
   (``verl/models/transformers/qwen3_5.py``, installed by verl as ``Qwen3_5GatedDeltaNet.forward``): Dynamo
   cannot substitute a module's ``forward`` (it inlines the class attribute directly), so the class attribute
   is wrapped (:func:`_verl_forward_takeover`): eager calls, and every call outside what the traced path
   covers, go to verl's function unchanged; a traced packed call (``cu_seqlens`` given, no cache, Ulysses
   sp 1, no ``causal-conv1d`` / FLA kernels bound on the module) runs :func:`_traced_packed_forward`: verl's
   arithmetic with the sequence offsets kept as a tensor (the causal conv by
   :func:`packed_causal_conv1d`, the delta rule by the op with ``cu_seqlens``), no ``.item()`` and no
   ``.tolist()``. With Ulysses sp > 1 verl 0.9.1 needs FLA's ``cp_context`` for Qwen3.5 (without FLA it
   raises); the takeover leaves those calls to verl, so our path supports what verl supports there.

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

from ..npu_ops import gated_delta_rule as op_module

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

#: Parameters of transformers' ``torch_chunk_gated_delta_rule`` the substitute reads (4.57.6, 5.10.4, 5.24.0).
_HF_PARAMETERS = ("query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
                  "use_qk_l2norm_in_kernel")
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
#: verl 0.9.1 passes ``cu_seqlens`` to transformers' torch delta rule, which ignores it (set by :func:`_install_verl`).
_verl_offsets_ignored = False
#: Refusals already logged.
_refused: set[str] = set()


class DeltaNetIntegrationError(RuntimeError):
    """transformers or verl no longer has what a substitution relies on (raised inside :func:`install`,
    caught there and logged as one warning)."""


def _versions() -> str:
    import transformers

    verl = sys.modules.get("verl")
    return f"transformers {transformers.__version__}" + (f", verl {getattr(verl, '__version__', '?')}" if verl else "")


def _refuse(key: str, reason: str) -> None:
    if key not in _refused:
        _refused.add(key)
        log.warning("qwen_npu: the Gated DeltaNet keeps its traced Python code (%s): %s (%s)", key, reason, _versions())


def _unsubstituted(function: types.FunctionType) -> types.FunctionType:
    """A copy of ``function`` (same code, globals, defaults, closure) that Dynamo inlines as it is: the way back
    to the original arithmetic from inside a substitute, without recursing into the substitute."""
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


# --------------------------------------------------------------------------------------------------
# 1. transformers' torch reference


def _substitute_for(original: types.FunctionType):
    fallback = _unsubstituted(original)

    def _traced_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                       output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        """What Dynamo traces for transformers' ``torch_chunk_gated_delta_rule`` (same arguments and results)."""
        heads, k_heads = value.shape[-2], key.shape[-2]
        if not _enabled or heads % k_heads:
            return fallback(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                            use_qk_l2norm_in_kernel, **kwargs)
        if heads != k_heads:
            query = query.repeat_interleave(heads // k_heads, dim=2)
            key = key.repeat_interleave(heads // k_heads, dim=2)
        out, state = torch.ops.qwen_npu.chunk_gated_delta_rule(
            query, key, value, g, beta, None, initial_state, query.shape[-1] ** -0.5, bool(use_qk_l2norm_in_kernel))
        return out, (state if output_final_state else None)

    return _traced_chunk_gated_delta_rule


def _install_transformers(module_name: str) -> str | None:
    module = sys.modules.get(module_name)
    if module is None:
        return None
    function = getattr(module, "torch_chunk_gated_delta_rule", None)
    key = f"{module_name}.torch_chunk_gated_delta_rule"
    if key in _installed:
        return _installed[key]
    if not isinstance(function, types.FunctionType) or function.__name__ != "torch_chunk_gated_delta_rule":
        log.info("qwen_npu: %s is %r (FLA or a hub kernel, outside any graph), not transformers' torch reference: "
                 "not substituted", key, function)
        _installed[key] = ""
        return None
    names = tuple(inspect.signature(function).parameters)[:len(_HF_PARAMETERS)]
    if names != _HF_PARAMETERS:
        _refuse(key, f"its parameters are {names}, expected {_HF_PARAMETERS}")
        _installed[key] = ""
        return None
    torch.compiler.substitute_in_graph(function, skip_signature_check=True)(_substitute_for(function))
    _installed[key] = f"{module_name.rsplit('.', 1)[-1]}.torch_chunk_gated_delta_rule -> {op_module.NAME}"
    return _installed[key]


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
    with ``cu_seqlens`` kept a tensor (see the module docstring)."""
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
    # verl hands cu_seqlens to a delta rule whose signature takes it (**kwargs counts); transformers' torch reference
    # then ignores it and runs the row as one sequence. Keep exactly that (see _install_verl); split otherwise.
    offsets = None if _verl_offsets_ignored else cu_seqlens
    out, _ = torch.ops.qwen_npu.chunk_gated_delta_rule(query, key, value, g, beta, offsets, None,
                                                       self.head_k_dim ** -0.5, True)
    out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(batch, tokens, -1))


def _torch_reference_bound(module) -> bool:
    """Whether the module runs transformers' torch code (no ``causal-conv1d`` kernel, the torch delta rule)."""
    rule = getattr(module, "chunk_gated_delta_rule", None)
    return module.causal_conv1d_fn is None and getattr(rule, "__name__", "") == "torch_chunk_gated_delta_rule"


def _ulysses_size() -> int:
    verl_ulysses = sys.modules.get("verl.utils.ulysses")
    return verl_ulysses.get_ulysses_sequence_parallel_world_size() if verl_ulysses else 1


def _verl_forward_takeover(original):
    @functools.wraps(original)
    def qwen3_5_gated_delta_net_forward(self, hidden_states, cache_params=None, attention_mask=None, cu_seqlens=None,
                                        cu_seqlens_cpu=None):
        if (torch.compiler.is_compiling() and _enabled and cu_seqlens is not None and cache_params is None
                and hidden_states.shape[0] == 1 and _ulysses_size() == 1 and _torch_reference_bound(self)):
            return _traced_packed_forward(self, hidden_states, attention_mask, cu_seqlens)
        return original(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask,
                        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)

    qwen3_5_gated_delta_net_forward._qwen_npu_original = original
    return qwen3_5_gated_delta_net_forward


def _install_verl() -> str | None:
    verl_module = sys.modules.get(VERL_MODULE)
    if verl_module is None:
        return None
    key = f"{VERL_MODULE}.{VERL_FORWARD}"
    if key in _installed:
        return _installed[key]
    original = getattr(verl_module, VERL_FORWARD, None)
    names = tuple(inspect.signature(original).parameters) if callable(original) else ()
    if names != _VERL_PARAMETERS:
        _refuse(key, f"its parameters are {names or 'missing'}, expected {_VERL_PARAMETERS}")
        _installed[key] = ""
        return None
    hf_module = sys.modules.get(TRANSFORMERS_MODULES[0])
    cls = getattr(hf_module, "Qwen3_5GatedDeltaNet", None) if hf_module else None
    if cls is None or getattr(cls.forward, "_qwen_npu_original", None) is original:
        return _installed.get(key)
    if cls.forward is not original:  # verl's monkey patch not applied (yet): nothing to take over
        return None
    global _verl_offsets_ignored
    accepts = getattr(verl_module, "_call_accepts_kwarg", None)
    reference = getattr(hf_module, "torch_chunk_gated_delta_rule", None)
    _verl_offsets_ignored = bool(accepts and reference and accepts(reference, "cu_seqlens"))
    if _verl_offsets_ignored:
        log.warning("qwen_npu: %s: verl's packed Qwen3.5 forward hands cu_seqlens to transformers' torch "
                    "torch_chunk_gated_delta_rule (its **kwargs pass verl's _call_accepts_kwarg), which ignores it: the "
                    "sequences packed in one row share the DeltaNet's recurrent state (the causal conv does restart "
                    "per sequence). Compiled runs keep that behaviour, to match the unset run; FLA's kernel honours "
                    "the offsets", _versions())
    cls.forward = _verl_forward_takeover(original)
    _installed[key] = f"verl {VERL_FORWARD} (packed rows) -> {op_module.NAME} with tensor cu_seqlens"
    return _installed[key]


def warn_if_substituted_while_disabled(gm: torch.fx.GraphModule, fusions) -> None:
    """One warning when ``gm`` holds the op although the ``gated_delta_rule`` family is off in these options:
    Dynamo substitutes while it traces, before a backend sees ``torch.compile(options=...)``; the switch set now
    reaches the next trace (Dynamo's guard on it recompiles the frame). ``QWEN_NPU_FUSIONS`` and
    ``maybe_compile``'s options are read before tracing."""
    if "gated_delta_rule" in fusions or "disabled" in _refused:
        return
    target = torch.ops.qwen_npu.chunk_gated_delta_rule.default
    if gm.graph.find_nodes(op="call_function", target=target):
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
        if line:
            done.append(line)
    try:
        line = _install_verl()
    except Exception as exc:
        _refuse(VERL_MODULE, f"{type(exc).__name__}: {exc}")
        line = None
    if line:
        done.append(line)
    return done
