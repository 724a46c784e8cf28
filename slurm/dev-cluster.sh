#!/usr/bin/env bash
# A real Slurm cluster on one host, for development and CI: munge, MariaDB + slurmdbd (so `sacct`
# and submitit see every job), slurmctld, and two fake nodes n1 and n2 (two slurmd on this host,
# 4 CPUs each whatever the host has). MPI across the nodes works with `srun --mpi=pmi2`.
#
#   slurm/dev-cluster.sh start     install missing Debian packages, start what is not running,
#                                  wait until both nodes are idle and sacct answers (root)
#   slurm/dev-cluster.sh stop      cancel jobs, stop the daemons this script started (root)
#   slurm/dev-cluster.sh restart   stop, then start (root)
#   slurm/dev-cluster.sh status    daemons and nodes; exit 0 if the cluster is up, 1 if not
#   slurm/dev-cluster.sh env       prints `export SLURM_CONF=...`: eval "$(slurm/dev-cluster.sh env)"
#
# Everything (config, state, logs, database) lives under ${ORCH_SLURM_PREFIX:-/tmp/orchestrator-slurm};
# delete that folder (after `stop`) for a fresh cluster; job ids then restart at 1.
# Knobs: ORCH_SLURM_PORT_BASE (6817: slurmctld, +2 slurmdbd, +3 MariaDB, +4/+5 the nodes),
# ORCH_SLURM_NODE_CPUS (4), ORCH_SLURM_NODE_MEM_MiB (4000), ORCH_SLURM_TIMEOUT_S (60, per wait).
set -euo pipefail

PREFIX=${ORCH_SLURM_PREFIX:-/tmp/orchestrator-slurm}
TEMPLATE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export SLURM_CONF=$PREFIX/etc/slurm.conf
PORT_BASE=${ORCH_SLURM_PORT_BASE:-6817}
# MariaDB is not on 3306, where a distro MariaDB started by a package postinst may sit.
# shellcheck disable=SC2034  # these reach the templates through render
CTLD_PORT=$PORT_BASE DBD_PORT=$((PORT_BASE + 2)) DB_PORT=$((PORT_BASE + 3)) \
  N1_PORT=$((PORT_BASE + 4)) N2_PORT=$((PORT_BASE + 5)) \
  NODE_CPUS=${ORCH_SLURM_NODE_CPUS:-4} NODE_MEM_MiB=${ORCH_SLURM_NODE_MEM_MiB:-4000}
TIMEOUT_S=${ORCH_SLURM_TIMEOUT_S:-60}
HOST=$(hostname -s 2>/dev/null || uname -n)
HOST=${HOST%%.*}
NODES=(n1 n2)
CLUSTER=devcluster   # must match ClusterName in slurm.conf.in
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server mariadb-client)

RUN=$PREFIX/run
LOG=$PREFIX/log
DB_DIR=$PREFIX/mariadb
DB_SOCKET=$DB_DIR/mariadbd.sock
DB_PIDFILE=$DB_DIR/mariadbd.pid
MUNGE_PIDFILE=/run/munge/munged.pid
# munged is system-wide (one socket in /run/munge); this file marks the one this script started.
MUNGE_OURS=$RUN/munged.started-here

# Microseconds since the epoch (EPOCHREALTIME's decimal point follows the locale).
now_us() { echo "${EPOCHREALTIME//[!0-9]/}"; }
T0_us=$(now_us)
log() {
  local tenths=$((($(now_us) - T0_us) / 100000))
  printf '[dev-cluster %4d.%ds] %s\n' $((tenths / 10)) $((tenths % 10)) "$*" >&2
}

# Prints the last lines of the named log files, then exits 1.
die() {
  echo "dev-cluster: ERROR: $1" >&2
  shift
  local f
  for f in "$@"; do
    [[ -s $f ]] || continue
    echo "---- last lines of $f ----" >&2
    tail -n 25 "$f" >&2
  done
  exit 1
}

need_root() {
  [[ $EUID -eq 0 ]] || die "'$1' must run as root (it starts system daemons): sudo $0 $1"
}

