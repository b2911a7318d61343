#!/usr/bin/env bash
# A real Slurm cluster of two nodes on this one machine (slurmctld + one slurmd per node, munge auth), so
# multi-node launches are tested against Slurm itself. Both nodes are this host (127.0.0.1); they differ
# in name (node1, node2), slurmd port and SLURM_NODEID.
#
#   launch/slurm/local-cluster.sh start    # as root; installs slurm-wlm + munge (Debian) if missing
#   export SLURM_CONF=/tmp/tray-slurm-ci/slurm.conf     (start prints this line)
#   srun -N2 --ntasks-per-node=1 hostname
#   launch/slurm/local-cluster.sh stop
#
# Settings: TRAY_SLURM_DIR (state, logs, conf; default /tmp/tray-slurm-ci), TRAY_SLURM_NODES (default 2),
# TRAY_SLURM_PORT (slurmctld's port; slurmd i listens on PORT+i; default 16917).
# Exit status: 0 started (or stopped), 2 bad usage, 3 cannot run here (not root, no packages), 4 no idle nodes.
set -euo pipefail
D=${TRAY_SLURM_DIR:-/tmp/tray-slurm-ci}
CONF=$D/slurm.conf
NODES=${TRAY_SLURM_NODES:-2}
PORT=${TRAY_SLURM_PORT:-16917}

say() { echo "local-cluster: $*" >&2; }

install() {
    command -v slurmctld >/dev/null && command -v munged >/dev/null && return
    if ! command -v apt-get >/dev/null; then
        say "slurmctld/munged missing and no apt-get to install slurm-wlm and munge"; exit 3
    fi
    export DEBIAN_FRONTEND=noninteractive
    timeout 300 apt-get update -qq >/dev/null && timeout 600 apt-get install -y -qq slurm-wlm munge >/dev/null || {
        say "could not install slurm-wlm and munge with apt-get"; exit 3; }
}

write_conf() {
    mkdir -p "$D/state" "$D/log"
    local names="" cpus
    cpus=$(nproc)
    {
        cat <<CONF
ClusterName=traylocal
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool-%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
SlurmctldPort=$PORT
SchedulerType=sched/builtin
SelectType=select/cons_tres
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
MpiDefault=none
CONF
        for i in $(seq 1 "$NODES"); do
            echo "NodeName=node$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + i)) CPUs=$cpus State=UNKNOWN"
            names="${names:+$names,}node$i"
        done
        echo "PartitionName=debug Nodes=$names Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
    } > "$CONF"
    # the node names resolve to this host, as a cluster's DNS would resolve them
    for i in $(seq 1 "$NODES"); do
        grep -q "[[:space:]]node$i\$" /etc/hosts || echo "127.0.0.1 node$i" >> /etc/hosts
    done
}

start_munge() {
    munge -n >/dev/null 2>&1 && return
    mkdir -p /etc/munge /run/munge /var/log/munge /var/lib/munge
    [ -s /etc/munge/munge.key ] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
    chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
    chmod 400 /etc/munge/munge.key
    runuser -u munge -- munged
    # NOTE: only a munged this script started is stopped by `stop` (one already running is someone's)
    pgrep -n -u munge -x munged > "$D/munged.pid" || true
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
    if [ "$(id -u)" != 0 ]; then say "needs root (slurmd runs jobs as their users)"; exit 3; fi
    install
    write_conf
    start_munge
    export SLURM_CONF=$CONF
    alive "$D/slurmctld.pid" || slurmctld -f "$CONF"
    for i in $(seq 1 "$NODES"); do
        alive "$D/slurmd-node$i.pid" || slurmd -f "$CONF" -N "node$i"
    done
    for _ in $(seq 60); do
        if [ "$(sinfo -h -N -o %t 2>/dev/null | grep -c -E '^(idle|mix|alloc)$' || true)" -ge "$NODES" ]; then
            echo "export SLURM_CONF=$CONF"
            return 0
        fi
        sleep 0.5
    done
    say "the nodes did not become idle within 30 s; see $D/log/"; sinfo >&2 || true
    exit 4
}

stop() {
    local pids=""
    for f in "$D"/slurmd-*.pid "$D/slurmctld.pid" "$D/munged.pid"; do
        [ -f "$f" ] && pids="$pids $(cat "$f")"
    done
    for p in $pids; do kill "$p" 2>/dev/null || true; done
    for _ in $(seq 50); do
        local left=0
        for p in $pids; do kill -0 "$p" 2>/dev/null && left=1; done
        [ "$left" = 0 ] && break
        sleep 0.1
    done
    rm -f "$D"/*.pid
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) SLURM_CONF=$CONF sinfo ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
