"""How an op is defined with torch.library (the one place): the simulated stand-ins in the ``npu``
library (each op module's ``register`` calls it once per op) and this project's own ``qwen_npu`` ops
that are defined by schema (:mod:`.qwen_npu.gate_up_proj`).

An op gets its exact torch_npu schema, a CPU reference kernel (``CompositeExplicitAutograd``: the same
kernel for every backend key), a fake kernel for fake/meta tensors, and, for ops with a backward op,
autograd whose backward calls that op (``torch.library.register_autograd``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: The ``qwen_npu`` fragment that holds this project's ops defined by schema (alive for the whole process).
QWEN_NPU_LIBRARY = torch.library.Library("qwen_npu", "FRAGMENT")


def define_op(
    lib: torch.library.Library,
    schema: str,
    kernel: Callable,
    fake: Callable,
    backward: Callable | None = None,
    setup_context: Callable | None = None,
) -> torch._ops.OpOverload:
    """Define the op of ``schema`` (``"name(args) -> returns"``) in ``lib`` with its kernels; returns its overload
    (``torch.ops.<namespace>.<name>.default``, what graphs hold).

    Args:
        lib: the ``torch.library.Library(namespace, "FRAGMENT")`` that keeps the registrations alive.
        schema: the op's schema string (for a stand-in: torch_npu's) (its name is the text before the first ``(``).
        kernel: the CPU reference kernel.
        fake: the fake kernel (output shapes, dtypes and strides only).
        backward, setup_context: autograd of the op (``torch.library.register_autograd``); None for an
            op without autograd (a backward op itself, or ``npu_add_rms_norm``, as in torch_npu).
    """
    name = schema.split("(", 1)[0]
    qualified = f"{lib.ns}::{name}"
    lib.define(schema)
    lib.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(qualified, fake, lib=lib)
    if backward is not None:
        torch.library.register_autograd(qualified, backward, setup_context=setup_context, lib=lib)
    return getattr(getattr(torch.ops, lib.ns), name).default
