"""Toy tasks: deterministic prompts, rewards in [0, 1], optimum 1, chance level as computed."""

from __future__ import annotations

import random

import pytest
import torch

from nereus.trainer.config import TaskConfig
from nereus.trainer.data.tasks import BOS_ID, EOS_ID, VOCAB, build_task, chance_reward, make_task

TASKS = [make_task("repeat"), make_task("count"), make_task("repeat", digits=5, response_len=3), make_task("count", digits=1, response_len=9)]


def test_vocabulary() -> None:
    assert len(VOCAB) == 16 and len(set(VOCAB)) == 16
    task = make_task("repeat")
    assert (task.pad_id, task.bos_id, task.eos_id) == (0, 1, 2)
    assert task.decode(task.encode("<bos>572=555<eos>")) == "<bos>572=555<eos>"
    with pytest.raises(ValueError, match="not in the task vocabulary"):
        task.encode("12a")


@pytest.mark.parametrize("task", TASKS, ids=lambda t: f"{t.name}-{t.digits}-{t.response_len}")
def test_prompts_are_deterministic_and_well_formed(task) -> None:
    a = task.sample_prompts(64, torch.Generator().manual_seed(5))
    b = task.sample_prompts(64, torch.Generator().manual_seed(5))
    c = task.sample_prompts(64, torch.Generator().manual_seed(6))
    assert a == b and a != c
    assert all(len(p) == task.prompt_len and p[0] == BOS_ID for p in a)
    assert all(len(task.target(p)) <= task.max_answer_len and task.target(p)[-1] == EOS_ID for p in a)


def test_targets_by_hand() -> None:
    repeat, count = make_task("repeat"), make_task("count")
    assert repeat.decode(repeat.target(repeat.encode("<bos>572="))) == "555555<eos>"
    assert count.decode(count.target(count.encode("<bos>789"))) == "012345<eos>"
    p = repeat.encode("<bos>572=")
    assert repeat.reward(p, repeat.encode("555555<eos>")) == 1.0
    assert repeat.reward(p, repeat.encode("555555")) == pytest.approx(6 / 7)  # no <eos>
    assert repeat.reward(p, repeat.encode("5<eos>5555<eos>")) == pytest.approx(1 / 7)  # cut at the first <eos>
    assert repeat.reward(p, repeat.encode("575555<eos>")) == pytest.approx(6 / 7)
    assert repeat.reward(p, repeat.encode("5555555555")) == pytest.approx(6 / 7)  # too long
    assert repeat.reward(p, []) == 0.0


@pytest.mark.parametrize("task", TASKS, ids=lambda t: f"{t.name}-{t.digits}-{t.response_len}")
def test_rewards_in_unit_interval_and_optimum_is_one(task) -> None:
    rng = random.Random(0)
    for prompt in task.sample_prompts(200, torch.Generator().manual_seed(0)):
        assert task.reward(prompt, task.target(prompt)) == 1.0
        for _ in range(5):
            response = [rng.randrange(len(VOCAB)) for _ in range(rng.randrange(0, 12))]
            assert 0.0 <= task.reward(prompt, response) <= 1.0


@pytest.mark.parametrize("task", TASKS, ids=lambda t: f"{t.name}-{t.digits}-{t.response_len}")
def test_uniform_policy_scores_chance(task) -> None:
    """Monte Carlo of the uniform random policy agrees with the analytic chance level."""
    max_new = task.max_answer_len + 1
    chance = chance_reward(task, max_new)
    g = torch.Generator().manual_seed(1)
    prompts = task.sample_prompts(20000, g)
    tokens = torch.randint(0, len(VOCAB), (len(prompts), max_new), generator=g).tolist()
    mc = sum(task.reward(p, r) for p, r in zip(prompts, tokens)) / len(prompts)
    assert mc == pytest.approx(chance, abs=0.004)  # several standard errors (≈ 0.0007 each)
    assert 0.02 < chance < 0.08


def test_chance_level_is_low_and_short_rollouts_lower_it() -> None:
    task = make_task("repeat")
    assert chance_reward(task, 7) == pytest.approx(chance_reward(task, 100))  # nothing after <eos> counts
    assert chance_reward(task, 3) < chance_reward(task, 7) < 1 / 16


def test_build_from_config_and_errors() -> None:
    task = build_task(TaskConfig(name="count", digits=2, response_len=4))
    assert (task.name, task.prompt_len, task.max_answer_len) == ("count", 3, 5)
    with pytest.raises(ValueError, match="unknown task 'sort'"):
        make_task("sort")
    with pytest.raises(ValueError, match="response_len=0"):
        make_task("repeat", response_len=0)
