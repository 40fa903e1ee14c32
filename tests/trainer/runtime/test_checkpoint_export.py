"""What `nereus train` saves exports to HuggingFace: `nereus convert RUN/checkpoints OUT --to hf --model actor`.

One PPO step of the tiny job on one process, its actor (and critic) started from a tiny HF
Llama that ships a generation config and a tokenizer file; then each model is exported and
compared, every element, with the checkpoint, and the actor is loaded by transformers.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from typer.testing import CliRunner

from nereus.cli.app import app
from nereus.store.checkpoint import CheckpointStore, load_checkpoint
from nereus.store.hf import HFCheckpoint

from tests.store.models import bits, llama_config, write_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY_PPO = os.path.join(ROOT, "configs", "tiny_ppo.yaml")
ONE_PROCESS_PPO = [
    "nproc=1", "plan.actor.train.dp=1", "plan.actor.train.tp=1", "plan.actor.gen.dp=1", "plan.critic.train.dp=1",
    "plan.critic.infer.dp=1", "plan.critic.infer.tp=1", "plan.ref.infer.dp=1", "plan.ref.infer.tp=1",
]
GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 8, "do_sample": True}
TOKENIZER = {"version": "1.0", "model": {"type": "WordLevel", "vocab": {str(i): i for i in range(16)}}}

runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run directory after one step (bf16 compute, float32 masters) from an HF start."""
    tmp = tmp_path_factory.mktemp("export")
    config = llama_config(vocab_size=16, hidden_size=64, intermediate_size=192, num_hidden_layers=2, max_position_embeddings=32)
    write_hf_model(tmp / "lm", config, seed=3)
    (tmp / "lm" / "generation_config.json").write_text(json.dumps(GENERATION))
    (tmp / "lm" / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    sets = [*ONE_PROCESS_PPO, "device=cpu", "steps=1", "model.dtype=bfloat16", f"model.path={tmp / 'lm'}"]
    result = runner.invoke(app, ["train", TINY_PPO, *[a for o in sets for a in ("--set", o)], "--run-dir", str(tmp / "run")],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return tmp


def _checkpoint_tensors(root: str, model: str) -> dict[str, torch.Tensor]:
    """The model's parameters as committed, read whole on one rank."""
    from nereus.reshard.derive import derive_emus
    from nereus.reshard.layout import ParallelConfig
    from nereus.store.hf import spec_from_hf_config

    manifest = CheckpointStore(root).manifest()
    spec = spec_from_hf_config(manifest.state["hf_configs"][model], dtype="float32")
    targets = derive_emus(spec, ParallelConfig.on(), model=model, stage="train")
    _, out = load_checkpoint(root, targets, 0)
    return out[model]


@pytest.mark.timeout(300)
def test_the_trained_actor_exports_to_hf_and_transformers_loads_it_as_saved(trained):
    ckpt = str(trained / "run" / "checkpoints")
    manifest = CheckpointStore(ckpt).manifest()
    assert sorted(manifest.state["hf_configs"]) == ["actor", "critic"]
    assert {a.path for a in manifest.aux} >= {"metadata.json", "hf/actor/generation_config.json", "hf/actor/tokenizer.json"}

    result = cli("convert", ckpt, str(trained / "out"), "--to", "hf", "--model", "actor", "--no-progress")
    assert result.exit_code == 0, result.output
    out = trained / "out"
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "float32"  # the masters' dtype, stated once
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((out / "generation_config.json").read_text()) == GENERATION
    assert json.loads((out / "tokenizer.json").read_text()) == TOKENIZER

    exported = HFCheckpoint.open(str(out))
    saved = _checkpoint_tensors(ckpt, "actor")
    assert sorted(exported.tensors) == sorted(saved)
    for name, t in saved.items():
        got = exported.read(name)
        assert got.dtype == torch.float32 and torch.equal(bits(got), bits(t)), name
    assert not torch.equal(saved["model.layers.0.mlp.down_proj.weight"],
                           HFCheckpoint.open(str(trained / "lm")).read("model.layers.0.mlp.down_proj.weight"))  # it trained

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype="auto")
    assert next(model.parameters()).dtype == torch.float32
    state = model.state_dict()
    for name, t in saved.items():
        assert torch.equal(state[name], t), name


@pytest.mark.timeout(300)
def test_the_critic_exports_with_its_value_head_and_one_model_must_be_named(trained):
    ckpt = str(trained / "run" / "checkpoints")
    result = cli("convert", ckpt, str(trained / "critic"), "--to", "hf", "--model", "critic", "--no-progress")
    assert result.exit_code == 0, result.output
    exported = HFCheckpoint.open(str(trained / "critic"))
    saved = _checkpoint_tensors(ckpt, "critic")
    assert "score.weight" in saved and "lm_head.weight" not in saved
    for name, t in saved.items():
        assert torch.equal(bits(exported.read(name)), bits(t)), name
    config = json.loads((trained / "critic" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForTokenClassification"] and config["dtype"] == "float32"

    for args, needles in (
        ((), ("holds models ['actor', 'critic']", "--model")),
        (("--model", "reward"), ("no model 'reward'", "['actor', 'critic']")),
    ):
        result = cli("convert", ckpt, str(trained / "none"), "--to", "hf", *args, "--no-progress")
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 1 and len(lines) == 1 and "Traceback" not in result.output, result.output
        assert all(n in lines[0] for n in needles), lines[0]
        assert not os.path.exists(trained / "none")
