"""stage=init: a cluster file from what Slurm says, and the preflight table that checks it.

The parsers and the guess run on captured text (Slurm 22.05 and older formats); one init run on
the dev Slurm cluster (module fixture) backs the end-to-end tests.
"""
from __future__ import annotations

import json
import re

import pytest
import yaml

from conftest import ledger, run_cli
from test_slurm import all_completed, sacct, wait_for
from orchestrator.cli.init import cluster_yaml, guess_cluster, load_cluster, published_links
from orchestrator.cli.preflight import Verdict, check_pmi, check_shared_hosts, diagnose
from orchestrator.config import ClusterConfig, InitConfig
from orchestrator.errors import ConfigError
from orchestrator.launch.slurm_discovery import (SlurmCluster, parse_config_value,
                                                 parse_gres_gpus, parse_mpi_plugins,
                                                 parse_partitions, parse_records,
                                                 parse_sinfo_nodes, parse_time_min,
                                                 slurm_command)

# `sinfo -h -N -o "%N|%n|%P|%T|%c|%m|%G"` on a GPU cluster: gpu is the default partition (`*`),
# gpu003 is in two partitions, one node is down, one powered off (idle~), one untyped Gres.
SINFO_GPU = """\
gpu001|gpu001|gpu*|idle|128|1031000|gpu:h100:8(S:0-1)
gpu002|gpu002|gpu*|mixed|128|1031000|gpu:h100:8(S:0-1)
gpu003|gpu003|gpu*|idle|128|1031000|gpu:h100:8(S:0-1)
gpu003|gpu003|long|idle|128|1031000|gpu:h100:8(S:0-1)
cpu001|cpu001|cpu|idle|64|256000|(null)
cpu002|cpu002|cpu|down*|64|256000|(null)
a100n1|a100n1|a100|idle~|64|512000|gpu:8
"""
# `scontrol show partition -o` (22.05): MaxTime as D-HH:MM:SS, UNLIMITED and MM:SS.
PARTITIONS_GPU = """\
PartitionName=gpu AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A DefaultTime=01:00:00 DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED MaxTime=1-00:00:00 MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=gpu[001-003] PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=384 TotalNodes=3 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED TRES=cpu=384,mem=3093000M,node=3,billing=384,gres/gpu=24
PartitionName=long AllowGroups=ALL Default=NO DefaultTime=NONE MaxTime=7-00:00:00 Nodes=gpu003 State=UP TotalCPUs=128 TotalNodes=1
PartitionName=cpu AllowGroups=ALL Default=NO DefaultTime=NONE MaxTime=UNLIMITED Nodes=cpu[001-002] State=UP TotalCPUs=128 TotalNodes=2
PartitionName=a100 AllowGroups=ALL Default=NO DefaultTime=NONE MaxTime=30:00 Nodes=a100n1 State=DOWN TotalCPUs=64 TotalNodes=1
"""
# The dev cluster's own lines (slurm/dev-cluster.sh, Slurm 22.05.8): two fake nodes on host vm.
SINFO_DEV = "n1|vm|debug*|idle|4|4000|(null)\nn2|vm|debug*|idle|4|4000|(null)\n"
PARTITION_DEV = (
    "PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES "
    "QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO "
    "MaxNodes=UNLIMITED MaxTime=UNLIMITED MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=n[1-2] "
    "PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE "
    "PreemptMode=OFF State=UP TotalCPUs=8 TotalNodes=2 SelectTypeParameters=NONE "
    "JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED "
    "TRES=cpu=8,mem=8000M,node=2,billing=8\n")
NODE_DEV = (
    "NodeName=n1 Arch=x86_64 CoresPerSocket=4  CPUAlloc=0 CPUEfctv=4 CPUTot=4 CPULoad=2.16 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.0.1 NodeHostName=vm "
    "Port=6821 Version=22.05.8 OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0  "
    "RealMemory=4000 AllocMem=0 FreeMem=20671 Sockets=1 Boards=1 State=IDLE ThreadsPerCore=1 "
    "Partitions=debug  CfgTRES=cpu=4,mem=4000M,billing=4 AllocTRES= CapWatts=n/a\n")
