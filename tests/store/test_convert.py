"""`nereus convert` / `nereus inspect`: HF <-> Nereus layouts, bit-exact, and every bad input of the issue."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from nereus.cli.app import app
from nereus.reshard.derive import derive_emus
from nereus.reshard.layout import ParallelConfig, box_view
from nereus.reshard.plan import merge_layouts
from nereus.store.checkpoint import CheckpointStore, load_checkpoint
from nereus.store.convert import convert, parse_target
from nereus.store.errors import StoreError
from nereus.store.hf import HFCheckpoint, spec_from_hf_config
from nereus.store.records import checkpoint_key

from .models import bits, llama_config, odd_vocabulary_llama, qwen2_config, write_hf_model

runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


def read_hf(path) -> dict[str, torch.Tensor]:
    ckpt = HFCheckpoint.open(str(path))
    return {name: ckpt.read(name) for name in ckpt.tensors}


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(bits(got[name]), bits(want[name])), name


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_hf_to_tp2pp2_to_tp4_to_hf_is_bit_exact(tmp_path, family, dtype):
    config = (llama_config if family == "llama" else qwen2_config)(dtype)
    weights = write_hf_model(tmp_path / "hf", config, shards=2 if family == "llama" else 1)
    assert cli("convert", str(tmp_path / "hf"), str(tmp_path / "n22"), "--to", "tp=2,pp=2", "--no-progress").exit_code == 0
    result = cli("convert", str(tmp_path / "n22"), str(tmp_path / "n4"), "--to", "tp=4", "--no-progress")
    assert result.exit_code == 0, result.output
    assert "tensors" in result.output and "GB/s" in result.output
    assert cli("convert", str(tmp_path / "n4"), str(tmp_path / "out"), "--to", "hf", "--no-progress").exit_code == 0
    assert_same(read_hf(tmp_path / "out"), weights)
    carried = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: carried[k] for k in config} == config


def _hf_logits(path) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert model.config.vocab_size == 21
    ids = torch.arange(21).repeat(2, 1)  # every token id, and a second row shifted
    ids[1] = ids[1].roll(5)
    with torch.no_grad():
        return model(ids).logits


def test_an_odd_vocabulary_converts_hf_tp2_tp3_hf_with_the_same_logits(tmp_path):
    """The vocabulary is a property of the layout, never of the checkpoint: HF (V = 21) ->
    tp=2 -> tp=3 -> HF, and tp=3 -> tp=6 -> HF, give transformers the same logits, every
    element; each checkpoint holds exactly V rows (no padding), the tp=3 one loads at tp=1,
    and the exports say vocab_size = 21."""
    from nereus.store.checkpoint import CheckpointStore

    odd_vocabulary_llama(tmp_path / "hf")
    want = _hf_logits(tmp_path / "hf")
    for src, dst, to in (("hf", "n2", "tp=2"), ("n2", "n3", "tp=3"), ("n3", "out", "hf"), ("n3", "n6", "tp=6"), ("n6", "out6", "hf")):
        result = cli("convert", str(tmp_path / src), str(tmp_path / dst), "--to", to, "--no-progress")
        assert result.exit_code == 0, (src, to, result.output)
    for ckpt, tp, rows in (("n2", 2, [11, 10]), ("n3", 3, [7, 7, 7]), ("n6", 6, [4, 4, 4, 4, 4, 1])):
        (emu,) = CheckpointStore(str(tmp_path / ckpt)).manifest().emus
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            layout = emu.tensor(name)
            assert emu.config.tp == tp and layout.shape == (21, 48), (ckpt, name)
            assert [s.lengths[0] for s in sorted(layout.shards, key=lambda s: s.rank)] == rows, (ckpt, name)
    weights = read_hf(tmp_path / "hf")
    spec = spec_from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    (whole,) = derive_emus(spec, ParallelConfig.on(), model="actor", stage="train")
    _, out = load_checkpoint(str(tmp_path / "n3"), [whole], 0)  # tp=3 saved, tp=1 loaded: every tensor whole
    assert_same({k: v for k, v in out["actor"].items()}, weights)
    for exported in ("out", "out6"):
        assert json.loads((tmp_path / exported / "config.json").read_text())["vocab_size"] == 21
        assert_same(read_hf(tmp_path / exported), weights)
        got = _hf_logits(tmp_path / exported)
        assert got.shape == (2, 21, 21) and torch.equal(got, want), exported  # every element, bit for bit


def test_converted_checkpoint_holds_the_right_boxes(tmp_path):
    """Not just a round trip: each rank of tp=2,pp=2 loads exactly its slice of the HF tensors."""
    config = llama_config("bfloat16")
    weights = write_hf_model(tmp_path / "hf", config)
    convert(str(tmp_path / "hf"), str(tmp_path / "n"), to="tp=2,pp=2")
    emus = derive_emus(spec_from_hf_config(config), ParallelConfig.on(tp=2, pp=2), model="actor", stage="train")
    layouts = merge_layouts(emus, "t")
    for rank in range(4):
        _, out = load_checkpoint(str(tmp_path / "n"), emus, rank)
        for name, layout in layouts.items():
            for s in layout.shards:
                if s.rank == rank:
                    assert torch.equal(bits(out["actor"][name]), bits(box_view(weights[name], s.offsets, s.lengths)))


def test_dtype_cast_and_sharded_hf_output(tmp_path):
    weights = write_hf_model(tmp_path / "hf", qwen2_config("bfloat16"))
    convert(str(tmp_path / "hf"), str(tmp_path / "n"), to="dp=2,tp=2", dtype="fp32")
    convert(str(tmp_path / "n"), str(tmp_path / "out"), to="hf", dtype="fp16", max_shard_bytes=40_000)
    assert os.path.exists(tmp_path / "out" / "model.safetensors.index.json")
    assert_same(read_hf(tmp_path / "out"), {k: v.float().half() for k, v in weights.items()})
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "float16"


def test_inspect_table_and_json(tmp_path):
    write_hf_model(tmp_path / "hf", llama_config())
    convert(str(tmp_path / "hf"), str(tmp_path / "n"), to="tp=2,pp=2")
    table = cli("inspect", str(tmp_path / "n"))
    assert table.exit_code == 0
    assert "dp=1,tp=2,pp=2" in table.output and "model.layers.3.mlp.down_proj.weight" in table.output
    assert "r1[:,32:64]" in table.output  # row-parallel: tp rank 1 holds the second half of dim 1
    assert "checksums: crc32c per 4.0 MiB block; other files: metadata.json" in table.output
    record = json.loads(cli("inspect", str(tmp_path / "n"), "--json").output)
    assert record["steps"] == [0] and record["manifest"]["schema"] == 1
    assert record["manifest"]["emus"][0]["config"]["tp"] == 2


def test_parse_target():
    assert parse_target("tp=2,pp=2") == parse_target(" pp=2, tp=2 ")
    assert parse_target("dp=3").tp == 1 and parse_target("HF").hf
    for bad in ("tp2", "xp=2", "tp=0", "tp=a", ""):
        with pytest.raises(StoreError):
            parse_target(bad)


# ------------------------------------------------------------------------------ bad input


def no_checkpoint_at(path, existed: bool = False) -> bool:
    """Nothing committed: a destination that did not exist still does not (no empty meta/
    or data/ left behind); an existing one holds no HF directory and no manifest or data."""
    if not os.path.exists(path):
        return True
    if not existed:
        return False
    if os.path.exists(os.path.join(path, "config.json")):
        return False
    data = os.path.join(path, "data")
    return CheckpointStore(str(path)).steps() == [] and (not os.path.isdir(data) or os.listdir(data) == [])


def fails(args, *needles, dst, held=False):
    """A one-line error naming ``needles``; nothing committed at ``dst`` (``held``: it held
    something before, which the caller checks is unchanged)."""
    existed = os.path.exists(dst)
    result = cli(*args, "--no-progress")
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert held or no_checkpoint_at(dst, existed)
    return lines[0]


@pytest.fixture
def nereus_ckpt(tmp_path):
    write_hf_model(tmp_path / "hf", llama_config())
    convert(str(tmp_path / "hf"), str(tmp_path / "n"), to="tp=2,pp=2")
    store = CheckpointStore(str(tmp_path / "n"))
    return tmp_path / "n", store.manifest()


def test_truncated_hf_shard(tmp_path):
    write_hf_model(tmp_path / "hf", llama_config(), shards=2)
    path = tmp_path / "hf" / "model-00002-of-00002.safetensors"
    os.truncate(path, os.path.getsize(path) - 100)
    fails(["convert", str(tmp_path / "hf"), str(tmp_path / "n"), "--to", "tp=2"],
          "model-00002-of-00002.safetensors", "truncated", dst=tmp_path / "n")


@pytest.mark.parametrize("damage", ["truncate", "flip", "two signs", "delete"])
def test_damaged_nereus_shard(tmp_path, nereus_ckpt, damage):
    root, manifest = nereus_ckpt
    entry = next(f for f in manifest.files[len(manifest.files) // 2:] if f.nbytes >= 8 and f.dtype == "float32")
    path = root / manifest.data / entry.path
    if damage == "truncate":
        os.truncate(path, entry.nbytes - 8)
    elif damage in ("flip", "two signs"):
        raw = bytearray(path.read_bytes())
        if damage == "flip":
            raw[-1] ^= 0x01
        else:  # two sign bits (-w <-> w): exported as the opposite weights if unseen
            raw[3] ^= 0x80
            raw[7] ^= 0x80
        path.write_bytes(bytes(raw))
    else:
        os.unlink(path)
    word = {"truncate": "truncated", "flip": "corrupted", "two signs": "corrupted", "delete": "is missing"}[damage]
    for to, dst in (("hf", tmp_path / "out"), ("tp=4", tmp_path / "n4")):
        fails(["convert", str(root), str(dst), "--to", to], entry.path, entry.tensor, word, dst=dst)


def test_unknown_manifest_schema(tmp_path, nereus_ckpt):
    root, _ = nereus_ckpt
    store = CheckpointStore(str(root))
    record = store.meta.get(checkpoint_key(0)).value
    store.meta.put(checkpoint_key(0), {**record, "schema": 7})
    fails(["convert", str(root), str(tmp_path / "out"), "--to", "hf"], "schema version 7", dst=tmp_path / "out")
    assert cli("inspect", str(root)).exit_code == 1


def test_hf_index_to_missing_file(tmp_path):
    write_hf_model(tmp_path / "hf", llama_config(), shards=3)
    os.unlink(tmp_path / "hf" / "model-00003-of-00003.safetensors")
    fails(["convert", str(tmp_path / "hf"), str(tmp_path / "n"), "--to", "tp=2"],
          "model.safetensors.index.json", "model-00003-of-00003.safetensors", "does not exist", dst=tmp_path / "n")


def test_hf_tensor_with_wrong_shape(tmp_path):
    weights = write_hf_model(tmp_path / "hf", qwen2_config())
    weights["model.layers.2.self_attn.k_proj.bias"] = torch.zeros(17)
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
    fails(["convert", str(tmp_path / "hf"), str(tmp_path / "out"), "--to", "hf"],
          "model.layers.2.self_attn.k_proj.bias", "[17]", "model.safetensors", dst=tmp_path / "out")


@pytest.mark.parametrize("to, needle, vocab", [
    ("tp=3", "tp=3 does not divide num_heads=4", 64),
    ("pp=5", "pp=5 is larger than the number of layers", 64),
    ("tp=4", "tp=4 is larger than vocab_size=3", 3),  # any tp up to V fits the vocabulary; more does not
])
def test_layout_that_does_not_fit(tmp_path, to, needle, vocab):
    write_hf_model(tmp_path / "hf", llama_config(vocab_size=vocab))
    fails(["convert", str(tmp_path / "hf"), str(tmp_path / "n"), "--to", to], needle, dst=tmp_path / "n")


def _tree(path) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, path)] = open(p, "rb").read()
    return out


def test_destination_with_a_checkpoint_needs_overwrite(tmp_path, nereus_ckpt):
    root, manifest = nereus_ckpt
    before = _tree(root / "data")
    line = fails(["convert", str(tmp_path / "hf"), str(root), "--to", "tp=4"], "--overwrite", "already holds", dst=root, held=True)
    assert str(root) in line and CheckpointStore(str(root)).manifest() == manifest and _tree(root / "data") == before
    hf_before = _tree(tmp_path / "hf")
    fails(["convert", str(root), str(tmp_path / "hf"), "--to", "hf"], "--overwrite", dst=tmp_path / "hf", held=True)
    assert _tree(tmp_path / "hf") == hf_before  # the HF directory is untouched
    assert cli("convert", str(tmp_path / "hf"), str(root), "--to", "tp=4", "--overwrite", "--no-progress").exit_code == 0
    after = CheckpointStore(str(root))
    assert after.steps() == [0] and after.manifest().emus[0].config.tp == 4
    assert os.listdir(root / "data") == [after.manifest().data.split("/")[1]]  # old data removed


def test_source_that_is_neither(tmp_path):
    (tmp_path / "empty").mkdir()
    fails(["convert", str(tmp_path / "empty"), str(tmp_path / "out"), "--to", "hf"], "neither", dst=tmp_path / "out")


def test_training_checkpoint_relayout_keeps_optimizer_state(tmp_path):
    from nereus.reshard.reference import mismatches, reference_state
    from nereus.store.checkpoint import save_checkpoint

    config = qwen2_config("bfloat16")
    spec = spec_from_hf_config(config)
    one = derive_emus(spec, ParallelConfig.on(), model="actor", stage="train", optimizer=True)
    state = reference_state(merge_layouts(one, "one").values(), 0)
    save_checkpoint(str(tmp_path / "train"), 42, one, {"actor": state}, state={"hf_configs": {"actor": config}, "data": 7})
    convert(str(tmp_path / "train"), str(tmp_path / "n"), to="tp=2,pp=2")
    manifest = CheckpointStore(str(tmp_path / "n")).manifest()
    assert manifest.step == 42 and manifest.state["data"] == 7
    target = derive_emus(spec, ParallelConfig.on(tp=2, pp=2), model="actor", stage="train", optimizer=True)
    target_layouts = list(merge_layouts(target, "t").values())
    assert any(t.name.startswith("optim/exp_avg/") for t in target_layouts)
    for rank in range(4):
        _, out = load_checkpoint(str(tmp_path / "n"), target, rank)
        assert mismatches(out["actor"], target_layouts, rank) == []
    convert(str(tmp_path / "n"), str(tmp_path / "hf"), to="hf")
    assert not any(n.startswith("optim/") for n in HFCheckpoint.open(str(tmp_path / "hf")).tensors)


def test_overwrite_to_hf_replaces_only_an_hf_export(tmp_path):
    write_hf_model(tmp_path / "hf", llama_config())
    (tmp_path / "hf" / "generation_config.json").write_text('{"eos_token_id": 2}')
    (tmp_path / "hf" / "tokenizer.json").write_text('{"model": {}}')
    convert(str(tmp_path / "hf"), str(tmp_path / "n"), to="tp=2")  # side files travel in the checkpoint
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model.safetensors").write_bytes(b"old")
    line = fails(["convert", str(tmp_path / "n"), str(out), "--to", "hf", "--overwrite"], "notes.txt",
                 "--overwrite replaces only an HF export", dst=out, held=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").read_bytes() == b"old", line
    (out / "notes.txt").unlink()  # now only what an export writes: replaced
    assert cli("convert", str(tmp_path / "n"), str(out), "--to", "hf", "--overwrite", "--no-progress").exit_code == 0
    assert (out / "generation_config.json").read_text() == '{"eos_token_id": 2}'
    assert (out / "tokenizer.json").read_text() == '{"model": {}}'
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "float32"


def _racing_convert(src, dst, barrier, queue):
    """Both conversions pass the destination check, then meet before committing."""
    import torch as _torch

    from nereus.store import checkpoint as ck

    _torch.set_num_threads(1)
    commit = ck.CheckpointStore.commit_exclusive

    def after_both_wrote(self, manifest, snapshot):
        barrier.wait(60)
        return commit(self, manifest, snapshot)

    ck.CheckpointStore.commit_exclusive = after_both_wrote
    try:
        convert(src, dst, to="tp=2")
        queue.put("committed")
    except StoreError as e:
        queue.put(type(e).__name__ + ": " + str(e))


@pytest.mark.timeout(120)
def test_two_conversions_into_one_destination_one_commits(tmp_path):
    import multiprocessing as mp

    write_hf_model(tmp_path / "hf", llama_config())
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    dst = str(tmp_path / "n")
    procs = [ctx.Process(target=_racing_convert, args=(str(tmp_path / "hf"), dst, barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(100)
    outcomes = sorted(queue.get(timeout=5) for _ in procs)
    assert outcomes[1] == "committed" and outcomes[0].startswith("ConflictError"), outcomes
    assert "another writer committed" in outcomes[0]
    store = CheckpointStore(dst)
    assert store.steps() == [0]
    assert os.listdir(tmp_path / "n" / "data") == [store.manifest().data.split("/")[1]]  # the loser removed its data
    emus = derive_emus(spec_from_hf_config(llama_config()), ParallelConfig.on(tp=2), model="actor", stage="train")
    for rank in range(2):
        load_checkpoint(dst, emus, rank)
