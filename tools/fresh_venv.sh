# Sourced by the tools/*_check.sh scripts that run tests in a venv of their own: after `set -euo pipefail`,
# with NAME (the script's name, prefixed to every line it prints) and KEEP (1 keeps the venv) set.
# Defines repo (the checkout), python (PYTHON, default python3.11, else python3), start (the epoch seconds at the
# start), tmp (a temporary folder, deleted on exit, also on failure, unless KEEP=1), pip (an array: the venv's
# pip), and creates the venv at $tmp/venv; on exit prints the total time and keeps the script's exit status.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
python=${PYTHON:-$(command -v python3.11 || command -v python3)}
start=$(date +%s)
tmp=$(mktemp -d -t "$NAME.XXXXXX")
cleanup() {
    status=$?
    if [[ "${KEEP:-0}" == 1 ]]; then echo "$NAME: venv kept at $tmp/venv"; else rm -rf "$tmp"; fi
    echo "$NAME: total $(( $(date +%s) - start ))s"
    exit $status
}
trap cleanup EXIT
"$python" -m venv "$tmp/venv"
pip=("$tmp/venv/bin/python" -m pip --disable-pip-version-check)

# run_tests WHAT [pytest args...]: pytest in the venv from the checkout, `set -e` off; prints how long it took and
# records a failure in `status` (the script's exit status: the first failing run's).
status=0
run_tests() {
    local what=$1 began=$(date +%s) code
    shift
    set +e
    (cd "$repo" && "$tmp/venv/bin/python" -m pytest -q -p no:cacheprovider "$@")
    code=$?
    set -e
    echo "$NAME: $what took $(( $(date +%s) - began ))s (pytest exit $code)"
    [[ $status -ne 0 ]] || status=$code
}

# run_on_simulated_host WHAT test files...: run_tests on the simulated Ascend host, in a pytest process of its own
# (the stand-in torch_npu of tests/ascend_host/stand_in first on PYTHONPATH).
run_on_simulated_host() {
    local what=$1
    shift
    PYTHONPATH="$repo/tests/ascend_host/stand_in" run_tests "simulated Ascend host $what" "$@"
}
