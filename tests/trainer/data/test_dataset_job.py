"""`nereus train` on a prompt dataset: verl-format parquet → the model directory's chat
template and tokenizer → generation → a reward-function file → validation.

The dataset and the tiny model come from ``tools/make_dataset.py`` (nothing downloaded):
user "572" → assistant "555", partial credit per position (``tools/repeat_reward.py``).
"""

import json
import os
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from nereus.cli.app import app
from nereus.store.checkpoint import CheckpointStore
from nereus.trainer.config import ConfigError
from nereus.trainer.prepare import load_config
from tests.distributed_harness import run_distributed

ROOT = Path(__file__).resolve().parents[3]
TINY_TEXT = str(ROOT / "configs" / "tiny_text.yaml")
REWARD = f"{ROOT / 'tools' / 'repeat_reward.py'}:compute_score"
sys.path.insert(0, str(ROOT / "tools"))
import make_dataset  # noqa: E402

runner = CliRunner()
# tiny_text on 2 processes (actor.train dp2, actor.gen and ref.infer tp2): still two layouts
TWO_PROCS = ["nproc=2", "plan.actor.train.dp=2", "plan.actor.gen.dp=1", "plan.ref.infer.dp=1"]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, str]:
    return make_dataset.make_dataset(tmp_path_factory.mktemp("tiny_text"), seed=0, train=2048, val=128)


def job(made: dict, run_dir, *extra: str) -> list[str]:
    sets = [f"model.path={made['model']}", f"data.train_files={made['train']}", f"data.val_files={made['val']}",
            f"reward.function={REWARD}", f"run_dir={run_dir}", *extra]
    return [arg for s in sets for arg in ("--set", s)]


def metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def other_source(made: dict, out: Path) -> str:
    """The validation file again under another data_source: validation metrics per source."""
    table = pq.read_table(made["val"]).to_pylist()
    rows = [{**r, "data_source": "nereus/other"} for r in table[:32]]
    path = out / "other.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


# Measured with the shipped config (seed 0, 4 processes): reward 0.066 (step 1) -> 0.966
# (step 40); validation accuracy (greedy, exact answer) 0.0 before step 1, 0.17 at step 20,
# 1.0 at step 40; about 80 s. Chance per row is ~0.06.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_text_learns_and_its_validation_accuracy_rises(made, tmp_path):
    other = other_source(made, tmp_path)
    args = job(made, tmp_path / "run", f"data.val_files=[{made['val']}, {other}]")
    result = runner.invoke(app, ["train", TINY_TEXT, *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(0, 41))
    validated = {r["step"]: r for r in rows if "val/acc" in r}
    assert sorted(validated) == [0, 10, 20, 30, 40]
    assert "reward_mean" not in rows[0]  # the validation before step 1 is its own record
    first = sum(r["reward_mean"] for r in rows[1:6]) / 5
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    assert first < 0.2 and last >= 0.8, (first, last)
    assert validated[0]["val/acc"] <= 0.1 and validated[40]["val/acc"] >= 0.8, {s: v["val/acc"] for s, v in validated.items()}
    for v in validated.values():  # 128 + 32 prompts; the overall figures weigh the sources by their prompts
        assert v["val/prompts"] == 160
        mixed = (128 * v["val/nereus/repeat/acc"] + 32 * v["val/nereus/other/acc"]) / 160
        assert v["val/acc"] == pytest.approx(mixed, abs=1e-6)
    assert rows[-1]["data/position"] == 40 * 64 and rows[-1]["data/epoch"] == 1  # 2,560 prompts of 2,048
    report = runner.invoke(app, ["report", str(tmp_path / "run")])
    assert report.exit_code == 0, report.output
    assert "validation reward / accuracy, step 0 → 40" in (tmp_path / "run" / "report" / "report.md").read_text()


@pytest.mark.timeout(600)
def test_a_resumed_dataset_job_draws_the_prompts_the_uninterrupted_one_draws(made, tmp_path):
    common = [*TWO_PROCS, "steps=4", "checkpoint_every=2", "validation.every=0", "rollout.prompts_per_step=16",
              "grpo.minibatch_size=64"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert runner.invoke(app, ["train", TINY_TEXT, *job(made, whole, *common)], catch_exceptions=False).exit_code == 0
    shutil.copytree(whole, split)  # as a crash after step 3 was logged, before step 4 was committed, leaves it
    assert CheckpointStore(str(split / "checkpoints")).delete(4)
    kept = metrics(split)[:2]  # step 3's line false: what the resumed run writes is what is compared
    (split / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*kept, {**kept[-1], "step": 3, "kl": 9.0}]))
    resumed = runner.invoke(app, ["train", TINY_TEXT, *job(made, split, *common), "--resume"], catch_exceptions=False)
    assert resumed.exit_code == 0, resumed.output
    keys = ("step", "reward_mean", "actor/loss", "kl", "data/position")
    assert [[r[k] for k in keys] for r in metrics(split)] == [[r[k] for k in keys] for r in metrics(whole)]
    assert [r["data/position"] for r in metrics(whole)] == [16, 32, 48, 64]


