"""A store written by someone else: edited manifests, hostile chunks, odd keys, symbolic links.

Every case must end in a clear ``CheckpointError`` (``CorruptCheckpoint``, ``StoreError``, ...) or
in correct behaviour: never a raw KeyError/TypeError/IndexError/RecursionError/MemoryError, never
a hang, never a read, write or delete outside the store. For each damaged checkpoint ``restore``
refuses, ``verify`` never says [] (it lists problems or refuses), ``export`` refuses and writes no
file, and the other, intact step still restores.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptlib import (
    Checkpointer,
    CheckpointError,
    CorruptCheckpoint,
    NoCheckpoint,
    RetentionPolicy,
    StoreError,
)
from ckptlib.store import Store, WrapperStore
from ckptlib.testing import document_json
from ckptlib.testing.protocol import assert_same_state

CHUNK = 4096
pytestmark = pytest.mark.timeout(60)
RAW_ERRORS = (KeyError, TypeError, IndexError, RecursionError, MemoryError, AttributeError, ValueError,
              OverflowError, ZeroDivisionError, UnicodeError)


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3072, generator=g)  # 3 whole chunks
    b = torch.randn(3072, generator=g)  # same size: chunks can be swapped with a's
    n = np.arange(700, dtype=np.int64)  # 5600 bytes: 2 chunks, the last one short
    small = torch.arange(10, dtype=torch.float32)  # packed
    if step >= 2:
        a[:20] += 1.0  # sparse deltas
        b += 0.001  # dense deltas
        n[::7] += 3
    return {"model": {"a": a, "b": b, "small": small}, "n": n, "step": step}


@pytest.fixture(scope="module")
def _run_template(tmp_path_factory) -> Path:
    """A local run: step 1 (keyframes), step 2 (deltas against 1); built once, copied per test."""
    root = tmp_path_factory.mktemp("hostile") / "run"
    with Checkpointer(str(root), chunk_bytes=CHUNK) as ck:
        ck.save(1, state(1))
        ck.restore(1, keep_base=True)
        info = ck.save(2, state(2))
        assert info.chunks["delta"] >= 3
    for lease in (root / "leases").glob("*"):
        lease.unlink()
    return root


def _copy_of(template: Path, tmp_path: Path, name: str) -> Path:
    shutil.copytree(template, tmp_path / name, symlinks=True)
    return tmp_path / name


@pytest.fixture
def run(_run_template, tmp_path) -> Path:
    return _copy_of(_run_template, tmp_path, "run")


PARTS = ("shard-0", "shard-1")


@pytest.fixture(scope="module")
def _cut_template(tmp_path_factory) -> Path:
    """A local run of two multi-part cuts (steps 1, 2)."""
    root = tmp_path_factory.mktemp("hostile-cut") / "cut"
    for step in (1, 2):
        for i, part in enumerate(PARTS):
            with Checkpointer(str(root), chunk_bytes=CHUNK) as ck:
                s = state(step)
                s["model"]["a"] += i
                ck.write_fragment(step, part, s, config_hash="h")
        with Checkpointer(str(root)) as ck:
            ck.commit(step, list(PARTS), timeout=5)
    return root


@pytest.fixture
def cut_run(_cut_template, tmp_path) -> Path:
    return _copy_of(_cut_template, tmp_path, "cut")


# ----------------------------------------------------------------------------- manifest surgery


def load(run: Path, step: int) -> dict:
    return document_json((run / "manifests" / f"{step}.json").read_bytes())


def store_doc(run: Path, step: int, doc: dict) -> None:
    text = json.dumps(doc)
    for name, deep in DEEP_TEXT.items():
        text = text.replace(json.dumps(DEEP + name), deep)
    (run / "manifests" / f"{step}.json").write_text(text)


def fragment_of(doc: dict, part: str = "state") -> dict:
    p = doc["parts"][part]
    return p["fragment"] if isinstance(p, dict) and "fragment" in p else p


def leaf(frag: dict, path: str) -> dict:
    return next(x for x in frag["leaves"] if x["path"] == path)


def _logical(x: dict) -> dict:
    shape = x["shape"]
    d = {"path": x["path"], "kind": x["kind"], "dtype": x["dtype"], "shape": list(shape) if isinstance(shape, list) else shape}
    for key, default in (("stride", None), ("order", "C"), ("param", False), ("requires_grad", False)):
        if x.get(key, default) != default:
            d[key] = list(x[key]) if key == "stride" else x[key]
    return d


def part_digest(frag: dict) -> str:
    """The logical digest of a fragment, as docs/format.md defines it (formats 1 and 2)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(frag["skeleton"], separators=(",", ":")).encode())
    for x in frag["leaves"]:
        if frag.get("format", 1) == 1:
            h.update(f"\0{x['path']}\0{x['kind']}\0{x['dtype']}\0{list(x['shape'])}\0{x['digest']}".encode())
        else:
            h.update(b"\0" + json.dumps(_logical(x), separators=(",", ":")).encode() + b"\0" + x["digest"].encode())
    return h.hexdigest()


def reseal(doc: dict) -> dict:
    """Recompute the digests of a single-writer manifest after an edit, as a forger would: the
    edit then passes every consistency check of the documents, and only the reader can catch it."""
    frag = fragment_of(doc)
    digest = part_digest(frag)
    frag["digest"] = digest
    if "fragment" in doc["parts"]["state"]:
        doc["parts"]["state"]["digest"] = digest
    doc["digest"] = digest
    return doc


def test_reseal_reproduces_the_writers_digests(run):
    for step in (1, 2):
        doc = load(run, step)
        assert reseal(json.loads(json.dumps(doc)))["digest"] == doc["digest"]


def delta_blobs(frag: dict) -> list[tuple[str, dict]]:
    return [(k, b) for k, b in frag["blobs"].items() if b["base"] is not None]


# ----------------------------------------------------------------------------- the refusal harness


def assert_refused(url: str | Path, step: int, tmp_path: Path, *, intact: dict[int, dict] | None = None,
                   part: str | None = None) -> CheckpointError:
    """restore, verify and export of ``step`` all refuse, clearly; the ``intact`` steps still restore."""
    url = str(url)
    with Checkpointer(url) as ck:
        with pytest.raises(CheckpointError) as err:
            ck.restore(step, part=part)
        assert not isinstance(err.value, NoCheckpoint), f"a damaged step reads as not committed: {err.value}"
        assert str(err.value), "an error without a message"
    with Checkpointer(url) as ck:
        try:
            problems = ck.verify(step)
        except CheckpointError as e:
            problems = [e]
        assert problems, "verify says [] for a checkpoint that restore cannot read"
    out = tmp_path / "exports" / "out.pt"
    out.parent.mkdir(exist_ok=True)
    with Checkpointer(url) as ck, pytest.raises(CheckpointError):
        ck.export(step, str(out), part=part)
    assert list(out.parent.iterdir()) == [], "export left a file behind"
    for good, expected in (intact or {}).items():
        with Checkpointer(url) as ck:
            assert_same_state(expected, ck.restore(good, part=part), f"intact step {good}")
    return err.value


def edit_and_check(run: Path, tmp_path: Path, step: int, edit, *, resealed: bool = False) -> CheckpointError:
    doc = load(run, step)
    edit(doc, fragment_of(doc))
    if resealed:
        reseal(doc)
    store_doc(run, step, doc)
    other = 2 if step == 1 else 1
    return assert_refused(run, step, tmp_path, intact={other: state(other)})


# ----------------------------------------------------------------------------- edited manifests


def _reorder(doc, frag):
    leaf(frag, "/model/a")["chunks"].reverse()


def _swap_tensors(doc, frag):
    a, b = leaf(frag, "/model/a"), leaf(frag, "/model/b")
    a["chunks"], b["chunks"] = b["chunks"], a["chunks"]


def _relabel(doc, frag):
    leaf(frag, "/model/a")["dtype"] = "int32"


def _nbytes_zero(doc, frag):
    leaf(frag, "/model/a")["nbytes"] = 0


def _blob_nbytes_zero(doc, frag):
    key = leaf(frag, "/model/a")["chunks"][0]
    frag["blobs"][key]["nbytes"] = 0


def _negative_chunk_bytes(doc, frag):
    leaf(frag, "/model/a")["chunk_bytes"] = -CHUNK


def _zero_chunk_bytes(doc, frag):
    leaf(frag, "/model/a")["chunk_bytes"] = 0


def _parts_empty(doc, frag):
    doc["parts"] = {}


def _parts_not_a_dict(doc, frag):
    doc["parts"] = ["state"]


def _base_is_itself(doc, frag):
    key, blob = delta_blobs(frag)[0]
    blob["base"] = key


def _cycle_of_two(doc, frag):
    key, blob = delta_blobs(frag)[0]
    frag["blobs"][blob["base"]]["base"] = key  # its keyframe becomes a delta of it


def _cycle_of_three(doc, frag):
    k1, b1 = next((k, b) for k, b in delta_blobs(frag) if b["nbytes"] == CHUNK)
    k0 = b1["base"]
    k2 = next(k for k, b in frag["blobs"].items() if b["nbytes"] == b1["nbytes"] and k not in (k0, k1))
    frag["blobs"][k0]["base"] = k2
    frag["blobs"][k2]["base"] = k1  # k1 -> k0 -> k2 -> k1


def _base_missing(doc, frag):
    _, blob = delta_blobs(frag)[0]
    blob["base"] = "0" * 32


