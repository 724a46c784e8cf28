"""init: a cluster file written from what Slurm says, then a check of the cluster with it.

`python -m orchestrator stage=init`, on a login node:
1. reads the cluster (sinfo, scontrol, srun --mpi=list: launch/slurm_discovery.py) and guesses
   a cluster config from it (`guess_cluster`, pure);
2. writes it, commented (what was seen, what was guessed, which key changes it), as
   conf/cluster/<name>.yaml in the site folder, and loads it back as `cluster=<name>` does;
3. checks the cluster with it (`preflight`, cli/preflight.py): one table, check | result |
   what to fix; exit 0 when nothing failed. `init.preflight_only=true cluster=<name>` runs only this.

All of it runs in the CLI's process, like `status`. The one launch is the check job: the init
stage's plan (orchestrator/stages/init.py) on the cluster's ranks through the Slurm launcher, as
any stage's (MPI's world, then one all_reduce over torch.distributed with the cluster's
backend). That job is in the ledger like every launch (`stage=status` re-attaches to it after a
Ctrl-C; `always_runs`, so never skipped as done). Writing the file is not: the file is its own
record, and force=true rewrites it (a file init did not write, or one edited since, is kept as
`<name>.yaml.orig-<time>`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from rich.console import Console
from rich.markup import escape

from orchestrator.choices import Backend
from orchestrator.cli.preflight import WHEEL_PMI, Verdict, preflight, print_checks
from orchestrator.commands import rerun_command, user_overrides
from orchestrator.conf_folders import CONF_DIR, site_conf_dir
from orchestrator.config import (ClusterConfig, Config, InitConfig, LinkSheetConfig,
                                 register_configs)
from orchestrator.config_keys import check_path_name
from orchestrator.errors import ConfigError, LaunchError
from orchestrator.launch import slurm_discovery
from orchestrator.launch.slurm_discovery import SlurmCluster
from orchestrator.store.user_folder import KeptCopy, UserFolder

CPU_TASKS_PER_NODE = 4  # CPU nodes: ranks per node when init.tasks_per_node is unset


# ---------------------------------------------------------------- the guess (pure)
@dataclass(frozen=True)
class ClusterGuess:
    """The cluster config init writes, and the comment next to each key (`links.<field>` too)."""

    cluster: ClusterConfig
    notes: Dict[str, str]
    seen: str  # what Slurm said, one line for the file's head


def gpu_mem_GiB(gpu_type: Optional[str], sheets: Dict[str, float]) -> Tuple[float, str]:
    """(memory per GPU in GiB, where that came from) for a Gres GPU type: a size in the type
    (`nvidia_h100_80gb_hbm3`, `1g.10gb`), else the device sheet whose name is in the type
    (`sheets`: name -> mem_GiB), else (0, why not)."""
    kind = (gpu_type or "").lower()
    stated = re.search(r"(\d+)\s*gi?b", kind)
    if stated:
        return float(stated.group(1)), f"from the GPU type {gpu_type!r}"
    names = sorted((n for n in sheets if n in kind), key=len, reverse=True)
    if names:
        return float(sheets[names[0]]), (f"GUESSED from the GPU type {gpu_type!r}: "
                                         f"conf/device/{names[0]}.yaml")
    what = f"GPU type {gpu_type!r}" if gpu_type else "an untyped Gres (gpu:<count>)"
    return 0.0, f"FILL IN: {what} matches no conf/device/*.yaml"


def guess_cluster(slurm: SlurmCluster, init: InitConfig, name: str, gpu_sheets: Dict[str, float],
                  links: Optional[Tuple[LinkSheetConfig, str]] = None) -> ClusterGuess:
    """The cluster config for `init`'s choices (partition, nodes, ranks) over what `slurm`
    offers; ConfigError where a choice cannot be met. `gpu_sheets`: device name -> mem_GiB;
    `links`: published link figures for the GPU type and where they are from (None: the
    schema's defaults)."""
    part = slurm.partition(init.partition)
    members = slurm.nodes_of(part.name)
    if not members:
        raise ConfigError(f"partition {part.name} has no nodes; choose another with "
                          f"init.partition=<name>")
    idle = [n for n in members if n.idle]
    shape = idle or members  # what a job gets: the idle nodes' (all the nodes' if none is idle)
    if init.nodes is not None and not 1 <= init.nodes <= len(members):
        raise ConfigError(f"init.nodes={init.nodes}: partition {part.name} has {len(members)} "
                          f"node(s)")
    nodes = init.nodes or len(idle) or 1
    gpus, cpus = min(n.gpus for n in shape), min(n.cpus for n in shape)
    mem_GiB = min(n.mem_MiB for n in shape) / 1024
    gpu_type = next((n.gpu_type for n in shape if n.gpu_type), None)
    limit = gpus or cpus
    tasks = init.tasks_per_node or (gpus or min(cpus, CPU_TASKS_PER_NODE))
    if not 1 <= tasks <= limit:
        raise ConfigError(f"init.tasks_per_node={tasks}: a node of partition {part.name} has "
                          f"{limit} {'GPUs (one rank each)' if gpus else 'CPUs'}")
    notes = {}
    if gpus:
        device_mem, notes["device_mem_GiB"] = gpu_mem_GiB(gpu_type, gpu_sheets)
        notes["device_mem_GiB"] += "; nvidia-smi on a compute node tells"
    else:
        device_mem = int(mem_GiB / tasks * 10) / 10
        notes["device_mem_GiB"] = (f"per rank: the node's {mem_GiB:.1f} GiB over {tasks} ranks; "
                                   f"search plans against it")
    max_time = part.max_time_min
    time_min = min(max_time, init.max_time_min) if max_time else init.max_time_min
    offered = ", ".join(slurm.mpi_plugins) or "nothing"
    link_sheet, link_source = links or (LinkSheetConfig(), "the schema's defaults (a DGX H100)")
    cluster = ClusterConfig(
        name=name, nodes=nodes, tasks_per_node=tasks, gpus_per_node=tasks if gpus else 0,
        backend=Backend.nccl if gpus else Backend.gloo, device_mem_GiB=device_mem,
        partition=part.name, account=init.account, time_min=time_min,
        cpus_per_task=max(1, cpus // tasks), mpi_flag=f"--mpi={WHEEL_PMI}",
        setup=list(init.setup), links=link_sheet)
    hosts = {n.host for n in shape}
    notes.update({
        "partition": ("the default partition" if part.default else "init.partition")
        + "; `sinfo -s` lists the others",
        "nodes": ("init.nodes" if init.nodes else
                  f"the partition's idle nodes when init ran ({len(idle)} of {len(members)})"
                  + ("" if idle else "; none was idle: 1")),
        "tasks_per_node": (f"one rank per GPU ({gpus} per node)" if gpus else
                           f"CPU ranks per node (of {cpus} CPUs); init.tasks_per_node= or edit"),
        "gpus_per_node": f"Gres: {gpus} x {gpu_type or 'gpu'}" if gpus else "no GPU in Gres",
        "backend": "nccl: one rank per GPU" if gpus else "gloo: CPU ranks",
        "cpus_per_task": f"the node's {cpus} CPUs shared among its ranks",
        "time_min": (f"minutes per job; the partition allows {_minutes(max_time)}; a stage "
                     f"requeues at the limit and resumes (init.max_time_min=)"),
        "mpi_flag": f"srun offers: {offered}; the mpich wheel speaks {WHEEL_PMI}",
        "setup": "shell lines run before srun in every job (module load ..., exports)"
        + ("; from init.setup" if init.setup else ""),
        "links": (f"GUESSED, not measured: {link_source}"
                  + ("" if gpus else "; this cluster has no GPUs, so only measured figures "
                     "mean anything")
                  + f". `profile_hardware.source=analytic` prices communication from these; "
                    f"`python -m orchestrator stage=profile_hardware launcher=slurm "
                    f"cluster={name}` measures the links (search then reads that profile)."),
    })
    gpu_text = f"{gpus} x {gpu_type or 'gpu'}" if gpus else "no GPUs"
    seen = (f"partition {part.name}{' (default)' if part.default else ''}, MaxTime "
            f"{_minutes(max_time)}, {len(members)} nodes ({len(idle)} idle, on {len(hosts)} "
            f"host(s)); per node {cpus} CPUs, {mem_GiB:.1f} GiB, {gpu_text}")
    return ClusterGuess(cluster=cluster, notes=notes, seen=seen)


def _minutes(minutes: Optional[int]) -> str:
    return "UNLIMITED" if minutes is None else f"{minutes} min"


def _yaml_scalar(value) -> str:
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a YAML double-quoted scalar


# What each link figure is, for the file's comments.
LINK_MEANINGS = {
    "intra_busbw_GBps": "all-reduce bus bandwidth inside a node (nccl-tests busbw)",
    "intra_p2p_GBps": "one GPU to another inside a node",
    "nics_per_node": "network cards per node (`ibstat` on a compute node)",
    "nic_Gbps": "each card's line rate",
    "inter_efficiency": "share of the line rate collectives reach across nodes",
    "intra_latency_us": "per collective step inside a node",
    "inter_latency_us": "per collective step across nodes",
    "overlap_coe": "slow-down of communication overlapped with compute",
    "dtype": "the dtype the figures are for",
}
LINE_WIDTH = 100


def _commented(text: str, note: Optional[str], indent: str = "") -> List[str]:
    """`text` with `note` as a trailing comment, or (when that is too long) wrapped above it."""
    import textwrap

    if not note:
        return [indent + text]
    line = f"{indent + text:<30}# {note}"
    if len(line) <= LINE_WIDTH:
        return [line]
    return textwrap.wrap(note, LINE_WIDTH - len(indent) - 2, initial_indent=indent + "# ",
                         subsequent_indent=indent + "# ") + [indent + text]


def cluster_yaml(guess: ClusterGuess, written_by: str) -> str:
    """The commented cluster file (YAML) for `guess`; `written_by` heads it."""
    import textwrap

    c, notes = guess.cluster, guess.notes
    use = f"python -m orchestrator stage=all launcher=slurm cluster={c.name}"
    check = rerun_command("init", "init.preflight_only=true", f"cluster={c.name}", overrides=[])
    head = (f"Slurm cluster {c.name}, {written_by}. Slurm said: {guess.seen}. Every value is "
            f"yours to change, here or per command (cluster.<key>=...); GUESSED and FILL IN "
            f"mark what Slurm could not tell.")
    lines = textwrap.wrap(head, LINE_WIDTH - 2, initial_indent="# ", subsequent_indent="# ")
    lines += [f"#   use it:    {use}", f"#   check it:  {check}"]
    for key in ("name", "partition", "nodes", "tasks_per_node", "gpus_per_node", "backend",
                "cpus_per_task", "device_mem_GiB", "time_min", "mpi_flag"):
        lines += _commented(f"{key}: {_yaml_scalar(getattr(c, key))}", notes.get(key))
    if c.account:
        lines += _commented(f"account: {_yaml_scalar(c.account)}", "init.account")
    else:
        lines += _commented("# account: <account>", "sbatch --account, where the site wants one")
    lines += _commented("# qos: <qos>", "sbatch --qos")
    lines += _commented("# mem_GiB: <GiB per node>", "unset: the partition's default memory")
    lines += _commented("setup:" if c.setup else "setup: []", notes["setup"])
    lines += [f"  - {_yaml_scalar(line)}" for line in c.setup]
    lines += _commented("links:", notes["links"])
    for f in dataclasses.fields(LinkSheetConfig):
        lines += _commented(f"{f.name}: {_yaml_scalar(getattr(c.links, f.name))}",
                            LINK_MEANINGS.get(f.name), indent="  ")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- sheets from conf/
def gpu_sheets() -> Dict[str, float]:
    """GPU device sheets (the site's and the package's): name -> mem_GiB."""
    from orchestrator.device import device_sheets, load_device_sheet

    sheets = {name: load_device_sheet(name) for name in device_sheets()}
    return {n: float(s["mem_GiB"]) for n, s in sheets.items()
            if s.get("type") == "gpu" and s.get("mem_GiB")}


def published_links(gpu_type: Optional[str]) -> Optional[Tuple[LinkSheetConfig, str]]:
    """The `links` of a package cluster file for this GPU (conf/cluster/dgx_a100.yaml for an
    a100) and its name; None when none matches."""
    from omegaconf import OmegaConf

    kind = (gpu_type or "").lower()
    for path in sorted((CONF_DIR / "cluster").glob("*.yaml")):
        device = path.stem.rsplit("_", 1)[-1]
        if kind and device in kind:
            raw = OmegaConf.load(path)
            if "links" in raw:
                sheet = OmegaConf.merge(OmegaConf.structured(LinkSheetConfig), raw.links)
                return OmegaConf.to_object(sheet), f"the figures of conf/cluster/{path.name}"
    return None


# ---------------------------------------------------------------- writing the file
def cluster_name(init: InitConfig, slurm_name: Optional[str]) -> str:
    """init.name, else Slurm's ClusterName, else this host's short name; ConfigError unless it
    is safe as a file name."""
    if init.name:
        check_path_name("init.name", init.name)
        return init.name
    name = slurm_name or socket.gethostname().split(".")[0]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".-") or "cluster"
    check_path_name("init.name", name)
    return name


def site_folder() -> Path:
    """Where init writes: the site folder, or ./conf when there is none yet."""
    return site_conf_dir() or (Path.cwd() / "conf")


def load_cluster(name: str) -> ClusterConfig:
    """`cluster=<name>` composed as the command line does (site folder first, the schema
    checking every key and type); ConfigError with Hydra's reason when it does not load."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup
    from omegaconf import OmegaConf

    register_configs()  # the site folder's search path, also outside the CLI

    # A fresh search path (this command's was fixed at start, maybe before ./conf existed);
    # the running command's Hydra is put back after.
    running = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            composed = compose("config", overrides=[f"cluster={name}"])
    except Exception as e:  # Hydra's errors have no common base worth naming
        raise ConfigError(f"cluster={name} does not load: {e}") from None
    finally:
        if running is not None:
            restore_gh_from_backup(running)
    return OmegaConf.to_object(composed).cluster


def write_cluster_file(init: InitConfig, slurm: SlurmCluster,
                       force: bool = False) -> Tuple[Path, ClusterConfig, List[KeptCopy]]:
    """Write conf/cluster/<name>.yaml for this cluster; ConfigError (exit 2) when it exists
    and not `force`. The site folder is the user's: a file init did not write, or one edited
    since, is kept as `<name>.yaml.orig-<time>` (store/user_folder.py). Returns the file, the
    cluster as `cluster=<name>` loads it, and the file kept (if any)."""
    name = cluster_name(init, slurm.name)
    path = site_folder() / "cluster" / f"{name}.yaml"
    if path.exists() and not force:
        check = rerun_command("init", "init.preflight_only=true", f"cluster={name}")
        raise ConfigError(f"{path} exists; force=true rewrites it, init.name=<name> writes "
                          f"another, `{check}` checks it")
    gpu_type = next((n.gpu_type for n in slurm.nodes if n.gpu_type), None)
    guess = guess_cluster(slurm, init, name, gpu_sheets(), published_links(gpu_type))
    stamp = time.strftime("%Y-%m-%d %H:%M")
    text = cluster_yaml(guess, f"written by `python -m orchestrator stage=init` on "
                               f"{socket.gethostname()}, {stamp}")
    with UserFolder(path.parent) as folder:
        folder.write_text(path.name, text)
    try:
        return path, load_cluster(name), folder.kept
    except ConfigError:
        # A file that does not load is init's bug: leave none behind, the user's back in place.
        path.unlink()
        for kept in folder.kept:
            os.replace(kept.copy, kept.path)
        raise


# ---------------------------------------------------------------- the command
def init_cluster(cfg: Config, launch: Callable[[Config], List[dict]],
                 console: Console) -> List[dict]:
    """`stage=init`: write the cluster file (unless init.preflight_only), then check the cluster
    with it (unless init.preflight=false); LaunchError (exit 5) when a check failed. Returns
    the checks as rows."""
    if cfg.init.preflight_only:
        if not any(o.split("=", 1)[0] == "cluster" for o in user_overrides()):
            raise ConfigError("init.preflight_only=true checks a cluster file: name it with "
                              "cluster=<name> (conf/cluster/<name>.yaml)")
        cluster = cfg.cluster
    else:
        path, cluster, kept = write_cluster_file(cfg.init, slurm_discovery.discover(),
                                                 cfg.force)
        console.print(escape(f"wrote {path}: partition {cluster.partition}, {cluster.nodes} "
                             f"node(s) x {cluster.tasks_per_node} rank(s), {cluster.backend}; "
                             f"read it, GUESSED and FILL IN mark what to check"))
        for copy in kept:
            console.print(f"[yellow]{escape(copy.describe())}[/]")
        if not cfg.init.preflight:
            return []
    cfg = dataclasses.replace(cfg, cluster=cluster)
    checks = preflight(cfg, launch)
    print_checks(console, checks, f"preflight: cluster={cluster.name}")
    rows = [dict(check=c.name, verdict=c.verdict.value, result=c.result, fix=c.fix)
            for c in checks]
    failed = [c.name for c in checks if c.verdict == Verdict.failed]
    again = rerun_command("init", "init.preflight_only=true", f"cluster={cluster.name}")
    if failed:
        raise LaunchError(f"preflight: {len(failed)} check(s) failed ({', '.join(failed)}); "
                          f"fix them as the table says, then: {again}")
    console.print(escape(f"cluster {cluster.name} is ready: python -m orchestrator stage=all "
                         f"launcher=slurm cluster={cluster.name}"))
    return rows