MPI_LIST_22 = ("MPI plugin types are...\n\tpmix\n\tnone\n\tcray_shasta\n\tpmi2\n"
               "specific pmix plugin versions available: pmix_v4\n")
MPI_LIST_OLD = "srun: MPI types are...\nsrun: none\nsrun: pmi2\nsrun: openmpi\n"
MPI_LIST_17 = "srun: MPI types are...\nsrun: mpi/none\nsrun: mpi/pmi2\nsrun: mpi/pmix\n"
CONFIG_DEV = ("Configuration data as of 2026-11-25T16:41:46\nAccountingStorageHost   = 127.0.0.1\n"
              "ClusterName             = devcluster\nCompleteWait            = 0 sec\n")
SHEETS = {"a100": 80.0, "h100": 80.0, "h200": 141.0}
OFI = ["export MPIR_CVAR_CH4_NETMOD=ofi", "export FI_PROVIDER=tcp", "export FI_TCP_IFACE=lo"]


def _cluster(sinfo=SINFO_GPU, partitions=PARTITIONS_GPU, mpi=MPI_LIST_22, name="site"):
    return SlurmCluster(name=name, nodes=tuple(parse_sinfo_nodes(sinfo)),
                        partitions=tuple(parse_partitions(partitions)),
                        mpi_plugins=parse_mpi_plugins(mpi))


# ---------------------------------------------------------------- parsers
@pytest.mark.parametrize("text, minutes", [
    ("UNLIMITED", None), ("infinite", None), ("NONE", None), ("1-00:00:00", 1440),
    ("2-12:30:59", 3630), ("02:00:00", 120), ("30:00", 30), ("45", 45), ("1-12", 2160),
    ("3-04:05", 4565)])
def test_slurm_times_read_as_minutes(text, minutes):
    assert parse_time_min(text) == minutes


@pytest.mark.parametrize("gres, gpus", [
    ("gpu:h100:8(S:0-1)", (8, "h100")), ("gpu:8", (8, None)), ("(null)", (0, None)),
    ("gpu:a100:4,gpu:v100:2", (6, "a100")), ("gpu:tesla:2(S:0),mps:200", (2, "tesla")),
    ("gpu:nvidia_h100_80gb_hbm3:4(S:0,1)", (4, "nvidia_h100_80gb_hbm3")), ("gpu:h100", (1, "h100")),
    ("mps:100,shard:8", (0, None))])
def test_gres_gives_gpu_count_and_type(gres, gpus):
    assert parse_gres_gpus(gres) == gpus


def test_sinfo_rows_give_each_node_per_partition_with_gpus_and_state():
    nodes = parse_sinfo_nodes(SINFO_GPU)
    assert [(n.name, n.partition) for n in nodes][2:4] == [("gpu003", "gpu"), ("gpu003", "long")]
    first = nodes[0]
    assert (first.cpus, first.mem_MiB, first.gpus, first.gpu_type) == (128, 1031000, 8, "h100")
    assert [n.idle for n in nodes] == [True, False, True, True, True, False, True]  # idle~ too


def test_partition_records_give_default_max_time_and_state():
    parts = {p.name: p for p in parse_partitions(PARTITIONS_GPU + PARTITION_DEV)}
    assert [n for n, p in parts.items() if p.default] == ["gpu", "debug"]
    assert (parts["gpu"].max_time_min, parts["gpu"].default_time_min) == (1440, 60)
    assert parts["long"].max_time_min == 7 * 1440
    assert parts["cpu"].max_time_min is None and parts["debug"].max_time_min is None
    assert (parts["a100"].max_time_min, parts["a100"].up) == (30, False)
    assert parts["gpu"].total_nodes == 3


def test_scontrol_records_keep_values_with_spaces_and_equals_signs():
    (node,) = parse_records(NODE_DEV)
    assert node["OS"] == "Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0"
    assert node["CfgTRES"] == "cpu=4,mem=4000M,billing=4"
    assert (node["AllocTRES"], node["Partitions"], node["NodeHostName"]) == ("", "debug", "vm")


