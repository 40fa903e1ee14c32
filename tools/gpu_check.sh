#!/usr/bin/env bash
# The trainer's GPU path, checked in one go on a lent GPU machine (one GPU is enough).
#
#     bash tools/gpu_check.sh            # from anywhere; outputs under $OUT (default ./gpu_check_out)
#
# Steps (each with its own time limit, all inside GPU_CHECK_BUDGET_S, default 480 s; a failed
# step is recorded and the next one runs; the summary is the last thing printed):
#   env       nvidia-smi, python, torch and CUDA as the machine has them
#   venv      a venv that also sees the base python3's packages (the machine's CUDA torch);
#             then `pip install torch==2.13.0` (fails fast where no registry is reachable: the
#             machine's own CUDA torch is used then) and `pip install -e .[test]` (offline:
#             --no-deps --no-build-isolation; every command below also runs from the source tree)
#   ppo       `nereus train configs/tiny_ppo.yaml --set device=cuda`, one process (all stages
#             dp=tp=1), 4 steps, checkpoints at 2 and 4; metrics must carry peak_device_memory_bytes
#   resume    the same job as 2 steps + `--resume` to 4: checkpoint save/restore on CUDA buffers;
#             its losses are compared with the uninterrupted run's (CUDA kernels may differ in
#             the last bits, so the difference is printed and a tolerance of 1e-4 applied)
#   grpo_bf16 tiny_grpo on one process in bfloat16, 3 steps, actor.train and ref.infer micro-batched
#   reshard   tests/reshard as they are (gloo on CPU: the tests have no NCCL switch, and one GPU
#             cannot host a multi-rank NCCL group anyway)
# tools/bench_reshard.py is skipped: it is gloo-only (2 CPU processes).
#
# Files under $OUT (at most 8): summary.txt, env.log, install.log, train_ppo.log,
# train_grpo.log, metrics_ppo.jsonl, reshard_tests.log.
#
# Knobs: GPU_CHECK_BUDGET_S (overall seconds), BASE_PY (default python3), GPU_CHECK_DEVICE
# (default cuda; cpu only to try the script itself on a machine without a GPU).
set -u

cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_BUDGET_S:-480}
DEADLINE=$(( $(date +%s) + BUDGET ))
WORK=${GPU_CHECK_WORK:-/tmp/nereus-gpu-check}
rm -rf "$WORK" && mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_RETRIES=0 PIP_TIMEOUT=10
BASE_PY=${BASE_PY:-python3}
PY=$BASE_PY
DEVICE=${GPU_CHECK_DEVICE:-cuda}
export OUT WORK BASE_PY PY DEVICE
RESULTS=()

# step NAME CAP_SECONDS LOGFILE CMD...: run CMD with the smaller of CAP and the time left,
# appending to $OUT/LOGFILE; record the exit code (124: timed out) and the seconds taken.
step() {
    local name=$1 cap=$2 log=$3 left rc t0
    shift 3
    left=$(( DEADLINE - $(date +%s) - 5 ))
    if (( left < 10 )); then
        RESULTS+=("$(printf '%-10s SKIP  (overall budget of %ss spent)' "$name" "$BUDGET")")
        return 0
    fi
    (( cap > left )) && cap=$left
    echo "=== $name (limit ${cap}s): $*" >> "$OUT/$log"
    t0=$(date +%s)
    # through bash: CMD may be an exported function; timeout signals the whole process group
    timeout -k 10 "$cap" bash -c '"$@"' "$name" "$@" >> "$OUT/$log" 2>&1
    rc=$?
    RESULTS+=("$(printf '%-10s %-5s rc=%-3s %4ss  (%s)' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL)" "$rc" "$(( $(date +%s) - t0 ))" "$log")")
    echo "=== $name: rc=$rc" >> "$OUT/$log"
    return 0
}

# ------------------------------------------------------------------ environment and install
step env 60 env.log bash -c "nvidia-smi; uname -a; nproc; $BASE_PY -c 'import sys, torch; print(sys.executable, sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available(), torch.cuda.device_count()); print(\"gpu:\", torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"none\")'"

make_venv() {
    "$BASE_PY" -m venv --system-site-packages "$WORK/venv" || return 1
    # When python3 is itself a venv, --system-site-packages reaches its base interpreter,
    # not the packages next to python3 (the machine's CUDA torch): list those in a .pth.
    local purelib
    purelib=$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    "$BASE_PY" -c 'import site; print("\n".join(site.getsitepackages()))' > "$purelib/_base_python_site.pth"
}
export -f make_venv
step venv 60 install.log make_venv
if [ -x "$WORK/venv/bin/python" ]; then PY=$WORK/venv/bin/python; fi
step torch 240 install.log "$PY" -m pip install torch==2.13.0
if ! "$PY" -c 'import torch' >> "$OUT/install.log" 2>&1; then  # a torch install cut short: back to python3's
    echo "--- torch does not import in $PY: using $BASE_PY" >> "$OUT/install.log"
    PY=$BASE_PY
