"""Helpers for testing code built on ckptlib: a fault-injecting store wrapper and the state comparer."""

from ckptlib.testing.compare import assert_same_state, differences, first_difference
from ckptlib.testing.faulty import Call, FaultyStore, InjectedFault, SimulatedCrash

__all__ = ["Call", "FaultyStore", "InjectedFault", "SimulatedCrash", "assert_same_state", "differences",
           "first_difference"]
