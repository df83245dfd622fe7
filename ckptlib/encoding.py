"""How one unit (a chunk, or a pack of small leaves) is stored: unchanged, a delta, or a keyframe.

Pure: bytes in, (codecs, payload) out; no I/O. Called by ``save.encode_part`` for every unit of a
part, with the unit's previous version (its delta base) when the writer holds one. The rules
(docs/format.md, "Encoding a unit"):

* ``unchanged``: the unit's raw checksum is already in the base's blob table: nothing is written,
  the fragment references the stored object.
* ``delta`` against the previous version of the same unit, while its chain is shorter than
  ``keyframe_every`` (lowered by up to a quarter for some units, so chains that began together do
  not all end at the same save), the chain's deltas stay within ``delta_budget`` keyframes, and the
  delta is at least 10% smaller than a keyframe (a dense delta, one that changes most elements:
  25%).
* ``keyframe`` otherwise: byte planes, each zstd-coded only where that pays, or the raw bytes when
  nothing does.

Which byte planes to code is measured on a sample of each chunk (a function of its bytes: the
same chunk is always the same object). Whether a delta paid is remembered per unit (``UnitHint``)
and spares the next save work that cannot pay: a unit whose dense delta did not pay is written as
keyframes from then on, and its writer keeps no base bytes for it (a delta is tried again every
``PROBE_EVERY`` saves, staggered by position); nor for a unit found unchanged twice in a row; nor
for one whose chain is at its bound (``takes_delta``: with ``keyframe_every=1``, none is kept).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from . import codecs
from .chunking import Unit
from .manifest import Blob

# A delta lengthens the chain a restore must decode, so it is kept only when it is at least this
# much smaller than a keyframe of the same chunk, and while the chain's deltas, it included, add up
# to at most ``delta_budget`` keyframes of the chunk as it is now. The keyframe is estimated by the
# size of the chain's own keyframe, and encoded only when the estimate says the delta may not do.
_DELTA_PAYS = 0.9
# Defaults of a Checkpointer (measured in docs/decisions.md, "Keyframes by budget"): a chunk's chain
# gets a new keyframe once its deltas add up to twice the keyframe's size, or after 32 links.
DEFAULT_KEYFRAME_EVERY = 32
DEFAULT_DELTA_BUDGET = 2.0
# A dense delta (most elements changed: the previous version held in memory, a snapshot into fresh
# memory, one more link per restore) must save more: dense fp32 AdamW deltas between saves 10 steps
# apart save 13-18% over a keyframe (dense-lm, tinylm), sparse ones 60-98% (docs/decisions.md 42).
_DENSE_DELTA_PAYS = 0.75
# Below this share of changed elements a sparse delta beats a dense one (measured on the tinylm,
# recsys, finetune and finetune-bf16 workloads: within 0.5% of always picking the smaller).
_SPARSE_BELOW = 0.3
# A byte plane is coded when zstd shrinks it by at least this much (else it is stored raw).
_PLANE_PAYS = 0.97
# A unit that keeps no base bytes tries a delta again (and re-measures its planes) every this many saves.
PROBE_EVERY = 16
# After this many saves in a row that found a unit unchanged, its writer stops holding its bytes.
_STILL_KEEPS = 2
# A keyframe that zstd shrinks by less than this is stored raw: its restore is then a copy
# (docs/decisions.md, "Raw keyframes").
RAW_KEYFRAME_ABOVE = 0.98


@dataclass(frozen=True)
class EncodeOptions:
    """What bounds a unit's delta chain and how hard zstd works."""

    keyframe_every: int = DEFAULT_KEYFRAME_EVERY  # longest chain + 1: a restore reads at most this many objects
    delta_budget: float | None = DEFAULT_DELTA_BUDGET  # a chain's deltas add up to at most this many keyframes
    zstd_level: int = 3
    # False: no compression, only the cheap wins (a checkpoint read back soon and then deleted, e.g. a
    # shard's within its round: the CPU it takes from training matters more than its bytes). A unit
    # is stored raw unless it is unchanged or its snapshot found a sparse change (a sparse delta).
    compress: bool = True


@dataclass(frozen=True)
class Previous:
    """The previous version of a unit: its raw checksum, its raw bytes, its stored blob.

    ``changes``: set when a snapshot found the unit's changes itself (``save.take_secure_snapshot``):
    ``data`` then holds the new bytes already (patched in place) and ``changes`` is (positions of
    the changed elements, their old values as unsigned integers)."""

    digest: str
    data: np.ndarray
    blob: Blob
    changes: tuple[np.ndarray, np.ndarray] | None = None


