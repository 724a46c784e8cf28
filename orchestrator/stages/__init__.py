"""The stages: one module each, each exposing `STAGE`, an instance of a `Stage` subclass.

A stage's `plan(cfg)` validates its config and says, once, what a launch of it is: its ledger key,
sub-parts, where it runs (every rank of the cluster or one process), the profiles it reads and
the files it writes, plus its own typed details (e.g. profile_model's sequence lengths and TP
degrees). The pipeline adds the config hash; the request carries the plan to the ranks, where
`run(ctx, run)` executes on every rank without planning again and never knows which launcher
started it.
"""
from __future__ import annotations

import importlib
import keyword
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, List, Optional, Tuple

from orchestrator.choices import Ranks
from orchestrator.commands import commands_that_launch, rerun_command, user_overrides
from orchestrator.config import Config, cluster_world_size, local_cannot_reach
from orchestrator.errors import ConfigError

# `stage=all` runs these in order, skipping what is done.
PIPELINE = ("profile_hardware", "profile_model", "search", "train")
# Stages a user can name (plus `all` and `status`, which the CLI handles itself). `init` and
# `tune` are commands of the CLI's process (cli/init.py, cli/tune.py); their stages here plan
# init's check job and tune's ledger key and calibration file.
STAGES = PIPELINE + ("import", "export", "trace", "noop", "init", "tune")


@dataclass(frozen=True)
class StageInput:
    path: Path
    profile: type  # the profile record the file must hold (store.schema), e.g. HardwareProfile
    producer: str  # the stage that writes it

    def rebuild(self) -> str:
        """The command that writes this input, for error messages: the user's overrides that
        matter to the producer (profiles_dir, cluster, model, ...), shell-quoted."""
        return rerun_command(self.producer)

    def read(self, cfg):
        """The input as its profile record, checked against the model and cluster `cfg` asks
        for (store.read_profile): ProfileError naming the file and `rebuild()`."""
        from orchestrator.store import read_profile

        return read_profile(self.path, self.profile, self.rebuild(), config=cfg)


@dataclass(frozen=True)
class StagePlan:
    """What one launch of a stage is, computed once by the CLI and carried to the ranks."""

    stage: str
    key: str  # the ledger key, e.g. "profile_model/tiny"
    ranks: Ranks
    world_size: int  # ranks the launch needs (1 for Ranks.one)
    subparts: Tuple[str, ...] = ()  # in run order; each a ledger entry `<key>/<name>`
    # The sub-parts the user named, when fewer than all: redone even when done, unless the same
    # selection made them (rerunning the same command resumes). () when not narrowed.
    selection: Tuple[str, ...] = ()
    inputs: Tuple[StageInput, ...] = ()
    outputs: Tuple[Path, ...] = ()
    detail: Any = None  # the stage's own typed plan
    config_hash: str = ""  # set by pipeline.plan_stage
    # The command line's overrides, for the fix commands the ranks print (they never see argv).
    user_overrides: Tuple[str, ...] = ()
    # The key the stage's results were recorded under before it had one per output (train:
    # `train/<model>` before `train/<model>/<layout tag>`), and still are when the layout is not
    # known when planning (stage=all before search): done there under the same config hash is
    # done here, while `key` has no record of its own. None: no such key.
    former_key: Optional[str] = None


