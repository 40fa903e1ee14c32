"""Benchmark: Nereus GRPO and PPO against TRL's GRPOTrainer and PPO trainer, same workload.

    python tools/bench_train.py [--steps 5] [--warmup 2] [--trl-python PATH] [--out bench_results/train.json]

The workload (``WORKLOAD``; issue 4 §10): a Llama decoder, 4 layers, hidden 256 (4 heads
of 64, 2 KV heads, SwiGLU 768, vocab 1024), float32, trained from its random init; 32
completions per optimizer step (GRPO: 8 prompts × 4 samples; PPO: 32 prompts × 1), 16
prompt tokens, exactly 48 completion tokens (EOS ignored, so both sides generate the
same number of tokens), temperature 1, one epoch of one mini-batch per step, lr 1e-5.
GRPO: actor + reference (k3 KL term, β 0.04, TRL's convention) and a rule reward. PPO:
actor, reference, critic and a reward *model* of the same shape (TRL's PPO trainer needs
one, so Nereus runs one too), GAE, clipped losses.

Nereus runs through ``nereus train``'s own worker (``trainer.worker.run_worker``, launched
like the CLI) at 1 and 2 local processes (2: every model-stage dp=2), each with its
threads = cores / processes; the faster counts. TRL runs in its own virtual environment
(``tools/trl_setup.sh`` makes it: TRL pins its own transformers, which Nereus does not
need) through ``tools/trl_workload.py``, single process, at its best thread count.

Each side runs ``--warmup`` steps that are not counted, then ``--steps`` measured steps;
completion tokens per second = completion tokens per step / median step seconds (both
sides count the tokens they actually generated). Per-stage seconds are medians over the
measured steps. Bar: Nereus ≥ 1.1× TRL's completion tokens/s for both algorithms (the
loss aggregation and mixed precision of the layout-invariance work must not cost that).

The floor row (``compute_floor``) is what the workload's linear-layer matmuls alone take on
this machine: every matmul shape of generation, inference and training timed in the same
run, at all cores. No fp32 implementation of the same algorithm can step faster, so its
tokens/s over TRL's (``{algo}_floor_over_trl``) is the most any of them could reach over
TRL here; when it is below 3 the bar cannot be met on this machine.

The layout rows run the default job (configs/tiny_ppo.yaml, 4 processes) under each
training layout of ``LAYOUTS`` (actor.train and critic.train together), one launch per
layout: median seconds per step after the warm-up and every rank's peak resident memory.
The first step of each starts from the same seeded state, so its gathered parameters and
AdamW moments also measure layout invariance in float32 (``layout_invariance_max_rel_err``:
the largest per-tensor max|Δθ| / max|θ| against the first layout;
``layout_invariance_moments_rel_err`` the same for AdamW's m and v, the gradient's images);
the same matrix in float64 in one more launch gives ``layout_invariance_fp64_rel_err``,
the layout's own effect once float32 rounding is out of the way (trainer/runtime/layout_check.py).

The recompute rows (``run_recompute_rows``) run the default job and a longer-response
variant (fixed 96-token responses, the 4-layer 256-wide decoder) with ``recompute`` none,
selective and full on actor.train and critic.train: median step and training seconds, peak
RSS per rank, and in a second launch the training stages' activation peak, measured as the
tensor bytes their forward and backward allocate beyond what was alive before
(``StageMeter(tensors=...)``, under the profiler). ``recompute_memory_saving`` = 1 − full ÷
none of actor.train's on the long variant; bar ≥ 0.30.

The packing rows (``run_packing_rows``) run a job whose random-init policy stops at <eos>
after a geometric number of tokens (responses of 1 to 64 in one batch; the run prints the
spread), padded and with ``micro_batch_tokens`` on every training and inference stage.
``packing_speedup`` = padded step ÷ packed step (bar ≥ 1.3); ``packing_stages_speedup`` the
same for the inference and training seconds, the stages packing changes; and
``packing_speedup_bound`` what the step would gain if those stages took no time at all
(generation and the weight sync are the same either way), the most any packing can give.

``--sections`` picks what runs (default: all). The last printed line is one JSON object: ``grpo_over_trl``, ``ppo_over_trl``, the floor
figures and the figures behind them, and the layout-invariance figures. The machine is
shared and noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from nereus.trainer.config.names import ACTOR_TRAIN, CRITIC_INFER, CRITIC_TRAIN, REF_INFER  # noqa: E402 - loads torch (config imports reshard/layout.py)

WORKLOAD = {
    "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 768, "num_layers": 4, "num_heads": 4,
    "num_kv_heads": 2, "max_seq_len": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "prompt_len": 16, "new_tokens": 48, "prompts_per_step": 8, "group": 4, "lr": 1e-5, "seed": 0,
}
KL_COEF = 0.04
BAR = 1.1
RECOMPUTE_BAR = 0.30  # full recompute saves at least this share of the training stage's activation peak
PACKING_BAR = 1.3  # packed over padded, on a batch whose response lengths vary 10x
TINY_PPO = ROOT / "configs" / "tiny_ppo.yaml"
LAYOUTS = {  # actor.train and critic.train, both; the shipped plan first
    "shipped (actor dp2·tp2, critic dp4 FSDP)": {},
    "dp4": dict(dp=4, tp=1, pp=1, dp_shard="false"),
    "dp4 FSDP": dict(dp=4, tp=1, pp=1, dp_shard="true"),
    "dp2·tp2": dict(dp=2, tp=2, pp=1, dp_shard="false"),
    "dp2·tp2 FSDP": dict(dp=2, tp=2, pp=1, dp_shard="true"),
    "tp2·pp2": dict(dp=1, tp=2, pp=2, dp_shard="false"),
    "tp4": dict(dp=1, tp=4, pp=1, dp_shard="false"),
    "dp2·pp2 FSDP": dict(dp=2, tp=1, pp=2, dp_shard="true"),
}


# --------------------------------------------------------------------------- Nereus


def nereus_config(algo: str, nproc: int, steps: int, run_dir: str) -> dict:
    """The job config of the workload: the repeat task with 14 digits gives 16-token prompts."""
    w = WORKLOAD
    model = {
        "vocab_size": w["vocab_size"], "hidden_size": w["hidden_size"], "intermediate_size": w["intermediate_size"],
        "num_layers": w["num_layers"], "num_heads": w["num_heads"], "num_kv_heads": w["num_kv_heads"],
        "max_seq_len": w["max_seq_len"], "rope_theta": w["rope_theta"], "rms_norm_eps": w["rms_norm_eps"],
        "dtype": "float32",
    }
    batch = w["prompts_per_step"] * w["group"]
    layout = {"dp": nproc}
    cfg = {
        "seed": w["seed"], "algorithm": algo, "steps": steps, "nproc": nproc, "run_dir": run_dir,
        "checkpoint_every": 0, "model": model,
        "task": {"name": "repeat", "digits": w["prompt_len"] - 2, "response_len": 3},
        "rollout": {
            "prompts_per_step": w["prompts_per_step"] if algo == "grpo" else batch,
            "samples_per_prompt": w["group"] if algo == "grpo" else 1,
            "max_new_tokens": w["new_tokens"], "temperature": 1.0, "ignore_eos": True,
        },
        "plan": {"actor": {"train": layout, "gen": layout}, "ref": {"infer": layout}},
    }
    hp = {"lr": w["lr"], "kl_coef": KL_COEF, "epochs": 1, "minibatch_size": batch}
    if algo == "grpo":
        cfg["grpo"] = hp
    else:
        cfg["ppo"] = {**hp, "critic_lr": w["lr"], "kl_in_reward": True}
        cfg["critic"] = dict(model)
        cfg["reward_model"] = dict(model)
        cfg["plan"].update({"critic": {"train": layout, "infer": layout}, "reward": {"infer": layout}})
    return cfg


def run_nereus(algo: str, nproc: int, warmup: int, steps: int) -> dict:
    """One ``nereus train`` job of warmup + steps steps; the measured steps' figures."""
    from nereus.launch import launch_local
    from nereus.trainer.prepare import load_config
    from nereus.trainer.runtime.worker import run_worker

    with tempfile.TemporaryDirectory(prefix="nereus-bench-train-") as run_dir:
        cfg = load_config(nereus_config(algo, nproc, warmup + steps, run_dir))
        last = launch_local(run_worker, nproc, cfg, False, run_id=f"bench-train-{uuid.uuid4().hex[:8]}")[0]
        if "error" in last:
            raise RuntimeError(f"nereus {algo} nproc={nproc}: {last['error']}")
        lines = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        lines = [m for m in lines if "reward_mean" in m]  # training steps (a validation before step 1 is step 0)
    measured = lines[warmup:]
    batch = cfg.batch_size
    tokens = [m["response_length"] * batch for m in measured]
    seconds = [m["step_seconds"] for m in measured]
    median = statistics.median(seconds)
    stages = {k: statistics.median(m["stage_seconds"][k] for m in measured) for k in measured[0]["stage_seconds"]}
    return {
        "engine": "nereus", "algo": algo, "setting": f"{nproc} proc × {max(1, (os.cpu_count() or 1) // nproc)} threads",
        "step_seconds": seconds, "step_seconds_median": median,
        "completion_tokens_per_step": statistics.median(tokens),
        "completion_tokens_per_s": statistics.median(tokens) / median,
        "stage_seconds": stages,
    }


