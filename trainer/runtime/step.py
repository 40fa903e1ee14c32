"""The step of ``nereus train`` (``Trainer``): generation → inference → training, every
model-stage in its own layout, weights moving between layouts through reshard. The loop
around it — start or restore, metrics, checkpoints, staging, the controller — is
``trainer/runtime/worker.py``.

One step (all ranks, SPMD):

1. weight sync: ``actor.train`` → ``actor.gen`` through reshard's stream executor (the plan
   and transition graph are computed once; every step streams into the live parameters,
   vLLM's own with ``rollout.engine: vllm``);
2. generation: each ``actor.gen`` replica samples responses for its share of the prompts
   (the step's prompts and the replica's sampling seed are the same on all its TP ranks),
   through ``actor.gen``'s ``RolloutEngine``: the built-in generator (``trainer/rollout/generator.py``)
   or vLLM (``trainer/rollout/vllm_engine.py``);
3. inference: rewards, from the task's rule or, with a ``reward_model``, from ``reward.infer``
   (its value at each sequence's last real token; the task's own reward is then logged as
   ``task_reward_mean``); old log-probs (``actor.train``), reference log-probs
   (``ref.infer``) and values (``critic.infer``, synced from ``critic.train``, or
   ``critic.train`` itself in its training layout when the plan has no ``critic.infer``).
   When the step makes exactly one update (one epoch of one mini-batch) and nothing before training
   reads the old log-probs (GRPO, or PPO with the KL as a loss term), π_old = π_θ at that
   update: the actor's forward is skipped and the loss uses its own log-probs, detached
   (ratio exp(l − sg(l)) = 1 with the policy gradient; TRL does the same); the logged KL
   then uses the generator's log-probs;
4. advantages (PPO: GAE over KL-penalised token rewards; GRPO: group-relative);
5. training: the algorithm's epochs over mini-batches for the actor (and critic), each replica taking its
   rows of every mini-batch; gradients synced over dp inside ``forward_backward``.

Devices: ``device`` in the config (``resolve_device``) puts every model-stage on CPU or on
this process's GPU (``cuda:LOCAL_RANK``); on CUDA the process group is gloo for CPU tensors
(object collectives, the reshard agreement) and NCCL for CUDA ones (TP/FSDP/PP, gradient
sync, the weight sync's point-to-point). The step's batch stays on CPU; stages move their
rows to their device and gather results back to CPU (``trainer/runtime/stages.py``).

Each trained model's LR follows its schedule (``trainer/runtime/lr_schedule.py``), positioned at its
AdamW step; ``save`` commits a checkpoint through the store atomically, so ``--resume``
restarts from the last good step and a failed step (NaN loss) never touches it.
"""

from __future__ import annotations

import os
import time
from collections import deque

import torch
import torch.distributed as dist

from ..algos import ppo
from ..algos.advantages import kl_k1, masked_mean, minibatch_indices
from ..algos.registry import Trained, algorithm
from ..config import JobConfig
from ..config.names import (ACTOR_GEN, ACTOR_TRAIN, ACTOR_TRAIN_INFER, ADVANTAGES, CRITIC_INFER, CRITIC_TRAIN, CRITIC_TRAIN_INFER, REF_INFER,
                            REWARD_INFER, TRAIN_CHECK, is_train, model_of, sync_piece)
from ..data.prompts import Prompts, make_source
from ..metrics.log import peak_memory
from ..metrics.meters import StageMeter, rss_bytes, trim_heap
from ..parallel.parallelize import init_stage
from ..prepare import resolve_device
from ..seeds import mix, model_seed
from . import checkpoint, lr_schedule, transition
from .checkpoint import load_hf
from .stages import ModelStage, backward_minibatch, build_stages, gather_rows, infer, make_optimizer, response_logprobs, response_values
from .transition import MESSAGES, measured_messages

