"""The KV-cache generator equals the recompute-everything generator, token for token, with
left-padded prompts of different lengths and stop tokens; its log-probs equal a
teacher-forced forward over the rollout."""

import pytest
import torch

from nereus.trainer.rollout.generator import BuiltinEngine, Rollout, generate, generate_no_cache, left_pad, sample

from tests.trainer.models.test_model import make_model

PROMPTS = [[5, 9, 3, 7, 1, 2, 11], [4, 4], [8, 1, 6, 2], [17]]
PAD = 0


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return make_model(std=0.5, num_layers=2, qkv_bias=True)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_same(a: Rollout, b: Rollout) -> None:
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.prompt_mask, b.prompt_mask) and torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.response_lengths, b.response_lengths)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def assert_well_formed(r: Rollout, stops: set[int]) -> None:
    """Masks, padding and lengths agree with each other and with the stop tokens."""
    p = r.prompt_width
    assert r.prompt_mask.sum(1).tolist() == r.prompt_lengths.tolist()
    assert not (r.prompt_mask & r.response_mask).any() and not r.response_mask[:, :p].any()
    for b in range(r.tokens.shape[0]):
        n = int(r.response_lengths[b])
        response = r.tokens[b, p:]
        assert r.response_mask[b, p:].tolist() == [True] * n + [False] * (response.shape[0] - n)
        assert (response[n:] == PAD).all() and (r.logprobs[b, n:] == 0).all()
        assert not stops & set(response[: n - 1].tolist())
        assert response[n - 1].item() in stops or n == response.shape[0]
        assert (r.logprobs[b, :n] < 0).all()


def run_both(model, **kwargs) -> tuple[Rollout, Rollout]:
    seed = kwargs.pop("seed", 0)
    a = generate(model, PROMPTS, pad_id=PAD, generator=seeded(seed), **kwargs)
    b = generate_no_cache(model, PROMPTS, pad_id=PAD, generator=seeded(seed), **kwargs)
    return a, b


def pick_stop_tokens(model) -> set[int]:
    """A stop token that row 1 emits at its third step (greedy), so some rows stop and others do not."""
    free = generate(model, PROMPTS, pad_id=PAD, max_new_tokens=3, temperature=0)
    return {int(free.tokens[1, -1])}


def test_greedy_with_cache_equals_without(model):
    stops = pick_stop_tokens(model)
    a, b = run_both(model, max_new_tokens=10, temperature=0, stop_tokens=tuple(stops))
    assert_same(a, b)
    assert_well_formed(a, stops)
    assert a.response_lengths[1] <= 3 and a.response_lengths.max() == 10


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_with_cache_equals_without_for_the_same_seed(model, temperature, top_p):
    first = generate(model, PROMPTS, pad_id=PAD, max_new_tokens=1, temperature=temperature, top_p=top_p, generator=seeded(1))
    stops = set(first.tokens[:2, -1].tolist())  # rows 0 and 1 stop at once, the others run on
    a, b = run_both(model, max_new_tokens=12, temperature=temperature, top_p=top_p, stop_tokens=tuple(stops), seed=1)
    assert_same(a, b)
    assert_well_formed(a, stops)
    assert (a.response_lengths[:2] == 1).all()
    other = generate(model, PROMPTS, pad_id=PAD, max_new_tokens=12, temperature=temperature, top_p=top_p, generator=seeded(2))
    assert not torch.equal(other.tokens[2:], a.tokens[2:])


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_equal_a_teacher_forced_forward(model, temperature):
    r = generate(model, PROMPTS, pad_id=PAD, max_new_tokens=9, temperature=temperature, top_p=0.8, generator=seeded(3))
    p = r.prompt_width
    logits = model(r.tokens, attention_mask=r.attention_mask)[:, p - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), -1).gather(-1, r.tokens[:, p:, None]).squeeze(-1)
    real = r.response_mask[:, p:]
    torch.testing.assert_close(r.logprobs[real], logp[real], atol=1e-5, rtol=0)


def test_stops_early_when_every_row_has_stopped(model):
    first = generate(model, PROMPTS, pad_id=PAD, max_new_tokens=1, temperature=0).tokens[:, -1]
    a, b = run_both(model, max_new_tokens=20, temperature=0, stop_tokens=tuple(first.tolist()))
    assert_same(a, b)
    assert a.logprobs.shape == (4, 1) and a.response_lengths.tolist() == [1, 1, 1, 1]


def test_a_row_alone_equals_the_row_in_a_left_padded_batch(model):
    batch = generate(model, PROMPTS, pad_id=PAD, max_new_tokens=8, temperature=0)
    for b, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], pad_id=PAD, max_new_tokens=8, temperature=0)
        assert torch.equal(alone.tokens[0, len(prompt) :], batch.tokens[b, batch.prompt_width :])
        torch.testing.assert_close(alone.logprobs[0], batch.logprobs[b], atol=1e-5, rtol=0)


