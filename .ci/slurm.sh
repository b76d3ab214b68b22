#!/usr/bin/env bash
# A single-node SLURM cluster for the suite's SLURM tests (tests/research/test_slurm.py), as root:
#   bash .ci/slurm.sh up     # install slurm-wlm + munge if missing, start munged, slurmctld, slurmd
#   bash .ci/slurm.sh down   # stop the three daemons this script started (by their PID files)
# The node offers this machine's CPUs and memory (less 1 GiB); accounting is off. Elsewhere, with
# no `sbatch` on PATH, the SLURM tests skip with a reason.
set -euo pipefail
state=/run/opsd-slurm
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
  pgrep -x munged > /dev/null || { munged --force; touch "$state/munged"; }
  host=$(hostname)
  cpus=$(nproc)
  mem=$(( $(free -m | awk '/Mem:/{print $2}') - 1024 ))
  cat > /etc/slurm/slurm.conf <<CONF
ClusterName=opsdtest
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# A job that asks for no memory gets 4 GiB a CPU (not the whole node), so that cells share the node.
DefMemPerCPU=4096
ReturnToService=2
JobRequeue=1
KillWait=30
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
  if ! pgrep -x slurmctld > /dev/null; then slurmctld; touch "$state/slurmctld"; fi
  if ! pgrep -x slurmd > /dev/null; then slurmd; touch "$state/slurmd"; fi
  for _ in $(seq 30); do
    if sinfo -h -o %t 2> /dev/null | grep -qE '^(idle|mix|alloc)'; then
      echo "[slurm] up: $(sinfo -h -o '%P %a %D %t %c CPUs %m MB')"
      exit 0
    fi
    sleep 1
  done
  echo "[slurm] the node did not come up; /var/log/slurm/ holds the logs" >&2
  exit 1
  ;;
down)
  # Only what `up` started: a cluster that was already running is left as it was.
  for daemon in slurmd slurmctld; do
    if [[ -e "$state/$daemon" && -s /run/$daemon.pid ]]; then kill "$(cat /run/$daemon.pid)" 2> /dev/null || true; fi
    rm -f "$state/$daemon"
  done
  if [[ -e "$state/munged" ]]; then pkill -x munged || true; rm -f "$state/munged"; fi
  sleep 1
  echo "[slurm] down"
  ;;
*)
  echo "usage: bash .ci/slurm.sh up|down" >&2
  exit 2
  ;;
esac
