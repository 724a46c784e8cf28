"""init's preflight: a cluster file checked against this Slurm cluster, one table of check |
result | what to fix.

The partition, srun's PMI plugins and fake nodes sharing a host are read from Slurm on the login
node (launch/slurm_discovery.py); the check job (the init stage, orchestrator/stages/init.py)
then starts MPI's world and one all_reduce over torch.distributed on the cluster's ranks, and a
failed job's logs are matched against known failure signs (`diagnose`) for the fix to print.
"""
from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from orchestrator.choices import LauncherName
from orchestrator.config import ClusterConfig, Config
from orchestrator.errors import ConfigError, OrchestratorError
from orchestrator.launch import slurm_discovery
from orchestrator.launch.slurm_discovery import SlurmCluster
from orchestrator.pipeline import ledger_for

# The PMI the mpich wheel (what `pip install` brings for mpi4py here) speaks under srun.
WHEEL_PMI = "pmi2"
# mpich's OFI netmod over TCP: what conf/cluster/dev.yaml sets for fake nodes sharing a host.
OFI_SETUP = ("export MPIR_CVAR_CH4_NETMOD=ofi", "export FI_PROVIDER=tcp")


class Verdict(str, Enum):
    passed = "pass"
    warning = "warn"
    failed = "FAIL"


@dataclass(frozen=True)
class Check:
    name: str
    verdict: Verdict
    result: str
    fix: str = ""


# What a failed check job's logs say, and what to do about it (the first that matches).
_LOG_SIGNS = (
    (r"COMM_WORLD.size == 1", f"cluster.mpi_flag: --mpi={WHEEL_PMI} (srun hands the tasks no "
     f"PMI, so each is its own MPI world)"),
    (r"value not properly terminated|PMI2?_\w+ (failed|error)|pmi2?: .*(error|fail)",
     "PMI start-up failed: pick mpich's OFI netmod in cluster.setup ("
     + "; ".join(OFI_SETUP) + "), or another cluster.mpi_flag"),
    (r"UCX\s+(ERROR|WARN)|ucp_\w+", "mpich's UCX netmod failed: cluster.setup: "
     + "; ".join(OFI_SETUP)),
    (r"DUE TO TIME LIMIT|TIMEOUT", "the job hung until its time limit (MPI or rendezvous "
     "start-up): cluster.setup: " + "; ".join(OFI_SETUP)),
    (r"No module named", "the compute nodes' Python lacks a package: a venv on a shared file "
     "system, activated in cluster.setup"),
    (r"NCCL (WARN|error)|ncclInternalError|ProcessGroupNCCL", "NCCL failed: export "
     "NCCL_DEBUG=INFO (and NCCL_SOCKET_IFNAME=<nic>) in cluster.setup, rerun, read the log"),
    (r"TCPStore|Connection refused|rendezvous", "the ranks could not reach rank 0's host: "
     "export MASTER_ADDR or GLOO_SOCKET_IFNAME=<nic> in cluster.setup"),
)


def diagnose(log_text: str) -> str:
    """The fix for the first known failure sign in a check job's logs ("" if none)."""
    for pattern, fix in _LOG_SIGNS:
        if re.search(pattern, log_text):
            return fix
    return ""


def check_partition(cluster: ClusterConfig, slurm: SlurmCluster) -> Check:
    """The partition exists, is up and has the nodes the cluster file asks for."""
    try:
        part = slurm.partition(cluster.partition)
    except ConfigError as e:
        return Check("partition", Verdict.failed, str(e), "cluster.partition in the file")
    members = slurm.nodes_of(part.name)
    idle = sum(n.idle for n in members)
    text = f"{part.name}: {'up' if part.up else 'down'}, {len(members)} nodes, {idle} idle"
    if not part.up:
        return Check("partition", Verdict.failed, text, "wait for it, or cluster.partition")
    if len(members) < cluster.nodes:
        return Check("partition", Verdict.failed, text + f" < cluster.nodes={cluster.nodes}",
                     "cluster.nodes in the file")
    return Check("partition", Verdict.passed, text)


def check_pmi(mpi_flag: str, plugins: Tuple[str, ...]) -> Check:
    """srun offers the PMI of cluster.mpi_flag, and it is one the mpich wheel speaks."""
    offered = ", ".join(plugins) or "nothing"
    wanted = mpi_flag.split("=", 1)[1] if mpi_flag.startswith("--mpi=") else None
    if not wanted or wanted == "none":
        return Check("PMI (srun --mpi=list)", Verdict.failed,
                     f"cluster.mpi_flag={mpi_flag!r}: every rank would be its own MPI world",
                     f"cluster.mpi_flag: --mpi={WHEEL_PMI}")
    if wanted not in plugins:
        return Check("PMI (srun --mpi=list)", Verdict.failed,
                     f"srun lacks {wanted}; it offers {offered}",
                     f"ask the admins for Slurm's {WHEEL_PMI} plugin, or build mpi4py against "
                     f"the site's MPI (pip install --no-binary mpi4py mpi4py after `module load "
                     f"<mpi>`) and set cluster.mpi_flag to its PMI")
    if wanted != WHEEL_PMI:
        return Check("PMI (srun --mpi=list)", Verdict.warning,
                     f"srun offers {wanted} (of {offered})",
                     f"the mpich wheel speaks {WHEEL_PMI}: {mpi_flag} needs mpi4py built "
                     f"against the site's MPI")
    return Check("PMI (srun --mpi=list)", Verdict.passed, f"srun offers {wanted} ({offered})")