def _mixed_lengths(rank, world_size, made, run_dir):
    """Greedy generation of prompts of different lengths on two actor.gen replicas, each
    row against the same prompt generated alone: the replicas' rows stack left-padded."""
    from nereus.trainer.rollout.generator import generate
    from nereus.trainer.runtime.step import Trainer
    from nereus.trainer.data.prompts import Prompts

    cfg = load_config(TINY_TEXT, [f"model.path={made['model']}", f"data.train_files={made['train']}",
                                  f"reward.function={REWARD}", f"run_dir={run_dir}", "device=cpu", "validation.every=0",
                                  "data.val_files=[]",
                                  "nproc=2", "plan.actor.train.dp=2", "plan.actor.gen.dp=2", "plan.actor.gen.tp=1",
                                  "plan.ref.infer.dp=2", "plan.ref.infer.tp=1", "data.max_prompt_length=16",
                                  "rollout.max_new_tokens=4"])
    trainer = Trainer(cfg)
    tok = trainer.source.tokenizer
    texts = ["5", "57", "572", "5721", "57213", "572130"]  # replica 0 takes the short ones, replica 1 the long
    ids = [tok.encode_prompt([{"role": "user", "content": t}]) for t in texts]
    rows = trainer._generate(Prompts(ids=ids, rows=None, max_new_tokens=4), temperature=0.0, top_p=1.0, seed=(0, 0))
    p = rows["prompt_width"]
    gen = trainer.stages["actor.gen"].part.module
    out = []
    for i, prompt in enumerate(ids):
        alone = generate(gen, [prompt], max_new_tokens=4, temperature=0.0, stop_tokens=tok.eos_ids, pad_id=tok.pad_id)
        n = int(alone.response_mask.sum())
        got = rows["tokens"][i, p:][rows["response_mask"][i]].tolist()
        want = alone.tokens[0, alone.prompt_width:][: n].tolist()
        prompt_cols = rows["attention_mask"][i, :p]
        out.append((got == want, rows["tokens"][i, p - len(prompt):p].tolist() == prompt,
                    int(prompt_cols.sum()) == len(prompt) and not prompt_cols[: p - len(prompt)].any()))
    trainer.source.close()
    return p, out


@pytest.mark.timeout(300)
def test_replicas_with_prompts_of_different_lengths_stack_left_padded(made, tmp_path):
    for p, rows in run_distributed(_mixed_lengths, 2, made, str(tmp_path), timeout=240):
        assert p == 10  # the longest prompt: <|bos|><|user|> + 6 digits + <|end|><|assistant|>
        assert rows == [(True, True, True)] * 6, rows


