"""The vLLM rollout engine: its layout mapping, reshard into it, wiring and errors (CPU, no
vllm), and a generation run that needs vllm and CUDA (skipped where either is missing).

Expected names and shapes are written out by hand from vLLM's layers (QKVParallelLinear,
MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding padding to 64), not
computed by the code under test; so is the un-fusing of the buffers after a reshard.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from nereus.reshard.derive import DecoderSpec, derive_emus
from nereus.reshard.errors import LayoutError
from nereus.reshard.layout import ParallelConfig, local_buffers
from nereus.reshard.plan import plan_transfers
from nereus.reshard.reference import reference_box, reference_state
from nereus.trainer.config import ConfigError, load_config
from nereus.trainer.generate import generate
from nereus.trainer.model import ModelArgs
from nereus.trainer.stages import _check_engine
from nereus.trainer.vllm_engine import (
    VLLMEngine,
    VLLMUnavailableError,
    check_vllm_plan,
    import_vllm,
    nereus_buffers,
    rollout_from_tokens,
    vllm_emus,
    vllm_hf_config,
    vllm_param_names,
    vocab_rows,
)
from tests.distributed_harness import run_distributed

from .test_config import CONFIGS, tiny
from .test_model import make_model

# Llama-style: GQA (2 KV heads), untied, no biases; vocab 100 -> vLLM pads to 128. head_dim 8.
LLAMA = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
# Qwen2-style: q/k/v biases, tied embeddings, one KV head; vocab 96 -> padded to 128.
QWEN = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=1, qkv_bias=True, tie_embeddings=True)

# Per TP degree, vLLM's parameter shapes on every rank, by hand:
#   embed/lm_head [128 / tp, 32]; qkv [(4/tp + 2 * max(K/tp, 1)) * 8, 32]; o_proj [32, 32/tp];
#   gate_up [2 * I / tp, 32]; down [32, I / tp]; norms [32].
EXPECTED = {
    ("llama", 1): dict(vocab=(128, 32), qkv=(32 + 16 + 16, 32), o=(32, 32), gate_up=(96, 32), down=(32, 48)),
    ("llama", 2): dict(vocab=(64, 32), qkv=(16 + 8 + 8, 32), o=(32, 16), gate_up=(48, 32), down=(32, 24)),
    ("llama", 4): dict(vocab=(32, 32), qkv=(8 + 8 + 8, 32), o=(32, 8), gate_up=(24, 32), down=(32, 12)),
    ("qwen", 1): dict(vocab=(128, 32), qkv=(32 + 8 + 8, 32), o=(32, 32), gate_up=(128, 32), down=(32, 64)),
    ("qwen", 2): dict(vocab=(64, 32), qkv=(16 + 8 + 8, 32), o=(32, 16), gate_up=(64, 32), down=(32, 32)),
    ("qwen", 4): dict(vocab=(32, 32), qkv=(8 + 8 + 8, 32), o=(32, 8), gate_up=(32, 32), down=(32, 16)),
}
# Token ids in the leading rows of each TP rank: [t * 128/tp, (t+1) * 128/tp) cut at the vocab.
VOCAB_ROWS = {
    ("llama", 1): [(0, 100)],
    ("llama", 2): [(0, 64), (64, 100)],
    ("llama", 4): [(0, 32), (32, 64), (64, 96), (96, 100)],
    ("qwen", 1): [(0, 96)],
    ("qwen", 2): [(0, 64), (64, 96)],
    ("qwen", 4): [(0, 32), (32, 64), (64, 96), (96, 96)],  # rank 3: padding only
}
SPECS = {"llama": LLAMA, "qwen": QWEN}


def expected_params(kind: str, tp: int) -> dict[str, tuple[int, ...]]:
    """vLLM parameter name -> shape, for the 2-layer specs above."""
    e = EXPECTED[kind, tp]
    out = {"model.embed_tokens.weight": e["vocab"], "model.norm.weight": (32,)}
    for layer in (0, 1):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = (32,)
        out[p + "post_attention_layernorm.weight"] = (32,)
        out[p + "self_attn.qkv_proj.weight"] = e["qkv"]
        out[p + "self_attn.o_proj.weight"] = e["o"]
        out[p + "mlp.gate_up_proj.weight"] = e["gate_up"]
        out[p + "mlp.down_proj.weight"] = e["down"]
        if kind == "qwen":
            out[p + "self_attn.qkv_proj.bias"] = e["qkv"][:1]
    if kind == "llama":
        out["lm_head.weight"] = e["vocab"]
    return out


# ------------------------------------------------------------------ the mapping (pure)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind", ["llama", "qwen"])
def test_param_names_and_shapes_are_vllms_layout(kind, tp):
    spec = DecoderSpec(**SPECS[kind])
    mapping = vllm_param_names(spec, tp)
    assert {v: shape for v, shape in mapping.values()} == expected_params(kind, tp)
    assert all(name == v for name, (v, _) in mapping.items())  # vLLM keeps the HF module paths
    assert [vocab_rows(spec, tp, t) for t in range(tp)] == VOCAB_ROWS[kind, tp]


@pytest.mark.parametrize("dp, tp", [(1, 1), (1, 2), (1, 4), (2, 2), (4, 1)])
@pytest.mark.parametrize("kind", ["llama", "qwen"])
def test_emus_cover_exactly_the_buffers_of_vllms_parameters(kind, dp, tp):
    """Per rank, the rollout EMUs' buffers are the views ``nereus_buffers`` takes of vLLM's
    parameters: same names and shapes, vocab tensors cut to their real rows."""
    spec = DecoderSpec(**SPECS[kind])
    config = ParallelConfig.on(dp=dp, tp=tp)
    emus = vllm_emus(spec, config)
    fused = derive_emus(spec, config, model="actor", stage="gen", fused=True)
    assert len(emus) == dp
    for emu, plain in zip(emus, fused):
        for i, rank in enumerate(emu.ranks):
            t = i % tp
            params = {name: torch.empty(shape) for name, shape in expected_params(kind, tp).items()}
            views = nereus_buffers(params, spec, tp, t)
            specs = local_buffers(emu.tensors, rank)
            assert {n: tuple(v.shape) for n, v in views.items()} == {n: s.shape for n, s in specs.items()}
            lo, hi = VOCAB_ROWS[kind, tp][t]
            assert ("model.embed_tokens.weight" in views) == (hi > lo)
            # everything but the vocab-parallel tensors is derive's fused layout as it is
            derived = local_buffers(plain.tensors, rank)
            vocab = {"model.embed_tokens.weight", "lm_head.weight"}
            assert {n: s for n, s in specs.items() if n not in vocab} == {n: s for n, s in derived.items() if n not in vocab}


def test_an_unpadded_vocabulary_is_derives_fused_layout_unchanged():
    spec = DecoderSpec(**{**LLAMA, "vocab_size": 128})
    config = ParallelConfig.on(dp=2, tp=2)
    assert [e.tensors for e in vllm_emus(spec, config)] == [
        e.tensors for e in derive_emus(spec, config, model="actor", stage="gen", fused=True)
    ]


def test_views_write_into_vllms_parameters():
    spec = DecoderSpec(**LLAMA)
    params = {name: torch.zeros(shape) for name, shape in expected_params("llama", 4).items()}
    views = nereus_buffers({k: torch.nn.Parameter(v, requires_grad=False) for k, v in params.items()}, spec, 4, 3)
    views["model.embed_tokens.weight"].fill_(1.0)  # rank 3 holds token ids 96..99: 4 rows
    views["model.layers.1.self_attn.qkv_proj.weight"].fill_(2.0)
    assert params["model.embed_tokens.weight"][:4].eq(1).all() and params["model.embed_tokens.weight"][4:].eq(0).all()
    assert params["model.layers.1.self_attn.qkv_proj.weight"].eq(2).all()
    assert all(v.is_contiguous() for v in views.values())


def test_a_vllm_model_of_another_layout_is_rejected():
    spec = DecoderSpec(**LLAMA)
    params = {name: torch.empty(shape) for name, shape in expected_params("llama", 2).items()}
    unfused = {**params, "model.layers.0.self_attn.q_proj.weight": torch.empty(16, 32)}
    del unfused["model.layers.0.self_attn.qkv_proj.weight"]
    with pytest.raises(LayoutError, match=r"missing \['model.layers.0.self_attn.qkv_proj.weight'\], unexpected \['model.layers.0.self_attn.q_proj.weight'\]"):
        nereus_buffers(unfused, spec, 2, 0)
    with pytest.raises(LayoutError, match=r"'model.norm.weight' is \[33\] torch.float32, Nereus expects \[32\]"):
        nereus_buffers({**params, "model.norm.weight": torch.empty(33)}, spec, 2, 0)
    with pytest.raises(LayoutError, match="torch.bfloat16"):
        nereus_buffers({**params, "model.norm.weight": torch.empty(32, dtype=torch.bfloat16)}, spec, 2, 0)


def test_layouts_vllm_cannot_hold_are_rejected():
    odd = DecoderSpec(vocab_size=96, hidden_size=48, intermediate_size=48, num_layers=1, num_heads=6, num_kv_heads=3)
    with pytest.raises(LayoutError, match="vLLM pads vocab_size=96 to 128 .* which tp=3 does not divide"):
        vllm_param_names(odd, 3)
    with pytest.raises(LayoutError, match="value head"):
        vllm_param_names(DecoderSpec(**LLAMA, head="value"), 1)
    spec = DecoderSpec(**LLAMA)
    with pytest.raises(LayoutError, match="pp=1"):
        vllm_emus(spec, ParallelConfig.on(tp=2, pp=2))
    with pytest.raises(LayoutError, match="every rank in order"):
        check_vllm_plan(spec, ParallelConfig(dp=2, tp=2, ranks=(0, 1, 3, 2)), 4)
    with pytest.raises(LayoutError, match="every rank in order"):
        check_vllm_plan(spec, ParallelConfig.on(tp=2), 4)  # vLLM's world is the whole world
    check_vllm_plan(spec, ParallelConfig.on(dp=2, tp=2), 4)


def test_hf_config_vllm_builds_is_qwen2_with_biases_and_llama_without():
    qwen = vllm_hf_config(ModelArgs(spec=DecoderSpec(**QWEN), rope_theta=1e6, max_seq_len=64))
    assert (qwen["architectures"], qwen["model_type"], qwen["tie_word_embeddings"]) == (["Qwen2ForCausalLM"], "qwen2", True)
    assert (qwen["rope_theta"], qwen["max_position_embeddings"], qwen["num_key_value_heads"]) == (1e6, 64, 1)
    llama = vllm_hf_config(ModelArgs(spec=DecoderSpec(**LLAMA)))
    assert (llama["architectures"], llama["model_type"], llama["attention_bias"]) == (["LlamaForCausalLM"], "llama", False)
    assert llama["vocab_size"] == 100  # vLLM pads it itself


# ------------------------------------------------------------------ reshard into vLLM's buffers


def unfused_mismatches(params: dict, spec: DecoderSpec, tp: int, t: int) -> list[str]:
    """What differs between vLLM-shaped parameters of TP rank t and the full reference
    weights, un-fusing by hand per vLLM's layout; vocab padding must still be NaN."""
    full = lambda name, *shape: reference_box(name, shape, spec.dtype, (0,) * len(shape), shape)  # noqa: E731
    h, d, inter, v = spec.hidden_size, spec.dim_head, spec.intermediate_size, spec.vocab_size
    heads, kv_heads = spec.num_heads, spec.num_kv_heads
    q = heads * d // tp
    if kv_heads >= tp:
        kv, kv_lo = kv_heads * d // tp, t * kv_heads * d // tp
    else:
        kv, kv_lo = d, (t // (tp // kv_heads)) * d  # KV head t // (tp / K), replicated
    i = inter // tp
    per = -(-v // 64) * 64 // tp
    lo, hi = min(t * per, v), min((t + 1) * per, v)
    bad = []

    def check(label, got, want):
        if got.shape != want.shape or not torch.equal(got, want):
            bad.append(label)

    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name == "lm_head.weight" and spec.tie_embeddings:
            continue
        check(name, params[name][: hi - lo], full(name, v, h)[lo:hi])
        if not params[name][hi - lo :].isnan().all():
            bad.append(f"{name}: padding rows written")
    check("model.norm.weight", params["model.norm.weight"], full("model.norm.weight", h))
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            check(p + norm, params[p + norm + ".weight"], full(p + norm + ".weight", h))
        kinds = ("weight", "bias") if spec.qkv_bias else ("weight",)
        for kind in kinds:
            qkv = params[p + "self_attn.qkv_proj." + kind]
            trail = (h,) if kind == "weight" else ()
            check(f"{p}q {kind}", qkv[:q], full(p + "self_attn.q_proj." + kind, heads * d, *trail)[t * q : (t + 1) * q])
            check(f"{p}k {kind}", qkv[q : q + kv], full(p + "self_attn.k_proj." + kind, kv_heads * d, *trail)[kv_lo : kv_lo + kv])
            check(f"{p}v {kind}", qkv[q + kv :], full(p + "self_attn.v_proj." + kind, kv_heads * d, *trail)[kv_lo : kv_lo + kv])
        check(p + "o_proj", params[p + "self_attn.o_proj.weight"], full(p + "self_attn.o_proj.weight", h, heads * d)[:, t * q : (t + 1) * q])
        gate_up = params[p + "mlp.gate_up_proj.weight"]
        check(p + "gate", gate_up[:i], full(p + "mlp.gate_proj.weight", inter, h)[t * i : (t + 1) * i])
        check(p + "up", gate_up[i:], full(p + "mlp.up_proj.weight", inter, h)[t * i : (t + 1) * i])
        check(p + "down_proj", params[p + "mlp.down_proj.weight"], full(p + "mlp.down_proj.weight", h, inter)[:, t * i : (t + 1) * i])
    return bad


def _reshard_into_vllm(rank: int, world: int, cases: list) -> list[str]:
    """Each case: the training layout dp=2·tp=2 streamed into vLLM-shaped parameters (NaN
    filled) through ``nereus_buffers``; returns what differs after un-fusing."""
    from nereus.reshard.arrays import arrays_from_plan
    from nereus.reshard.execute import execute
    from nereus.reshard.graph import plan_graph

    failures = []
    for label, spec_kw, dst in cases:
        spec = DecoderSpec(**spec_kw)
        src = derive_emus(spec, ParallelConfig.on(dp=2, tp=2), model="actor", stage="train")
        config = ParallelConfig.on(**dst)
        plan = plan_transfers(src, vllm_emus(spec, config))
        graph = plan_graph(arrays_from_plan(plan))
        sources = reference_state([t for e in src for t in e.tensors], rank)
        dtype = getattr(torch, spec.dtype)
        params = {v: torch.full(shape, float("nan"), dtype=dtype) for v, shape in vllm_param_names(spec, config.tp).values()}
        t = config.ranks.index(rank) % config.tp
        execute(plan, graph, sources, rank=rank, dst_buffers=nereus_buffers(params, spec, config.tp, t))
        failures += [f"{label}, rank {rank}: {m}" for m in unfused_mismatches(params, spec, config.tp, t)]
    return failures


def test_reshard_from_a_training_layout_fills_vllms_parameters_exactly():
    cases = [
        ("llama tp4 (KV heads replicated, rank 3 holds 4 vocab rows)", LLAMA, dict(tp=4)),
        ("llama dp2 tp2", LLAMA, dict(dp=2, tp=2)),
        ("llama dp4 tp1", LLAMA, dict(dp=4)),
        ("qwen bf16 tp4 (one KV head, rank 3 padding only)", {**QWEN, "dtype": "bfloat16"}, dict(tp=4)),
        ("qwen bf16 dp2 tp2", {**QWEN, "dtype": "bfloat16"}, dict(dp=2, tp=2)),
    ]
    results = run_distributed(_reshard_into_vllm, 4, cases, timeout=180.0)
    assert [m for r in results for m in r] == []


# ------------------------------------------------------------------ rollouts


def test_rollouts_have_the_builtin_generators_layout():
    """Rebuilt from its per-row responses and log-probs, a built-in rollout is unchanged."""
    torch.manual_seed(0)
    model = make_model(std=0.5, num_layers=2)
    prompts = [[5, 9, 3, 7, 1, 2, 11], [4, 4], [8, 1, 6, 2], [17]]
    free = generate(model, prompts, pad_id=0, max_new_tokens=3, temperature=0)
    stop = int(free.tokens[1, -1])  # row 1 stops at its third step, others run on
    ref = generate(model, prompts, pad_id=0, max_new_tokens=6, stop_tokens=(stop,), generator=torch.Generator().manual_seed(1))
    p = ref.prompt_width
    lengths = ref.response_lengths.tolist()
    responses = [ref.tokens[b, p : p + n].tolist() for b, n in enumerate(lengths)]
    logprobs = [ref.logprobs[b, :n].tolist() for b, n in enumerate(lengths)]
    got = rollout_from_tokens(prompts, responses, logprobs, pad_id=0)
    for field in ("tokens", "prompt_mask", "response_mask", "prompt_lengths", "response_lengths"):
        assert torch.equal(getattr(got, field), getattr(ref, field)), field
    torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=0, atol=0)
    assert got.prompt_width == p and torch.equal(got.attention_mask, ref.attention_mask)


def test_rollout_rows_need_one_logprob_per_token():
    with pytest.raises(ValueError, match="row 0: 2 tokens but 1 log-probs"):
        rollout_from_tokens([[1]], [[2, 3]], [[-0.5]], pad_id=0)


# ------------------------------------------------------------------ wiring and errors


def test_config_engine_vllm_needs_a_fused_actor_gen_over_the_world():
    cfg = tiny("rollout.engine=vllm", "plan.actor.gen.fused=true")
    assert (cfg.rollout.engine, cfg.plan.actor.gen.fused, cfg.rollout.gpu_memory_utilization) == ("vllm", True, 0.5)
    assert tiny().rollout.engine == "builtin"
    with pytest.raises(ConfigError, match="rollout.engine: vllm writes into vLLM's fused .* set plan 'actor.gen' fused: true"):
        tiny("rollout.engine=vllm")
    with pytest.raises(ConfigError, match="plan 'actor.gen': fused \\(vLLM\\) buffers need rollout.engine: vllm"):
        tiny("plan.actor.gen.fused=true")
    with pytest.raises(ConfigError, match="every rank in order"):
        tiny("rollout.engine=vllm", "plan.actor.gen={dp: 4, fused: true, ranks: [1, 0, 2, 3]}")
    with pytest.raises(ConfigError, match="the vllm engine runs actor.gen with pp=1"):
        tiny("rollout.engine=vllm", "plan.actor.gen={dp: 2, pp: 2, fused: true}")
    with pytest.raises(ConfigError, match="the built-in generator runs pp=1 only"):
        tiny("plan.actor.gen={dp: 2, pp: 2}")
    with pytest.raises(ConfigError, match="'rollout.engine' must be one of 'builtin', 'vllm'; got 'sglang'"):
        tiny("rollout.engine=sglang")
    with pytest.raises(ConfigError, match="'rollout.gpu_memory_utilization' must be in \\(0, 1\\]"):
        tiny("rollout.gpu_memory_utilization=1.5")


def test_shipped_gpu_configs_generate_with_vllm():
    for name in ("llama3_8b_ppo.yaml", "qwen2_5_7b_ppo.yaml"):
        cfg = load_config(CONFIGS / name)
        assert cfg.rollout.engine == "vllm" and cfg.plan.actor.gen.fused


def test_stage_builder_checks_the_engine_too():
    from nereus.trainer.config import StageConfig

    _check_engine("actor.gen", StageConfig(dp=2, fused=True), "vllm")
    _check_engine("actor.gen", StageConfig(dp=2), "builtin")
    with pytest.raises(ValueError, match="need rollout.engine: vllm"):
        _check_engine("actor.gen", StageConfig(fused=True), "builtin")
    with pytest.raises(ValueError, match="set fused: true"):
        _check_engine("actor.gen", StageConfig(), "vllm")


def test_missing_vllm_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(VLLMUnavailableError, match=r"the vllm engine needs `pip install nereus\[vllm\]`") as e:
        import_vllm()
    assert isinstance(e.value, ImportError)
    with pytest.raises(ImportError, match=r"pip install nereus\[vllm\]"):
        VLLMEngine(ModelArgs(spec=DecoderSpec(**LLAMA)), ParallelConfig.on(tp=1))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.9.2"))
    with pytest.raises(VLLMUnavailableError, match="found vllm 0.9.2"):
        import_vllm()


# ------------------------------------------------------------------ with vllm and a GPU


@pytest.mark.gpu
def test_vllm_engine_generates_from_the_weights_reshard_writes(monkeypatch):
    """One rank, tp=1: the Nereus model's weights stream into vLLM; greedy tokens match the
    built-in generator's and sampled tokens' log-probs match a teacher-forced forward."""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import torch.distributed as dist

    from nereus.reshard.arrays import arrays_from_plan
    from nereus.reshard.execute import execute
    from nereus.reshard.graph import plan_graph
    from nereus.trainer.model import build_model, init_weights
    from tests.distributed_harness import free_port

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        spec = DecoderSpec(**{**LLAMA, "hidden_size": 64, "intermediate_size": 128, "dtype": "bfloat16"})
        args = ModelArgs(spec=spec, max_seq_len=64)
        model = build_model(args, "cuda")
        init_weights(model, seed=0, std=0.3)
        config = ParallelConfig.on(tp=1)
        engine = VLLMEngine(args, config, seed=0, gpu_memory_utilization=0.3)
        plan = plan_transfers(derive_emus(spec, config, model="actor", stage="train"), vllm_emus(spec, config))
        graph = plan_graph(arrays_from_plan(plan))

        def sync():
            src = {n: p.detach() for n, p in model.named_parameters()}
            execute(plan, graph, src, rank=0, dst_buffers=engine.param_buffers())

        prompts = [[5, 9, 3], [4, 4, 7, 1], [8]]
        sync()
        greedy = engine.generate(prompts, max_new_tokens=6, temperature=0, pad_id=0)
        with torch.no_grad():
            ref = generate(model, prompts, max_new_tokens=6, temperature=0, pad_id=0)
        assert torch.equal(greedy.tokens[:, greedy.prompt_width], ref.tokens[:, ref.prompt_width].cpu())
        with pytest.raises(RuntimeError, match="discarded its weights"):
            engine.generate(prompts, max_new_tokens=6, pad_id=0)  # level-2 sleep: sync first
        sync()
        sampled = engine.generate(prompts, max_new_tokens=6, temperature=0.7, pad_id=0, seed=3)
        with torch.no_grad():
            logits = model(sampled.tokens.cuda(), attention_mask=sampled.attention_mask.cuda()).float()
        p = sampled.prompt_width
        teacher = torch.log_softmax(logits[:, p - 1 : -1] / 0.7, -1).gather(-1, sampled.tokens[:, p:, None].cuda())[..., 0].cpu()
        mask = sampled.response_mask[:, p:]
        torch.testing.assert_close(sampled.logprobs[mask], teacher[mask], atol=0.1, rtol=0)
        sync()
        again = engine.generate(prompts, max_new_tokens=6, temperature=0.7, pad_id=0, seed=3)
        assert torch.equal(again.tokens, sampled.tokens)
    finally:
        dist.destroy_process_group()