def _empty_codecs(doc, frag):
    for b in frag["blobs"].values():
        b["codecs"] = []


def _unknown_codec(doc, frag):
    key = leaf(frag, "/model/a")["chunks"][0]
    frag["blobs"][key]["codecs"] = [{"name": "rot13"}]


def _codec_bad_configuration(doc, frag):
    key = leaf(frag, "/model/a")["chunks"][0]
    frag["blobs"][key]["codecs"] = [{"name": "byteplane", "configuration": {"itemsize": -4, "evil": 1}}]


def _codec_not_a_dict(doc, frag):
    key = leaf(frag, "/model/a")["chunks"][0]
    frag["blobs"][key]["codecs"] = ["zstd"]


def _delta_codec_on_a_keyframe(doc, frag):
    key = leaf(frag, "/model/a")["chunks"][0]
    frag["blobs"][key]["codecs"] = [{"name": "xor_delta"}, *frag["blobs"][key]["codecs"]]


def _delta_codec_in_the_middle(doc, frag):
    key = leaf(frag, "/model/a")["chunks"][0]
    frag["blobs"][key]["codecs"] = [{"name": "byteplane", "configuration": {"itemsize": 4}},
                                    {"name": "xor_delta"}, {"name": "zstd", "configuration": {"level": 3}}]


def _blob_key_outside(doc, frag):
    key = leaf(frag, "/model/a")["chunks"][0]
    frag["blobs"][key]["key"] = "../../../etc/passwd"


def _blob_key_of_another_object(doc, frag):
    a, b = leaf(frag, "/model/a")["chunks"][0], leaf(frag, "/model/b")["chunks"][0]
    frag["blobs"][a]["key"] = frag["blobs"][b]["key"]


def _blob_size_lies(doc, frag):
    key = leaf(frag, "/model/a")["chunks"][0]
    frag["blobs"][key]["size"] += 1


def _pack_offset_outside(doc, frag):
    leaf(frag, "/model/small")["offset"] = 10**9


def _leaf_index_out_of_range(doc, frag):
    frag["skeleton"]["model"]["a"] = {"__leaf__": 99}


def _skeleton_with_code(doc, frag):
    frag["skeleton"]["model"]["a"] = {"__map__": {"type": "os.system", "items": [["echo", "pwned"]]}}


DEEP = "@@deep@@"  # replaced in the JSON text: json.dumps itself cannot write 5,000 levels
DEEP_TEXT = {"lists": "[" * 5000 + "0" + "]" * 5000, "dicts": '{"k":' * 5000 + "0" + "}" * 5000}


def _deep_skeleton(doc, frag):
    frag["skeleton"]["model"]["deep"] = DEEP + "lists"


def _deep_dict_skeleton(doc, frag):
    frag["skeleton"]["model"]["deep"] = DEEP + "dicts"


def _wrong_step(doc, frag):
    doc["step"] = 7


def _future_format(doc, frag):
    doc["format"] = 99


def _chunk_count_lies(doc, frag):
    leaf(frag, "/model/a")["chunks"].append(leaf(frag, "/model/a")["chunks"][0])


def _depth_huge(doc, frag):
    _, blob = delta_blobs(frag)[0]
    blob["depth"] = 10**12


def _stride_lies(doc, frag):
    leaf(frag, "/model/a")["stride"] = [0]


# --- forged trees: digests recomputed, so only the decoder's grammar can refuse them (each of these
# built an object save never writes, or raised a raw error, before the decoder checked its grammar)

def _skel(frag):
    return frag["skeleton"]


def _tensor_data_attribute(doc, frag):  # a 3072-element tensor came back with another's data
    _skel(frag)["model"]["a"] = {"__attrs__": [_skel(frag)["model"]["a"], {"data": _skel(frag)["model"]["b"]}]}


def _tensor_shape_attribute(doc, frag):  # a read-only property: AttributeError from setattr
    _skel(frag)["model"]["a"] = {"__attrs__": [_skel(frag)["model"]["a"], {"shape": 5}]}


def _ordered_dict_shadowing_items(doc, frag):
    _skel(frag)["model"] = {"__map__": {"type": "OrderedDict", "items": [["a", _skel(frag)["model"]["a"]]],
                                        "attrs": {"items": 1, "keys": [1]}}}


def _attributes_on_a_str(doc, frag):
    _skel(frag)["step"] = {"__attrs__": ["hello", {"upper": 1}]}


def _attributes_on_a_list(doc, frag):
    _skel(frag)["step"] = {"__attrs__": [[1, 2], {"x": 1}]}


def _tensor_as_dict_key(doc, frag):
    _skel(frag)["model"] = {"__items__": [[_skel(frag)["model"]["a"], 1], ["b", _skel(frag)["model"]["b"]]]}


def _set_of_tensors(doc, frag):
    _skel(frag)["model"]["a"] = {"__set__": [_skel(frag)["model"]["a"]]}


def _negative_size(doc, frag):
    _skel(frag)["step"] = {"__size__": [-5]}


def _bad_device(doc, frag):
    _skel(frag)["step"] = {"__device__": "warpdrive:0"}


def _leaf_placed_twice(doc, frag):
    _skel(frag)["model"]["b"] = dict(_skel(frag)["model"]["a"])


def _ref_to_a_numpy_leaf(doc, frag):
    _skel(frag)["model"]["b"] = {"__ref__": _skel(frag)["n"]["__leaf__"]}


def _nan_outside_its_tag(doc, frag):
    _skel(frag)["step"] = float("nan")


FORGED_TREES = {
    "tensor-data-attribute": _tensor_data_attribute,
    "tensor-shape-attribute": _tensor_shape_attribute,
    "ordered-dict-shadowing-items": _ordered_dict_shadowing_items,
    "attributes-on-a-str": _attributes_on_a_str,
    "attributes-on-a-list": _attributes_on_a_list,
    "tensor-as-dict-key": _tensor_as_dict_key,
    "set-of-tensors": _set_of_tensors,
    "negative-size": _negative_size,
    "bad-device": _bad_device,
    "leaf-placed-twice": _leaf_placed_twice,
    "ref-to-a-numpy-leaf": _ref_to_a_numpy_leaf,
    "nan-outside-its-tag": _nan_outside_its_tag,
}


def assert_forgery_refused(run: Path, tmp_path: Path, edit, intact: dict) -> None:
    """Step 1 with ``edit`` applied and its digests recomputed is refused by the decoder, naming where."""
    doc = load(run, 1)
    edit(doc, fragment_of(doc))
    reseal(doc)
    (run / "manifests" / "1.json").write_text(json.dumps(doc))  # NaN as the literal json writes
    err = assert_refused(run, 1, tmp_path, intact=intact)
    assert isinstance(err, CorruptCheckpoint), err
    assert "skeleton" in str(err) and "at '/" in str(err), err


@pytest.mark.parametrize("name", list(FORGED_TREES))
def test_a_forged_tree_is_refused_naming_where(run, tmp_path, name):
    """The decoder builds only what save writes: restore, verify and export refuse with a
    CorruptCheckpoint that names the path, whatever the digests say."""
    assert_forgery_refused(run, tmp_path, FORGED_TREES[name], {2: state(2)})


# --- forged views: a storage leaf is viewed only by __view__ nodes that fit inside it, and a
# __view__ views only a storage leaf (save writes nothing else)

def views_state(step: int) -> dict:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(40, 40, generator=g)  # 6400 bytes: a storage of two chunks
    if step >= 2:
        base[:3] += 1.0
    z = torch.randn(8, dtype=torch.complex64, generator=g)
    return {"w": base, "rows": base[5:9], "flat": base.view(-1)[100:300], "z": z.conj(),
            "plain": torch.arange(5.0), "step": step}


@pytest.fixture(scope="module")
def _views_template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile-views") / "run"
    with Checkpointer(str(root), chunk_bytes=CHUNK) as ck:
        for step in (1, 2):
            ck.save(step, views_state(step))
    return root


@pytest.fixture
def views_run(_views_template, tmp_path) -> Path:
    return _copy_of(_views_template, tmp_path, "run")


def _index(frag: dict, path: str) -> int:
    return next(i for i, x in enumerate(frag["leaves"]) if x["path"] == path)


def _view(frag: dict, key: str) -> dict:
    return frag["skeleton"][key]["__view__"]


def _set_view(key: str, **fields):
    def edit(doc, frag):
        _view(frag, key).update(fields)
    return edit


def _drop_view_field(doc, frag):
    del _view(frag, "rows")["stride"]


def _view_of_a_tensor_leaf(doc, frag):
    frag["skeleton"]["rows"] = {"__view__": {**_view(frag, "rows"), "storage": _index(frag, "/plain")}}


def _leaf_of_a_storage(doc, frag):
    frag["skeleton"]["plain"] = {"__leaf__": _view(frag, "w")["storage"]}


def _ref_of_a_storage(doc, frag):
    frag["skeleton"]["plain"] = {"__ref__": _view(frag, "w")["storage"]}


def _data_attribute_on_a_view(doc, frag):
    frag["skeleton"]["rows"] = {"__attrs__": [frag["skeleton"]["rows"], {"data": frag["skeleton"]["plain"]}]}


def _view_not_an_object(doc, frag):
    frag["skeleton"]["rows"] = {"__view__": [0, 0]}