def test_a_dataset_jobs_model_shapes_come_from_its_directory(made, tmp_path):
    import yaml

    bare = yaml.safe_load(open(TINY_TEXT))
    bare["model"] = {"path": made["model"]}  # no shapes at all: config.json gives them
    cfg = load_config(bare, [f"run_dir={tmp_path}"])
    with open(os.path.join(made["model"], "config.json")) as f:
        hf = json.load(f)
    m = cfg.model
    assert (m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads, m.num_kv_heads) == (
        hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], hf["num_attention_heads"],
        hf["num_key_value_heads"])
    assert m.max_seq_len == 16 + 4  # data.max_prompt_length + rollout.max_new_tokens
    assert load_config(TINY_TEXT, [f"model.path={made['model']}", "model.hidden_size=64"]).model.hidden_size == 64
    with pytest.raises(ConfigError, match=r"'model.hidden_size' is 128, but .*config.json says 64"):
        load_config(TINY_TEXT, [f"model.path={made['model']}", "model.hidden_size=128"])
    with pytest.raises(ConfigError, match=r"'model.max_seq_len'=100 is longer than the max_position_embeddings=64"):
        load_config(TINY_TEXT, [f"model.path={made['model']}", "model.max_seq_len=100"])


def _bad(made, tmp_path, name):
    """Each bad input and the words its error must hold."""
    verl = made["train"]
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"question": "57"}) + "\n")
    cases = {
        "missing file": ([f"data.train_files={tmp_path / 'nope.parquet'}"], ["nope.parquet"]),
        "unknown format": ([f"data.train_files={made['model']}/model.safetensors"], ["model.safetensors", "parquet"]),
        "missing key": ([f"data.train_files={plain}", "data.prompt_key=question", "data.answer_key=answer"], ["plain.jsonl", "answer"]),
        "prompt too long": (["data.max_prompt_length=5", "rollout.max_new_tokens=4"], [verl, "row", "max_prompt_length"]),
        "no reward file": ([f"reward.function={tmp_path / 'none.py'}:compute_score"], ["none.py"]),
        "no reward function": ([f"reward.function={ROOT / 'tools' / 'repeat_reward.py'}:score"], ["repeat_reward.py", "score"]),
        "unknown data source": (["reward.function=null"], ["nereus/repeat", "reward.function"]),
        "no tokenizer": ([f"tokenizer.path={tmp_path / 'tok'}"], ["tok"]),
        "tokenizer vs embedding": (["model.path=null", f"tokenizer.path={made['model']}", "model.vocab_size=8"], ["16 tokens", "8", "vocab_size"]),
        # a model from scratch whose embedding pads the tokenizer's 16 ids to 64 rows
        "padded vocabulary": (["model.path=null", f"tokenizer.path={made['model']}", "model.vocab_size=64"],
                              ["'model.vocab_size'=64", "16 tokens", made["model"]]),
        "task and data": (["task.name=repeat"], ["both 'task'", "'data'"]),
        "validation without val": (["data.val_files=[]"], ["validation.every", "data.val_files"]),
    }
    return cases[name]


BAD = ["missing file", "unknown format", "missing key", "prompt too long", "no reward file", "no reward function",
       "unknown data source", "no tokenizer", "tokenizer vs embedding", "padded vocabulary", "task and data",
       "validation without val"]


