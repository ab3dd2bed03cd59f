"""Plain helpers of the tests (no fixtures: those are in ``tests/conftest.py``), imported as ``tests.helpers.<module>``.

- :mod:`.models`: the tiny models of the tests (MoE, hybrid Qwen3.5 / Qwen3-Next) and their inputs (token ids,
  packed rows).
- :mod:`.numerics`: parity with eager (``check``'s rule) and the two error measures, :func:`.numerics.relative_l2`
  and :func:`.numerics.max_abs_ratio`.
- :mod:`.tensors`: test tensors and reference math (meta tensors, random q/k/v, transformers' ``rotate_half``).
- :mod:`.graphs`: FX graphs of a test's compiles (AOTAutograd traces, call targets, op counts).
- :mod:`.torchair`: the torch_npu wheel's torchair (its sources; a GE conversion script in a fresh interpreter).
- :mod:`.wheel_contracts`: the stand-in npu ops against the torch_npu wheel's schemas and meta kernels.
- :mod:`.runs`: the results the drivers of ``tests/drivers`` and the examples hand back (per-layer fusions).
- :mod:`.trainer`: a short Hugging Face Trainer run.
- :mod:`.verl_npu_patch`: verl's own ``npu_patch`` run on a CPU (a throwaway ``torch_npu`` over the stand-in ops).
- :mod:`.fla`: an FLA-like Gated DeltaNet kernel to bind where transformers or verl bind FLA's.
- :mod:`.mindspeed_stand_in`: a stand-in ``mindspeed`` package written to disk.
- :mod:`.npu_host`: transformers' own Ascend NPU flash-attention path, driven on a host without an NPU.

``tests`` is a regular package (``tests/__init__.py``) so that ``tests.helpers`` is this folder even where another
``tests`` package is installed; the test folders themselves are not packages (pytest imports their files by
basename, so basenames are unique across folders).
"""

from pathlib import Path

#: The repository root.
REPO = Path(__file__).resolve().parents[2]
#: The scripts the tests run in a fresh interpreter (``tests/drivers``).
DRIVERS = REPO / "tests" / "drivers"
