"""The TRL side of ``tools/bench_train.py``: one RL workload through TRL, timed per optimizer step.

    python tools/trl_workload.py --algo grpo|ppo --workload '<json>' [--threads N] [--out FILE]

Run with the TRL environment's python (``tools/trl_setup.sh`` makes it); this script does
not import nereus. Everything is built locally, nothing comes from a model hub
(``HF_HUB_OFFLINE=1``):

- a word-level tokenizer over ``vocab_size`` ids (``<pad> <bos> <eos> <unk>``, then ``t4``
  .. ``t{vocab_size-1}``) with no post-processor, so a prompt of N words is N ids;
- a randomly initialised float32 ``LlamaForCausalLM`` of the workload's shape (fixed
  seed), saved to a temporary directory and loaded back from it, because GRPOTrainer
  builds its reference model from the policy's path;
- ``prompts_per_step × group × (warmup + steps)`` random prompts of exactly
  ``prompt_len`` tokens (plain text, not conversational).

GRPO (``trl.GRPOTrainer``): ``prompts_per_step`` prompts × ``group`` samples = one batch,
one generation, one optimizer step per trainer step (per-device batch = the whole batch,
no gradient accumulation, ``num_iterations=1``); β = 0.04 with a reference model (TRL's
default is β = 0, no reference; 0.04 does the same work as Nereus's k3 KL term); reward:
the fraction of completion tokens equal to the prompt's first token.

PPO (``trl.experimental.ppo.PPOTrainer``): ``prompts_per_step × group`` prompts, one
completion each; policy, reference, value model and reward model all of the workload's
shape (value and reward: ``LlamaForSequenceClassification``, one label); one PPO epoch of
one mini-batch; ``stop_token=None``; KL penalty 0.04 (k1, TRL's estimator) in the reward.
TRL removed its PPO trainer after 1.12.0, so for ``--algo ppo`` the TRL 1.12.0 that
``tools/trl_setup.sh`` installs under ``<venv>/trl-ppo`` goes first on ``sys.path`` (it
runs on the same transformers, accelerate and torch as GRPO).

Both: temperature 1, top-p 1, no top-k, exactly ``new_tokens`` completion tokens (``<pad>``,
``<bos>`` and ``<eos>`` are suppressed while sampling, so nothing stops or truncates a
completion), float32, CPU, one process, no gradient checkpointing, constant learning rate,
no logging, saving or reporting. TRL runs at its best thread count on this 2-core machine
(``--threads``, default 2: measured faster than 1 for both trainers).

Timing: ``warmup`` trainer steps are not counted, then ``steps`` are. A step's seconds run
from the previous step's end (or the start of training) to its end, so they hold all the
trainer does per step. The policy's ``generate`` is wrapped to time it and to count the
completion tokens it returns (non-pad ids after the prompt); the script fails unless every
step produced ``prompts_per_step × group × new_tokens`` of them. The last line printed is
one JSON object: versions, threads, the measured ``step_seconds`` and their median,
``completion_tokens_per_s`` (tokens per step / median step seconds), ``stage_seconds``
(medians of generation and of the rest) and ``notes``; ``--out`` also writes it to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

WORKLOAD_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "max_seq_len",
    "rope_theta", "rms_norm_eps", "prompt_len", "new_tokens", "prompts_per_step", "group", "lr", "seed",
    "warmup", "steps",
)
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0..3
KL_BETA = 0.04  # GRPO's beta and PPO's kl_coef
PPO_TRL_DIR = Path(sys.prefix) / "trl-ppo"  # TRL 1.12.0, the last release with a PPO trainer


def parse_workload(text: str) -> dict:
    workload = json.loads(text)
    missing = [k for k in WORKLOAD_KEYS if k not in workload]
    unknown = sorted(set(workload) - set(WORKLOAD_KEYS))
    if missing or unknown:
        raise SystemExit(f"workload: missing keys {missing}, unknown keys {unknown}")
    if workload["prompt_len"] + workload["new_tokens"] > workload["max_seq_len"]:
        raise SystemExit("workload: prompt_len + new_tokens exceeds max_seq_len")
    return workload


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIALS), vocab_size)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left",
    )


def llama_config(w: dict, tokenizer, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=w["vocab_size"], hidden_size=w["hidden_size"], intermediate_size=w["intermediate_size"],
        num_hidden_layers=w["num_layers"], num_attention_heads=w["num_heads"],
        num_key_value_heads=w["num_kv_heads"], max_position_embeddings=w["max_seq_len"],
        rope_parameters={"rope_type": "default", "rope_theta": w["rope_theta"]}, rms_norm_eps=w["rms_norm_eps"],
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, dtype="float32", **extra,
    )


def save_policy(w: dict, tokenizer, path: str) -> None:
    """The initial policy (seeded random init), saved where the trainers load it from."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(w["seed"])
    LlamaForCausalLM(llama_config(w, tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)


def load_policy(path: str, tokenizer):
    """The saved policy, sampling no special token: every completion runs to its full length."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.suppress_tokens = special_ids(tokenizer)
    return model


def special_ids(tokenizer) -> list[int]:
    return [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id]


def make_prompts(w: dict, tokenizer, count: int) -> list[str]:
    """``count`` prompts of exactly ``prompt_len`` tokens, words drawn from a seeded RNG."""
    rng = random.Random(w["seed"])
    prompts = [" ".join(f"t{rng.randrange(len(SPECIALS), w['vocab_size'])}" for _ in range(w["prompt_len"]))
               for _ in range(count)]
    lengths = {len(ids) for ids in tokenizer(prompts)["input_ids"]}
    if lengths != {w["prompt_len"]}:
        raise RuntimeError(f"prompts tokenize to lengths {sorted(lengths)}, not {w['prompt_len']}")
    return prompts


class StepClock:
    """Per-step wall time, generation time and generated completion tokens.

    ``wrap`` replaces a model's ``generate`` with a timed, counting one; the trainer calls it
    through the model object, so the wrapper sees every rollout. As a TrainerCallback it closes a
    step at ``on_step_end`` (both trainers call it once per optimizer step).
    """

    def __init__(self, pad_id: int):
        self.pad_id = pad_id
        self.step_seconds: list[float] = []
        self.generation_seconds: list[float] = []
        self.tokens: list[int] = []
        self._gen = 0.0
        self._tok = 0
        self._last = None

    def wrap(self, model) -> None:
        generate = model.generate

        def timed_generate(*args, **kwargs):
            start = time.perf_counter()
            out = generate(*args, **kwargs)
            self._gen += time.perf_counter() - start
            sequences = out if hasattr(out, "shape") else out.sequences
            prompt_len = kwargs["input_ids"].shape[1]
            self._tok += int((sequences[:, prompt_len:] != self.pad_id).sum())
            return out

        model.generate = timed_generate

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                clock._last = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                now = time.perf_counter()
                clock.step_seconds.append(now - clock._last)
                clock.generation_seconds.append(clock._gen)
                clock.tokens.append(clock._tok)
                clock._last, clock._gen, clock._tok = now, 0.0, 0

        return _Callback()


def quiet(trainer) -> None:
    """No printing of logs: PPOTrainer logs every step, GRPOTrainer its summary at the end."""
    from transformers import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)


def run_grpo(w: dict, tokenizer, policy_dir: str, out_dir: str, clock: StepClock) -> tuple[str, str]:
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    total_steps = w["warmup"] + w["steps"]
    prompts = make_prompts(w, tokenizer, w["prompts_per_step"] * total_steps)
    first_ids = [tokenizer.convert_tokens_to_ids(p.split()[0]) for p in prompts]
    dataset = Dataset.from_dict({"prompt": prompts, "first_id": first_ids})

    def match_first_token(completion_ids, first_id, **kwargs):
        return [sum(t == f for t in ids) / len(ids) for ids, f in zip(completion_ids, first_id)]

    batch = w["prompts_per_step"] * w["group"]
    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_generations=w["group"],
        num_iterations=1, max_steps=total_steps, max_completion_length=w["new_tokens"],
        temperature=1.0, top_p=1.0, top_k=0, beta=KL_BETA, learning_rate=w["lr"], lr_scheduler_type="constant",
        seed=w["seed"], report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True,
        generation_kwargs={"suppress_tokens": special_ids(tokenizer)},
    )
    trainer = GRPOTrainer(
        model=load_policy(policy_dir, tokenizer), reward_funcs=match_first_token, args=args,
        train_dataset=dataset, processing_class=tokenizer, callbacks=[clock.callback()],
    )
    quiet(trainer)
    clock.wrap(trainer.model)
    trainer.train()
    notes = (f"GRPOTrainer, {w['prompts_per_step']} prompts x {w['group']} samples per step, "
             f"beta {KL_BETA} with a reference model (TRL's default is 0, no reference)")
    return trl.__version__, notes


def run_ppo(w: dict, tokenizer, policy_dir: str, out_dir: str, clock: StepClock) -> tuple[str, str]:
    if not (PPO_TRL_DIR / "trl").is_dir():
        raise SystemExit(f"no PPO-capable TRL at {PPO_TRL_DIR}: run tools/trl_setup.sh")
    sys.path.insert(0, str(PPO_TRL_DIR))
    import torch
    import trl
    from datasets import Dataset
    from transformers import LlamaForSequenceClassification
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    total_steps = w["warmup"] + w["steps"]
    batch = w["prompts_per_step"] * w["group"]
    prompts = make_prompts(w, tokenizer, batch * total_steps)
    dataset = Dataset.from_dict({"input_ids": tokenizer(prompts)["input_ids"]})

    def scalar_model(seed: int):
        torch.manual_seed(seed)
        return LlamaForSequenceClassification(llama_config(w, tokenizer, num_labels=1))

    args = PPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_mini_batches=1, num_ppo_epochs=1,
        total_episodes=batch * total_steps, local_rollout_forward_batch_size=batch,
        response_length=w["new_tokens"], stop_token=None, temperature=1.0, kl_coef=KL_BETA, learning_rate=w["lr"],
        lr_scheduler_type="constant", seed=w["seed"], report_to="none", save_strategy="no", disable_tqdm=True,
        num_sample_generations=0,
    )
    policy = load_policy(policy_dir, tokenizer)
    trainer = PPOTrainer(
        args=args, processing_class=tokenizer, model=policy, ref_model=load_policy(policy_dir, tokenizer),
        reward_model=scalar_model(w["seed"] + 1), value_model=scalar_model(w["seed"] + 2),
        train_dataset=dataset, eval_dataset=dataset, callbacks=[clock.callback()],
    )
    quiet(trainer)
    clock.wrap(policy)
    trainer.train()
    notes = (f"trl.experimental.ppo.PPOTrainer from TRL {trl.__version__} (removed after 1.12.0), "
             f"{batch} prompts x 1 sample per step, kl_coef {args.kl_coef} ({args.kl_estimator}) in the reward")
    return trl.__version__, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algo", choices=("grpo", "ppo"), required=True)
    parser.add_argument("--workload", required=True, help="JSON object with keys: " + ", ".join(WORKLOAD_KEYS))
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2: best here)")
    parser.add_argument("--out", type=Path)
    cli = parser.parse_args()
    w = parse_workload(cli.workload)

    import torch
    import transformers

    torch.set_num_threads(cli.threads)
    transformers.logging.set_verbosity_error()
    tokenizer = build_tokenizer(w["vocab_size"])
    clock = StepClock(tokenizer.pad_token_id)
    with tempfile.TemporaryDirectory(prefix="trl-workload-") as tmp:
        policy_dir = os.path.join(tmp, "policy")
        save_policy(w, tokenizer, policy_dir)
        run = run_grpo if cli.algo == "grpo" else run_ppo
        trl_version, notes = run(w, tokenizer, policy_dir, os.path.join(tmp, "out"), clock)

    completions = w["prompts_per_step"] * w["group"]
    expected = completions * w["new_tokens"]
    if len(clock.step_seconds) != w["warmup"] + w["steps"] or set(clock.tokens) != {expected}:
        raise RuntimeError(f"expected {w['warmup'] + w['steps']} steps of {expected} completion tokens, "
                           f"got {clock.tokens}")
    seconds = clock.step_seconds[w["warmup"]:]
    generation = clock.generation_seconds[w["warmup"]:]
    median = statistics.median(seconds)
    result = {
        "algo": cli.algo, "trl_version": trl_version, "transformers_version": transformers.__version__,
        "torch_version": torch.__version__, "threads": torch.get_num_threads(), "steps": w["steps"],
        "completions_per_step": completions, "completion_tokens_per_step": expected,
        "step_seconds": [round(s, 4) for s in seconds], "step_seconds_median": round(median, 4),
        "completion_tokens_per_s": round(expected / median, 1),
        "stage_seconds": {
            "generation": round(statistics.median(generation), 4),
            "other": round(statistics.median(s - g for s, g in zip(seconds, generation)), 4),
        },
        "notes": f"{notes}; float32, 1 process, {torch.get_num_threads()} torch threads, "
                 f"{w['warmup']} warmup steps not counted",
    }
    line = json.dumps(result)
    if cli.out:
        cli.out.parent.mkdir(parents=True, exist_ok=True)
        cli.out.write_text(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":
    main()
