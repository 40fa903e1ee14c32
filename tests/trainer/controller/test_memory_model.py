"""The memory model's resident weights equal the layouts' local buffers; device profiles load and
refuse what is malformed."""

from __future__ import annotations

import itertools
import re

import pytest

from nereus.reshard.derive import DecoderSpec, check_tp, derive_emus
from nereus.reshard.errors import LayoutError
from nereus.reshard.layout import ParallelConfig, local_buffers
from nereus.trainer.controller.candidates import local_elements
from nereus.trainer.controller.profiles import ProfileError, load_profile, parse_profile, shipped_profiles

SPECS = {
    "gqa": DecoderSpec(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=5, num_heads=4, num_kv_heads=2),
    "qwen-tied": DecoderSpec(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=1,
                             qkv_bias=True, tie_embeddings=True),
    "value": DecoderSpec(vocab_size=60, hidden_size=24, intermediate_size=36, num_layers=2, num_heads=2, num_kv_heads=2, head="value"),
    # a vocabulary no tp > 1 divides (tp=4: 16, 16, 16, 13 rows; TP rank 0 holds the most)
    "odd-vocab": DecoderSpec(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2),
    "odd-tied": DecoderSpec(vocab_size=7, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=4,
                            tie_embeddings=True),  # tp=4: 2, 2, 2, 1
}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("tp, pp, dp, shard", [c for c in itertools.product((1, 2, 4), (1, 2), (1, 2, 3), (False, True))])
def test_local_elements_equal_derives_local_buffers(name, tp, pp, dp, shard):
    spec = SPECS[name]
    try:
        check_tp(spec, tp)
    except LayoutError:
        pytest.skip("tp does not fit this model")
    config = ParallelConfig.on(dp=dp, tp=tp, pp=pp)
    want = local_elements(spec, tp, pp, dp, shard)
    for emu in derive_emus(spec, config, model="m", stage="s", dp_shard=shard):
        groups: dict[tuple[int, int], list[int]] = {}  # (dp, pp) -> what each of its TP ranks holds
        for rank in emu.ranks:
            i = config.ranks.index(rank)
            p = (i // tp) % pp
            held = sum(b.nbytes for b in local_buffers(emu.tensors, rank).values()) // 4
            groups.setdefault((i // (tp * pp), p), []).append(held)
            if shard and dp > 1:
                assert held <= want[p], (rank, held, want[p])  # the model counts the largest chunk of each tensor
                assert want[p] - held <= len(emu.tensors) * spec.hidden_size * 4  # at most a few rows per tensor more
            else:  # a later, shorter vocabulary shard holds less: the model prices the largest
                assert held <= want[p], (rank, p, held, want[p])
        if not (shard and dp > 1):
            for (_, p), held in groups.items():
                assert max(held) == held[0] == want[p], (p, held, want[p])  # TP rank 0 holds the largest shard
                assert len(set(held)) == 1 or spec.vocab_size % tp, held


def test_shipped_profiles_load():
    assert set(shipped_profiles()) == {"cpu", "a100", "h100", "h200", "mi250x"}
    for name in shipped_profiles():
        profile = load_profile(name)
        assert profile.flops["bfloat16"] >= profile.flops["float32"] > 0
        assert profile.links["local"].bandwidth >= profile.links["intra"].bandwidth >= profile.links["inter"].bandwidth
    cpu = load_profile("cpu")
    assert cpu.share(4) == 0.5 and cpu.share(1) == 1.0 and load_profile("h200").share(64) == 1.0
    h200 = load_profile("h200")
    assert h200.link(0, 7) is h200.links["intra"] and h200.link(7, 8) is h200.links["inter"]


def good() -> dict:
    return {
        "name": "x", "kind": "gpu", "memory_gib": 80, "devices_per_node": 8, "flops": {"float32": 1e13},
        "memory_bandwidth": 1e12, "op_overhead": 5e-6,
        "links": {k: {"bandwidth": 1e10, "latency": 1e-5} for k in ("local", "intra", "inter")},
    }


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("flops"), "missing key 'flops'"),
    (lambda d: d.update(flop={}), "unknown key 'flop' (did you mean 'flops'?)"),
    (lambda d: d["flops"].update(int4=1e15), "flops.int4: unknown dtype"),
    (lambda d: d["links"].pop("inter"), "links must give exactly local, intra, inter"),
    (lambda d: d["links"]["intra"].update(bandwidth=-1), "links.intra.bandwidth must be a positive number"),
    (lambda d: d.update(kind="cpu"), "a cpu profile needs cores"),
    (lambda d: d.update(devices_per_node=0), "devices_per_node must be an integer >= 1"),
])
def test_a_malformed_profile_names_the_key(change, message):
    data = good()
    change(data)
    with pytest.raises(ProfileError, match=re.escape(f"my.yaml: {message}")):
        parse_profile(data, "my.yaml")


def test_a_missing_profile_says_what_exists(tmp_path):
    with pytest.raises(ProfileError, match="unknown device profile 'b200'; shipped: a100, cpu, h100, h200, mi250x"):
        load_profile("b200")
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(str(tmp_path / "none.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(str(bad))
