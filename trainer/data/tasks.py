"""Toy verifiable tasks that a tiny randomly initialised model learns by RL in minutes on CPU.

Vocabulary (16 tokens, defined here, so TP degrees 1, 2, 4, 8, 16 split it):
``<pad> <bos> <eos> 0 1 … 9 = + :`` — ids 0, 1, 2, digit d at 3 + d, then the symbols.

Every prompt of a task has the same length (no left padding). A task has one correct
answer per prompt, ``target(prompt)`` = digits then ``<eos>``, and scores a response with
per-position partial credit:

    reward(prompt, y) = (1/n) Σ_{i<n} [y_i = target_i],     n = len(target)

where y is cut after its first ``<eos>`` (later tokens are never seen). So reward ∈ [0, 1],
1 exactly for the target, and every right token earns 1/n: a dense signal.

Tasks (``configs/tiny_*.yaml`` run ``repeat`` with ``response_len: 3``; results below are
``nereus train`` on 4 CPU processes with this project's decoder unless stated):

- ``repeat`` (default): ``<bos>`` + ``digits`` random digits + ``=``; the answer is the
  *first* prompt digit repeated ``response_len`` times, then ``<eos>``:
  ``<bos>572=`` → ``555555<eos>``. Every position wants the same token, so a response's
  reward (how many positions hold it) pushes every token the same way; a model can
  attend back to position 1 for the first token, copy the previous token afterwards and
  count to the ``<eos>``. With ``response_len=3`` (``555<eos>``, chance ≈ 0.057), 64
  prompts × 4 samples, init std 0.05, lr 2e-3: GRPO's last-10-step mean reward reached
  0.93 / 0.96 and PPO's 0.88 / 0.89 (seeds 0 / 1) within 40 steps. On one process:
  with ``response_len=6`` the digits are learned as fast but the ``<eos>`` lags (the
  decoder has RoPE, no absolute positions, so it must learn to count): 6/7 ≈ 0.85 for
  tens of steps; with the model's default init std 0.02 and 8 × 4 samples per step,
  GRPO was still near 0.2 after 100 steps, sampling runs of prompt-independent digits.
  (TRL's GRPO on "repeat the last prompt digit", from random init, reached only ~0.1 on a
  2-core CPU, by learning to emit digits only.)
- ``count`` (harder): ``<bos>`` + an ascending run of ``digits`` digits mod 10 starting at
  a uniform s; the answer continues the run for ``response_len`` digits (mod 10), then
  ``<eos>``: ``<bos>789`` → ``012345<eos>``. The optimal policy is a bigram
  (d → d + 1 mod 10), but every position wants a different token, so credit is
  diluted: a throwaway 2-layer transformer (learned positions, 8 prompts × 4 samples,
  lr 1e-3) plateaued at ≈0.6 after 300 steps (policies collapse onto memorised answers
  for the 10 possible prompts). Use it to stress an algorithm.

Chance level. A uniform random policy draws every token i.i.d. from the V = 16 tokens and
stops at its first ``<eos>`` or after M = max_new_tokens. It gets position i right iff no
``<eos>`` came before and token i is right: probability q^i / V with q = (V − 1)/V, so

    E[reward | prompt] = (1/n) Σ_{i < min(n, M)} q^i / V

(≈ 0.052 for both tasks with response_len=6 and max_new_tokens ≥ 7; ≈ 0.057 with
response_len=3 and max_new_tokens ≥ 4).
``chance_reward`` averages this exact per-prompt value over a fixed seeded set of prompts.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..config import JobConfig, TaskConfig

VOCAB: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", *"0123456789", "=", "+", ":")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
DIGIT0 = 3
EQUALS_ID = VOCAB.index("=")
_TOKEN_RE = re.compile(r"<pad>|<bos>|<eos>|.", re.S)


class Task:
    """A prompt distribution and a verifiable reward over the shared 16-token vocabulary.

    Call order for a rollout: ``sample_prompts`` (same generator state → same prompts on
    every rank), generate, then ``reward(prompt, response)`` per sample (pure, any rank)."""

    name = "task"
    vocab: tuple[str, ...] = VOCAB
    pad_id: int = PAD_ID
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def prompt_len(self) -> int:
        """Tokens in every prompt (``<bos>`` included)."""
        raise NotImplementedError

    @property
    def max_answer_len(self) -> int:
        """Tokens in the longest target (``<eos>`` included): the least max_new_tokens for reward 1."""
        raise NotImplementedError

    def sample_prompts(self, n: int, generator: torch.Generator) -> list[list[int]]:
        raise NotImplementedError

    def target(self, prompt: list[int]) -> list[int]:
        """The one response that earns reward 1."""
        raise NotImplementedError

    def reward(self, prompt: list[int], response: list[int]) -> float:
        """Fraction of the target's positions the response gets right (response cut after ``<eos>``)."""
        target = self.target(prompt)
        response = list(response)
        if self.eos_id in response:
            response = response[: response.index(self.eos_id) + 1]
        hits = sum(1 for y, t in zip(response, target) if y == t)
        return hits / len(target)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids)

    def encode(self, text: str) -> list[int]:
        index = {tok: i for i, tok in enumerate(self.vocab)}
        tokens = _TOKEN_RE.findall(text)
        unknown = [t for t in tokens if t not in index]
        if unknown:
            raise ValueError(f"characters {unknown!r} are not in the task vocabulary {self.vocab}")
        return [index[t] for t in tokens]