@pytest.mark.parametrize("text, plugins", [
    (MPI_LIST_22, ("pmix", "none", "cray_shasta", "pmi2")),
    (MPI_LIST_OLD, ("none", "pmi2", "openmpi")), (MPI_LIST_17, ("none", "pmi2", "pmix"))])
def test_srun_mpi_list_in_old_and_new_formats(text, plugins):
    assert parse_mpi_plugins(text) == plugins


def test_missing_slurm_commands_say_to_run_on_a_login_node(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError, match="sinfo not found on PATH: .* run it on a login node"):
        slurm_command("sinfo", "-h")


def test_cluster_name_comes_from_scontrol_show_config():
    assert parse_config_value(CONFIG_DEV, "ClusterName") == "devcluster"
    assert parse_config_value(CONFIG_DEV, "SlurmctldHost") is None


# ---------------------------------------------------------------- the guess
def test_gpu_cluster_gets_one_nccl_rank_per_gpu_and_the_sheets_memory():
    guess = guess_cluster(_cluster(), InitConfig(), "site", SHEETS, published_links("h100"))
    c = guess.cluster
    assert (c.partition, c.nodes, c.tasks_per_node, c.gpus_per_node) == ("gpu", 2, 8, 8)
    assert (c.backend, c.cpus_per_task, c.device_mem_GiB) == ("nccl", 16, 80.0)
    assert (c.time_min, c.mpi_flag) == (60, "--mpi=pmi2")  # MaxTime 1 day, capped at 60 min
    assert c.links.nic_Gbps == 400.0 and "dgx_h100.yaml" in guess.notes["links"]
    assert "GUESSED" in guess.notes["device_mem_GiB"]


def test_cpu_partition_gets_gloo_ranks_and_memory_per_rank():
    init = InitConfig(partition="cpu", max_time_min=120)
    c = guess_cluster(_cluster(), init, "site", SHEETS).cluster
    assert (c.nodes, c.tasks_per_node, c.gpus_per_node, c.backend) == (1, 4, 0, "gloo")
    assert c.device_mem_GiB == pytest.approx(62.5, abs=0.1)  # 250 GiB over 4 ranks
    assert c.time_min == 120  # MaxTime UNLIMITED: init.max_time_min


def test_gpu_memory_comes_from_the_type_name_else_asks_for_it():
    c = guess_cluster(_cluster(), InitConfig(partition="a100"), "site", SHEETS)
    assert c.cluster.device_mem_GiB == 0 and "FILL IN" in c.notes["device_mem_GiB"]
    typed = SINFO_DEV.replace("(null)", "gpu:nvidia_a100_40gb:4")
    c = guess_cluster(_cluster(typed, PARTITION_DEV), InitConfig(), "site", SHEETS).cluster
    assert (c.device_mem_GiB, c.tasks_per_node, c.backend) == (40.0, 4, "nccl")


@pytest.mark.parametrize("init, message", [
    (InitConfig(partition="gpux"), "no such partition; it has: gpu (default), long, cpu, a100"),
    (InitConfig(nodes=4), "init.nodes=4: partition gpu has 3 node(s)"),
    (InitConfig(tasks_per_node=16), "init.tasks_per_node=16: a node of partition gpu has 8 GPUs")])
def test_choices_the_cluster_cannot_meet_are_refused(init, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        guess_cluster(_cluster(), init, "site", SHEETS)


def test_written_file_loads_back_as_cluster_name(tmp_path, monkeypatch):
    """The commented YAML composes through Hydra's cluster group (site folder first) into the
    same values, comments and all."""
    guess = guess_cluster(_cluster(), InitConfig(account="ml", setup=OFI[:1]), "site",
                          SHEETS, published_links("h100"))
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "site.yaml").write_text(cluster_yaml(guess, "a test"))
    monkeypatch.setenv("ORCHESTRATOR_CONF", str(tmp_path))
    assert load_cluster("site") == guess.cluster
    assert isinstance(load_cluster("site"), ClusterConfig)


