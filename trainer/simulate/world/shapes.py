"""What the world prices: a model-stage's shapes and a step's lengths, as numbers and arrays (pure).

Shapes (``ModelShape``, from the job's ``ModelConfig``; elements, not bytes). Per TP rank of
degree t: q = heads·d columns split t ways; k and v split by KV head where t divides the KV
heads, else one head per rank (GQA replication); gate/up/down split t ways; the embedding
and an LM head split over the vocabulary; norms and a value head replicated. PP splits the
layers into contiguous ranges, the first ``L mod pp`` stages one layer more; the first stage
holds the embedding, the last the final norm and the head (a tied head is the embedding when
pp = 1, a copy on the last stage otherwise).

Lengths (``Lengths``: arrays over trace steps). A step's batch has ``batch`` rows; row r
holds a prompt (``prompt_mean`` real tokens on average, ``prompt`` at most) and a response
of length ℓ_r. The world draws the responses of a step from one distribution with the
step's mean μ and longest M: the share of rows still generating after s tokens is

    S(s) = 1 − (s/M)^β,  β = μ / (M − μ),

so that ∫₀^M S = μ (the mean), S(M) = 0 (the longest ends at M), β → ∞ when every row is as
long as the longest. Then E[ℓ²] = M²·β/(β + 2) (what packed attention costs). Generation
integrates over s with Gauss–Legendre nodes in u = s/M (``DECODE_NODES``), the active
batch of a replica max(1, rows·S) — the longest row is always in the slowest replica.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from nereus.trainer.config import ConfigError, JobConfig, ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
DECODE_NODES = 24
"""Gauss–Legendre nodes of the decode integral (module docstring)."""
_U, _W = np.polynomial.legendre.leggauss(DECODE_NODES)
U_NODES, U_WEIGHTS = (_U + 1) / 2, _W / 2  # on [0, 1], weights summing to 1


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool
    tied: bool
    lm: bool  # an LM head (else a value head)
    dtype: str

    @classmethod
    def of(cls, cfg: JobConfig, key: str) -> ModelShape:
        """The shapes of model-stage ``key`` (``actor.train``, ``critic.infer``, …) of ``cfg``."""
        _, m, head = cfg.stage_model(key)
        return cls.from_model(m, lm=head == "lm")

    @classmethod
    def from_model(cls, m: ModelConfig, *, lm: bool = True) -> ModelShape:
        if m.vocab_size is None:
            raise ConfigError("model vocab_size is unresolved: load the job config with its loader first")
        return cls(vocab=m.vocab_size, hidden=m.hidden_size, inter=m.intermediate_size, layers=m.num_layers, heads=m.num_heads,
                   kv_heads=m.num_kv_heads, head_dim=m.head_dim or m.hidden_size // m.num_heads, qkv_bias=m.qkv_bias,
                   tied=m.tie_embeddings, lm=lm, dtype=m.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of one element in the compute dtype."""
        return DTYPE_BYTES[self.dtype]

    def q_t(self, t: int) -> float:
        return self.heads * self.head_dim / t

    def kv_t(self, t: int) -> float:
        """Columns of k (or of v) on a TP rank: split by KV head, or one head replicated."""
        return (self.kv_heads // t if self.kv_heads % t == 0 else 1) * self.head_dim

    def layer_elements(self, t: int) -> float:
        h, q, kv = self.hidden, self.q_t(t), self.kv_t(t)
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return 2 * h * q + 2 * h * kv + 3 * h * self.inter / t + 2 * h + bias

    def embed_elements(self, t: int) -> float:
        return self.vocab * self.hidden / t

    def head_elements(self, t: int, pp: int) -> float:
        if not self.lm:
            return self.hidden + self.hidden  # value head and final norm
        shared = self.tied and pp == 1
        return (0 if shared else self.vocab * self.hidden / t) + self.hidden

    def stage_layers(self, pp: int) -> np.ndarray:
        """Layers of each pipeline stage (first ``L mod pp`` one more)."""
        base, extra = divmod(self.layers, pp)
        return np.array([base + (j < extra) for j in range(pp)], dtype=np.int64)

    def checkpointed(self, pp: int, recompute: str) -> np.ndarray:
        """Blocks of each pipeline stage whose activations are recomputed in backward:
        none, all (``full``) or those of an even global index (``selective``: every other block)."""
        layers = self.stage_layers(pp)
        if recompute == "full":
            return layers
        if recompute != "selective":
            return np.zeros(pp, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(layers)[:-1]])
        return (layers + (starts % 2 == 0)) // 2

    def rank_elements(self, t: int, pp: int) -> np.ndarray:
        """Parameters held by a rank of each pipeline stage (before any FSDP sharding)."""
        out = self.stage_layers(pp) * self.layer_elements(t)
        out = out.astype(float)
        out[0] += self.embed_elements(t)
        out[-1] += self.head_elements(t, pp)
        return out

    def tensors_per_layer(self) -> int:
        return 9 + (3 if self.qkv_bias else 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Work:
    """One step's demands (the trace step's lengths on the job's batch)."""

    batch: int
    prompt: int  # the longest prompt (the padded width's part)
    prompt_mean: float  # real prompt tokens per row on average
    response_max: int
    response_mean: float
    minibatch: int
    epochs: int

    @property
    def width(self) -> int:
        return self.prompt + self.response_max

    @property
    def row_mean(self) -> float:
        return self.prompt_mean + self.response_mean


@dataclass(frozen=True, kw_only=True, slots=True)
class Lengths:
    """Several steps' lengths as arrays (float, one entry per step) on one job's batch."""

    batch: int
    prompt: int
    minibatch: int
    epochs: int
    response_max: np.ndarray
    response_mean: np.ndarray
    prompt_mean: np.ndarray

    @classmethod
    def of(cls, works: list[Work]) -> Lengths:
        w = works[0]
        return cls(batch=w.batch, prompt=w.prompt, minibatch=w.minibatch, epochs=w.epochs,
                   response_max=np.array([x.response_max for x in works], dtype=float),
                   response_mean=np.array([x.response_mean for x in works], dtype=float),
                   prompt_mean=np.array([x.prompt_mean for x in works], dtype=float))

    def __len__(self) -> int:
        return len(self.response_max)

    @property
    def key(self) -> tuple:
        return (self.batch, self.prompt, self.minibatch, self.epochs, self.response_max.tobytes(), self.response_mean.tobytes(),
                self.prompt_mean.tobytes())

    @property
    def width(self) -> np.ndarray:
        return self.prompt + self.response_max

    @property
    def row_mean(self) -> np.ndarray:
        return self.prompt_mean + self.response_mean

    @property
    def beta(self) -> np.ndarray:
        return length_beta(self.response_max, self.response_mean)

    @property
    def response_sq_mean(self) -> np.ndarray:
        return response_sq_mean(self.response_max, self.response_mean)

    @property
    def row_sq_mean(self) -> np.ndarray:
        """E[(prompt + ℓ)²] of a real row (prompts at their mean)."""
        p = self.prompt_mean
        return p * p + 2 * p * self.response_mean + self.response_sq_mean

    @property
    def minibatches(self) -> int:
        return self.epochs * max(1, self.batch // self.minibatch)

    @property
    def train_rows(self) -> int:
        return min(self.minibatch, self.batch)


def length_beta(longest, mean):
    """β of the module docstring's S(s) = 1 − (s/M)^β: μ / (M − μ), clipped."""
    gap = np.maximum(np.asarray(longest, dtype=float) - mean, 1e-9)
    return np.clip(mean / gap, 1e-6, 1e6)


def response_sq_mean(longest, mean):
    """E[ℓ²] of a response of the step (what its rows measure): M²·β/(β + 2)."""
    b, m = length_beta(longest, mean), np.asarray(longest, dtype=float)
    return m * m * b / (b + 2)


def job_prompt(cfg: JobConfig) -> int:
    """The longest prompt of the job: its dataset's ``max_prompt_length``, or the toy task's
    prompt (``<bos>`` and the digits; ``count`` one separator more)."""
    if cfg.data is not None:
        return cfg.data.max_prompt_length
    return (1 if cfg.task.name == "repeat" else 2) + cfg.task.digits


def job_work(cfg: JobConfig, t, prompt_mean: float | None = None) -> Work:
    """A trace step's ``Work`` for ``cfg`` (``t``: any object with the ``TraceStep`` fields;
    its ``prompt_mean``, else ``prompt_mean``, else the longest prompt)."""
    hp = cfg.algo_hp
    prompt = job_prompt(cfg)
    mean = getattr(t, "prompt_mean", None)
    mean = mean if mean is not None else prompt_mean if prompt_mean is not None else prompt
    return Work(batch=cfg.batch_size, prompt=prompt, prompt_mean=float(mean), response_max=int(t.response_max),
                response_mean=float(t.response_mean or t.response_max), minibatch=hp.minibatch_size, epochs=hp.epochs)
