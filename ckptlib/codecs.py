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

import hashlib
import threading
from typing import Any, ClassVar, Protocol

import numpy as np
import zstandard

from .errors import CorruptCheckpoint

_DIGEST_SIZE = 16  # 128-bit blake2b: content addresses and checksums


def checksum(data: np.ndarray | bytes | memoryview) -> str:
    """Hex blake2b-128 of the bytes (hashlib releases the GIL for large buffers)."""
    return hashlib.blake2b(memoryview(data), digest_size=_DIGEST_SIZE).hexdigest()


class Codec(Protocol):
    """One reversible step. ``decode(encode(x, base), base) == x`` for every input."""

    name: ClassVar[str]

    def encode(self, data: np.ndarray, base: np.ndarray | None) -> np.ndarray: ...
    def decode(self, data: np.ndarray, base: np.ndarray | None, nbytes: int) -> np.ndarray: ...
    def to_config(self) -> dict[str, Any]: ...


class XorDelta:
    """XOR against the base chunk: unchanged bytes become zeros, which zstd erases."""

    name: ClassVar[str] = "xor_delta"

    def encode(self, data: np.ndarray, base: np.ndarray | None) -> np.ndarray:
        if base is None or base.nbytes != data.nbytes:
            raise ValueError("xor_delta needs a base chunk of the same size")
        return _xor(data, base)

    def decode(self, data: np.ndarray, base: np.ndarray | None, nbytes: int) -> np.ndarray:
        if base is None or base.nbytes != data.nbytes:
            raise CorruptCheckpoint(
                f"xor_delta chunk of {data.nbytes} bytes has a base of "
                f"{None if base is None else base.nbytes} bytes"
            )
        return _xor(data, base)

    def to_config(self) -> dict[str, Any]:
        return {"name": self.name}