class Trainer:
    """The model-stages of one job on this rank, and the step function; ``device`` (default:
    ``worker_device(cfg)``) is where every model-stage lives."""

    def __init__(self, cfg: JobConfig, device: torch.device | str | None = None) -> None:
        baseline = rss_bytes()  # before any model exists: what a CPU stage's peak is measured above
        self.cfg, self.rank = cfg, dist.get_rank()
        self.algo = algorithm(cfg)  # its advantages and losses (trainer/algos/registry.py)
        self.device = worker_device(cfg) if device is None else torch.device(device)
        self.source = make_source(cfg)  # the toy task or the prompt dataset, and its reward
        self.stages = build_stages(cfg, self.rank, self.device)
        for key, stage in self.stages.items():
            if stage.part is not None:  # a vLLM actor.gen has no module: the first sync fills it
                source, model, head = cfg.stage_model(key)
                seed = model_seed(cfg.seed, model_of(key))
                if not model.path:
                    init_stage(stage.part, seed=seed, std=model.init_std)
                elif head == "value" and source == "model":  # a critic on the actor's LM checkpoint
                    load_hf(stage, model.path, fresh_head=(seed, model.init_std))
                else:  # the actor's and reference's LM, or a critic:/reward_model: value checkpoint
                    load_hf(stage, model.path)
            if is_train(key):
                make_optimizer(stage, self.lr(key))
                self.attach_schedule(key, stage)
        self.syncs = transition.plan_syncs(self.stages)
        self.on_policy = cfg.on_policy
        self.step = 0
        self.meter = StageMeter(self.device, baseline)
        self.extra_state: dict = {}  # JSON-able state saved with every checkpoint (the controller's, the sampler's)
        self.messages: deque = deque(maxlen=8 * MESSAGES)  # measured reshard messages, until the controller takes them
        self.state_providers: dict = {}  # key -> () -> JSON-able state, asked for at each job_state()
        self._reward_metrics: dict = {}
        self.restored_state: dict = {}

    def lr(self, key: str) -> float:
        """The configured (peak) learning rate of a training model-stage."""
        return self.cfg.algo_hp.optimizers()[key][0]

    def attach_schedule(self, key: str, stage: ModelStage) -> None:
        """The stage's LR schedule at its optimizer's own step count (``trainer/runtime/lr_schedule.py``):
        when the optimizer is made, and again after a checkpoint loads into it or a transition
        moves its state, so the LR continues where it was."""
        if stage.optimizer is not None:
            stage.scheduler = lr_schedule.attach(stage.optimizer, lr_schedule.plan_schedule(self.cfg, key), self.lr(key))

    def trained_stages(self) -> list[ModelStage]:
        """The training model-stages (what a checkpoint holds), in plan order."""
        return [s for k, s in self.stages.items() if is_train(k)]

    def apply_plan(self, plan, *, verify: bool = False) -> dict:
        """Move the job to ``plan`` between steps (``transition.apply_plan``; collective)."""
        return transition.apply_plan(self, plan, verify=verify)

    # ------------------------------------------------------------------ checkpoints (checkpoint.py)

    def checkpoint_root(self) -> str:
        return checkpoint.checkpoint_root(self)

    def save(self) -> None:
        """Commit the training stages' weights and AdamW state (every rank calls it)."""
        checkpoint.save(self)

    def job_state(self) -> dict:
        return checkpoint.job_state(self)

    def stage(self, stager) -> None:
        """Stage this step's state in node memory (every rank calls it)."""
        checkpoint.stage(self, stager)

    def restore(self, root: str | None = None, *, step: int | None = None) -> int:
        """Load a committed checkpoint into this rank's layouts (``checkpoint.restore``); its step."""
        return checkpoint.restore(self, root, step=step)

    # ------------------------------------------------------------------ one step

    def run_step(self) -> dict:
        """One step (module docstring); its metrics, with every model-stage's own record
        (``stages``: seconds, rows, tokens, this rank's peak memory) and the lengths."""
        cfg, meter, seconds = self.cfg, self.meter, {}
        if self.device.type == "cpu":
            trim_heap()  # metrics/meters.py: a step's measured peak is its own
        start = time.perf_counter()
        syncs = {}
        for sync in self.syncs:
            with meter(sync_piece(sync.dst.key)):
                result = sync()
            self.messages.extend(measured_messages(result))
            stats = getattr(result, "stats", None)
            if stats is not None:
                syncs[sync.dst.key] = {"bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
                                       "bytes_copied": stats.bytes_copied, "seconds": stats.seconds}
        seconds["sync"] = time.perf_counter() - start

        t = time.perf_counter()
        with meter(ACTOR_GEN):
            batch, scores = self._rollout()
        seconds["generation"] = time.perf_counter() - t

        t = time.perf_counter()
        temp = cfg.rollout.temperature
        reward_model, task_scores = REWARD_INFER in self.stages, scores
        if reward_model:
            with meter(REWARD_INFER):
                scores = infer(self.stages[REWARD_INFER], batch, "scores")
        if not self.on_policy:
            with meter(ACTOR_TRAIN_INFER):  # the old log-probs, by the training layout
                batch["old_logprobs"] = infer(self.stages[ACTOR_TRAIN], batch, "logprobs", temp)
        if REF_INFER in self.stages:
            with meter(REF_INFER):
                batch["ref_logprobs"] = infer(self.stages[REF_INFER], batch, "logprobs", temp)
        if self.algo.critic:
            values = self.stages.get(CRITIC_INFER, self.stages[CRITIC_TRAIN])
            with meter(CRITIC_INFER if values.key == CRITIC_INFER else CRITIC_TRAIN_INFER):
                batch["old_values"] = infer(values, batch, "values")
        with meter(ADVANTAGES):
            advantage_metrics = self._advantages(batch, scores)
        seconds["inference"] = time.perf_counter() - t

        t = time.perf_counter()
        train_metrics = self._train(batch)
        seconds["training"] = time.perf_counter() - t

        mask = batch["response_mask"]
        old = batch.get("old_logprobs", batch["rollout_logprobs"])
        kl = masked_mean(kl_k1(old, batch["ref_logprobs"]), mask) if "ref_logprobs" in batch else torch.zeros(())
        total = time.perf_counter() - start
        self.step += 1
        lengths = mask.sum(1)
        return {
            "step": self.step,
            "reward_mean": float(scores.mean()),
            **({"task_reward_mean": float(task_scores.mean())} if reward_model and self.source.rule else {}),
            "kl": float(kl),
            "response_length": float(lengths.float().mean()),
            **self._reward_metrics,
            **self.source.metrics(),
            **train_metrics,
            **advantage_metrics,
            "stage_seconds": seconds,
            "step_seconds": total,
            "tokens_per_s": float(mask.sum()) / total,
            "lengths": _length_summary(batch),
            "stages": self._stage_records(batch, *meter.take()),
            "syncs": syncs,
            "plan": plan_label(cfg.plan),
            **peak_memory(self.device),
        }

    def _stage_records(self, batch: dict, seconds: dict[str, float], peaks: dict[str, int]) -> dict[str, dict]:
        """Per measured piece: seconds (this rank's), rows and tokens it processed (padded:
        ``tokens``; ``real_tokens`` without the padding, what a packed stage computes on), and
        this rank's measured peak bytes (``peak_bytes``; gathered over ranks by
        ``trainer/runtime/worker.py``'s ``gather_rank_figures``)."""
        rows, width = batch["input_ids"].shape
        real = int(batch["attention_mask"].sum())
        hp = self.cfg.algo_hp
        out = {}
        for name, s in seconds.items():
            k = hp.epochs if name in (ACTOR_TRAIN, CRITIC_TRAIN) else 1
            out[name] = {"seconds": s, "rows": rows * k, "tokens": rows * width * k, "real_tokens": real * k, "peak_bytes": peaks.get(name, 0)}
        return out

    def _generate(self, prompts: Prompts, *, temperature: float, top_p: float, seed: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """Every ``actor.gen`` replica samples its share of ``prompts``; the rows of all
        replicas on every rank, as wide as the longest prompt plus the longest response (the
        columns no response reached are padding for every row: dropping them changes no
        result, and time and memory follow the lengths)."""
        cfg, gen, source = self.cfg, self.stages[ACTOR_GEN], self.source
        b, local, width = len(prompts.ids), None, cfg.rollout.max_new_tokens
        ids = list(prompts.ids)
        if b < gen.config.dp:  # every replica generates something (a short validation chunk): the copies are dropped
            ids += [ids[-1]] * (gen.config.dp - b)
        if gen.member:
            lo, hi = gen.rows(len(ids))
            sampling = dict(
                max_new_tokens=prompts.max_new_tokens, temperature=temperature, top_p=top_p,
                stop_tokens=() if cfg.rollout.ignore_eos else source.stop_ids, pad_id=source.pad_id,
            )
            # keyed by the step and the row, not the replica: the same rollouts at any dp (rollout/generator.py)
            seed = mix(*seed)
            out = gen.engine.generate(ids[lo:hi], seed=seed, first_row=lo, **sampling)
            # replicas stack: the same prompt width (the longest prompt of the whole batch) and response width
            local = _padded(out, max(width, prompts.max_new_tokens), source.pad_id, prompt_width=max(map(len, ids)))
        rows = gather_rows(gen, local, len(ids))
        rows = {k: v[:b] for k, v in rows.items()}
        p = rows["tokens"].shape[1] - rows["logprobs"].shape[1]
        n = max(1, int(rows["response_mask"].sum(1).max()))
        return {**rows, "tokens": rows["tokens"][:, : p + n], "attention_mask": rows["attention_mask"][:, : p + n],
                "response_mask": rows["response_mask"][:, :n], "logprobs": rows["logprobs"][:, :n], "prompt_width": p}

    def _rollout(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        cfg = self.cfg
        prompts = self.source.prompts(self.step).repeated(cfg.rollout.samples_per_prompt)
        rows = self._generate(prompts, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              seed=(cfg.seed, self.step))
        p, b = rows["prompt_width"], len(prompts.ids)
        responses = [r[m].tolist() for r, m in zip(rows["tokens"][:, p:], rows["response_mask"])]
        scored = self.source.rewards(self.step, prompts, responses)
        self._reward_metrics = scored.metrics
        scores = scored.scores
        batch = {
            "input_ids": rows["tokens"],
            "attention_mask": rows["attention_mask"],
            "response_mask": rows["response_mask"].float(),
            "rollout_logprobs": rows["logprobs"],
            "prompt_width": torch.full((b,), p, dtype=torch.int64),
        }
        return batch, scores

    def validate(self) -> dict[str, float]:
        """Generation on the validation set with ``validation``'s sampling (greedy by default),
        scored by the job's rule reward: ``val/reward_mean``, ``val/acc`` and
        ``val/response_length`` over all of it, and ``val/<data_source>/reward_mean`` and
        ``.../acc`` per data source. Collective (every rank calls it); {} without a
        validation set. The weights are synced into ``actor.gen`` first: it holds the
        weights of the last step's start, before that step trained."""
        chunks = self.source.validation_prompts()
        if not chunks:
            return {}
        for sync in self.syncs:
            if sync.dst.key == ACTOR_GEN:
                sync()
        v = self.cfg.validation
        scores, accuracy, lengths, sources, failed = [], [], [], [], 0.0
        for k, chunk in enumerate(chunks):
            rows = self._generate(chunk, temperature=v.temperature, top_p=v.top_p, seed=(self.cfg.seed, self.step, -1 - k))
            p = rows["prompt_width"]
            responses = [r[m].tolist() for r, m in zip(rows["tokens"][:, p:], rows["response_mask"])]
            scored = self.source.rewards(self.step, chunk, responses)
            scores.append(scored.scores)
            accuracy.append(scored.accuracy)
            failed += scored.metrics.get("reward/errors", 0.0)
            lengths.append(rows["response_mask"].sum(1).float())
            sources += [row.data_source for row in chunk.rows]
        score, acc = torch.cat(scores), torch.cat(accuracy)
        out = {"val/reward_mean": float(score.mean()), "val/acc": float(acc.mean()),
               "val/response_length": float(torch.cat(lengths).mean()), "val/prompts": float(len(score)),
               "val/reward_errors": failed}
        for name in sorted(set(sources)):
            pick = torch.tensor([s == name for s in sources])
            out[f"val/{name}/reward_mean"] = float(score[pick].mean())
            out[f"val/{name}/acc"] = float(acc[pick].mean())
        return out

    def _advantages(self, batch: dict, scores: torch.Tensor) -> dict[str, float]:
        """The algorithm's advantages (and returns) into ``batch``; their metrics."""
        return self.algo.advantages(self.cfg, batch, scores)

    def _train(self, batch: dict) -> dict[str, float]:
        """The algorithm's epochs over mini-batches: per mini-batch every model's forward and backward
        (its loss normalised by the global mini-batch, ``ppo.loss_weights``), one check that
        everything is finite on every rank, then the optimizer steps."""
        cfg = self.cfg
        hp = cfg.algo_hp
        temp = cfg.rollout.temperature
        g = torch.Generator().manual_seed(mix(cfg.seed, self.step, 99))
        models = [(m.name, self.stages[m.stage], self._loss_fn(m, temp), m.max_grad_norm) for m in self.algo.models(cfg)]
        sums: dict[str, ppo.LossSums] = {}
        norms: dict[str, list[float]] = {name: [] for name, *_ in models}
        lrs: dict[str, float] = {}
        b = batch["input_ids"].shape[0]
        minibatches = list(minibatch_indices(b, hp.minibatch_size, epochs=hp.epochs, generator=g))
        for k, idx in enumerate(minibatches):
            mb = {key: v[idx] for key, v in batch.items()}
            mb["loss_weights"] = ppo.loss_weights(mb["response_mask"], hp.loss_agg, max_length=cfg.rollout.max_new_tokens)
            done = {}
            for name, stage, fn, clip in models:
                with self.meter(stage.key):
                    done[name] = backward_minibatch(stage, mb, fn, clip)
            with self.meter(TRAIN_CHECK):
                self._check_finite(done, k, len(minibatches))
            for name, stage, *_ in models:
                if done[name] is None:
                    continue
                with self.meter(stage.key):
                    lrs[name] = stage.optimizer.param_groups[0]["lr"]  # this update's
                    stage.optimizer.step()
                    if stage.scheduler is not None:
                        stage.scheduler.step()
                norms[name].append(float(done[name].grad_norm))
                if done[name].sums is not None:
                    sums[name] = done[name].sums if name not in sums else sums[name] + done[name].sums
        with self.meter(TRAIN_CHECK):
            mine = {name: (lrs[name], lr_schedule.optimizer_step_count(stage.optimizer), stage.optimizer.param_groups[0]["lr"])
                    for name, stage, *_ in models if name in lrs}
            metrics, self.extra_state["lr_schedule"] = _finish_metrics(sums, norms, len(minibatches), mine)
            return metrics

    def _loss_fn(self, model: Trained, temperature: float):
        """``model``'s loss of its stage's output (the logits or values of the mini-batch's rows):
        the response tokens' log-probs and entropy, or values, computed from the stage's own
        layout (vocabulary-parallel logits), then the algorithm's loss of them."""
        stage = self.stages[model.stage]
        if model.kind == "policy":
            def policy(logits, mb):
                logprobs, entropy = response_logprobs(logits, mb, temperature, stage.part.vocab, entropy=model.entropy)
                return model.loss(logprobs, entropy, mb)

            return policy
        return lambda values, mb: model.loss(response_values(values, mb), mb)

    def _check_finite(self, done: dict, k: int, minibatches: int) -> None:
        """Raise FloatingPointError on every rank, before any optimizer of this mini-batch
        steps, when any model's loss or gradient is not finite on any rank."""
        names = list(done)
        flags = torch.zeros(dist.get_world_size(), len(names))
        for j, name in enumerate(names):
            flags[self.rank, j] = float(done[name] is not None and not done[name].finite)
        dist.all_reduce(flags)
        if not flags.any():
            return
        bad = [f"{name} (rank{'s' * (int(flags[:, j].sum()) > 1)} {', '.join(map(str, flags[:, j].nonzero().flatten().tolist()))})"
               for j, name in enumerate(names) if flags[:, j].any()]
        raise FloatingPointError(
            f"step {self.step + 1}, mini-batch {k + 1} of {minibatches}: the {' and '.join(bad)} loss or gradient "
            "is not finite (NaN/inf); no optimizer stepped on it"
        )


def _length_summary(batch: dict) -> dict:
    """The step's prompt width and response length distribution (its mean is the step's
    ``response_length``; the mean square prices decoding: ``controller.workload``)."""
    lengths = batch["response_mask"].sum(1).float()
    q = torch.quantile(lengths, torch.tensor([0.5, 0.9]))
    return {"prompt": int(batch["prompt_width"][0]), "response_min": float(lengths.min()),
            "response_p50": float(q[0]), "response_p90": float(q[1]), "response_max": float(lengths.max()),
            "response_sq_mean": float((lengths * lengths).mean()),
            "width": int(batch["input_ids"].shape[1])}


def plan_label(plan) -> dict[str, str]:
    """Model-stage -> its layout in one word (``dp2·tp2``, ``dp4 fsdp mb16``), for logs."""
    out = {}
    for key, sc in plan.stages().items():
        parts = sc.label_parts() + ([f"ranks{list(sc.ranks)}"] if sc.ranks is not None else [])
        out[key] = "·".join(parts)
    return out


def _padded(out, width: int, pad_id: int, *, prompt_width: int | None = None) -> dict[str, torch.Tensor]:
    """A rollout padded to ``width`` response columns (and, on the left, to ``prompt_width``
    prompt columns: replicas whose prompts are shorter), so all replicas stack."""
    extra = width - out.logprobs.shape[1]
    left = 0 if prompt_width is None else prompt_width - out.prompt_width
    pad = lambda t, v: torch.nn.functional.pad(t, (left, extra), value=v)  # noqa: E731
    return {
        "tokens": pad(out.tokens, pad_id),
        "attention_mask": pad(out.attention_mask, False),
        "response_mask": pad(out.response_mask, False)[:, -width:],
        "logprobs": torch.nn.functional.pad(out.logprobs, (0, extra), value=0.0),
    }


def _finish_metrics(sums: dict[str, ppo.LossSums], norms: dict[str, list[float]], minibatches: int,
                    lrs: dict[str, tuple[float, int, float]]) -> tuple[dict[str, float], dict[str, dict]]:
    """``model/metric`` over the whole step: every replica's LossSums added in rank order
    (the same sums under every layout, up to the order of their float additions), loss
    terms averaged over the mini-batches, token statistics over every token; ``grad_norm``
    the mean over mini-batches; ``lr`` the LR of the step's last update. With it, for the
    checkpoint, each model's ``{"optimizer_steps": updates so far, "lr": the next update's}``
    (``lrs``: this rank's (last LR, updates, next LR) per model it trains)."""
    mine = {name: {k: float(v) for k, v in s.tensors().items()} for name, s in sums.items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, {name: n for name, n in norms.items() if n}, lrs))
    out: dict[str, float] = {}
    schedules: dict[str, dict] = {}
    for name in norms:
        lr = next((g[name] for *_, g in gathered if name in g), None)
        if lr is not None:
            out[f"{name}/lr"] = lr[0]
            schedules[name] = {"optimizer_steps": lr[1], "lr": lr[2]}
    for name in norms:
        parts = [m[name] for m, *_ in gathered if name in m]
        total = {k: sum(p[k] for p in parts) for k in parts[0]} if parts else {}
        n = max(total.get("tokens", 0.0), 1.0)
        for key, value in total.items():
            kind, _, metric = key.partition("/")
            if kind == "loss":
                out[f"{name}/{metric}"] = value / minibatches
            elif kind == "token":
                out[f"{name}/{metric}"] = value / n
        grad_norms = next((g[name] for _, g, _ in gathered if name in g), [])
        if grad_norms:
            out[f"{name}/grad_norm"] = sum(grad_norms) / len(grad_norms)
    return out, schedules


def worker_device(cfg: JobConfig) -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` when the config resolves to cuda, else CPU."""
    if resolve_device(cfg) == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


