"""The step loop of ``nereus train``: generation → inference → training, every model-stage
in its own layout, weights moving between layouts through reshard.

One step (all ranks, SPMD):

1. weight sync: ``actor.train`` → ``actor.gen`` through reshard's stream executor (the plan
   and transition graph are computed once; every step streams into the live parameters,
   vLLM's own with ``rollout.engine: vllm``);
2. generation: each ``actor.gen`` replica samples responses for its share of the prompts
   (the step's prompts and the replica's sampling seed are the same on all its TP ranks),
   with the built-in generator or the vLLM engine (``trainer/vllm_engine.py``);
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
5. training: PPO epochs over mini-batches for the actor (and critic), each replica taking its
   rows of every mini-batch; gradients synced over dp inside ``forward_backward``.

Devices: ``device`` in the config (``resolve_device``) puts every model-stage on CPU or on
this process's GPU (``cuda:LOCAL_RANK``); on CUDA the process group is gloo for CPU tensors
(object collectives, the reshard agreement) and NCCL for CUDA ones (TP/FSDP/PP, gradient
sync, the weight sync's point-to-point). The step's batch stays on CPU; stages move their
rows to their device and gather results back to CPU (``trainer/stages.py``).

Metrics go to ``RUN_DIR/metrics.jsonl`` and TensorBoard from rank 0; checkpoints every
``checkpoint_every`` steps through the store, committed atomically, so ``--resume`` restarts
from the last good step and a failed step (NaN loss) never touches it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from nereus.reshard.arrays import arrays_from_plan
from nereus.reshard.execute import execute
from nereus.reshard.graph import plan_graph
from nereus.reshard.plan import plan_transfers
from nereus.reshard.stream import StagingArena

from . import grpo, ppo
from .advantages import kl_k1, masked_mean, minibatch_indices
from .config import JobConfig, resolve_device
from .generate import generate
from .model import ModelArgs
from .metrics import MetricsLog, peak_memory
from .parallel import init_stage, init_tensor, load_full
from .stages import (
    ModelStage, backward_minibatch, build_stages, gather_rows, infer, make_optimizer, response_logprobs, response_values,
)
from .tasks import Task, build_task

KEEP_CHECKPOINTS = 3


@dataclass(kw_only=True)
class WeightSync:
    """Parameters of one model-stage streamed into another's live parameters each step."""

    src: ModelStage
    dst: ModelStage

    def __post_init__(self) -> None:
        src = [e.params_only() for e in self.src.emus]
        dst = [e.params_only() for e in self.dst.emus]
        self.plan = plan_transfers(src, dst, cast=True)  # float32 masters -> the rollout dtype, cast on the way
        self.graph = plan_graph(arrays_from_plan(self.plan))
        # Host staging is kept across steps (its pages stay touched); CUDA's caching
        # allocator already reuses blocks, and a kept buffer would sit through training.
        self.staging = StagingArena("cpu")

    def __call__(self) -> None:
        """Stream the weights. A reshard past its deadline leaves the process group unusable
        (ops may be pending: ``reshard.errors.TransitionTimeout``); that is raised as a
        RuntimeError telling the job to restart its workers on a fresh group, never retried
        on the broken one."""
        from nereus.reshard.errors import TransitionTimeout

        rank, src, dst = dist.get_rank(), self.src.param_buffers(), self.dst.param_buffers()
        on_host = all(t.device.type == "cpu" for t in (*src.values(), *dst.values()))
        try:
            execute(self.plan, self.graph, src, rank=rank, dst_buffers=dst, staging=self.staging if on_host else None)
        except TransitionTimeout as e:
            raise RuntimeError(
                f"weight sync {self.src.key} -> {self.dst.key} timed out: {e}. The process group cannot be reused: "
                "restart the workers (torchrun restarts them; nereus train --resume continues from the last checkpoint)"
            ) from e


