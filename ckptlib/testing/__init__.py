"""Helpers for testing code built on ckptlib: a fault-injecting store wrapper."""

from ckptlib.testing.faulty import Call, FaultyStore, InjectedFault, SimulatedCrash

__all__ = ["Call", "FaultyStore", "InjectedFault", "SimulatedCrash"]
