#!/usr/bin/env bash
# The simulated Ascend host (tests/ascend_host): a stand-in torch_npu 2.13.0 (PrivateUse1 renamed npu over CPU
# memory, the npu ops for npu tensors only, the lazy torchair) first on PYTHONPATH, in a pytest process of its own.
# Builds the stand-in's C++ extension first (cached: $QWEN_NPU_SIM_BUILD or ~/.cache/qwen_npu_compile/npu_sim-*)
# and prints the build and test times. Extra arguments go to pytest. Run from any folder, in the project's venv.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/tests/ascend_host/stand_in${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
python -c "import torch_npu, sys; print(f'ascend_host: stand-in torch_npu {torch_npu.__version__} built/loaded in {torch_npu._build.LOAD_SECONDS:.1f}s ({torch_npu._build.build_dir()})')"
built=$(date +%s)
echo "ascend_host: build took $((built - start))s"
status=0
python -m pytest -q -p no:cacheprovider tests/ascend_host "$@" || status=$?
echo "ascend_host: tests took $(( $(date +%s) - built ))s (build + tests $(( $(date +%s) - start ))s)"
exit $status
