#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, and examples/slurm.sbatch run on it end to end:
#   sudo bash tools/slurm_local.sh [MPI]     # MPI: mpich (default), openmpi or impi
# Needs root and Debian's packages slurm-wlm, munge and libpmix-dev (for srun --mpi=pmix;
# installed with apt-get if missing).
# Starts munged, slurmctld and slurmd for this host and its CPUs with a configuration of its
# own (nothing under /etc/slurm is touched), submits the sbatch file on 2 CPU ranks with the
# NumPy backend (its GPU settings overridden on the sbatch command line), waits for the job,
# checks that it ran on 2 ranks and that its final loss equals the same training under mpiexec,
# and stops every daemon it started on exit, also on failure or Ctrl-C.
#
# The MPI comes from the wheel of that name in a virtual environment of its own under the work
# directory (${ZERO1_SLURM_DIR:-/tmp/zero1-slurm}), or from the Python given as PYTHON if it
# already has mpi4py. srun's PMI for each MPI is chosen in examples/slurm.sbatch; see the
# docs/clusters.md (Slurm) for what was tested.
set -euo pipefail
cd "$(dirname "$0")/.."
mpi=${1:-mpich}
case $mpi in
  mpich|openmpi|impi) ;;
  *) echo "usage: $0 [mpich|openmpi|impi]" >&2; exit 2 ;;
esac
[ "$(id -u)" -eq 0 ] || { echo "$0: needs root (it starts munged, slurmctld, slurmd)" >&2; exit 1; }
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null \
    || [ ! -e /usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so ]; then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge libpmix-dev
fi

work=${ZERO1_SLURM_DIR:-/tmp/zero1-slurm}
rm -rf "$work/state" "$work/spool" "$work/log"
mkdir -p "$work/state" "$work/spool" "$work/log" "$work/job"
chmod 777 "$work/job"
host=$(hostname -s)
cpus=$(nproc)
memory=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
export SLURM_CONF=$work/slurm.conf
cat >"$SLURM_CONF" <<EOF
ClusterName=zero1
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
NodeName=$host CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if ! munge -n </dev/null >/dev/null 2>&1; then  # no munged answering yet: start one
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged --foreground &
  pids+=($!)
  for _ in $(seq 20); do munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.5; done
fi
/usr/sbin/slurmctld -D -f "$SLURM_CONF" &
pids+=($!)
/usr/sbin/slurmd -D -f "$SLURM_CONF" &
pids+=($!)
for _ in $(seq 60); do
  sinfo -h -o %T 2>/dev/null | grep -q idle && break
  sleep 1
done
sinfo -h -o %T | grep -q idle || { echo "Slurm did not come up:"; tail -n 20 "$work"/log/*.log; exit 1; }

PY=${PYTHON:-}
if [ -z "$PY" ] || ! "$PY" -c "import mpi4py" 2>/dev/null; then
  venv=$work/venv-$mpi
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q ".[$mpi]"
  PY=$venv/bin/python
fi
export PATH=$(dirname "$PY"):$PATH ZERO1_MPI=$mpi

steps=60
out=$work/job/slurm-%j.out
job=$(sbatch --parsable --wait --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 --gpus-per-node=0 \
  --time=00:05:00 --output="$out" examples/slurm.sbatch --backend numpy --steps "$steps" \
  --log-every 20) || true
log=${out//%j/$job}
echo "--- job $job ($mpi) wrote:"
cat "$log"
reference=$(PYTHONPATH=$PWD "$PY" -m zero1_mpi.launcher -n 2 -- "$PY" -m mpi4py \
  examples/train_mlp.py --steps "$steps" | tail -n 1)
echo "--- the same training under mpiexec: $reference"
grep -q "world_size=2 " "$log" || { echo "slurm_local: FAIL: the job did not run on 2 ranks"; exit 1; }
[ "$(tail -n 1 "$log")" = "$reference" ] || { echo "slurm_local: FAIL: final loss differs"; exit 1; }
echo "slurm_local: OK ($mpi under srun: $(grep -o 'srun --mpi=[a-z0-9]*' "$log" | head -n 1))"
