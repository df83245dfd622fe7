"""Format 2 state encoding: every value comes back with the same type and value, or ``save`` refuses it.

Round-trip cases ported from public suites (what goes in, what must come out), not their harness:

* pytorch/torchsnapshot tests/test_flatten.py (nested dicts/lists/OrderedDict, '/' and '%' in keys,
  empty keys, colliding and mixed-type keys, long lists), test_serialization.py (every dtype;
  quantized tensors), test_rng_state.py (RNG state restored => the same draws), test_snapshot.py /
  test_state_dict.py (nn.Linear, nn.Sequential, Adagrad state, restore into another module,
  invalid app state);
* pytorch/pytorch test/distributed/checkpoint/test_state_dict_stager.py (views sharing storage,
  tensor attributes, every dtype, empty and 0-dim tensors, dataclasses, custom objects),
  test_state_dict_utils.py (bytes, BytesIO, 0-dim step tensors, nested lists), test_state_dict.py
  (optimizer state keyed by int, param_groups).

Mechanism: every "exact" case is saved here (its own store under one temp dir), then ONE fresh
Python process (``python -c`` importing this file) restores every case, regenerates the expected
value from the same deterministic factory, compares with ``ckptlib.testing.compare.differences`` (exact types,
bits, strides, requires_grad, Parameter-ness, attributes, key order, ties) and prints per-case results
as JSON. Each case is then one pytest test reading its result.

What the expected value is: the saved value itself, except for what docs promise to change: a
lone tensor (no other tensor of the state shares its storage) whose layout has gaps or broadcast
strides comes back C-contiguous (with its conjugate/negative bits); tensors that are the same
memory (same storage, offset, shape, strides, dtype, type, flags) come back as one tensor object;
tensors that share a storage otherwise come back sharing one storage, with their offsets, strides,
dtypes and bits (as ``torch.save`` keeps them); a non-leaf tensor comes back detached (a
checkpoint holds no autograd graph). The comparison checks the bits and the storage sharing.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import decimal
import enum
import fractions
import functools
import io
import json
import os
import pathlib
import random
import struct
import subprocess
import sys
import typing
import uuid
from typing import Any, Callable

import numpy as np
import pytest
import torch

from ckptlib import Checkpointer, UnsupportedState
from ckptlib.testing import compare as ckptlib_compare
from ckptlib.testing.compare import assert_same_state, differences, tie_pattern
from ckptlib.types import REFUSED_TORCH_DTYPES

SMALL = 4096  # chunk_bytes that forces chunking and packing

TORCH_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex128, torch.complex64,
                torch.complex32, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint64, torch.uint32,
                torch.uint16, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
                torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2,
                torch.bits8, torch.bits16, torch.bits1x8, torch.bits2x4, torch.bits4x2]

NUMPY_DTYPES = ["<f8", "<f4", "<f2", "<f16", "<c8", "<c16", "<c32", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2",
                "<u4", "<u8", "|b1", "<M8[ns]", "<M8[D]", "<m8[s]", "<U3", "|S5", ">f4", ">f8", ">i8", ">u2",
                ">c16", ">U2", ">M8[us]"]


def _name(dt: Any) -> str:
    return str(dt).removeprefix("torch.").replace("<", "le_").replace(">", "be_").replace("|", "").replace(
        "[", "_").replace("]", "")


# --- deterministic value factories -------------------------------------------------------------

class _fork_rngs:
    """Keep the global torch/numpy/python RNGs of the calling process untouched."""

    def __enter__(self):
        self.saved = (torch.get_rng_state(), np.random.get_state(), random.getstate())

    def __exit__(self, *exc):
        torch.set_rng_state(self.saved[0])
        np.random.set_state(self.saved[1])
        random.setstate(self.saved[2])


def rand_tensor(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    """Random bits of ``dtype`` (every float pattern: NaNs with payloads, infs, -0.0, subnormals)."""
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, itemsize), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).clone()


def rand_array(dtype: str, shape: tuple, seed: int) -> np.ndarray:
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(dt)
    if dt.kind == "U":  # valid code points (trailing NULs included: numpy strips them on access)
        points = np.array([ord(c) for c in "aé✓日🎉 z\x00"], dtype=dt.byteorder.replace("|", "<") + "u4")
        return rng.choice(points, size=n * (dt.itemsize // 4)).view(dt).reshape(shape).copy()
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape).copy()


def _bits_float(hexbits: str) -> float:
    return struct.unpack(">d", bytes.fromhex(hexbits))[0]


def _mix(a: Any, b: Any) -> Any:
    """``a`` with every 7th element replaced by ``b``'s (the next step of a training run: a delta)."""
    if isinstance(a, torch.Tensor):
        out = a.detach().clone()
        if out.numel():
            ro = out.reshape(-1).view(torch.uint8).reshape(out.numel(), -1)
            rb = b.detach().contiguous().reshape(-1).view(torch.uint8).reshape(out.numel(), -1)
            ro[::7] = rb[::7]
        return out
    if isinstance(a, np.ndarray):
        out = a.copy()
        if out.size:
            ro = out.reshape(-1).view(np.uint8).reshape(out.size, -1)
            ro[::7] = b.reshape(-1).view(np.uint8).reshape(out.size, -1)[::7]
        return out
    if isinstance(a, dict):
        return type(a)((k, _mix(v, b[k])) for k, v in a.items())
    if isinstance(a, list):
        return [_mix(x, y) for x, y in zip(a, b)]
    return a


def _small_model(seed: int) -> torch.nn.Module:
    with _fork_rngs():
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.ReLU(),
                                   torch.nn.Linear(5, 3))


def _trained_optimizer_state(cls: type, seed: int, **kw: Any) -> dict:
    """A real optimizer state_dict (state keyed by int, param_groups with tuples, None, bools)."""
    model = _small_model(seed)
    opt = cls(model.parameters(), **kw)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 6, generator=g)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 2}


def _tied_lm(seed: int) -> dict:
    with _fork_rngs():
        torch.manual_seed(seed)
        emb = torch.nn.Embedding(11, 4)
        head = torch.nn.Linear(4, 11, bias=False)
        head.weight = emb.weight
        model = torch.nn.ModuleDict({"emb": emb, "head": head})
    return model.state_dict()


def _rng_states(seed: int) -> dict:
    with _fork_rngs():
        torch.manual_seed(seed)
        torch.rand(7)
        np.random.seed(seed)
        np.random.standard_normal()  # legacy state with a cached gaussian (has_gauss=1)
        random.seed(seed)
        random.gauss(0, 1)  # python state with gauss_next set
        gen = torch.Generator().manual_seed(seed + 1)
        torch.rand(3, generator=gen)
        pcg = np.random.default_rng(seed)
        pcg.random(5)
        return {
            "torch": torch.get_rng_state(),
            "torch_generator": gen.get_state(),
            "numpy_legacy": np.random.get_state(),
            "numpy_legacy_dict": np.random.get_state(legacy=False),
            "numpy_pcg64": pcg.bit_generator.state,
            "numpy_philox": np.random.Philox(seed).state,
            "numpy_sfc64": np.random.SFC64(seed).state,
            "numpy_mt19937": np.random.MT19937(seed).state,
            "numpy_pcg64dxsm": np.random.PCG64DXSM(seed).state,
            "python": random.getstate(),
            "python_fresh": random.Random(seed).getstate(),
        }


def _rng_draws(states: dict) -> dict:
    """What each RNG state produces when loaded back (the torchsnapshot RNG test, for every RNG)."""
    out = {}
    with _fork_rngs():
        torch.set_rng_state(states["torch"])
        out["torch"] = torch.rand(4).tolist()
        g = torch.Generator()
        g.set_state(states["torch_generator"])
        out["torch_generator"] = torch.rand(4, generator=g).tolist()
        np.random.set_state(states["numpy_legacy"])
        out["numpy_legacy"] = np.random.standard_normal(3).tolist()
        np.random.set_state(states["numpy_legacy_dict"])
        out["numpy_legacy_dict"] = np.random.standard_normal(3).tolist()
        for key, cls in [("numpy_pcg64", np.random.PCG64), ("numpy_philox", np.random.Philox),
                         ("numpy_sfc64", np.random.SFC64), ("numpy_mt19937", np.random.MT19937),
                         ("numpy_pcg64dxsm", np.random.PCG64DXSM)]:
            bg = cls()
            bg.state = states[key]
            out[key] = np.random.Generator(bg).random(3).tolist()
        random.setstate(states["python"])
        out["python"] = [random.random(), random.gauss(0, 1)]
        r = random.Random()
        r.setstate(states["python_fresh"])
        out["python_fresh"] = [r.random()]
    return out


def _check_rng(expected: Any, restored: Any) -> list[str]:
    try:
        got = _rng_draws(restored)
    except Exception as e:  # a state of the wrong type cannot even be loaded
        return [f"loading the restored RNG states failed: {type(e).__name__}: {e}"]
    want = _rng_draws(expected)
    return [f"{k}: draws {want[k]} expected, got {got[k]}" for k in want if want[k] != got[k]]


# --- the table of exact cases ------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    make: Callable[[int], Any]
    chunk_bytes: int = 4 << 20
    delta: bool = False  # also save a second step with every 7th element changed (delta encoding)
    check: Callable[[Any, Any], list[str]] | None = None  # extra check in the fresh process
    second: Callable[[int], Any] | None = None  # the second step's state (delta), when _mix would lose sharing

    def next_state(self) -> Any:
        return self.second(0) if self.second is not None else _mix(self.make(0), self.make(1))