FORGED_VIEWS = {
    "view-of-a-tensor-leaf": _view_of_a_tensor_leaf,
    "view-of-a-leaf-out-of-range": _set_view("rows", storage=999),
    "view-past-its-storage": _set_view("rows", offset=1600 - 3),
    "view-stride-past-its-storage": _set_view("rows", stride=[10**6, 1]),
    "view-negative-offset": _set_view("rows", offset=-1),
    "view-float-offset": _set_view("rows", offset=1.0),
    "view-unknown-field": _set_view("rows", data=1),
    "view-missing-field": _drop_view_field,
    "view-shape-and-stride-lengths-differ": _set_view("rows", stride=[1]),
    "view-unknown-dtype": _set_view("rows", dtype="float128"),
    "view-flag-not-a-bool": _set_view("z", conj=1),
    "view-conj-bit-on-floats": _set_view("rows", conj=True),
    "view-int-requires-grad": _set_view("rows", dtype="int32", requires_grad=True),
    "view-of-2^62-bytes": _set_view("rows", shape=[2**40, 2**20], stride=[0, 0]),
    "view-not-an-object": _view_not_an_object,
    "leaf-of-a-storage": _leaf_of_a_storage,
    "ref-of-a-storage": _ref_of_a_storage,
    "data-attribute-on-a-view": _data_attribute_on_a_view,
}


@pytest.mark.parametrize("name", list(FORGED_VIEWS))
def test_a_forged_view_is_refused_naming_where(views_run, tmp_path, name):
    assert_forgery_refused(views_run, tmp_path, FORGED_VIEWS[name], {2: views_state(2)})


@pytest.mark.parametrize("field,value", [("shape", [40, 40]), ("param", True), ("requires_grad", True),
                                         ("stride", [1]), ("dtype", "int4"), ("kind", "torch")])
def test_a_forged_storage_leaf_is_refused(views_run, tmp_path, field, value):
    """A storage leaf is one-dimensional bytes of a stored dtype, never a parameter; relabelled a
    tensor, its views are views of a tensor leaf (save never writes those)."""
    doc = load(views_run, 1)
    frag = fragment_of(doc)
    leaf(frag, "/w#storage")[field] = value
    reseal(doc)
    store_doc(views_run, 1, doc)
    assert isinstance(assert_refused(views_run, 1, tmp_path, intact={2: views_state(2)}), CorruptCheckpoint)


