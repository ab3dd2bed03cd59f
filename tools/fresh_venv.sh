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