def exact_cases() -> dict[str, Case]:
    C: dict[str, Case] = {}

    # containers (torchsnapshot test_flatten.py)
    C["nested_flatten_obj"] = Case(lambda s: {
        "foo": 0, "bar": 1,
        "baz": [2, 3, {"qux": 4, "quxx": [5, collections.OrderedDict(quuz=6, corge=[7, 8, 9])]}],
        "x/y": {"%a/b": 10}, "": {"": []},
        "dict_with_colliding_keys": {"0": {"1": "foo", 1: "bar"}, 0: "baz"},
        "dict_with_mixed_type_keys": {0: {"0": "foo", 1: "bar"}, "1": "baz"},
        "long_list": list(range(100))})
    C["key_order"] = Case(lambda s: {"b": 1, "a": 2, "c": {"z": 1, "y": [], "x": {}}, "10": 0, "9": 0, "1": 0})
    C["tag_like_keys"] = Case(lambda s: {"__leaf__": 0, "__tuple__": [1, 2], "__map__": {"type": "Counter"},
                                         "lone": {"__leaf__": 0}, "lone2": {"__ref__": 0},
                                         "lone3": {"__float__": "nan"}, "lone4": {"__np__": ["<f8", "00"]}})
    C["non_str_keys"] = Case(lambda s: {1: "int", -7: "neg", 2.5: "float", -0.0: "negzero", float("inf"): "inf",
                                        (1, "a", (2.0, None)): "tuple", None: "none", False: "bool", 3j: "complex",
                                        frozenset({1, 2}): "frozenset", np.int64(7): "np.int64",
                                        np.float32(0.5): "np.float32", "s": "str"})
    C["nan_key"] = Case(lambda s: {float("nan"): 1, "x": 2})
    C["tuples"] = Case(lambda s: {"t": (1, (2, 3), [], (), ("x",)), "empty": (), "nested": ((((1,),),),)})
    C["sets"] = Case(lambda s: {"s": {1, 2, 3}, "f": frozenset({"a", "b"}), "e": set(), "ef": frozenset(),
                                "tuples": {(1, 2), (3, "x")}, "mixed": {1, "1", 2.5, None, (1, 2), b"x", False},
                                "nested": frozenset({frozenset({1}), frozenset()})})
    C["ordered_dict_attrs"] = Case(lambda s: _od_with_attrs())
    C["defaultdicts"] = Case(lambda s: {
        "list": collections.defaultdict(list, {"a": [1, 2]}), "int": collections.defaultdict(int, {"n": 3}),
        "none": collections.defaultdict(None, {1: 2}), "dict": collections.defaultdict(dict),
        "set": collections.defaultdict(set, {"k": {1}}), "od": collections.defaultdict(collections.OrderedDict),
        "counter": collections.defaultdict(collections.Counter),
        "float": collections.defaultdict(float), "str": collections.defaultdict(str, {"s": "v"}),
        "tuple": collections.defaultdict(tuple), "bytes": collections.defaultdict(bytes)})
    C["counter"] = Case(lambda s: {"c": collections.Counter(a=3, b=-1, z=0), "empty": collections.Counter(),
                                   "int_keys": collections.Counter({30: 1, 80: 2})})
    C["deep_100_lists"] = Case(lambda s: functools.reduce(lambda acc, _: [acc], range(99), [1]))
    C["deep_100_mixed"] = Case(lambda s: functools.reduce(
        lambda acc, i: (acc,) if i % 3 == 0 else ({1: acc} if i % 3 == 1 else collections.OrderedDict(x=acc)),
        range(99), {"leaf": 1}))
    C["empty_containers"] = Case(lambda s: {"d": {}, "l": [], "t": (), "od": collections.OrderedDict(), "s": ""})
    C["top_level_state_dict"] = Case(lambda s: _small_model(s).state_dict(), chunk_bytes=SMALL, delta=True)
    C["top_level_empty_dict"] = Case(lambda s: {})
    C["colliding_leaf_paths"] = Case(lambda s: {  # different leaves whose '/'-paths are the same string
        "a/b": rand_tensor(torch.float32, (300,), s), "a": {"b": rand_tensor(torch.float64, (200,), s + 1)},
        0: rand_tensor(torch.int16, (500,), s + 2), "0": rand_tensor(torch.int16, (500,), s + 3),
        1.0: rand_array("<f4", (300,), s), "1.0": rand_array("<f4", (300,), s + 1)}, chunk_bytes=SMALL, delta=True)
    C["shared_subtree"] = Case(lambda s: (lambda shared: {"a": shared, "b": shared})([1, {"x": 2}]))

    # scalars
    C["strings"] = Case(lambda s: ["", "ascii", "héllo wörld ✓ 日本語 🎉", "\x00nul\x00", "tab\tnew\nline", "\\",
                                   '"quoted"', "a" * 10000, "\u200b\ufeff", "/slash/", "__leaf__"])
    C["string_lone_surrogate"] = Case(lambda s: {"s": "\ud800x\udfff"})
    C["ints"] = Case(lambda s: [0, 1, -1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**100,
                                -(10**300), 2**12999, -(2**12999)])
    C["bools_none"] = Case(lambda s: [True, False, None, [True, 1, 1.0], {"t": True, "one": 1}])
    C["floats"] = Case(lambda s: [0.0, -0.0, 1.5, -2.25, 1e308, -1e308, 5e-324, 2.2250738585072014e-308, 1e16,
                                  0.1, 1 / 3, float("inf"), float("-inf"), float("nan"), -float("nan"),
                                  _bits_float("7ff8000000000001"), _bits_float("fff0000000abcdef"),
                                  _bits_float("7ff4000000000000")])
    C["complex"] = Case(lambda s: [1 + 2j, complex(-0.0, -0.0), complex(float("nan"), float("inf")),
                                   complex(0, _bits_float("7ff8000000000123")), 1e308j, 0j])
    C["bytes"] = Case(lambda s: {"b": b"", "b2": b"\x00\xff" * 100, "ba": bytearray(b"abc"), "ba0": bytearray(),
                                 "big": bytes(range(256)) * 40}, chunk_bytes=SMALL)
    C["numpy_scalars"] = Case(lambda s: {
        "f64nan": np.float64("nan"), "f64": np.float64(1.5), "f32": np.float32(0.5), "f16": np.float16(-0.0),
        "ld": np.longdouble(1) / 3, "cld": np.clongdouble(1 + 1j) / 3, "c64": np.complex64(1 - 2j),
        "c128": np.complex128(complex(float("nan"), -0.0)),
        "i8": np.int8(-128), "u8": np.uint8(255), "i16": np.int16(-2), "u16": np.uint16(65535),
        "i32": np.int32(-(2**31)), "u32": np.uint32(2**32 - 1), "i64": np.int64(-(2**63)), "u64": np.uint64(2**64 - 1),
        "b": np.bool_(True), "bf": np.bool_(False),
        "dt": np.datetime64("2024-02-29T12:34:56", "s"), "dtns": np.datetime64(1, "ns"), "nat": np.datetime64("NaT"),
        "td": np.timedelta64(5, "ms"), "str": np.str_("héllo"), "bytes": np.bytes_(b"ab\x00c")})
    C["numpy_empty_str_scalars"] = Case(lambda s: {"str": np.str_(""), "bytes": np.bytes_(b"")})
    C["torch_objects"] = Case(lambda s: {
        "size": torch.Size([2, 3]), "size0": torch.Size([]), "dtypes": [getattr(torch, _name(d)) for d in TORCH_DTYPES],
        "refused_dtypes": [torch.int4, torch.uint1, torch.qint8, torch.quint4x2],
        "devices": [torch.device("cpu"), torch.device("cuda:1"), torch.device("cuda"), torch.device("meta")]})
    C["top_level_int"] = Case(lambda s: 5)
    C["top_level_none"] = Case(lambda s: None)
    C["top_level_list"] = Case(lambda s: [torch.arange(3), "x"])
    C["top_level_tensor"] = Case(lambda s: rand_tensor(torch.float32, (4, 3), s))

    # tensors of every dtype and shape (torchsnapshot test_serialization.py, DCP stager dtypes/empty)
    for dt in TORCH_DTYPES:
        C[f"tensor_{_name(dt)}"] = Case(
            functools.partial(lambda dt, s: {"m": rand_tensor(dt, (37, 29), s), "scalar": rand_tensor(dt, (), s + 1),
                                             "empty": rand_tensor(dt, (0,), s), "empty3": rand_tensor(dt, (3, 0, 2), s),
                                             "one": rand_tensor(dt, (1,), s + 2)}, dt),
            chunk_bytes=SMALL, delta=True)
    for dt in NUMPY_DTYPES:
        C[f"numpy_{_name(dt)}"] = Case(
            functools.partial(lambda dt, s: {"m": rand_array(dt, (41, 13), s), "scalar0d": rand_array(dt, (), s + 1),
                                             "empty": rand_array(dt, (0,), s), "empty2": rand_array(dt, (2, 0), s)}, dt),
            chunk_bytes=SMALL, delta=True)
    C["numpy_layouts"] = Case(lambda s: {
        "fortran": np.asfortranarray(rand_array("<f4", (7, 9), s)),
        "fortran3": np.asfortranarray(rand_array("<i2", (3, 4, 5), s)),
        "fortran_be": np.asfortranarray(rand_array(">f8", (6, 5), s)),
        "slice": rand_array("<f8", (10, 10), s)[::2, 1::3],
        "transposed3": rand_array("<u4", (2, 3, 4), s).transpose(1, 0, 2),
        "readonly": _readonly(rand_array("<f4", (5,), s))}, chunk_bytes=SMALL)
    C["tensor_layouts"] = Case(lambda s: {
        "channels_last": rand_tensor(torch.float32, (2, 3, 4, 5), s).to(memory_format=torch.channels_last),
        "channels_last_3d": rand_tensor(torch.bfloat16, (2, 3, 2, 4, 5), s).to(memory_format=torch.channels_last_3d),
        "transposed": rand_tensor(torch.float64, (6, 9), s).t(),
        "permuted": rand_tensor(torch.int16, (2, 3, 4), s).permute(2, 0, 1),
        "strided_slice": rand_tensor(torch.float32, (8, 8), s)[:, ::2],
        "narrow_offset": rand_tensor(torch.float32, (8, 8), s)[3:5],
        "expanded": rand_tensor(torch.float32, (1, 4), s).expand(3, 4),
        "diagonal": rand_tensor(torch.float32, (5, 5), s).diagonal()}, chunk_bytes=SMALL)
    C["storage_sharing_views"] = Case(lambda s: (lambda base: {  # DCP test_complex_storage_sharing
        "base": base, "view1": base.view(100), "view2": base.view(10, 10), "slice1": base[2:8, 2:8],
        "slice2": base[:, :5], "slice3": base.view(100)[10:60]})(rand_tensor(torch.float32, (10, 10), s)))
    C["conj_neg_views"] = Case(lambda s: (lambda z: {"conj": z.conj(), "neg": torch._neg_view(z.real.clone())})(
        rand_tensor(torch.complex64, (4, 3), s)))
    C["conj_view_beside_base"] = Case(lambda s: (lambda z: {"z": z, "z_conj": z.conj()})(
        torch.randn(3, 2, dtype=torch.complex64, generator=torch.Generator().manual_seed(s))))
    C["neg_view_beside_base"] = Case(lambda s: (lambda x: {"x": x, "x_neg": torch._neg_view(x)})(
        torch.randn(5, generator=torch.Generator().manual_seed(s))))
    C["parameters_requires_grad"] = Case(lambda s: {
        "p": torch.nn.Parameter(rand_tensor(torch.float32, (3, 4), s)),
        "frozen": torch.nn.Parameter(rand_tensor(torch.float32, (2,), s), requires_grad=False),
        "bf16_param": torch.nn.Parameter(rand_tensor(torch.bfloat16, (5,), s)),
        "leaf_rg": torch.randn(3, generator=torch.Generator().manual_seed(s)).requires_grad_(),
        "plain": torch.zeros(2),
        "non_leaf": torch.ones(3, requires_grad=True) * 2})
    C["int_parameter"] = Case(lambda s: {"int_param": torch.nn.Parameter(torch.arange(4), requires_grad=False),
                                         "bool_param": torch.nn.Parameter(torch.ones(2, dtype=torch.bool),
                                                                          requires_grad=False)})
    C["tied_same_object"] = Case(lambda s: (lambda p, t: {"a": p, "b": p, "c": [t, t], "d": {"t": t}})(
        torch.nn.Parameter(rand_tensor(torch.float32, (3, 3), s)), rand_tensor(torch.int64, (4,), s)))
    C["tied_detached_views"] = Case(lambda s: (lambda p: {"param": p, "view": p.detach(), "view2": p.detach(),
                                                          "other_dtype": p.detach().view(torch.int32)})(
        torch.nn.Parameter(rand_tensor(torch.float32, (3, 3), s))))
    C["tied_lm_state_dict"] = Case(_tied_lm)
    C["overlapping_slices"] = Case(lambda s: (lambda b: {"a": b[0:60], "b": b[40:100], "inner": b[10:20],
                                                         "every_third": b[::3], "rev_2d": b.view(10, 10).t()})(
        rand_tensor(torch.float32, (100,), s)))
    C["dtypes_viewing_one_storage"] = Case(lambda s: (lambda b: {
        "f32": b, "i32": b.view(torch.int32)[3:9], "u8": b.view(torch.uint8)[5:77], "bf16": b.view(torch.bfloat16),
        "c64_conj": b.view(torch.complex64)[2:6].conj(), "f64": b[2:10].view(torch.float64),
        "bool": b.view(torch.bool)[1:3]})(rand_tensor(torch.float32, (32,), s)))
    C["slices_without_their_base"] = Case(lambda s: (lambda big: {"x": big[:, :3], "y": big[:, 2:5]})(
        rand_tensor(torch.float64, (50, 40), s)))
    C["parameter_and_its_views"] = Case(lambda s: (lambda p: {
        "p": p, "flat": p.detach().view(-1), "row": p[1], "tagged": _with_attrs(p.detach()[2:]),
        "frozen_alias": torch.nn.Parameter(p.detach()[0], requires_grad=False)})(
        torch.nn.Parameter(rand_tensor(torch.float32, (4, 5), s))))
    C["expanded_view_beside_its_base"] = Case(lambda s: (lambda r: {"row": r, "expanded": r.expand(3, 4)})(
        rand_tensor(torch.int64, (1, 4), s)))
    C["views_nested_and_tied"] = Case(lambda s: (lambda b: (lambda v: {
        "a": [v, v], "b": collections.OrderedDict(x=b), "c": (v,), 7: {"d": b[1:2]}})(b[3:]))(
        rand_tensor(torch.int16, (9, 2), s)))
    C["shared_storage_delta"] = Case(lambda s: _shared_state(rand_tensor(torch.float32, (64, 64), s)),
                                     chunk_bytes=SMALL, delta=True,
                                     second=lambda s: _shared_state(_mix(rand_tensor(torch.float32, (64, 64), s),
                                                                         rand_tensor(torch.float32, (64, 64), s + 1))))
    C["conj_neg_lone_layouts"] = Case(lambda s: (lambda z, x: {
        "conj_t": z.t().conj(), "conj_strided": z[:, ::2].conj(), "neg_int": torch._neg_view(x),
        "conj_and_neg": torch._neg_view(z.conj()), "conj_empty": torch.zeros(0, 3, dtype=torch.complex128).conj(),
        "neg_param": torch.nn.Parameter(torch._neg_view(x.float()))})(
        rand_tensor(torch.complex64, (6, 4), s), rand_tensor(torch.int32, (7,), s)))
    C["low_precision_requires_grad"] = Case(lambda s: {
        "fp8": rand_tensor(torch.float8_e4m3fn, (6,), s).requires_grad_(),
        "fp8_param": torch.nn.Parameter(rand_tensor(torch.float8_e5m2, (3,), s)),
        "fp4": rand_tensor(torch.float4_e2m1fn_x2, (4,), s).requires_grad_()})

    # real states (torchsnapshot test_snapshot.py, DCP test_state_dict.py)
    C["module_state_dicts"] = Case(lambda s: {"linear": _linear_sd(s), "seq": _small_model(s).state_dict(),
                                              "encoder": _encoder_sd(s)})
    C["adam_state"] = Case(lambda s: _trained_optimizer_state(torch.optim.Adam, s, lr=1e-2, betas=(0.8, 0.9)))
    C["adamw_amsgrad_state"] = Case(lambda s: _trained_optimizer_state(torch.optim.AdamW, s, lr=1e-2, amsgrad=True))
    C["sgd_momentum_state"] = Case(lambda s: _trained_optimizer_state(torch.optim.SGD, s, lr=0.1, momentum=0.9,
                                                                      nesterov=True))
    C["adagrad_state"] = Case(lambda s: _trained_optimizer_state(torch.optim.Adagrad, s, lr=0.01))
    C["rmsprop_state"] = Case(lambda s: _trained_optimizer_state(torch.optim.RMSprop, s, lr=0.01, centered=True))
    C["lbfgs_state"] = Case(lambda s: _lbfgs_state(s))
    C["rng_states"] = Case(_rng_states, check=lambda e, r: _check_rng(e, r))
    C["dcp_cpu_state_dict"] = Case(lambda s: {  # DCP test_state_dict_utils.py test_create_cpu_state_dict
        "tensor1": torch.arange(10), "tensor2": torch.ones(10), "non_tensor_bytes": b"\x80\x02" + bytes(30),
        "step": torch.tensor(7, dtype=torch.float), "lr": 1.5, "nested": {"list": [1, 2, 3, 4]}})

    # big and many (chunking, packing)
    C["large_multichunk"] = Case(lambda s: {"w": rand_tensor(torch.float32, (300, 257), s),
                                            "b16": rand_tensor(torch.bfloat16, (70001,), s + 1),
                                            "c128": rand_tensor(torch.complex128, (3001,), s + 2),
                                            "np_u3": rand_array("<U3", (3001,), s), "np_s5": rand_array("|S5", (4099,), s),
                                            "np_ld": rand_array("<f16", (1001,), s)},
                                 chunk_bytes=SMALL, delta=True)
    C["many_small"] = Case(lambda s: {f"t{i}": rand_tensor(TORCH_DTYPES[i % len(TORCH_DTYPES)], (i % 7, 3), s + i)
                                      for i in range(300)} | {f"n{i}": rand_array(NUMPY_DTYPES[i % len(NUMPY_DTYPES)],
                                                                                  (i % 5,), s + i) for i in range(60)},
                           chunk_bytes=SMALL, delta=True)
    return C


