"""Batched autoregressive sampling with a KV cache: the built-in rollout engine.

Prompts of different lengths are left-padded to P so that every row's last prompt token
sits in column P-1 and all rows decode in lock-step; position ids count real tokens only.
Each step samples one token per row from ``softmax(logits / temperature)`` restricted to the
top-p nucleus (greedy argmax when temperature == 0). Rows with the same prompt are
prefilled once (``_prefill``). A row stops after emitting a stop token; later columns
hold ``pad_id``. Decoding ends when every row has stopped or after
``max_new_tokens`` steps, so N <= max_new_tokens. Stopped rows leave the batch the model
runs (``RETIRE_SHARE``), as a serving engine's finished requests do: a step's decode costs
the rows still generating, not the whole batch until its longest row ends.

Log-probs (what RL needs as the behaviour policy's log-prob): ``log_softmax(logits / T)``
of the sampled token, of the model's logits before top-p filtering (verl's convention; with
top-p < 1 the true sampling distribution is renormalised over the nucleus, this is not).
For greedy decoding (T == 0) they are ``log_softmax(logits)``.

Randomness: each step draws one uniform per row, from ``generator``, or, with ``uniforms``
[B, max_new_tokens], row i's step t reads ``uniforms[i, t]``. ``BuiltinEngine``, the trainer's
``RolloutEngine`` (``engine.py``), draws a replica's uniforms as rows ``first_row..`` of the whole
batch's, from a seed of (job seed, step), so a row's sample depends on the step and the row
only: the same rollouts at any dp degree (a job resumed on another number of processes
samples what the original would have).

The generator only calls ``model(ids, attention_mask=, kv_cache=)``: it is TP-agnostic
(DTensor TP runs inside the same forward). ``generate_no_cache`` recomputes the whole
sequence each step; it exists to test the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..models.decoder import KVCache

RETIRE_SHARE = 4
"""Finished rows leave the decoding batch (and the KV cache) once they are at least 1 /
``RETIRE_SHARE`` of the rows it still runs: each retirement copies the cache of the rows
left, so the copies shrink geometrically (at most ``RETIRE_SHARE`` caches' worth in all)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Rollout:
    """A batch of prompts and sampled responses, B rows, P prompt columns, N response columns.

    tokens          [B, P+N] int64: left-padded prompt, response, right padding (pad_id).
    prompt_mask     [B, P+N] bool: real prompt tokens.
    response_mask   [B, P+N] bool: generated tokens, up to and including the stop token.
    logprobs        [B, N] float32: log_softmax(logits / T) of each sampled token (0 on padding);
                    column j belongs to tokens[:, P + j].
    prompt_lengths  [B] int64, response_lengths [B] int64 (stop token included).
    """

    tokens: torch.Tensor
    prompt_mask: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor

    @property
    def prompt_width(self) -> int:
        """P: the number of (left-padded) prompt columns."""
        return self.tokens.shape[1] - self.logprobs.shape[1]

    @property
    def attention_mask(self) -> torch.Tensor:
        """[B, P+N] bool: real tokens (prompt or response), for teacher-forced scoring."""
        return self.prompt_mask | self.response_mask


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, P] (P = longest prompt) left-padded with ``pad_id``, and the lengths [B]."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
    return ids.to(device), torch.tensor([len(p) for p in prompts], device=device)


