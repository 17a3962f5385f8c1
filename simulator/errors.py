"""Errors the simulator raises on bad input or a run that cannot finish."""

from __future__ import annotations


class SimulatorInputError(ValueError):
    """Bad user input (workload, cluster spec, options): the message names the file, row and field."""


class SimulationStuck(RuntimeError):
    """Active jobs made no progress for too long in simulated time; the message lists them."""
