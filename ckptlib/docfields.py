"""The rules every JSON document of the format obeys: its version, its checksum, its caps, and the
checks of its fields.

Fragments (``ckptlib.fragment``), rank and group fragments (``ckptlib.distributed.documents``) and
manifests (``ckptlib.manifest``) are all parsed with these, so a malformed, truncated or hostile
document raises one ``CorruptCheckpoint`` naming where, never a raw KeyError/TypeError, and nothing
in it can make a reader allocate more than its cap. The field checks raise ``ValueError``;
``parse_document`` turns it into that ``CorruptCheckpoint``.

Stored, a document is its JSON in one zstd frame that declares its size (``pack``): a fragment's
digests and paths compress about 9x, and a manifest is a tenth of a delta save's bytes on a
partly frozen model without it. Readers take both that and plain JSON (what ckptlib wrote before):
``unpack`` checks the declared size against the cap before it allocates.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import zstandard

from .codecs import Zstd
from .errors import CorruptCheckpoint, FormatVersionError
from .types import MAX_LEAF_BYTES

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
CHECKSUM = "xxh3-128"  # the hash of chunk checksums and leaf digests, recorded in every fragment
MAX_CHAIN = 1024  # deepest delta chain a manifest may declare (keyframe_every is at most this)

# Caps of the documents (docs/format.md, "Caps"), checked before a document is read whole and by
# the writer, which refuses to write what a reader would refuse. A fragment costs about 290 bytes
# per chunk and 270 per leaf: 128 MiB holds some 450,000 chunks (1.7 TiB in 4 MiB chunks) per part.
MAX_FRAGMENT_BYTES = 128 << 20
MANIFEST_FIELDS_BYTES = 1 << 20  # a manifest's own fields and its meta
PART_REF_BYTES = 4 << 10  # one part's entry in a multi-part manifest (digest, sizes, stats, key)
MAX_MANIFEST_BYTES = MAX_FRAGMENT_BYTES + MANIFEST_FIELDS_BYTES  # a single-writer one embeds its fragment
# What a stored object may hold for ``nbytes`` raw bytes: a keyframe is at most the raw bytes (stored
# raw when zstd does not pay), a delta smaller than a keyframe; format 1's tiny zstd frames had headers.
STORED_SLACK_BYTES = 64 << 10


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# 79 KB of a fragment's JSON in 0.3 ms, to 9 KB (level 19: 7.7 KB in 20x the time); the chunks' own
# zstd codec, whose frames declare their size and whose decode checks it before allocating
_DOCUMENT_CODEC = Zstd(level=3)


def pack(data: bytes) -> bytes:
    """The stored bytes of a document's JSON ``data``: one zstd frame declaring its size."""
    return _DOCUMENT_CODEC.encode(np.frombuffer(data, dtype=np.uint8), None).tobytes()


def unpack(data: bytes, where: str, cap: int) -> bytes:
    """The JSON of the stored document ``data`` (``pack``'s frame, or plain JSON as it is), at most
    ``cap`` bytes: CorruptCheckpoint naming ``where`` for a frame that declares more, declares no
    size, holds anything after the frame or does not decode."""
    if not data.startswith(_ZSTD_MAGIC):
        return data
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise CorruptCheckpoint(f"{where} is not a document ckptlib wrote (its zstd frame header: {e})") from None
    if not 0 <= declared <= cap:
        size = "no size" if declared < 0 else f"{declared} bytes"
        raise CorruptCheckpoint(f"{where} declares {size} of JSON; ckptlib writes at most {cap}, with its size: it "
                                "was not written by ckptlib")
    try:
        return _DOCUMENT_CODEC.decode(np.frombuffer(data, dtype=np.uint8), None, declared).tobytes()
    except CorruptCheckpoint as e:
        raise CorruptCheckpoint(f"{where}: {e}: it was damaged") from None


def json_size(data: bytes) -> int:
    """The size of the JSON in the stored document ``data`` (read by ``parse_document`` already)."""
    return zstandard.frame_content_size(data) if data.startswith(_ZSTD_MAGIC) else len(data)


def multi_part_cap(parts: int) -> int:
    """The largest multi-part manifest of ``parts`` parts: O(parts), it names their fragments."""
    return MANIFEST_FIELDS_BYTES + parts * PART_REF_BYTES


def max_stored_bytes(nbytes: int) -> int:
    """The largest object an encoding of ``nbytes`` raw bytes is stored as."""
    return 2 * nbytes + STORED_SLACK_BYTES


_CHECKSUM = re.compile(r"^[0-9a-f]{32}$")


def int_field(v: Any, what: str, lo: int = 0, hi: int = MAX_LEAF_BYTES) -> int:
    """``v``, an int (not a bool) in ``[lo, hi]`` (ValueError)."""
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"{what} {v!r} is not an int in [{lo}, {hi}]")
    return v


def checksum_field(v: Any, what: str) -> str:
    """``v``, a checksum of the format's hash (ValueError)."""
    if not isinstance(v, str) or not _CHECKSUM.match(v):
        raise ValueError(f"{what} {str(v)[:40]!r} is not a {CHECKSUM} checksum")
    return v


def meta_field(v: Any) -> dict[str, Any]:
    """A document's ``meta``: an object of at most ``MANIFEST_FIELDS_BYTES`` (as writers refuse more).
    Measured as a lower bound of its JSON size, walking it and stopping as soon as it is over: the
    check costs no more than the cap, whatever was stored (ValueError)."""
    if not isinstance(v, dict):
        raise ValueError(f"meta is a {type(v).__name__}, not an object")
    budget, stack = MANIFEST_FIELDS_BYTES, [v]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            budget -= 1 + sum(len(k) + 4 for k in x)  # {"k":v,...}: quotes, colon, comma per member
            stack.extend(x.values())
        elif isinstance(x, list):
            budget -= 1 + len(x)
            stack.extend(x)
        else:
            budget -= len(x) + 2 if isinstance(x, str) else 1
        if budget < 0:
            raise ValueError(f"its meta is more than the {MANIFEST_FIELDS_BYTES} bytes any ckptlib writes "
                             "(writers refuse a larger meta)")
    return v


def parse_document(cls: Any, data: bytes, where: str, cap: int) -> Any:
    """``cls.from_json`` of ``data``, at most ``cap`` bytes: any malformation is one ``CorruptCheckpoint``
    naming ``where`` (a ``FormatVersionError`` passes as it is)."""
    if len(data) > cap:
        raise CorruptCheckpoint(f"{where} is {len(data)} bytes, more than the {cap} any {cls.__name__.lower()} "
                                "ckptlib writes may hold: it was not written by ckptlib")
    try:
        return cls.from_json(json.loads(unpack(data, where, cap)))
    except (FormatVersionError, CorruptCheckpoint) as e:
        if isinstance(e, CorruptCheckpoint) and where not in str(e):
            raise CorruptCheckpoint(f"{where}: {e}") from None
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptCheckpoint(
            f"{where} is not a valid {cls.__name__.lower()} ({type(e).__name__}: {str(e)[:300]}): it was damaged "
            "or written by something else"
        ) from None


def format_field(d: Any) -> int:
    """The format version of the document ``d``, one this ckptlib reads (else ``FormatVersionError``)."""
    if not isinstance(d, dict) or "format" not in d:
        raise KeyError("format")
    if d["format"] not in READABLE_FORMATS:
        raise FormatVersionError(
            f"checkpoint format version {str(d['format'])[:20]!r} is not supported by this ckptlib (reads versions "
            f"{', '.join(map(str, READABLE_FORMATS))}); install the ckptlib version that wrote it, or a newer one"
        )
    return int(d["format"])