def _shared_state(base: torch.Tensor) -> dict:
    """Views of one storage large enough for chunks: the storage leaf is chunked and delta-encoded."""
    return {"base": base, "flat": base.view(-1), "top": base[:16], "cols": base[:, 8:40], "bytes": base.view(torch.uint8)[7:]}


class Color(enum.IntEnum):
    RED = 1


class Mode(enum.Enum):
    TRAIN = "train"


class Flags(enum.Flag):
    A = 1


Point = collections.namedtuple("Point", "x y")


class TypedPoint(typing.NamedTuple):
    x: int


@dataclasses.dataclass
class DC:
    tensor: Any
    value: int = 42


@dataclasses.dataclass(frozen=True)
class FrozenDC:
    value: int = 100


class MyStr(str):
    pass


class MyInt(int):
    pass


class MyDict(dict):
    pass


class MyList(list):
    pass


class MyOD(collections.OrderedDict):
    pass


class MyTensor(torch.Tensor):
    pass


class Plain:
    pass


def _od_with_attrs() -> collections.OrderedDict:
    od = collections.OrderedDict([("b", 1), ("a", collections.OrderedDict())])
    od._metadata = collections.OrderedDict([("", {"version": 1}), ("sub.x", {"version": 2})])
    od.extra = [1, (2, 3)]
    return od


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _with_attrs(t: torch.Tensor) -> torch.Tensor:
    t.a = 42  # DCP test_state_dict_stager.py test_tensor_attrs
    t.b = "x"
    return t


def _linear_sd(seed: int) -> dict:
    with _fork_rngs():
        torch.manual_seed(seed)
        return torch.nn.Linear(128, 64).state_dict()


def _encoder_sd(seed: int) -> dict:
    with _fork_rngs():
        torch.manual_seed(seed)
        return torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16).state_dict()


def _lbfgs_state(seed: int) -> dict:
    model = _small_model(seed)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=4)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed))

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    opt.step(closure)
    return opt.state_dict()