EDITS = {
    # name: (edit, step, resealed)
    "nbytes-0": (_nbytes_zero, 1, False),
    "blob-nbytes-0": (_blob_nbytes_zero, 1, False),
    "chunks-reordered": (_reorder, 1, False),
    "chunks-reordered-deltas": (_reorder, 2, False),
    "chunks-swapped-between-tensors": (_swap_tensors, 1, False),
    "chunks-swapped-between-tensors-deltas": (_swap_tensors, 2, False),
    "dtype-relabelled": (_relabel, 1, False),
    # (a relabel with digests recomputed is a valid checkpoint of other values: unkeyed digests
    # detect damage, not forgery; docs/format.md says so)
    "negative-chunk-bytes": (_negative_chunk_bytes, 1, False),
    "zero-chunk-bytes": (_zero_chunk_bytes, 1, False),
    "parts-empty": (_parts_empty, 1, False),
    "parts-not-a-dict": (_parts_not_a_dict, 1, False),
    "base-is-itself": (_base_is_itself, 2, False),
    "base-cycle-of-two": (_cycle_of_two, 2, False),
    "base-cycle-of-three": (_cycle_of_three, 2, False),
    "base-missing": (_base_missing, 2, False),
    "empty-codec-lists": (_empty_codecs, 1, False),
    "unknown-codec": (_unknown_codec, 1, False),
    "codec-bad-configuration": (_codec_bad_configuration, 1, False),
    "codec-not-a-dict": (_codec_not_a_dict, 1, False),
    "delta-codec-on-a-keyframe": (_delta_codec_on_a_keyframe, 1, False),
    "delta-codec-in-the-middle": (_delta_codec_in_the_middle, 1, False),
    "blob-key-outside-the-store": (_blob_key_outside, 1, False),
    "blob-key-of-another-object": (_blob_key_of_another_object, 1, False),
    "blob-size-lies": (_blob_size_lies, 1, False),
    "pack-offset-outside": (_pack_offset_outside, 1, False),
    "leaf-index-out-of-range": (_leaf_index_out_of_range, 1, True),
    "skeleton-names-code": (_skeleton_with_code, 1, True),
    "skeleton-5000-deep-lists": (_deep_skeleton, 1, False),
    "skeleton-5000-deep-dicts": (_deep_dict_skeleton, 1, False),
    "wrong-step": (_wrong_step, 1, False),
    "future-format": (_future_format, 1, False),
    "chunk-count-lies": (_chunk_count_lies, 1, False),
    "delta-depth-huge": (_depth_huge, 2, False),
    "stride-lies": (_stride_lies, 1, True),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_edited_manifest_is_refused(run, tmp_path, name):
    edit, step, resealed = EDITS[name]
    edit_and_check(run, tmp_path, step, edit, resealed=resealed)


SIZES = {
    "nbytes-1e15": ("nbytes", 1e15),
    "nbytes-huge": ("nbytes", 2**62),
    "nbytes-negative": ("nbytes", -12288),
    "nbytes-string": ("nbytes", "12288"),
    "nbytes-bool": ("nbytes", True),
    "nbytes-null": ("nbytes", None),
    "shape-1e15": ("shape", [1e15]),
    "shape-huge": ("shape", [2**40, 2**40]),
    "shape-negative": ("shape", [-3072]),
    "shape-strings": ("shape", ["3072"]),
    "shape-not-a-list": ("shape", 3072),
    "shape-deep": ("shape", [1] * 1000),
    "itemsize-0": ("itemsize", 0),
    "dtype-object": ("dtype", "|O"),
    "dtype-structured": ("dtype", [["x", "<f4"]]),
    "kind-pickle": ("kind", "pickle"),
}


@pytest.mark.parametrize("name", list(SIZES))
@pytest.mark.parametrize("resealed", [False, True], ids=["plain", "resealed"])
def test_hostile_leaf_fields(run, tmp_path, name, resealed):
    field, value = SIZES[name]

    def edit(doc, frag):
        leaf(frag, "/model/a" if field != "dtype" else "/n")[field] = value

    edit_and_check(run, tmp_path, 1, edit, resealed=resealed)


def test_numpy_object_dtype_is_never_unpickled(run, tmp_path):
    """A numpy leaf relabelled '|O' (8-byte pointers) with a consistent itemsize and digests."""

    def edit(doc, frag):
        x = leaf(frag, "/n")
        x["dtype"], x["itemsize"] = "|O", 8

    edit_and_check(run, tmp_path, 1, edit, resealed=True)


def test_huge_tensor_is_refused_before_allocating(run, tmp_path):
    """A forged, self-consistent 1 TiB tensor: refused against this machine's memory, unallocated."""

    def edit(doc, frag):
        x = leaf(frag, "/model/a")
        first = x["chunks"][0]
        x["shape"], x["nbytes"], x["chunk_bytes"], x["chunks"] = [2**28, 1024], 2**40, 2**40, [first]
        frag["blobs"][first]["nbytes"] = 2**40
        frag["chunk_bytes"] = 2**40  # self-consistent: the writer's chunk size (a chunk is no larger)

    err = edit_and_check(run, tmp_path, 1, edit, resealed=True)
    assert "GiB" in str(err) or "memory" in str(err)


# ----------------------------------------------------------------------------- bounded work


def peak_bytes(call) -> tuple[int, object]:
    """(the peak of Python allocations during ``call()`` (every byte a store returns is one), its
    outcome: the value, or the exception it raised)."""
    import tracemalloc

    tracemalloc.start()
    try:
        try:
            outcome = call()
        except Exception as e:  # noqa: BLE001 - returned: the caller asserts what it is
            outcome = e
        return tracemalloc.get_traced_memory()[1], outcome
    finally:
        tracemalloc.stop()


def test_a_pack_declaring_2_45_bytes_is_refused_before_allocating(run, tmp_path):
    """The pack of small leaves declares 2^45 bytes: its leaves end at byte 40, so it is refused
    when the fragment is parsed (before: numpy's MemoryError from restore, a traceback from verify)."""

    def edit(doc, frag):
        frag["blobs"][leaf(frag, "/model/small")["pack"]]["nbytes"] = 2**45

    err = edit_and_check(run, tmp_path, 1, edit)
    assert "pack" in str(err) and str(2**45) in str(err), err


def test_a_self_consistent_2_45_byte_pack_is_refused_against_memory(run, tmp_path):
    """The same pack with its leaf at its end and the writer's chunk size raised to match: every
    check of the document passes, and the restore counts the pack's buffer against memory."""

    def edit(doc, frag):
        small = leaf(frag, "/model/small")
        frag["blobs"][small["pack"]]["nbytes"] = 2**45
        small["offset"] = 2**45 - small["nbytes"]
        frag["chunk_bytes"] = 2**45

    err = edit_and_check(run, tmp_path, 1, edit)
    assert "GiB" in str(err) and "memory" in str(err), err


def test_a_pack_larger_than_the_chunk_size_is_refused(run, tmp_path):
    def edit(doc, frag):
        frag["chunk_bytes"] = 16  # the pack of "small" holds 40 bytes

    err = edit_and_check(run, tmp_path, 1, edit)
    assert "chunk size" in str(err), err


def test_a_chunk_declaring_a_huge_stored_size_is_refused_unread(run, tmp_path):
    """A 4 KiB chunk whose object was replaced by 64 MiB and whose declared size says so: no
    encoding of 4 KiB is that large, the manifest is refused before any object is read."""
    doc = load(run, 1)
    frag = fragment_of(doc)
    blob = frag["blobs"][leaf(frag, "/model/a")["chunks"][0]]
    (run / blob["key"]).write_bytes(bytes(64 << 20))
    blob["size"] = 64 << 20
    store_doc(run, 1, doc)
    with Checkpointer(str(run)) as ck:
        peak, outcome = peak_bytes(lambda: ck.restore(1))
    assert isinstance(outcome, CorruptCheckpoint) and "blob size" in str(outcome), outcome
    assert peak < 8 << 20, peak
    assert_refused(run, 1, tmp_path)  # (step 2's deltas build on that object: it is damaged too)


def test_a_chunk_object_larger_than_its_manifest_says_is_not_read(run, tmp_path):
    """The object of a chunk replaced by 64 MiB, the manifest untouched: the restore reads no more
    than the size the manifest records (before: all 64 MiB, then a size mismatch)."""
    with Checkpointer(str(run)) as ck:
        frag = ck.fragment(1, "state")
    key = frag.blobs[frag.leaves[0].chunks[0]].key
    (run / key).write_bytes(bytes(64 << 20))
    with Checkpointer(str(run)) as ck:
        peak, outcome = peak_bytes(lambda: ck.restore(1))
        assert isinstance(outcome, CorruptCheckpoint) and key in str(outcome), outcome
        assert peak < 8 << 20, peak
        problems = ck.verify(1)
    assert problems and key in str(problems[0]), problems


def _write_junk(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: the test writes no data, the reader would read it all


def test_a_manifest_larger_than_any_is_refused_unread(run, tmp_path):
    """A manifest past the manifest cap (a fragment's cap and the manifest's own fields) is refused
    before it is read (before: read and parsed whole: 1.5 GB of memory for a 500 MB one)."""
    from ckptlib.manifest import MAX_MANIFEST_BYTES

    _write_junk(run / "manifests" / "1.json", MAX_MANIFEST_BYTES + 1)
    with Checkpointer(str(run)) as ck:
        peak, outcome = peak_bytes(lambda: ck.restore(1))
        assert isinstance(outcome, CorruptCheckpoint), outcome
        assert str(MAX_MANIFEST_BYTES + 1) in str(outcome) and str(MAX_MANIFEST_BYTES) in str(outcome), outcome
        assert peak < 1 << 20, peak
        assert_same_state(state(2), ck.restore(2))


def test_a_multi_part_manifest_is_capped_by_its_parts(cut_run, tmp_path):
    """A manifest naming 2 fragments holds a few KiB: padded past what 2 parts may hold (its meta
    grown to 2 MiB, digests untouched), it is refused; and a commit never writes one."""
    from ckptlib import UnsupportedState
    from ckptlib.manifest import multi_part_cap

    doc = load(cut_run, 2)
    doc["meta"] = {"junk": "x" * (2 << 20)}
    store_doc(cut_run, 2, doc)
    err = assert_refused(cut_run, 2, tmp_path, part="shard-0")
    assert str(multi_part_cap(2)) in str(err) and "2 parts" in str(err), err
    with Checkpointer(str(cut_run)) as ck, pytest.raises(UnsupportedState, match="meta"):
        ck.commit(1, list(PARTS), timeout=5, meta={"junk": "x" * (2 << 20)})


def test_a_fragment_is_read_with_the_size_its_manifest_records(cut_run, tmp_path):
    """A multi-part manifest records each fragment's size; a fragment object grown past it (64 MiB of
    JSON whitespace: still the same document) is refused having read no more than that."""
    doc = load(cut_run, 2)
    ref = doc["parts"]["shard-0"]
    target = cut_run / ref["key"]
    assert ref["size"] == target.stat().st_size
    with open(target, "ab") as f:
        f.write(b" " * (64 << 20))
    with Checkpointer(str(cut_run)) as ck:
        peak, outcome = peak_bytes(lambda: ck.restore(2, part="shard-0"))
    assert isinstance(outcome, CorruptCheckpoint) and "shard-0" in str(outcome), outcome
    assert str(ref["size"]) in str(outcome), outcome
    assert peak < 8 << 20, peak


def test_a_manifest_without_fragment_sizes_still_restores(cut_run):
    """Manifests written before sizes were recorded read their fragments with the fragment cap."""
    doc = load(cut_run, 2)
    for ref in doc["parts"].values():
        del ref["size"]
    store_doc(cut_run, 2, doc)
    with Checkpointer(str(cut_run)) as ck:
        expected = state(2)
        expected["model"]["a"] += 1
        assert_same_state(expected, ck.restore(2, part="shard-1"))


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_huge_heartbeat_is_ignored_unread(run, kind, request):
    """A heartbeat is kilobytes: one of 64 MiB is refused before it is read whole (logged, read as
    no beat; before: read and parsed: `ckpt status` took 1.1 GB for a 300 MB beat)."""
    from ckptlib.heartbeat import HEARTBEAT_MAX_BYTES, Heartbeat, read_heartbeats

    if kind == "s3":
        loc = request.getfixturevalue("s3_url")
        store = Store.from_url(loc.url, loc.storage_options)
    else:
        store = Store.from_url(str(run))
    Heartbeat(store, "shard-0", generation=0, round=0).start(step=1)
    Heartbeat(store, "shard-1", generation=0, round=0).start(step=1)
    junk = b'{"format": 1, "pad": "' + b"x" * (64 << 20) + b'"}'
    store.put("heartbeats/shard-1.json", junk)
    del junk
    peak, beats = peak_bytes(lambda: read_heartbeats(store))
    assert isinstance(beats, dict) and sorted(beats) == ["shard-0"], beats
    assert peak < 2 * HEARTBEAT_MAX_BYTES + (1 << 20), peak


def test_a_heartbeat_is_never_written_larger_than_a_reader_accepts(tmp_path):
    from ckptlib.heartbeat import Heartbeat

    hb = Heartbeat(Store.from_url(str(tmp_path / "run")), "shard-0", generation=0, round=0,
                   meta={"junk": "x" * (5 << 20)})
    with pytest.raises(ValueError, match="heartbeat of shard-0 would be .* bytes, more than the 4194304"):
        hb.start(step=0)


def test_huge_verdicts_leases_and_fences_are_refused_unread(run):
    """Small documents have small caps: a 32 MiB verdict reads as not validated (and as failed to
    ckptlib.validate), a 32 MiB lease as malformed (it protects nothing), a 32 MiB fence as a fence
    with no details; none is read whole."""
    from ckptlib import commit
    from ckptlib.leases import live_leases
    from ckptlib.validate.verdict import read_verdict

    _write_junk(run / "validations" / "1.json", 32 << 20)
    _write_junk(run / "leases" / ("save-" + "0" * 32 + ".json"), 32 << 20)
    _write_junk(run / "fences" / "shard-0" / "1", 32 << 20)
    store = Store.from_url(str(run))
    with Checkpointer(store) as ck:
        for call, check in ((lambda: ck.verdict(1), lambda v: v is None),
                            (lambda: read_verdict(store, 1), lambda v: v.passed is False),
                            (lambda: live_leases(store), lambda v: v == []),
                            (lambda: commit.read_fence(store, "shard-0", 1),
                             lambda v: v == {"part": "shard-0", "generation": 1})):
            peak, outcome = peak_bytes(call)
            assert check(outcome), outcome
            assert peak < 1 << 20, (outcome, peak)
        assert ck.latest_step(healthy=True) is None


def test_manifest_that_is_not_a_manifest(run, tmp_path):
    for junk in (b"", b"\x00\xff" * 100, b"[]", b"null", b'{"format": 2}', b"{" * 100000, b"1e999999",
                 json.dumps({"format": 2, "parts": {"state": {"fragment": "x"}}}).encode()):
        (run / "manifests" / "1.json").write_bytes(junk)
        assert_refused(run, 1, tmp_path, intact={2: state(2)})


# ----------------------------------------------------------------------------- multi-part manifests


def test_one_part_removed_from_a_cut(cut_run, tmp_path):
    doc = load(cut_run, 2)
    del doc["parts"]["shard-1"]
    store_doc(cut_run, 2, doc)
    assert_refused(cut_run, 2, tmp_path, part="shard-0")
    assert_refused(cut_run, 2, tmp_path)


def test_a_part_added_to_a_cut(cut_run, tmp_path):
    doc = load(cut_run, 2)
    doc["parts"]["shard-2"] = doc["parts"]["shard-1"]
    store_doc(cut_run, 2, doc)
    assert_refused(cut_run, 2, tmp_path)


def test_parts_swapped_in_a_cut(cut_run, tmp_path):
    doc = load(cut_run, 2)
    p = doc["parts"]
    p["shard-0"], p["shard-1"] = p["shard-1"], p["shard-0"]
    store_doc(cut_run, 2, doc)
    assert_refused(cut_run, 2, tmp_path, part="shard-0")


def test_cut_with_no_parts(cut_run, tmp_path):
    doc = load(cut_run, 2)
    doc["parts"] = {}
    store_doc(cut_run, 2, doc)
    assert_refused(cut_run, 2, tmp_path)


@pytest.mark.parametrize("replacement", ["other-part", "other-step", "edited", "garbage", "deleted"])
def test_fragment_object_replaced(cut_run, tmp_path, replacement):
    target = cut_run / "fragments" / "2" / "shard-0.g0.json"
    if replacement == "other-part":
        target.write_bytes((cut_run / "fragments" / "2" / "shard-1.g0.json").read_bytes())
    elif replacement == "other-step":
        target.write_bytes((cut_run / "fragments" / "1" / "shard-0.g0.json").read_bytes())
    elif replacement == "edited":  # a self-consistent fragment with another state: another digest
        frag = document_json(target.read_bytes())
        leaf(frag, "/model/a")["chunks"] = leaf(frag, "/model/b")["chunks"]
        leaf(frag, "/model/a")["digest"] = leaf(frag, "/model/b")["digest"]
        frag["digest"] = part_digest(frag)
        target.write_text(json.dumps(frag))
    elif replacement == "garbage":
        target.write_bytes(b"\x89PNG not a fragment")
    else:
        target.unlink()
    err = assert_refused(cut_run, 2, tmp_path, part="shard-0")
    assert "shard-0" in str(err)
    with Checkpointer(str(cut_run)) as ck:  # the other part of the same cut is intact
        expected = state(2)
        expected["model"]["a"] += 1
        assert_same_state(expected, ck.restore(2, part="shard-1"))


# ----------------------------------------------------------------------------- hostile chunks


@pytest.fixture(scope="module")
def zstd_bombs(tmp_path_factory) -> dict[str, bytes]:
    """2 GiB of zeros in one zstd frame (about 65 KB, which an object of a 4 KiB chunk may be: see
    ckptlib.manifest.max_stored_bytes), with and without a declared content size; twice the address
    space the restore is given."""
    import zstandard

    zeros = bytes(1 << 20)
    out = {}
    for name, declared in (("declared", True), ("undeclared", False)):
        cctx = zstandard.ZstdCompressor(level=1, write_content_size=declared, write_checksum=True)
        chunks = []
        if declared:
            comp = cctx.compressobj(size=2 << 30)
        else:
            comp = cctx.compressobj()
        for _ in range(2048):
            chunks.append(comp.compress(zeros))
        chunks.append(comp.flush())
        out[name] = b"".join(chunks)
    return out


BOMB_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import torch  # noqa: F401 - loaded before the limit: its own mappings are not the restore's
    from ckptlib import Checkpointer, CheckpointError
    vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
    limit = vm + (1 << 30)  # 1 GiB more address space than the interpreter has now
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    outcome = {}
    with Checkpointer(sys.argv[1]) as ck:
        for name, call in (("restore", lambda: ck.restore(int(sys.argv[2]))),
                           ("verify", lambda: ck.verify(int(sys.argv[2])))):
            try:
                result = call()
                outcome[name] = "returned " + (repr(result)[:200] if name == "verify" else "a state")
            except CheckpointError as e:
                outcome[name] = "refused: " + type(e).__name__ + ": " + str(e)[:300]
            except BaseException as e:
                outcome[name] = "RAW " + type(e).__name__ + ": " + str(e)[:300]
    # this process's own peak (VmHWM): Linux's ru_maxrss keeps the parent's peak across fork + exec,
    # so a pytest worker grown past 1 GiB by earlier tests would be counted as this restore's
    outcome["maxrss_kib"] = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    print(json.dumps(outcome))
""")


def _bomb_run(run: Path, step: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", BOMB_SCRIPT, str(run), str(step)], capture_output=True, text=True,
                          timeout=50, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["declared", "undeclared"])
def test_zstd_bomb_in_a_keyframe(run, zstd_bombs, kind):
    bomb = zstd_bombs[kind]
    assert len(bomb) < 200_000
    doc = load(run, 1)
    frag = fragment_of(doc)
    key = leaf(frag, "/model/a")["chunks"][0]
    blob = frag["blobs"][key]
    blob["codecs"] = [{"name": "zstd", "configuration": {"level": 1}}]  # codecs are not in the digest
    blob["size"] = len(bomb)
    (run / blob["key"]).write_bytes(bomb)
    store_doc(run, 1, doc)
    outcome = _bomb_run(run, 1)
    assert outcome["restore"].startswith("refused: CorruptCheckpoint"), outcome
    assert outcome["verify"].startswith("returned [Problem(") or outcome["verify"].startswith("refused"), outcome
    assert outcome["maxrss_kib"] < 1_000_000, outcome


def test_zstd_bomb_in_a_sparse_delta(run, zstd_bombs):
    """A sparse delta whose header claims every element changed and whose planes frame is the bomb."""
    bomb = zstd_bombs["declared"]
    doc = load(run, 2)
    frag = fragment_of(doc)
    _, blob = next((k, b) for k, b in delta_blobs(frag) if b["codecs"][0]["name"] == "sparse_delta")
    import zstandard

    n = blob["nbytes"] // 4
    index = zstandard.ZstdCompressor(write_content_size=True).compress(np.ones(n, dtype="<u4").tobytes())
    payload = np.array([len(index), n], dtype="<u8").tobytes() + index + bomb
    blob["size"] = len(payload)
    (run / blob["key"]).write_bytes(payload)
    store_doc(run, 2, doc)
    outcome = _bomb_run(run, 2)
    assert outcome["restore"].startswith("refused: CorruptCheckpoint"), outcome
    assert outcome["maxrss_kib"] < 1_000_000, outcome


@pytest.mark.parametrize("damage", ["truncated", "empty", "flipped", "random", "sparse-count-lies",
                                    "sparse-positions-outside"])
def test_damaged_chunk_objects(run, tmp_path, damage):
    doc = load(run, 2)
    frag = fragment_of(doc)
    if damage.startswith("sparse"):
        _, blob = next((k, b) for k, b in delta_blobs(frag) if b["codecs"][0]["name"] == "sparse_delta")
    else:
        blob = frag["blobs"][leaf(frag, "/model/a")["chunks"][1]]
    path = run / blob["key"]
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    elif damage == "flipped":
        data[len(data) // 2] ^= 0x01
    elif damage == "random":
        data = bytearray(np.random.RandomState(0).bytes(len(data)))
    elif damage == "sparse-count-lies":
        data[8:16] = np.array([2**62], dtype="<u8").tobytes()
    else:  # a gap that jumps past the end of the chunk, with a consistent index frame
        import zstandard

        count = int(np.frombuffer(bytes(data[8:16]), dtype="<u8")[0])
        gaps = np.full(count, 2**31, dtype="<u4")
        planes = gaps.view(np.uint8).reshape(-1, 4).T.reshape(-1).tobytes()
        index = zstandard.ZstdCompressor(write_content_size=True).compress(planes)
        old_len = int(np.frombuffer(bytes(data[:8]), dtype="<u8")[0])
        data = bytearray(np.array([len(index), count], dtype="<u8").tobytes() + index + bytes(data[16 + old_len:]))
    path.write_bytes(bytes(data))
    if damage in ("truncated", "empty", "random", "sparse-positions-outside"):
        blob["size"] = len(data)  # a forger keeps the sizes consistent (sizes are not in the digest)
        store_doc(run, 2, doc)
    assert_refused(run, 2, tmp_path)


# ----------------------------------------------------------------------------- validation verdicts


@pytest.mark.parametrize("verdict", [b"not json", b"[]", b"null", b'{"passed": "yes"}', b'{"passed": 1}',
                                     b'{"passed": false, "failed": 5}', b'{"passed": false, "failed": {"a": 1}}',
                                     b"\xff\xfe", b"{" * 5000, b'{"passed": true, "nested": ' + b"[" * 5000 + b"]" * 5000 + b"}"])
def test_malformed_verdict(run, verdict, tmp_path):
    from typer.testing import CliRunner

    from ckpt.cli import app

    (run / "validations").mkdir(exist_ok=True)
    (run / "validations" / "1.json").write_bytes(verdict)
    (run / "validations" / "2.json").write_bytes(b'{"passed": true, "failed": []}')
    with Checkpointer(str(run)) as ck:
        assert ck.healthy_steps() == [2]
        assert ck.latest_step(healthy=True) == 2
        if ck.verdict(1) is not None:  # a verdict it accepts says whether it passed, as a bool
            assert isinstance(ck.verdict(1)["passed"], bool) and ck.verdict(1)["passed"] is False
    result = CliRunner().invoke(app, ["ls", str(run)])
    assert result.exit_code == 0, result.output
    rows = {line.replace("│", " ").split()[0]: line for line in result.output.splitlines()
            if line.replace("│", " ").split()[:1] in (["1"], ["2"])}
    assert "passed" not in rows["1"] and "passed" in rows["2"], result.output


# ----------------------------------------------------------------------------- GC outside stores and links


def test_gc_refuses_a_folder_that_is_not_a_store(tmp_path):
    root = tmp_path / "photos"
    files = {"chunks/ab/ab" + "0" * 30: b"x", "chunks/cd/cd" + "1" * 30: b"y", "fragments/1/a.g0.json": b"{}",
             "manifests/readme.txt": b"not a manifest", "holiday.jpg": b"\xff\xd8"}
    for key, data in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
        os.utime(root / key, (0, 0))
    before = sorted(str(p) for p in root.rglob("*"))
    with Checkpointer(str(root)) as ck, pytest.raises(CheckpointError, match="not a ckptlib store"):
        ck.gc(RetentionPolicy(keep_last=1), grace_s=0)
    from typer.testing import CliRunner

    from ckpt.cli import app

    result = CliRunner().invoke(app, ["gc", str(root), "--keep-last", "1"])
    assert result.exit_code != 0 and "not a ckptlib store" in result.output
    assert sorted(str(p) for p in root.rglob("*")) == before


def _outside(tmp_path: Path) -> Path:
    out = tmp_path / "outside"
    out.mkdir()
    for name in ("precious.txt", "ab" + "0" * 30, ".ckpt-tmp-x"):
        (out / name).write_bytes(b"not the store's")
        os.utime(out / name, (0, 0))
    return out


def _untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == sorted(["precious.txt", "ab" + "0" * 30, ".ckpt-tmp-x"])
    assert all(p.read_bytes() == b"not the store's" for p in outside.iterdir())


def _gc_may_refuse(url: str, **kw):
    """GC on a store holding a link: it completes, or refuses with a StoreError naming the link."""
    with Checkpointer(url) as ck:
        try:
            return ck.gc(RetentionPolicy(keep_last=1), grace_s=0, **kw)
        except StoreError as e:
            assert "link" in str(e), e
            return None


def test_gc_never_deletes_through_a_linked_report_folder(run, tmp_path):
    outside = _outside(tmp_path)
    (run / "reports").mkdir()
    os.symlink(outside, run / "reports" / "1")  # step 1 is dropped by the policy: its reports go
    _gc_may_refuse(str(run))
    _untouched(outside)
    with Checkpointer(str(run)) as ck:
        assert_same_state(state(2), ck.restore(2))


def test_validation_runs_on_an_intact_run(run):
    """(The baseline of the next test: validation of an intact format 2 checkpoint gives a verdict.)"""
    from ckptlib.validate import validate_checkpoint

    verdict = validate_checkpoint(str(run), 2, report=False)
    passed = verdict["passed"] if isinstance(verdict, dict) else verdict.passed
    assert passed is True, verdict
    assert (run / "validations" / "2.json").exists()


def test_validation_never_writes_through_a_linked_report_folder(run, tmp_path):
    from ckptlib.validate import validate_checkpoint

    outside = _outside(tmp_path)
    (run / "reports").mkdir()
    os.symlink(outside, run / "reports" / "2")
    try:
        validate_checkpoint(str(run), 2)
    except StoreError as e:
        assert "link" in str(e)
    _untouched(outside)


def test_a_linked_chunks_folder(run, tmp_path):
    outside = _outside(tmp_path)
    os.rename(run / "chunks", tmp_path / "real-chunks")
    os.symlink(outside, run / "chunks")
    _gc_may_refuse(str(run))
    _untouched(outside)
    changed = state(3)
    changed["model"]["a"] += 1  # chunks to write (an unchanged chunk is only referenced)
    with Checkpointer(str(run)) as ck:
        with pytest.raises(StoreError, match="link"):
            ck.restore(2)
        with pytest.raises(StoreError, match="link"):
            ck.save(3, changed)
    _untouched(outside)


def test_a_linked_chunk_file(run, tmp_path):
    outside = _outside(tmp_path)
    with Checkpointer(str(run)) as ck:
        key = ck.fragment(2, "state").blobs[ck.fragment(2, "state").leaves[0].chunks[0]].key
    (run / key).unlink()
    os.symlink(outside / "precious.txt", run / key)
    (run / "chunks" / "ab").mkdir(exist_ok=True)
    os.symlink(outside / ("ab" + "0" * 30), run / "chunks" / "ab" / ("ab" + "0" * 30))  # unreferenced
    _gc_may_refuse(str(run))
    _untouched(outside)
    with Checkpointer(str(run)) as ck:
        with pytest.raises(CheckpointError):
            ck.restore(2)
        try:
            assert ck.verify(2) != []
        except StoreError as e:
            assert "link" in str(e)
    _untouched(outside)


# ----------------------------------------------------------------------------- odd keys on S3


def _s3_keys(client, prefix: str) -> set[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket="ckpt-test", Prefix=prefix + "/")
    return {o["Key"][len(prefix) + 1:] for page in pages for o in page.get("Contents", [])}


def _s3_run_with_odd_keys(seaweedfs, s3_url, odd: list[str]) -> tuple[Store, set[str], object, str]:
    store = Store.from_url(s3_url.url, s3_url.storage_options)
    with Checkpointer(store, chunk_bytes=CHUNK) as ck:
        ck.save(1, state(1))
        ck.save(2, state(2))
    prefix = s3_url.url.split("/", 3)[3]
    client = seaweedfs._client()
    for key in odd:
        try:
            client.put_object(Bucket="ckpt-test", Key=f"{prefix}/{key}", Body=b"odd")
        except client.exceptions.ClientError:
            pass  # a key this server refuses cannot be in a store either
    return store, _s3_keys(client, prefix), client, prefix


@pytest.mark.s3
@pytest.mark.parametrize("odd", [
    ["chunks/ab/.ckpt-tmp-1", "chunks/.ckpt-tmp-2", "chunks/ab/x y", "chunks/zz", "chunks/ab/ab/c",
     "chunks/AB/AB" + "0" * 30, "chunks/ab//double", "chunks/ab/../escape", "chunks/ab/caf\u00e9",
     "fragments/1/bad", "fragments/x/a.g0.json", "fragments/1/.ckpt-tmp-3", "fragments/9/.ckpt-tmp-3",
     "manifests/.ckpt-tmp-4", "manifests/x.json", "validations/.ckpt-tmp-8"],
    ["leases/.ckpt-tmp-5"],
    ["reports/1/.ckpt-tmp-7", "reports/1/x/../y"],
    ["leases/x y.json", "leases/junk.json"],
], ids=["chunks-fragments-manifests", "temp-name-under-leases", "temp-name-in-a-dropped-report", "junk-leases"])
def test_odd_s3_keys_do_not_abort_gc(seaweedfs, s3_url, odd):
    """Objects ckptlib never writes (another tool's, or names a local store would hide) are skipped
    by GC: it completes, and deletes none of them (a malformed lease document is the only kind of
    odd object it may delete: it expires)."""
    store, before, client, prefix = _s3_run_with_odd_keys(seaweedfs, s3_url, odd)
    planted = {k for k in before if k.split("/")[0] in ("chunks", "fragments", "manifests", "leases", "reports",
                                                        "validations") and any(k.endswith(o.rsplit("/", 1)[-1]) for o in odd)}
    assert planted
    with Checkpointer(store) as ck:
        report = ck.gc(RetentionPolicy(keep_last=1), grace_s=0)
        assert report.dropped_steps == [1]
        assert_same_state(state(2), ck.restore(2))
        assert ck.verify(2) == []
    gone = planted - _s3_keys(client, prefix)
    assert gone <= {"leases/junk.json", "leases/x y.json"}, gone


def test_odd_local_names_do_not_abort_gc(run):
    for key in ("chunks/ab/x y", "chunks/zz", "chunks/ab/ab/c", "fragments/1/bad", "fragments/x/a.g0.json",
                "manifests/x.json", "manifests/1.json.bak"):
        (run / key).parent.mkdir(parents=True, exist_ok=True)
        (run / key).write_bytes(b"odd")
        os.utime(run / key, (0, 0))
    with Checkpointer(str(run)) as ck:
        report = ck.gc(RetentionPolicy(keep_last=1), grace_s=0)
        assert report.dropped_steps == [1] and "chunks/zz" in report.skipped
        assert_same_state(state(2), ck.restore(2))
    assert (run / "chunks/ab/x y").exists() and (run / "manifests/1.json.bak").exists()


# ----------------------------------------------------------------------------- GC beside readers


class ReadOnly(WrapperStore):
    """A reader without write access (an evaluation job with read-only credentials)."""

    def _forward(self, op, key, *args):
        if op in ("put", "put_if_absent", "delete"):
            raise StoreError(f"permission denied to {op} {key!r} in {self.url} (read-only reader)")
        return super()._forward(op, key, *args)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("reader", ["read-write", "read-only"])
def test_gc_with_no_grace_beside_restores_of_old_steps(tmp_path, reader):
    """A GC loop (grace 0, keep_last=1) beside a writer that keeps re-saving steps 1-4 and a reader
    restoring them 200 times: every restore returns the exact state, or says clearly that the step
    is not committed (a read-only reader, which cannot take a read lease, may also find objects
    swept: a CorruptCheckpoint naming them). Never a wrong state, never a raw error."""
    url = str(tmp_path / "run")
    with Checkpointer(url, chunk_bytes=CHUNK) as ck:
        for step in (1, 2, 3, 4, 5):
            ck.save(step, state(step))
    stop = threading.Event()
    errors: list[BaseException] = []

    def gc_loop():
        with Checkpointer(url) as ck:
            while not stop.is_set():
                try:
                    ck.gc(RetentionPolicy(keep_last=1), grace_s=0)
                except StoreError as e:
                    if "another garbage collection" not in str(e):
                        errors.append(e)
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

    def write_loop():
        with Checkpointer(url, chunk_bytes=CHUNK) as ck:
            while not stop.is_set():
                for step in (1, 2, 3, 4):
                    try:
                        if step not in ck.steps():
                            ck.save(step, state(step))
                    except BaseException as e:  # noqa: BLE001
                        errors.append(e)
                time.sleep(0.01)

    writer_errors = errors  # reported after the reader's outcome (two findings, reported apart)
    threads = [threading.Thread(target=gc_loop), threading.Thread(target=write_loop)]
    for t in threads:
        t.start()
    outcomes: dict[str, int] = {}
    rng = np.random.RandomState(0)
    try:
        store = Store.from_url(url)
        with Checkpointer(ReadOnly(store) if reader == "read-only" else store) as ck:
            attempts, deadline = 0, time.monotonic() + 90
            # 200 restores, and on until one found its step committed (under load the GC may drop
            # every step the writer commits before the reader gets to it for a while)
            while attempts < 200 or (not outcomes.get("restored") and time.monotonic() < deadline):
                attempts += 1
                step = int(rng.randint(1, 5))
                try:
                    got = ck.restore(step)
                except NoCheckpoint:
                    outcomes["not committed"] = outcomes.get("not committed", 0) + 1
                    continue
                except CorruptCheckpoint as e:
                    if reader == "read-write":
                        raise AssertionError(f"a leased restore of step {step} failed: {e}") from e
                    assert "missing" in str(e) or "deleted" in str(e), e
                    outcomes["swept"] = outcomes.get("swept", 0) + 1
                    continue
                assert_same_state(state(step), got, f"step {step}")
                outcomes["restored"] = outcomes.get("restored", 0) + 1
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert outcomes.get("restored", 0) > 0, outcomes
    assert not writer_errors, "\n".join(sorted({str(e)[:400] for e in writer_errors}))


def test_a_long_lived_reader_does_not_restore_a_dropped_step(tmp_path):
    """A Checkpointer reads each committed manifest once; GC can uncommit a step (and the step can
    then be committed again with another state). A later restore(step) must not return what the
    step was: NoCheckpoint while it is not committed, the new state once it is again."""
    url = str(tmp_path / "run")
    with Checkpointer(url, chunk_bytes=CHUNK) as ck:
        ck.save(1, state(1))
        ck.save(2, state(2))
    with Checkpointer(url) as reader:
        assert_same_state(state(1), reader.restore(1))
        with Checkpointer(url) as ck:
            assert ck.gc(RetentionPolicy(keep_last=1), grace_s=0).dropped_steps == [1]
        with pytest.raises(NoCheckpoint):
            reader.restore(1)
        other = state(1)
        other["model"]["a"] += 5
        with Checkpointer(url, chunk_bytes=CHUNK) as ck:
            ck.save(1, other)
        assert_same_state(other, reader.restore(1))


@pytest.mark.parametrize("how", ["saved", "restored"])
def test_a_save_never_builds_on_a_base_that_gc_dropped_between_saves(tmp_path, how):
    """A writer's next save deltas against its base: the step it saved last, or restored with
    ``keep_base``. When that is not the newest step, a GC between two saves may drop it and sweep
    its objects (no save is in flight then). The next save must not commit deltas against objects
    that are gone: every committed step restores exactly."""
    url = str(tmp_path / "run")
    with Checkpointer(url, chunk_bytes=CHUNK) as first, Checkpointer(url, chunk_bytes=CHUNK) as second:
        first.save(5, state(5))  # the newest step: GC keeps it whatever the policy
        first.save(2, state(1))  # first's base is step 2 (objects of its own: state 1 differs from 5)
        if how == "restored":
            second.save(3, state(3))
            second.restore(2, keep_base=True)  # second's base is step 2 too
        writer = first if how == "saved" else second
        with Checkpointer(url) as other:  # another process's GC, between two saves
            assert 2 in other.gc(RetentionPolicy(keep_last=1), grace_s=0).dropped_steps
        changed = state(1)
        changed["model"]["b"] += 0.5  # a, n, small as in step 2: the save references step 2's objects
        writer.save(4, changed)
    with Checkpointer(url) as fresh:
        assert_same_state(changed, fresh.restore(4))
        assert fresh.verify(4) == []

def test_gc_never_removes_the_temp_file_of_a_write_in_flight(tmp_path, monkeypatch):
    """GC removes temp files of killed writes older than its grace period. A write in flight (a save
    holding its lease) keeps its temp file between writing it and linking it into place: a GC with
    a short grace period run right then must not remove it (the save would fail), whatever the grace."""
    from ckptlib.store import local

    url = str(tmp_path / "run")
    with Checkpointer(url, chunk_bytes=CHUNK) as ck:
        ck.save(1, state(1))
    real_link, ran = os.link, []

    def link_after_a_gc(src, dst, *a, **kw):
        if "/chunks/" in str(dst) and not ran:
            ran.append(True)
            with Checkpointer(url) as other:
                # another process's GC, right now; it waits 0.5 s (not the default 30 s) for the save
                # in flight, then defers its sweeps
                other.gc(RetentionPolicy(keep_last=1), grace_s=0, wait_s=0.5)
        return real_link(src, dst, *a, **kw)

    monkeypatch.setattr(local.os, "link", link_after_a_gc)
    with Checkpointer(url, chunk_bytes=CHUNK) as ck:
        ck.save(2, state(2))
    assert ran
    with Checkpointer(url) as ck:
        assert_same_state(state(2), ck.restore(2))


@pytest.mark.timeout(60)
def test_a_manifest_of_long_paths_restores_in_time_linear_in_its_size(run):
    """A 4 MB manifest whose 1,000,000 list items sit under a 2 MB key: a decoder that makes a path
    string per child copies 2 TB (minutes); one that names a path only for an error reads it in
    about a second. Restore, restore into a state and verify all read it."""
    doc = load(run, 1)
    key = "k" * 2_000_000
    _skel(fragment_of(doc))[key] = [0] * 1_000_000
    reseal(doc)
    store_doc(run, 1, doc)
    with Checkpointer(str(run)) as ck:
        restored = ck.restore(1)
        assert restored[key] == [0] * 1_000_000
        assert ck.restore(1, into=state(1))[key] == [0] * 1_000_000
        assert ck.verify(1) == []


# ----------------------------------------------------------------------------- every command, one line


def _junk(data: bytes):
    def edit(run: Path, step: int) -> None:
        (run / "manifests" / f"{step}.json").write_bytes(data)
    return edit


def _edited(edit, resealed: bool):
    def apply(run: Path, step: int) -> None:
        doc = load(run, step)
        edit(doc, fragment_of(doc))
        if resealed:
            reseal(doc)
        store_doc(run, step, doc)
    return apply


def _sized(field: str, value):
    def edit(doc, frag):
        leaf(frag, "/model/a" if field != "dtype" else "/n")[field] = value
    return _edited(edit, True)


DAMAGED_STEPS = {  # name: (damage(run, step), step): every store the tests above build, applied for the CLI
    **{f"forged-{name}": (_edited(fn, True), 1) for name, fn in FORGED_TREES.items()},
    **{f"edit-{name}": (_edited(edit, resealed), step) for name, (edit, step, resealed) in EDITS.items()},
    **{f"leaf-{name}": (_sized(*SIZES[name]), 1) for name in SIZES},
    **{f"junk-{i}": (_junk(data), 2) for i, data in enumerate(
        [b"", b"\x00\xff" * 100, b"[]", b"null", b'{"format": 2}', b"{" * 100000, b"1e999999"])},
    "pack-2^45": (_edited(lambda doc, frag: frag["blobs"][leaf(frag, "/model/small")["pack"]].update(nbytes=2**45),
                          False), 1),
}
# report (half a second: it draws the run's plot) on every kind of damage a listing can see, and on a
# sample of the others; validate (seconds) on one case of each kind
_REPORTED = {n for n in DAMAGED_STEPS if n.startswith(("forged-", "junk-"))} | {
    "edit-chunks-reordered", "edit-unknown-codec", "edit-parts-empty", "edit-future-format", "edit-base-cycle-of-two",
    "leaf-nbytes-huge", "leaf-dtype-object", "pack-2^45"}
_VALIDATED = {"forged-bad-device", "edit-chunks-reordered", "junk-2"}


def _cli(*args: str):
    from typer.testing import CliRunner

    from ckpt.cli import app

    return CliRunner().invoke(app, list(args))


def table_rows(output: str) -> dict[str, str]:
    """{first cell: the line} of the rows of a rich table (continuation lines have an empty first cell)."""
    rows = {}
    for line in output.splitlines():
        cells = line.split("│")
        if len(cells) > 2 and cells[1].strip():
            rows[cells[1].strip()] = line
    return rows


def assert_one_line(result, codes: tuple[int, ...], *, what: str, verdict: int | None = None) -> None:
    """Exit code in ``codes``; on failure exactly one ``error:`` line on stderr (``verdict``: the
    exit code of a verdict printed on stdout instead); never a traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), (what, repr(result.exception),
                                                                                  result.output[-2000:])
    assert "Traceback" not in result.output, (what, result.output[-2000:])
    assert result.exit_code in codes, (what, result.exit_code, result.output[-2000:])
    lines = result.stderr.strip().splitlines()
    if result.exit_code not in (0, verdict):
        assert len(lines) == 1 and lines[0].startswith("error: "), (what, result.stderr[-2000:])


@pytest.mark.parametrize("name", list(DAMAGED_STEPS))
def test_every_command_reports_a_damaged_step_and_goes_on(run, tmp_path, name):
    """Whatever is wrong with one step, every command answers in one line, and the others go on:
    ls lists every step (a step whose manifest is not read is marked DAMAGED, with its reason),
    show of it is one error: line or its details, verify checks every step (exit 1, the other intact),
    export refuses, report lists every step, validate gives a verdict or one error: line."""
    damage, bad = DAMAGED_STEPS[name]
    good = 2 if bad == 1 else 1
    damage(run, bad)
    url = str(run)

    ls = _cli("ls", url)
    assert_one_line(ls, (0,), what="ls")
    rows = table_rows(ls.stdout)
    assert set(rows) == {str(good), str(bad)}, ls.stdout
    if "DAMAGED" in rows[str(bad)] or "UNREADABLE" in rows[str(bad)]:
        assert f"damaged: step {bad}: " in ls.stdout, ls.stdout
    assert "DAMAGED" not in rows[str(good)]

    show = _cli("show", url, "--step", str(bad))
    assert_one_line(show, (0, 2), what="show")
    if show.exit_code == 2:
        assert f"step {bad}" in show.stderr, show.stderr
        assert "quarantine" in show.stderr or "install the ckptlib version" in show.stderr, show.stderr
    if "DAMAGED" in rows[str(bad)] or name.startswith("forged"):
        assert show.exit_code == 2, show.output

    for args in (("verify", url), ("verify", url, "--step", str(bad))):
        verify = _cli(*args)
        assert_one_line(verify, (1,), what=" ".join(args[:1] + args[2:]))
        assert f"step {bad}: damaged" in verify.stdout, verify.stdout
    assert f"step {good}: intact" in _cli("verify", url).stdout

    out = tmp_path / "exports" / "x.pt"
    out.parent.mkdir()
    assert_one_line(_cli("export", url, "--step", str(bad), "--out", str(out)), (2,), what="export")
    assert not out.exists() and list(out.parent.iterdir()) == []

    if name not in _REPORTED:
        return
    report = _cli("report", url)
    assert_one_line(report, (0,), what="report")
    listed = table_rows(report.stdout)
    assert set(listed) == {str(good), str(bad)}, report.stdout
    if "DAMAGED" in rows[str(bad)] or name.startswith("forged"):
        assert "damaged" in listed[str(bad)] and f"damaged: step {bad}: " in report.stdout, report.stdout

    if name in _VALIDATED:
        validate = _cli("validate", url, "--step", str(bad))
        assert_one_line(validate, (1, 2), what="validate", verdict=1)
        if validate.exit_code == 1:
            assert f"step {bad}: FAILED" in validate.stdout, validate.stdout


# ----------------------------------------------------------------------------- one damaged step


@pytest.fixture
def three_steps(tmp_path) -> Path:
    """Steps 1, 2, 3 (3 writes new keyframes of its own), every one validated as passed."""
    root = tmp_path / "three"
    with Checkpointer(str(root), chunk_bytes=CHUNK) as ck:
        for step in (1, 2, 3):
            s = state(step)
            if step == 3:
                s["model"]["b"] = torch.randn(3072, generator=torch.Generator().manual_seed(3))
            ck.save(step, s)
    (root / "validations").mkdir()
    for step in (1, 2, 3):
        (root / "validations" / f"{step}.json").write_text('{"passed": true, "failed": []}')
    return root


def test_a_damaged_latest_step_is_skipped_by_a_resume_and_named_by_a_restore(three_steps, caplog):
    (three_steps / "manifests" / "3.json").write_bytes(b"{not json")
    with Checkpointer(str(three_steps)) as ck:
        assert ck.latest_step() == 3 and ck.steps() == [1, 2, 3]  # still committed: listed, not hidden
        with caplog.at_level("WARNING", logger="ckptlib"):
            assert ck.latest_step(healthy=True) == 2
        assert any("skipping checkpoint step 3" in r.getMessage() and "damaged" in r.getMessage()
                   for r in caplog.records), caplog.text
        assert_same_state(state(2), ck.restore(healthy=True))
        with pytest.raises(CorruptCheckpoint) as err:
            ck.restore()
        text = str(err.value)
        assert "step 3" in text and "manifests/3.json" in text and f"ckpt quarantine {ck.url} --step 3" in text, text
        with pytest.raises(CheckpointError) as err:
            ck.gc(RetentionPolicy(keep_last=1), grace_s=0)
        assert "manifests/3.json" in str(err.value) and "ckpt quarantine" in str(err.value), err.value
        assert ck.steps() == [1, 2, 3]  # GC deleted nothing


def test_quarantine_moves_a_damaged_step_aside_gc_keeps_its_objects_and_undo_puts_it_back(three_steps):
    """A step whose chunk is damaged, moved aside: restores and GC go on without it, GC keeps every
    object it names (its own keyframes included), and undo brings back exactly what was there."""
    from ckptlib import quarantine as q

    with Checkpointer(str(three_steps)) as ck:
        frag = ck.fragment(3, "state")
        own = {b.key for b in frag.blobs.values()} - {b.key for b in ck.fragment(2, "state").blobs.values()}
        assert own  # keyframes only step 3 needs
        victim = frag.blobs[leaf_of(frag, "/model/b").chunks[0]].key
        data = bytearray((three_steps / victim).read_bytes())
        data[len(data) // 2] ^= 1
        (three_steps / victim).write_bytes(bytes(data))
        before = [str(p) for p in ck.verify(3)]
        manifest = (three_steps / "manifests" / "3.json").read_bytes()
        q.quarantine_step(ck.store, 3, "chunk flipped")
        assert ck.steps() == [1, 2] and ck.latest_step(healthy=True) == 2
        assert_same_state(state(2), ck.restore())
        assert sorted(q.quarantined(ck.store)) == [3] and q.quarantined(ck.store)[3].reason == "chunk flipped"
        assert not (three_steps / "validations" / "3.json").exists()
        report = ck.gc(RetentionPolicy(keep_last=1), grace_s=0)
        assert report.dropped_steps == [1] and ck.steps() == [2]
        assert all((three_steps / key).exists() for key in own), "GC swept objects of a quarantined step"
        with pytest.raises(NoCheckpoint, match="in quarantine already"):
            q.quarantine_step(ck.store, 3, "again")
        q.release_step(ck.store, 3)
        assert ck.steps() == [2, 3] and (three_steps / "manifests" / "3.json").read_bytes() == manifest
        assert (three_steps / "validations" / "3.json").exists() and q.quarantined(ck.store) == {}
        assert [str(p) for p in ck.verify(3)] == before  # the same damage, nothing more


def test_undo_never_replaces_a_step_committed_again(three_steps):
    from ckptlib import quarantine as q

    with Checkpointer(str(three_steps), chunk_bytes=CHUNK) as ck:
        q.quarantine_step(ck.store, 3, "by hand")
        ck.save(3, state(1))  # another state under the same step
        with pytest.raises(CheckpointError, match="committed again"):
            q.release_step(ck.store, 3)
        assert_same_state(state(1), ck.restore(3))
        assert sorted(q.quarantined(ck.store)) == [3]


def test_a_quarantine_interrupted_after_its_record_finishes_when_run_again(three_steps):
    """The record is the quarantine's commit point: run again after a crash that left the manifest
    in place, it finishes the move (and never takes a different step for the quarantined one)."""
    from ckptlib import quarantine as q
    from ckptlib.testing import FaultyStore, SimulatedCrash

    store = FaultyStore(Store.from_url(str(three_steps)))
    store.crash_after("put_if_absent", "record.json")
    with pytest.raises(SimulatedCrash):
        q.quarantine_step(store, 3, "flipped")
    plain = Store.from_url(str(three_steps))
    assert plain.exists("manifests/3.json") and q.read_record(plain, 3) is not None
    q.quarantine_step(plain, 3, "flipped")
    assert not plain.exists("manifests/3.json") and plain.exists("quarantine/3/manifests/3.json")
    q.release_step(plain, 3)
    with Checkpointer(plain) as ck:
        assert ck.steps() == [1, 2, 3] and ck.verify(3) == []


def leaf_of(frag, path: str):
    return next(x for x in frag.leaves if x.spec.path == path)


MALFORMED_DOCUMENTS = {  # key: bytes nobody's writer wrote
    "verdict-not-json": ("validations/1.json", b"not json"),
    "verdict-deep": ("validations/1.json", b'{"passed": true, "nested": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    "verdict-wrong-types": ("validations/1.json", b'{"passed": "yes", "failed": {"a": 1}}'),
    "verdict-huge": ("validations/1.json", b'{"passed": true, "pad": "' + b"x" * (20 << 20) + b'"}'),
    "beat-not-json": ("heartbeats/shard-0.json", b"\xff\xfe"),
    "beat-wrong-format": ("heartbeats/shard-0.json", b'{"format": 9, "part": "shard-0"}'),
    "beat-huge": ("heartbeats/shard-0.json", b'{"format": 1, "pad": "' + b"x" * (20 << 20) + b'"}'),
    "lease-huge": ("leases/save-" + "0" * 32 + ".json", b"{" + b" " * (1 << 20) + b"}"),
    "fence-junk": ("fences/shard-0/1", b"\x00" * 100),
}


@pytest.mark.parametrize("name", list(MALFORMED_DOCUMENTS))
def test_every_command_reads_a_malformed_small_document_as_unknown(run, name):
    """A verdict, beat, lease or fence nobody wrote: every command goes on, reading it as unknown (a
    verdict as not validated, a beat as no beat, a lease as protecting nothing)."""
    key, data = MALFORMED_DOCUMENTS[name]
    (run / key).parent.mkdir(parents=True, exist_ok=True)
    (run / key).write_bytes(data)
    url = str(run)
    for args in (("ls", url), ("verify", url), ("show", url, "--step", "1"), ("report", url), ("status", url)):
        result = _cli(*args)
        assert_one_line(result, (0,), what=" ".join(args[:1]))
    assert "passed" not in table_rows(_cli("ls", url).stdout)["1"]
    with Checkpointer(url) as ck:
        assert ck.latest_step(healthy=True) is None
        assert_same_state(state(2), ck.restore(2))
