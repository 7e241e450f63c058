#!/bin/sh
# A local SLURM cluster for tests: munged, slurmctld and N slurmd "nodes" (node1..nodeN,
# `slurmd -N`, one port each), all inside a network namespace of its own that holds only
# loopback (the daemons listen on every address; there, that is 127.0.0.1 alone).
#
#   scripts/start_slurm.sh start DIR [NODES] [NETNS]   # writes DIR/slurm.conf, waits for idle nodes
#   scripts/start_slurm.sh stop DIR [NETNS]            # every process of the namespace, then DIR
#
# Clients: `nsenter --net=/run/netns/NETNS env SLURM_CONF=DIR/slurm.conf sbatch ...`.
# Needs root and Debian's slurm-wlm and munge (apt-get install -y slurm-wlm munge).
set -eu
# munged, slurmctld and slurmd live in /usr/sbin, which a non-login PATH may lack.
PATH="$PATH:/usr/sbin:/sbin"

cmd=${1:?usage: start_slurm.sh start|stop DIR [NODES] [NETNS]}
dir=${2:?usage: start_slurm.sh start|stop DIR [NODES] [NETNS]}
if [ "$cmd" = stop ]; then
    netns=${3:-openenv-slurm}
    if [ -e "/run/netns/$netns" ]; then
        for sig in TERM KILL; do
            pids=$(ip netns pids "$netns" || true)
            [ -n "$pids" ] && kill "-$sig" $pids 2>/dev/null || true
            i=0
            while [ -n "$(ip netns pids "$netns" 2>/dev/null)" ] && [ $i -lt 50 ]; do
                sleep 0.1; i=$((i + 1))
            done
        done
        ip netns delete "$netns"
    fi
    # munged runs outside the namespace (unix socket only): its pid file says which.
    if [ -f "$dir/munged.pid" ]; then
        pid=$(cat "$dir/munged.pid")
        kill "$pid" 2>/dev/null || true
        i=0  # it writes its seed file as it exits
        while [ -d "/proc/$pid" ] && [ "$(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null)" != Z ] && [ $i -lt 50 ]; do
            sleep 0.1; i=$((i + 1))
        done
    fi
    rm -rf "$dir"
    exit 0
fi

nodes=${3:-3}
netns=${4:-openenv-slurm}
host=$(hostname -s)
mkdir -p "$dir/state" "$dir/spool"
in_ns="nsenter --net=/run/netns/$netns"

ip netns add "$netns"
ip -n "$netns" link set lo up
# glibc's AI_ADDRCONFIG (slurm resolves its listen address with it) wants an IPv4
# address other than 127.0.0.1: a second loopback one.
ip -n "$netns" addr add 127.0.0.2/32 dev lo

munged --socket="$dir/munge.socket" --pid-file="$dir/munged.pid" \
    --key-file=/etc/munge/munge.key --log-file="$dir/munged.log" \
    --seed-file="$dir/munged.seed" --force

cat > "$dir/slurm.conf" <<EOF
ClusterName=openenv
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
AuthInfo=socket=$dir/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdTimeout=10
MinJobAge=2
KillWait=10
InactiveLimit=0
EOF
i=1
while [ $i -le "$nodes" ]; do
    echo "NodeName=node$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((16820 + i)) CPUs=1 State=UNKNOWN" >> "$dir/slurm.conf"
    i=$((i + 1))
done
echo "PartitionName=debug Nodes=node[1-$nodes] Default=YES MaxTime=INFINITE State=UP" >> "$dir/slurm.conf"

export SLURM_CONF="$dir/slurm.conf"
$in_ns slurmctld -f "$SLURM_CONF"
i=1
while [ $i -le "$nodes" ]; do
    $in_ns slurmd -f "$SLURM_CONF" -N "node$i"
    i=$((i + 1))
done
# Ready when every node is idle.
i=0
until [ "$($in_ns sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" -eq "$nodes" ]; do
    i=$((i + 1))
    if [ $i -gt 300 ]; then
        echo "start_slurm.sh: nodes not idle after 30 s" >&2
        $in_ns sinfo -N >&2 || true
        tail -n 20 "$dir/slurmctld.log" >&2 || true
        exit 1
    fi
    sleep 0.1
done
echo "slurm: $nodes nodes idle; SLURM_CONF=$SLURM_CONF netns=$netns"
