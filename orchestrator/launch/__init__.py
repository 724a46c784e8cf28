"""Launchers: how a stage's ranks get started. Peers behind one interface (`Launcher`).

A launcher carries a StageRequest to its ranks and reports how the launch ended; it never knows
what the stage does.
"""
from __future__ import annotations

from orchestrator.errors import ConfigError
from orchestrator.launch.base import Launcher, LaunchResult


def make_launcher(cfg) -> Launcher:
    """The launcher that `launcher=<name>` selects."""
    name = cfg.launcher.name
    if name == "local":
        from orchestrator.launch.local import LocalLauncher

        return LocalLauncher(cfg)
    if name == "slurm":
        from orchestrator.launch.slurm import SlurmLauncher

        return SlurmLauncher(cfg)
    raise ConfigError(f"launcher={name!r}; allowed: local, slurm")


__all__ = ["Launcher", "LaunchResult", "make_launcher"]
