"""Stage 0, before Dynamo traces: what it traces instead of model code (not FX pattern matching).

The fuse stage rewrites subgraphs it can see. Two computations never reach a graph in a form it could
rewrite, so they are substituted where Dynamo traces them:

* :mod:`.deltanet` (family ``gated_delta_rule``): transformers' ``torch_chunk_gated_delta_rule`` (and its
  hub wrapper, FLA's kernel where transformers binds it, 5.24's ``causal_conv1d_fn``) is registered with
  ``torch.compiler.substitute_in_graph``, and verl's packed DeltaNet ``forward`` is wrapped on its class, so that
  Dynamo traces one ``qwen_npu::chunk_gated_delta_rule`` call per layer instead of a ``T/64``-step unrolled scan
  or a graph break. Process-wide; eager calls run the original code untouched.
* :mod:`.varlen_attention` (family ``attention``, under :func:`~qwen_npu_compile.maybe_compile` only, since it
  needs the model): a forward pre-hook on the model's base model computes a packed row's sequence ends once per
  micro-batch, and transformers' ``ALL_ATTENTION_FUNCTIONS["sdpa"]`` and ``_flash_attention_forward`` are taken
  over process-wide; every call without the pre-hook's keyword passes through to the original unchanged.

These are the only places where this project replaces upstream functions; the modeling code itself is never
edited. Both are installed by one explicit call, :func:`install`: from :mod:`qwen_npu_compile.backend` when
``torch.compile`` looks the backend up (the one moment a backend can act before Dynamo traces the first frame)
and again per compiled graph, and from :func:`~qwen_npu_compile.maybe_compile`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from torch import nn

from qwen_npu_compile.substitutions import deltanet, varlen_attention


@dataclasses.dataclass
class Installed:
    """What :func:`install` put in place, one line each (for the log).

    Attributes:
        deltanet: the Gated DeltaNet substitutions (:func:`.deltanet.install`).
        varlen: the packed-row pre-hook and attention takeovers (:func:`.varlen_attention.install`); empty
            without a model or with the attention family off.
    """

    deltanet: list[str]
    varlen: list[str]


def install(fusions: Iterable[str], model: nn.Module | None = None) -> Installed:
    """Install the substitutions the enabled ``fusions`` need (idempotent).

    Args:
        fusions: the enabled families (``QwenNpuConfig.fusions``). With ``gated_delta_rule`` off, traced
            DeltaNet code takes transformers' own Python (a process-wide switch read when Dynamo traces).
        model: the model :func:`~qwen_npu_compile.maybe_compile` compiles, for the packed-row path; None from
            the backend.

    Returns:
        What was installed.

    Raises:
        qwen_npu_compile.substitutions.varlen_attention.VarlenIntegrationError: transformers changed what the
            packed-row path relies on (the message names the versions); the DeltaNet substitutions never raise
            (a mismatch refuses that substitution with one warning).
    """
    fusions = frozenset(fusions)
    installed = Installed(deltanet=deltanet.install(enabled="gated_delta_rule" in fusions), varlen=[])
    if model is not None and "attention" in fusions:
        installed.varlen = varlen_attention.install(model)
    return installed
