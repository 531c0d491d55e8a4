#!/usr/bin/env bash
# A one-node Slurm cluster in a directory, for tests and for trying ditrun's Slurm path on a
# laptop. It installs nothing (the Makefile's install step does: slurm-wlm munge libpmix2) and
# needs no systemd: munged, slurmctld and slurmd run from DIR with their own ports and keys, so
# several clusters (one per test session) can run on one machine side by side.
#
#   slurm/local-cluster.sh start DIR [CPUS]   start it; prints the line to export SLURM_CONF
#   slurm/local-cluster.sh stop DIR           stop its daemons by PID and wait until they are gone
#
# CPUS (default 8) is what the node declares: more than the real cores, so that 4-task jobs run
# on a 2-core machine (SlurmdParameters=config_overrides lets slurmd believe the config). Jobs
# start at once (batch_sched_delay=0, a scheduling pass every second), and a requeued job is held
# cred_expire + 1 = 6 s instead of Slurm's default 121 s.
set -euo pipefail

die() { echo "local-cluster: $*" >&2; exit 1; }

usage() { die "usage: $0 start DIR [CPUS] | stop DIR"; }

need_binaries() {
    local missing=()
    for bin in munged slurmctld slurmd sbatch sinfo; do
        command -v "$bin" >/dev/null || missing+=("$bin")
    done
    [ ${#missing[@]} -eq 0 ] || die "missing ${missing[*]}: install Debian's slurm-wlm munge libpmix2 (make install does, as root)"
}

# Free TCP ports for slurmctld and slurmd, so this cluster does not clash with another one.
free_ports() {
    python3 - <<'PY'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

write_config() {
    local dir=$1 cpus=$2 ctld_port=$3 slurmd_port=$4 node
    node=$(hostname -s)
    cat >"$dir/slurm.conf" <<CONF
ClusterName=ditrun-local
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=$(id -un)
SlurmdUser=$(id -un)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge.sock,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
SlurmdParameters=config_overrides
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait=5
MinJobAge=300
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
}

start() {
    local dir=$1 cpus=${2:-8} ports
    need_binaries
    mkdir -p "$dir/state" "$dir/spool"
    dir=$(cd "$dir" && pwd)
    chmod 700 "$dir"
    # munged refuses keys readable by others; --force accepts the temp dir's ownership.
    [ -f "$dir/munge.key" ] || { dd if=/dev/urandom of="$dir/munge.key" bs=1024 count=1 status=none; chmod 400 "$dir/munge.key"; }
    munged --force --socket="$dir/munge.sock" --key-file="$dir/munge.key" --pid-file="$dir/munged.pid" \
        --log-file="$dir/munged.log" --seed-file="$dir/munged.seed"
    read -r ctld_port slurmd_port < <(free_ports)
    write_config "$dir" "$cpus" "$ctld_port" "$slurmd_port"
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$SLURM_CONF" -i
    slurmd -f "$SLURM_CONF"
    wait_idle "$dir"
    echo "export SLURM_CONF=$SLURM_CONF"
}

# The node is usable once sinfo reports it idle.
wait_idle() {
    local dir=$1 state
    for _ in $(seq 100); do
        state=$(sinfo -h -o %T 2>/dev/null || true)
        [ "$state" = idle ] && return 0
        sleep 0.1
    done
    die "the node is not idle after 10 s (state '${state:-none}'); see $dir/slurmctld.log and $dir/slurmd.log"
}

stop() {
    local dir=$1 pid
    for daemon in slurmd slurmctld munged; do
        [ -f "$dir/$daemon.pid" ] || continue
        pid=$(cat "$dir/$daemon.pid")
        kill "$pid" 2>/dev/null || continue
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
    done
}

case "${1:-}" in
    start) [ $# -ge 2 ] || usage; start "$2" "${3:-8}" ;;
    stop) [ $# -eq 2 ] || usage; stop "$2" ;;
    *) usage ;;
esac