@dataclass(frozen=True)
class UnitHint:
    """What encoding a unit found, for its next save: whether its last dense delta failed to pay
    (``dense``), how many saves in a row found it unchanged (``still``), how many saves it has
    seen (``saves``: when to try a delta again), and whether its last change was patched by the
    snapshot (``patched``: else the next snapshot copies it without comparing first)."""

    dense: bool = False
    still: int = 0
    saves: int = 0
    patched: bool = True  # its last change was few enough for a snapshot by difference (or none was seen)

    def due(self, position: int) -> bool:
        return (self.saves + position) % PROBE_EVERY == 0

    def keep_bytes(self, position: int) -> bool:
        """Whether the writer keeps this unit's bytes as the base of its next save: not when deltas
        do not pay for it (but before a save that tries one again), nor when it was unchanged twice
        in a row (a frozen weight: if it ever changes, that save writes a keyframe)."""
        if self.dense:
            return self.due(position)
        return self.still < _STILL_KEEPS


@dataclass
class EncodedUnit:
    """One unit's raw checksum and, unless it is unchanged, the blob to store and its payload;
    ``hint``: what this encode measured, for the unit's next save."""

    digest: str
    kind: str  # "unchanged" | "delta" | "keyframe"
    blob: Blob | None = None
    payload: np.ndarray | None = None
    hint: UnitHint = UnitHint()


def encode_unit(view: np.ndarray, unit: Unit, position: int, known: dict[str, Blob], previous: Previous | None,
                opts: EncodeOptions, hint: UnitHint | None = None) -> EncodedUnit:
    """Encode the raw bytes ``view`` of ``unit`` (the ``position``-th of its part). ``known``: the
    base's blob table (raw checksum -> stored blob); ``previous``: the unit's delta base, if held;
    ``hint``: what its previous encode measured."""
    hint = replace(hint or UnitHint(), saves=(hint.saves + 1) if hint else 1)
    digest = codecs.checksum(view)
    if digest in known:
        return EncodedUnit(digest, "unchanged", hint=replace(hint, still=hint.still + 1))
    hint = replace(hint, still=0, patched=previous is None or previous.changes is not None)
    if (previous is not None and (opts.compress or previous.changes is not None)
            and takes_delta(previous.blob.depth, opts.keyframe_every, position)):
        chosen, payload, base, hint = _delta_or_keyframe(view, unit, previous, known, opts, hint)
    else:
        (chosen, payload), base = keyframe(view, unit, opts.zstd_level if opts.compress else None), None
        if not opts.compress and previous is not None:
            # a change its snapshot did not find sparse: without compression no delta of it pays, so
            # its bytes are not kept (the snapshot buffers go round; a probe tries a delta again)
            hint = replace(hint, dense=True)
    configs = [c.to_config() for c in chosen]
    depth = 0 if base is None else previous.blob.depth + 1  # type: ignore[union-attr]
    blob = Blob(blob_key(digest, base, configs), payload.nbytes, view.nbytes, tuple(configs), base, depth)
    return EncodedUnit(digest, "keyframe" if base is None else "delta", blob, payload, hint)


def _delta_or_keyframe(view: np.ndarray, unit: Unit, previous: Previous, known: dict[str, Blob],
                       opts: EncodeOptions, hint: UnitHint) -> tuple[list, np.ndarray, str | None, UnitHint]:
    """(codecs, payload, base checksum or None, hint): a delta against ``previous``, unless a
    keyframe is better. The chain's own keyframe estimates this unit's; only when the estimate says
    a keyframe may be better is one encoded, to decide on its real size."""
    chosen: list
    if previous.changes is not None:  # a sparse change found by the snapshot
        positions, old = previous.changes
        sparse = codecs.SparseDelta(unit.itemsize, unit.is_float, opts.zstd_level, index="vgaps")
        elements = view.view(f"u{unit.itemsize}")
        chosen, payload = [sparse], sparse.encode_changes(positions, elements[positions], old, elements.size)
    else:
        chosen, payload = dense_or_sparse_delta(view, previous.data, unit, opts.zstd_level)
    dense = not isinstance(chosen[0], codecs.SparseDelta)
    pays = _DENSE_DELTA_PAYS if dense else _DELTA_PAYS
    key_estimate, chain_deltas = chain_sizes(previous.blob, known)
    chain_deltas += payload.nbytes
    if keyframe_better(payload.nbytes, chain_deltas, key_estimate, opts.delta_budget, pays):
        key_codecs, key_payload = keyframe(view, unit, opts.zstd_level if opts.compress else None)
        if keyframe_better(payload.nbytes, chain_deltas, key_payload.nbytes, opts.delta_budget, pays):
            # a dense delta that does not pay marks the unit dense (no base bytes kept for it)
            return key_codecs, key_payload, None, replace(hint, dense=dense and payload.nbytes >= pays * key_payload.nbytes)
    return chosen, payload, previous.digest, replace(hint, dense=False)


