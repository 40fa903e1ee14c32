"""Pure pieces: block checksums and spans, manifest JSON round trip and schema checks."""

from __future__ import annotations

import pytest
import torch

from nereus.reshard.derive import DecoderSpec, derive_emus
from nereus.reshard.layout import ParallelConfig
import zlib

from nereus.store.checksum import (
    block_checksums, blocks_of, checksums_of, crc32c, region_span, wsum64, wsum64_blocks, wsum64_reference,
)
from nereus.store.errors import SchemaError
from nereus.store.records import FileEntry, Manifest, manifest_from_dict, manifest_to_dict


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4095, 4096, 4097, 3 * 4096 + 13])
def test_wsum64_matches_its_plain_definition_and_sees_every_change(n):
    data = bytes((i * 131 + 7) % 256 for i in range(n))
    assert wsum64(data) == wsum64_reference(data)
    if n:
        for at in {0, n // 2, n - 1}:
            changed = bytearray(data)
            changed[at] ^= 0x01
            assert wsum64(bytes(changed)) != wsum64(data)
    if n >= 16:  # two words swapped
        swapped = data[8:16] + data[:8] + data[16:]
        assert swapped == data or wsum64(swapped) != wsum64(data)
    assert wsum64(data + b"\0") != wsum64(data)  # length counts, not only content


def _crc32c_bitwise(data: bytes) -> int:
    """CRC32C from its definition (reflected polynomial 0x82F63B78), one bit at a time."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


@pytest.mark.parametrize("n", [0, 1, 7, 9, 4095, 4097])
def test_crc32c_is_the_castagnoli_crc(n):
    data = bytes((i * 131 + 7) % 256 for i in range(n))
    assert crc32c(data) == _crc32c_bitwise(data)
    assert crc32c(b"123456789") == 0xE3069283  # the published check value
    assert crc32c(data) != zlib.crc32(data) or n == 0  # not the IEEE polynomial


def test_block_checksums_cut_into_blocks():
    data = bytes(range(256)) * 40  # 10240 bytes
    assert block_checksums(data, 4096) == tuple(f"{crc32c(data[i:i + 4096]):08x}" for i in (0, 4096, 8192))
    assert block_checksums(b"", 4096) == (f"{crc32c(b''):08x}",)
    assert wsum64_blocks(data, 4096) == tuple(f"{wsum64(data[i:i + 4096]):016x}" for i in (0, 4096, 8192))
    assert checksums_of("crc32c", data, 4096) == block_checksums(data, 4096)
    assert checksums_of("wsum64", data, 4096) == wsum64_blocks(data, 4096)


def test_two_sign_flips_in_one_block_cancel_in_wsum64_not_in_crc32c():
    """Why the scheme changed: wsum64 is linear mod 2**64, so flipping bit 63 of two words
    adds 2**63 * (w_i + w_j), which is 0 mod 2**64 (odd weights): the sum cannot see it."""
    words = torch.randn(1024, dtype=torch.float64)
    data = words.numpy().tobytes()
    flipped = words.clone()
    flipped[10], flipped[500] = -flipped[10], -flipped[500]  # two sign bits
    damaged = flipped.numpy().tobytes()
    assert damaged != data
    assert wsum64(damaged) == wsum64(data)  # the weighted sum misses it
    assert block_checksums(damaged) != block_checksums(data)  # the CRC does not


def test_region_span_matches_the_bytes_a_region_touches():
    box = torch.arange(4 * 6 * 5, dtype=torch.int32).view(4, 6, 5)
    raw = box.reshape(-1)
    for offsets, lengths in [((1, 2, 0), (2, 3, 5)), ((0, 0, 3), (4, 6, 2)), ((3, 5, 4), (1, 1, 1))]:
        start, end = region_span(box.shape, 4, offsets, lengths)
        region = box[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
        touched = set(region.reshape(-1).tolist())
        assert min(touched) * 4 == start and (max(touched) + 1) * 4 == end
        assert touched <= set(raw[start // 4 : end // 4].tolist())
    assert region_span((), 2, (), ()) == (0, 2)
    assert list(blocks_of(0, 4096, 4096)) == [0] and list(blocks_of(4095, 4097, 4096)) == [0, 1]
    assert list(blocks_of(5, 5, 4096)) == []


def _manifest() -> Manifest:
    spec = DecoderSpec(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1)
    emus = derive_emus(spec, ParallelConfig.on(tp=2), model="actor", stage="train")
    files = (FileEntry(tensor="actor/x", offsets=(0, 4), lengths=(2, 4), dtype="bfloat16", path="x@0_4.bin", nbytes=16, checksums=("00000000deadbeef",)),)
    return Manifest(step=3, data="data/000000000003-ab", files=files, emus=tuple(emus), created=1.5,
                    plan={"index": 2}, state={"data_position": 9}, rng=({"cpu": "AAA="},))


def test_manifest_json_round_trip():
    m = _manifest()
    assert manifest_from_dict("k", manifest_to_dict(m)) == m
    assert manifest_to_dict(m)["bytes"] == 16


@pytest.mark.parametrize("change, match", [
    ({"schema": 2}, "schema version 2"),
    ({"kind": "job"}, "is a 'job' record"),
    ({"files": [["actor/x", [0], [3], "float32", "p", 5, []]]}, "5 bytes, box needs 12"),
    ({"checksum": "md5"}, "uses checksum 'md5'"),
])
def test_bad_manifests_are_refused_with_the_key(change, match):
    record = {**manifest_to_dict(_manifest()), **change}
    with pytest.raises(SchemaError, match=match):
        manifest_from_dict("checkpoints/000000000003", record)