class Trainer:
    """The model-stages of one job on this rank, and the step function; ``device`` (default:
    ``worker_device(cfg)``) is where every model-stage lives."""

    def __init__(self, cfg: JobConfig, device: torch.device | str | None = None) -> None:
        self.cfg, self.rank = cfg, dist.get_rank()
        self.device = worker_device(cfg) if device is None else torch.device(device)
        self.task: Task = build_task(cfg.task)
        self.stages = build_stages(cfg, self.rank, self.device)
        hp = cfg.ppo if cfg.algorithm == "ppo" else cfg.grpo
        for key, stage in self.stages.items():
            if stage.part is not None:  # a vLLM actor.gen has no module: the first sync fills it
                source, model, head = cfg.stage_model(key)
                seed = cfg.seed + (1 if key.startswith("critic") else 0)
                if not model.path:
                    init_stage(stage.part, seed=seed, std=model.init_std)
                elif head == "value" and source == "model":  # a critic on the actor's LM checkpoint
                    load_hf(stage, model.path, fresh_head=(seed, model.init_std))
                else:  # the actor's and reference's LM, or a critic:/reward_model: value checkpoint
                    load_hf(stage, model.path)
            if key.endswith(".train"):
                make_optimizer(stage, cfg.ppo.critic_lr if key == "critic.train" else hp.lr)
        self.syncs = [WeightSync(src=self.stages["actor.train"], dst=self.stages["actor.gen"])]
        if "critic.infer" in self.stages:
            self.syncs.append(WeightSync(src=self.stages["critic.train"], dst=self.stages["critic.infer"]))
        one_update = hp.epochs == 1 and hp.minibatch_size >= cfg.batch_size
        self.on_policy = one_update and (cfg.algorithm == "grpo" or not cfg.ppo.kl_in_reward)
        self.step = 0

    # ------------------------------------------------------------------ one step

    def run_step(self) -> dict:
        cfg, seconds = self.cfg, {}
        start = time.perf_counter()
        for sync in self.syncs:
            sync()
        _synchronize(self.device)  # the sync's copies and sends are asynchronous on CUDA
        seconds["sync"] = time.perf_counter() - start

        t = time.perf_counter()
        batch, scores = self._rollout()
        seconds["generation"] = time.perf_counter() - t

        t = time.perf_counter()
        temp = cfg.rollout.temperature
        reward_model, task_scores = "reward.infer" in self.stages, scores
        if reward_model:
            scores = infer(self.stages["reward.infer"], batch, "scores")
        if not self.on_policy:
            batch["old_logprobs"] = infer(self.stages["actor.train"], batch, "logprobs", temp)
        if "ref.infer" in self.stages:
            batch["ref_logprobs"] = infer(self.stages["ref.infer"], batch, "logprobs", temp)
        if cfg.algorithm == "ppo":
            batch["old_values"] = infer(self.stages.get("critic.infer", self.stages["critic.train"]), batch, "values")
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
        return {
            "step": self.step,
            "reward_mean": float(scores.mean()),
            **({"task_reward_mean": float(task_scores.mean())} if reward_model else {}),
            "kl": float(kl),
            "response_length": float(mask.sum(1).float().mean()),
            **train_metrics,
            **advantage_metrics,
            "stage_seconds": seconds,
            "step_seconds": total,
            "tokens_per_s": float(mask.sum()) / total,
            **peak_memory(self.device),
        }

    def _rollout(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        cfg, gen = self.cfg, self.stages["actor.gen"]
        g = torch.Generator().manual_seed(_seed(cfg.seed, self.step, 0))
        prompts = self.task.sample_prompts(cfg.rollout.prompts_per_step, g)
        prompts = [p for p in prompts for _ in range(cfg.rollout.samples_per_prompt)]
        b, local = len(prompts), None
        if gen.member:
            lo, hi = gen.rows(b)
            seed = _seed(cfg.seed, self.step, 1 + gen.coords()[0])
            sampling = dict(
                max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                stop_tokens=() if cfg.rollout.ignore_eos else (self.task.eos_id,), pad_id=self.task.pad_id,
            )
            if gen.engine is not None:
                out = gen.engine.generate(prompts[lo:hi], seed=seed, **sampling)
            else:
                rng = torch.Generator(gen.part.device).manual_seed(seed)  # where sample() draws: the model's device
                with torch.no_grad():
                    out = generate(gen.part.module, prompts[lo:hi], generator=rng, **sampling)
            local = _padded(out, cfg.rollout.max_new_tokens, self.task.pad_id)
        rows = gather_rows(gen, local, b)
        p = rows["tokens"].shape[1] - cfg.rollout.max_new_tokens
        responses = [r[m].tolist() for r, m in zip(rows["tokens"][:, p:], rows["response_mask"])]
        scores = torch.tensor([self.task.reward(q, r) for q, r in zip(prompts, responses)], dtype=torch.float32)
        batch = {
            "input_ids": rows["tokens"],
            "attention_mask": rows["attention_mask"],
            "response_mask": rows["response_mask"].float(),
            "rollout_logprobs": rows["logprobs"],
            "prompt_width": torch.full((b,), p, dtype=torch.int64),
        }
        return batch, scores

    def _advantages(self, batch: dict, scores: torch.Tensor) -> dict[str, float]:
        cfg, mask = self.cfg, batch["response_mask"]
        if cfg.algorithm == "ppo":
            hp = cfg.ppo
            adv, returns, metrics = ppo.compute_advantages(
                scores, batch["old_values"], mask, old_logprobs=batch.get("old_logprobs"),
                ref_logprobs=batch.get("ref_logprobs"), kl_coef=hp.kl_coef, kl_in_reward=hp.kl_in_reward,
                gamma=hp.gamma, lam=hp.lam, whiten=hp.whiten,
            )
            batch["advantages"], batch["returns"] = adv, returns
            return metrics
        hp = cfg.grpo
        adv, metrics = grpo.group_advantages(scores, cfg.rollout.samples_per_prompt, scale_by_std=hp.scale_by_std, eps=hp.eps)
        batch["advantages"] = adv[:, None].expand_as(mask).contiguous()
        return metrics

    def _train(self, batch: dict) -> dict[str, float]:
        """PPO epochs over mini-batches: per mini-batch every model's forward and backward
        (its loss normalised by the global mini-batch, ``ppo.loss_weights``), one check that
        everything is finite on every rank, then the optimizer steps."""
        cfg = self.cfg
        hp = cfg.ppo if cfg.algorithm == "ppo" else cfg.grpo
        temp = cfg.rollout.temperature
        g = torch.Generator().manual_seed(_seed(cfg.seed, self.step, 99))
        actor_kl = hp.kl_coef if (cfg.algorithm == "grpo" or not cfg.ppo.kl_in_reward) else 0.0
        actor = self.stages["actor.train"]

        def actor_loss(logits, mb):
            logprobs, entropy = response_logprobs(logits, mb, temp, actor.part.vocab, entropy=bool(hp.entropy_coef))
            old = mb["old_logprobs"] if "old_logprobs" in mb else logprobs.detach()  # on-policy: see step 3
            return ppo.policy_loss(
                logprobs, old, mb["advantages"], mb["response_mask"], clip=hp.clip, weights=mb["loss_weights"],
                ref_logprobs=mb.get("ref_logprobs"), kl_coef=actor_kl, entropy=entropy, entropy_coef=hp.entropy_coef,
            )

        def critic_loss(values, mb):
            return ppo.value_loss(
                response_values(values, mb), mb["old_values"], mb["returns"], mb["response_mask"],
                clip=cfg.ppo.value_clip, weights=mb["loss_weights"],
            )

        models = [("actor", actor, actor_loss, hp.max_grad_norm)]
        if cfg.algorithm == "ppo":
            models.append(("critic", self.stages["critic.train"], critic_loss, cfg.ppo.max_grad_norm))
        sums: dict[str, ppo.LossSums] = {}
        norms: dict[str, list[float]] = {name: [] for name, *_ in models}
        b = batch["input_ids"].shape[0]
        minibatches = list(minibatch_indices(b, hp.minibatch_size, epochs=hp.epochs, generator=g))
        for k, idx in enumerate(minibatches):
            mb = {key: v[idx] for key, v in batch.items()}
            mb["loss_weights"] = ppo.loss_weights(mb["response_mask"], hp.loss_agg, max_length=cfg.rollout.max_new_tokens)
            done = {name: backward_minibatch(stage, mb, fn, clip) for name, stage, fn, clip in models}
            self._check_finite(done, k, len(minibatches))
            for name, stage, *_ in models:
                if done[name] is None:
                    continue
                stage.optimizer.step()
                norms[name].append(float(done[name].grad_norm))
                if done[name].sums is not None:
                    sums[name] = done[name].sums if name not in sums else sums[name] + done[name].sums
        return _finish_metrics(sums, norms, len(minibatches))

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

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_root(self) -> str:
        return os.path.join(self.cfg.run_dir, "checkpoints")

    def _trained(self) -> list[ModelStage]:
        return [s for k, s in self.stages.items() if k.endswith(".train")]

    def save(self) -> None:
        """Commit the training stages' weights and AdamW state (every rank calls it)."""
        from nereus.store.checkpoint import save_checkpoint

        from nereus.store.convert import one_dtype
        from nereus.store.hf import HFCheckpoint, side_files

        emus = [e for s in self._trained() for e in s.emus]
        buffers = {s.key.split(".")[0]: s.buffers() for s in self._trained()}
        # each model's HF config (as trained: its head, its shapes; the rest of its source's
        # config.json) and, on the coordinator, its source's side files: `nereus convert
        # RUN_DIR/checkpoints OUT --to hf --model actor` exports what this saves
        configs, files = {}, {}
        for s in self._trained():
            model, source = s.key.split(".")[0], self.cfg.stage_model(s.key)[1]
            original = HFCheckpoint.open(source.path).config if source.path else {}
            dtype = next(t.dtype for e in s.emus for t in e.tensors if not t.name.startswith("optim/"))
            configs[model] = one_dtype({**original, **s.args.to_hf_config()}, dtype)  # the masters' dtype
            if source.path and self.rank == 0:
                files.update({f"hf/{model}/{name}": data for name, data in side_files(source.path).items()})
        state = {"step": self.step, "hf_configs": configs}
        save_checkpoint(self.checkpoint_root(), self.step, emus, buffers, rank=self.rank, state=state, files=files,
                        keep=KEEP_CHECKPOINTS)

    def restore(self) -> int:
        """Load the latest committed checkpoint into this rank's layouts; returns its step."""
        from nereus.store.checkpoint import CheckpointStore, load_checkpoint

        if not CheckpointStore(self.checkpoint_root()).steps():
            raise FileNotFoundError(f"--resume: no committed checkpoint under {self.checkpoint_root()}")
        emus = [e for s in self._trained() for e in s.emus]
        buffers = {s.key.split(".")[0]: s.buffers() for s in self._trained()}
        manifest, _ = load_checkpoint(self.checkpoint_root(), emus, self.rank, buffers)
        self.step = manifest.step
        if self.rank == 0:  # this job owns the root and is not saving: unfinished saves of its last run go
            CheckpointStore(self.checkpoint_root()).clean_orphans(older_than=0)
        return self.step


def load_hf(stage: ModelStage, path: str, *, fresh_head: tuple[int, float] | None = None) -> None:
    """This rank's boxes of a HuggingFace checkpoint, read through memory maps: only the
    pages of the boxes are touched, and ``copy_`` casts them to the stage's dtype.

    ``fresh_head=(seed, std)``: ``path`` is the causal LM a value model is built on (a critic
    that shares the actor's ``model``, started as verl and OpenRLHF start one): the backbone
    comes from the checkpoint, its ``lm_head`` is not read, and ``score.weight`` is drawn as
    ``init_stage`` draws it."""
    from nereus.store.hf import HFCheckpoint, check_against_spec

    ckpt = HFCheckpoint.open(path)
    spec = stage.args.spec
    check_against_spec(ckpt, replace(spec, head="lm") if fresh_head else spec)
    check_forward_settings(stage.args, ckpt.config, path)
    if fresh_head is None:
        load_full(stage.part, ckpt.mapped)
        return
    seed, std = fresh_head
    shapes = {t.name: t.shape for t in stage.part.layouts()}
    load_full(stage.part, lambda name: init_tensor(name, shapes[name], seed, std) if name == "score.weight" else ckpt.mapped(name))


def check_forward_settings(args: ModelArgs, config: dict, path: str) -> None:
    """What the config's ``model`` says about the forward (RoPE base and scaling, RMSNorm eps)
    must be what the checkpoint was trained with: a mismatch computes silently wrong outputs."""
    hf = ModelArgs.from_hf_config(config)
    for key in ("rope_theta", "rope_scaling", "rms_norm_eps"):
        ours, theirs = getattr(args, key), getattr(hf, key)
        if ours != theirs:
            raise ValueError(f"model.{key} is {ours!r}, but {path}/config.json has {theirs!r}: set it to match")


def _padded(out, width: int, pad_id: int) -> dict[str, torch.Tensor]:
    """A rollout padded to ``width`` response columns, so all replicas stack."""
    extra = width - out.logprobs.shape[1]
    pad = lambda t, v: torch.nn.functional.pad(t, (0, extra), value=v)  # noqa: E731
    return {
        "tokens": pad(out.tokens, pad_id),
        "attention_mask": pad(out.attention_mask, False),
        "response_mask": pad(out.response_mask, False)[:, -width:],
        "logprobs": pad(out.logprobs, 0.0),
    }


def _seed(*parts: int) -> int:
    h = 0
    for p in parts:
        h = (h * 1_000_003 + p + 1) % (1 << 62)
    return h


def _finish_metrics(sums: dict[str, ppo.LossSums], norms: dict[str, list[float]], minibatches: int) -> dict[str, float]:
    """``model/metric`` over the whole step: every replica's LossSums added in rank order
    (the same sums under every layout, up to the order of their float additions), loss
    terms averaged over the mini-batches, token statistics over every token; ``grad_norm``
    the mean over mini-batches."""
    mine = {name: {k: float(v) for k, v in s.tensors().items()} for name, s in sums.items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, {name: n for name, n in norms.items() if n}))
    out: dict[str, float] = {}
    for name in norms:
        parts = [m[name] for m, _ in gathered if name in m]
        total = {k: sum(p[k] for p in parts) for k in parts[0]} if parts else {}
        n = max(total.get("tokens", 0.0), 1.0)
        for key, value in total.items():
            kind, _, metric = key.partition("/")
            if kind == "loss":
                out[f"{name}/{metric}"] = value / minibatches
            elif kind == "token":
                out[f"{name}/{metric}"] = value / n
        grad_norms = next((g[name] for _, g in gathered if name in g), [])
        if grad_norms:
            out[f"{name}/grad_norm"] = sum(grad_norms) / len(grad_norms)
    return out


