#!/usr/bin/env bash
# A Slurm cluster of one or more nodes in a directory, for tests and for trying ditrun's Slurm path
# on a laptop. It installs nothing (the Makefile's install step does: slurm-wlm munge libpmix2) and
# needs no systemd: munged, slurmctld and slurmd run from DIR with their own ports and keys, so
# several clusters (one per test session) can run on one machine side by side.
#
#   slurm/local-cluster.sh start DIR [CPUS] [NODES]   start it; prints the line to export SLURM_CONF
#   slurm/local-cluster.sh stop DIR                    stop its daemons by PID and wait until they are gone
#
# NODES (default 1) > 1 emulates a multi-node cluster on this one machine: one slurmd per node,
# named n1..nN, each with its own port, spool directory, pid file and log (Debian's 22.05 build
# runs several slurmd on one host with `slurmd -N`, one port per NodeName line), and each in its
# own UTS namespace whose host name is its node name. The tasks a slurmd starts inherit that
# namespace, so `hostname` and socket.gethostname() say n1, n2, ... as on a real cluster, while
# all of them share this machine's network (NodeAddr=127.0.0.1) and file system (the "shared
# file system" of the results directory). Node names resolve to 127.0.0.1 inside the nodes
# through a hosts file bind-mounted over /etc/hosts in their mount namespace, so rank 0's node
# name is an address as on a real cluster. Needs root (unshare --uts --mount). A node that stops
# answering is down after SlurmdTimeout=5 s (about 20 s in all), and Slurm requeues its batch jobs.
#
# Job ids start at a random FirstJobId: ditrun derives its rendezvous port from the job id, and
# two clusters on one machine (two test files at once) must not derive the same ports.
#
# CPUS (default 8) is what each node declares: more than the real cores, so that 4-task jobs run
# on a 2-core machine (SlurmdParameters=config_overrides lets slurmd believe the config). Jobs
# start at once (batch_sched_delay=0, a scheduling pass every second), and a requeued job is held
# cred_expire + 1 = 6 s instead of Slurm's default 121 s.
set -euo pipefail

die() { echo "local-cluster: $*" >&2; exit 1; }

usage() { die "usage: $0 start DIR [CPUS] [NODES] | stop DIR"; }

