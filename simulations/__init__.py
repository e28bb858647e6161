"""Rebalancing simulations on a virtual clock, driving the real ring and engine.

``simulate(load_scenario(path))`` runs every mode on the same arrivals and
returns a :class:`SimulationResult` whose ``report`` is the JSON document
described in ``docs/simulations.md``. The CLI lives in :mod:`simulations.cli`.

numpy is imported on first use of ``simulate`` (not by ``import
simulations.cli``), so mounting the subcommand costs the ``ringlimit`` script
nothing at start-up.
"""

from __future__ import annotations

from typing import Any

from .scenario import MODES, Scenario, ScenarioError, load_scenario, parse_scenario

__all__ = [
    "MODES",
    "SCHEMA_VERSION",
    "Scenario",
    "ScenarioError",
    "SimulationResult",
    "load_scenario",
    "parse_scenario",
    "simulate",
]


def __getattr__(name: str) -> Any:
    if name == "SCHEMA_VERSION":
        from .metrics import SCHEMA_VERSION

        return SCHEMA_VERSION
    if name in ("simulate", "SimulationResult"):
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'simulations' has no attribute {name!r}")
