"""safetensors streaming I/O and HF directories: compatibility with the library, boxes, bad input."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from nereus.reshard.derive import plan_parameters
from nereus.store.errors import CheckpointExistsError, ModelMismatchError, StoreError
from nereus.store.hf import HFCheckpoint, HFWriter, check_against_spec, plan_hf_files, spec_from_hf_config
from nereus.store.safetensors_io import Interleaved, SafetensorsWriter, plan_header, read_box, read_header

from .models import bits, llama_config, qwen2_config, write_hf_model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reads_library_files_box_by_box(tmp_path, dtype):
    t = torch.randn(6, 10).to(dtype)
    path = str(tmp_path / "a.safetensors")
    save_file({"w": t, "s": torch.tensor(3.0).to(dtype)}, path)
    infos, _ = read_header(path)
    for name, want in (("w", t), ("s", torch.tensor(3.0).to(dtype))):  # the whole tensor as one box
        out = torch.empty(want.shape, dtype=dtype)
        read_box(path, infos[name], (0,) * want.dim(), tuple(want.shape), out)
        assert torch.equal(bits(out), bits(want))
    for offsets, lengths in [((2, 0), (3, 10)), ((1, 4), (4, 3)), ((0, 9), (6, 1))]:
        out = torch.empty(lengths, dtype=dtype)
        read_box(path, infos["w"], offsets, lengths, out)
        assert torch.equal(bits(out), bits(t[offsets[0] : offsets[0] + lengths[0], offsets[1] : offsets[1] + lengths[1]]))


def test_writer_output_loads_in_the_library(tmp_path):
    tensors = {"b": torch.randn(3, 5).to(torch.bfloat16), "a": torch.randn(7), "z": torch.tensor(1.5)}
    path = str(tmp_path / "w.safetensors")
    w = SafetensorsWriter(path, [(n, str(t.dtype)[6:], tuple(t.shape)) for n, t in tensors.items()], {"format": "pt"})
    for n, t in tensors.items():
        w.write(n, t)
    w.close()
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for n, t in tensors.items():
        assert torch.equal(bits(loaded[n]), bits(t))
    header, _ = plan_header([("x", "float32", (2,))])
    assert (len(header) - 8) % 8 == 0


@pytest.mark.parametrize("cut", [0, 1, 2])
def test_interleaved_runs_write_the_tensor_cut_along_one_dim(tmp_path, cut):
    """Boxes of a tensor cut along dim ``cut`` (uneven, 3 boxes), written as runs of their
    bytes, give the tensor; 2,000 rows exceed one writev's IOV_MAX runs."""
    full = torch.randn(2000, 6, 10).to(torch.bfloat16) if cut else torch.randn(50, 6, 10)
    sizes = [1, 2, 3] if cut == 1 else ([4, 5, 1] if cut == 2 else [7, 0, 43])
    boxes = [b.contiguous() for b in full.split(sizes, dim=cut)]
    rows = full.shape[:cut].numel()
    parts = tuple(b.reshape(-1).view(torch.uint8) for b in boxes)
    runs = Interleaved(parts, tuple(p.numel() // rows for p in parts), rows, full.dtype)
    path = str(tmp_path / "r.safetensors")
    w = SafetensorsWriter(path, [("t", str(full.dtype)[6:], tuple(full.shape))])
    w.write("t", runs)
    w.close()
    assert torch.equal(bits(load_file(path)["t"]), bits(full))


def test_truncated_file_names_the_file_and_tensor(tmp_path):
    path = str(tmp_path / "t.safetensors")
    save_file({"w": torch.randn(100)}, path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(StoreError, match=r"t\.safetensors: tensor 'w' ends at byte .* \(truncated\)"):
        read_header(path)


def test_spec_from_config_reads_shapes_and_names_what_is_wrong():
    spec = spec_from_hf_config(qwen2_config())
    assert spec.qkv_bias and spec.tie_embeddings and spec.num_kv_heads == 2 and spec.head == "lm"
    llama = llama_config("bfloat16")
    spec = spec_from_hf_config(llama)
    assert (spec.num_layers, spec.hidden_size, spec.dtype) == (llama["num_hidden_layers"], llama["hidden_size"], "bfloat16")
    assert not spec.qkv_bias and not spec.tie_embeddings
    assert spec_from_hf_config({**llama, "architectures": ["LlamaForSequenceClassification"]}).head == "value"
    # shapes only: RoPE scaling changes the forward, not the parameters (the trainer rejects it)
    assert spec_from_hf_config({**llama, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) == spec
    for config, family in ((llama, "llama"), (qwen2_config(), "qwen2")):  # the inverse, with the shape keys
        spec = spec_from_hf_config(config)
        assert spec_from_hf_config(spec.to_hf_config(family)) == spec
    with pytest.raises(StoreError, match="model_type='mistral'"):
        spec_from_hf_config({**llama, "model_type": "mistral"})
    with pytest.raises(StoreError, match="lacks 'intermediate_size'"):
        spec_from_hf_config({k: v for k, v in llama.items() if k != "intermediate_size"})


@pytest.mark.parametrize("shards", [1, 3])
def test_opens_single_and_sharded_directories(tmp_path, shards):
    weights = write_hf_model(tmp_path / "m", llama_config(), shards=shards)
    ckpt = HFCheckpoint.open(str(tmp_path / "m"))
    check_against_spec(ckpt, ckpt.spec())
    assert set(ckpt.tensors) == set(weights)
    for name, t in weights.items():
        assert torch.equal(bits(ckpt.read(name)), bits(t))


def test_index_pointing_to_a_missing_file(tmp_path):
    write_hf_model(tmp_path / "m", llama_config(), shards=2)
    os.unlink(tmp_path / "m" / "model-00002-of-00002.safetensors")
    with pytest.raises(StoreError, match=r"points to 'model-00002-of-00002.safetensors', which does not exist"):
        HFCheckpoint.open(str(tmp_path / "m"))


def test_index_naming_a_tensor_its_file_lacks(tmp_path):
    write_hf_model(tmp_path / "m", llama_config(), shards=2)
    index_path = tmp_path / "m" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(StoreError, match=r"'model.layers.9.mlp.up_proj.weight' is mapped to"):
        HFCheckpoint.open(str(tmp_path / "m"))


def test_wrong_shape_names_tensor_and_file(tmp_path):
    config = llama_config()
    weights = write_hf_model(tmp_path / "m", config)
    weights["model.layers.1.mlp.down_proj.weight"] = torch.zeros(32, 63)
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    ckpt = HFCheckpoint.open(str(tmp_path / "m"))
    with pytest.raises(ModelMismatchError, match=r"model.safetensors: tensor 'model.layers.1.mlp.down_proj.weight' has shape \[32, 63\]"):
        check_against_spec(ckpt, ckpt.spec())


def test_plan_hf_files_splits_by_size():
    entries = [(f"t{i}", "float32", (10,)) for i in range(5)]  # 40 bytes each
    assert list(plan_hf_files(entries, 1000)) == ["model.safetensors"]
    files = plan_hf_files(entries, 80)
    assert list(files) == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert [len(v) for v in files.values()] == [2, 2, 1]


def test_writer_is_atomic_and_refuses_to_overwrite(tmp_path):
    config = qwen2_config()
    spec = spec_from_hf_config(config)
    entries = [(n, "float32", s) for n, s, _, _ in plan_parameters(spec)]
    dst = str(tmp_path / "out")
    w = HFWriter(dst, entries, config, max_shard_bytes=20_000)
    w.write(entries[0][0], torch.zeros(entries[0][2]))
    w.abort()
    assert not os.path.exists(dst) and os.listdir(tmp_path) == []
    w = HFWriter(dst, entries, config, max_shard_bytes=20_000)
    for n, _, s in entries:
        w.write(n, torch.ones(s))
    w.close()
    ckpt = HFCheckpoint.open(dst)
    check_against_spec(ckpt, spec)
    assert len(set(ckpt.files.values())) > 1
    with pytest.raises(CheckpointExistsError, match="--overwrite"):
        HFWriter(dst, entries, config)


@pytest.mark.parametrize("existing", ["absent", "empty"])
def test_of_two_writers_into_one_destination_the_second_fails_and_keeps_nothing(tmp_path, existing):
    """The destination check (at the start) and the rename (at the end) are one
    compare-and-swap: an export that landed meanwhile is never replaced."""
    entries = [("w", "float32", (3,))]
    dst = tmp_path / "out"
    if existing == "empty":
        dst.mkdir()
    first, second = HFWriter(str(dst), entries, {"n": 1}), HFWriter(str(dst), entries, {"n": 2})
    first.write("w", torch.ones(3))
    second.write("w", torch.zeros(3))
    first.close()
    with pytest.raises(CheckpointExistsError, match="another export was put there"):
        second.close()
    assert json.loads((dst / "config.json").read_text()) == {"n": 1}
    assert torch.equal(HFCheckpoint.open(str(dst)).read("w"), torch.ones(3))
    assert os.listdir(tmp_path) == ["out"]  # the loser's temporary directory is gone


def test_overwrite_checks_the_destination_again_before_replacing_it(tmp_path):
    entries = [("w", "float32", (3,))]
    dst = tmp_path / "out"
    w = HFWriter(str(dst), entries, {"n": 1})
    w.write("w", torch.ones(3))
    w.close()
    w = HFWriter(str(dst), entries, {"n": 2}, overwrite=True)
    w.write("w", torch.zeros(3))
    (dst / "notes.txt").write_text("mine")  # put there while the export was written
    with pytest.raises(CheckpointExistsError, match="notes.txt"):
        w.close()
    assert (dst / "notes.txt").read_text() == "mine" and json.loads((dst / "config.json").read_text()) == {"n": 1}
    assert sorted(os.listdir(tmp_path)) == ["out"]