def test_force_keeps_a_cluster_file_init_did_not_write_or_that_was_edited(tmp_path,
                                                                         monkeypatch):
    """force=true rewrites the cluster file; the site folder is the user's, so a file init did
    not write, or one edited since, is kept beside it (store/user_folder), never lost."""
    from orchestrator.cli.init import write_cluster_file

    monkeypatch.setenv("ORCHESTRATOR_CONF", str(tmp_path))
    path = tmp_path / "cluster" / "site.yaml"
    path.parent.mkdir()
    path.write_text("# my own\nname: site\npartition: gpu\n")
    written, cluster, kept = write_cluster_file(InitConfig(), _cluster(), force=True)
    assert written == path and cluster.partition == "gpu" and "GUESSED" in path.read_text()
    assert [(k.copy.read_text(), k.why) for k in kept] == [
        ("# my own\nname: site\npartition: gpu\n", "not written by the orchestrator")]
    assert kept[0].copy.name.startswith("site.yaml.orig-")  # not a cluster= choice
    assert write_cluster_file(InitConfig(), _cluster(), force=True)[2] == []  # init's own
    path.write_text(path.read_text() + "setup: [module load mpi]\n")
    (kept,) = write_cluster_file(InitConfig(), _cluster(), force=True)[2]
    assert kept.why == "changed since the orchestrator wrote it"
    assert "module load mpi" in kept.copy.read_text() and "module load mpi" not in path.read_text()


# ---------------------------------------------------------------- preflight rows (pure)
def test_pmi_check_wants_the_flags_plugin_in_srun_list():
    assert check_pmi("--mpi=pmi2", ("pmix", "pmi2")).verdict == Verdict.passed
    missing = check_pmi("--mpi=pmi2", ("none", "pmix"))
    assert missing.verdict == Verdict.failed and "offers none, pmix" in missing.result
    assert check_pmi("--mpi=pmix", ("pmix", "pmi2")).verdict == Verdict.warning
    assert check_pmi("", ("pmi2",)).verdict == Verdict.failed


def test_fake_nodes_on_one_host_want_the_ofi_setup_lines():
    dev = _cluster(SINFO_DEV, PARTITION_DEV)
    bare = check_shared_hosts(ClusterConfig(partition="debug"), dev)
    assert bare.verdict == Verdict.warning and "MPIR_CVAR_CH4_NETMOD=ofi" in bare.fix
    ofi = check_shared_hosts(ClusterConfig(partition="debug", setup=OFI), dev)
    assert ofi.verdict == Verdict.passed
    real = check_shared_hosts(ClusterConfig(partition="gpu"), _cluster())
    assert (real.verdict, real.result) == (Verdict.passed, "3 nodes on 3 hosts")


@pytest.mark.parametrize("log, fix", [
    ("mpi/pmi2: value not properly terminated in client request", "MPIR_CVAR_CH4_NETMOD=ofi"),
    ("slurmstepd: error: *** JOB 9 ON n1 CANCELLED DUE TO TIME LIMIT ***", "time limit"),
    ("MPI sees COMM_WORLD.size == 1 but Slurm started 4 tasks", "cluster.mpi_flag: --mpi=pmi2"),
    ("ModuleNotFoundError: No module named 'mpi4py'", "venv"), ("all fine", "")])
def test_known_failures_in_the_job_logs_name_their_fix(log, fix):
    assert fix in diagnose(log) if fix else diagnose(log) == ""


# ---------------------------------------------------------------- on the dev Slurm cluster
SLURM = ["launcher.poll_s=0.5"]
QUICK_CHAIN = ["profile_hardware.max_size_bytes=65536", "profile_hardware.max_time_s=0.05",
               "profile_hardware.size_step=16",
               "profile_hardware.benchmarks=[inventory,allreduce,p2p,reduce_scatter,all_gather,"
               "overlap]", "profile_model.seq_lens=[64,128]", "profile_model.max_tp=2",
               "search.max_tp=2", "train.steps=2", "train.plot=false"]


@pytest.fixture(scope="module")
def written(slurm_cluster, tmp_path_factory):
    """One `stage=init` in a fresh folder (no conf/ yet): 2 nodes of partition debug, one rank
    each (a quick check job), with dev.yaml's setup lines, which init cannot discover."""
    folder = tmp_path_factory.mktemp("site")
    setup = "init.setup=[" + ",".join(f'"{line}"' for line in OFI) + "]"
    proc = run_cli("stage=init", "init.nodes=2", "init.tasks_per_node=1", setup, *SLURM,
                   profiles_dir=folder / "profiles", cwd=folder, check=0)
    return folder, proc


