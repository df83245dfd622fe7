"""A writer plans a state's layout once and plans again whenever the layout changes (save.Layout).

Each chain of a writer remembers its last save's tensor specs by path (``tree.SpecMemo``) and the
units planned from them; a save of a state laid out the same way reuses both. These tests change
one tensor's metadata at one path between two saves of one writer, every way a training loop can
(dtype, shape, strides, gradient flags, type, device, Python attributes, a tensor added), and
check that the second save is read back exactly as it was given, or refused as a fresh writer
refuses it.
"""

from __future__ import annotations

import pytest
import torch

from ckptlib import Checkpointer, UnsupportedState
from ckptlib.save import Layout
from ckptlib.testing.compare import assert_same_state
from ckptlib.tree import SpecMemo, flatten


def _fresh(shape=(4, 8), dtype=torch.float32) -> torch.Tensor:
    return torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float64).reshape(shape).to(dtype)


def _param(t: torch.Tensor, requires_grad: bool = True) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=requires_grad)


def _with_attribute(t: torch.Tensor) -> torch.Tensor:
    t.note = "kept"  # type: ignore[attr-defined]
    return t


# What the tensor at path "w" becomes at the second save; every one keeps the path.
CHANGES = {
    "dtype": lambda: _fresh(dtype=torch.float64),
    "same bytes, other dtype": lambda: _fresh(shape=(4, 4), dtype=torch.float64).view(torch.float32),
    "shape, same numel": lambda: _fresh(shape=(8, 4)),
    "rank": lambda: _fresh(shape=(32,)),
    "strides (a transposed view)": lambda: _fresh(shape=(8, 4)).t(),
    "a non-dense view": lambda: _fresh(shape=(4, 16))[:, ::2],
    "a parameter": lambda: _param(_fresh()),
    "a frozen parameter": lambda: _param(_fresh(), requires_grad=False),
    "a leaf that requires grad": lambda: _fresh().requires_grad_(True),
    "a non-leaf that requires grad": lambda: _fresh().requires_grad_(True) * 1,
    "Python attributes": lambda: _with_attribute(_fresh()),
    "empty": lambda: _fresh(shape=(0, 8)),
    "a conjugate view": lambda: torch.complex(_fresh(), _fresh()).conj(),
}


def _restored_like(got: torch.Tensor, want: torch.Tensor) -> None:
    assert type(got) is type(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.requires_grad == (want.requires_grad and want.is_leaf)
    if want.dim() == 2 and not want.is_contiguous() and want.t().is_contiguous():
        assert got.stride() == want.stride()  # a transposed view keeps its layout
    else:
        assert got.is_contiguous()  # a contiguous tensor, or a non-dense view stored compact
    assert torch.equal(got.detach().resolve_conj(), want.detach().resolve_conj())
    assert getattr(got, "__dict__", {}) == getattr(want, "__dict__", {})


@pytest.mark.parametrize("background", [False, True], ids=["save", "save_async"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_tensor_whose_metadata_change_between_saves_is_planned_anew(tmp_path, change, background):
    """The first save plans w as a (4, 8) float32 tensor; the second gives another tensor at the
    same path: it comes back as given (a spec remembered from the first save would store the new
    bytes under the old dtype, shape or strides), and so do three saves after it."""
    with Checkpointer(str(tmp_path), chunk_bytes=1 << 12) as ck:
        states = [{"w": _fresh(), "b": torch.ones(3)}, {"w": CHANGES[change](), "b": torch.ones(3)}]
        states += [{"w": states[1]["w"], "b": torch.full((3,), float(k))} for k in range(3)]
        for step, state in enumerate(states):
            (ck.save_async(step, state).result() if background else ck.save(step, state))
            got = Checkpointer(str(tmp_path)).restore(step)
            _restored_like(got["w"], state["w"])
            assert torch.equal(got["b"], state["b"])


def test_a_meta_tensor_after_a_cpu_one_is_refused_as_a_fresh_writer_refuses_it(tmp_path):
    """The memo never lets a tensor skip the checks: a meta tensor with the last save's dtype,
    shape and strides is refused, and the writer saves the next state as before."""
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(0, {"w": _fresh()})
        with pytest.raises(UnsupportedState, match="meta device"):
            ck.save(1, {"w": _fresh().to("meta")})
        ck.save(2, {"w": _fresh() + 1})
        assert torch.equal(Checkpointer(str(tmp_path)).restore()["w"], _fresh() + 1)


def test_the_plan_is_reused_while_the_layout_holds_and_made_again_when_a_tensor_is_added():
    """Same layout: the same spec objects and the units planned once (``Layout.units`` returns the
    last plan); a tensor added, or the chunk size changed: planned again, and the units are those
    a writer without a memo plans."""
    layout = Layout()
    state = {"a": torch.zeros(1000), "b": torch.zeros(10, 10)}
    first = [spec for spec, _ in flatten(state, memo=layout.specs)[1]]
    units = layout.units(first, 1 << 12)
    again = [spec for spec, _ in flatten({"a": torch.ones(1000), "b": torch.ones(10, 10)}, memo=layout.specs)[1]]
    assert all(x is y for x, y in zip(first, again))
    assert layout.units(again, 1 << 12) == units
    assert layout._plan is not None and layout._plan[2] == units
    state["c"] = torch.zeros(5)
    grown = [spec for spec, _ in flatten(state, memo=layout.specs)[1]]
    from ckptlib.chunking import plan_units

    assert layout.units(grown, 1 << 12) == plan_units(grown, 1 << 12) != units
    assert layout.units(grown, 1 << 10) == plan_units(grown, 1 << 10)


def test_a_refused_state_leaves_the_memo_as_the_last_good_flatten_left_it():
    memo = SpecMemo()
    flatten({"a": torch.zeros(4)}, memo=memo)
    last = dict(memo.last)
    with pytest.raises(UnsupportedState):
        flatten({"a": torch.zeros(4), "z": object()}, memo=memo)
    assert memo.last == last


def test_every_spec_the_memo_gives_is_the_one_a_fresh_flatten_makes():
    """Over a real model's and optimizer's state, saved twice: the memoised specs equal the specs
    of a flatten without a memo, leaf for leaf."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters())
    memo = SpecMemo()
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "params": list(model.parameters())}
        with_memo = [spec for spec, _ in flatten(state, memo=memo)[1]]
        without = [spec for spec, _ in flatten(state)[1]]
        assert with_memo == without
    assert_same_state(state, state)


def test_a_tensor_with_python_attributes_is_never_given_a_remembered_spec():
    """``isinstance(t, Parameter)`` is true of a plain tensor that carries ``_is_param`` (torch's
    own marker): a spec remembered from a plain tensor at the same path would say otherwise."""
    memo = SpecMemo()
    flatten({"w": _fresh()}, memo=memo)
    marked = _fresh()
    marked._is_param = True  # type: ignore[attr-defined]
    assert isinstance(marked, torch.nn.Parameter)
    assert [s for s, _ in flatten({"w": marked}, memo=memo)[1]] == [s for s, _ in flatten({"w": marked})[1]]
