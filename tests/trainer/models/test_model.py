"""The decoder: HF names equal reshard's parameter plan, and each piece of maths equals a
direct float64 reference (transformers is not installed here, so no HF parity run)."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from nereus.reshard.derive import DecoderSpec, plan_parameters
from nereus.trainer.models.decoder import (
    Attention,
    KVCache,
    ModelArgs,
    apply_rope,
    attention_mask_4d,
    build_model,
    init_weights,
    rope_cos_sin,
)

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)


def make_model(seed: int = 0, std: float = 0.3, rope_theta: float = 500.0, **spec_overrides):
    """A tiny float32 decoder on CPU. std is large so logits are peaked (no near-ties in
    argmax); biases and norm weights are made random so they are exercised too."""
    args = ModelArgs(spec=DecoderSpec(**{**TINY, **spec_overrides}), rope_theta=rope_theta, rms_norm_eps=1e-5)
    model = build_model(args).to_empty(device="cpu")
    init_weights(model, seed=seed, std=std)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)
    return model


# ---------------------------------------------------------------- names and shapes


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(tie_embeddings=True),
        dict(qkv_bias=True, tie_embeddings=True),
        dict(head="value"),
        dict(head="value", tie_embeddings=True, qkv_bias=True),
        dict(head_dim=16, num_kv_heads=1),
        dict(dtype="bfloat16"),
    ],
)
def test_state_dict_names_and_shapes_equal_the_reshard_plan(overrides):
    spec = DecoderSpec(**{**TINY, **overrides})
    state = build_model(ModelArgs(spec=spec)).state_dict()
    assert {n: tuple(t.shape) for n, t in state.items()} == {n: s for n, s, _, _ in plan_parameters(spec)}
    assert {t.dtype for t in state.values()} == {getattr(torch, spec.dtype)}
    assert all(t.is_meta for t in state.values())


# ---------------------------------------------------------------- float64 references


def rope_complex(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [..., T, heads, d] rotated as complex numbers x[:d/2] + i x[d/2:] times e^(i pos w_j)."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    freqs = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / x.shape[-1])
    angles = pos.double()[..., None] * freqs
    z = z * torch.polar(torch.ones_like(angles), angles)[..., None, :]
    return torch.cat([z.real, z.imag], -1)


def attention_loop(q, k, v, visible) -> torch.Tensor:
    """q [T, H, d], k/v [S, K, d], visible bool [T, S]: query head h reads kv head h // (H/K)."""
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
    out = torch.zeros_like(q)
    for h in range(heads):
        kh = h // (heads // kv_heads)
        scores = (q[:, h] @ k[:, kh].T) / math.sqrt(d)
        out[:, h] = torch.softmax(scores.masked_fill(~visible, -math.inf), -1) @ v[:, kh]
    return out


