"""Where a step's prompts and rewards come from: a built-in toy task, or a prompt dataset.

``make_source(cfg)`` gives the job's source; the step loop asks it for the step's prompts
(``prompts(step)``), has them generated, and asks it to score the responses
(``rewards(prompts, responses)``, collective: every rank calls it with the same rows).

- ``TaskSource``: the toy tasks of ``trainer/data/tasks.py`` (``task:``), their own 16-token
  vocabulary, prompts drawn from a per-step seeded generator, the task's rule reward
  (computed on every rank: it is a few comparisons per row).
- ``DatasetSource``: ``data.train_files`` read as verl reads them (``trainer/data/datasets.py``),
  rendered and tokenized by the model's own tokenizer (``trainer/data/tokenizer.py``), drawn in
  a seeded order that is a function of one position (prompts consumed so far, saved in
  every checkpoint, independent of the number of ranks and replicas), and scored by a rule
  reward (``trainer/data/rewards.py``: a built-in or the user's ``compute_score``) on the
  responses decoded to text. Scoring is split over the ranks (rank r scores rows
  r, r + W, …, in its own process pool) and gathered, so that a slow reward function
  costs 1/W of the rows on each rank; a failure on any rank is raised on every rank,
  naming the sample.

``check_inputs(cfg)`` opens everything a dataset job reads (data files, tokenizer, reward
function) and checks the tokenizer against the models' embeddings (``check_vocab_sizes``: as many
rows as tokens for a model trained from scratch, no padding): ``nereus train`` calls it
before starting any worker, so bad input is a one-line error, not a failure on N ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..config import MODEL_SECTIONS, ConfigError, JobConfig
from ..seeds import mix
from .tasks import Task, build_task


@dataclass(frozen=True, kw_only=True, slots=True)
class Prompts:
    """One step's (or one validation chunk's) prompts: token ids, each with its dataset row
    (None for a toy task), and the most tokens a response may take."""

    ids: list[list[int]]
    rows: list[Any] | None
    max_new_tokens: int

    def repeated(self, n: int) -> Prompts:
        """Each prompt ``n`` times in a row (samples of one prompt are contiguous: GRPO's groups)."""
        rows = None if self.rows is None else [r for r in self.rows for _ in range(n)]
        return Prompts(ids=[p for p in self.ids for _ in range(n)], rows=rows, max_new_tokens=self.max_new_tokens)


@dataclass(kw_only=True)
class Scores:
    """Rewards of a batch of responses: one per row, and metrics of the scoring."""

    scores: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    accuracy: torch.Tensor | None = None
    """Per row: 1 for a right answer (the function's own ``acc`` where it returns one, else a score >= 1)."""


class TaskSource:
    """A built-in toy task (``cfg.task``)."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.task: Task = build_task(cfg.task)
        self.pad_id = self.task.pad_id
        self.stop_ids: tuple[int, ...] = (self.task.eos_id,)
        self.vocab_size = self.task.vocab_size
        self.rule = True  # the task's reward is always computed (logged as task_reward_mean beside a reward model's)

    def _task(self, step: int) -> Task:
        return build_task(self.cfg.task, step) if self.cfg.task.grow_to is not None else self.task

    def prompts(self, step: int) -> Prompts:
        cfg, task = self.cfg, self._task(step)
        g = torch.Generator().manual_seed(mix(cfg.seed, step, 0))
        # under a length curriculum the rollout is capped at the step's answer length too
        cap = cfg.rollout.max_new_tokens if cfg.task.grow_to is None else min(cfg.rollout.max_new_tokens, task.max_answer_len)
        return Prompts(ids=task.sample_prompts(cfg.rollout.prompts_per_step, g), rows=None, max_new_tokens=cap)

    def rewards(self, step: int, prompts: Prompts, responses: list[list[int]]) -> Scores:
        task = self._task(step)
        scores = torch.tensor([task.reward(q, r) for q, r in zip(prompts.ids, responses)], dtype=torch.float32)
        return Scores(scores=scores, accuracy=(scores >= 1).float())

    def state_dict(self) -> dict:
        return {}

    def metrics(self) -> dict[str, float]:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def validation_prompts(self) -> list[Prompts]:
        return []

    def close(self) -> None:
        pass


class DatasetSource:
    """A prompt dataset (``cfg.data``) with the model's tokenizer and a rule reward."""

    def __init__(self, cfg: JobConfig, *, scorer: bool = True) -> None:
        from .datasets import PromptSampler
        from .rewards import RewardScorer

        self.cfg = cfg
        self.tokenizer = job_tokenizer(cfg)
        self.pad_id = self.tokenizer.pad_id
        self.stop_ids = tuple(self.tokenizer.eos_ids)
        self.vocab_size = self.tokenizer.vocab_size
        self.train = _dataset(cfg, cfg.data.train_files, "data.train_files", self.tokenizer)
        self.val = _dataset(cfg, cfg.data.val_files, "data.val_files", self.tokenizer) if cfg.data.val_files else None
        self.sampler = PromptSampler(len(self.train), seed=cfg.seed, shuffle=cfg.data.shuffle)
        self.position = 0  # prompts consumed: the sampler's whole state
        self.rule = cfg.reward_model is None or cfg.reward.function is not None
        self.scorer = RewardScorer(cfg.reward) if scorer and self.rule else None

    def prompts(self, step: int) -> Prompts:
        k = self.cfg.rollout.prompts_per_step
        picked = self.sampler.indices(self.position, k)
        self.position += k
        return Prompts(ids=[self.train.prompt_ids[i] for i in picked], rows=[self.train.rows[i] for i in picked],
                       max_new_tokens=self.cfg.rollout.max_new_tokens)

    def rewards(self, step: int, prompts: Prompts, responses: list[list[int]]) -> Scores:
        """The rule reward of every row, computed split over the ranks (collective)."""
        from .rewards import RewardError, RewardItem

        b = len(responses)
        if self.scorer is None:  # a reward model scores this job; no rule reward to log
            return Scores(scores=torch.zeros(b), metrics={})
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        mine = list(range(rank, b, world))
        items = [
            RewardItem(index=i, data_source=prompts.rows[i].data_source, solution_str=self.tokenizer.decode(responses[i]),
                       ground_truth=prompts.rows[i].ground_truth, extra_info=dict(prompts.rows[i].extra_info))
            for i in mine
        ]
        try:
            result, error = self.scorer.score(items), None
        except Exception as e:  # noqa: BLE001 - agreed on below: every rank raises, none waits in a collective
            result, error = None, str(e) if isinstance(e, RewardError) else f"rank {rank}: {type(e).__name__}: {e}"
        part = (mine, None, None, 0, error) if result is None else (mine, result.scores, result.metrics, result.errors, None)
        parts = [part]
        if world > 1:
            parts = [None] * world
            dist.all_gather_object(parts, part)
        errors = [p[4] for p in parts if p[4]]
        if errors:
            more = f" (and {len(errors) - 1} more rank{'s' * (len(errors) > 2)} failed)" if len(errors) > 1 else ""
            raise RewardError(errors[0] + more)
        scores = torch.zeros(b)
        extra: dict[str, torch.Tensor] = {}
        failed = 0
        for rows, values, metrics, count, _ in parts:
            scores[rows] = torch.tensor(values, dtype=torch.float32)
            failed += count
            for key, column in metrics.items():
                extra.setdefault(key, torch.full((b,), math.nan))[rows] = torch.tensor(column, dtype=torch.float32)
        out = {"reward/errors": float(failed)}  # calls that failed and scored 0 (reward.on_error: zero)
        for key, column in extra.items():  # the function's own keys, apart from ours
            seen = column[~column.isnan()]
            if seen.numel():
                out[f"reward/fn/{key}"] = float(seen.mean())
        accuracy = extra.get("acc")
        accuracy = (scores >= 1).float() if accuracy is None else torch.where(accuracy.isnan(), (scores >= 1).float(), accuracy)
        return Scores(scores=scores, metrics=out, accuracy=accuracy)

    def state_dict(self) -> dict:
        """The position, and what the order it indexes depends on (checked on restore)."""
        return {"position": self.position, "rows": len(self.train), "seed": self.cfg.seed, "shuffle": self.cfg.data.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved position; a dataset, seed or shuffle that changed since the
        checkpoint would map the position to other prompts, so it is refused."""
        saved = {k: state[k] for k in ("rows", "seed", "shuffle") if k in state}
        now = {k: v for k, v in self.state_dict().items() if k in saved}
        if saved != now:
            raise ConfigError(
                f"--resume: the prompt order changed since the checkpoint ({saved} then, {now} now: data files, "
                "filtering, max_prompt_length, seed or data.shuffle): the saved position would draw other prompts; "
                "restore them, or start a fresh run"
            )
        self.position = int(state.get("position", 0))

    def metrics(self) -> dict[str, float]:
        return {"data/epoch": float(self.sampler.epoch_of(self.position)), "data/position": float(self.position),
                "data/filtered": float(self.train.filtered)}

    def validation_prompts(self) -> list[Prompts]:
        """The validation set (``validation.max_prompts`` of it) in chunks of one rollout batch."""
        if self.val is None:
            return []
        v, n = self.cfg.validation, len(self.val)
        picked = list(range(n))
        if v.max_prompts is not None and v.max_prompts < n:  # a seeded sample over every file, in file order
            g = torch.Generator().manual_seed(self.cfg.seed)
            picked = sorted(torch.randperm(n, generator=g)[: v.max_prompts].tolist())
        chunk = self.cfg.batch_size
        cap = v.max_new_tokens or self.cfg.rollout.max_new_tokens
        return [Prompts(ids=[self.val.prompt_ids[i] for i in part], rows=[self.val.rows[i] for i in part], max_new_tokens=cap)
                for part in (picked[lo:lo + chunk] for lo in range(0, len(picked), chunk))]

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()


def make_source(cfg: JobConfig) -> TaskSource | DatasetSource:
    return DatasetSource(cfg) if cfg.data is not None else TaskSource(cfg)


def job_tokenizer(cfg: JobConfig):
    """The dataset job's tokenizer: ``tokenizer.path``, else the actor's ``model.path``."""
    from .tokenizer import load_tokenizer

    path = cfg.tokenizer.path or cfg.model.path
    if path is None:
        raise ConfigError("a dataset job (data.train_files) needs a tokenizer: set model.path (an HF directory) or tokenizer.path")
    return load_tokenizer(path)


def _dataset(cfg: JobConfig, files, key: str, tokenizer):
    from .datasets import load_prompt_dataset

    if not files:
        raise ConfigError(f"config key '{key}' is empty: a dataset job needs at least one file")
    return load_prompt_dataset(files, cfg.data, tokenizer)


def check_vocab_sizes(cfg: JobConfig, tokens: int) -> None:
    """Each model's embedding against the tokenizer's ``tokens`` ids (a dataset job):

    - fewer rows than tokens: they are not the same model's;
    - more rows, in a model trained from scratch (its ``vocab_size`` given in the config, not
      read from a checkpoint's ``config.json``): padding, which no layout needs — a TP shard
      of the vocabulary is ceil(V/tp) rows of the real V (``docs/vocab.md``), and padded rows
      would be sampled from. A checkpoint's own ``vocab_size`` above its tokenizer's (Qwen2.5's
      152,064 rows for 151,665 tokens) is its real V: those rows exist in its weights; a model
      from scratch beside such an actor (a critic reading its ids) may take the actor's V.
    """
    def from_checkpoint(m) -> bool:  # m: a ModelConfig; its path may be on another machine
        return bool(m.path)

    tokenizer = cfg.tokenizer.path or cfg.model.path
    actor = cfg.model.vocab_size if from_checkpoint(cfg.model) else None
    for key in MODEL_SECTIONS:
        m = getattr(cfg, key)
        if m is None or m.vocab_size is None:
            continue
        if tokens > m.vocab_size:
            raise ConfigError(
                f"the tokenizer ({tokenizer}) has {tokens} tokens, more than the "
                f"{m.vocab_size} rows of '{key}''s embedding (vocab_size): they are not the same model's"
            )
        if m.vocab_size > tokens and not from_checkpoint(m) and m.vocab_size != actor:
            raise ConfigError(
                f"config key '{key}.vocab_size'={m.vocab_size} is larger than the {tokens} tokens of the tokenizer "
                f"({tokenizer}): a model trained from scratch needs no padded rows (any tp shards the real vocabulary); "
                f"set it to {tokens} or leave it out"
            )


def check_inputs(cfg: JobConfig) -> None:
    """Open what a dataset job reads, before any worker starts (module docstring); raises
    ConfigError (or the data/tokenizer/reward modules' own one-line errors)."""
    if cfg.data is None:
        return
    from .rewards import check_rewards

    source = DatasetSource(cfg, scorer=False)
    check_vocab_sizes(cfg, source.vocab_size)
    if source.rule:
        rows = [*source.train.rows, *(source.val.rows if source.val is not None else ())]
        check_rewards(cfg.reward, sorted({r.data_source for r in rows}))
