"""tune's plan: its ledger key, config hash and output (calibration/<model>.json), as any stage's.

The command `stage=tune` (candidates, one train launch each, the fit, the pick) runs in the CLI's
process: orchestrator/cli/tune.py. No rank ever runs this stage.
"""
from __future__ import annotations

from orchestrator.choices import Ranks
from orchestrator.errors import ConfigError
from orchestrator.stages import Stage
from orchestrator.store import calibration_path


class Tune(Stage):
    """Planned like any stage (its key and hash); launched by the command line itself."""

    name = "tune"
    # Search lists the calibration among its inputs, so this hash is part of search's (and
    # train's): tune's own knobs must not make them stale; the calibration's digest does.
    hash_sections = ("cluster", "model")

    def plan(self, cfg):
        return self.make_plan(cfg, key=f"tune/{cfg.model.name}", ranks=Ranks.one,
                              outputs=[calibration_path(cfg.profiles_dir, cfg.cluster.name,
                                                        cfg.model.name)])

    def run(self, ctx, run):
        raise ConfigError("stage=tune runs from the command line: python -m orchestrator "
                          "stage=tune")


STAGE = Tune()