def reference_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] (values [T]) of one unpadded row, written out in float64."""
    args, spec = model.args, model.args.spec
    w = {n: t.double() for n, t in model.state_dict().items()}
    d, t = spec.dim_head, ids.shape[0]
    pos = torch.arange(t)

    def rms(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + args.rms_norm_eps)

    def linear(x, name):
        return x @ w[name + ".weight"].T + w.get(name + ".bias", 0)

    x = w["model.embed_tokens.weight"][ids]
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        n = rms(x, w[p + "input_layernorm.weight"])
        q = rope_complex(linear(n, p + "self_attn.q_proj").view(t, -1, d), pos, args.rope_theta)
        k = rope_complex(linear(n, p + "self_attn.k_proj").view(t, -1, d), pos, args.rope_theta)
        v = linear(n, p + "self_attn.v_proj").view(t, -1, d)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        x = x + linear(attention_loop(q, k, v, causal).reshape(t, -1), p + "self_attn.o_proj")
        n = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + linear(F.silu(linear(n, p + "mlp.gate_proj")) * linear(n, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rms(x, w["model.norm.weight"])
    if spec.head == "value":
        return linear(x, "score").squeeze(-1)
    return x @ w["model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight"].T


def test_rope_equals_complex_rotation():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 16, dtype=torch.float64)  # [B, heads, T, d]
    pos = torch.randint(0, 200, (2, 7))
    cos, sin = rope_cos_sin(pos, 16, 10000.0, torch.float64)
    expected = rope_complex(x.transpose(1, 2), pos, 10000.0).transpose(1, 2)
    torch.testing.assert_close(apply_rope(x, cos, sin), expected, atol=5e-5, rtol=0)


def test_gqa_attention_equals_loop_over_heads_with_repeated_kv():
    torch.manual_seed(0)
    model = make_model(num_heads=8, num_kv_heads=2, qkv_bias=True)
    attn: Attention = model.model.layers["0"].self_attn
    x = torch.randn(2, 6, 32)
    pos = torch.arange(6).expand(2, 6)
    d = attn.head_dim  # 32 / 8 = 4
    out = attn(x, rope_cos_sin(pos, d, 500.0, x.dtype), None, None, "0")
    for b in range(2):
        q = rope_complex((x[b].double() @ attn.q_proj.weight.double().T + attn.q_proj.bias.double()).view(6, 8, d), pos[b], 500.0)
        k = rope_complex((x[b].double() @ attn.k_proj.weight.double().T + attn.k_proj.bias.double()).view(6, 2, d), pos[b], 500.0)
        v = (x[b].double() @ attn.v_proj.weight.double().T + attn.v_proj.bias.double()).view(6, 2, d)
        ref = attention_loop(q, k, v, torch.ones(6, 6, dtype=torch.bool).tril()).reshape(6, -1) @ attn.o_proj.weight.double().T
        torch.testing.assert_close(out[b].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [dict(num_layers=1), dict(num_layers=1, qkv_bias=True, tie_embeddings=True), dict(num_layers=1, head="value"), dict(num_kv_heads=1)],
)
def test_forward_equals_float64_reference(overrides):
    model = make_model(**overrides)
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(1))
    out = model(ids)
    for b in range(3):
        torch.testing.assert_close(out[b].double(), reference_forward(model, ids[b]), atol=1e-4, rtol=1e-4)


def test_attention_is_causal():
    model = make_model()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 64
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6], atol=0, rtol=0)
    assert (a[:, 6:] - b[:, 6:]).abs().amax(-1).min() > 1e-3


# ---------------------------------------------------------------- padding and cache


def left_padded(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    return ids, mask


ROWS = [[5, 9, 3, 7, 1, 2, 11], [4, 4, 30, 2], [8]]


@pytest.mark.parametrize("head", ["lm", "value"])
def test_row_alone_equals_row_left_padded_in_a_batch(head):
    model = make_model(head=head)
    ids, mask = left_padded(ROWS, pad=63)
    batched = model(ids, attention_mask=mask)
    for b, row in enumerate(ROWS):
        alone = model(torch.tensor([row]))[0]
        torch.testing.assert_close(batched[b, -len(row) :], alone, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(batched).all()


def test_attention_mask_hides_pad_keys_and_the_future_but_never_a_query_own_slot():
    keys = torch.tensor([[False, True, True, False, True]])  # slot 3: a pad after a stopped token
    mask = attention_mask_4d(keys, start=2, num_queries=3)[0, 0].int().tolist()
    assert mask == [[0, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 1, 1, 0, 1]]


def test_default_position_ids_count_real_tokens_before_each_token():
    # RoPE scores depend only on position differences, so a wrong but row-constant offset
    # would pass the padding tests within tolerance; compare bit for bit with explicit ids.
    model = make_model()
    ids, mask = left_padded(ROWS)
    expected = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 1, 2, 3], [0, 0, 0, 0, 0, 0, 0]])
    torch.testing.assert_close(model(ids, attention_mask=mask), model(ids, attention_mask=mask, position_ids=expected), atol=0, rtol=0)
    cache, explicit = KVCache.for_model(model, 3, 9), KVCache.for_model(model, 3, 9)
    model(ids, attention_mask=mask, kv_cache=cache)
    model(ids, attention_mask=mask, kv_cache=explicit, position_ids=expected)
    step = torch.tensor([[True], [False], [True]])
    torch.testing.assert_close(
        model(ids[:, :1], attention_mask=step, kv_cache=cache),
        model(ids[:, :1], attention_mask=step, kv_cache=explicit, position_ids=torch.tensor([[7], [3], [1]])),
        atol=0, rtol=0,
    )


def test_kv_cache_prefill_then_decode_equals_full_forward():
    model = make_model(qkv_bias=True)
    ids, mask = left_padded(ROWS)
    more = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(3))
    more_mask = torch.tensor([[True] * 5, [True, True, True, False, False], [True] * 5])
    full = model(torch.cat([ids, more], 1), attention_mask=torch.cat([mask, more_mask], 1))

    cache = KVCache.for_model(model, batch_size=3, max_len=ids.shape[1] + 5)
    parts = [model(ids, attention_mask=mask, kv_cache=cache)]
    for lo, hi in [(0, 1), (1, 2), (2, 5)]:  # two single-token steps, then a chunk of three
        parts.append(model(more[:, lo:hi], attention_mask=more_mask[:, lo:hi], kv_cache=cache))
    assert cache.length == ids.shape[1] + 5
    assert cache.seen.tolist() == [12, 7, 6]
    real = torch.cat([mask, more_mask], 1)
    torch.testing.assert_close(torch.cat(parts, 1)[real], full[real], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="KV cache holds 12 slots; 12 used, 1 more"):
        model(more[:, :1], kv_cache=cache)


# ---------------------------------------------------------------- pipeline stages and init


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stages_compose_to_the_full_model(tied):
    full = make_model(num_layers=3, tie_embeddings=tied)
    first, last = make_model(num_layers=3, tie_embeddings=tied), make_model(num_layers=3, tie_embeddings=tied)
    first.model.norm, first.lm_head = None, None
    del first.model.layers["2"]
    for name in ("0", "1"):
        del last.model.layers[name]
    if not tied:
        last.model.embed_tokens = None  # with tied embeddings the last stage keeps a copy
    for stage in (first, last):
        state = stage.state_dict()
        assert set(state) < set(full.state_dict())
        init_weights(stage, seed=7)
    init_weights(full, seed=7)

    ids, mask = left_padded(ROWS)
    hidden = first(ids, attention_mask=mask)
    assert hidden.shape == (3, 7, 32)
    torch.testing.assert_close(last(hidden, attention_mask=mask), full(ids, attention_mask=mask), atol=0, rtol=0)
    if not tied:
        with pytest.raises(ValueError, match="no embed_tokens"):
            last(ids)


def test_init_weights_is_deterministic_per_name():
    a, b, c = make_model(seed=3, std=0.02), make_model(seed=3, std=0.02), make_model(seed=4, std=0.02)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    emb = sa["model.embed_tokens.weight"]
    assert not torch.equal(emb, sc["model.embed_tokens.weight"])
    assert abs(emb.std().item() - 0.02) < 0.002 and abs(emb.mean().item()) < 0.002
    plain = build_model(ModelArgs(spec=DecoderSpec(**TINY, qkv_bias=True))).to_empty(device="cpu")
    init_weights(plain, seed=0)
    state = plain.state_dict()
    assert all((state[n] == 1).all() for n in state if n.endswith("norm.weight"))
    assert all((state[n] == 0).all() for n in state if n.endswith(".bias"))
    assert not torch.equal(state["model.layers.0.mlp.up_proj.weight"], state["model.layers.1.mlp.up_proj.weight"])


# ---------------------------------------------------------------- HF config.json


LLAMA = {  # TinyLlama-1.1B's config.json
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
    "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float32", "attention_bias": False,
    "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
}
QWEN2 = {  # Qwen2.5-0.5B's config.json
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "hidden_act": "silu", "max_position_embeddings": 32768, "max_window_layers": 24, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
}


@pytest.mark.parametrize("config", [LLAMA, QWEN2], ids=["llama", "qwen2"])
def test_hf_config_round_trip(config):
    args = ModelArgs.from_hf_config(config)
    s = args.spec
    assert (s.num_layers, s.num_heads, s.num_kv_heads, s.dim_head) == (
        config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
        config["hidden_size"] // config["num_attention_heads"],
    )
    assert s.qkv_bias == (config["model_type"] == "qwen2") and s.tie_embeddings == config["tie_word_embeddings"]
    assert (s.dtype, args.rope_theta, args.rms_norm_eps) == (config["torch_dtype"], config["rope_theta"], config["rms_norm_eps"])
    out = args.to_hf_config()
    assert {k: out[k] for k in out if k in config} == {k: config[k] for k in out if k in config}
    assert ModelArgs.from_hf_config(out) == args


def test_hf_config_value_head_explicit_head_dim_and_transformers5_rope_keys():
    config = {**LLAMA, "architectures": ["LlamaForTokenClassification"], "head_dim": 128, "id2label": {"0": "LABEL_0"}}
    args = ModelArgs.from_hf_config(config)
    assert args.spec.head == "value" and args.spec.head_dim == 128
    assert ModelArgs.from_hf_config(args.to_hf_config()) == args
    nested = {k: v for k, v in QWEN2.items() if k != "rope_theta"} | {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert ModelArgs.from_hf_config(nested, dtype="float32").rope_theta == 5e5
    assert ModelArgs.from_hf_config(nested, dtype="float32").spec.dtype == "float32"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(model_type="mistral"), "model_type='mistral'"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'rope_scaling'.*'yarn' is not supported"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "lacks 'low_freq_factor'"),
        (dict(hidden_act="gelu"), "'hidden_act'='gelu'"),
        (dict(mlp_bias=True), "'mlp_bias'"),
    ],
)
def test_hf_config_features_the_model_lacks_are_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_hf_config({**LLAMA, **change})


LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def test_llama31_rope_scaling_matches_transformers():
    """Frequencies of Llama-3.1-8B (head_dim 128, theta 5e5): values printed by transformers
    5.23's ROPE_INIT_FUNCTIONS["llama3"] for the same config (low band / 8, high band kept,
    the middle blended)."""
    from nereus.trainer.models.decoder import Llama3RopeScaling

    args = ModelArgs.from_hf_config({**LLAMA, "hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 5e5, "rope_scaling": LLAMA31_ROPE})
    assert args.rope_scaling == Llama3RopeScaling.from_hf(LLAMA31_ROPE)
    assert ModelArgs.from_hf_config(args.to_hf_config()) == args
    base = 1.0 / 5e5 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128)
    scaled = args.rope_scaling.apply(base)
    transformers = {0: 1.0, 20: 0.016560440883040428, 28: 0.0032114461064338684, 34: 0.0001785077911335975,
                    40: 3.428102354519069e-05, 63: 3.068925877869333e-07}
    for i, want in transformers.items():
        assert scaled[i].item() == pytest.approx(want, rel=1e-6), i
    assert int((scaled != base).sum()) == 35
    cos, _ = rope_cos_sin(torch.arange(4)[None], 128, 5e5, torch.float32, args.rope_scaling)
    plain, _ = rope_cos_sin(torch.arange(4)[None], 128, 5e5, torch.float32)
    assert not torch.equal(cos, plain) and torch.equal(cos[..., :20], plain[..., :20])


def test_loading_refuses_forward_settings_that_differ_from_the_checkpoint():
    from nereus.trainer.runtime.checkpoint import check_forward_settings

    config = {**LLAMA, "rope_theta": 5e5, "rope_scaling": LLAMA31_ROPE}
    args = ModelArgs.from_hf_config(config)
    check_forward_settings(args, config, "/models/x")  # the same: fine
    unscaled = dataclasses.replace(args, rope_scaling=None)
    with pytest.raises(ValueError, match=r"model.rope_scaling is None, but /models/x/config.json has Llama3RopeScaling"):
        check_forward_settings(unscaled, config, "/models/x")
    with pytest.raises(ValueError, match="model.rope_theta is 10000.0"):
        check_forward_settings(dataclasses.replace(args, rope_theta=1e4), config, "/models/x")
