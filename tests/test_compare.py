"""ckptlib.testing.compare: the one state comparer finds each kind of difference, in both strictnesses,
and says where; the lenient one accepts what only the containers' and tensors' classes change."""

from __future__ import annotations

import collections
import subprocess
import sys

import numpy as np
import pytest
import torch

from ckptlib.testing.compare import assert_same_state, differences, first_difference, storage_pattern, tie_pattern


def _od_with_metadata(version: int) -> collections.OrderedDict:
    od = collections.OrderedDict(w=torch.zeros(2))
    od._metadata = {"": {"version": version}}  # type: ignore[attr-defined]
    return od


def _tensor_with_attribute(value: int) -> torch.Tensor:
    t = torch.zeros(2)
    t.tag = value  # type: ignore[attr-defined]
    return t


# (expected, actual, what the difference names): differences in both strictnesses
BOTH = {
    "bool is not int": (1, True, "type int expected, got bool"),
    "int is not float": (1, 1.0, "type int expected, got float"),
    "list is not tuple": ([1], (1,), "type list expected, got tuple"),
    "set is not frozenset": ({1}, frozenset({1}), "type set expected, got frozenset"),
    "numpy scalar is not float": (np.float64(1), 1.0, "type numpy.float64 expected, got float"),
    "np.str_ is not str": (np.str_("a"), "a", "type numpy.str_ expected, got str"),
    "-0.0": (0.0, -0.0, "float 0.0 (0000000000000000) expected, got -0.0 (8000000000000000)"),
    "NaN payload": (float("nan"), -float("nan"), "float nan"),
    "complex bits": (complex(0.0, 1.0), complex(-0.0, 1.0), "complex"),
    "numpy scalar bits": (np.float32(0.0), np.float32(-0.0), "numpy scalar"),
    "value": ({"a": "x"}, {"a": "y"}, "/a: 'x' expected, got 'y'"),
    "length": ([1, 2], [1], "length 2 expected, got 1"),
    "set items": ({1, 2}, {1, 3}, "/<item 1>: 2 expected, got 3"),
    "missing key": ({"a": 1, "b": 2}, {"a": 1}, "'b'"),
    "tensor dtype": (torch.zeros(2), torch.zeros(2, dtype=torch.float64), "dtype torch.float32 expected, got torch.float64"),
    "tensor shape": (torch.zeros(2, 3), torch.zeros(3, 2), "shape (2, 3) expected, got (3, 2)"),
    "tensor -0.0": (torch.tensor([0.0]), torch.tensor([-0.0]), "tensor bytes differ"),
    "tensor NaN payload": (torch.tensor([float("nan")]), torch.tensor([-float("nan")]), "tensor bytes differ"),
    "bf16 bytes": (torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16) * 2, "tensor bytes differ"),
    "array dtype byte order": (np.array([1], ">i4"), np.array([1], "<i4"), "dtype >i4 expected, got <i4"),
    "array shape": (np.zeros((2, 2)), np.zeros(4), "shape (2, 2) expected, got (4,)"),
    "array bytes": (np.zeros(3), np.ones(3), "array bytes differ"),
    "torch.Size": (torch.Size([2]), torch.Size([3]), "torch.Size([2]) expected, got torch.Size([3])"),
    "torch.dtype": (torch.float32, torch.float16, "torch.float32 expected, got torch.float16"),
    "nested path": ({"opt": {"state": [{"m": torch.zeros(2)}]}}, {"opt": {"state": [{"m": torch.ones(2)}]}},
                    "/opt/state/0/m: tensor bytes differ"),
}

# differences only with exact_types=True (what ckptlib keeps, a loader into existing tensors need not)
EXACT_ONLY = {
    "OrderedDict is not dict": (collections.OrderedDict(a=1), {"a": 1}, "type collections.OrderedDict expected, got dict"),
    "key order": ({"a": 1, "b": 2}, {"b": 2, "a": 1}, "/<key 0>: 'a' expected, got 'b'"),
    "defaultdict factory": (collections.defaultdict(list), collections.defaultdict(int), "default_factory"),
    "dict attributes": (_od_with_metadata(1), _od_with_metadata(2), "/._metadata//version: 1 expected, got 2"),
    "Parameter is not Tensor": (torch.nn.Parameter(torch.zeros(1)), torch.zeros(1),
                                "type torch.nn.parameter.Parameter expected, got torch.Tensor"),
    "requires_grad": (torch.zeros(1, requires_grad=True), torch.zeros(1), "requires_grad True expected, got False"),
    "tensor strides": (torch.zeros(2, 3), torch.zeros(3, 2).t(), "strides (3, 1) expected, got (1, 2)"),
    "tensor attributes": (_tensor_with_attribute(1), _tensor_with_attribute(2), "/.tag: 1 expected, got 2"),
    "array strides": (np.zeros((2, 2)), np.asfortranarray(np.zeros((2, 2))), "strides"),
}


@pytest.mark.parametrize("name", sorted(BOTH))
@pytest.mark.parametrize("exact_types", [True, False])
def test_each_kind_of_difference_is_found_and_located(name, exact_types):
    expected, actual, fragment = BOTH[name]
    found = differences(expected, actual, exact_types=exact_types)
    assert found and fragment in found[0], found
    assert not differences(expected, expected, exact_types=exact_types)


@pytest.mark.parametrize("name", sorted(EXACT_ONLY))
def test_exact_types_finds_what_lenient_accepts(name):
    expected, actual, fragment = EXACT_ONLY[name]
    found = differences(expected, actual)
    assert found and fragment in found[0], found
    assert differences(expected, actual, exact_types=False) == []


