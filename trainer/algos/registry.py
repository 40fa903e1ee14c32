"""The RL algorithms a job can run, behind one interface (``algorithm(cfg)``).

The step (``trainer/runtime/step.py``) asks the job's algorithm what it needs, never
``if algorithm == "ppo"``:

- ``critic``: whether it trains a value model. Inference then computes the old values (from
  ``critic.infer``, or ``critic.train`` in its training layout), and the plan needs
  ``critic.train``. It is the hyperparameter section's ``critic`` (``config/schema.py``'s
  ``HYPERPARAMETERS``), which the config checks and the planners read;
- ``advantages(cfg, batch, scores)``: writes ``batch["advantages"]`` (and ``"returns"``) from
  the step's rewards and returns its metrics;
- ``models(cfg)``: the models one mini-batch trains, in order, each with its loss, either of
  the response tokens' log-probs and entropy (a policy) or of their values (a critic), and
  its gradient clip. The runtime computes log-probs and values from its sharded logits
  (``parallel/vocab_parallel.py``), so the losses here never see a layout.

A new algorithm is a class here and, in ``trainer/config/``, its hyperparameter section
(``schema.py``: the class, its ``JobConfig`` field, ``HYPERPARAMETERS`` and ``Algorithm``; a test
checks they agree) and its values' range checks (``checks.py``). Outside the registry and
``trainer/config/`` no code names an algorithm (a test checks): it reads ``cfg.algo_hp``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import grpo, ppo
from ..config.names import ACTOR, ACTOR_TRAIN, CRITIC, CRITIC_TRAIN
from ..config import GRPOConfig, PPOConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Trained:
    """One model a mini-batch trains: ``name`` (metrics prefix), its training stage, its loss.

    ``kind`` "policy": ``loss(logprobs, entropy, mb)`` (``entropy`` None unless ``entropy``);
    ``kind`` "value": ``loss(values, mb)``. Both return ``ppo.LossSums``-carrying losses as
    ``ppo.policy_loss``/``value_loss`` do."""

    name: str
    stage: str
    kind: str
    loss: Callable
    max_grad_norm: float
    entropy: bool = False


class PPO:
    """GAE advantages over KL-penalised token rewards; a clipped policy and a clipped critic."""

    name = "ppo"
    critic = PPOConfig.critic

    def advantages(self, cfg, batch: dict, scores: torch.Tensor) -> dict[str, float]:
        hp = cfg.algo_hp
        adv, returns, metrics = ppo.compute_advantages(
            scores, batch["old_values"], batch["response_mask"], old_logprobs=batch.get("old_logprobs"),
            ref_logprobs=batch.get("ref_logprobs"), kl_coef=hp.kl_coef, kl_in_reward=hp.kl_in_reward,
            gamma=hp.gamma, lam=hp.lam, whiten=hp.whiten,
        )
        batch["advantages"], batch["returns"] = adv, returns
        return metrics

    def models(self, cfg) -> list[Trained]:
        hp = cfg.algo_hp
        actor = _policy(hp, kl_coef=0.0 if hp.kl_in_reward else hp.kl_coef)

        def critic(values, mb):
            return ppo.value_loss(values, mb["old_values"], mb["returns"], mb["response_mask"], clip=hp.value_clip,
                                  weights=mb["loss_weights"])

        return [actor, Trained(name=CRITIC, stage=CRITIC_TRAIN, kind="value", loss=critic, max_grad_norm=hp.max_grad_norm)]


class GRPO:
    """Group-relative advantages, PPO's clipped surrogate with the k3 KL as a loss term, no critic."""

    name = "grpo"
    critic = GRPOConfig.critic

    def advantages(self, cfg, batch: dict, scores: torch.Tensor) -> dict[str, float]:
        hp = cfg.algo_hp
        adv, metrics = grpo.group_advantages(scores, cfg.rollout.samples_per_prompt, scale_by_std=hp.scale_by_std, eps=hp.eps)
        batch["advantages"] = adv[:, None].expand_as(batch["response_mask"]).contiguous()
        return metrics

    def models(self, cfg) -> list[Trained]:
        return [_policy(cfg.algo_hp, kl_coef=cfg.algo_hp.kl_coef)]


def _policy(hp, *, kl_coef: float) -> Trained:
    """The actor's clipped surrogate (with the KL as a loss term when ``kl_coef``). Without old
    log-probs in the mini-batch (on-policy: the step skipped that forward) π_old is π_θ detached."""

    def loss(logprobs, entropy, mb):
        old = mb["old_logprobs"] if "old_logprobs" in mb else logprobs.detach()
        return ppo.policy_loss(
            logprobs, old, mb["advantages"], mb["response_mask"], clip=hp.clip, weights=mb["loss_weights"],
            ref_logprobs=mb.get("ref_logprobs"), kl_coef=kl_coef, entropy=entropy, entropy_coef=hp.entropy_coef,
        )

    return Trained(name=ACTOR, stage=ACTOR_TRAIN, kind="policy", loss=loss, max_grad_norm=hp.max_grad_norm,
                   entropy=bool(hp.entropy_coef))


ALGORITHMS = {a.name: a for a in (PPO(), GRPO())}
"""Every algorithm by its config name (``algorithm:``)."""


def algorithm(cfg) -> PPO | GRPO:
    """The job's algorithm (``cfg.algorithm``)."""
    return ALGORITHMS[cfg.algorithm]
