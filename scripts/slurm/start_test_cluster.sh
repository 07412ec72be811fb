#!/usr/bin/env bash
# Start a real single-node Slurm (slurmctld + slurmd + munge) on this machine, for tests.
# Root only. Installs Debian's packages if missing. The node has QS_SLURM_GPUS GPUs (default 4)
# declared in gres.conf, each a device file (a copy of /dev/null: Slurm drops a count-only GPU),
# so Slurm hands each GPU job a card of its own and queues the rest, as on a GPU node.
# No accounting daemon: the plugin polls with squeue, so MinJobAge is kept far above the
# status-check interval, and every finished job is written by jobcomp/filetxt to $STATE/jobcomp.log.
# Usage: start_test_cluster.sh  (env: QS_SLURM_PARTITION, QS_SLURM_GPU_MODEL, QS_SLURM_GPUS, QS_SLURM_STATE)
set -euo pipefail
PARTITION=${QS_SLURM_PARTITION:-test}
GPU_MODEL=${QS_SLURM_GPU_MODEL:-testgpu}
GPUS=${QS_SLURM_GPUS:-4}
STATE=${QS_SLURM_STATE:-/var/tmp/quantstudy-slurm}
CONF=/etc/slurm/slurm.conf   # the job step drops SLURM_CONF, so only the default path works
MARK="# quantstudy test cluster"
NODE=$(hostname -s)

[ "$(id -u)" = 0 ] || { echo "start_test_cluster: needs root" >&2; exit 77; }
if [ -e "$CONF" ] && ! grep -q "^$MARK" "$CONF"; then
  echo "start_test_cluster: $CONF exists and is not ours; refusing to touch a real cluster" >&2; exit 77
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
   || ! command -v sbatch >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      slurmctld slurmd munge slurm-client; } >"${TMPDIR:-/tmp}/quantstudy-slurm-apt.log" 2>&1 \
    || { echo "start_test_cluster: apt-get install failed" >&2; exit 77; }
fi
"$(dirname "$0")/stop_test_cluster.sh" >/dev/null 2>&1 || true   # a clean slate each time

mkdir -p "$STATE"/{ctld,slurmd,dev} /etc/slurm /run/munge
rm -f "$STATE/jobcomp.log" "$STATE"/dev/gpu*   # this cluster's record and cards only
for i in $(seq 0 $((GPUS - 1))); do mknod -m 666 "$STATE/dev/gpu$i" c 1 3; done   # char 1,3 = /dev/null
# The node is declared at GPUS times one GPU's share of a B200/B300 node (16 CPUs, 192 GiB),
# so that the profiles' per-rule CPU and memory requests are satisfiable; nothing enforces
# them here (no cgroups), and config_overrides stops slurmd from draining the node for "low"
# resources.
cat >"$CONF" <<CONF
$MARK (written by scripts/slurm/start_test_cluster.sh; removed by stop_test_cluster.sh)
ClusterName=quantstudy-test
SlurmctldHost=$NODE
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
GresTypes=gpu
MinJobAge=3600
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
MailProg=/bin/true
DefMemPerCPU=1024
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/jobcomp.log
NodeName=$NODE CPUs=$((16 * GPUS)) RealMemory=$((196608 * GPUS)) Gres=gpu:$GPU_MODEL:$GPUS State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
cat >/etc/slurm/gres.conf <<CONF
$MARK
NodeName=$NODE Name=gpu Type=$GPU_MODEL File=$STATE/dev/gpu[0-$((GPUS - 1))]
CONF

if ! pgrep -x munged >/dev/null; then
  [ -s /etc/munge/munge.key ] || runuser -u munge -- mungekey --create
  chown munge:munge /run/munge
  runuser -u munge -- /usr/sbin/munged
  touch "$STATE/munged.ours"          # stop_test_cluster.sh stops munged only if we started it
fi
/usr/sbin/slurmctld -c
/usr/sbin/slurmd -N "$NODE"
for _ in $(seq 60); do
  if sinfo -h -n "$NODE" -o %t 2>/dev/null | grep -qx idle; then
    echo "Slurm test cluster up: partition=$PARTITION gpu=$GPU_MODEL node=$NODE state=$STATE"
    exit 0
  fi
  sleep 0.5
done
echo "start_test_cluster: node did not become idle" >&2
sinfo -N -l >&2 || true; tail -n 20 "$STATE/slurmctld.log" "$STATE/slurmd.log" >&2 || true
"$(dirname "$0")/stop_test_cluster.sh" >&2
exit 1
