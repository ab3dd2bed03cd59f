"""The torch_npu 2.13.0 wheel the stand-in reads (op schemas, meta kernels, torchair): obtained, verified and
extracted once per process by ``qwen_npu_compile.torchair.offline.wheel`` (``$QWEN_NPU_TORCH_NPU_WHEEL``, its
cache, or ``pip download``); never installed."""

from __future__ import annotations

import functools

import torch


@functools.cache
def sources():
    from qwen_npu_compile.torchair.offline.wheel import obtain_sources

    return obtain_sources(torch.__version__)