@pytest.mark.parametrize("name", BAD)
def test_bad_dataset_input_is_a_one_line_error_before_any_worker(made, tmp_path, name):
    overrides, words = _bad(made, tmp_path, name)
    result = runner.invoke(app, ["train", TINY_TEXT, *job(made, tmp_path / "run", *overrides)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.output.startswith("error: "), result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    for word in words:
        assert word in result.output, (word, result.output)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped before any worker started


def test_a_checkpoints_own_vocabulary_may_exceed_its_tokenizers(made, tmp_path):
    """Qwen2.5's config.json says 152,064 rows for 151,665 tokens: the checkpoint's real V (the
    rows exist in its weights), never refused; the same excess given for a model trained from
    scratch is padding, one line naming the key and both sizes."""
    from nereus.trainer.data.prompts import check_vocab_sizes

    cfg = load_config(TINY_TEXT, [f"model.path={made['model']}", f"run_dir={tmp_path}"])  # V = 16 from its config.json
    check_vocab_sizes(cfg, 12)  # a tokenizer of 12 ids beside a 16-row checkpoint: its own V
    critic = "critic={hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 2, num_kv_heads: 1}"
    ppo = load_config(TINY_TEXT, [f"model.path={made['model']}", f"run_dir={tmp_path}", "algorithm=ppo", critic,
                                  "plan.critic.train={dp: 4}", "validation.every=0"])
    check_vocab_sizes(ppo, 12)  # a critic from scratch takes the actor's V: it reads the actor's ids
    scratch = load_config(TINY_TEXT, ["model.path=null", f"tokenizer.path={made['model']}", f"run_dir={tmp_path}"])
    check_vocab_sizes(scratch, 16)
    with pytest.raises(ConfigError, match=r"^config key 'model.vocab_size'=16 is larger than the 12 tokens of the tokenizer \("):
        check_vocab_sizes(scratch, 12)


def test_padded_rows_of_a_replica_with_shorter_prompts_line_up():
    from nereus.trainer.rollout.generator import Rollout
    from nereus.trainer.runtime.step import _padded

    out = Rollout(tokens=torch.tensor([[0, 7, 8, 9, 2]]), prompt_mask=torch.tensor([[False, True, True, False, False]]),
                  response_mask=torch.tensor([[False, False, False, True, True]]), logprobs=torch.tensor([[-0.5, -0.25]]),
                  prompt_lengths=torch.tensor([2]), response_lengths=torch.tensor([2]))
    rows = _padded(out, 3, 0, prompt_width=5)  # 3 prompt columns -> 5, 2 response columns -> 3
    assert rows["tokens"].tolist() == [[0, 0, 0, 7, 8, 9, 2, 0]]
    assert rows["attention_mask"].tolist() == [[False, False, False, True, True, True, True, False]]
    assert rows["response_mask"].tolist() == [[True, True, False]]
    assert rows["logprobs"].tolist() == [[-0.5, -0.25, 0.0]]


def _validate(rank, world_size, made, run_dir, val):
    """Trainer.validate on two actor.gen replicas over 3 prompts of two sources in chunks of
    2 (the last chunk has fewer prompts than replicas), against each prompt generated alone."""
    from nereus.trainer.rollout.generator import generate
    from nereus.trainer.runtime.step import Trainer
    from tools.repeat_reward import compute_score

    cfg = load_config(TINY_TEXT, [f"model.path={made['model']}", f"data.train_files={made['train']}", f"data.val_files={val}",
                                  f"reward.function={REWARD}", f"run_dir={run_dir}", "device=cpu", "nproc=2",
                                  "rollout.prompts_per_step=1", "rollout.samples_per_prompt=2", "grpo.minibatch_size=2",
                                  "plan.actor.train.dp=2", "plan.actor.gen.dp=2", "plan.actor.gen.tp=1",
                                  "plan.ref.infer.dp=2", "plan.ref.infer.tp=1"])
    trainer = Trainer(cfg)
    got = trainer.validate()
    source, tok = trainer.source, trainer.source.tokenizer
    gen = trainer.stages["actor.gen"].part.module
    want = {}
    for ids, row in zip(source.val.prompt_ids, source.val.rows):
        alone = generate(gen, [list(ids)], max_new_tokens=4, temperature=0.0, stop_tokens=tok.eos_ids, pad_id=tok.pad_id)
        text = tok.decode(alone.tokens[0, alone.prompt_width:][alone.response_mask[0, alone.prompt_width:]].tolist())
        want.setdefault(row.data_source, []).append(compute_score(row.data_source, text, row.ground_truth))
    source.close()
    return got, want


@pytest.mark.timeout(300)
def test_validation_scores_every_prompt_once_per_source_even_a_chunk_smaller_than_the_replicas(made, tmp_path):
    rows = pq.read_table(made["val"]).to_pylist()[:3]
    rows[2] = {**rows[2], "data_source": "nereus/other"}
    val = tmp_path / "val3.parquet"
    pq.write_table(pa.Table.from_pylist(rows), val)
    for got, want in run_distributed(_validate, 2, made, str(tmp_path / "run"), str(val), timeout=240):
        every = [s for scores in want.values() for s in scores]
        assert got["val/prompts"] == 3 and got["val/reward_errors"] == 0
        assert got["val/reward_mean"] == pytest.approx(sum(every) / 3, abs=1e-6)
        for name, scores in want.items():
            assert got[f"val/{name}/reward_mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-6), name
            assert got[f"val/{name}/acc"] == pytest.approx(sum(s >= 1 for s in scores) / len(scores), abs=1e-6), name


def test_model_directory_rules_the_config_names(made, tmp_path):
    base = [f"model.path={made['model']}", f"run_dir={tmp_path}"]
    assert load_config(TINY_TEXT, [*base, "model.vocab_size=null"]).model.vocab_size == 16  # null: read from there
    critic = "critic={hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 2, num_kv_heads: 1}"
    cfg = load_config(TINY_TEXT, [*base, "algorithm=ppo", critic, "plan.critic.train={dp: 4}", "validation.every=0"])
    assert cfg.critic.vocab_size == cfg.model.vocab_size == 16  # a critic from scratch reads the actor's ids
    with pytest.raises(ConfigError, match=r"'model.max_seq_len'=104 is longer than the max_position_embeddings=64"):
        load_config(TINY_TEXT, [*base, "data.max_prompt_length=100"])  # derived: 100 + 4
    import yaml

    bare = yaml.safe_load(open(TINY_TEXT))
    bare["model"] = {"path": str(tmp_path / "elsewhere"), "vocab_size": 16}
    with pytest.raises(ConfigError, match=r"has no config.json here, so its shapes must be given: model.hidden_size, "):
        load_config(bare)
    rm = f"reward_model={{path: {made['model']}}}"
    with pytest.raises(ConfigError, match=r"'validation.every' is set on a reward-model job without a rule reward"):
        load_config(TINY_TEXT, [*base, rm, "reward.function=null", "plan.reward.infer={dp: 4}"])


def test_a_changed_dataset_refuses_to_resume_at_a_position_that_means_other_prompts(made):
    from nereus.trainer.data.prompts import DatasetSource

    cfg = load_config(TINY_TEXT, [f"model.path={made['model']}", f"data.train_files={made['train']}",
                                  f"data.val_files={made['val']}", f"reward.function={REWARD}"])
    source = DatasetSource(cfg, scorer=False)
    source.prompts(0)
    state = source.state_dict()
    assert state == {"position": 64, "rows": 2048, "seed": 0, "shuffle": True}
    again = DatasetSource(cfg, scorer=False)
    again.load_state_dict(state)
    assert again.prompts(1).ids == source.prompts(1).ids
    with pytest.raises(ConfigError, match=r"the prompt order changed since the checkpoint"):
        again.load_state_dict({**state, "rows": 2000})


def test_dataset_rewards_keep_the_functions_metrics_apart_and_count_failed_calls(made):
    """One process (no process group): the dict's keys as reward/fn/<key>, a failed call under
    on_error: zero counted in reward/errors, acc from the function where it returns one."""
    from nereus.trainer.data.datasets import PromptRow
    from nereus.trainer.data.prompts import DatasetSource, Prompts

    contract = f"{ROOT / 'tests' / 'trainer' / 'data' / 'reward_fns' / 'contract.py'}:compute_score"
    cfg = load_config(TINY_TEXT, [f"model.path={made['model']}", f"data.train_files={made['train']}",
                                  f"data.val_files={made['val']}", f"reward.function={contract}", "reward.on_error=zero"])
    source = DatasetSource(cfg)
    try:
        rows = [PromptRow(index=i, prompt="5", data_source=s, ground_truth="555", extra_info={})
                for i, s in enumerate(["dict", "raise", "float", "dict"])]
        tok = source.tokenizer
        responses = [tok.hf.encode(t, add_special_tokens=False) for t in ("long", "1", "555", "5")]
        scored = source.rewards(0, Prompts(ids=[[2]] * 4, rows=rows, max_new_tokens=4), responses)
    finally:
        source.close()
    assert scored.scores.tolist() == [0.5, 0.0, 1.0, 0.5]
    assert scored.metrics["reward/errors"] == 1.0
    assert scored.metrics["reward/fn/acc"] == 1.0 and "reward/fn/length" not in scored.metrics  # "long" is no digit string
    assert scored.accuracy.tolist() == [1.0, 0.0, 1.0, 1.0]  # the dict's own acc; the float's full score