fi
install_nereus() {
    "$PY" -m pip install -e '.[test]' && return 0
    echo "--- pip install -e .[test] failed (offline?): retrying without dependencies"
    "$PY" -m pip install --no-deps --no-build-isolation -e .
}
export -f install_nereus
step install 180 install.log install_nereus
step probe 60 install.log "$PY" -c "import torch, nereus, nereus.trainer.runtime.step; print('nereus from', nereus.__file__); print('torch', torch.__version__, 'cuda', torch.version.cuda); assert '$DEVICE' == 'cpu' or torch.cuda.is_available(), 'no CUDA'"

# ------------------------------------------------------------------ trainer on CUDA, one process
ONE_PROCESS_PPO=(nproc=1 plan.actor.train.dp=1 plan.actor.train.tp=1 plan.actor.gen.dp=1 plan.critic.train.dp=1
                 plan.critic.infer.dp=1 plan.critic.infer.tp=1 plan.ref.infer.dp=1 plan.ref.infer.tp=1)
ONE_PROCESS_GRPO=(nproc=1 plan.actor.train.dp=1 plan.actor.gen.dp=1 plan.actor.gen.tp=1 plan.ref.infer.dp=1 plan.ref.infer.tp=1)
sets() { for s in "$@"; do printf -- '--set\n%s\n' "$s"; done; }
mapfile -t PPO_SETS < <(sets "${ONE_PROCESS_PPO[@]}" "device=$DEVICE" checkpoint_every=2)
mapfile -t GRPO_SETS < <(sets "${ONE_PROCESS_GRPO[@]}" "device=$DEVICE" steps=3 model.dtype=bfloat16 \
                           plan.actor.train.micro_batch_size=32 plan.ref.infer.micro_batch_size=64)
TRAIN=("$PY" -m nereus.cli.app train)

check_metrics() {  # the uninterrupted run's metrics: 4 steps, device memory reported
    cp "$WORK/ppo_whole/metrics.jsonl" "$OUT/metrics_ppo.jsonl" || return 1
    "$PY" - "$WORK/ppo_whole/metrics.jsonl" <<'EOF'
import json, os, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
last = rows[-1]
print("steps", [r["step"] for r in rows], "reward_mean", [round(r["reward_mean"], 3) for r in rows])
print("stage_seconds", last["stage_seconds"], "tokens_per_s", round(last["tokens_per_s"]))
print("peak_memory_bytes", last["peak_memory_bytes"], "peak_device_memory_bytes", last.get("peak_device_memory_bytes"))
assert [r["step"] for r in rows] == [1, 2, 3, 4], "expected steps 1..4"
if os.environ["DEVICE"] == "cuda":
    assert last.get("peak_device_memory_bytes") and last["peak_device_memory_bytes"][0] > 0, "no peak_device_memory_bytes"
EOF
}
compare_resume() {  # the resumed run repeats the uninterrupted one's losses
    "$PY" - "$WORK/ppo_whole/metrics.jsonl" "$WORK/ppo_split/metrics.jsonl" <<'EOF'
import json, sys
keys = ("actor/loss", "critic/loss", "reward_mean", "kl")
whole, split = ([json.loads(line) for line in open(p)] for p in sys.argv[1:3])
assert [r["step"] for r in split] == [r["step"] for r in whole], ([r["step"] for r in split], [r["step"] for r in whole])
diff = max(abs(a[k] - b[k]) for a, b in zip(whole, split) for k in keys)
print("exact" if diff == 0 else f"max |difference| over {keys}: {diff:.3g}")
assert diff <= 1e-4, "resumed losses differ from the uninterrupted run"
EOF
}
export -f check_metrics compare_resume
step ppo 150 train_ppo.log "${TRAIN[@]}" configs/tiny_ppo.yaml "${PPO_SETS[@]}" --set steps=4 --run-dir "$WORK/ppo_whole"
step metrics 30 train_ppo.log check_metrics
step ppo_half 120 train_ppo.log "${TRAIN[@]}" configs/tiny_ppo.yaml "${PPO_SETS[@]}" --set steps=2 --run-dir "$WORK/ppo_split"
step resume 120 train_ppo.log "${TRAIN[@]}" configs/tiny_ppo.yaml "${PPO_SETS[@]}" --set steps=4 --run-dir "$WORK/ppo_split" --resume
step resume_eq 30 train_ppo.log compare_resume
step grpo_bf16 150 train_grpo.log "${TRAIN[@]}" configs/tiny_grpo.yaml "${GRPO_SETS[@]}" --run-dir "$WORK/grpo"

# ------------------------------------------------------------------ reshard tests (gloo, as they are)
step reshard 400 reshard_tests.log "$PY" -m pytest -q -p no:cacheprovider tests/reshard

# ------------------------------------------------------------------ summary
{
    echo "nereus GPU check, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), python: $PY"
    grep -m1 -E '^torch ' "$OUT/env.log" || true
    grep -m1 -E '^gpu: ' "$OUT/env.log" || true
    printf '%s\n' "${RESULTS[@]}"
    echo "bench_reshard SKIP  (tools/bench_reshard.py is gloo-only)"
} > "$OUT/summary.txt"
echo
cat "$OUT/summary.txt"