# --------------------------------------------------------------------------- TRL


def default_trl_python() -> Path:
    return ROOT / ".bench-trl-venv" / "bin" / "python"


def run_trl(algo: str, python: Path, warmup: int, steps: int) -> dict:
    """tools/trl_workload.py in the TRL environment; its last stdout line is its result."""
    if not python.exists():
        raise SystemExit(f"no TRL environment at {python}: run `bash tools/trl_setup.sh` first (or pass --trl-python)")
    workload = json.dumps({**WORKLOAD, "warmup": warmup, "steps": steps})
    cmd = [str(python), str(ROOT / "tools" / "trl_workload.py"), "--algo", algo, "--workload", workload]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"TRL {algo} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["engine"], result["setting"] = "trl", f"1 proc × {result.get('threads', '?')} threads"
    return result


# --------------------------------------------------------------------------- floor


def layer_shapes(w: dict) -> list[tuple[int, int]]:
    """(in, out) of every linear layer of the decoder's blocks, in order."""
    h, i, d = w["hidden_size"], w["intermediate_size"], w["hidden_size"] // w["num_heads"]
    q, kv = w["num_heads"] * d, w["num_kv_heads"] * d
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)] * w["num_layers"]


def matmul_seconds(m: int, k: int, n: int, threads: int, kind: str) -> float:
    """Seconds of one fp32 matmul of the given pass at this machine's best speed:
    ``fwd`` y = x Wᵀ (x [m, k], W [n, k]); ``dgrad`` g W (g [m, n]); ``wgrad`` gᵀ x."""
    import torch
    import torch.utils.benchmark as tb

    x, weight, g = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
    stmt = {"fwd": "F.linear(x, weight)", "dgrad": "g @ weight", "wgrad": "g.t() @ x"}[kind]
    timer = tb.Timer(stmt, globals={"F": torch.nn.functional, "x": x, "weight": weight, "g": g}, num_threads=threads)
    return min(timer.blocked_autorange(min_run_time=0.2).times)  # a floor: the best block, not a typical one