def dense_or_sparse_delta(view: np.ndarray, base_view: np.ndarray, unit: Unit, level: int) -> tuple[list, np.ndarray]:
    """(codecs, payload): a sparse or dense integer delta for 1/2/4/8-byte elements, XOR for
    anything else. A dense delta codes the byte planes of its differences that pay."""
    if not codecs.integer_deltas_apply(unit.itemsize):
        chosen = codecs.delta_codecs(unit.itemsize, level)
        return chosen, codecs.encode(view, chosen, base_view)
    uint = np.dtype(f"u{unit.itemsize}")
    changed = np.count_nonzero(view.view(uint) != base_view.view(uint))
    if changed < _SPARSE_BELOW * (view.nbytes // unit.itemsize):
        chosen = codecs.sparse_codecs(unit.itemsize, level, unit.is_float)
        return chosen, codecs.encode(view, chosen, base_view)
    arith = codecs.ArithDelta(unit.itemsize, ordered_float=unit.is_float)
    differences = arith.encode(view, base_view)
    planes = codecs.Planes(unit.itemsize, codecs.Planes.paying(differences, unit.itemsize, level, _PLANE_PAYS), level)
    return [arith, planes], planes.encode(differences, None)


def keyframe(view: np.ndarray, unit: Unit, level: int | None) -> tuple[list, np.ndarray]:
    """(codecs, payload) of a keyframe: byte planes, zstd-coded at ``level`` where that pays
    (measured on a sample of the chunk), or the raw bytes when nothing does (or ``level`` is None)."""
    if level is None:
        return [codecs.Raw()], view
    itemsize = unit.itemsize if 1 <= unit.itemsize <= 16 else 1
    planes = codecs.Planes.paying(view, itemsize, level, _PLANE_PAYS)
    if not planes:
        return [codecs.Raw()], view
    codec = codecs.Planes(itemsize, planes, level)
    payload = codec.encode(view, None)
    if payload.nbytes >= RAW_KEYFRAME_ABOVE * view.nbytes:
        return [codecs.Raw()], view
    return [codec], payload


def chain_sizes(blob: Blob, known: dict[str, Blob]) -> tuple[int, int]:
    """(encoded size of the keyframe at the root of ``blob``'s delta chain, or its raw size if
    unknown; encoded bytes of the chain's deltas up to and including ``blob``)."""
    deltas = 0
    while blob.base is not None and blob.base in known:
        deltas += blob.size
        blob = known[blob.base]
    if blob.base is not None:
        return blob.nbytes, deltas + blob.size
    return blob.size, deltas


def keyframe_better(delta: int, chain_deltas: int, keyframe: int, budget: float | None, pays: float = _DELTA_PAYS) -> bool:
    """Whether a keyframe of ``keyframe`` bytes beats a delta of ``delta`` bytes that would bring its
    chain's deltas to ``chain_deltas`` bytes: the delta is not ``pays`` times smaller, or the chain
    is over budget."""
    return delta >= pays * keyframe or (budget is not None and chain_deltas > budget * keyframe)


def chain_cap(keyframe_every: int, position: int) -> int:
    """The chain bound of the unit at ``position`` in the part: ``keyframe_every``, lowered by up to
    a quarter for some positions. Units whose chains all started at one save (the first, say) would
    otherwise all reach the bound at the same save, and that save would upload the whole state
    again; staggered, the keyframes spread over a quarter of the cycle. Never above the bound."""
    spread = keyframe_every // 4
    return keyframe_every - position % spread if spread > 1 else keyframe_every


def takes_delta(depth: int, keyframe_every: int, position: int) -> bool:
    """Whether the next version of the unit at ``position``, stored now as a blob ``depth`` links
    from its keyframe, may be a delta against it (else that save writes a keyframe, whatever its
    bytes: a writer need not keep these)."""
    return depth + 1 < chain_cap(keyframe_every, position)


def blob_key(raw_digest: str, base: str | None, codec_configs: list[dict[str, Any]]) -> str:
    """Content-derived object key: the same chunk encoded the same way always lands on the same key."""
    ident = json.dumps([raw_digest, base, codec_configs], sort_keys=True, separators=(",", ":"))
    h = hashlib.blake2b(ident.encode(), digest_size=16).hexdigest()
    return f"chunks/{h[:2]}/{h}"