# --- what a restore is expected to return ------------------------------------------------------

def _dense(t: torch.Tensor) -> bool:
    if t.numel() <= 1 or t.is_contiguous():
        return True
    expect = 1
    for d in sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d))):
        if t.size(d) == 1:
            continue
        if t.stride(d) != expect:
            return False
        expect *= t.size(d)
    return True


def _tie_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), tuple(t.stride()),
            type(t), t.requires_grad and t.is_leaf, t.is_conj(), t.is_neg())


def _shared_storages(obj: Any) -> set[int]:
    """The storages that more than one distinct view of ``obj``'s tensors use."""
    views: dict[int, set[tuple]] = collections.defaultdict(set)
    for _, t in ckptlib_compare._tensors_in_order(obj, "", 0):
        if t.numel():
            views[t.untyped_storage().data_ptr()].add(_tie_key(t))
    return {ptr for ptr, keys in views.items() if len(keys) > 1}


def _compacted(t: torch.Tensor) -> torch.Tensor:
    """A lone tensor with gaps in its layout: a contiguous copy of its memory, with its bits."""
    conj, neg = t.is_conj(), t.is_neg()
    raw = t.conj() if conj else t
    raw = torch._neg_view(raw) if neg else raw
    new = raw.contiguous()
    new = new.conj() if conj else new
    return torch._neg_view(new) if neg else new


def documented(obj: Any) -> Any:
    """``obj`` as the docs say a restore returns it (see the module docstring)."""
    memo: dict[tuple, torch.Tensor] = {}
    by_id: dict[int, torch.Tensor] = {}
    shared = _shared_storages(obj)

    def tensor(t: torch.Tensor) -> torch.Tensor:
        if id(t) in by_id:
            return by_id[id(t)]
        key = None
        if t.numel():
            key = _tie_key(t)
            if key in memo:
                by_id[id(t)] = memo[key]
                return memo[key]
        new = t
        if not t.is_leaf:
            new = t.detach()
        if not _dense(new) and not (t.numel() and t.untyped_storage().data_ptr() in shared):
            new = _compacted(new)
        if new is not t and type(t) is torch.nn.Parameter:
            new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
        if key is not None:
            memo[key] = new
        by_id[id(t)] = new
        return new

    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return tensor(o)
        if isinstance(o, np.ndarray):
            return np.array(o, order="F" if o.ndim > 1 and o.flags.f_contiguous and not o.flags.c_contiguous else "C")
        if type(o) is collections.defaultdict:
            out = collections.defaultdict(o.default_factory, ((k, walk(v)) for k, v in o.items()))
        elif isinstance(o, dict) and type(o) in (dict, collections.OrderedDict, collections.Counter):
            out = type(o)()
            for k, v in o.items():
                out[k] = walk(v)
        elif type(o) in (list, tuple):
            return type(o)(walk(v) for v in o)
        else:
            return o
        for name, v in vars(o).items() if hasattr(o, "__dict__") else ():
            setattr(out, name, walk(v))
        return out

    return walk(obj)


def expected_value(case: Case, final: bool = True) -> Any:
    if case.delta and final:
        return documented(case.next_state())
    return documented(case.make(0))


# --- saving here, restoring in a fresh process -------------------------------------------------

def _save_case(root: str, name: str, case: Case) -> str | None:
    """Save one case under root/name; None, or why the save failed."""
    try:
        with Checkpointer(os.path.join(root, name), chunk_bytes=case.chunk_bytes, threads=2) as ck:
            ck.save(1, case.make(0))
            if case.delta:
                ck.save(2, case.next_state())
    except Exception as e:
        return f"save raised {type(e).__name__}: {e}"
    return None


def fresh_process_main(root: str, names: list[str]) -> dict[str, list[str]]:
    """Runs in the fresh process: restore every case, compare, return {name: [differences]}."""
    cases = exact_cases()
    results: dict[str, list[str]] = {}
    for name in names:
        case = cases[name]
        try:
            with Checkpointer(os.path.join(root, name), threads=2) as ck:
                diffs = []
                for step in ([1, 2] if case.delta else [1]):
                    restored = ck.restore(step)
                    expected = expected_value(case, final=step == 2)
                    diffs += [f"step {step}: {d}" for d in differences(expected, restored)]
                    diffs += [f"step {step}: verify: {p}" for p in ck.verify(step)]
                    if case.check is not None:
                        diffs += [f"step {step}: {d}" for d in case.check(expected, restored)]
                results[name] = diffs
        except Exception as e:
            results[name] = [f"restore raised {type(e).__name__}: {str(e)[:500]}"]
    return results


CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import test_state_roundtrip as m
print("RESULTS " + json.dumps(m.fresh_process_main(sys.argv[2], json.loads(sys.argv[3]))))
"""


@pytest.fixture(scope="module")
def fresh_results(tmp_path_factory) -> dict[str, list[str]]:
    root = str(tmp_path_factory.mktemp("roundtrip"))
    cases = exact_cases()
    results: dict[str, list[str]] = {}
    saved = []
    for name, case in cases.items():
        err = _save_case(root, name, case)
        if err:
            results[name] = [err]
        else:
            saved.append(name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_repo_root(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", CHILD, os.path.dirname(os.path.abspath(__file__)), root,
                           json.dumps(saved)], capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"fresh process failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    results.update(json.loads(lines[-1][len("RESULTS "):]))
    return results


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", list(exact_cases()))
def test_exact_roundtrip_in_fresh_process(fresh_results, name):
    diffs = fresh_results[name]
    assert not diffs, f"case {name!r} does not round-trip exactly:\n  " + "\n  ".join(diffs)


def test_factories_are_deterministic_and_comparison_is_strict():
    """The harness itself: each factory gives the same value twice (so the fresh process can
    regenerate it), and the comparison catches what it must."""
    for name, case in exact_cases().items():
        assert not differences(expected_value(case), expected_value(case)), name
    bad = [(1, True), (1.0, 1), (0.0, -0.0), (float("nan"), -float("nan")), ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
           (collections.OrderedDict(a=1), {"a": 1}), ((1,), [1]), ({1}, frozenset({1})), (np.float64(1), 1.0),
           (np.array([1], ">i4"), np.array([1], "<i4")), (torch.zeros(2, 3), torch.zeros(3, 2).t()),
           (torch.nn.Parameter(torch.zeros(1)), torch.zeros(1)), (torch.zeros(1, requires_grad=True), torch.zeros(1)),
           (collections.defaultdict(list), collections.defaultdict(int)), (_od_with_attrs(), collections.OrderedDict(
               [("b", 1), ("a", collections.OrderedDict())])), (torch.tensor([float("nan")]), torch.tensor([-float("nan")])),
           (np.asfortranarray(np.zeros((2, 2))), np.zeros((2, 2))), (np.str_("a"), "a")]
    for a, b in bad:
        assert differences(a, b), (a, b)
    t = torch.zeros(2)
    assert differences({"a": t, "b": t}, {"a": torch.zeros(2), "b": torch.zeros(2)})
    assert tie_pattern({"a": t, "b": [t]}) == [("/a", "/a"), ("/b/0", "/a")]


# --- refused values ----------------------------------------------------------------------------

def _cycle_list():
    x: list = []
    x.append(x)
    return x


def _cycle_dict():
    d: dict = {}
    d["inner"] = {"me": d}
    return d


def _cycle_attr():
    od = collections.OrderedDict()
    od.self_ref = od
    return od


def _deep(n: int, kind: str) -> Any:
    x: Any = 1
    for _ in range(n):
        x = [x] if kind == "list" else {"k": x}
    return x


def _fake_tensor():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(3)


def _dtensor():
    """A real DTensor on a one-process gloo group (the group is gone again when it is saved)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, DTensor, Shard

    if not dist.is_available():  # pragma: no cover
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        return DTensor.from_local(torch.ones(4), DeviceMesh("cpu", [0]), [Shard(0)])
    finally:
        dist.destroy_process_group()


def _memmap(tmp: str):
    return np.memmap(os.path.join(tmp, "mm.bin"), dtype="float32", mode="w+", shape=(4,))


def _od_bad_attr():
    od = collections.OrderedDict(a=1)
    od.bad = Plain()
    return od


def _lazy_param():
    return torch.nn.LazyLinear(3).state_dict()["weight"]