def compute_floor(algo: str, threads: int) -> dict:
    """Seconds per step that the workload's linear-layer matmuls alone take here, timed shape
    by shape in this run at ``threads`` threads: a lower bound for any fp32 implementation
    of the same algorithm (attention, norms, sampling, optimizer and dispatch not counted).

    Per step (B completions, P prompt and N completion tokens, T = P + N):
    generation = a prefill of B·P tokens through the layers plus the LM head on the last
    prompt token (M = B), and N − 1 decode steps of B tokens with the head; inference = one
    forward of B·T tokens through the layers, with the head on the B·N scored positions, per
    forward model (GRPO: the reference; PPO: the actor's old log-probs, the reference, the
    critic and the reward model, the last two without the LM head); training = forward plus
    both backward matmuls (input and weight gradients) per trained model (PPO: actor and
    critic).
    """
    w = WORKLOAD
    b, p, n = w["prompts_per_step"] * w["group"], w["prompt_len"], w["new_tokens"]
    timed: dict = {}

    def seconds(m: int, k: int, out: int, kinds: tuple[str, ...]) -> float:
        for kind in kinds:
            if (m, k, out, kind) not in timed:
                timed[m, k, out, kind] = matmul_seconds(m, k, out, threads, kind)
        return sum(timed[m, k, out, kind] for kind in kinds)

    def layers(m: int, kinds: tuple[str, ...] = ("fwd",)) -> float:
        return sum(seconds(m, k, out, kinds) for k, out in layer_shapes(w))

    def head(m: int, kinds: tuple[str, ...] = ("fwd",)) -> float:
        return seconds(m, w["hidden_size"], w["vocab_size"], kinds)

    train = ("fwd", "dgrad", "wgrad")
    generation = layers(b * p) + head(b) + (n - 1) * (layers(b) + head(b))
    lm_forward, value_forward = layers(b * (p + n)) + head(b * n), layers(b * (p + n))
    lm_train, value_train = layers(b * (p + n), train) + head(b * n, train), layers(b * (p + n), train)
    if algo == "grpo":
        stages = {"generation": generation, "inference": lm_forward, "training": lm_train}
    else:
        stages = {"generation": generation, "inference": 2 * lm_forward + 2 * value_forward, "training": lm_train + value_train}
    return {"engine": "floor", "algo": algo, "setting": f"linear matmuls only, {threads} threads",
            "step_seconds_median": sum(stages.values()), "completion_tokens_per_step": b * n,
            "completion_tokens_per_s": b * n / sum(stages.values()), "stage_seconds": stages}


