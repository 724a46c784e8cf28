"""noop: a stage that does nothing on every rank; bench/overhead.py times the launch path with it.

`noop.sleep_s` holds the ranks a while: a cheap run in progress for tests of Ctrl-C, kill -9 and
concurrent runs.
"""
import time

from orchestrator.stages import Stage


class Noop(Stage):
    name = "noop"
    hash_sections = ("cluster",)
    torch_distributed = False

    def plan(self, cfg):
        return self.make_plan(cfg, key="noop")

    def run(self, ctx, run):
        time.sleep(run.cfg.noop.sleep_s)
        return {"world_size": ctx.world_size}


STAGE = Noop()
