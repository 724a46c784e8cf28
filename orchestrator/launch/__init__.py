"""Launchers: how a stage's ranks get started. Peers behind one interface (`Launcher`).

A launcher carries a StageRequest to its ranks and reports how the launch ended; it never knows
what the stage does.
"""
from __future__ import annotations

import sys

from orchestrator.errors import ConfigError, OrchestratorError
from orchestrator.launch.base import Launcher, LaunchResult
from orchestrator.store.ledger import ACTIVE


def make_launcher(cfg, name: str | None = None) -> Launcher:
    """The launcher that `launcher=<name>` selects (or the one named)."""
    name = name or cfg.launcher.name
    if name == "local":
        from orchestrator.launch.local import LocalLauncher

        return LocalLauncher(cfg)
    if name == "slurm":
        from orchestrator.launch.slurm import SlurmLauncher

        return SlurmLauncher(cfg)
    raise ConfigError(f"launcher={name!r}; allowed: local, slurm")


def refresh_ledger(ledger, cfg) -> None:
    """Re-attach to every launch the ledger still calls pending or running (any process may
    ask: `stage=status`), through the launcher that made it, and record how each ended.

    One that cannot be refreshed (no Slurm here, a read-only profiles folder) keeps its
    recorded state, with a note on stderr: reading the ledger must not fail for it.
    """
    for key, entry in ledger.entries().items():
        if entry.state in ACTIVE and entry.launcher:
            try:
                make_launcher(cfg, entry.launcher).refresh(ledger, key, entry)
            except (OrchestratorError, OSError) as e:
                print(f"note: {key} is shown as recorded ({entry.state}), not refreshed: {e}",
                      file=sys.stderr)


__all__ = ["Launcher", "LaunchResult", "make_launcher", "refresh_ledger"]