class Stage:
    """Base of every stage. Subclasses set the class fields and define `plan` and `run`."""

    name: ClassVar[str]
    # Top-level config sections that decide whether earlier results are still valid, and the
    # dotted keys in them that do not (which sub-parts to run, plotting).
    hash_sections: ClassVar[Tuple[str, ...]]
    hash_exclude: ClassVar[Tuple[str, ...]] = ()
    # A config section whose swept keys give each point of a `-m` sweep its own ledger key and
    # outputs (orchestrator.sweep); None: points share them.
    sweep_section: ClassVar[Optional[str]] = None
    # False: the ranks get MPI only (no torch import, no process group): a cheaper start.
    torch_distributed: ClassVar[bool] = True
    # Slurm requeues after a time limit or preemption, at least (also one per sub-part).
    requeues: ClassVar[int] = 3
    # True: run whenever asked, never skipped as done (what it reads may change outside us).
    always_runs: ClassVar[bool] = False
    # The heavy modules its ranks import: a rank imports them at its start, with the garbage
    # collector paused (runtime.run_rank); naming one here only makes a rank start sooner.
    rank_imports: ClassVar[Tuple[str, ...]] = ()

    def plan(self, cfg: Config) -> StagePlan:
        """Validate the stage's config (ConfigError before anything launches); the launch."""
        raise NotImplementedError

    def hash_extra(self, cfg: Config) -> dict:
        """What else decides whether earlier results are still valid, beside hash_sections
        (profile_model: whether the block is timed compiled); {} adds nothing to the hash."""
        return {}

    def launch_plan(self, plan: StagePlan, produced_now) -> StagePlan:
        """The plan to launch once the stages named in `produced_now` have run (or been
        submitted) earlier in this command, rewriting its inputs: `plan` by default."""
        return plan

    def read_inputs(self, cfg: Config, plan: StagePlan) -> List[str]:
        """Read and check the plan's input profiles, each against the model and cluster `cfg`
        asks for (ProfileError, exit 4, naming the file and the command that rebuilds it); the
        notes on what is extrapolated from them."""
        for needed in plan.inputs:
            needed.read(cfg)
        return []

    def run(self, ctx, run) -> Optional[dict]:
        """Run on every rank (`run.plan`, `run.cfg`, `run.todo`); rank 0 returns the summary."""
        raise NotImplementedError

    def disk_bytes(self, cfg: Config) -> Optional[int]:
        """About how many bytes a run writes under the profiles folder (an order of magnitude,
        computed from the shape of its outputs), for the message on a full disk; None: the
        stage does not say."""
        return None

    def make_plan(self, cfg: Config, key: str, ranks: Ranks = Ranks.cluster,
                  subparts=(), inputs=(), outputs=(), detail=None, selection=(),
                  former_key=None) -> StagePlan:
        """A StagePlan of this stage; the world size follows from `ranks`."""
        world = cluster_world_size(cfg.cluster) if ranks == Ranks.cluster else 1
        return StagePlan(stage=self.name, key=key, former_key=former_key, ranks=Ranks(ranks),
                         world_size=world,
                         subparts=tuple(subparts), selection=tuple(selection),
                         inputs=tuple(inputs),
                         outputs=tuple(Path(p) for p in outputs), detail=detail,
                         user_overrides=tuple(user_overrides()))


def check_ranks_reachable(stage: str, ranks: Ranks, cfg: Config) -> None:
    """ConfigError when this launcher cannot start `ranks` of `stage`: the local launcher runs
    on this machine only. A stage calls it before its other checks, so that no message about
    the node count (a layout for other ranks, say) sends the user into a command that this
    launcher refuses anyway. Both commands it prints run as printed."""
    if ranks == Ranks.cluster and local_cannot_reach(cfg.launcher.name, cfg.cluster.nodes):
        slurm, here = commands_that_launch(stage, cfg)
        priced = ""
        if stage in ("profile_hardware", "profile_model"):  # the profiles with an analytic form
            priced = (f"; or from published figures, on no ranks: "
                      f"{rerun_command(stage, f'{stage}.source=analytic')}")
        raise ConfigError(f"launcher=local runs {stage} on this machine only: cluster.nodes"
                          f"({cfg.cluster.nodes}) must be 1. On {cfg.cluster.nodes} nodes: "
                          f"{slurm}; here: {here}{priced}")


def get_stage(name: str) -> Stage:
    """The stage `name`; ConfigError naming the allowed stages if there is none."""
    if name not in STAGES:
        allowed = ", ".join(STAGES + ("all", "status"))
        raise ConfigError(f"unknown stage {name!r}; allowed: {allowed}")
    module = f"{name}_" if keyword.iskeyword(name) else name  # stage=import: stages/import_.py
    return importlib.import_module(f"orchestrator.stages.{module}").STAGE


def disk_need_text(names, cfg: Config) -> str:
    """'<stage> writes about <size>' for each stage of `names` that estimates it, joined by
    commas; '' when none does. Only for an error message: an estimate that fails is left out."""
    from orchestrator.errors import size_text

    parts = []
    for name in names:
        try:
            n_bytes = get_stage(name).disk_bytes(cfg)
        except Exception:  # noqa: BLE001 - never hide the error being reported
            n_bytes = None
        if n_bytes:
            parts.append(f"{name} writes about {size_text(n_bytes)}")
    return ", ".join(parts)