def _xor(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.empty_like(a)
    n8 = a.nbytes - a.nbytes % 8  # XOR 8 bytes at a time where the length allows
    np.bitwise_xor(a[:n8].view(np.uint64), b[:n8].view(np.uint64), out=out[:n8].view(np.uint64))
    np.bitwise_xor(a[n8:], b[n8:], out=out[n8:])
    return out


class BytePlane:
    """Transpose element bytes into planes (all first bytes, then all second bytes, ...).

    Exponent and sign bytes of floats, and the zero high bytes of small deltas, line up into long
    runs that zstd compresses far better than interleaved bytes.
    """

    name: ClassVar[str] = "byteplane"

    def __init__(self, itemsize: int = 1):
        self.itemsize = int(itemsize)

    def _usable(self, n: int) -> bool:
        return self.itemsize > 1 and n % self.itemsize == 0

    def encode(self, data: np.ndarray, base: np.ndarray | None) -> np.ndarray:
        if not self._usable(data.nbytes):
            return data
        return np.ascontiguousarray(data.reshape(-1, self.itemsize).T).reshape(-1)

    def decode(self, data: np.ndarray, base: np.ndarray | None, nbytes: int) -> np.ndarray:
        if not self._usable(data.nbytes):
            return data
        return np.ascontiguousarray(data.reshape(self.itemsize, -1).T).reshape(-1)

    def to_config(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": {"itemsize": self.itemsize}}


class Zstd:
    """zstd frame with the content size and a frame checksum; one compressor per thread."""

    name: ClassVar[str] = "zstd"
    _local = threading.local()

    def __init__(self, level: int = 3):
        self.level = int(level)

    def _compressor(self) -> zstandard.ZstdCompressor:
        cache = self._local.__dict__.setdefault("compressors", {})
        if self.level not in cache:
            cache[self.level] = zstandard.ZstdCompressor(
                level=self.level, write_checksum=True, write_content_size=True
            )
        return cache[self.level]

    def encode(self, data: np.ndarray, base: np.ndarray | None) -> np.ndarray:
        return np.frombuffer(self._compressor().compress(memoryview(data)), dtype=np.uint8)

    def decode(self, data: np.ndarray, base: np.ndarray | None, nbytes: int) -> np.ndarray:
        dctx = self._local.__dict__.setdefault("decompressor", zstandard.ZstdDecompressor())
        try:
            out = dctx.decompress(memoryview(data), max_output_size=nbytes, allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise CorruptCheckpoint(f"zstd frame does not decode ({e})") from None
        if len(out) != nbytes:
            raise CorruptCheckpoint(f"zstd frame decoded to {len(out)} bytes, expected {nbytes}")
        return np.frombuffer(out, dtype=np.uint8)

    def to_config(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": {"level": self.level}}


class SparseDelta:
    """A delta as (bitmap of changed elements, their integer differences), each zstd-compressed.

    For updates that touch a minority of elements by small amounts (bf16 weights at small learning
    rates change ~10% of elements, mostly by one unit in the last place) this is far smaller than
    an XOR delta: the bitmap costs about its entropy and each difference a few bits. Floats are
    mapped to integers that order like the float values (sign-magnitude -> offset binary), so a
    one-ulp step is a difference of +-1 even across zero. Differences wrap modulo 2**bits, so any
    bit pattern (NaN payloads included) round-trips exactly. A complete codec: no zstd after it.
    """

    name: ClassVar[str] = "sparse_delta"
    _UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

    def __init__(self, itemsize: int, ordered_float: bool = False, level: int = 3):
        if itemsize not in self._UINT:
            raise ValueError(f"sparse_delta supports element sizes 1, 2, 4, 8, not {itemsize}")
        self.itemsize, self.ordered_float, self.level = int(itemsize), bool(ordered_float), int(level)

    def _ordered(self, x: np.ndarray) -> np.ndarray:
        if not self.ordered_float:
            return x
        top = x.dtype.type(1 << (8 * self.itemsize - 1))
        return np.where(x & top, ~x, x | top)

    def _unordered(self, u: np.ndarray) -> np.ndarray:
        if not self.ordered_float:
            return u
        top = u.dtype.type(1 << (8 * self.itemsize - 1))
        return np.where(u & top, u & ~top, ~u)

    def _zigzag(self, d: np.ndarray) -> np.ndarray:  # uint wrap-around diff -> small unsigned
        shift = d.dtype.type(8 * self.itemsize - 1)
        signed = d.view(np.dtype(f"i{self.itemsize}"))
        return ((d << d.dtype.type(1)) ^ (signed >> signed.dtype.type(shift)).view(d.dtype))

    def _unzigzag(self, z: np.ndarray) -> np.ndarray:
        one = z.dtype.type(1)
        return (z >> one) ^ (np.zeros_like(z) - (z & one))

    def encode(self, data: np.ndarray, base: np.ndarray | None) -> np.ndarray:
        if base is None or base.nbytes != data.nbytes or data.nbytes % self.itemsize:
            raise ValueError("sparse_delta needs a base chunk of the same size, whole elements")
        uint = self._UINT[self.itemsize]
        new, old = data.view(uint), base.view(uint)
        changed = new != old
        diffs = self._zigzag(self._ordered(new[changed]) - self._ordered(old[changed]))
        planes = BytePlane(self.itemsize).encode(diffs.view(np.uint8), None)
        z = Zstd(self.level)
        bitmap = z.encode(np.packbits(changed), None)
        header = np.array([bitmap.nbytes, int(changed.sum())], dtype="<u8").view(np.uint8)
        return np.concatenate([header, bitmap, z.encode(planes, None)])

    def decode(self, data: np.ndarray, base: np.ndarray | None, nbytes: int) -> np.ndarray:
        if base is None or base.nbytes != nbytes:
            raise CorruptCheckpoint("sparse_delta chunk has no base of the right size")
        try:
            bitmap_len, count = (int(v) for v in data[:16].view("<u8"))
            uint = self._UINT[self.itemsize]
            n = nbytes // self.itemsize
            z = Zstd(self.level)
            changed = np.unpackbits(z.decode(data[16:16 + bitmap_len], None, (n + 7) // 8), count=n).view(bool)
            planes = z.decode(data[16 + bitmap_len:], None, count * self.itemsize)
        except (ValueError, TypeError) as e:
            raise CorruptCheckpoint(f"sparse_delta chunk is malformed ({e})") from None
        if int(changed.sum()) != count:
            raise CorruptCheckpoint("sparse_delta bitmap does not match its count of changes")
        diffs = BytePlane(self.itemsize).decode(planes, None, count * self.itemsize).view(uint)
        out = base.view(uint).copy()
        out[changed] = self._unordered(self._ordered(out[changed]) + self._unzigzag(diffs))
        return out.view(np.uint8)

    def to_config(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": {"itemsize": self.itemsize,
                                                     "ordered_float": self.ordered_float, "level": self.level}}


REGISTRY: dict[str, type] = {c.name: c for c in (XorDelta, BytePlane, Zstd, SparseDelta)}


def from_configs(configs: list[dict[str, Any]]) -> list[Codec]:
    """Codec instances for a stored encoding; unknown names are a corrupt or newer checkpoint."""
    codecs = []
    for cfg in configs:
        try:
            cls = REGISTRY[cfg["name"]]
            codecs.append(cls(**cfg.get("configuration", {})))
        except (KeyError, TypeError) as e:
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


def uses_base(configs: list[dict[str, Any]]) -> bool:
    return any(c["name"] in (XorDelta.name, SparseDelta.name) for c in configs)


def keyframe_codecs(itemsize: int, level: int) -> list[Codec]:
    return [BytePlane(itemsize), Zstd(level)]


def delta_codecs(itemsize: int, level: int) -> list[Codec]:
    return [XorDelta(), BytePlane(itemsize), Zstd(level)]


def sparse_codecs(itemsize: int, level: int, is_float: bool) -> list[Codec] | None:
    """The sparse delta for this element size, or None where it does not apply."""
    if itemsize not in SparseDelta._UINT:
        return None
    return [SparseDelta(itemsize, ordered_float=is_float, level=level)]
