"""What a Slurm cluster offers, as its own commands say on a login node (for `stage=init`).

Pure parsers of the commands' text, each tested on captured samples, and `discover()`, which
runs the commands. Only formats that have held across Slurm releases: `sinfo -o` with a fixed
field list, and scontrol's one-line `key=value` records (`--json` exists from 21.08 on and has
changed shape between releases).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from orchestrator.errors import ConfigError

# One row per node and partition: name | host | partition (`*`: the default) | state | CPUs |
# memory MiB | generic resources (e.g. gpu:h100:8(S:0-1)).
SINFO_NODE_FORMAT = "%N|%n|%P|%T|%c|%m|%G"
COMMAND_TIMEOUT_S = 30


@dataclass(frozen=True)
class SlurmNode:
    """One node of one partition, as `sinfo -N -o SINFO_NODE_FORMAT` lists it."""

    name: str
    host: str  # NodeHostName: fake nodes (several slurmd on one machine) share one
    partition: str
    state: str  # sinfo's long state, lower case, flags kept: idle, mixed, down*, idle~
    cpus: int
    mem_MiB: int
    gpus: int
    gpu_type: Optional[str]  # the Gres type, e.g. h100 in gpu:h100:8; None: untyped or no GPU

    @property
    def idle(self) -> bool:
        """Free now: idle, responding (no `*`), not drained."""
        return re.sub(r"[~#!%$@^\-]+$", "", self.state) == "idle"


@dataclass(frozen=True)
class SlurmPartition:
    name: str
    default: bool
    up: bool
    max_time_min: Optional[int]  # None: UNLIMITED
    default_time_min: Optional[int]  # None: NONE (MaxTime applies)
    total_nodes: int


@dataclass(frozen=True)
class SlurmCluster:
    """Everything `stage=init` chooses from."""

    name: Optional[str]  # ClusterName of `scontrol show config`
    nodes: Tuple[SlurmNode, ...]
    partitions: Tuple[SlurmPartition, ...]
    mpi_plugins: Tuple[str, ...]  # what `srun --mpi=list` offers (pmi2, pmix, ...)

    def partition(self, name: Optional[str] = None) -> SlurmPartition:
        """Partition `name`, or the default one; ConfigError naming the partitions there are."""
        names = ", ".join(p.name + (" (default)" if p.default else "") for p in self.partitions)
        for p in self.partitions:
            if (p.name == name) if name else p.default:
                return p
        if name:
            raise ConfigError(f"init.partition={name}: Slurm has no such partition; it has: "
                              f"{names or 'none'}")
        raise ConfigError(f"Slurm names no default partition; choose one with "
                          f"init.partition=<name> (there are: {names or 'none'})")

    def nodes_of(self, partition: str) -> List[SlurmNode]:
        return [n for n in self.nodes if n.partition == partition]


# ---------------------------------------------------------------- parsers (pure)
def parse_time_min(text: str) -> Optional[int]:
    """Minutes of a Slurm time (MaxTime, DefaultTime, sinfo's %l), rounded down; None for
    UNLIMITED / infinite / NONE. Forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    text = text.strip()
    if text.upper() in ("UNLIMITED", "INFINITE", "NONE", "N/A", ""):
        return None
    days, _, clock = text.rpartition("-") if "-" in text else ("", "", text)
    parts = [int(p) for p in clock.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        hours, minutes = parts[0], (parts[1] if len(parts) > 1 else 0)
    elif len(parts) == 3:  # H:M:S
        hours, minutes = parts[0], parts[1]
    else:  # M or M:S
        hours, minutes = 0, parts[0]
    return int(days or 0) * 1440 + hours * 60 + minutes


def parse_gres_gpus(gres: str) -> Tuple[int, Optional[str]]:
    """(GPU count, GPU type) of a node's Gres: `gpu:h100:8(S:0-1)` -> (8, "h100"),
    `gpu:8` -> (8, None), `gpu:a100:4,gpu:v100:2` -> (6, "a100") (the first type),
    `(null)` -> (0, None). Other resources (mps, shard) are not GPUs."""
    gres = re.sub(r"\([^)]*\)", "", gres)  # socket bindings: (S:0-1)
    count, kind = 0, None
    for item in gres.split(","):
        fields = item.strip().split(":")
        if fields[0] != "gpu":
            continue
        number = re.match(r"\d+", fields[-1]) if len(fields) > 1 else None
        named = fields[1] if len(fields) > 2 or (len(fields) == 2 and not number) else None
        count += int(number.group()) if number else 1
        kind = kind or named
    return count, kind


def parse_sinfo_nodes(text: str) -> List[SlurmNode]:
    """The rows of `sinfo -h -N -o SINFO_NODE_FORMAT` (a node once per partition)."""
    nodes = []
    for line in text.splitlines():
        if not line.strip():
            continue
        name, host, partition, state, cpus, mem, gres = line.strip().split("|", 6)
        gpus, gpu_type = parse_gres_gpus(gres)
        nodes.append(SlurmNode(name=name, host=host, partition=partition.rstrip("*"),
                               state=state.lower(), cpus=int(re.match(r"\d+", cpus).group()),
                               mem_MiB=int(re.match(r"\d+", mem).group()), gpus=gpus,
                               gpu_type=gpu_type))
    return nodes


def parse_records(text: str) -> List[Dict[str, str]]:
    """scontrol's `-o` output: one record per line, `Key=value` pairs split at the spaces
    before each key (a value may hold spaces, e.g. OS=Linux 6.8 #1 SMP, or `=`, e.g.
    CfgTRES=cpu=4,mem=4000M)."""
    records = []
    for line in text.splitlines():
        pairs = re.findall(r"(?:^|\s)([A-Za-z][\w/.:-]*)=(.*?)(?=\s+[A-Za-z][\w/.:-]*=|\s*$)",
                           line)
        if pairs:
            records.append({key: value.strip() for key, value in pairs})
    return records


def parse_partitions(text: str) -> List[SlurmPartition]:
    """The partitions of `scontrol show partition -o`."""
    return [SlurmPartition(name=r["PartitionName"], default=r.get("Default", "NO") == "YES",
                           up=r.get("State", "UP") == "UP",
                           max_time_min=parse_time_min(r.get("MaxTime", "UNLIMITED")),
                           default_time_min=parse_time_min(r.get("DefaultTime", "NONE")),
                           total_nodes=int(r.get("TotalNodes", "0") or 0))
            for r in parse_records(text) if "PartitionName" in r]


def parse_config_value(text: str, key: str) -> Optional[str]:
    """One setting of `scontrol show config` (`Key = value` lines); None if absent or (null)."""
    match = re.search(rf"^{re.escape(key)}\s*=\s*(.*?)\s*$", text, re.MULTILINE)
    value = match.group(1) if match else None
    return None if value in (None, "", "(null)") else value


def parse_mpi_plugins(text: str) -> Tuple[str, ...]:
    """The plugin names `srun --mpi=list` prints. Old releases: `srun: pmi2` lines after
    `srun: MPI types are...`; 22.05 on: tab-indented names after `MPI plugin types are...`,
    then a line on pmix versions."""
    names = []
    for line in text.splitlines():
        line = re.sub(r"^(srun:)?\s*(mpi/)?", "", line).strip()  # 17.x: `srun: mpi/pmi2`
        if re.fullmatch(r"\w+", line):  # headers and notes have spaces
            names.append(line)
    return tuple(dict.fromkeys(names))


# ---------------------------------------------------------------- running the commands
def slurm_command(*args: str) -> str:
    """stdout of a Slurm command (with stderr appended: srun --mpi=list prints there on old
    releases); ConfigError naming the command and its error when it is missing or fails."""
    if shutil.which(args[0]) is None:
        raise ConfigError(f"{args[0]} not found on PATH: stage=init reads a Slurm cluster; run "
                          f"it on a login node (or put Slurm's commands on PATH)")
    try:
        out = subprocess.run(list(args), capture_output=True, text=True,
                             timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"`{' '.join(args)}` gave no answer in {COMMAND_TIMEOUT_S} s: is "
                          f"slurmctld up?") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise ConfigError(f"`{' '.join(args)}` failed (exit {out.returncode}): {last}")
    return out.stdout + out.stderr


def mpi_plugins() -> Tuple[str, ...]:
    """What `srun --mpi=list` offers."""
    return parse_mpi_plugins(slurm_command("srun", "--mpi=list"))


def discover() -> SlurmCluster:
    """The cluster as Slurm's commands describe it now (a handful of quick queries)."""
    return SlurmCluster(
        name=parse_config_value(slurm_command("scontrol", "show", "config"), "ClusterName"),
        nodes=tuple(parse_sinfo_nodes(slurm_command("sinfo", "-h", "-N", "-o",
                                                    SINFO_NODE_FORMAT))),
        partitions=tuple(parse_partitions(slurm_command("scontrol", "show", "partition",
                                                        "-o"))),
        mpi_plugins=mpi_plugins())
