"""Launchers: how a stage's ranks get started. Peers behind one interface (`Launcher`).

A launcher carries a StageRequest to its ranks and reports how the launch ended; it never knows
what the stage does.
"""
from __future__ import annotations

from orchestrator.errors import ConfigError
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
    ask: `stage=status`), through the launcher that made it, and record how each ended."""
    for key, entry in ledger.entries().items():
        if entry.state in ACTIVE and entry.launcher:
            make_launcher(cfg, entry.launcher).refresh(ledger, key, entry)


__all__ = ["Launcher", "LaunchResult", "make_launcher", "refresh_ledger"]
