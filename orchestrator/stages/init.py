"""init's check job: on every rank of the cluster (as the preflight narrows it), MPI's world,
then one all_reduce over torch.distributed with the cluster's backend.

The command `stage=init` (the cluster file, the preflight table) runs in the CLI's process:
orchestrator/cli/init.py, which launches this stage's plan like any stage's.
"""
from __future__ import annotations

from orchestrator.stages import Stage


class Init(Stage):
    """Its plan is the check job: every rank of the cluster (as the preflight narrows it)."""

    name = "init"
    hash_sections = ("cluster",)
    always_runs = True  # a check of the cluster now: never skipped as done

    def plan(self, cfg):
        return self.make_plan(cfg, key="init")

    def run(self, ctx, run):
        """One all_reduce of rank + 1 over the backend; what rank 0 saw."""
        import torch
        import torch.distributed as dist

        value = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
        dist.all_reduce(value)
        return {"world_size": ctx.world_size, "num_nodes": ctx.num_nodes, "backend": ctx.backend,
                "allreduce_sum": value.item(), "hosts": sorted(set(ctx.hostnames))}


STAGE = Init()
