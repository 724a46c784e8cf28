"""noop: a stage that does nothing on every rank; bench/overhead.py times the launch path with it."""
from orchestrator.stages import StageSpec


def run(ctx, run):
    return {"world_size": ctx.world_size}


SPEC = StageSpec(
    name="noop",
    run=run,
    ledger_key=lambda cfg: "noop",
    outputs=lambda cfg: [],
    hash_sections=("cluster",),
    torch_distributed=False,
)