# name -> (factory(tmp_dir), words the message must contain besides the path, path suffix below /z/bad)
REFUSED: dict[str, tuple[Callable[[str], Any], list[str], str]] = {
    "int_enum": (lambda d: Color.RED, ["Color"], ""),
    "enum": (lambda d: Mode.TRAIN, ["Mode"], ""),
    "flag": (lambda d: Flags.A, ["Flags"], ""),
    "namedtuple": (lambda d: Point(1, 2), ["Point"], ""),
    "typing_namedtuple": (lambda d: TypedPoint(1), ["TypedPoint"], ""),
    "dataclass": (lambda d: DC(torch.zeros(2)), ["DC"], ""),
    "frozen_dataclass": (lambda d: FrozenDC(), ["FrozenDC"], ""),
    "plain_object": (lambda d: Plain(), ["Plain"], ""),
    "object": (lambda d: object(), ["object"], ""),
    # a module or an optimizer object is a Stateful: saved as its state_dict() (tests/test_stateful.py)
    "bytesio": (lambda d: io.BytesIO(b"x"), ["BytesIO"], ""),
    "memoryview": (lambda d: memoryview(b"abc"), ["memoryview"], ""),
    "range": (lambda d: range(3), ["range"], ""),
    "slice": (lambda d: slice(1, 2), ["slice"], ""),
    "ellipsis": (lambda d: ..., ["ellipsis"], ""),
    "function": (lambda d: (lambda: 1), ["function"], ""),
    "type_object": (lambda d: int, ["type"], ""),
    "decimal": (lambda d: decimal.Decimal("1.5"), ["Decimal"], ""),
    "fraction": (lambda d: fractions.Fraction(1, 3), ["Fraction"], ""),
    "datetime": (lambda d: datetime.datetime(2024, 1, 1), ["datetime"], ""),
    "path": (lambda d: pathlib.Path("/tmp"), ["Path"], ""),
    "uuid": (lambda d: uuid.UUID(int=1), ["UUID"], ""),
    "str_subclass": (lambda d: MyStr("x"), ["MyStr"], ""),
    "int_subclass": (lambda d: MyInt(3), ["MyInt"], ""),
    "dict_subclass": (lambda d: MyDict(a=1), ["MyDict"], ""),
    "list_subclass": (lambda d: MyList([1]), ["MyList"], ""),
    "ordered_dict_subclass": (lambda d: MyOD(a=1), ["MyOD"], ""),
    "userdict": (lambda d: collections.UserDict(a=1), ["UserDict"], ""),
    "deque": (lambda d: collections.deque([1]), ["deque"], ""),
    "tensor_subclass": (lambda d: torch.zeros(2).as_subclass(MyTensor), ["MyTensor"], ""),
    "fake_tensor": (lambda d: _fake_tensor(), ["FakeTensor"], ""),
    "dtensor": (lambda d: _dtensor(), ["DTensor"], ""),
    "uninitialized_parameter": (lambda d: _lazy_param(), ["UninitializedParameter"], ""),
    "meta_tensor": (lambda d: torch.empty(3, device="meta"), ["meta"], ""),
    "quantized_tensor": (lambda d: torch.quantize_per_tensor(torch.rand(4), 0.1, 1, torch.quint8), ["quantized"], ""),
    "quantized_per_channel": (lambda d: torch.quantize_per_channel(torch.rand(3, 2), torch.rand(3), torch.zeros(
        3, dtype=torch.long), 0, torch.qint8), ["quantized"], ""),
    "nested_tensor": (lambda d: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]), ["nested"], ""),
    "sparse_coo": (lambda d: torch.eye(3).to_sparse(), ["sparse"], ""),
    "sparse_csr": (lambda d: torch.eye(3).to_sparse_csr(), ["sparse"], ""),
    "int4_tensor": (lambda d: torch.empty(2, dtype=torch.int4), ["int4", "no kernels", "view(torch.uint8)"], ""),
    "uint7_tensor": (lambda d: torch.empty(2, dtype=torch.uint7), ["uint7", "no kernels"], ""),
    "numpy_object_array": (lambda d: np.array([1, "a", None], dtype=object), ["object"], ""),
    "numpy_structured_array": (lambda d: np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]), ["dtype"], ""),
    "numpy_void_array": (lambda d: np.zeros(3, dtype="V4"), ["V4"], ""),
    "numpy_matrix": (lambda d: np.matrix([[1, 2]]), ["matrix"], ""),
    "numpy_memmap": (_memmap, ["memmap"], ""),
    "numpy_masked_array": (lambda d: np.ma.masked_array([1, 2], mask=[0, 1]), ["MaskedArray"], ""),
    "numpy_recarray": (lambda d: np.rec.array([(1, 2.0)], dtype=[("a", "<i4"), ("b", "<f8")]), ["recarray"], ""),
    "numpy_void_scalar": (lambda d: np.void(b"ab"), ["void"], ""),
    "numpy_structured_scalar": (lambda d: np.zeros(1, dtype=[("a", "<i4")])[0], ["void"], ""),
    "defaultdict_lambda": (lambda d: collections.defaultdict(lambda: 0), ["defaultdict", "lambda"], ""),
    "defaultdict_partial": (lambda d: collections.defaultdict(functools.partial(list)), ["defaultdict"], ""),
    "defaultdict_user_class": (lambda d: collections.defaultdict(Plain), ["defaultdict", "Plain"], ""),
    "huge_int": (lambda d: 2**13001, ["int"], ""),
    "cycle_list": (lambda d: _cycle_list(), ["cycle"], ""),
    "cycle_dict": (lambda d: _cycle_dict(), ["cycle"], "/inner/me"),
    "cycle_through_attrs": (lambda d: _cycle_attr(), ["cycle"], "/.self_ref"),
    "deep_101_lists": (lambda d: _deep(101, "list"), ["100"], "/0/0/0"),
    "deep_101_dicts": (lambda d: _deep(101, "dict"), ["100"], "/k/k/k"),
    "enum_dict_key": (lambda d: {Color.RED: 1}, ["Color"], "/<key>"),
    "object_dict_key": (lambda d: {Plain(): 1}, ["Plain"], "/<key>"),
    "str_subclass_key": (lambda d: {MyStr("k"): 1}, ["MyStr"], "/<key>"),
    "enum_in_set": (lambda d: {Mode.TRAIN}, ["Mode"], "/<item>"),
    "enum_in_tuple_key": (lambda d: {(1, Color.RED): 1}, ["Color"], "/<key>/1"),
    "bad_value_in_attrs": (lambda d: _od_bad_attr(), ["Plain"], "/.bad"),
}


def _files_under(root: str, sub: str) -> list[str]:
    top = os.path.join(root, sub)
    return sorted(os.path.relpath(os.path.join(d, f), top) for d, _, fs in os.walk(top) for f in fs)


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_before_anything_is_written(tmp_path, name):
    factory, words, suffix = REFUSED[name]
    bad = factory(str(tmp_path))
    root = str(tmp_path / "store")
    # a big tensor first, so that a save which starts writing before it has looked at everything would leave chunks
    state = {"big": torch.arange(20000, dtype=torch.float32), "z": {"bad": bad}}
    with Checkpointer(root, chunk_bytes=SMALL, threads=2) as ck:
        with pytest.raises(UnsupportedState) as err:
            ck.save(1, state)
        msg = str(err.value)
        path = "/z/bad" + suffix
        assert path in msg, f"message does not name {path!r}: {msg}"
        for w in words:
            assert w.lower() in msg.lower(), f"message does not name {w!r}: {msg}"
        assert ck.steps() == []
    assert _files_under(root, "chunks") == [] and _files_under(root, "manifests") == [], "something was written"
    assert _files_under(root, "fragments") == []


@pytest.mark.parametrize("name", ["int_enum", "meta_tensor", "numpy_object_array", "cycle_list"])
def test_refused_by_save_async_too(tmp_path, name):
    factory, words, _ = REFUSED[name]
    root = str(tmp_path / "store")
    with Checkpointer(root, chunk_bytes=SMALL, threads=2) as ck:
        ck.save(1, {"big": torch.arange(5000.0)})
        chunks = _files_under(root, "chunks")
        with pytest.raises(UnsupportedState) as err:
            ck.save_async(2, {"big": torch.arange(5000.0) + 1, "z": {"bad": factory(str(tmp_path))}}).result()
        assert "/z/bad" in str(err.value)
        ck.wait()
        assert ck.steps() == [1]
    assert _files_under(root, "chunks") == chunks, "a refused save_async wrote chunks"


def test_tensor_with_python_attributes_is_kept_or_refused(tmp_path):
    """DCP's stager keeps Python attributes set on tensors. ckptlib must keep them or refuse the
    tensor; dropping them silently would break 'same value or UnsupportedState'."""
    t = _with_attrs(torch.ones(2))
    with Checkpointer(str(tmp_path), threads=2) as ck:
        try:
            ck.save(1, {"t": t})
        except UnsupportedState as e:
            assert "/t" in str(e)
            return
        got = ck.restore()["t"]
    assert getattr(got, "a", None) == 42 and getattr(got, "b", None) == "x", \
        f"tensor attributes silently dropped: saved {vars(t)}, restored {vars(got)}"


def test_save_async_snapshot_is_taken_at_call(tmp_path):
    """Values mutated after save_async returns must not leak into the checkpoint (arrays, bytearrays
    and containers included)."""
    t = torch.arange(6000, dtype=torch.float32)
    a = np.arange(3000, dtype=np.int64)
    ba = bytearray(b"before")
    lst = [1, 2]
    d = {"k": "v"}
    state = {"t": t, "a": a, "ba": ba, "lst": lst, "d": d}
    expected = {"t": t.clone(), "a": a.copy(), "ba": bytearray(ba), "lst": list(lst), "d": dict(d)}
    with Checkpointer(str(tmp_path), chunk_bytes=SMALL, threads=2) as ck:
        fut = ck.save_async(1, state)
        t.add_(1)
        a += 1
        ba[:] = b"AFTER!"
        lst.append(3)
        d["k"] = "changed"
        fut.result()
    with Checkpointer(str(tmp_path), threads=2) as ck:
        assert_same_state(expected, ck.restore())


def test_digest_tells_types_apart(tmp_path):
    """Committing a step that exists with the same digest is a no-op success, so states that differ
    only in type must have different digests (else the second save silently keeps the first value)."""
    pairs = {
        "int_bool": ({"a": 1}, {"a": True}), "int_float": ({"a": 1}, {"a": 1.0}),
        "float_np": ({"a": 0.5}, {"a": np.float64(0.5)}), "np32_np64": ({"a": np.float32(0.5)}, {"a": np.float64(0.5)}),
        "list_tuple": ({"a": [1]}, {"a": (1,)}), "set_frozenset": ({"a": {1}}, {"a": frozenset({1})}),
        "dict_od": ({"a": {"k": 1}}, {"a": collections.OrderedDict(k=1)}),
        "dict_counter": ({"a": {"k": 1}}, {"a": collections.Counter(k=1)}),
        "key_int_str": ({0: 1}, {"0": 1}), "key_order": ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
        "zero_negzero": ({"a": 0.0}, {"a": -0.0}), "bytes_bytearray": ({"a": b"x"}, {"a": bytearray(b"x")}),
        "tensor_array": ({"a": torch.zeros(3)}, {"a": np.zeros(3, np.float32)}),
        "tensor_param": ({"a": torch.zeros(3)}, {"a": torch.nn.Parameter(torch.zeros(3))}),
        "requires_grad": ({"a": torch.zeros(3)}, {"a": torch.zeros(3, requires_grad=True)}),
        "strides": ({"a": torch.zeros(3, 2)}, {"a": torch.zeros(2, 3).t()}),
        "dtype_same_bytes": ({"a": torch.zeros(4, dtype=torch.int32)}, {"a": torch.zeros(4, dtype=torch.float32)}),
        "size_tuple": ({"a": torch.Size([2])}, {"a": (2,)}),
        "defaultdict_factory": ({"a": collections.defaultdict(list)}, {"a": collections.defaultdict(dict)}),
        "od_attrs": ({"a": collections.OrderedDict()}, {"a": _od_empty_with_metadata()}),
        "str_npstr": ({"a": "x"}, {"a": np.str_("x")}),
        "tied_untied": ((lambda t: {"a": t, "b": t})(torch.ones(2)), {"a": torch.ones(2), "b": torch.ones(2)}),
    }
    same = []
    for name, (a, b) in pairs.items():
        digests = []
        for i, st in enumerate((a, b)):
            with Checkpointer(str(tmp_path / f"{name}{i}"), threads=2) as ck:
                digests.append(ck.save(1, st).digest)
        if digests[0] == digests[1]:
            same.append(name)
    assert not same, f"states that differ only in type have the same digest: {same}"


