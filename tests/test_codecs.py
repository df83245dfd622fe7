"""Pure codec and chunking properties (no I/O)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptlib import codecs
from ckptlib.chunking import chunk_ranges, chunk_size_for, plan_units
from ckptlib.types import LeafSpec
from ckptlib.errors import CorruptCheckpoint

raw_bytes = st.binary(min_size=0, max_size=5000).map(lambda b: np.frombuffer(b, dtype=np.uint8).copy())


@settings(max_examples=150, deadline=None)
@given(data=raw_bytes, itemsize=st.sampled_from([1, 2, 4, 8]), level=st.sampled_from([1, 3]), flips=st.integers(0, 50))
def test_keyframe_and_delta_round_trip(data, itemsize, level, flips):
    key = codecs.keyframe_codecs(itemsize, level)
    assert np.array_equal(codecs.decode(codecs.encode(data, key), key, data.nbytes), data)
    # a delta against a base that differs in a few positions
    base = data.copy()
    rng = np.random.default_rng(flips)
    if base.nbytes:
        idx = rng.integers(0, base.nbytes, size=flips)
        base[idx] ^= rng.integers(1, 256, size=flips, dtype=np.uint8)
    delta = codecs.delta_codecs(itemsize, level)
    enc = codecs.encode(data, delta, base)
    assert np.array_equal(codecs.decode(enc, delta, data.nbytes, base), data)


def test_unchanged_delta_is_tiny_and_configs_round_trip():
    data = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32).view(np.uint8)
    delta = codecs.delta_codecs(4, 3)
    enc = codecs.encode(data, delta, data.copy())
    assert enc.nbytes < 200  # all zeros
    configs = [c.to_config() for c in delta]
    again = codecs.from_configs(configs)
    assert [c.to_config() for c in again] == configs
    assert codecs.uses_base(configs) and not codecs.uses_base(configs[1:])


def test_byteplane_helps_float_keyframes():
    data = np.random.default_rng(0).normal(0, 0.02, 1 << 18).astype(np.float32).view(np.uint8)
    planes = codecs.encode(data, codecs.keyframe_codecs(4, 3)).nbytes
    plain = codecs.encode(data, [codecs.Zstd(3)]).nbytes
    assert planes < plain


def test_corrupt_frames_raise():
    data = np.arange(10000, dtype=np.uint8)
    key = codecs.keyframe_codecs(1, 3)
    enc = codecs.encode(data, key).copy()
    with pytest.raises(CorruptCheckpoint):
        codecs.decode(enc[: enc.nbytes // 2], key, data.nbytes)
    enc[enc.nbytes // 2] ^= 0xFF
    with pytest.raises(CorruptCheckpoint):  # the frame does not decode, or not to the chunk's checksum
        out = codecs.decode(enc, key, data.nbytes)
        if codecs.checksum(out) != codecs.checksum(data):
            raise CorruptCheckpoint("decoded, but not to the chunk's checksum")  # what a reader does
    with pytest.raises(CorruptCheckpoint, match="unknown codec"):
        codecs.from_configs([{"name": "rot13"}])


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(0, 100_000), itemsize=st.sampled_from([1, 2, 4, 8, 16]), chunk=st.integers(16, 9000))
def test_chunks_cover_exactly_and_align(nbytes, itemsize, chunk):
    nbytes -= nbytes % itemsize
    size = chunk_size_for(itemsize, chunk)
    assert size % itemsize == 0 and size >= itemsize
    ranges = chunk_ranges(nbytes, size)
    assert sum(b - a for a, b in ranges) == nbytes
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 20_000), st.sampled_from([1, 2, 4, 8]), st.sampled_from(["a", "b"])),
                      max_size=40), chunk=st.integers(4096, 9000))
def test_units_cover_every_leaf_byte_once_and_packs_fit_a_chunk(sizes, chunk):
    specs = [LeafSpec(f"/{top}/{i}", "numpy", f"<u{k}" if k > 1 else "|u1", (n // k,), n - n % k, k)
             for i, (n, k, top) in enumerate(sizes)]
    units = plan_units(specs, chunk)
    covered = {i: [] for i in range(len(specs))}
    for u in units:
        assert u.nbytes <= chunk_size_for(u.itemsize, chunk)
        assert sum(s.length for s in u.segments) == u.nbytes
        assert len({specs[s.leaf].group[1:] for s in u.segments}) == 1  # one element size and kind per pack
        for s in u.segments:
            covered[s.leaf].append((s.leaf_start, s.leaf_start + s.length))
    for i, spec in enumerate(specs):
        ranges = sorted(covered[i])
        assert sum(b - a for a, b in ranges) == spec.nbytes
        assert all(ranges[j][1] == ranges[j + 1][0] for j in range(len(ranges) - 1))
    assert plan_units(specs, chunk) == units  # deterministic


@settings(max_examples=150, deadline=None)
@given(data=raw_bytes, itemsize=st.sampled_from([1, 2, 4, 8]), is_float=st.booleans(), flips=st.integers(0, 300),
       index=st.sampled_from(["gaps", "bitmap"]))
def test_sparse_delta_round_trips_any_bits(data, itemsize, is_float, flips, index):
    data = data[: data.nbytes - data.nbytes % itemsize]
    base = data.copy()
    rng = np.random.default_rng(flips)
    if base.nbytes:
        idx = rng.integers(0, base.nbytes, size=flips)
        base[idx] ^= rng.integers(1, 256, size=flips, dtype=np.uint8)
    sparse = [codecs.SparseDelta(itemsize, is_float, 3, index=index)]
    enc = codecs.encode(data, sparse, base)
    configs = [c.to_config() for c in sparse]
    assert np.array_equal(codecs.decode(enc, codecs.from_configs(configs), data.nbytes, base), data)
    out = base.copy()
    codecs.decode_into(enc, codecs.from_configs(configs), out)  # in place, as a restore does
    assert np.array_equal(out, data)


def test_sparse_delta_reads_the_first_version_and_refuses_bad_positions():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, 4096, dtype=np.uint8)
    data = base.copy()
    data[rng.integers(0, 4096, 40)] += 1
    legacy = codecs.SparseDelta(4, True, 3, index="bitmap")
    config = legacy.to_config()
    del config["configuration"]["index"]  # the first version wrote no index: a bitmap
    enc = codecs.encode(data, [legacy], base)
    assert np.array_equal(codecs.decode(enc, codecs.from_configs([config]), data.nbytes, base), data)
    gaps = codecs.sparse_codecs(4, 3, True)
    enc = codecs.encode(data, gaps, base)
    count = int(enc[8:16].view("<u8")[0])
    bad = np.concatenate([enc[:8], np.array([count + 5000], "<u8").view(np.uint8), enc[16:]])
    with pytest.raises(CorruptCheckpoint, match="sparse_delta"):
        codecs.decode(bad, gaps, data.nbytes, base)
    with pytest.raises(CorruptCheckpoint, match="unknown codec configuration"):
        codecs.from_configs([{"name": "sparse_delta", "configuration": {"itemsize": 4, "index": "runs"}}])


def test_sparse_delta_wins_on_ulp_steps_of_bf16():
    import torch

    w = torch.randn(1 << 20) * 0.02
    before = w.to(torch.bfloat16)
    w += 2e-5 * torch.randn_like(w).sign()  # about 10% of bf16 values move by one ulp
    after = w.to(torch.bfloat16)
    base = before.view(torch.uint8).numpy()
    new = after.view(torch.uint8).numpy()
    xor = codecs.encode(new, codecs.delta_codecs(2, 3), base).nbytes
    sparse = codecs.encode(new, codecs.sparse_codecs(2, 3, True), base).nbytes
    assert sparse < xor


def _order0_bytes(planes: np.ndarray) -> float:
    """The order-0 entropy bound, in bytes, of each column of ``planes`` coded on its own."""
    total = 0.0
    for column in planes.T:
        p = np.bincount(column, minlength=256) / column.size
        p = p[p > 0]
        total -= float((p * np.log2(p)).sum()) * column.size / 8
    return total


@pytest.mark.parametrize("changed", [0.05, 0.2, 0.5])
def test_sparse_streams_come_within_5_percent_of_their_order0_bound(changed):
    """A sparse delta's gaps and differences are small numbers with skewed frequencies and few
    repeats: coded as the byte planes are, each stream lands within 5% of the order-0 bound of its
    planes (zstd's level-3 match finder gave 3-17% above it)."""
    rng = np.random.default_rng(0)
    n = 1 << 20
    base = rng.integers(0, 1 << 14, n, dtype=np.uint16) | 0x3C00
    moved = np.flatnonzero(rng.random(n) < changed)
    steps = rng.geometric(0.3, moved.size).astype(np.uint16) * np.where(rng.random(moved.size) < 0.5, 1, -1).astype(np.uint16)
    new = base.copy()
    new[moved] += steps
    payload = codecs.encode(new.view(np.uint8), [codecs.SparseDelta(2, True, 3, index="vgaps")], base.view(np.uint8))
    positions = np.flatnonzero(new != base)
    gaps = np.diff(positions, prepend=0)
    diffs = codecs._zigzag(codecs._ordered(new[positions], True) - codecs._ordered(base[positions], True))
    planes = [a.astype(codecs._UINT[codecs._narrowest(int(a.max()), 4)]) for a in (gaps, diffs)]
    bound = sum(_order0_bytes(a.view(np.uint8).reshape(a.size, -1)) for a in planes)
    assert payload.nbytes <= 1.05 * bound, payload.nbytes / bound
    assert np.array_equal(codecs.decode(payload, [codecs.SparseDelta(2, True, 3, index="vgaps")], new.nbytes,
                                        base.view(np.uint8)).view(np.uint16), new)


@settings(max_examples=200, deadline=None)
@given(data=raw_bytes, itemsize=st.sampled_from([1, 2, 3, 4, 8, 16]), coded=st.sets(st.integers(0, 15)),
       level=st.sampled_from([1, 3, 5]))
def test_planes_round_trip_any_bytes_any_choice_of_coded_planes(data, itemsize, coded, level):
    codec = codecs.Planes(itemsize, [p for p in coded if p < itemsize], level)
    enc = codec.encode(data, None)
    again = codecs.from_configs([codec.to_config()])
    assert np.array_equal(codecs.decode(enc, again, data.nbytes), data)
    out = np.full(data.nbytes, 0xAB, dtype=np.uint8)
    codecs.decode_into(enc, again, out)  # straight into a destination, as a restore does
    assert np.array_equal(out, data)
    if not codec.coded and data.nbytes % itemsize == 0:
        assert enc.tobytes() == data.tobytes()  # nothing coded: the raw bytes themselves


@settings(max_examples=200, deadline=None)
@given(data=raw_bytes, itemsize=st.sampled_from([2, 4, 8]), coded=st.sets(st.integers(0, 7), min_size=1))
def test_the_raw_part_of_planes_is_each_elements_raw_bytes_in_order(data, itemsize, coded):
    # The layout is the format (docs/format.md): payloads written before the one-pass gather of
    # machine words must read back, so the encoder's raw part is checked against a plane-by-plane
    # gather of the same bytes, not only against the decoder.
    coded = {p for p in coded if p < itemsize}
    if data.nbytes % itemsize or len(coded) in (0, itemsize):
        return
    codec = codecs.Planes(itemsize, coded)
    enc = codec.encode(data, None)
    elements = data.reshape(-1, itemsize)
    raw = [p for p in range(itemsize) if p not in coded]
    expected = np.stack([elements[:, p] for p in raw], axis=1).reshape(-1)
    head = 8 * len(coded)
    assert np.array_equal(enc[head:head + expected.nbytes], expected)


def test_planes_code_only_what_pays_on_float_weights():
    w = np.random.default_rng(0).normal(0, 0.02, 1 << 18).astype(np.float32).view(np.uint8)
    exponent_only = codecs.Planes(4, [3]).encode(w, None)
    every_plane = codecs.Planes(4, [0, 1, 2, 3]).encode(w, None)
    sizes = codecs.Planes(4, [0, 1, 2, 3]).frame_sizes(every_plane, w.nbytes)
    plane = w.nbytes // 4
    assert sizes[3] < 0.5 * plane and min(sizes[0], sizes[1]) > 0.99 * plane  # exponents pay, low mantissas not
    assert exponent_only.nbytes < 0.85 * w.nbytes
    assert exponent_only.nbytes <= every_plane.nbytes + 64
    # an arithmetic delta into planes decodes in place over its base, as a chain link does
    base = w.copy()
    base.view(np.float32)[::7] += 1e-4
    delta = [codecs.ArithDelta(4, True), codecs.Planes(4, [2, 3])]
    enc = codecs.encode(w, delta, base)
    out = base.copy()
    codecs.decode_into(enc, codecs.from_configs([c.to_config() for c in delta]), out)
    assert np.array_equal(out, w)


def test_hostile_planes_payloads_are_refused_before_allocating():
    data = np.random.default_rng(1).normal(0, 1, 4096).astype(np.float32).view(np.uint8)
    codec = codecs.Planes(4, [2, 3])
    enc = codec.encode(data, None)
    out = np.empty(data.nbytes, dtype=np.uint8)
    for bad in (enc[:4],  # no room for the header
                enc[:-1],  # truncated
                np.concatenate([enc, np.zeros(3, np.uint8)])):  # trailing bytes
        with pytest.raises(CorruptCheckpoint, match="planes payload"):
            codec.decode_into(bad, out)
    lying = enc.copy()
    lying[:8] = np.array([1 << 40], "<u8").view(np.uint8)  # a frame "of a terabyte"
    with pytest.raises(CorruptCheckpoint, match="planes payload holds"):
        codec.decode_into(lying, out)
    # frames swapped between planes: lengths add up, but a frame of the wrong plane breaks the data
    # (the reader's chunk checksum catches it) or does not decode; a frame declaring another
    # content size is refused before zstd allocates it
    other = codecs.Planes(4, [2, 3]).encode(np.concatenate([data, data]), None)
    head = 16
    raw_part = 2 * (data.nbytes // 4)
    frames = enc[head + raw_part:]
    big = other[16 + 2 * raw_part:]
    first = int(other[:8].view("<u8")[0])
    forged = np.concatenate([np.array([first, frames.nbytes - int(enc[:8].view("<u8")[0])], "<u8").view(np.uint8),
                             enc[head:head + raw_part], big[:first], frames[int(enc[:8].view("<u8")[0]):]])
    with pytest.raises(CorruptCheckpoint, match="declares"):
        codec.decode_into(forged, out)
    for config in ({"itemsize": 4, "coded": [4]}, {"itemsize": 0}, {"itemsize": 4, "coded": "x"}):
        with pytest.raises(CorruptCheckpoint, match="unknown codec configuration"):
            codecs.from_configs([{"name": "planes", "configuration": config}])
