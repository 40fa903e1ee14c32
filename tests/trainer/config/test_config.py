"""Job config loader: unknown keys with suggestions, types, overrides, plan validation, shipped configs."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch
import yaml

from nereus.reshard.derive import derive_emus
from nereus.trainer.config import ConfigError, JobConfig, StageConfig, config_to_dict, decoder_spec
from nereus.trainer.prepare import load_config, resolve_device

CONFIGS = pathlib.Path(__file__).resolve().parents[3] / "configs"
SHIPPED = sorted(CONFIGS.glob("*.yaml"))
TINY = CONFIGS / "tiny_ppo.yaml"


def tiny(*overrides: str) -> JobConfig:
    return load_config(TINY, list(overrides))


def test_shipped_configs_exist() -> None:
    names = {p.name for p in SHIPPED}
    assert {"tiny_ppo.yaml", "tiny_grpo.yaml", "llama3_8b_ppo.yaml", "qwen2_5_7b_ppo.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_configs_load_validate_and_derive(path: pathlib.Path) -> None:
    cfg = load_config(path)
    assert load_config(config_to_dict(cfg)) == cfg  # the job record round trip
    assert load_config(yaml.safe_load(yaml.safe_dump(config_to_dict(cfg)))) == cfg
    for stage, sc in cfg.plan.stages().items():
        _, model, head = cfg.stage_model(stage)
        emus = derive_emus(
            decoder_spec(model, head=head),
            sc.parallel_config(cfg.nproc),
            model=stage.split(".")[0],
            stage=stage.split(".")[1],
            dp_shard=sc.dp_shard,
            fused=sc.fused,
        )
        ranks = {r for e in emus for r in e.ranks}
        assert ranks == set(sc.ranks if sc.ranks is not None else range(cfg.nproc))


def test_tiny_configs_use_different_layouts() -> None:
    for name in ("tiny_ppo.yaml", "tiny_grpo.yaml"):
        cfg = load_config(CONFIGS / name)
        assert cfg.nproc == 4
        layouts = {(s.dp, s.tp, s.pp, s.dp_shard, s.fused) for s in cfg.plan.stages().values()}
        assert len(layouts) >= 2
        assert cfg.model.vocab_size == 16  # from the task


def test_gpu_model_shapes() -> None:
    llama = load_config(CONFIGS / "llama3_8b_ppo.yaml").model
    assert (llama.vocab_size, llama.hidden_size, llama.intermediate_size, llama.num_layers) == (128256, 4096, 14336, 32)
    assert (llama.num_heads, llama.num_kv_heads, llama.rope_theta, llama.dtype) == (32, 8, 500000.0, "bfloat16")
    assert not llama.tie_embeddings and not llama.qkv_bias
    qwen = load_config(CONFIGS / "qwen2_5_7b_ppo.yaml").model
    assert (qwen.vocab_size, qwen.hidden_size, qwen.intermediate_size, qwen.num_layers) == (152064, 3584, 18944, 28)
    assert (qwen.num_heads, qwen.num_kv_heads, qwen.rope_theta, qwen.qkv_bias) == (28, 4, 1e6, True)


@pytest.mark.parametrize(
    "override,message",
    [
        ("ppo.kl_coeff=0.1", "unknown key 'ppo.kl_coeff' (did you mean 'ppo.kl_coef'?)"),
        ("ppoo.lr=0.1", "unknown key 'ppoo' (did you mean 'ppo'?)"),
        ("plan.actor.gen.tpp=2", "unknown key 'plan.actor.gen.tpp' (did you mean 'plan.actor.gen.tp'?)"),
        ("model.hiden_size=32", "unknown key 'model.hiden_size' (did you mean 'model.hidden_size'?)"),
        ("plan.actr.train.dp=1", "unknown key 'plan.actr' (did you mean 'plan.actor'?)"),
    ],
)
def test_unknown_key_names_the_closest(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        tiny(override)
    assert message in str(e.value)


def test_unknown_key_in_a_dict_source() -> None:
    data = config_to_dict(tiny())
    data["rollout"]["max_new_token"] = 8
    with pytest.raises(ConfigError, match=r"unknown key 'rollout.max_new_token' \(did you mean 'rollout.max_new_tokens'\?\)"):
        load_config(data)
    data = config_to_dict(tiny())
    data["zzzz"] = 1
    with pytest.raises(ConfigError, match="unknown key 'zzzz'; valid keys: seed, algorithm"):
        load_config(data)


@pytest.mark.parametrize(
    "override,message",
    [
        ("ppo.lr=fast", "config key 'ppo.lr' expects float, got str 'fast'"),
        ("ppo.epochs=1.5", "config key 'ppo.epochs' expects int, got float 1.5"),
        ("ppo.epochs=true", "config key 'ppo.epochs' expects int, got bool True"),
        ("ppo.whiten=1", "config key 'ppo.whiten' expects bool, got int 1"),
        ("algorithm=dpo", "config key 'algorithm' must be one of 'ppo', 'grpo'; got 'dpo'"),
        ("plan.actor.gen.ranks=[0, x, 2, 3]", "config key 'plan.actor.gen.ranks[1]' expects int, got str 'x'"),
        ("plan.actor.gen.ranks=3", "config key 'plan.actor.gen.ranks' expects a list of int"),
        ("plan.actor=7", "config key 'plan.actor' expects a section (ActorPlan), got int 7"),
    ],
)
def test_wrong_types_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        tiny(override)
    assert message in str(e.value)


def test_overrides_nested_numeric_bool_and_null() -> None:
    cfg = tiny(
        "ppo.lr=1e-4",
        "ppo.kl_in_reward=false",
        "ppo.epochs=3",
        "ppo.minibatch_size=8",
        "rollout.temperature=0.7",
        "plan.actor.gen.tp=2",
        "plan.actor.gen.dp=2",
        "plan.critic.infer.ranks=[3, 2, 1, 0]",
        "critic={hidden_size: 32, num_heads: 2, num_kv_heads: 2, intermediate_size: 64}",
        "run_dir=/tmp/x",
        "seed=7",
    )
    assert cfg.ppo.lr == 1e-4 and isinstance(cfg.ppo.lr, float)
    assert cfg.ppo.kl_in_reward is False and cfg.ppo.epochs == 3
    assert cfg.rollout.temperature == 0.7
    assert cfg.plan.actor.gen == StageConfig(dp=2, tp=2)
    assert cfg.plan.critic.infer.ranks == (3, 2, 1, 0)
    assert cfg.critic is not None and cfg.critic_model.hidden_size == 32 and cfg.critic.vocab_size == 16
    assert cfg.model.hidden_size == 64  # untouched
    assert (cfg.run_dir, cfg.seed) == ("/tmp/x", 7)
    assert tiny("ppo.lr=5").ppo.lr == 5.0  # int accepted for float
    assert tiny("critic=null").critic is None


def test_yaml_files_read_exponent_floats(tmp_path: pathlib.Path) -> None:
    text = re.sub(r"(?m)^  lr: .*$", "  lr: 3e-4", TINY.read_text())
    path = tmp_path / "job.yaml"
    path.write_text(text)
    assert load_config(path).ppo.lr == 3e-4


def test_override_syntax_errors() -> None:
    with pytest.raises(ConfigError, match="must look like key.sub=value"):
        tiny("ppo.lr")
    with pytest.raises(ConfigError, match="'ppo.lr' is a value, not a section"):
        tiny("ppo.lr.x=1")
    with pytest.raises(ConfigError, match="override 'plan.actor.gen.ranks=\\[0, 1': the value is not valid YAML"):
        tiny("plan.actor.gen.ranks=[0, 1")


def test_plan_must_match_the_world() -> None:
    with pytest.raises(ConfigError, match=r"plan 'actor.train': dp=2 · tp=2 · pp=1 needs 4 ranks, but nproc=8"):
        tiny("nproc=8")
    with pytest.raises(ConfigError, match=r"plan 'critic.train': dp=4 · tp=1 · pp=1 needs 4 ranks, got 3: \(0, 1, 2\)"):
        tiny("plan.critic.train.ranks=[0, 1, 2]")
    with pytest.raises(ConfigError, match=r"plan 'ref.infer': rank 4 is out of range for nproc=4"):
        tiny("plan.ref.infer.ranks=[0, 1, 2, 4]")
    with pytest.raises(ConfigError, match=r"plan 'ref.infer': ranks \(0, 1, 1, 2\) repeat a rank"):
        tiny("plan.ref.infer.ranks=[0, 1, 1, 2]")
    with pytest.raises(ConfigError, match=r"plan 'actor.gen': tp=0 must be >= 1"):
        tiny("plan.actor.gen.tp=0")
    # a subset of ranks is fine
    cfg = tiny("plan.ref.infer={dp: 1, tp: 2, ranks: [2, 3]}")
    assert cfg.plan.ref.infer.parallel_config(4).ranks == (2, 3)


def test_plan_must_fit_the_model() -> None:
    with pytest.raises(ConfigError, match=r"plan 'actor.train' \(tp=8, pp=1\) does not fit 'model': tp=8 does not divide num_heads=4"):
        tiny("nproc=8", "plan.actor.train={tp: 8, ranks: [0, 1, 2, 3, 4, 5, 6, 7]}")
    with pytest.raises(ConfigError, match=r"plan 'critic.train' \(tp=1, pp=4\) does not fit 'model': pp=4 is larger than the number of layers \(2\)"):
        tiny("plan.critic.train={pp: 4}")
    with pytest.raises(ConfigError, match=r"does not fit 'critic': tp=4 does not divide num_heads=2"):
        tiny("critic={num_heads: 2, num_kv_heads: 1}", "plan.critic.infer={tp: 4}")
    # no tp needs to divide the vocabulary (tp=2 of 17 tokens: 9 + 8 rows), but tp may not exceed it
    assert tiny("model.vocab_size=17", "plan.actor.train={dp: 2, tp: 2}").model.vocab_size == 17
    four = [f"plan.{s}.ranks=[0, 1, 2, 3]" for s in ("actor.train", "critic.train", "critic.infer", "ref.infer")]
    with pytest.raises(ConfigError, match=r"^\S+: plan 'actor.gen' \(tp=32, pp=1\) does not fit 'model': tp=32 is larger than vocab_size=16"):
        tiny("nproc=32", "model={hidden_size: 64, intermediate_size: 64, num_heads: 32, num_kv_heads: 32}", "plan.actor.gen={tp: 32}", *four)
    qwen = CONFIGS / "qwen2_5_7b_ppo.yaml"
    with pytest.raises(ConfigError, match=r"plan 'actor.gen' \(tp=8, pp=1\) does not fit 'model': tp=8 does not divide num_heads=28"):
        load_config(qwen, ["plan.actor.gen.tp=8", "plan.actor.gen.dp=8"])


def test_stages_the_algorithm_needs() -> None:
    with pytest.raises(ConfigError, match="grpo has no critic"):
        tiny("algorithm=grpo")
    with pytest.raises(ConfigError, match="plan 'critic.train' is missing"):
        tiny("plan.critic.train=null")
    assert tiny("plan.critic.infer=null").plan.critic.infer is None  # values from critic.train then
    with pytest.raises(ConfigError, match="plan 'ref.infer' is missing"):
        tiny("plan.ref=null")
    assert tiny("plan.ref=null", "ppo.kl_coef=0").plan.ref is None  # no KL, no reference
    with pytest.raises(ConfigError, match="plan 'reward.infer' is set, but there is no reward_model"):
        tiny("plan.reward.infer={dp: 4}")
    with pytest.raises(ConfigError, match="plan 'reward.infer' is missing"):
        tiny("reward_model={}")
    assert tiny("reward_model={}", "plan.reward.infer={dp: 4}").reward_model.vocab_size == 16
    with pytest.raises(ConfigError, match="fused buffers are a rollout layout"):
        tiny("plan.actor.train.fused=true")
    with pytest.raises(ConfigError, match="missing config key 'plan'"):
        load_config({"nproc": 1})


def test_value_ranges_and_sizes() -> None:
    with pytest.raises(ConfigError, match="'ppo.gamma' must be in \\[0, 1\\], got 1.5"):
        tiny("ppo.gamma=1.5")
    with pytest.raises(ConfigError, match=f"'ppo.minibatch_size'=12 must divide the batch of {tiny().batch_size}"):
        tiny("ppo.minibatch_size=12")
    with pytest.raises(ConfigError, match="'actor.train': dp=2 does not divide ppo.minibatch_size=1"):
        tiny("ppo.minibatch_size=1")
    with pytest.raises(ConfigError, match="'rollout.max_new_tokens'=3 is shorter than the 4 tokens"):
        tiny("rollout.max_new_tokens=3")  # the shipped task answers 3 digits + <eos>
    with pytest.raises(ConfigError, match="'model.max_seq_len'=8 is shorter than a prompt"):
        tiny("model.max_seq_len=8")
    with pytest.raises(ConfigError, match="'rollout.samples_per_prompt' must be >= 2 for grpo"):
        load_config(CONFIGS / "tiny_grpo.yaml", ["rollout.samples_per_prompt=1", "grpo.minibatch_size=8"])
    with pytest.raises(ConfigError, match="config section 'model': num_kv_heads=3 must divide num_heads=4"):
        tiny("model.num_kv_heads=3")
    with pytest.raises(ConfigError, match="config section 'task': repeat task: digits=0"):
        tiny("task.digits=0")


def test_errors_name_the_file() -> None:
    with pytest.raises(ConfigError, match=r"tiny_ppo.yaml: unknown key 'ppo.kl_coeff'"):
        tiny("ppo.kl_coeff=1")


def test_config_is_frozen() -> None:
    cfg = tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3  # type: ignore[misc]
    assert cfg.batch_size == cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    assert cfg.critic_model == cfg.model


def test_device_key_resolves_to_cpu_here() -> None:
    assert tiny().device == "auto"  # the shipped configs leave it to the machine
    assert resolve_device(tiny("device=cpu")) == "cpu"
    assert resolve_device(tiny("device=cpu"), local_processes=10**6) == "cpu"
    assert resolve_device(tiny(), local_processes=10**6) == "cpu"  # auto: not a GPU per worker, so CPU
    if not torch.cuda.is_available():
        assert resolve_device(tiny()) == "cpu"
    with pytest.raises(ConfigError, match="config key 'device' must be one of 'auto', 'cpu', 'cuda'; got 'tpu'"):
        tiny("device=tpu")


def test_device_cuda_without_a_gpu_per_worker_names_the_key() -> None:
    cfg = tiny("device=cuda")  # loads anywhere: whether CUDA is there is checked at startup
    with pytest.raises(ConfigError, match="config key 'device' is 'cuda'"):
        resolve_device(cfg, local_processes=10**6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA message")
def test_device_cuda_without_cuda_says_so() -> None:
    with pytest.raises(ConfigError, match=r"config key 'device' is 'cuda', but torch \S+ sees no CUDA device; set device: auto or cpu"):
        resolve_device(tiny("device=cuda"))


def test_vllm_share_of_the_device_counts_while_it_generates() -> None:
    """vLLM sleeps outside generation (no resident bytes) and holds its share while running."""
    from nereus.trainer.controller.memory import GIB, plan_memory

    llama = CONFIGS / "llama3_8b_ppo.yaml"
    cfg = load_config(llama)
    gen = [s for s in plan_memory(cfg)[0] if s.stage == "actor.gen"]
    assert [(s.resident, s.transient) for s in gen] == [(0, int(0.5 * 141 * GIB))]
    with pytest.raises(ConfigError, match=r"on rank 0 at 2048 tokens per row: needs 16\d GiB .* largest model-stage there: actor.gen"):
        load_config(llama, ["rollout.gpu_memory_utilization=0.95"])


def test_value_heads_hold_no_vocabulary_logits() -> None:
    """tiny_ppo's critic.infer and ref.infer share shapes and layout (dp2·tp2); only the LM
    holds fp32 logits and their softmax copy: s·b·V/t·4·2 bytes."""
    from nereus.trainer.controller.memory import plan_memory

    cfg = tiny()
    stages = {s.stage: s for s in plan_memory(cfg)[0]}
    rows = cfg.batch_size // 2  # dp2
    logits = cfg.model.max_seq_len * rows * cfg.model.vocab_size // 2 * 4 * 2
    assert stages["ref.infer"].transient - stages["critic.infer"].transient == logits


def test_micro_batch_size_sets_the_micro_batches_of_a_replica() -> None:
    from nereus.trainer.config import StageConfig

    assert [StageConfig(pp=1).micro_batches(r) for r in (1, 16)] == [1, 1]
    assert [StageConfig(pp=4).micro_batches(r) for r in (6, 8, 2)] == [3, 4, 2]  # largest divisor <= pp
    assert [StageConfig(micro_batch_size=m).micro_batches(16) for m in (1, 4, 8, 16)] == [16, 4, 2, 1]
    assert StageConfig(pp=4, micro_batch_size=16).micro_batches(16) == 1  # exactly what was asked, GPipe then


def test_micro_batch_size_shrinks_the_activation_memory_and_is_checked() -> None:
    from nereus.trainer.controller.memory import plan_memory

    def train_transient(*overrides: str) -> int:
        return next(s.transient for s in plan_memory(tiny(*overrides))[0] if s.stage == "actor.train")

    # 64 rows per replica; activations and logits scale with the micro-batch, the weights' workspace does not
    whole, half, quarter = (train_transient(f"plan.actor.train.micro_batch_size={m}") for m in (64, 32, 16))
    assert whole == train_transient() and quarter < half < whole
    assert whole - half == pytest.approx(2 * (half - quarter), rel=1e-6)
    with pytest.raises(ConfigError, match="plan 'actor.gen': micro_batch_size applies to training and inference stages"):
        tiny("plan.actor.gen.micro_batch_size=4")
    with pytest.raises(ConfigError, match="plan 'ref.infer': micro_batch_size=0 must be >= 1"):
        tiny("plan.ref.infer.micro_batch_size=0")
    with pytest.raises(ConfigError, match=r"plan 'actor.train': micro_batch_size=3 does not divide the 64 rows of a replica \(ppo.minibatch_size=128 over dp=2\)"):
        tiny("plan.actor.train.micro_batch_size=3")
    with pytest.raises(ConfigError, match=r"plan 'ref.infer': micro_batch_size=5 does not divide the 128 rows of a replica \(the rollout batch=256"):
        tiny("plan.ref.infer.micro_batch_size=5")


def test_recompute_and_token_budget_are_checked_before_any_step() -> None:
    cfg = tiny("plan.actor.train.recompute=full", "plan.critic.train.recompute=selective", "plan.ref.infer.micro_batch_tokens=9")
    assert (cfg.plan.actor.train.recompute, cfg.plan.critic.train.recompute, cfg.plan.ref.infer.micro_batch_tokens) == ("full", "selective", 9)
    with pytest.raises(ConfigError, match="'plan.actor.train.recompute' must be one of 'none', 'full', 'selective'; got 'ful'"):
        tiny("plan.actor.train.recompute=ful")
    with pytest.raises(ConfigError, match="plan 'ref.infer': recompute=full applies to training stages only"):
        tiny("plan.ref.infer.recompute=full")
    with pytest.raises(ConfigError, match=r"plan 'actor.train': micro_batch_tokens=8 is smaller than the longest row \(9 tokens"):
        tiny("plan.actor.train.micro_batch_tokens=8")
    with pytest.raises(ConfigError, match="plan 'actor.train': give micro_batch_size .rows. or micro_batch_tokens .packed tokens., not both"):
        tiny("plan.actor.train.micro_batch_tokens=64", "plan.actor.train.micro_batch_size=16")
    with pytest.raises(ConfigError, match="plan 'actor.gen': micro_batch_tokens applies to training and inference stages"):
        tiny("plan.actor.gen.micro_batch_tokens=64")


@pytest.mark.parametrize("key", ["ppo.loss_agg", "grpo.loss_agg"])
def test_an_unknown_loss_aggregation_is_a_one_line_error(key: str) -> None:
    with pytest.raises(ConfigError, match=f"config key '{key}' must be one of 'token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum'; got 'mean'"):
        tiny(f"{key}=mean")


def test_float16_training_without_loss_scaling_is_refused() -> None:
    with pytest.raises(ConfigError, match="config key 'model.dtype' is float16, which trains only with loss scaling"):
        tiny("model.dtype=float16")
