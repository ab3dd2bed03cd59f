"""Performance evidence for the ``qwen_npu`` backend, rerunnable on any CPU host.

No Ascend NPU is needed: what can be measured exactly on a CPU is measured, the rest is modelled (Atlas A2
figures from the CANN developer guide: :mod:`benchmarks.cost_model`).

* :mod:`benchmarks.traffic` — kernels and bytes moved per Qwen2.5 decoder layer (AOT forward and
  backward graphs built under fake tensors at real shapes) for eager, verl-style monkey patches and
  qwen_npu, against the fused lower bound, with a time estimate at the Ascend A2's HBM bandwidth;
  :mod:`benchmarks.moe_traffic` and :mod:`benchmarks.qwen3_5_traffic` the same per MoE and Qwen3.5 layer.
  They share :mod:`benchmarks.cost_model` (what one kernel costs), :mod:`benchmarks.capture` (how the
  graphs are captured) and :mod:`benchmarks.tables` (per-layer tables).
* :mod:`benchmarks.activation_memory` — what each way of running a layer saves for its backward
  (:mod:`benchmarks.saved_tensors`), and the largest micro-batch that fits.
* :mod:`benchmarks.compile_cost` — wall time of our canonicalize + fuse stages against Dynamo capture
  and AOTAutograd, for 2, 8 and 24 layers.
* :mod:`benchmarks.registration` — one-time pattern registration cost, measured in fresh processes.
* :mod:`benchmarks.long_seq` — the npu stand-ins' cost at long sequences on the CPU (run on its own).

Run everything with ``make bench`` (``python -m benchmarks.run --out benchmarks/results``).
"""