def test_init_writes_the_dev_cluster_and_every_check_passes(written):
    folder, proc = written
    path = folder / "conf" / "cluster" / "devcluster.yaml"  # Slurm's ClusterName
    cluster = yaml.safe_load(path.read_text())
    assert {k: cluster[k] for k in ("name", "partition", "nodes", "backend", "mpi_flag")} == {
        "name": "devcluster", "partition": "debug", "nodes": 2, "backend": "gloo",
        "mpi_flag": "--mpi=pmi2"}
    assert cluster["setup"] == OFI and "GUESSED" in path.read_text()
    rows = re.findall(r"│ (.+?)\s+│ (pass|warn|FAIL): ", proc.stdout)
    assert len(rows) == 6 and {verdict for _, verdict in rows} == {"pass"}, proc.stdout
    assert ledger(folder / "profiles", "devcluster")["init"]["state"] == "done"


def test_all_runs_on_slurm_with_the_written_cluster_as_an_afterok_chain(written):
    """The first hour's end: `stage=all launcher=slurm cluster=<name>` from the folder init
    wrote to, with nothing else there. One job per stage, each held until the last ended well
    (afterok); a rerun finds every stage done and submits nothing."""
    folder, _ = written
    profiles = folder / "profiles"
    args = ["stage=all", "launcher=slurm", "cluster=devcluster", *SLURM, *QUICK_CHAIN]
    proc = run_cli(*args, "wait=false", profiles_dir=profiles, cwd=folder, check=0)
    job_ids = re.findall(r"submitted Slurm job (\d+)", proc.stdout)
    assert len(job_ids) == 4, proc.stdout  # profile_hardware, profile_model, search, train
    wait_for(lambda: all_completed(job_ids, profiles / "devcluster"), timeout_s=600, every_s=2,
             what="the four jobs to complete")
    for before, after in zip(job_ids, job_ids[1:]):  # afterok: each started after the last ended
        assert sacct(after, "Start")[0] >= sacct(before, "End")[0]
        script = next((profiles / "devcluster" / "runs").glob(f"*/*/submitit/{after}_submission.sh"))
        assert f"#SBATCH --dependency=afterok:{before}" in script.read_text()
    run_cli("stage=status", "cluster=devcluster", profiles_dir=profiles, cwd=folder, check=0)
    entries = ledger(profiles, "devcluster")
    assert [entries[k]["state"] for k in ("profile_hardware", "profile_model/tiny", "search/tiny",
                                          "train/tiny")] == ["done"] * 4
    strategy = json.loads((profiles / "devcluster" / "strategy" / "tiny.json").read_text())
    assert strategy["layout"]["world_size"] == 2  # the written file's 2 nodes x 1 task
    # The chain recorded the hashes a later plan computes: nothing runs again.
    proc = run_cli(*args, profiles_dir=profiles, cwd=folder, check=0)
    assert proc.stdout.count("skipping (force=true redoes it)") == 4, proc.stdout


def test_init_refuses_to_overwrite_the_file_without_force(written):
    folder, _ = written
    proc = run_cli("stage=init", profiles_dir=folder / "profiles", cwd=folder, check=2)
    assert proc.stderr.count("\n") == 1 and "devcluster.yaml exists; force=true" in proc.stderr


def test_preflight_fails_with_the_fix_when_srun_gives_no_pmi(written):
    folder, _ = written
    proc = run_cli("stage=init", "init.preflight_only=true", "cluster=devcluster",
                   'cluster.mpi_flag="--mpi=none"', *SLURM, profiles_dir=folder / "profiles",
                   cwd=folder, check=5)
    assert "FAIL: cluster.mpi_flag='--mpi=none'" in proc.stdout  # the PMI row
    assert "COMM_WORLD.size" in proc.stdout and "--mpi=pmi2" in proc.stdout  # the job's, its fix
    assert "preflight: 3 check(s) failed" in proc.stderr