HASHSEED_CHILD = """
import sys
from ckptlib import Checkpointer
state = {"s": {b"alpha", b"beta", b"gamma", b"delta"}, "f": frozenset({(b"x", 1), (b"y", 2)}), "w": [1.5]}
with Checkpointer(sys.argv[1], threads=2) as ck:
    print("DIGEST", ck.save(1, state).digest)
"""


def test_digest_does_not_depend_on_hash_seed(tmp_path):
    """Sets are stored "in a canonical order (digests do not depend on hashing)". A retried save of
    the same step from another process (another PYTHONHASHSEED) must find the same digest, not a
    CommitConflict."""
    digests = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed,
                   PYTHONPATH=os.pathsep.join([_repo_root(), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, "-c", HASHSEED_CHILD, str(tmp_path / "store")], capture_output=True,
                              text=True, timeout=120, env=env)
        assert proc.returncode == 0, f"saving step 1 again with PYTHONHASHSEED={seed} failed:\n{proc.stderr[-1500:]}"
        digests += [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("DIGEST")]
    assert len(set(digests)) == 1, digests


def _od_empty_with_metadata():
    od = collections.OrderedDict()
    od._metadata = {"": {"version": 1}}
    return od


def test_keep_base_follower_then_delta_save(tmp_path):
    """A follower restores with keep_base=True and saves the next step as deltas against what it
    restored: the result is still exact for every dtype (many_small, large_multichunk, fp8, strings)."""
    cases = exact_cases()
    for name in ("many_small", "large_multichunk", "tensor_float8_e5m2", "numpy_le_U3", "numpy_be_c16"):
        case, root = cases[name], str(tmp_path / name)
        with Checkpointer(root, chunk_bytes=SMALL, threads=2) as ck:
            ck.save(1, case.make(0))
        nxt = _mix(case.make(0), case.make(1))
        with Checkpointer(root, chunk_bytes=SMALL, threads=2) as ck:
            ck.restore(keep_base=True)
            ck.save(2, nxt)
        with Checkpointer(root, threads=2) as ck:
            assert_same_state(documented(nxt), ck.restore(2))
            assert ck.verify(2) == []


# --- restore(into=...) -------------------------------------------------------------------------

def _into_state(seed: int) -> dict:
    with _fork_rngs():
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                    torch.nn.Linear(4 * 4 * 4, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, 3, 6, 6)).sum().backward()
    opt.step()
    return {"model": model, "opt": opt, "state": {
        "model": model.state_dict(), "optimizer": opt.state_dict(), "step": 17,
        "np": np.arange(12, dtype=np.float32).reshape(3, 4) + seed, "buf": bytearray(b"seed%d" % seed)}}


def _ptrs(obj: Any) -> dict[str, int]:
    out = {}

    def walk(o, p):
        if isinstance(o, torch.Tensor):
            out[p] = o.data_ptr()
        elif isinstance(o, np.ndarray):
            out[p] = o.__array_interface__["data"][0]
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{p}/{k}")
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                walk(v, f"{p}/{i}")
    walk(obj, "")
    return out


def test_restore_into_fills_in_place(tmp_path):
    saved = _into_state(0)["state"]
    with Checkpointer(str(tmp_path), threads=2) as ck:
        ck.save(5, saved)
    expected = _into_state(0)["state"]
    fresh = _into_state(1)
    dest = {"model": fresh["model"].state_dict(), "optimizer": fresh["opt"].state_dict(), "step": 0,
            "np": np.zeros((3, 4), np.float32), "buf": bytearray(5)}
    before = _ptrs(dest)
    with Checkpointer(str(tmp_path), threads=2) as ck:
        got = ck.restore(into=dest)
    for k, t in dest["model"].items():
        assert got["model"][k] is t, f"/model/{k} is not the destination tensor"
    assert got["np"] is dest["np"] and got["buf"] is dest["buf"]
    assert {p: v for p, v in _ptrs(got).items() if p in before} == before, "data pointers changed"
    assert got["step"] == 17 and type(got["step"]) is int
    assert_same_state(expected, got)
    # the parameters of the fresh model now hold the saved values (state_dict tensors alias them)
    for (k, p), (_, q) in zip(fresh["model"].named_parameters(), _into_state(0)["model"].named_parameters()):
        assert torch.equal(p, q), k
    fresh["opt"].load_state_dict(got["optimizer"])


def test_restore_into_parameters_and_other_layouts(tmp_path):
    """Destinations as training code holds them: Parameters that require grad
    (state_dict(keep_vars=True)), a channels_last conv weight, a transposed view, a Fortran array."""
    torch.manual_seed(0)
    src = {"p": torch.nn.Parameter(torch.randn(4, 3, 3, 3)), "w": torch.randn(5, 7), "a": np.arange(20.0).reshape(4, 5),
           "q": torch.randn(6, 4).to(memory_format=torch.contiguous_format)}
    with Checkpointer(str(tmp_path), threads=2) as ck:
        ck.save(1, src)
    dest = {"p": torch.nn.Parameter(torch.zeros(4, 3, 3, 3).to(memory_format=torch.channels_last)),
            "w": torch.zeros(7, 5).t(), "a": np.asfortranarray(np.zeros((4, 5))),
            "q": torch.zeros(6, 4)}
    ptrs, strides = _ptrs(dest), {k: dest[k].stride() for k in ("p", "w", "q")}
    with Checkpointer(str(tmp_path), threads=2) as ck:
        got = ck.restore(into=dest)
    assert all(got[k] is dest[k] for k in dest)
    assert _ptrs(got) == ptrs and {k: got[k].stride() for k in strides} == strides
    assert type(got["p"]) is torch.nn.Parameter and got["p"].requires_grad
    for k in ("p", "w", "q"):
        assert torch.equal(got[k].detach(), src[k].detach()), k
    assert np.array_equal(got["a"], src["a"]) and got["a"].flags.f_contiguous


def _views_of(base: torch.Tensor) -> dict:
    return {"w": base, "rows": base[5:9], "flat": base.view(-1)[10:90], "ints": base.view(torch.int32)[2],
            "z": base.view(torch.complex64)[1:3].conj(), "tied": [base[1], base[1]]}


def test_restore_into_fills_destination_views_consistently(tmp_path):
    """A destination that shares memory as the saved state did gets every view filled, and keeps
    sharing it; a destination of separate tensors gets each its values; mismatched views are listed."""
    saved = _views_of(rand_tensor(torch.float32, (12, 10), 0))
    with Checkpointer(str(tmp_path), threads=2) as ck:
        ck.save(1, saved)
    dest = _views_of(torch.zeros(12, 10))
    with Checkpointer(str(tmp_path), threads=2) as ck:
        got = ck.restore(into=dest)
    assert got["w"] is dest["w"] and got["rows"] is dest["rows"] and got["z"] is dest["z"]
    assert got["tied"][0] is dest["tied"][0] and got["tied"][1] is dest["tied"][1]
    assert_same_state(saved, got)  # values, bits and the sharing itself
    separate = {k: [t.clone() for t in v] if isinstance(v, list) else v.clone() for k, v in _views_of(torch.zeros(12, 10)).items()}
    separate["z"] = separate["z"].resolve_conj().conj()
    with Checkpointer(str(tmp_path), threads=2) as ck:
        got = ck.restore(into=separate)
    for k in ("w", "rows", "flat", "ints", "z"):
        assert got[k] is separate[k] and not differences(saved[k].resolve_conj(), got[k].resolve_conj(),
                                                         exact_types=False), k
    assert not differences(saved["tied"][1], got["tied"][1], exact_types=False)
    with Checkpointer(str(tmp_path), threads=2) as ck:  # a partial restore of views reads their storage
        part = ck.restore(select=["rows", "z"])
    assert list(part) == ["rows", "z"] and part["z"].is_conj()
    assert part["rows"].untyped_storage().data_ptr() == part["z"].untyped_storage().data_ptr()
    assert_same_state({"rows": saved["rows"], "z": saved["z"]}, part)
    bad = _views_of(torch.zeros(12, 10))
    bad["rows"], bad["flat"] = torch.zeros(3, 10), np.zeros(80, np.float32)
    with Checkpointer(str(tmp_path), threads=2) as ck, pytest.raises(ValueError) as err:
        ck.restore(into=bad)
    assert "/rows: shape [3, 10] in the destination, [4, 10] saved" in str(err.value)
    assert "/flat: the checkpoint holds a torch tensor, the destination a ndarray" in str(err.value)
    assert not bad["w"].any(), "a refused restore wrote into the destination"


def test_storage_leaf_holds_only_the_bytes_its_views_span(tmp_path):
    """Two slices of a tensor that is not in the state: the storage saved is their span (from an
    aligned offset), not the whole storage (torch.save writes all of it)."""
    big = rand_tensor(torch.float64, (50, 40), 0)
    state = {"x": big[3:, 1:3], "y": big[3:, 2:5], "b": big.view(-1).view(torch.uint8)[3 * 320 + 9:3 * 320 + 20]}
    with Checkpointer(str(tmp_path), threads=2) as ck:
        ck.save(1, state)
        (storage,) = [leaf.spec for leaf in ck.fragment(1, "state").leaves if leaf.spec.kind == "storage"]
        got = ck.restore(1)
    start, end = 3 * 320 + 8, 49 * 320 + 5 * 8  # bytes: row 3 column 1 (aligned to 8), to row 49's column 5
    assert storage.dtype == "uint8" and storage.nbytes == end - start < big.numel() * 8
    assert got["x"].untyped_storage().nbytes() == end - start
    assert_same_state(state, got)