def _digit(d: int) -> int:
    return DIGIT0 + d


class CountTask(Task):
    """``<bos>`` + ascending run of ``digits`` digits (mod 10) → the next ``response_len`` of
    the run (mod 10), then ``<eos>``."""

    name = "count"

    def __init__(self, *, digits: int = 3, response_len: int = 6) -> None:
        if digits < 1 or response_len < 1:
            raise ValueError(f"count task: digits={digits} and response_len={response_len} must be >= 1")
        self.digits, self.response_len = digits, response_len

    @property
    def prompt_len(self) -> int:
        return 1 + self.digits

    @property
    def max_answer_len(self) -> int:
        return self.response_len + 1

    def sample_prompts(self, n: int, generator: torch.Generator) -> list[list[int]]:
        starts = torch.randint(0, 10, (n,), generator=generator).tolist()
        return [[BOS_ID, *(_digit((s + k) % 10) for k in range(self.digits))] for s in starts]

    def target(self, prompt: list[int]) -> list[int]:
        last = prompt[-1] - DIGIT0
        return [*(_digit((last + k) % 10) for k in range(1, self.response_len + 1)), EOS_ID]


class RepeatTask(Task):
    """``<bos>`` + ``digits`` random digits + ``=`` → the first digit ``response_len`` times, ``<eos>``."""

    name = "repeat"

    def __init__(self, *, digits: int = 3, response_len: int = 6) -> None:
        if digits < 1 or response_len < 1:
            raise ValueError(f"repeat task: digits={digits} and response_len={response_len} must be >= 1")
        self.digits, self.response_len = digits, response_len

    @property
    def prompt_len(self) -> int:
        return 2 + self.digits

    @property
    def max_answer_len(self) -> int:
        return self.response_len + 1

    def sample_prompts(self, n: int, generator: torch.Generator) -> list[list[int]]:
        digits = torch.randint(0, 10, (n, self.digits), generator=generator).tolist()
        return [[BOS_ID, *(_digit(d) for d in row), EQUALS_ID] for row in digits]

    def target(self, prompt: list[int]) -> list[int]:
        return [prompt[1]] * self.response_len + [EOS_ID]


TASKS: dict[str, type[Task]] = {"repeat": RepeatTask, "count": CountTask}


def make_task(name: str, *, digits: int = 3, response_len: int = 6) -> Task:
    if name == "count":
        return CountTask(digits=digits, response_len=response_len)
    if name == "repeat":
        return RepeatTask(digits=digits, response_len=response_len)
    raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}")


def build_task(cfg: TaskConfig, step: int | None = None) -> Task:
    """The task a job config names; at ``step`` (0-based, None: its longest) under a length
    curriculum (``grow_to``), whose answers grow linearly from ``response_len`` digits at step 0
    to ``grow_to`` at step ``grow_steps`` and stay there (the trainer caps each step's rollout
    at that step's answer length, so the batch widens with the curriculum)."""
    length = cfg.response_len
    if cfg.grow_to is not None:
        done = 1.0 if step is None or cfg.grow_steps <= 0 else min(1.0, step / cfg.grow_steps)
        length = cfg.response_len + round((cfg.grow_to - cfg.response_len) * done)
    return make_task(cfg.name, digits=cfg.digits, response_len=length)


def longest_task(cfg: TaskConfig) -> Task:
    """The task at its longest (the end of a length curriculum)."""
    return make_task(cfg.name, digits=cfg.digits, response_len=max(cfg.response_len, cfg.grow_to or 0))


def longest_row(cfg: JobConfig) -> int:
    """The most tokens one rollout row can hold: the longest prompt plus ``rollout.max_new_tokens``."""
    prompt = cfg.data.max_prompt_length if cfg.data is not None else longest_task(cfg.task).prompt_len
    return prompt + cfg.rollout.max_new_tokens


def chance_reward(task: Task, max_new_tokens: int, *, prompts: int = 4096, seed: int = 0) -> float:
    """Expected reward of the uniform random policy (see the module docstring), exact per
    prompt and averaged over ``prompts`` prompts drawn with ``seed``."""
    v = task.vocab_size
    q = (v - 1) / v
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for prompt in task.sample_prompts(prompts, gen):
        n = len(task.target(prompt))
        total += sum(q**i / v for i in range(min(n, max_new_tokens))) / n
    return total / prompts
