"""The names of the model-stages, defined once.

A model-stage is one model in one stage: ``<model>.<stage>`` with model actor | critic | ref |
reward and stage train | gen | infer. The plan (``plan.<model>.<stage>``), the step's measured
pieces, the metrics and the controller all key by these names.
"""

ACTOR_TRAIN = "actor.train"
ACTOR_GEN = "actor.gen"
CRITIC_TRAIN = "critic.train"
CRITIC_INFER = "critic.infer"
REF_INFER = "ref.infer"
REWARD_INFER = "reward.infer"

ACTOR_TRAIN_INFER = f"{ACTOR_TRAIN}.infer"
CRITIC_TRAIN_INFER = f"{CRITIC_TRAIN}.infer"
"""A training layout's own forward (the old log-probs; the old values without critic.infer): a piece the step measures."""

MODEL_STAGES = (ACTOR_TRAIN, ACTOR_GEN, CRITIC_TRAIN, CRITIC_INFER, REF_INFER, REWARD_INFER)
"""Every model-stage a plan may place, in the plan's order."""

SYNCED = {ACTOR_GEN: ACTOR_TRAIN, CRITIC_INFER: CRITIC_TRAIN}
"""A weight-synced copy -> the training stage whose weights stream into it every step."""
