#!/usr/bin/env bash
# Makes the TRL environment that tools/bench_train.py runs tools/trl_workload.py in.
#
#   bash tools/trl_setup.sh [VENV]     # VENV defaults to .bench-trl-venv in the repo root
#
# A python3.11 venv with tools/trl_requirements.txt (torch installed first: it is the CPU
# wheel on this machine's disk), plus TRL 1.12.0, the last release with a PPO trainer,
# installed --no-deps into VENV/trl-ppo (trl_workload.py puts it first on sys.path for
# --algo ppo). Does nothing when VENV already has all of it.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-$ROOT/.bench-trl-venv}
REQUIREMENTS=$ROOT/tools/trl_requirements.txt
PPO_TRL=trl==1.12.0

ready() {
    [[ -x $VENV/bin/python && -d $VENV/trl-ppo/trl-${PPO_TRL#trl==}.dist-info ]] || return 1
    "$VENV/bin/python" - "$REQUIREMENTS" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, pinned = line.split("==")
        try:
            installed = version(name)
        except PackageNotFoundError:
            sys.exit(1)
        if installed.split("+")[0] != pinned:
            sys.exit(1)
PY
}

if ready; then
    echo "TRL environment ready: $VENV"
    exit 0
fi

[[ -x $VENV/bin/python ]] || python3.11 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
"${PIP[@]}" "$(grep -E '^torch==' "$REQUIREMENTS")"
"${PIP[@]}" -r "$REQUIREMENTS"
rm -rf "$VENV/trl-ppo"
"${PIP[@]}" --no-deps --target "$VENV/trl-ppo" "$PPO_TRL"
ready || { echo "TRL environment at $VENV does not match $REQUIREMENTS" >&2; exit 1; }
echo "TRL environment ready: $VENV"