def check_shared_hosts(cluster: ClusterConfig, slurm: SlurmCluster) -> Check:
    """Fake nodes (several slurmd on one host) need mpich's OFI netmod: over its default UCX
    netmod the PMI2 exchange of addresses is now and then garbled and start-up hangs."""
    nodes = slurm.nodes_of(cluster.partition or slurm.partition().name)
    hosts: Dict[str, List[str]] = {}
    for n in nodes:
        hosts.setdefault(n.host, []).append(n.name)
    shared = {h: names for h, names in hosts.items() if len(names) > 1}
    if not shared:
        return Check("nodes and hosts", Verdict.passed, f"{len(nodes)} nodes on {len(hosts)} hosts")
    host, names = next(iter(shared.items()))
    text = f"{', '.join(names)} share host {host} (fake nodes)"
    if any("MPIR_CVAR_CH4_NETMOD=ofi" in line for line in cluster.setup):
        return Check("nodes and hosts", Verdict.passed, text + "; setup picks mpich's OFI netmod")
    return Check("nodes and hosts", Verdict.warning,
                 text + ": MPI start-up hangs now and then (PMI2 garbles UCX addresses)",
                 "cluster.setup (as conf/cluster/dev.yaml): " + "; ".join(OFI_SETUP)
                 + "; export FI_TCP_IFACE=lo")


def check_accounting(job_id: Optional[str]) -> Check:
    """sacct answers (for the check job when there is one)."""
    args = ["sacct", "-n", "-X", "-P", "-o", "JobID,State"] + (["-j", job_id] if job_id else [])
    try:
        out = slurm_discovery.slurm_command(*args).strip()
    except ConfigError as e:
        return Check("accounting (sacct)", Verdict.warning, str(e),
                     "none needed: job states then come from squeue (launch/slurm.py); a job "
                     "that left the queue counts as ended, how it ended only from its result "
                     "file")
    state = out.splitlines()[-1].replace("|", " ") if out else "no jobs listed"
    return Check("accounting (sacct)", Verdict.passed, f"sacct answers: {state}")


def run_check_job(cfg: Config, launch: Callable[[Config], List[dict]]) -> Tuple[List[Check],
                                                                                 Optional[str]]:
    """The check job (this stage's plan on min(init.preflight_nodes, cluster.nodes) nodes),
    launched by `launch` (the CLI's run_stages); its two rows and its job id."""
    c = cfg.cluster
    probe = dataclasses.replace(
        cfg, launcher=dataclasses.replace(cfg.launcher, name=LauncherName.slurm),
        cluster=dataclasses.replace(c, nodes=min(cfg.init.preflight_nodes, c.nodes),
                                    time_min=min(c.time_min, cfg.init.preflight_time_min),
                                    signal_delay_s=min(c.signal_delay_s, 30)))
    nodes, world = probe.cluster.nodes, probe.cluster.nodes * c.tasks_per_node
    name = f"job: MPI world of {nodes} node(s) x {c.tasks_per_node}"
    torch_name = f"job: torch.distributed ({c.backend})"
    started = time.time()
    try:
        rows = launch(probe)
    except OrchestratorError as e:
        entry = ledger_for(probe).get("init")
        if entry is None or (entry.started or 0) < started:
            entry = None  # not launched (e.g. sbatch refused it): the error says why
        logs = _job_logs(entry.job_folder if entry else None)
        fix = diagnose(f"{logs}\n{e}") or "the job's logs (in the result); cluster.setup"
        return ([Check(name, Verdict.failed, (entry.error if entry else None) or str(e), fix),
                 Check(torch_name, Verdict.failed, "not reached: the job failed before")],
                entry.job_id if entry else None)
    result, job_id = rows[-1].get("result") or {}, rows[-1].get("job_id")
    seen = f"{result.get('world_size')} ranks on {result.get('num_nodes')} node(s) (job {job_id})"
    mpi_ok = result.get("world_size") == world and result.get("num_nodes") == nodes
    checks = [Check(name, Verdict.passed if mpi_ok else Verdict.failed, seen,
                    "" if mpi_ok else "cluster.mpi_flag, cluster.tasks_per_node")]
    expected = world * (world + 1) / 2
    got = result.get("allreduce_sum")
    torch_ok = got == expected
    checks.append(Check(torch_name, Verdict.passed if torch_ok else Verdict.failed,
                        f"all_reduce over {result.get('world_size')} ranks: {got} "
                        f"(expected {expected:g})",
                        "" if torch_ok else "cluster.backend; NCCL_DEBUG=INFO in cluster.setup"))
    return checks, job_id


def _job_logs(folder: Optional[str]) -> str:
    if not folder or not Path(folder).is_dir():
        return ""
    return "\n".join(p.read_text(errors="replace")[-20000:]
                     for p in sorted(Path(folder).glob("*_log.*")))


def preflight(cfg: Config, launch: Callable[[Config], List[dict]]) -> List[Check]:
    """Every check of cfg.cluster on this Slurm cluster, in the table's order."""
    c = cfg.cluster
    try:
        slurm = slurm_discovery.discover()
    except ConfigError as e:
        return [Check("Slurm answers", Verdict.failed, str(e), "run on a login node; SLURM_CONF")]
    checks = [check_partition(c, slurm), check_pmi(c.mpi_flag, slurm.mpi_plugins),
              check_shared_hosts(c, slurm)]
    job_checks, job_id = run_check_job(cfg, launch)
    return checks + job_checks + [check_accounting(job_id)]


def print_checks(console: Console, checks: List[Check], title: str) -> None:
    """The checks as one table: check | result | what to fix."""
    colours = {Verdict.passed: "green", Verdict.warning: "yellow", Verdict.failed: "red"}
    table = Table(title=title)
    for col in ("check", "result", "what to fix"):
        table.add_column(col)
    for check in checks:
        table.add_row(escape(check.name),
                      f"[{colours[check.verdict]}]{check.verdict.value}[/]: {escape(check.result)}",
                      escape(check.fix))
    console.print(table)