# --------------------------------------------------------------------------- layouts


def layout_plan(layout: dict) -> list[str]:
    return [f"plan.{m}.train.{k}={v}" for m in ("actor", "critic") for k, v in layout.items()]


def run_layout_rows(warmup: int, steps: int) -> tuple[list[dict], dict]:
    """The default job under every layout of ``LAYOUTS`` (one launch each), and the
    layout-invariance figures of their first steps (module docstring)."""
    import numpy as np

    from nereus.trainer.prepare import load_config
    from nereus.trainer.runtime.layout_check import compare, run_layouts, state_kind

    rows, results = [], []
    with tempfile.TemporaryDirectory(prefix="nereus-bench-layouts-") as run_dir:
        for name, layout in LAYOUTS.items():
            cfg = load_config(TINY_PPO, [f"run_dir={run_dir}/{len(rows)}", "checkpoint_every=0"])
            (r,) = run_layouts(cfg, [layout_plan(layout)], steps=warmup + steps)
            results.append(r)
            rows.append({"layout": name, "step_seconds_median": statistics.median(r.step_seconds[warmup:]),
                         "peak_memory_mib": [round(b / 2**20) for b in r.peak_memory_bytes]})
        cfg = load_config(TINY_PPO, [f"run_dir={run_dir}/fp64", "checkpoint_every=0", "model.dtype=float64"])
        fp64 = run_layouts(cfg, [layout_plan(layout) for layout in LAYOUTS.values()])
    worst = compare(results)
    figures = {
        "layout_invariance_max_rel_err": max(w["param"][0] for w in worst.values()),
        "layout_invariance_moments_rel_err": max(max(w["exp_avg"][0], w["exp_avg_sq"][0]) for w in worst.values()),
        "layout_invariance_metrics_err": max(w["metrics"][0] for w in worst.values()),
        "layout_invariance_fp64_rel_err": max(max(e for e, _ in w.values()) for w in compare(fp64).values()),
    }
    for row, r in zip(rows[1:], results[1:]):
        row["param_rel_err"] = max(
            float(np.abs(r.state[k].astype(np.float64) - results[0].state[k]).max() / max(np.abs(results[0].state[k]).max(), 1e-30))
            for k in r.state if state_kind(k) == "param"
        )
    return rows, figures


def layout_table(rows: list[dict]) -> str:
    out = ["| layout (actor.train and critic.train) | step s | peak RSS per rank, MiB | params after step 1 vs shipped |",
           "| --- | --- | --- | --- |"]
    for r in rows:
        err = f"{r['param_rel_err']:.1e}" if "param_rel_err" in r else "(reference)"
        out.append(f"| {r['layout']} | {r['step_seconds_median']:.3f} | {', '.join(map(str, r['peak_memory_mib']))} | {err} |")
    return "\n".join(out)