def sample(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None, u: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits [B, V] and its log-prob, as the module docstring states.

    Sampling inverts the CDF: with c = cumsum(p) and one uniform U per row, the token is
    the first i with c_i > U · c_V, which is i with probability p_i (tokens cut by top-p have
    p_i = 0 and are never picked). It draws exactly B numbers every step whatever the
    logits, so two runs from one seed (with and without the cache) stay in step; ``u`` [B, 1]
    gives those numbers instead of ``generator``.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        logp = torch.log_softmax(logits, -1)
    else:
        logp = torch.log_softmax(logits / temperature, -1)
        probs = logp.exp()
        if top_p < 1.0:
            sorted_p, order = probs.sort(-1, descending=True)
            outside = sorted_p.cumsum(-1) - sorted_p > top_p  # the most likely token is always kept
            probs = probs.scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
        cdf = probs.cumsum(-1)
        if u is None:
            u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cdf.dtype)
        u = u.to(cdf.device, cdf.dtype) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    *,
    prompt_lengths: torch.Tensor | None = None,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    stop_tokens: Sequence[int] = (),
    pad_id: int,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> Rollout:
    """Sample up to ``max_new_tokens`` per prompt, prefilling once and decoding through a KV cache.

    ``prompts``: lists of token ids, or a left-padded tensor [B, P] with ``prompt_lengths``.
    ``generator`` must live on the model's device; the same seed gives the same tokens.
    ``uniforms`` [B, max_new_tokens] instead: each row's draws (module docstring).
    """
    ids, lengths = _prompt_batch(model, prompts, prompt_lengths, pad_id)
    return _decode(model, ids, lengths, max_new_tokens, temperature, top_p, stop_tokens, pad_id, generator, use_cache=True,
                   uniforms=uniforms)