need_binaries() {
    local missing=()
    for bin in munged slurmctld slurmd sbatch sinfo; do
        command -v "$bin" >/dev/null || missing+=("$bin")
    done
    [ ${#missing[@]} -eq 0 ] || die "missing ${missing[*]}: install Debian's slurm-wlm munge libpmix2 (make install does, as root)"
}

# N free TCP ports (slurmctld, then one per slurmd), so this cluster does not clash with another one.
free_ports() {
    python3 - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

# The emulated nodes' names: n1..nN (one node: this machine's own name, as before).
node_names() {
    local nodes=$1
    if [ "$nodes" -eq 1 ]; then hostname -s; else seq -f 'n%g' 1 "$nodes"; fi
}

# The daemons' files: one slurmd per node gets its own (%n is the node name).
slurmd_files() {
    local dir=$1 nodes=$2
    if [ "$nodes" -eq 1 ]; then
        printf 'SlurmdSpoolDir=%s/spool\nSlurmdPidFile=%s/slurmd.pid\nSlurmdLogFile=%s/slurmd.log\n' "$dir" "$dir" "$dir"
    else
        printf 'SlurmdSpoolDir=%s/spool/%%n\nSlurmdPidFile=%s/slurmd-%%n.pid\nSlurmdLogFile=%s/slurmd-%%n.log\n' \
            "$dir" "$dir" "$dir"
    fi
}

# One NodeName line per node; several nodes each listen on their own port (all on 127.0.0.1).
node_lines() {
    local cpus=$1 nodes=$2 name port
    shift 2
    for name in $(node_names "$nodes"); do
        port=$1
        shift
        echo "NodeName=$name NodeAddr=127.0.0.1 Port=$port CPUs=$cpus State=UNKNOWN"
    done
}

write_config() {
    local dir=$1 cpus=$2 nodes=$3 ctld_port=$4
    shift 4
    local host
    host=$(hostname -s)
    cat >"$dir/slurm.conf" <<CONF
ClusterName=ditrun-local
FirstJobId=$((RANDOM * 16 + 1000))
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$1
SlurmUser=$(id -un)
SlurmdUser=$(id -un)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge.sock,cred_expire=5
StateSaveLocation=$dir/state
$(slurmd_files "$dir" "$nodes")
SlurmctldPidFile=$dir/slurmctld.pid
SlurmctldLogFile=$dir/slurmctld.log
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
$([ "$nodes" -eq 1 ] || echo "SlurmdTimeout=5")
$(node_lines "$cpus" "$nodes" "$@")
PartitionName=debug Nodes=$(node_names "$nodes" | paste -sd,) Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
}

# One slurmd per node. Emulated nodes run in their own UTS namespace named after the node, so
# that every task they start sees that host name; the network and file system stay shared.
start_slurmds() {
    local dir=$1 nodes=$2 name
    if [ "$nodes" -eq 1 ]; then
        slurmd -f "$SLURM_CONF"
        return
    fi
    [ "$(id -u)" -eq 0 ] || die "$nodes emulated nodes need root (each slurmd runs in its own UTS namespace)"
    # Node names resolve to this machine inside the nodes, as a real cluster's resolve to theirs:
    # rank 0's host name is where the others meet it.
    { cat /etc/hosts; echo "127.0.0.1 $(node_names "$nodes" | xargs)"; } >"$dir/hosts"
    for name in $(node_names "$nodes"); do
        [ "$name" != "$(hostname -s)" ] || die "this machine is called $name, like an emulated node"
        mkdir -p "$dir/spool/$name"
        unshare --uts --mount sh -c "hostname $name && mount --bind '$dir/hosts' /etc/hosts &&
            exec slurmd -f '$SLURM_CONF' -N $name"
    done
}

start() {
    local dir=$1 cpus=${2:-8} nodes=${3:-1} ports
    need_binaries
    [[ "$nodes" =~ ^[1-9][0-9]*$ ]] || die "NODES must be a positive number, not '$nodes'"
    mkdir -p "$dir/state" "$dir/spool"
    dir=$(cd "$dir" && pwd)
    chmod 700 "$dir"
    # munged refuses keys readable by others; --force accepts the temp dir's ownership.
    [ -f "$dir/munge.key" ] || { dd if=/dev/urandom of="$dir/munge.key" bs=1024 count=1 status=none; chmod 400 "$dir/munge.key"; }
    munged --force --socket="$dir/munge.sock" --key-file="$dir/munge.key" --pid-file="$dir/munged.pid" \
        --log-file="$dir/munged.log" --seed-file="$dir/munged.seed"
    read -r -a ports < <(free_ports $((nodes + 1)))
    write_config "$dir" "$cpus" "$nodes" "${ports[@]}"
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$SLURM_CONF" -i
    start_slurmds "$dir" "$nodes"
    wait_idle "$dir" "$nodes"
    echo "export SLURM_CONF=$SLURM_CONF"
}

# The cluster is usable once sinfo reports every node idle.
wait_idle() {
    local dir=$1 nodes=$2 states
    for _ in $(seq 150); do
        states=$(sinfo -h -N -o %T 2>/dev/null | sort | uniq -c | xargs || true)
        [ "$states" = "$nodes idle" ] && return 0
        sleep 0.1
    done
    die "the nodes are not all idle after 15 s (states '${states:-none}'); see $dir/slurmctld.log and $dir/slurmd*.log"
}

# Each daemon takes seconds to shut down: signal the Slurm daemons together, then munged.
stop() {
    local dir=$1
    stop_pids "$dir" "$dir"/slurmd*.pid "$dir/slurmctld.pid"
    stop_pids "$dir" "$dir/munged.pid"
}

stop_pids() {
    local dir=$1 pidfile pids=() pid
    shift
    for pidfile in "$@"; do
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")  # read once: a daemon removes its pid file as it stops
        if kill "$pid" 2>/dev/null; then pids+=("$pid"); fi
    done
    for pid in "${pids[@]}"; do
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
    done
}

case "${1:-}" in
    start) [ $# -ge 2 ] || usage; start "$2" "${3:-8}" "${4:-1}" ;;
    stop) [ $# -eq 2 ] || usage; stop "$2" ;;
    *) usage ;;
esac
