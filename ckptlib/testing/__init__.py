"""Helpers for testing code built on ckptlib: a fault-injecting store wrapper, the state comparer,
and the JSON of a stored document (a manifest or a fragment, stored zstd-compressed)."""

import json
from typing import Any

from ckptlib.testing.compare import assert_same_state, differences, first_difference
from ckptlib.testing.faulty import Call, FaultyStore, InjectedFault, SimulatedCrash

__all__ = ["Call", "document_json", "FaultyStore", "InjectedFault", "SimulatedCrash", "assert_same_state", "differences",
           "first_difference"]


def document_json(data: bytes) -> Any:
    """The parsed JSON of a stored manifest or fragment (a reader takes it back written as plain JSON)."""
    from ckptlib.docfields import unpack  # (importing the comparer alone loads no numpy)

    return json.loads(unpack(data, "a stored document", 1 << 30))