def worker_device(cfg: JobConfig) -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` when the config resolves to cuda, else CPU."""
    if resolve_device(cfg) == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def join_process_group(device: torch.device) -> None:
    """From the environment: gloo on CPU; on CUDA, this process's GPU made current and one
    group with gloo for CPU tensors and NCCL for CUDA tensors (``device_id`` forms the NCCL
    communicator now, on every rank, so that a first point-to-point batch between some ranks
    does not have to)."""
    timeout = timedelta(seconds=300)
    if device.type == "cpu":
        dist.init_process_group("gloo", timeout=timeout)
        return
    torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout, device_id=device)


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (stage timings are wall time); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_worker(cfg: JobConfig, resume: bool = False) -> dict:
    """One rank of ``nereus train`` (the process group is initialised from the environment).

    Returns the last step's metrics, or ``{"error": message}`` on every rank when the job
    stopped on a non-finite loss (the last committed checkpoint is left as it was).
    """
    device = worker_device(cfg)
    join_process_group(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.nproc))
    torch.manual_seed(cfg.seed)
    try:
        trainer = Trainer(cfg, device)
        try:
            first = trainer.restore() if resume else 0
        except FileNotFoundError as e:  # every rank sees the same store
            return {"error": str(e)}
        log = MetricsLog(cfg.run_dir, total=cfg.steps, first_step=first) if trainer.rank == 0 else None
        last: dict = {}
        try:
            while trainer.step < cfg.steps:
                metrics = trainer.run_step()
                for key in ("peak_memory_bytes", "peak_device_memory_bytes"):
                    if key in metrics:  # the same keys on every rank: one device type per job
                        metrics[key] = _gather_peaks(metrics[key])
                if log:
                    log.write(metrics)
                last = metrics
                every = cfg.checkpoint_every
                if (every and trainer.step % every == 0) or trainer.step == cfg.steps:
                    trainer.save()
        except FloatingPointError as e:
            return {"error": f"{e}; stopped, the last committed checkpoint is unchanged"}
        finally:
            if log:
                log.close()
        return last
    finally:
        dist.destroy_process_group()


def _gather_peaks(mine: int) -> list[int]:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out