# True if process $1 runs. A zombie does not: in containers PID 1 may reap late or never.
alive() {
  local stat=""
  # `read` and not $(<file): under set -e a failed $(<file) ends the script even after `||`.
  { read -r stat <"/proc/$1/stat"; } 2>/dev/null || [[ -n $stat ]] || return 1
  stat=${stat##*) }
  [[ ${stat:0:1} != Z ]]
}

# Prints the pid recorded in pidfile $1 if that process runs and is the program $2
# (a stale pid file after a crash may name a recycled pid).
live_pid() {
  local pid="" comm=""
  { read -r pid <"$1"; } 2>/dev/null || [[ -n $pid ]] || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  { read -r comm <"/proc/$pid/comm"; } 2>/dev/null || return 1
  [[ $comm == "$2" ]] && alive "$pid" || return 1
  echo "$pid"
}

# wait_for SECONDS WHAT COMMAND...: polls COMMAND every 0.2 s; false after SECONDS.
wait_for() {
  local deadline_s=$1 deadline_us=$(($(now_us) + $1 * 1000000)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    if (($(now_us) > deadline_us)); then
      echo "dev-cluster: timed out after ${deadline_s}s waiting for $what" >&2
      return 1
    fi
    sleep 0.2
  done
}

# Starts a daemon with no terminal, no inherited lock fd, and its early stderr in a log file:
# CI steps and subprocess pipes must not stay open because a daemon holds them.
spawn() {
  local out=$1
  shift
  setsid "$@" </dev/null >>"$out" 2>&1 9>&- &
}

install_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
  done
  ((${#missing[@]} == 0)) && return 0
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Keep package postinst scripts from starting distro daemons: this script starts its own.
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
  fi
  local rc=0
  {
    apt-get update -qq &&
      apt-get install -y -qq --no-install-recommends -o Dpkg::Options::=--force-confold "${missing[@]}"
  } </dev/null >"$LOG/apt.log" 2>&1 || rc=$?
  ((made_policy)) && rm -f "$policy"
  ((rc == 0)) || die "apt-get install ${missing[*]} failed (exit $rc)" "$LOG/apt.log"
  log "packages installed"
}

# Writes $2 from template $1, filling the ${NAME} placeholders. Prints "changed" if that differs
# from the file already there, and then keeps the old file if $3 is "keep".
render() {
  local template=$1 out=$2 tmp name
  tmp=$(mktemp "$out.XXXXXX")
  local names=(PREFIX HOST CTLD_PORT DBD_PORT DB_PORT N1_PORT N2_PORT NODE_CPUS NODE_MEM_MiB DB_PASSWORD)
  if command -v envsubst >/dev/null; then
    local shell_format=""
    for name in "${names[@]}"; do shell_format+="\${$name}"; done
    (for name in "${names[@]}"; do export "${name?}"; done; envsubst "$shell_format" <"$template" >"$tmp")
  else
    local sed_args=()
    for name in "${names[@]}"; do sed_args+=(-e "s|\${$name}|${!name}|g"); done
    sed "${sed_args[@]}" "$template" >"$tmp"
  fi
  # shellcheck disable=SC2016  # a literal ${NAME} left in the output
  if grep -q '\${[A-Za-z_]*}' "$tmp"; then
    local unfilled
    # shellcheck disable=SC2016
    unfilled=$(grep -o '\${[A-Za-z_]*}' "$tmp" | sort -u | tr '\n' ' ')
    rm -f "$tmp"
    die "$template has placeholders this script does not fill: $unfilled"
  fi
  if [[ ! -f $out ]]; then
    mv -f "$tmp" "$out"
  elif cmp -s "$tmp" "$out"; then
    rm -f "$tmp"
  else
    echo changed
    if [[ ${3:-} == keep ]]; then rm -f "$tmp"; else mv -f "$tmp" "$out"; fi
  fi
}

write_config() {
  local db_password_file=$PREFIX/etc/db-password
  if [[ ! -s $db_password_file ]]; then
    (umask 077 && head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$db_password_file")
  fi
  DB_PASSWORD=$(<"$db_password_file")
  # Clients read slurm.conf too: while the daemons run, the file must stay what they run with.
  local mode=replace changed=""
  live_pid "$RUN/slurmctld.pid" slurmctld >/dev/null && mode=keep
  changed+=$(render "$TEMPLATE_DIR/slurm.conf.in" "$SLURM_CONF" $mode)
  changed+=$(render "$TEMPLATE_DIR/slurmdbd.conf.in" "$PREFIX/etc/slurmdbd.conf" $mode)
  chmod 644 "$SLURM_CONF"
  chmod 600 "$PREFIX/etc/slurmdbd.conf"   # slurmdbd refuses a config others can read
  if [[ -n $changed && $mode == keep ]]; then
    log "WARNING: the templates or settings changed but the cluster runs with the old config;" \
      "'$0 restart' (with the same settings) applies them"
  fi
}

munge_works() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  # With a socket left by a dead munged, the munge client retries for seconds: look at the pid first.
  if { live_pid "$MUNGE_PIDFILE" munged >/dev/null || [[ ! -e $MUNGE_PIDFILE && -S /run/munge/munge.socket.2 ]]; } &&
    munge_works; then
    log "munged already running"
    return 0
  fi
  local key=/etc/munge/munge.key
  mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
  if [[ ! -s $key ]]; then
    mungekey --create --keyfile="$key" 2>/dev/null || head -c 1024 /dev/urandom >"$key"
    log "created munge key $key"
  fi
  chown munge:munge /etc/munge "$key" /run/munge /var/lib/munge /var/log/munge
  chmod 0400 "$key"
  chmod 0700 /etc/munge /var/lib/munge /var/log/munge
  chmod 0755 /run/munge
  rm -f "$MUNGE_PIDFILE"
  runuser -u munge -- /usr/sbin/munged </dev/null >>"$LOG/munged.out" 2>&1 9>&- ||
    die "munged failed to start" "$LOG/munged.out" /var/log/munge/munged.log
  wait_for "$TIMEOUT_S" "munged" munge_works || die "munged does not answer" /var/log/munge/munged.log
  live_pid "$MUNGE_PIDFILE" munged >"$MUNGE_OURS" || true
  log "munged started"
}

db() { mariadb --no-defaults --socket="$DB_SOCKET" --user=root "$@"; }

start_mariadb() {
  if live_pid "$DB_PIDFILE" mariadbd >/dev/null && db -e 'select 1' >/dev/null 2>&1; then
    log "MariaDB already running"
  else
    if [[ ! -d $DB_DIR/data/mysql ]]; then
      rm -rf "$DB_DIR/data"
      mariadb-install-db --no-defaults --user=root --datadir="$DB_DIR/data" --skip-test-db \
        --auth-root-authentication-method=socket </dev/null >"$LOG/mariadb-install.log" 2>&1 ||
        die "mariadb-install-db failed" "$LOG/mariadb-install.log"
      log "MariaDB data directory created"
    fi
    rm -f "$DB_SOCKET" "$DB_PIDFILE"
    # Durability is not worth the fsyncs here: the database only holds dev-cluster job records.
    spawn "$LOG/mariadb.out" /usr/sbin/mariadbd --no-defaults --user=root --datadir="$DB_DIR/data" \
      --socket="$DB_SOCKET" --pid-file="$DB_PIDFILE" --bind-address=127.0.0.1 --port="$DB_PORT" \
      --log-error="$LOG/mariadb.log" --skip-log-bin --innodb-buffer-pool-size=64M \
      --innodb-log-file-size=16M --innodb-flush-log-at-trx-commit=0 --innodb-doublewrite=0 \
      --sync-binlog=0 --skip-name-resolve
    wait_for "$TIMEOUT_S" "MariaDB" db -e 'select 1' ||
      die "MariaDB did not start" "$LOG/mariadb.log" "$LOG/mariadb.out"
    log "MariaDB started on 127.0.0.1:$DB_PORT"
  fi
  db -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASSWORD';
         ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASSWORD';
         GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" ||
    die "could not create the slurm database user" "$LOG/mariadb.log"
}

cluster_registered() { sacctmgr -n -P show cluster "$CLUSTER" format=cluster | grep -qx "$CLUSTER"; }

start_slurmdbd() {
  if live_pid "$RUN/slurmdbd.pid" slurmdbd >/dev/null; then
    log "slurmdbd already running"
  else
    rm -f "$RUN/slurmdbd.pid"
    spawn "$LOG/slurmdbd.out" /usr/sbin/slurmdbd
    wait_for "$TIMEOUT_S" "slurmdbd" sacctmgr -n show cluster ||
      die "slurmdbd does not answer sacctmgr" "$LOG/slurmdbd.log" "$LOG/slurmdbd.out"
    log "slurmdbd started"
  fi
  if ! cluster_registered; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster $CLUSTER failed" "$LOG/slurmdbd.log"
  fi
}

start_slurmctld() {
  if live_pid "$RUN/slurmctld.pid" slurmctld >/dev/null; then
    log "slurmctld already running"
    return 0
  fi
  rm -f "$RUN/slurmctld.pid"
  spawn "$LOG/slurmctld.out" /usr/sbin/slurmctld
  wait_for "$TIMEOUT_S" "slurmctld" scontrol ping ||
    die "slurmctld does not answer scontrol ping" "$LOG/slurmctld.log" "$LOG/slurmctld.out"
  log "slurmctld started"
}

start_slurmd() {
  local node
  for node in "${NODES[@]}"; do
    mkdir -p "$PREFIX/spool/slurmd-$node"
    if live_pid "$RUN/slurmd-$node.pid" slurmd >/dev/null; then
      log "slurmd $node already running"
      continue
    fi
    rm -f "$RUN/slurmd-$node.pid"
    spawn "$LOG/slurmd-$node.out" /usr/sbin/slurmd -N "$node"
    log "slurmd $node started"
  done
}

# True when every node answers and can take jobs.
nodes_up() {
  local usable
  usable=$(sinfo -h -N -p debug -o '%N %T' | grep -cE ' (idle|mixed|allocated|completing)$') || return 1
  ((usable == ${#NODES[@]}))
}

# Like nodes_up, and resumes the nodes a previous run left down or drained (say, after a crash).
nodes_up_or_resume() {
  nodes_up && return 0
  local node state
  while read -r node state; do
    case $state in
      down | drained | draining | drain | fail | failing)
        scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 && log "resumed $node (was $state)" ;;
    esac
  done < <(sinfo -h -N -p debug -o '%N %T' 2>/dev/null)
  return 1
}

# sacct answers and slurmctld has reported to slurmdbd (else finished jobs would not show yet).
accounting_up() {
  sacct -n -X -S now-1minutes -o JobID >/dev/null &&
    [[ -n $(sacctmgr -n -P show cluster "$CLUSTER" format=ControlHost) ]]
}

cmd_start() {
  need_root start
  [[ $PREFIX != *[[:space:]]* ]] || die "ORCH_SLURM_PREFIX must not contain spaces: '$PREFIX'"
  mkdir -p "$PREFIX/etc" "$PREFIX/state" "$PREFIX/spool" "$RUN" "$LOG" "$DB_DIR"
  # Two starts at once (two shells, two CI steps) would race on pid files: take turns.
  exec 9>"$PREFIX/dev-cluster.lock"
  flock -w $((4 * TIMEOUT_S)) 9 || die "another '$0' holds $PREFIX/dev-cluster.lock"
  log "starting the dev cluster in $PREFIX"
  install_packages
  write_config
  start_munge
  start_mariadb
  start_slurmdbd
  start_slurmctld
  start_slurmd
  wait_for "$TIMEOUT_S" "nodes ${NODES[*]} to be idle" nodes_up_or_resume ||
    die "nodes are not up: $(sinfo -h -N -o '%N=%T' 2>&1 | tr '\n' ' ')" \
      "$LOG/slurmctld.log" "$LOG/slurmd-n1.log" "$LOG/slurmd-n2.log"
  wait_for "$TIMEOUT_S" "accounting (sacct)" accounting_up ||
    die "sacct does not work" "$LOG/slurmdbd.log" "$LOG/slurmctld.log"
  sinfo -N -o '%N %P %T %c %m' >&2
  log "cluster up: nodes ${NODES[*]} idle, sacct works"
  echo "export SLURM_CONF=$SLURM_CONF"
}

no_jobs() { [[ -z $(squeue -h -o %A) ]]; }

not_alive() { ! alive "$1"; }

# stop_daemons PIDFILE:PROGRAM...: TERM to each live one, then KILL to those alive after 10 s.
stop_daemons() {
  local spec pidfile comm pid pids=() names=() i
  for spec in "$@"; do
    pidfile=${spec%:*} comm=${spec##*:}
    if pid=$(live_pid "$pidfile" "$comm"); then
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid") names+=("$comm")
    fi
    rm -f "$pidfile"
  done
  for i in "${!pids[@]}"; do
    pid=${pids[i]}
    wait_for 10 "${names[i]} (pid $pid) to exit" not_alive "$pid" || true
    if alive "$pid"; then
      kill -KILL "$pid" 2>/dev/null || true
      log "stopped ${names[i]} (pid $pid) with KILL"
    else
      log "stopped ${names[i]} (pid $pid)"
    fi
  done
}

cmd_stop() {
  need_root stop
  if [[ ! -d $PREFIX ]]; then
    log "nothing to stop: $PREFIX does not exist"
    return 0
  fi
  exec 9>"$PREFIX/dev-cluster.lock"
  flock -w $((4 * TIMEOUT_S)) 9 || die "another '$0' holds $PREFIX/dev-cluster.lock"
  # Jobs' slurmstepd processes outlive slurmd; cancel them so no user process is left orphaned.
  if live_pid "$RUN/slurmctld.pid" slurmctld >/dev/null; then
    local jobs
    jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ') || true
    if [[ -n ${jobs// /} ]]; then
      log "cancelling jobs $jobs"
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      wait_for 15 "jobs to end" no_jobs || true
    fi
  fi
  local node slurmds=()
  for node in "${NODES[@]}"; do slurmds+=("$RUN/slurmd-$node.pid:slurmd"); done
  stop_daemons "${slurmds[@]}"
  stop_daemons "$RUN/slurmctld.pid:slurmctld"
  stop_daemons "$RUN/slurmdbd.pid:slurmdbd"
  local last=("$DB_PIDFILE:mariadbd")
  # Only a munged this script started; one that was already there belongs to someone else.
  if [[ -s $MUNGE_OURS ]] && [[ $(live_pid "$MUNGE_PIDFILE" munged || true) == "$(<"$MUNGE_OURS")" ]]; then
    last+=("$MUNGE_PIDFILE:munged")
  fi
  stop_daemons "${last[@]}"
  rm -f "$MUNGE_OURS"
  log "dev cluster stopped (state kept in $PREFIX)"
}

cmd_status() {
  local up=0 pid label pidfile comm
  while read -r label pidfile comm; do
    if pid=$(live_pid "$pidfile" "$comm"); then
      printf '%-10s pid %s\n' "$label" "$pid"
    elif [[ -e $pidfile && ! -r $pidfile ]]; then
      printf '%-10s unknown (%s is for root only)\n' "$label" "$pidfile"
    else
      printf '%-10s not running\n' "$label"
      up=1
    fi
  done <<DAEMONS
slurmd-n1 $RUN/slurmd-n1.pid slurmd
slurmd-n2 $RUN/slurmd-n2.pid slurmd
slurmctld $RUN/slurmctld.pid slurmctld
slurmdbd $RUN/slurmdbd.pid slurmdbd
mariadbd $DB_PIDFILE mariadbd
DAEMONS
  if munge_works; then echo "munged     answers"; else echo "munged     does not answer"; up=1; fi
  if [[ -f $SLURM_CONF ]] && sinfo -N -o '%N %P %T %c %m' 2>/dev/null; then
    nodes_up 2>/dev/null || up=1
    if accounting_up 2>/dev/null; then echo "sacct      works"; else echo "sacct      does not work"; up=1; fi
  else
    echo "sinfo: no answer from slurmctld"
    up=1
  fi
  if ((up == 0)); then echo "dev cluster is up: export SLURM_CONF=$SLURM_CONF"; else echo "dev cluster is NOT up"; fi
  return $up
}

case ${1:-} in
  start) cmd_start ;;
  stop) cmd_stop ;;
  restart) cmd_stop && cmd_start ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$SLURM_CONF" ;;
  *)
    echo "usage: $0 start|stop|restart|status|env" >&2
    exit 2
    ;;
esac
