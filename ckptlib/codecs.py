"""Chunk codecs: raw bytes <-> stored bytes. Pure functions of their inputs, no I/O.

A chunk's encoding is a list of codec configurations, zarr-v3 style::

    [{"name": "xor_delta"}, {"name": "byteplane", "configuration": {"itemsize": 4}},
     {"name": "zstd", "configuration": {"level": 3}}]

applied left to right on encode and right to left on decode. ``xor_delta`` needs the raw bytes of
the base chunk (the same chunk position in the previous checkpoint); the others need nothing.
Codecs are found by name in ``REGISTRY`` (no isinstance ladders). Two codecs may share a name only
if each decodes the other's output.

Every buffer here is a 1-D ``numpy.uint8`` array. numpy's ufuncs, copies and zstandard release the
GIL on large buffers, so callers run many chunks in a thread pool.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar, Protocol

import numpy as np
import xxhash
import zstandard

from .errors import CorruptCheckpoint


def checksum(data: np.ndarray | bytes | memoryview) -> str:
    """Hex XXH3-128 of the bytes: the identity of a chunk and the integrity check of every decode.

    XXH3 hashes at memory speed (7.5 GiB/s on one core here, against 0.4 GiB/s for blake2b), which
    matters because every byte of a save and a restore is hashed. It detects corruption, not
    tampering: a store writable by an adversary could plant colliding chunks (see docs/format.md).
    """
    return xxhash.xxh3_128_hexdigest(_mv(data))


def checksum_of(parts: list[np.ndarray]) -> str:
    """``checksum`` of the concatenation of ``parts``, without concatenating them."""
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(_mv(part))
    return h.hexdigest()


def _mv(data: np.ndarray | bytes | memoryview) -> memoryview:
    """A memoryview of any buffer (numpy's stubs do not declare ndarray a Buffer)."""
    return memoryview(data)  # type: ignore[arg-type]


class Codec(Protocol):
    """One reversible step. ``decode(encode(x, base), base) == x`` for every input.

    ``uses_base``: a delta codec. Its ``apply(data, out)`` decodes in place: ``out`` holds the
    base's raw bytes and becomes the decoded chunk, so a restore resolves a delta chain inside the
    destination tensor's memory without a buffer per link. A codec that can be first in a chain
    without a base has ``decode_into(data, out)``, writing the raw bytes straight into ``out``.
    """

    name: ClassVar[str]
    uses_base: ClassVar[bool]

    def encode(self, data: np.ndarray, base: np.ndarray | None) -> np.ndarray: ...
    def decode(self, data: np.ndarray, base: np.ndarray | None, nbytes: int) -> np.ndarray: ...
    def to_config(self) -> dict[str, Any]: ...


class _InPlaceDelta:
    """``decode`` of a delta codec, by its in-place ``apply`` on a copy of the base."""

    uses_base: ClassVar[bool] = True

    def apply(self, data: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError

    def decode(self, data: np.ndarray, base: np.ndarray | None, nbytes: int) -> np.ndarray:
        if base is None or base.nbytes != nbytes:
            raise CorruptCheckpoint(f"{self.name} chunk of {nbytes} bytes has a base of "  # type: ignore[attr-defined]
                                    f"{None if base is None else base.nbytes} bytes")
        out = base.copy()
        self.apply(data, out)
        return out


class _Transform:
    """A codec that needs no base: ``decode_into`` writes the decoded bytes into ``out``."""

    uses_base: ClassVar[bool] = False

    def decode(self, data: np.ndarray, base: np.ndarray | None, nbytes: int) -> np.ndarray:
        raise NotImplementedError

    def decode_into(self, data: np.ndarray, out: np.ndarray) -> None:
        decoded = self.decode(data, None, out.nbytes)
        if decoded.nbytes != out.nbytes:
            raise CorruptCheckpoint(f"chunk decoded to {decoded.nbytes} bytes, expected {out.nbytes}")
        out[:] = decoded


class Raw(_Transform):
    """The raw bytes as they are: a keyframe of a chunk that does not compress. Restoring it is a
    copy, which is what makes incompressible state (most fp32 mantissas) as fast to read back as
    an uncompressed checkpoint."""

    name: ClassVar[str] = "raw"

    def encode(self, data: np.ndarray, base: np.ndarray | None) -> np.ndarray:
        return data

    def decode(self, data: np.ndarray, base: np.ndarray | None, nbytes: int) -> np.ndarray:
        if data.nbytes != nbytes:
            raise CorruptCheckpoint(f"raw chunk holds {data.nbytes} bytes, expected {nbytes}")
        return data

    def to_config(self) -> dict[str, Any]:
        return {"name": self.name}


class XorDelta(_InPlaceDelta):
    """XOR against the base chunk: unchanged bytes become zeros, which zstd erases."""

    name: ClassVar[str] = "xor_delta"

    def encode(self, data: np.ndarray, base: np.ndarray | None) -> np.ndarray:
        if base is None or base.nbytes != data.nbytes:
            raise ValueError("xor_delta needs a base chunk of the same size")
        return _xor(data, base, np.empty_like(data))

    def apply(self, data: np.ndarray, out: np.ndarray) -> None:
        if data.nbytes != out.nbytes:
            raise CorruptCheckpoint(f"xor_delta chunk of {data.nbytes} bytes has a base of {out.nbytes} bytes")
        _xor(data, out, out)

    def to_config(self) -> dict[str, Any]:
        return {"name": self.name}


def _xor(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    n8 = a.nbytes - a.nbytes % 8  # XOR 8 bytes at a time where the length allows
    np.bitwise_xor(a[:n8].view(np.uint64), b[:n8].view(np.uint64), out=out[:n8].view(np.uint64))
    np.bitwise_xor(a[n8:], b[n8:], out=out[n8:])
    return out


class BytePlane(_Transform):
    """Transpose element bytes into planes (all first bytes, then all second bytes, ...).

    Exponent and sign bytes of floats, and the zero high bytes of small deltas, line up into long
    runs that zstd compresses far better than interleaved bytes.
    """

    name: ClassVar[str] = "byteplane"

    def __init__(self, itemsize: int = 1):
        self.itemsize = int(itemsize)

    def _usable(self, n: int) -> bool:
        return self.itemsize > 1 and n % self.itemsize == 0

    # One strided copy per plane: 3-6x faster than numpy's general transpose for small itemsizes.
    def encode(self, data: np.ndarray, base: np.ndarray | None) -> np.ndarray:
        if not self._usable(data.nbytes):
            return data
        elements = data.reshape(-1, self.itemsize)
        planes = np.empty((self.itemsize, elements.shape[0]), dtype=np.uint8)
        for k in range(self.itemsize):
            planes[k] = elements[:, k]
        return planes.reshape(-1)

    def decode(self, data: np.ndarray, base: np.ndarray | None, nbytes: int) -> np.ndarray:
        if not self._usable(data.nbytes):
            return data
        out = np.empty(data.nbytes, dtype=np.uint8)
        self.decode_into(data, out)
        return out

    def decode_into(self, data: np.ndarray, out: np.ndarray) -> None:
        """Interleave the planes straight into ``out`` (e.g. the destination tensor's memory)."""
        if data.nbytes != out.nbytes:
            raise CorruptCheckpoint(f"byte planes hold {data.nbytes} bytes, expected {out.nbytes}")
        if not self._usable(data.nbytes):
            out[:] = data
            return
        planes = data.reshape(self.itemsize, -1)
        elements = out.reshape(-1, self.itemsize)
        for k in range(self.itemsize):
            elements[:, k] = planes[k]

    def to_config(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": {"itemsize": self.itemsize}}


class Zstd(_Transform):
    """zstd frame with the content size; one compressor per thread.

    Frames carry no checksum of their own (zstd's XXH64 of the content): every decoded chunk is
    checked against its XXH3-128 anyway, so a second hash of the same bytes cost 4% of a decode and
    8% of an encode for nothing (docs/decisions.md 54). Frames written with one still decode."""

    name: ClassVar[str] = "zstd"
    _local = threading.local()

    def __init__(self, level: int = 3):
        self.level = int(level)

    def _compressor(self) -> zstandard.ZstdCompressor:
        cache = self._local.__dict__.setdefault("compressors", {})
        if self.level not in cache:
            cache[self.level] = zstandard.ZstdCompressor(
                level=self.level, write_checksum=False, write_content_size=True
            )
        return cache[self.level]

    def encode(self, data: np.ndarray, base: np.ndarray | None) -> np.ndarray:
        return np.frombuffer(self._compressor().compress(_mv(data)), dtype=np.uint8)

    def decode(self, data: np.ndarray, base: np.ndarray | None, nbytes: int) -> np.ndarray:
        dctx = self._local.__dict__.setdefault("decompressor", zstandard.ZstdDecompressor())
        return _unzstd(dctx, data, nbytes)

    def to_config(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": {"level": self.level}}


def _fast_compressor(level: int) -> zstandard.ZstdCompressor:
    """The zstd compressor of a byte plane (one per thread and level).

    At levels up to 3 it is tuned as an order-0 coder: a plane of float exponents or of small
    differences has skewed byte frequencies but few long repeats, so zstd's Huffman stage does the
    work and its match finder mostly wastes time. A tiny hash table (2^6), matches of 7 bytes or
    more and the fastest strategy compress those planes 2-4x faster than level 1 and 3-8% smaller
    than levels 1-3 (measured on dense-lm's planes: docs/decisions.md, "Planes"). Above level 3,
    zstd's own level (more search, for users who trade time for bytes). Frames are standard zstd
    either way: how they were made is not part of the format."""
    cache = Zstd._local.__dict__.setdefault("planes", {})
    if level not in cache:
        if level <= 3:
            params = zstandard.ZstdCompressionParameters(
                window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0,
                strategy=zstandard.STRATEGY_FAST, write_checksum=0, write_content_size=1)
            cache[level] = zstandard.ZstdCompressor(compression_params=params)
        else:
            cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
    return cache[level]


class Planes(_Transform):
    """Byte planes, each stored either zstd-compressed or raw: code only the planes that pay.

    The mantissa bytes of trained float weights and moments are close to random (zstd saves
    nothing on them, and a reader would decompress them for nothing); the exponent byte, and the
    high bytes of small differences, compress 3-30x. ``coded`` lists the planes stored as zstd
    frames (plane ``k`` holds byte ``k`` of every element, little-endian order: for float32, plane 3
    is the sign and 7 exponent bits). Which planes pay is the writer's choice, measured per unit
    (``ckptlib.encoding``); any choice decodes, and ``coded=[]`` is the raw bytes themselves.

    Payload: for each coded plane in ``coded`` order, its frame's length as a little-endian uint64;
    then the raw part: every element's raw (not coded) bytes in plane order, element after element
    (for float32 with plane 3 coded, bytes 0-2 of each element); then the coded planes' zstd frames
    (content size set) in ``coded`` order. A chunk that is not whole elements is one
    plane. The raw part keeps the element order so that a reader copies it with one strided pass
    of machine words (the coded planes then overwrite their bytes), not one pass per plane.
    """

    name: ClassVar[str] = "planes"

    def __init__(self, itemsize: int = 1, coded: list[int] | tuple[int, ...] = (), level: int = 3):
        self.itemsize = int(itemsize)
        if not 1 <= self.itemsize <= 16:
            raise ValueError(f"planes itemsize must be in 1..16, got {itemsize}")
        self.coded = tuple(sorted({int(k) for k in coded}))
        if any(not 0 <= k < self.itemsize for k in self.coded):
            raise ValueError(f"planes coded {list(coded)} out of range for itemsize {self.itemsize}")
        self.level = int(level)

    def _layout(self, nbytes: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """(planes, coded planes, raw planes) of a chunk of ``nbytes``."""
        if nbytes % self.itemsize:
            return 1, ((0,) if self.coded else ()), (() if self.coded else (0,))
        return self.itemsize, self.coded, tuple(p for p in range(self.itemsize) if p not in self.coded)

    def encode(self, data: np.ndarray, base: np.ndarray | None) -> np.ndarray:
        k, coded, raw = self._layout(data.nbytes)
        elements = data.reshape(-1, k)
        compressor = _fast_compressor(self.level)
        # One strided copy per plane (numpy's general transpose is 3-6x slower for small itemsizes).
        frames = [compressor.compress(_mv(np.ascontiguousarray(elements[:, p]) if k > 1 else data)) for p in coded]
        head, raw_bytes = 8 * len(coded), len(raw) * (data.nbytes // k)
        out = np.empty(head + raw_bytes + sum(len(f) for f in frames), dtype=np.uint8)
        out[:head] = np.array([len(f) for f in frames], dtype="<u8").view(np.uint8)
        if len(raw) == k:
            out[head:] = data
        elif raw:
            _raw_from(elements, raw, out[head:head + raw_bytes])
        at = head + raw_bytes
        for frame in frames:
            out[at:at + len(frame)] = np.frombuffer(frame, dtype=np.uint8)
            at += len(frame)
        return out

    @staticmethod
    def paying(data: np.ndarray, itemsize: int, level: int, pays: float = 0.97) -> tuple[int, ...]:
        """The planes of ``data`` worth coding: those whose sample (8 runs spread over the chunk,
        16 KiB of the plane in all) zstd shrinks to at most ``pays`` of its size. A function of the
        bytes alone, so the same chunk is always encoded the same way (one object, whoever writes
        it); the sample costs a few percent of coding the planes that pay."""
        if itemsize < 1 or data.nbytes % itemsize:
            itemsize = 1
        elements = data.reshape(-1, itemsize)
        n = elements.shape[0]
        run = max(1, min(n, _SAMPLE_BYTES) // _SAMPLE_RUNS)
        starts = np.linspace(0, max(0, n - run), _SAMPLE_RUNS).astype(np.int64) if n > run else np.zeros(1, np.int64)
        rows = np.concatenate([np.arange(a, min(n, a + run)) for a in np.unique(starts)]) if n else np.zeros(0, np.int64)
        sample = elements[rows]
        compressor = _fast_compressor(level)
        return tuple(p for p in range(itemsize)
                     if rows.size and len(compressor.compress(_mv(np.ascontiguousarray(sample[:, p])))) <= pays * rows.size)

    def frame_sizes(self, payload: np.ndarray, nbytes: int) -> dict[int, int]:
        """Stored bytes of each coded plane of a payload this codec wrote for a chunk of ``nbytes``
        (the writer's measure of which planes pay)."""
        coded = self._layout(nbytes)[1]
        return dict(zip(coded, (int(n) for n in payload[:8 * len(coded)].view("<u8"))))

    def decode(self, data: np.ndarray, base: np.ndarray | None, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, dtype=np.uint8)
        self.decode_into(data, out)
        return out

    def decode_into(self, data: np.ndarray, out: np.ndarray) -> None:
        """Straight into ``out`` (e.g. the destination tensor's memory): the raw part, then each
        coded plane into its bytes."""
        k, coded, raw = self._layout(out.nbytes)
        plane_bytes = out.nbytes // k
        head, raw_bytes = 8 * len(coded), len(raw) * plane_bytes
        if data.nbytes < head:
            raise CorruptCheckpoint(f"planes payload of {data.nbytes} bytes has no room for its header")
        lengths = [int(n) for n in data[:head].view("<u8")]
        total = head + raw_bytes + sum(lengths)
        if total != data.nbytes:
            raise CorruptCheckpoint(f"planes payload holds {data.nbytes} bytes, its header says {total}")
        if len(raw) == k:
            out[:] = data[head:]
            return
        elements = out.reshape(-1, k)
        if raw:
            _raw_into(data[head:head + raw_bytes], elements, raw)
        at = head + raw_bytes
        dctx = Zstd._local.__dict__.setdefault("decompressor", zstandard.ZstdDecompressor())
        for plane, size in zip(coded, lengths):
            decoded = _unzstd(dctx, data[at:at + size], plane_bytes)
            at += size
            if k == 1:
                out[:] = decoded
            else:
                elements[:, plane] = decoded

    def to_config(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": {"itemsize": self.itemsize, "coded": list(self.coded),
                                                     "level": self.level}}


def _raw_from(elements: np.ndarray, raw: tuple[int, ...], rest: np.ndarray) -> None:
    """Gather the bytes ``raw`` of each row of ``elements`` into ``rest`` (``len(raw)`` bytes per
    element, element after element): the inverse of ``_raw_into``. When the raw bytes are the low
    ones of 2, 4 or 8-byte elements, one pass of machine-word stores does it (3x faster than a
    strided pass per plane for float32): word ``i`` is stored at byte ``i * r`` of ``rest``, so its
    high bytes land on the next element's place, and that element's own store, which comes after
    it, overwrites them. That order is numpy's for a 1-D copy between arrays that do not overlap
    each other (the round-trip tests check it). The last element's word would end past ``rest``
    and goes by plane, as does every other layout."""
    words = _raw_words(rest, elements, raw)
    by_word = 0 if words is None else words.size
    if words is not None:
        words[:] = elements[:by_word].reshape(-1).view(words.dtype)
    tail = rest.reshape(-1, len(raw))[by_word:]
    for j, p in enumerate(raw):
        tail[:, j] = elements[by_word:, p]


def _raw_words(rest: np.ndarray, elements: np.ndarray, raw: tuple[int, ...]) -> np.ndarray | None:
    """The raw part ``rest`` seen as one machine word per element, word ``i`` at byte ``i * r``
    (``r = len(raw)``), as many as end within ``rest``; None unless the raw bytes are the low ones
    of C-contiguous 2, 4 or 8-byte elements (the layouts a word pass can move) and a word fits."""
    n, k = elements.shape
    r = len(raw)
    if raw != tuple(range(r)) or k not in (2, 4, 8) or not elements.flags.c_contiguous:
        return None
    count = min(n, (r * n - k) // r + 1) if r * n >= k else 0
    return np.ndarray((count,), dtype=f"<u{k}", buffer=rest, strides=(r,)) if count > 0 else None


def _raw_into(rest: np.ndarray, elements: np.ndarray, raw: tuple[int, ...]) -> None:
    """Copy the raw part ``rest`` (``len(raw)`` bytes per element) into the bytes ``raw`` of each
    row of ``elements``. When the raw bytes are the low ones of 2, 4 or 8-byte elements, one strided
    pass of machine words does it: word ``i`` is read from byte ``i * r`` of ``rest``, so its high
    bytes are the next element's raw bytes, which the coded planes overwrite afterwards (twice as
    fast as a pass per plane). The last elements, whose word would read past ``rest``, go by plane."""
    r = len(raw)
    # a pass by word writes whole elements, which then pays only while most of each is raw
    words = _raw_words(rest, elements, raw) if 2 * r >= elements.shape[1] else None
    by_word = 0 if words is None else words.size
    if words is not None:
        elements[:by_word].reshape(-1).view(words.dtype)[:] = words
    tail = rest.reshape(-1, r)[by_word:]
    for j, p in enumerate(raw):
        elements[by_word:, p] = tail[:, j]


def _unzstd(dctx: zstandard.ZstdDecompressor, data: np.ndarray, nbytes: int) -> np.ndarray:
    """One zstd frame of exactly ``nbytes`` bytes, its declared size checked before anything is
    allocated (a small hostile frame could declare gigabytes)."""
    try:
        declared = zstandard.frame_content_size(_mv(data))
        if declared != nbytes:
            raise CorruptCheckpoint(f"zstd frame declares {declared} bytes, the chunk holds {nbytes}")
        out = dctx.decompress(_mv(data), max_output_size=nbytes, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CorruptCheckpoint(f"zstd frame does not decode ({e})") from None
    if len(out) != nbytes:
        raise CorruptCheckpoint(f"zstd frame decoded to {len(out)} bytes, expected {nbytes}")
    return np.frombuffer(out, dtype=np.uint8)


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# What Planes.paying measures a plane on: 16 KiB chose the same planes as 64 KiB for every tensor of
# the bench's workloads, in a quarter of the time (docs/decisions.md 52).
_SAMPLE_BYTES, _SAMPLE_RUNS = 16 << 10, 8


def _ordered(x: np.ndarray, is_float: bool) -> np.ndarray:
    """Float bit patterns -> unsigned ints that order like the floats (offset binary).

    Negative floats (sign bit set) are inverted, positive ones get the top bit: x ^ (-(x >> top) | top),
    branch-free, in a few passes over the array.
    """
    if not is_float:
        return x
    t = x.dtype.type
    mask = x >> t(8 * x.itemsize - 1)
    np.negative(mask, out=mask)  # 0 -> 0, 1 -> all ones (unsigned wrap-around)
    mask |= t(1 << (8 * x.itemsize - 1))
    mask ^= x
    return mask


def _unordered(u: np.ndarray, is_float: bool) -> np.ndarray:
    """Inverse of _ordered: u ^ (((u >> top) - 1) | top); may reuse ``u``'s memory."""
    if not is_float:
        return u
    t = u.dtype.type
    mask = u >> t(8 * u.itemsize - 1)
    mask -= t(1)
    mask |= t(1 << (8 * u.itemsize - 1))
    np.bitwise_xor(u, mask, out=mask)
    return mask


def _zigzag(d: np.ndarray) -> np.ndarray:
    """Wrap-around difference -> small unsigned (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...)."""
    signed = d.view(np.dtype(f"i{d.itemsize}"))
    return (d << d.dtype.type(1)) ^ (signed >> signed.dtype.type(8 * d.itemsize - 1)).view(d.dtype)


def _unzigzag(z: np.ndarray, inplace: bool = False) -> np.ndarray:
    """Inverse of _zigzag; with ``inplace``, ``z`` (a buffer of the caller's) is overwritten."""
    t = z.dtype.type
    low = z & t(1)
    np.negative(low, out=low)
    if inplace:
        z >>= t(1)
        low ^= z
    else:
        low ^= z >> t(1)
    return low


def _check_itemsize(name: str, itemsize: int) -> int:
    if itemsize not in _UINT:
        raise ValueError(f"{name} supports element sizes 1, 2, 4, 8, not {itemsize}")
    return int(itemsize)


class ArithDelta(_InPlaceDelta):
    """Element-wise integer difference against the base chunk, zigzag-encoded.

    Floats are mapped to integers that order like their values (sign-magnitude -> offset binary),
    so a small update is a small difference even across zero, with fewer significant bits than
    an XOR of the patterns. Differences wrap modulo 2**bits: any bit pattern round-trips exactly.
    Followed by byteplane + zstd; meant for updates that touch most elements.
    """

    name: ClassVar[str] = "arith_delta"

    def __init__(self, itemsize: int, ordered_float: bool = False):
        self.itemsize, self.ordered_float = _check_itemsize(self.name, itemsize), bool(ordered_float)

    def encode(self, data: np.ndarray, base: np.ndarray | None) -> np.ndarray:
        if base is None or base.nbytes != data.nbytes or data.nbytes % self.itemsize:
            raise ValueError("arith_delta needs a base chunk of the same size, whole elements")
        uint = _UINT[self.itemsize]
        f = self.ordered_float
        return _zigzag(_ordered(data.view(uint), f) - _ordered(base.view(uint), f)).view(np.uint8)

    def apply(self, data: np.ndarray, out: np.ndarray) -> None:
        if out.nbytes != data.nbytes or data.nbytes % self.itemsize:
            raise CorruptCheckpoint("arith_delta chunk has no base of the right size")
        uint = _UINT[self.itemsize]
        f = self.ordered_float
        value = _unzigzag(data.view(uint))
        value += _ordered(out.view(uint), f)
        out.view(uint)[:] = _unordered(value, f)

    def add_to(self, data: np.ndarray, acc: np.ndarray) -> None:
        """Add this delta's differences to ``acc`` (the chunk's elements as ordered integers)."""
        if acc.nbytes != data.nbytes:
            raise CorruptCheckpoint("arith_delta chunk has no base of the right size")
        z = data.view(acc.dtype)
        acc += _unzigzag(z, inplace=z.flags.writeable)

    def to_config(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": {"itemsize": self.itemsize, "ordered_float": self.ordered_float}}


class SparseDelta(_InPlaceDelta):
    """A delta as (the positions of the changed elements, their integer differences), each
    zstd-compressed.

    For updates that touch a minority of elements by small amounts (bf16 weights at small learning
    rates change ~10% of elements, mostly by one unit in the last place) this is far smaller than a
    dense delta: the positions cost about their entropy and each difference a few bits. Differences
    are those of ``arith_delta``. A complete codec: no zstd after it.

    ``index`` says how positions are stored: ``"vgaps"`` (what the writer uses: the distance from
    the previous changed element, and the differences, each in the narrowest of 1, 2, 4 (8) bytes
    that holds them, byte-planed; the widths are in the payload's header), ``"gaps"`` (distances as
    byte-planed uint32: the second version) or ``"bitmap"`` (one bit per element: the first version,
    whose configurations have no ``index``). Both older ones are still read. Gaps measured 14%
    smaller than the bitmap on finetune-bf16 and 40% on recsys, and decode 2.4-3x faster; narrow
    widths decode in a quarter of the bytes (docs/decisions.md, "Restore at storage speed").

    Payload: little-endian uint64 (index bytes, count of changes), for ``vgaps`` then one byte each
    of gap width and difference width and 6 zero bytes, then the index, then the differences.
    """

    name: ClassVar[str] = "sparse_delta"
    INDEXES = ("vgaps", "gaps", "bitmap")

    def __init__(self, itemsize: int, ordered_float: bool = False, level: int = 3, index: str = "bitmap"):
        self.itemsize = _check_itemsize(self.name, itemsize)
        self.ordered_float, self.level = bool(ordered_float), int(level)
        if index not in self.INDEXES:
            raise ValueError(f"sparse_delta index must be one of {self.INDEXES}, got {index!r}")
        self.index = index

    @property
    def _header_bytes(self) -> int:
        return 24 if self.index == "vgaps" else 16

    def encode(self, data: np.ndarray, base: np.ndarray | None) -> np.ndarray:
        if base is None or base.nbytes != data.nbytes or data.nbytes % self.itemsize:
            raise ValueError("sparse_delta needs a base chunk of the same size, whole elements")
        uint = _UINT[self.itemsize]
        new, old = data.view(uint), base.view(uint)
        positions = np.flatnonzero(new != old)
        return self.encode_changes(positions, new[positions], old[positions], data.nbytes // self.itemsize)

    def encode_changes(self, positions: np.ndarray, new: np.ndarray, old: np.ndarray, n: int) -> np.ndarray:
        """The payload of a chunk of ``n`` elements whose elements at ``positions`` (increasing)
        went from ``old`` to ``new`` (unsigned views): what ``encode`` writes for the same change,
        from a writer that found the changes itself (a snapshot by difference)."""
        f = self.ordered_float
        diffs = _zigzag(_ordered(new, f) - _ordered(old, f))
        changed = None
        if self.index == "bitmap":
            changed = np.zeros(n, dtype=bool)
            changed[positions] = True
        z = Zstd(self.level)
        widths = b""
        if self.index == "vgaps":
            gaps = np.diff(positions, prepend=0)
            gap_bytes = _narrowest(int(gaps.max()) if gaps.size else 0, 4)
            diff_bytes = _narrowest(int(diffs.max()) if diffs.size else 0, self.itemsize)
            # zstd tunes itself to the input's size, and for the narrow arrays its smaller tables
            # compress 3% worse (measured on finetune-bf16): above level 3 it gets the wide ones'.
            index = _zstd_as(BytePlane(gap_bytes).encode(gaps.astype(_UINT[gap_bytes]).view(np.uint8), None),
                             self.level, 4 * positions.size)
            planes = BytePlane(diff_bytes).encode(diffs.astype(_UINT[diff_bytes]).view(np.uint8), None)
            header = np.concatenate([np.array([index.nbytes, positions.size], dtype="<u8").view(np.uint8),
                                     np.frombuffer(bytes([gap_bytes, diff_bytes]) + bytes(6), dtype=np.uint8)])
            return np.concatenate([header, index, _zstd_as(planes, self.level, self.itemsize * positions.size)])
        elif self.index == "gaps":
            gaps = np.diff(positions, prepend=0).astype(np.uint32)
            index = z.encode(BytePlane(4).encode(gaps.view(np.uint8), None), None)
        else:
            index = z.encode(np.packbits(changed), None)  # type: ignore[arg-type]
        planes = BytePlane(diffs.itemsize).encode(diffs.view(np.uint8), None)
        header = np.concatenate([np.array([index.nbytes, positions.size], dtype="<u8").view(np.uint8),
                                 np.frombuffer(widths, dtype=np.uint8)])
        return np.concatenate([header, index, z.encode(planes, None)])

    def changes(self, data: np.ndarray, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions of the changed elements, their zigzag-decoded differences as unsigned ints)."""
        if nbytes % self.itemsize:
            raise CorruptCheckpoint("sparse_delta chunk has no base of the right size")
        n = nbytes // self.itemsize
        z = Zstd(self.level)
        try:
            index_len, count = (int(v) for v in data[:16].view("<u8"))
            head = self._header_bytes
            if count > n or index_len > data.nbytes - head:
                raise ValueError(f"{count} changes in a chunk of {n} elements, index of {index_len} bytes")
            index = data[head:head + index_len]
            gap_bytes, diff_bytes = 4, self.itemsize
            if self.index == "vgaps":
                gap_bytes, diff_bytes = int(data[16]), int(data[17])
                if gap_bytes not in (1, 2, 4) or diff_bytes not in _UINT or diff_bytes > self.itemsize:
                    raise ValueError(f"widths {gap_bytes}/{diff_bytes}")
            if self.index == "bitmap":
                positions = np.flatnonzero(np.unpackbits(z.decode(index, None, (n + 7) // 8), count=n).view(bool))
                if positions.size != count:
                    raise ValueError("the bitmap does not match its count of changes")
            else:
                raw = z.decode(index, None, count * gap_bytes)
                gaps = BytePlane(gap_bytes).decode(raw, None, raw.nbytes).view(_UINT[gap_bytes])
                positions = np.cumsum(gaps, dtype=np.intp)
                if count and (positions[-1] >= n or (count > 1 and gaps[1:].min() == 0)):
                    raise ValueError("positions are not increasing within the chunk")
            raw = z.decode(data[head + index_len:], None, count * diff_bytes)
        except (ValueError, TypeError) as e:
            raise CorruptCheckpoint(f"sparse_delta chunk is malformed ({e})") from None
        diffs = BytePlane(diff_bytes).decode(raw, None, raw.nbytes).view(_UINT[diff_bytes])
        uint = _UINT[self.itemsize]
        if diff_bytes < self.itemsize:
            diffs = diffs.astype(uint)
        return positions, _unzigzag(diffs)

    def apply(self, data: np.ndarray, out: np.ndarray) -> None:
        """Only the changed elements of ``out`` are touched."""
        positions, diffs = self.changes(data, out.nbytes)
        elements = out.view(_UINT[self.itemsize])
        f = self.ordered_float
        elements[positions] = _unordered(_ordered(elements[positions], f) + diffs, f)

    def add_to(self, data: np.ndarray, acc: np.ndarray) -> None:
        """Add this delta's differences to ``acc`` (the chunk's elements as ordered integers)."""
        positions, diffs = self.changes(data, acc.nbytes)
        acc[positions] += diffs  # positions are distinct within one delta

    def to_config(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": {"itemsize": self.itemsize, "ordered_float": self.ordered_float,
                                                     "level": self.level, "index": self.index}}


def _zstd_as(data: np.ndarray, level: int, source_size: int) -> np.ndarray:
    """A zstd frame of a sparse delta's index or differences. Up to level 3 it is the byte planes'
    order-0 coder (``_fast_compressor``): these streams are small numbers with skewed frequencies
    and few repeats, and it makes them 4.5% smaller than zstd's level 3 at 2.5x its speed (measured
    on finetune-bf16: docs/decisions.md, "Sparse streams"). Above, the parameters zstd picks for an
    input of ``source_size`` bytes, rounded up to a power of two of at least 64 KiB (few size
    classes, few contexts)."""
    if level <= 3:
        return np.frombuffer(_fast_compressor(level).compress(_mv(data)), dtype=np.uint8)
    size = max(source_size, 1 << 16)
    key = (level, size.bit_length())
    cache = Zstd._local.__dict__.setdefault("sized", {})
    if key not in cache:
        params = zstandard.ZstdCompressionParameters.from_level(level, source_size=1 << key[1],
                                                                write_checksum=0, write_content_size=1)
        cache[key] = zstandard.ZstdCompressor(compression_params=params)
    return np.frombuffer(cache[key].compress(_mv(data)), dtype=np.uint8)


def _narrowest(largest: int, limit: int) -> int:
    """The fewest bytes (1, 2, 4 or 8, at most ``limit``) that hold ``largest``."""
    for width in (1, 2, 4, 8):
        if width >= limit or largest < 1 << (8 * width):
            return min(width, limit)
    return limit


REGISTRY: dict[str, type] = {c.name: c for c in (Raw, XorDelta, BytePlane, Zstd, ArithDelta, SparseDelta, Planes)}


def from_configs(configs: list[dict[str, Any]]) -> list[Codec]:
    """Codec instances for a stored encoding; unknown names are a corrupt or newer checkpoint."""
    codecs = []
    for cfg in configs:
        try:
            cls = REGISTRY[cfg["name"]]
            codecs.append(cls(**cfg.get("configuration", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpoint(
                f"unknown codec configuration {cfg!r} ({e}); known codecs: {sorted(REGISTRY)}. "
                "Was this checkpoint written by a newer ckptlib? Upgrade to read it."
            ) from None
    return codecs


def encode(data: np.ndarray, codecs: list[Codec], base: np.ndarray | None = None) -> np.ndarray:
    for codec in codecs:
        data = codec.encode(data, base)
    return data


def decode(data: np.ndarray, codecs: list[Codec], nbytes: int, base: np.ndarray | None = None) -> np.ndarray:
    for codec in reversed(codecs):
        data = codec.decode(data, base, nbytes)
    return data


def decode_into(data: np.ndarray, codecs: list[Codec], out: np.ndarray) -> None:
    """Decode into ``out`` (1-D uint8 of the raw size). For a delta encoding (its first codec
    ``uses_base``), ``out`` holds the base's raw bytes on entry and is updated in place."""
    first, inner = codecs[0], codecs[1:]
    if any(c.uses_base for c in inner):
        raise CorruptCheckpoint("a delta codec can only be the first of an encoding")
    for codec in reversed(inner):
        data = codec.decode(data, None, out.nbytes)
    if first.uses_base:
        first.apply(data, out)  # type: ignore[attr-defined]
    else:
        first.decode_into(data, out)  # type: ignore[attr-defined]


def additive(codecs: list[Codec]) -> tuple[int, bool] | None:
    """(itemsize, ordered_float) when the encoding is an integer delta (sparse or dense) whose
    differences add up: the deltas of a chain can then be summed and applied in one pass."""
    first = codecs[0]
    if isinstance(first, (SparseDelta, ArithDelta)):
        return first.itemsize, first.ordered_float
    return None


def add_delta(data: np.ndarray, codecs: list[Codec], acc: np.ndarray) -> None:
    """Decode an additive delta (``additive(codecs)`` is not None) and add its differences to
    ``acc``, the chunk's elements as unsigned ordered integers."""
    first, inner = codecs[0], codecs[1:]
    for codec in reversed(inner):
        data = codec.decode(data, None, acc.nbytes)
    first.add_to(data, acc)  # type: ignore[attr-defined]


def to_ordered(raw: np.ndarray, itemsize: int, ordered_float: bool) -> np.ndarray:
    """A chunk's elements as unsigned integers that order like them (a new array)."""
    u = raw.view(_UINT[itemsize])
    return _ordered(u, True) if ordered_float else u.copy()


def from_ordered(acc: np.ndarray, ordered_float: bool, out: np.ndarray) -> None:
    """Write ordered integers ``acc`` back as the chunk's raw bytes ``out``."""
    out.view(acc.dtype)[:] = _unordered(acc, ordered_float)


def uses_base(configs: list[dict[str, Any]]) -> bool:
    return any(getattr(REGISTRY.get(str(c.get("name"))), "uses_base", False) for c in configs)


def keyframe_codecs(itemsize: int, level: int) -> list[Codec]:
    return [BytePlane(itemsize), Zstd(level)]


def delta_codecs(itemsize: int, level: int) -> list[Codec]:
    return [XorDelta(), BytePlane(itemsize), Zstd(level)]


def arith_codecs(itemsize: int, level: int, is_float: bool) -> list[Codec]:
    return [ArithDelta(itemsize, ordered_float=is_float), BytePlane(itemsize), Zstd(level)]


def sparse_codecs(itemsize: int, level: int, is_float: bool) -> list[Codec]:
    return [SparseDelta(itemsize, ordered_float=is_float, level=level, index="vgaps")]


def integer_deltas_apply(itemsize: int) -> bool:
    """arith_delta and sparse_delta work on 1, 2, 4 and 8 byte elements."""
    return itemsize in _UINT
