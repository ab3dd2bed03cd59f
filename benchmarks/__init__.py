"""Performance evidence for the ``qwen_npu`` backend (issue 5), rerunnable on any CPU host.

No Ascend NPU is needed: what can be measured exactly on a CPU is measured, the rest is modelled.

* :mod:`benchmarks.traffic` — kernels and bytes moved per Qwen2.5 decoder layer (AOT forward and
  backward graphs built under fake tensors at real shapes) for eager, verl-style monkey patches and
  qwen_npu, against the fused lower bound, with a time estimate at the Ascend A2's HBM bandwidth.
* :mod:`benchmarks.compile_cost` — wall time of our canonicalize + fuse stages against Dynamo capture
  and AOTAutograd, for 2, 8 and 24 layers.
* :mod:`benchmarks.registration` — one-time pattern registration cost, measured in fresh processes.

Run everything with ``make bench`` (``python -m benchmarks.run --out benchmarks/results``).
"""
