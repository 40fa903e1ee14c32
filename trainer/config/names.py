"""The names of the model-stages and of the step's other measured pieces, defined once.

A model-stage is one model in one stage: ``<model>.<stage>`` with model actor | critic | ref |
reward and stage train | gen | infer. The plan (``plan.<model>.<stage>``), the step's measured
pieces, the metrics and the controller all key by these names.
"""

ACTOR, CRITIC, REF, REWARD = "actor", "critic", "ref", "reward"
MODELS = (ACTOR, CRITIC, REF, REWARD)
"""The models a plan places (``plan.<model>``)."""
TRAIN, GEN, INFER = "train", "gen", "infer"
"""The stages (``plan.<model>.<stage>``), and the modes a stage's step-time is priced in."""

ACTOR_TRAIN = f"{ACTOR}.{TRAIN}"
ACTOR_GEN = f"{ACTOR}.{GEN}"
CRITIC_TRAIN = f"{CRITIC}.{TRAIN}"
CRITIC_INFER = f"{CRITIC}.{INFER}"
REF_INFER = f"{REF}.{INFER}"
REWARD_INFER = f"{REWARD}.{INFER}"

OWN_FORWARD = f".{INFER}"
ACTOR_TRAIN_INFER = f"{ACTOR_TRAIN}{OWN_FORWARD}"
CRITIC_TRAIN_INFER = f"{CRITIC_TRAIN}{OWN_FORWARD}"
"""A training layout's own forward (the old log-probs; the old values without critic.infer): a piece the step measures."""
SYNC = "sync."
"""The prefix of a weight sync's piece: ``sync.<the copy it fills>``."""
ADVANTAGES = "advantages"
"""The step's piece that computes the algorithm's advantages (and returns) on every rank."""
TRAIN_CHECK = "train.check"
"""The step's piece after each mini-batch's backward (the check that every loss and gradient is
finite on every rank, one all-reduce) and after the last (the training metrics' finish)."""

MODEL_STAGES = (ACTOR_TRAIN, ACTOR_GEN, CRITIC_TRAIN, CRITIC_INFER, REF_INFER, REWARD_INFER)
"""Every model-stage a plan may place, in the plan's order."""

SYNCED = {ACTOR_GEN: ACTOR_TRAIN, CRITIC_INFER: CRITIC_TRAIN}
"""A weight-synced copy -> the training stage whose weights stream into it every step."""


def model_of(key: str) -> str:
    """The model of a model-stage: ``critic`` of ``critic.train``."""
    return key.split(".")[0]


def own_forward_piece(key: str) -> str:
    """The piece of training stage ``key``'s own forward (``actor.train.infer``)."""
    return f"{key}{OWN_FORWARD}"


def train_stage(model: str) -> str:
    """A model's training stage: ``critic.train`` of ``critic``."""
    return f"{model}.{TRAIN}"


def sync_piece(key: str) -> str:
    """The piece of the weight sync that fills synced copy ``key`` (``sync.actor.gen``)."""
    return f"{SYNC}{key}"


def piece_stage(name: str) -> str:
    """The model-stage a measured piece runs on: a sync's destination, a training layout's own
    forward's training stage, else ``name`` itself (a model-stage, or the step's bookkeeping)."""
    if name.startswith(SYNC):
        return name[len(SYNC):]
    if name in (ACTOR_TRAIN_INFER, CRITIC_TRAIN_INFER):
        return name[: -len(OWN_FORWARD)]
    return name


def split_key(key: str) -> tuple[str, str]:
    """(model, stage) of a model-stage: ``("critic", "train")`` of ``critic.train``."""
    model, stage = key.split(".")
    return model, stage


def stage_of(key: str) -> str:
    """The stage of a model-stage: ``train``, ``gen`` or ``infer``."""
    return key.split(".")[1]


def is_train(key: str) -> bool:
    """Whether ``key`` is a training model-stage (``actor.train``, ``critic.train``)."""
    return key.endswith(f".{TRAIN}")


def is_gen(key: str) -> bool:
    """Whether ``key`` is the rollout's model-stage (``actor.gen``)."""
    return key.endswith(f".{GEN}")


def is_infer(key: str) -> bool:
    """Whether ``key`` is an inference model-stage (``critic.infer``, ``ref.infer``, ``reward.infer``)."""
    return key.endswith(f".{INFER}")


def is_own_forward(name: str) -> bool:
    """Whether piece ``name`` is a training layout's own forward (``actor.train.infer``)."""
    return name in (ACTOR_TRAIN_INFER, CRITIC_TRAIN_INFER)