def test_restore_into_lists_every_mismatch_and_changes_nothing(tmp_path):
    saved = {"model": {"w": torch.ones(3, 4), "b": torch.ones(4), "h": torch.ones(2, dtype=torch.float64),
                       "i": torch.ones(2)},
             "np": np.ones(3, np.float32), "n": 1}
    with Checkpointer(str(tmp_path), threads=2) as ck:
        ck.save(1, saved)
    dest = {"model": {"w": torch.zeros(4, 3),                      # wrong shape
                      "b": torch.zeros(4, dtype=torch.float16),    # wrong dtype
                      "h": torch.zeros(2, dtype=torch.float64),    # fine: must stay untouched too
                      "i": np.zeros(2, np.float32),                # numpy where a tensor was saved
                      "extra": torch.zeros(2)},                    # not in the checkpoint
            "np": np.zeros(3, np.float64),                         # wrong numpy dtype
            "n": torch.zeros(1)}                                    # a tensor where an int was saved
    snapshot = {k: (v.clone() if isinstance(v, torch.Tensor) else v.copy()) for k, v in dest["model"].items()}
    with Checkpointer(str(tmp_path), threads=2) as ck:
        with pytest.raises(ValueError) as err:
            ck.restore(into=dest)
    msg = str(err.value)
    for path in ("/model/w", "/model/b", "/model/i", "/model/extra", "/np", "/n"):
        assert path in msg, f"{path} not listed in: {msg}"
    assert "/model/h" not in msg
    assert "[4, 3]" in msg or "(4, 3)" in msg, msg
    assert "float16" in msg, msg
    for k, v in snapshot.items():
        now = dest["model"][k]
        assert (torch.equal(now, v) if isinstance(v, torch.Tensor) else np.array_equal(now, v)), f"{k} changed"
    assert np.array_equal(dest["np"], np.zeros(3))


def test_restore_into_tied_destination_and_untied_destination(tmp_path):
    sd = _tied_lm(0)
    with Checkpointer(str(tmp_path), threads=2) as ck:
        ck.save(1, sd)
    untied = {"emb.weight": torch.zeros(11, 4), "head.weight": torch.zeros(11, 4)}
    with Checkpointer(str(tmp_path), threads=2) as ck:
        got = ck.restore(into=untied)
    assert got["emb.weight"] is untied["emb.weight"] and got["head.weight"] is untied["head.weight"]
    assert torch.equal(got["emb.weight"], sd["emb.weight"]) and torch.equal(got["head.weight"], sd["emb.weight"])
    tied_t = torch.zeros(11, 4)
    with Checkpointer(str(tmp_path), threads=2) as ck:
        got = ck.restore(into={"emb.weight": tied_t, "head.weight": tied_t})
    assert got["emb.weight"] is tied_t and got["head.weight"] is tied_t and torch.equal(tied_t, sd["emb.weight"])


def test_restore_into_top_level_state_dict(tmp_path):
    """ck.save(step, model.state_dict()) then ck.restore(into=other_model.state_dict())."""
    src, dst = _small_model(0), _small_model(1)
    with Checkpointer(str(tmp_path), threads=2) as ck:
        ck.save(1, src.state_dict())
    dest = dst.state_dict()
    with Checkpointer(str(tmp_path), threads=2) as ck:
        got = ck.restore(into=dest)
    assert all(got[k] is dest[k] for k in dest)
    assert_same_state(src.state_dict(), got)
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))


def test_refused_at_top_level(tmp_path):
    with Checkpointer(str(tmp_path), threads=2) as ck:
        with pytest.raises(UnsupportedState) as err:
            ck.save(1, Color.RED)
        assert "'/'" in str(err.value) and "Color" in str(err.value)
        assert ck.steps() == []


def test_restore_into_non_str_keys(tmp_path):
    """Arrays under int, float, None and tuple keys (valid state) are filled in place or at least
    restored; the destination's own arrays there are not reported as extra."""
    def state(v):
        return {"by_int": {0: torch.full((2,), v), 1: torch.full((3,), v)}, "by_tuple": {(0, "a"): torch.full((2,), v)},
                "by_none": {None: np.full(2, v)}, "by_float": {0.5: torch.full((1,), v)}}
    with Checkpointer(str(tmp_path), threads=2) as ck:
        ck.save(1, state(7.0))
    dest = state(0.0)
    with Checkpointer(str(tmp_path), threads=2) as ck:
        got = ck.restore(into=dest)
    assert_same_state(state(7.0), got)
    assert got["by_int"][0] is dest["by_int"][0] and got["by_none"][None] is dest["by_none"][None]


# --- select= -----------------------------------------------------------------------------------

def _select_state() -> dict:
    st = _trained_optimizer_state(torch.optim.Adam, 0, lr=1e-2)
    st["rng"] = _rng_states(0)
    st["x/y"] = 1
    return st


def test_select_top_level_key_and_paths(tmp_path):
    with Checkpointer(str(tmp_path), chunk_bytes=SMALL, threads=2) as ck:
        ck.save(1, _select_state())
    full = documented(_select_state())
    with Checkpointer(str(tmp_path), threads=2) as ck:
        assert_same_state({"model": full["model"]}, ck.restore(select=["model"]))
        assert_same_state({"model": full["model"], "epoch": 2}, ck.restore(select=["model", "epoch"]))
        assert_same_state({"optimizer": {"param_groups": full["optimizer"]["param_groups"]}},
                    ck.restore(select=["optimizer/param_groups"]))
        got = ck.restore(select=["model/0.weight", "rng/numpy_legacy"])
        assert list(got) == ["model", "rng"] and type(got["model"]) is collections.OrderedDict
        assert list(got["model"]) == ["0.weight"] and torch.equal(got["model"]["0.weight"], full["model"]["0.weight"])
        assert_same_state(full["rng"]["numpy_legacy"], got["rng"]["numpy_legacy"])
        with pytest.raises(KeyError) as err:
            ck.restore(select=["nope"])
        assert "nope" in str(err.value)


def test_select_int_keyed_optimizer_state(tmp_path):
    """The optimizer's state is keyed by int: '/'-paths should reach one parameter's moments."""
    with Checkpointer(str(tmp_path), threads=2) as ck:
        ck.save(1, _select_state())
        got = ck.restore(select=["optimizer/state/0"])
    full = documented(_select_state())
    assert_same_state({"optimizer": {"state": {0: full["optimizer"]["state"][0]}}}, got)


# --- export ------------------------------------------------------------------------------------

def _export_state() -> dict:
    st = _trained_optimizer_state(torch.optim.AdamW, 0, lr=1e-2)
    st.update({"np": np.arange(6, dtype=">f4").reshape(2, 3), "np_scalar": np.float32(0.5), "set": {1, 2},
               "defaultdict": collections.defaultdict(list, {"k": [1]}), "bytes": b"\x01\x02", "bf16": rand_tensor(torch.bfloat16, (4,), 0),
               "fp8": rand_tensor(torch.float8_e4m3fn, (4,), 0), "u16": rand_tensor(torch.uint16, (3,), 0),
               "size": torch.Size([2, 3]), "dtype": torch.float16, "device": torch.device("cpu"),
               "big_int": 2**100, "nan": float("nan"), "tuple": (1, "a"), "dt": np.arange(3).astype("<M8[s]"),
               "cplx": 1 + 2j, "none": None})
    return st


def test_export_pt_refuses_what_weights_only_would_change(tmp_path):
    """A .pt export is exact or refused: each value torch.load(weights_only=True) would give back
    as another type is named, with its path and type, unless convert=True."""
    cases = {"np": np.arange(3.0), "np_scalar": np.float32(0.5), "frozenset": frozenset({1}),
             "defaultdict": collections.defaultdict(list, {"k": [1]}), "np_key": {np.int64(3): 1},
             "np_in_set": {np.int8(1)}}
    with Checkpointer(str(tmp_path / "ck"), threads=2) as ck:
        for i, (name, value) in enumerate(cases.items()):
            ck.save(i, {"ok": torch.ones(1), "z": {name: value}})
            with pytest.raises(UnsupportedState) as err:
                ck.export(i, str(tmp_path / "x.pt"))
            assert f"/z/{name}" in str(err.value) and "--convert" in str(err.value), (name, str(err.value))
    assert sorted(os.listdir(tmp_path)) == ["ck"], "a refused export left a file"


