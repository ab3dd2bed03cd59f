#!/usr/bin/env bash
# transformers 5.25 with its `kernels` hub dependency: the Gated DeltaNet's bindings (a kernels Func module around
# the hub wrapper), the train()/eval() re-kernelize toggles and the packed-row paths, in a fresh venv.
#
#   tools/kernels_hub_check.sh            # exit status: pytest's
#
# 1. makes a venv in a temporary folder (deleted on exit, also on failure);
# 2. installs torch 2.13.0 (the README's pin), transformers 5.25.0 (which requires kernels 0.19.x and
#    huggingface-hub 2.x), pytest + pytest-xdist, accelerate and protobuf (requirements.txt's pins), and this
#    project (--no-deps, editable: the qwen_npu backend is registered by entry point);
# 3. runs the test files whose code paths depend on how transformers binds the delta rule and the conv
#    (tests/substitutions/test_deltanet_bindings.py, test_deltanet_whole_model.py, test_deltanet_packed.py,
#    test_hybrid_models.py, test_cli.py) in two processes, then the simulated Ascend host's Gated DeltaNet test
#    (FLA bound by the inputs' device, npu) in a process of its own;
# 4. prints how long the install and each test run took.
#
# Environment: PYTHON (default python3.11, else python3), KERNELS_HUB_KEEP=1 keeps the venv and prints its path.
set -euo pipefail
NAME=kernels_hub_check KEEP=${KERNELS_HUB_KEEP:-0}
source "$(dirname "$0")/fresh_venv.sh"

pin() { grep "^$1==" "$repo/requirements.txt"; }
export PATH="$tmp/venv/bin:$PATH"  # the console script, as an activated venv has it (tests/cli/test_cli.py)
"${pip[@]}" install -q "$(pin torch)" transformers==5.25.0 "$(pin pytest)" "$(pin pytest-xdist)" "$(pin accelerate)" \
    "$(pin protobuf)"
"${pip[@]}" install -q --no-deps -e "$repo"
installed=$(date +%s)
"$tmp/venv/bin/python" -W ignore -c '
import importlib.metadata as m
print("kernels_hub_check: " + ", ".join(f"{d} {m.version(d)}" for d in ("torch", "transformers", "kernels", "huggingface-hub")))'
echo "kernels_hub_check: install took $(( installed - start ))s"

run_tests tests -n 2 --dist loadfile \
    tests/substitutions/test_deltanet_bindings.py tests/substitutions/test_deltanet_whole_model.py tests/substitutions/test_deltanet_packed.py \
    tests/e2e/test_hybrid_models.py tests/cli/test_cli.py
run_on_simulated_host "Gated DeltaNet tests" tests/ascend_host/test_gated_delta_rule_npu.py
exit $status