def generate_no_cache(
    model: nn.Module,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    *,
    prompt_lengths: torch.Tensor | None = None,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    stop_tokens: Sequence[int] = (),
    pad_id: int,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> Rollout:
    """``generate`` recomputing the full sequence every step (O(N^2) work): a test oracle."""
    ids, lengths = _prompt_batch(model, prompts, prompt_lengths, pad_id)
    return _decode(model, ids, lengths, max_new_tokens, temperature, top_p, stop_tokens, pad_id, generator, use_cache=False,
                   uniforms=uniforms)


class BuiltinEngine:
    """The built-in generator as a ``RolloutEngine`` (``engine.py``): ``actor.gen``'s own module
    (any tp, pp=1), sampled by ``generate`` with uniforms.

    Row i of ``prompts`` reads row ``first_row + i`` of ``torch.rand(rows, max_new_tokens)``
    drawn from a CPU generator seeded with ``seed``, ``rows`` the whole batch's. The engine draws
    the rows up to its own last only: torch's CPU uniform kernel fills a tensor in order from
    one stream, so those rows hold the same numbers whatever the batch's size
    (tests/trainer/rollout/test_generator.py pins it)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_tokens: Sequence[int] = (),
        pad_id: int,
        seed: int = 0,
        first_row: int = 0,
    ) -> Rollout:
        draws = torch.rand(first_row + len(prompts), max_new_tokens, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            return generate(self.module, prompts, uniforms=draws[first_row:], max_new_tokens=max_new_tokens,
                            temperature=temperature, top_p=top_p, stop_tokens=stop_tokens, pad_id=pad_id)


def _prompt_batch(model, prompts, prompt_lengths, pad_id) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [B, P] and lengths [B] on the model's device, checked."""
    device = next(model.parameters()).device
    if not isinstance(prompts, torch.Tensor):
        return left_pad(prompts, pad_id, device)
    if prompt_lengths is None:
        raise ValueError("a prompt tensor needs prompt_lengths (its rows are left-padded)")
    ids, lengths = prompts.to(device, torch.long), prompt_lengths.to(device, torch.long)
    if bool((lengths < 1).any()) or bool((lengths > ids.shape[1]).any()):
        raise ValueError(f"prompt_lengths must lie in [1, {ids.shape[1]}], got {lengths.tolist()}")
    return ids, lengths


@torch.no_grad()
def _decode(
    model, ids, lengths, max_new_tokens, temperature, top_p, stop_tokens, pad_id, generator, *, use_cache, uniforms=None
) -> Rollout:
    if temperature < 0 or not 0 < top_p <= 1 or max_new_tokens < 1:
        raise ValueError(
            f"need temperature >= 0, 0 < top_p <= 1, max_new_tokens >= 1; got {temperature}, {top_p}, {max_new_tokens}"
        )
    device = ids.device
    b, width = ids.shape
    if uniforms is not None and tuple(uniforms.shape) != (b, max_new_tokens):
        raise ValueError(f"uniforms must be [rows, max_new_tokens] = [{b}, {max_new_tokens}], got {list(uniforms.shape)}")
    prompt_mask = _prompt_mask(width, lengths)
    stops = torch.tensor(list(stop_tokens), dtype=torch.long, device=device)
    tokens, real = ids, prompt_mask
    if use_cache:
        logits, cache = _prefill(model, ids, lengths, prompt_mask, width + max_new_tokens)
    else:
        cache, logits = None, model(ids, attention_mask=prompt_mask)[:, -1]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    live = torch.arange(b, device=device)  # the batch row of each row the model still runs (a cache row)
    uniforms = None if uniforms is None else uniforms.to(device)  # (indexed by ``live``, on the model's device)
    new_tokens, new_logprobs, alive_cols = [], [], []
    for step in range(max_new_tokens):
        if uniforms is not None:
            u = uniforms[live, step : step + 1]
        else:  # B draws every step whatever has retired, so the streams stay in step (float32, as ``sample`` draws)
            u = torch.rand((b, 1), generator=generator, device=device, dtype=torch.float32)[live] if temperature > 0 else None
        drawn, drawn_logp = sample(logits, temperature, top_p, generator, u)
        token = torch.full((b,), pad_id, dtype=torch.long, device=device).index_copy_(0, live, drawn)
        logp = torch.zeros(b, dtype=drawn_logp.dtype, device=device).index_copy_(0, live, drawn_logp)
        alive = ~done
        token, logp = token.masked_fill(done, pad_id), logp.masked_fill(done, 0.0)
        new_tokens.append(token)
        new_logprobs.append(logp)
        alive_cols.append(alive)
        done = done | torch.isin(token, stops)
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        if cache is not None:
            finished = done[live]
            if int(finished.sum()) * RETIRE_SHARE >= live.numel():  # retire them: the cache keeps the rows still generating
                keep = (~finished).nonzero().squeeze(1)
                cache.select_rows(keep)
                live = live[keep]
            logits = model(token[live][:, None], attention_mask=alive[live][:, None], kv_cache=cache)[:, -1]
        else:
            tokens, real = torch.cat([tokens, token[:, None]], 1), torch.cat([real, alive[:, None]], 1)
            logits = model(tokens, attention_mask=real)[:, -1]

    response_mask = torch.stack(alive_cols, 1)
    return Rollout(
        tokens=torch.cat([ids, torch.stack(new_tokens, 1)], 1),
        prompt_mask=torch.cat([prompt_mask, torch.zeros_like(response_mask)], 1),
        response_mask=torch.cat([torch.zeros_like(prompt_mask), response_mask], 1),
        logprobs=torch.stack(new_logprobs, 1),
        prompt_lengths=lengths,
        response_lengths=response_mask.sum(1),
    )


def _prefill(model, ids, lengths, prompt_mask, max_len: int) -> tuple[torch.Tensor, KVCache]:
    """The last prompt token's logits [B, V] and a KV cache of the prompts for B rows.

    Rows sharing a prompt (GRPO's samples of one prompt: same ids and length) are prefilled
    once and their cache rows copied, as vLLM's prefix caching would share them: a group of
    G samples costs one prompt's prefill instead of G.
    """
    distinct, inverse = torch.unique(torch.cat([ids, lengths[:, None]], 1), dim=0, return_inverse=True)
    if distinct.shape[0] == ids.shape[0]:
        cache = KVCache.for_model(model, ids.shape[0], max_len)
        return model(ids, attention_mask=prompt_mask, kv_cache=cache)[:, -1], cache
    cache = KVCache.for_model(model, distinct.shape[0], max_len)
    mask = _prompt_mask(ids.shape[1], distinct[:, -1])
    logits = model(distinct[:, :-1], attention_mask=mask, kv_cache=cache)[:, -1]
    cache.select_rows(inverse)
    return logits[inverse], cache


def _prompt_mask(width: int, lengths: torch.Tensor) -> torch.Tensor:
    """[B, width] bool: the real tokens of left-padded prompts of ``lengths``."""
    return torch.arange(width, device=lengths.device) >= width - lengths[:, None]