def test_export_pt_loads_with_weights_only(tmp_path):
    st = _export_state()
    with Checkpointer(str(tmp_path / "ck"), threads=2) as ck:
        ck.save(3, st)
        with pytest.raises(UnsupportedState):
            ck.export(3, str(tmp_path / "x.pt"))
        done = ck.export(3, str(tmp_path / "x.pt"), convert=True)
    assert done.size == os.path.getsize(tmp_path / "x.pt")
    assert done.converted == ("/np: numpy.ndarray -> torch.Tensor", "/np_scalar: numpy.float32 -> float",
                              "/defaultdict: collections.defaultdict -> dict", "/dt: numpy.ndarray -> torch.Tensor",
                              "/dt: numpy.ndarray -> its int64 ticks (datetime64[s])")
    got = torch.load(tmp_path / "x.pt", weights_only=True)
    assert_same_state(st["model"], got["model"])  # OrderedDict with _metadata, exact tensors
    model = _small_model(9)
    model.load_state_dict(got["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(got["optimizer"])
    for k in ("bf16", "fp8", "u16"):
        assert got[k].dtype == st[k].dtype and torch.equal(got[k].view(torch.uint8), st[k].view(torch.uint8)), k
    assert torch.equal(got["np"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert got["np_scalar"] == 0.5 and got["defaultdict"] == {"k": [1]}
    # what weights_only keeps is kept as it is, not converted
    assert got["set"] == {1, 2} and got["bytes"] == b"\x01\x02" and type(got["bytes"]) is bytes
    assert got["big_int"] == 2**100 and got["size"] == torch.Size([2, 3]) and got["dtype"] is torch.float16
    unconverted = {k: v for k, v in st.items() if k not in ("np", "np_scalar", "defaultdict", "dt", "nan")}
    assert_same_state(unconverted, {k: got[k] for k in unconverted})


def test_export_pt_keeps_views_bits_and_new_dtypes(tmp_path):
    """torch.save holds storage sharing, conjugate/negative bits, tensor attributes, Counter, bytes
    and the float4/bits dtypes: an export of them is exact, with no conversion."""
    base = rand_tensor(torch.float32, (6, 4), 0)
    st = {"views": _views_of(rand_tensor(torch.float32, (12, 10), 1)), "neg": torch._neg_view(base),
          "tagged": _with_attrs(base[1:3]), "counter": collections.Counter(a=2), "raw": bytearray(b"ab"),
          "fp4": rand_tensor(torch.float4_e2m1fn_x2, (3,), 0), "bits16": rand_tensor(torch.bits16, (2,), 0),
          "p": torch.nn.Parameter(base)}
    with Checkpointer(str(tmp_path / "ck"), threads=2) as ck:
        ck.save(1, st)
        with pytest.raises(UnsupportedState) as err:  # torch.save saves a storage as one dtype
            ck.export(1, str(tmp_path / "x.pt"))
        assert "/views/ints" in str(err.value) and "torch.float32 tensor views" in str(err.value)
        done = ck.export(1, str(tmp_path / "x.pt"), convert=True)
        del st["views"]["ints"], st["views"]["z"]
        ck.save(2, st)
        exact = ck.export(2, str(tmp_path / "y.pt"))
    assert done.converted == ("/views/ints: torch.Tensor -> its own copy (it views memory that a torch.float32 "
                              "tensor views)", "/views/z: torch.Tensor -> its own copy (it views memory that a "
                              "torch.float32 tensor views)")
    got = torch.load(tmp_path / "x.pt", weights_only=True)
    assert got["views"]["ints"].untyped_storage().data_ptr() != got["views"]["w"].untyped_storage().data_ptr()
    assert got["views"]["z"].is_conj() and torch.equal(got["views"]["ints"], st["views"]["w"].view(torch.int32)[2])
    assert exact.converted == ()
    assert_same_state(documented(st), torch.load(tmp_path / "y.pt", weights_only=True))


def test_export_safetensors(tmp_path):
    from safetensors import safe_open

    st = _export_state()
    with Checkpointer(str(tmp_path / "ck"), threads=2) as ck:
        ck.save(3, st)
        with pytest.raises(UnsupportedState) as err:
            ck.export(None, str(tmp_path / "x.safetensors"))
        assert "/optimizer/param_groups" in str(err.value) and "tuple" not in str(err.value)
        done = ck.export(None, str(tmp_path / "x.safetensors"), convert=True)
    assert "/optimizer/param_groups: list -> its nearest JSON in the metadata" in done.converted
    assert "/set: set -> its nearest JSON in the metadata" in done.converted and "/epoch" not in str(done.converted)
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        names = set(f.keys())
        meta = f.metadata()
        assert {"model.0.weight", "optimizer.state.0.exp_avg", "bf16", "np"} <= names
        assert torch.equal(f.get_tensor("model.0.weight"), st["model"]["0.weight"])
        assert torch.equal(f.get_tensor("optimizer.state.0.exp_avg"), st["optimizer"]["state"][0]["exp_avg"])
    assert json.loads(meta["epoch"]) == 2 and "__ckpt__" in meta


def test_export_safetensors_writes_views_as_copies_and_resolves_bits(tmp_path):
    """safetensors holds no storage sharing and no lazy bits: each view is written as its own
    values (conjugates resolved), and what the installed safetensors stores is probed, not assumed."""
    from safetensors.torch import load_file

    from ckptlib.export import safetensors_keeps

    st = _views_of(rand_tensor(torch.float32, (12, 10), 1))
    st["neg"] = torch._neg_view(torch.arange(3.0))
    with Checkpointer(str(tmp_path / "ck"), threads=2) as ck:
        ck.save(1, st)
        assert ck.export(1, str(tmp_path / "x.safetensors")).converted == ()
    got = load_file(str(tmp_path / "x.safetensors"))
    for name in ("w", "rows", "flat", "ints", "z", "tied.0", "tied.1", "neg"):
        want = st
        for part in name.split("."):
            want = want[int(part)] if isinstance(want, list) else want[part]
        assert not differences(want.resolve_conj().resolve_neg(), got[name], exact_types=False), name
    assert safetensors_keeps(torch.complex64) and not safetensors_keeps(torch.bits16)  # safetensors 0.8


def test_export_safetensors_non_str_keys(tmp_path):
    """Non-tensor values go to safetensors' JSON metadata; a dict keyed by tuples (valid state) must be
    written somehow or refused with UnsupportedState, not fail with json's TypeError."""
    with Checkpointer(str(tmp_path / "ck"), threads=2) as ck:
        ck.save(1, {"w": torch.ones(2), "meta": {(1, 2): "pair", frozenset({3}): "set"}})
        try:
            ck.export(1, str(tmp_path / "x.safetensors"))
        except UnsupportedState as e:
            assert "/meta" in str(e)
            return
    from safetensors import safe_open

    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert "meta" in f.metadata()


def test_export_safetensors_tied_weights(tmp_path):
    """A tied LM (embedding == head) is the common case; the export must work or refuse clearly."""
    with Checkpointer(str(tmp_path / "ck"), threads=2) as ck:
        ck.save(1, _tied_lm(0))
        try:
            ck.export(1, str(tmp_path / "tied.safetensors"))
        except UnsupportedState:
            return
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "tied.safetensors"))
    assert torch.equal(got["emb.weight"], got["head.weight"])


@pytest.mark.parametrize("suffix,value,words", [
    (".safetensors", {"z": torch.zeros(2, dtype=torch.complex128)}, ["/z", "complex128", "safetensors 0."]),
    (".safetensors", {"z": rand_tensor(torch.bits8, (2,), 0)}, ["/z", "bits8"]),
    (".pt", {"z": np.zeros(2, dtype=np.longdouble)}, ["/z", "float128"]),
    (".safetensors", {"z": np.zeros(2, dtype=np.longdouble)}, ["/z", "float128"]),
    (".pt", {"z": np.longdouble(1.5)}, ["/z"]),
    (".pt", {"z": np.array(["ab"])}, ["/z"]),
])
def test_export_refusals(tmp_path, suffix, value, words):
    with Checkpointer(str(tmp_path / "ck"), threads=2) as ck:
        ck.save(1, value)
        out = tmp_path / f"out{suffix}"
        with pytest.raises(UnsupportedState) as err:
            ck.export(1, str(out))
    for w in words:
        assert w in str(err.value), str(err.value)
    assert os.listdir(tmp_path) == ["ck"], "export left a file behind"


def test_export_existing_file_needs_force(tmp_path):
    out = tmp_path / "x.pt"
    out.write_bytes(b"keep me")
    with Checkpointer(str(tmp_path / "ck"), threads=2) as ck:
        ck.save(1, {"w": torch.ones(2)})
        with pytest.raises(FileExistsError) as err:
            ck.export(1, str(out))
        assert "force" in str(err.value)
        assert out.read_bytes() == b"keep me"
        with pytest.raises(ValueError):
            ck.export(1, str(tmp_path / "x.bin"))
        ck.export(1, str(out), force=True)
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.ones(2))


# --- the README's dtype table ------------------------------------------------------------------

def _readme_dtype_table() -> dict[str, str]:
    """{dtype name: "kept" | "refused"} from the README's torch dtype table."""
    with open(os.path.join(_repo_root(), "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("**torch dtypes.**"):]
    section = section[:section.index("\n\n", section.index("| torch dtype |"))]
    table: dict[str, str] = {}
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        names, verdict = row.strip("|").split("|")[:2]
        for name in names.replace("`", " ").split():
            assert name not in table, f"{name} is in the README's dtype table twice"
            table[name] = verdict.strip().split()[0].rstrip(":,")
    return table


def test_readme_dtype_table_names_every_dtype_of_this_torch():
    """Every torch.dtype of the installed torch is in the README's table, as kept or refused, and
    the table says what ckptlib does: a torch with a new dtype fails here until the table (and
    ckptlib's dtype tables) say what happens to it."""
    from ckptlib.types import TORCH_DTYPES as STORED

    every = {str(v).removeprefix("torch.") for v in vars(torch).values() if isinstance(v, torch.dtype)}
    table = _readme_dtype_table()
    assert set(table) == every, f"not in the README: {sorted(every - set(table))}; not torch's: {sorted(set(table) - every)}"
    assert {n for n, v in table.items() if v == "kept"} == set(STORED)
    assert {n for n, v in table.items() if v == "refused"} == set(REFUSED_TORCH_DTYPES)
    assert {_name(d) for d in TORCH_DTYPES} == set(STORED), "every stored dtype has its round-trip case"


@pytest.mark.parametrize("name", sorted(REFUSED_TORCH_DTYPES))
def test_every_refused_dtype_is_refused_with_its_reason(tmp_path, name):
    dtype = getattr(torch, name)
    t = torch.quantize_per_tensor(torch.rand(2), 0.1, 0, dtype) if name in ("qint8", "qint32", "quint8") else \
        torch.empty(2, dtype=dtype)
    with Checkpointer(str(tmp_path), threads=2) as ck:
        with pytest.raises(UnsupportedState) as err:
            ck.save(1, {"t": t})
        ck.save(2, {"dtype": dtype})  # the dtype itself is a name: stored
        assert ck.restore(2)["dtype"] is dtype
    assert "/t" in str(err.value) and (REFUSED_TORCH_DTYPES[name] in str(err.value) or "quantized" in str(err.value))
