#!/usr/bin/env bash
# A single-node SLURM cluster for the suite's SLURM tests (tests/research/test_slurm.py), as root:
#   bash .ci/slurm.sh up     # install slurm-wlm + munge if missing, start munged, slurmctld, slurmd
#   bash .ci/slurm.sh down   # stop, by PID, the daemons `up` started, and wait until they are gone
# The node offers this machine's CPUs and memory (less 1 GiB); accounting is off; jobs are bound to
# the CPUs they were given (TaskPlugin below). What a lab's cluster does that the SLURM tests need:
# JobRequeue=0 (jobs requeue only when they ask), a low and a high partition with real preemption
# (preempt/partition_prio, PreemptMode=REQUEUE) over a node resource (`preemptee`), a partition whose
# MaxTime (1 min) is below what grids ask, and a partition with a second node that never comes up. A slurm.conf this script did not write is kept as it
# is (its cluster is used); one it wrote is rewritten. The daemons start with their state cleared
# (-c: a throwaway cluster), and a state folder left by a cluster of another name is emptied first
# (slurmctld would exit on `CLUSTER NAME MISMATCH`). When a daemon does not come up, its log's
# last lines are printed. Elsewhere, with no `sbatch` on PATH, the SLURM tests skip with a reason
# (CI_REQUIRE_SLURM=1, as .ci/run sets, makes that a failure).
set -euo pipefail
state=/run/opsd-slurm  # <daemon>.pid: the PID of each daemon `up` started
conf=/etc/slurm/slurm.conf
marker="# written by .ci/slurm.sh (opsd); 'bash .ci/slurm.sh up' rewrites it"
cluster=opsdtest

conf_value() {  # a slurm.conf key's value, or $2 when the file does not set it
  local value
  value=$(awk -F= -v key="$1" 'tolower($1) == tolower(key) {print $2}' "$conf" | tail -n 1)
  echo "${value:-$2}"
}

started() {  # the PID `up` recorded for daemon $1, if that process is still that daemon
  local pid
  [[ -s "$state/$1.pid" ]] || return 1
  pid=$(cat "$state/$1.pid")
  [[ "$(cat "/proc/$pid/comm" 2> /dev/null)" == "$1" ]] && echo "$pid"
}

