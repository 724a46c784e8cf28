"""noop: a stage that does nothing on every rank; bench/overhead.py times the launch path with it."""
from orchestrator.stages import Stage


class Noop(Stage):
    name = "noop"
    hash_sections = ("cluster",)
    torch_distributed = False

    def plan(self, cfg):
        return self.make_plan(cfg, key="noop")

    def run(self, ctx, run):
        return {"world_size": ctx.world_size}


STAGE = Noop()