# --------------------------------------------------------------------------- recompute and packing

WIDE = ["model.hidden_size=256", "model.intermediate_size=768", "model.num_layers=4"]  # the TRL workload's decoder
RECOMPUTE_VARIANTS = {  # the default job, and its longer-response variant (fixed 96-token responses)
    "default job": [],
    "long responses (96 tokens, 4 layers × 256)": [*WIDE, "rollout.max_new_tokens=96", "rollout.ignore_eos=true", "model.max_seq_len=101",
                                                   "rollout.prompts_per_step=32", "ppo.minibatch_size=64"],
}
RECOMPUTE_MODES = ("none", "selective", "full")
# the random-init policy stops at <eos> after a geometric number of tokens: response lengths
# spread from 1 to 64 in one batch (the run prints them)
VARIED = [*WIDE, "rollout.max_new_tokens=64", "model.max_seq_len=69"]
PACK_TOKENS = 512
PACKED_STAGES = (ACTOR_TRAIN, CRITIC_TRAIN, REF_INFER, CRITIC_INFER)
TRAINING = (ACTOR_TRAIN, CRITIC_TRAIN)


def run_recompute_rows(warmup: int, steps: int) -> tuple[list[dict], dict]:
    """Per variant and recompute mode (actor.train and critic.train both): the median step
    and training seconds after the warm-up, every rank's peak resident memory, and, in a
    second launch, the training stages' activation peak — the tensor bytes their forward and
    backward allocate beyond what was alive before (``StageMeter(tensors=...)``, second step;
    the highest rank)."""
    from nereus.trainer.prepare import load_config
    from nereus.trainer.runtime.layout_check import run_layouts

    rows, figures = [], {}
    with tempfile.TemporaryDirectory(prefix="nereus-bench-recompute-") as run_dir:
        for variant, overrides in RECOMPUTE_VARIANTS.items():
            cfg = load_config(TINY_PPO, [f"run_dir={run_dir}/{len(rows)}", "checkpoint_every=0", *overrides])
            plans = [[f"plan.{m}.recompute={mode}" for m in TRAINING] for mode in RECOMPUTE_MODES]
            timed = run_layouts(cfg, plans, steps=warmup + steps)
            measured = run_layouts(cfg, plans, steps=2, tensor_peaks=TRAINING)
            for mode, t, m in zip(RECOMPUTE_MODES, timed, measured):
                rows.append({
                    "variant": variant, "recompute": mode,
                    "step_seconds_median": statistics.median(t.step_seconds[warmup:]),
                    "training_seconds_median": statistics.median(p["training"] for p in t.phase_seconds[warmup:]),
                    "peak_memory_mib": [round(b / 2**20) for b in t.peak_memory_bytes],
                    "activation_peak_mib": {k: round(m.stage_peaks[k] / 2**20, 2) for k in TRAINING},
                })
        long = [r for r in rows if r["variant"] != "default job"]
        peak = {r["recompute"]: r["activation_peak_mib"][ACTOR_TRAIN] for r in long}
        figures["recompute_memory_saving"] = 1 - peak["full"] / peak["none"]
        figures["recompute_selective_saving"] = 1 - peak["selective"] / peak["none"]
        secs = {r["recompute"]: r["training_seconds_median"] for r in long}
        figures["recompute_full_training_slowdown"] = secs["full"] / secs["none"]
    return rows, figures