def test_lenient_mode_accepts_dict_for_ordered_dict_but_still_compares_the_values():
    sd = collections.OrderedDict(w=torch.arange(3.0), b=torch.zeros(1))
    assert first_difference(sd, {"b": torch.zeros(1), "w": torch.arange(3.0)}, exact_types=False) is None
    assert "/w: tensor bytes differ" in first_difference(sd, {"b": torch.zeros(1), "w": torch.ones(3)},
                                                         exact_types=False)
    keys = first_difference({0: 1, 1: 2}, {"0": 1, "1": 2}, exact_types=False)  # DCP gives optimizer keys back as str
    assert keys == "/: keys differ: only in expected 0, 1; only in actual '0', '1'"
    assert first_difference({0: 1}, {"0": 1}) == "/<key 0>: type int expected, got str"


def test_ties_must_match_in_exact_mode_only():
    t = torch.zeros(2)
    assert "tied tensors [['/a', '/b']] expected, got []" in differences({"a": t, "b": t},
                                                                        {"a": torch.zeros(2), "b": torch.zeros(2)})[0]
    u = torch.zeros(2)
    assert differences({"a": torch.zeros(2), "b": torch.zeros(2)}, {"a": u, "b": u})
    assert differences({"a": t, "b": t}, {"a": torch.zeros(2), "b": torch.zeros(2)}, exact_types=False) == []
    assert tie_pattern({"a": t, "b": [t]}) == [("/a", "/a"), ("/b/0", "/a")]


def test_limit_path_and_assert():
    a, b = {f"k{i}": i for i in range(50)}, {f"k{i}": -i for i in range(50)}
    assert len(differences(a, b)) == 20 and len(differences(a, b, limit=3)) == 3
    assert first_difference(a, b, path="step 3") == "step 3/k1: 1 expected, got -1"
    with pytest.raises(AssertionError, match="step 3/k1: 1 expected, got -1"):
        assert_same_state(a, b, "step 3")
    assert_same_state(a, dict(a))


def test_loose_allows_a_type_difference_but_compares_the_values():
    def loose(expected, actual):
        return isinstance(expected, tuple) and isinstance(actual, list)

    assert_same_state({"x": (1, 2)}, {"x": [1, 2]}, loose=loose)
    with pytest.raises(AssertionError, match="/x/1: 2 expected, got 3"):
        assert_same_state({"x": (1, 2)}, {"x": [1, 3]}, loose=loose)
    with pytest.raises(AssertionError, match="type list expected, got tuple"):
        assert_same_state({"x": [1, 2]}, {"x": (1, 2)}, loose=loose)


def test_views_and_conjugates_compare_by_their_values():
    base = torch.arange(12.0).reshape(3, 4)
    assert differences(base[:, 1], base[:, 1].clone(), exact_types=False) == []  # the same values
    assert "strides (4,) expected, got (1,)" in differences(base[:, 1], base[:, 1].clone())[0]
    z = torch.tensor([1 + 2j])
    # the same values; the lazy bits are kept by ckptlib (exact), not by every system (data only)
    assert differences(z.conj(), z.conj().resolve_conj(), exact_types=False) == []
    assert "conj bit True expected, got False" in differences(z.conj(), z.conj().resolve_conj())[0]
    x = torch.arange(3.0)
    assert "neg bit True expected, got False" in differences(torch._neg_view(x), torch._neg_view(x).resolve_neg())[0]


def test_storage_sharing_is_part_of_an_exact_state():
    base = torch.arange(12.0)
    shared = {"a": base, "b": base[4:]}
    copies = {"a": base.clone(), "b": base[4:].clone()}
    assert differences(shared, copies, exact_types=False) == []
    assert "sharing a storage [['/a@0', '/b@16']] expected, got []" in differences(shared, copies)[0]
    other = base.clone()
    assert differences(shared, {"a": other, "b": other[4:]}) == []
    zeros, zeros2 = torch.zeros(12), torch.zeros(12)
    assert "sharing a storage" in differences({"a": zeros, "b": zeros[4:]}, {"a": zeros2, "b": zeros2[2:10]})[0]
    assert storage_pattern(shared) == [("/a", "/a", 0), ("/b", "/a", 16)]


def test_importing_and_comparing_plain_states_loads_no_torch():
    code = ("import sys; from ckptlib.testing.compare import differences; "
            "assert differences({'a': [1, 2.0]}, {'a': [1, -2.0]}); assert not differences({'a': 1}, {'a': 1}); "
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_deep_copy_is_the_same_state_in_both_strictnesses():
    import copy

    w = torch.nn.Parameter(torch.randn(3, 4))
    state = {"model": _od_with_metadata(1), "tied": [w, w], "cl": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
             "grad": torch.zeros(2, requires_grad=True), "counts": collections.Counter(a=2),
             "groups": collections.defaultdict(list, {"x": [1]}), "nan": float("nan"), "neg": -0.0, "z": 1 - 2j,
             "np": {"f": np.asfortranarray(np.arange(6.0).reshape(2, 3)), "be": np.array([1, 2], ">i8"),
                    "s": np.float16(0.5), "ld": np.longdouble(1) / 3},
             "meta": (torch.Size([2, 3]), torch.bfloat16, torch.device("cpu")), "set": frozenset({1, "a"}),
             "none": None, "bytes": b"\x00", "flags": [True, 1, 1.5]}
    twin = copy.deepcopy(state)
    assert differences(state, twin) == [] and differences(state, twin, exact_types=False) == []
