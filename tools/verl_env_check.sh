#!/usr/bin/env bash
# The verl and Hugging Face Trainer checks, in a fresh venv with verl 0.9.1 from the registry.
#
#   tools/verl_env_check.sh            # exit status: pytest's
#
# 1. makes a venv in a temporary folder (deleted on exit, also on failure);
# 2. installs torch 2.13.0 (CPU), transformers 5.10.4 (inside verl 0.9.1's pin >=5.5.3,!=5.6.0,<5.11),
#    verl 0.9.1 with all its dependencies (accelerate, ray, peft, tensordict, ... as verl declares them),
#    pytest (+ pytest-xdist: the files run in two processes, as the README suite does), and this project (--no-deps, editable: the qwen_npu backend is registered by entry point);
# 3. runs tests/integrations/test_verl_hook.py (its `-m verl` part drives verl's own FSDP engine on the CPU),
#    tests/integrations/test_trainer.py (accelerate comes with verl) and tests/integrations/test_verl_moe_patch.py (verl's real
#    npu_patch Qwen3-MoE block compiled with qwen_npu) and tests/integrations/test_verl_qwen3_5.py (verl's packed Qwen3.5
#    forward, per-layer compiled: one graph per layer kind, the Gated DeltaNet as one op) and
#    tests/integrations/test_verl_npu_patch.py (verl's npu_patch applied, then QWEN_NPU_COMPILE=1: layers fuse as without it) and
#    tests/integrations/test_verl_fsdp_turbo.py (verl's FSDPTurboEngineWithLMHead over the stand-in tests/stand_ins/fsdp_turbo);
# 4. prints how long the install and the tests took;
# 5. runs tests/ascend_host/test_verl_npu_patch_on_npu.py on the simulated Ascend host (PYTHONPATH=tests/ascend_host/stand_in,
#    its own pytest process; builds the stand-in's C++ extension unless cached) and prints its time.
#
# Environment: PYTHON (default python3.11, else python3), VERL_ENV_KEEP=1 keeps the venv and prints its path.
set -euo pipefail
NAME=verl_env_check KEEP=${VERL_ENV_KEEP:-0}
source "$(dirname "$0")/fresh_venv.sh"

"${pip[@]}" install -q torch==2.13.0 transformers==5.10.4 verl==0.9.1 pytest==9.0.3 pytest-xdist==3.8.0
"${pip[@]}" install -q --no-deps -e "$repo"
installed=$(date +%s)
echo "verl_env_check: install took $(( installed - start ))s, venv $(du -sh "$tmp/venv" | cut -f1)"
# preflight: what the tests would otherwise skip without (verl's engine module, accelerate) must import
"$tmp/venv/bin/python" -W ignore -c '
import accelerate, torch, transformers, verl
import verl.workers.engine.fsdp.transformer_impl
print(f"verl_env_check: verl {verl.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"accelerate {accelerate.__version__}")' 2>&1 | grep '^verl_env_check' || { echo "verl_env_check: preflight import failed"; exit 1; }

run_tests tests -n 2 --dist loadfile tests/integrations/test_verl_hook.py tests/integrations/test_trainer.py \
    tests/integrations/test_verl_moe_patch.py tests/integrations/test_verl_qwen3_5.py tests/integrations/test_verl_npu_patch.py \
    tests/substitutions/test_deltanet_packed.py tests/integrations/test_verl_fsdp_turbo.py
# 5. verl on the simulated Ascend host (its own NPU branches: is_npu_available, FSDPEngine.__init__'s npu_patch)
run_on_simulated_host "verl tests" tests/ascend_host/test_verl_npu_patch_on_npu.py
exit $status