def run_packing_rows(warmup: int, steps: int) -> tuple[list[dict], dict]:
    """The varied-length job padded and packed (``PACK_TOKENS`` per micro-batch on every
    training and inference stage): median step seconds and the inference and training
    seconds, the stages packing changes (generation is the same in both)."""
    from nereus.trainer.prepare import load_config
    from nereus.trainer.runtime.layout_check import compare, run_layouts

    with tempfile.TemporaryDirectory(prefix="nereus-bench-packing-") as run_dir:
        cfg = load_config(TINY_PPO, [f"run_dir={run_dir}", "checkpoint_every=0", *VARIED])
        plans = [[], [f"plan.{k}.micro_batch_tokens={PACK_TOKENS}" for k in PACKED_STAGES]]
        padded, packed = run_layouts(cfg, plans, steps=warmup + steps)
    rows = []
    for name, r in (("padded", padded), (f"packed, {PACK_TOKENS} tokens", packed)):
        rows.append({
            "setting": name,
            "step_seconds_median": statistics.median(r.step_seconds[warmup:]),
            "inference_training_seconds_median": statistics.median(p["inference"] + p["training"] for p in r.phase_seconds[warmup:]),
            "response_lengths": {k: r.metrics[f"lengths/{k}"] for k in ("response_min", "response_p50", "response_max")},
        })
    padded_step, stages = rows[0]["step_seconds_median"], rows[0]["inference_training_seconds_median"]
    figures = {
        "packing_speedup": padded_step / rows[1]["step_seconds_median"],
        "packing_stages_speedup": stages / rows[1]["inference_training_seconds_median"],
        # generation and the weight sync are the same either way: even free inference and
        # training would leave the step at padded − (inference + training)
        "packing_speedup_bound": padded_step / max(padded_step - stages, 1e-9),
        "packing_update_rel_err": max(max(e for e, _ in w.values()) for w in compare([padded, packed]).values()),
    }
    return rows, figures


