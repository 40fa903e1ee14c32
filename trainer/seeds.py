"""Every seed the job derives, in one place (pure; of the project it imports only the models'
names of ``config/names``).

Randomness in a step is keyed by what it is about — the job's seed, the step, a row, a
parameter's name, an epoch — never by a rank or a replica, so that every layout draws the
same numbers (``docs/correctness.md``). Each mixer is a fixed formula: changing one changes
every trained number, and tests pin them.

- ``mix(*parts)``: a step's draws (the rollout's uniforms ``(seed, step)``, a validation chunk's
  ``(seed, step, -1 - k)``, the mini-batch permutation ``(seed, step, 99)``, the prompts
  ``(seed, step, 0)``): h ← (h · 1,000,003 + p + 1) mod 2^62 over the parts;
- ``row_seed(seed, row)``: vLLM's per-request seed of one rollout row, the same step of ``mix``;
- ``param_seed(seed, name)``: a parameter's own init generator, (seed · 1,000,003 + crc32(name))
  mod 2^63, so a pipeline stage or a tied copy draws what the whole model draws;
- ``epoch_seed(seed, epoch)``: a dataset epoch's permutation, 63 bits of blake2b;
- ``model_seed(seed, model)``: a model's initialisation (and a fresh value head's): the
  job's seed, + 1 for the critic, so that a critic of the actor's shapes starts elsewhere;
- the validation set's sample of ``validation.max_prompts`` prompts draws from the job's seed
  itself (``data/prompts.py``).

Every draw above uses a generator of its own, never torch's global one, so a resumed job
draws what the uninterrupted one draws without restoring any generator state (a checkpoint
records each rank's global RNG states, ``store.checkpoint.rng_state``, and nothing restores
them). One seed lives outside the trainer, which it cannot import: ``reshard.reference``
seeds the reference tensors of the resharding tests and benchmarks by (name, seed).
"""

from __future__ import annotations

import hashlib
import zlib

from .config.names import CRITIC


def mix(*parts: int) -> int:
    h = 0
    for p in parts:
        h = (h * 1_000_003 + p + 1) % (1 << 62)
    return h


def row_seed(seed: int, row: int) -> int:
    return (seed * 1_000_003 + row + 1) % (1 << 62)


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def model_seed(seed: int, model: str) -> int:
    """The init seed of ``model`` (actor, critic, ref, reward: a model-stage's first part)."""
    return seed + (1 if model == CRITIC else 0)


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of one epoch's permutation: 63 bits of blake2b("seed:epoch")."""
    digest = hashlib.blake2b(f"nereus.data:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
