#!/usr/bin/env bash
# Stop the daemons started by start_test_cluster.sh (by their pid files) and remove its config.
set -uo pipefail
STATE=${QS_SLURM_STATE:-/var/tmp/quantstudy-slurm}
MARK="# quantstudy test cluster"

stop_pid() {  # stop_pid PIDFILE: TERM the process, wait up to 10 s
  [ -s "$1" ] || return 0
  local pid; pid=$(cat "$1")
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
}
if [ -e /etc/slurm/slurm.conf ] && ! grep -q "^$MARK" /etc/slurm/slurm.conf; then
  echo "stop_test_cluster: /etc/slurm/slurm.conf is not ours; leaving it alone" >&2; exit 0
fi
stop_pid "$STATE/slurmd.pid"
stop_pid "$STATE/slurmctld.pid"
if [ -e "$STATE/munged.ours" ]; then stop_pid /run/munge/munged.pid; rm -f "$STATE/munged.ours"; fi
for f in /etc/slurm/slurm.conf /etc/slurm/gres.conf; do
  [ -e "$f" ] && grep -q "^$MARK" "$f" && rm -f "$f"
done
echo "Slurm test cluster stopped (logs kept in $STATE)"