def markdown(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of ``rows`` under ``head``."""
    return "\n".join(["| " + " | ".join(head) + " |", "|" + " --- |" * len(head), *("| " + " | ".join(r) + " |" for r in rows)])


def recompute_table(rows: list[dict]) -> str:
    head = ["variant", "recompute", "step s", "training s", "activation peak, actor.train / critic.train MiB", "peak RSS per rank, MiB"]
    return markdown(head, [[r["variant"], r["recompute"], f"{r['step_seconds_median']:.3f}", f"{r['training_seconds_median']:.3f}",
                            f"{r['activation_peak_mib'][ACTOR_TRAIN]:.1f} / {r['activation_peak_mib'][CRITIC_TRAIN]:.1f}",
                            ", ".join(map(str, r["peak_memory_mib"]))] for r in rows])


def packing_table(rows: list[dict]) -> str:
    head = ["setting", "step s", "inference + training s", "response lengths min / p50 / max"]
    return markdown(head, [[r["setting"], f"{r['step_seconds_median']:.3f}", f"{r['inference_training_seconds_median']:.3f}",
                            " / ".join(f"{r['response_lengths'][k]:.0f}" for k in ("response_min", "response_p50", "response_max"))]
                           for r in rows])


# --------------------------------------------------------------------------- report


def table(rows: list[dict]) -> str:
    stage_keys = ["generation", "inference", "training", "sync", "other"]
    head = ["algo", "engine", "setting", "step s", "compl. tok/step", "compl. tok/s", *(f"{k} s" for k in stage_keys)]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        stages = r.get("stage_seconds") or {}
        cells = [
            r["algo"], r["engine"], r["setting"], f"{r['step_seconds_median']:.3f}",
            f"{r['completion_tokens_per_step']:.0f}", f"{r['completion_tokens_per_s']:.0f}",
            *(f"{stages[k]:.3f}" if k in stages else "" for k in stage_keys),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps run before measuring")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="Nereus process counts to try")
    parser.add_argument("--algos", nargs="+", default=["grpo", "ppo"], choices=["grpo", "ppo"])
    parser.add_argument("--sections", nargs="+", default=["trl", "layouts", "recompute", "packing"],
                        choices=["trl", "layouts", "recompute", "packing"], help="what to run (all by default)")
    parser.add_argument("--trl-python", type=Path, default=default_trl_python())
    parser.add_argument("--out", type=Path, default=ROOT / "bench_results" / "train.json")
    args = parser.parse_args()

    os.environ.setdefault("TQDM_DISABLE", "1")  # the workers' progress bars (inherited by the launcher's children)
    load = os.getloadavg()[0]
    if load > 0.5:  # TRL's 2-thread steps slow several-fold when anything else runs (2 cores)
        print(f"warning: load average {load:.2f} before the run; the machine should be idle", flush=True)
    rows, headline = [], {"load_average_before": round(load, 2)}
    for algo in args.algos if "trl" in args.sections else ():
        trl = run_trl(algo, args.trl_python, args.warmup, args.steps)
        ours = [run_nereus(algo, n, args.warmup, args.steps) for n in args.nproc]
        best = max(ours, key=lambda r: r["completion_tokens_per_s"])
        floor = compute_floor(algo, threads=os.cpu_count() or 1)
        rows += [trl, *ours, floor]
        headline[f"{algo}_over_trl"] = round(best["completion_tokens_per_s"] / trl["completion_tokens_per_s"], 3)
        headline[f"{algo}_nereus_tokens_per_s"] = round(best["completion_tokens_per_s"], 1)
        headline[f"{algo}_trl_tokens_per_s"] = round(trl["completion_tokens_per_s"], 1)
        headline[f"{algo}_floor_s"] = round(floor["step_seconds_median"], 4)
        headline[f"{algo}_floor_over_trl"] = round(floor["completion_tokens_per_s"] / trl["completion_tokens_per_s"], 3)

    layouts: list[dict] = []
    if "layouts" in args.sections:
        layouts, figures = run_layout_rows(args.warmup, args.steps)
        headline.update({k: float(f"{v:.3g}") for k, v in figures.items()})
    recompute: list[dict] = []
    if "recompute" in args.sections:  # printed as they finish: these sections are long
        recompute, figures = run_recompute_rows(args.warmup, args.steps)
        headline.update({k: float(f"{v:.3g}") for k, v in figures.items()})
        print(recompute_table(recompute))
        saving = headline["recompute_memory_saving"]
        print(f"bar: full recompute saves >= {RECOMPUTE_BAR:.0%} of actor.train's activation peak on the long-response "
              f"variant: {saving:.0%} ({'met' if saving >= RECOMPUTE_BAR else 'NOT met'}); training "
              f"{headline['recompute_full_training_slowdown']:.2f}x slower", flush=True)
    packing: list[dict] = []
    if "packing" in args.sections:
        packing, figures = run_packing_rows(args.warmup, args.steps)
        headline.update({k: float(f"{v:.3g}") for k, v in figures.items()})
        print(packing_table(packing))
        speedup = headline["packing_speedup"]
        print(f"bar: a packed step >= {PACKING_BAR}x faster than a padded one: {speedup:.2f}x "
              f"({'met' if speedup >= PACKING_BAR else 'NOT met'}); the stages packing changes (inference + training) "
              f"{headline['packing_stages_speedup']:.2f}x; the most any packing could give this step (generation unchanged) "
              f"{headline['packing_speedup_bound']:.2f}x; the update differs by {headline['packing_update_rel_err']:.1e} "
              "(float32 reduction order through Adam's ε band, as in the layout rows)", flush=True)

    if rows:
        print(table(rows))
        print(f"bar: Nereus >= {BAR}x TRL completion tokens/s; " + ", ".join(
            f"{a}: {headline[f'{a}_over_trl']:.2f}x ({'met' if headline[f'{a}_over_trl'] >= BAR else 'NOT met'})" for a in args.algos))
        print("ceiling: the floor's tokens/s over TRL's, the most any fp32 implementation could reach here; " + ", ".join(
            f"{a}: {headline[f'{a}_floor_over_trl']:.2f}x" for a in args.algos))
    if layouts:
        print()
        print(layout_table(layouts))
        print("layout invariance after one step of the default job: parameters "
              f"{headline['layout_invariance_max_rel_err']:.1e} (float32; Adam's ε band, see trainer/runtime/layout_check.py), "
              f"AdamW moments {headline['layout_invariance_moments_rel_err']:.1e}, metrics {headline['layout_invariance_metrics_err']:.1e}, "
              f"everything in float64 {headline['layout_invariance_fp64_rel_err']:.1e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"workload": WORKLOAD, "kl_coef": KL_COEF, "runs": rows, "layouts": layouts,
                                    "recompute": recompute, "packing": packing, **headline}, indent=2))
    print(f"wrote {args.out}")
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