start() {  # start daemon $1 (args after it), record its PID, or print its log's last lines and fail
  local daemon=$1 pidfile=$2 log=$3
  shift 3
  if pgrep -x "$daemon" > /dev/null; then
    echo "[slurm] $daemon already runs (PID $(pgrep -x "$daemon" | tr '\n' ' ')): left as it is"
    return 0
  fi
  rm -f "$pidfile"
  "$daemon" "$@" || true  # it forks; a start that fails says so in its log, checked below
  for _ in $(seq 20); do
    if [[ -s "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2> /dev/null; then
      cp "$pidfile" "$state/$daemon.pid"
      return 0
    fi
    sleep 0.5
  done
  echo "[slurm] $daemon did not start; the last lines of $log:" >&2
  tail -n 15 "$log" >&2 2> /dev/null || echo "  (no log at $log)" >&2
  return 1
}

case "${1:-}" in
up)
  if ! command -v slurmctld > /dev/null || ! command -v munged > /dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge > /dev/null
  fi
  mkdir -p "$state" /etc/munge /var/log/munge /run/munge /var/lib/munge /etc/slurm \
    /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
  if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2> /dev/null
  fi
  chown -R munge:munge /etc/munge /var/log/munge /run/munge /var/lib/munge
  chmod 400 /etc/munge/munge.key
  start munged /run/munge/munged.pid /var/log/munge/munged.log --force
  if [[ -e "$conf" ]] && ! grep -qF "$marker" "$conf"; then
    echo "[slurm] keeping $conf: this script did not write it"
  else
    host=$(hostname)
    cpus=$(nproc)
    mem=$(($(free -m | awk '/Mem:/{print $2}') - 1024))
    cat > "$conf" << CONF
$marker
ClusterName=$cluster
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
ProctrackType=proctrack/linuxproc
# Jobs are bound to the CPUs they were given (sched_getaffinity in a job shows them). task/cgroup
# (cgroup v1 here) bound a job as well in a quick check, but the suite has run on this one only.
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# A job that asks for no memory gets 4 GiB a CPU (not the whole node), so that cells share the node.
DefMemPerCPU=4096
ReturnToService=2
# A site that does not requeue jobs unless they ask (--requeue): the grid's jobs must ask.
JobRequeue=0
KillWait=30
# Real preemption: a job of the high partition requeues a job of the low one (its higher
# PriorityTier); the debug partition, where the other tests run, is never preempted.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# A node resource the preemption test's two jobs ask for (--gres=preemptee:1), so that they contend
# for it and not for CPUs or memory, which the other SLURM tests hold at the same time (licences
# are not freed by a preemption). No GPUs: asking for one is refused, as on a CPU cluster.
GresTypes=preemptee
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
NodeName=$host CPUs=$cpus RealMemory=$mem Gres=preemptee:1 State=UNKNOWN
# A node that never comes up (partition twonodes below).
NodeName=ghost NodeAddr=127.0.0.2 CPUs=$cpus RealMemory=$mem State=FUTURE
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4 PriorityTier=2 PreemptMode=OFF
PartitionName=low Nodes=$host MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=high Nodes=$host MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
# A partition whose time limit is below what a grid asks (--time): its jobs pend for PartitionTimeLimit.
PartitionName=short Nodes=$host MaxTime=1 State=UP PriorityTier=2 PreemptMode=OFF
# This node and one that never comes up: a job that excludes this host (a resubmission excluding the
# node its cell failed on) is accepted and pends, as on a cluster of several nodes. In the partitions
# above, of this node alone, sbatch refuses such a job.
PartitionName=twonodes Nodes=$host,ghost MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
CONF
    echo "$marker
NodeName=$host Name=preemptee Count=1" > "$(dirname "$conf")/gres.conf"
    saved=$(conf_value StateSaveLocation /var/spool/slurmctld)
    if [[ -s "$saved/clustername" && "$(cat "$saved/clustername")" != "$cluster" ]]; then
      echo "[slurm] $saved holds the state of cluster $(cat "$saved/clustername"): cleared"
      find "$saved" -mindepth 1 -delete
    fi
  fi
  start slurmctld "$(conf_value SlurmctldPidFile /run/slurmctld.pid)" \
    "$(conf_value SlurmctldLogFile /var/log/slurm/slurmctld.log)" -c
  start slurmd "$(conf_value SlurmdPidFile /run/slurmd.pid)" "$(conf_value SlurmdLogFile /var/log/slurm/slurmd.log)" -c
  for _ in $(seq 30); do
    if sinfo -h -o %t 2> /dev/null | grep -qE '^(idle|mix|alloc)'; then
      echo "[slurm] up: $(sinfo -h -o '%P %a %D %t %c CPUs %m MB')"
      exit 0
    fi
    sleep 1
  done
  echo "[slurm] the node did not come up ($(sinfo -h -o '%t %E' 2>&1 | head -n 1)); the last lines of the logs:" >&2
  for daemon in slurmctld slurmd; do
    log=$(conf_value "${daemon^}LogFile" "/var/log/slurm/$daemon.log")
    echo "--- $log" >&2
    tail -n 10 "$log" >&2 2> /dev/null || true
  done
  exit 1
  ;;
down)
  # Only what `up` started, by the PIDs it recorded: a cluster that was already running is left as
  # it was. slurmd may take its time cleaning up after killed jobs: SIGKILL after 10 s.
  for daemon in slurmd slurmctld munged; do
    if pid=$(started "$daemon"); then
      kill "$pid" 2> /dev/null || true
      for _ in $(seq 20); do
        kill -0 "$pid" 2> /dev/null || break
        sleep 0.5
      done
      if kill -0 "$pid" 2> /dev/null; then
        echo "[slurm] $daemon (PID $pid) ignored SIGTERM for 10 s: SIGKILL"
        kill -9 "$pid" 2> /dev/null || true
        while kill -0 "$pid" 2> /dev/null; do sleep 0.2; done
      fi
    fi
    rm -f "$state/$daemon.pid"
  done
  echo "[slurm] down"
  ;;
*)
  echo "usage: bash .ci/slurm.sh up|down" >&2
  exit 2
  ;;
esac