def test_tiny_top_p_is_greedy_and_tensor_prompts_equal_list_prompts(model):
    greedy = generate(model, PROMPTS, pad_id=PAD, max_new_tokens=6, temperature=0)
    nucleus = generate(model, PROMPTS, pad_id=PAD, max_new_tokens=6, temperature=1.0, top_p=1e-6, generator=seeded(4))
    assert torch.equal(greedy.tokens, nucleus.tokens)
    ids, lengths = left_pad(PROMPTS, pad_id=PAD)
    ids[1, :5] = 13  # pad slots hold any valid id: they are masked
    from_tensor = generate(model, ids, prompt_lengths=lengths, pad_id=PAD, max_new_tokens=6, temperature=0)
    assert torch.equal(from_tensor.tokens[:, ids.shape[1] :], greedy.tokens[:, ids.shape[1] :])
    torch.testing.assert_close(from_tensor.logprobs, greedy.logprobs, atol=1e-5, rtol=0)


def test_bad_arguments_are_rejected(model):
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[1], []], pad_id=PAD, max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt_lengths"):
        generate(model, torch.ones(2, 3, dtype=torch.long), pad_id=PAD, max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [[1]], pad_id=PAD, max_new_tokens=2, top_p=0.0)


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_sampled_frequencies_match_the_nucleus_distribution(top_p):
    """200,000 draws from 5 fixed distributions: each token's frequency is within 5 standard
    errors of its (top-p renormalised) probability, and tokens outside the nucleus never occur."""
    torch.manual_seed(1)
    logits = torch.randn(5, 12) * 1.5
    probs = torch.softmax(logits / 0.8, -1)
    if top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, sorted_p.cumsum(-1) - sorted_p <= top_p)
        probs = torch.where(keep, probs, 0.0)
        probs /= probs.sum(-1, keepdim=True)
    n, g = 200_000, seeded(7)
    counts = torch.zeros_like(probs)
    for _ in range(n // 1000):
        tokens, logp = sample(logits.repeat_interleave(1000, 0), 0.8, top_p, g)
        counts.scatter_add_(1, tokens.view(5, 1000), torch.ones(5, 1000))
        torch.testing.assert_close(logp.view(5, 1000), torch.log_softmax(logits / 0.8, -1).gather(1, tokens.view(5, 1000)))
    freq = counts / n
    stderr = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * stderr + 1e-9).all(), (freq - probs).abs().max()
    assert (counts[probs == 0] == 0).all()


def test_shared_prompts_are_prefilled_once_with_the_same_rollout(model):
    """GRPO-style repeated prompts (and two that left-pad to the same ids but differ in
    length) give the recompute-everything generator's tokens; the prefill sees each distinct
    prompt once."""
    prompts = [[5, 9, 3], [5, 9, 3], [PAD, 7], [7], [5, 9, 3], [7]]  # [PAD, 7] and [7] pad alike
    seen = []
    hook = model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    try:
        cached = generate(model, prompts, pad_id=PAD, max_new_tokens=5, generator=seeded(2))
    finally:
        hook.remove()
    assert seen[0] == 3 and set(seen[1:]) == {6}  # prefill: 3 distinct rows; decode: all 6
    plain = generate_no_cache(model, prompts, pad_id=PAD, max_new_tokens=5, generator=seeded(2))
    assert_same(cached, plain)
    assert_well_formed(cached, set())


def test_stopped_rows_leave_the_decoding_batch_with_the_same_rollout(model):
    """Rows that stopped leave the batch the model runs once they are a quarter of it (the
    cache keeps the others): the decode forwards shrink, and the tokens and log-probs are
    the recompute-everything generator's, row by row, with uniforms or a generator."""
    first = generate(model, PROMPTS, pad_id=PAD, max_new_tokens=1, temperature=1.0, generator=seeded(1))
    stops = tuple(set(first.tokens[:2, -1].tolist()))  # rows 0 and 1 stop at once, the others run on
    seen = []
    hook = model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    try:
        cached = generate(model, PROMPTS, pad_id=PAD, max_new_tokens=12, stop_tokens=stops, generator=seeded(1))
    finally:
        hook.remove()
    assert seen[0] == 4 and seen[1] <= 2 and max(seen[1:]) <= 2  # the prefill, then the two rows still generating
    assert_same(cached, generate_no_cache(model, PROMPTS, pad_id=PAD, max_new_tokens=12, stop_tokens=stops, generator=seeded(1)))
    u = torch.rand(4, 12, generator=seeded(5))
    a = generate(model, PROMPTS, pad_id=PAD, max_new_tokens=12, stop_tokens=stops, uniforms=u)
    assert_same(a, generate_no_cache(model, PROMPTS, pad_id=PAD, max_new_tokens=12, stop_tokens=stops, uniforms=u))
    assert_well_formed(a, set(stops))


def test_the_builtin_engine_samples_a_replicas_rows_with_the_whole_batchs_uniforms(model):
    """``BuiltinEngine.generate`` on a replica's rows [lo, hi) with ``first_row=lo`` samples what
    ``generate`` gives those rows with rows [lo, hi) of the whole batch's ``torch.rand(rows, T)``
    from the seed (the trainer's draw): the engine draws the rows up to hi only, the same numbers."""
    engine, batch = BuiltinEngine(model), PROMPTS * 3
    whole = torch.rand(len(batch), 9, generator=seeded(11))
    for lo, hi in [(0, 12), (0, 5), (5, 9), (9, 12), (11, 12)]:
        got = engine.generate(batch[lo:hi], seed=11, first_row=lo, max_new_tokens=9, temperature=0.9, top_p=0.95, pad_id=PAD)
        assert_same(got, generate(model, batch[lo:hi], pad_id=PAD, max_new_tokens=9, temperature=0.9, top_p=0.95, uniforms=whole[lo:hi]))
