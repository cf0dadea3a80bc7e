#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, and examples/slurm.sbatch run on it end to end:
#   sudo bash tools/slurm_local.sh [--preempt] [MPI]   # MPI: mpich (default), openmpi or impi
# Needs root and Debian's packages slurm-wlm, munge and libpmix-dev (for srun --mpi=pmix;
# installed with apt-get if missing).
# Starts munged, slurmctld and slurmd for this host and its CPUs with a configuration of its
# own (nothing under /etc/slurm is touched), submits the sbatch file on 2 CPU ranks with the
# NumPy backend (its GPU settings overridden on the sbatch command line), waits for the job,
# checks that it ran on 2 ranks and that its final loss equals the same training under mpiexec,
# and stops every daemon it started on exit, also on failure or Ctrl-C.
# --preempt: instead, a longer job with --checkpoint is sent SIGUSR1 (scancel --signal=USR1)
# mid-run; it must save a checkpoint and end cleanly (checkpoint_on_signal), and a second job
# resumes from it to the final loss of the uninterrupted run under mpiexec.
#
# The MPI comes from the wheel of that name in a virtual environment of its own under the work
# directory (${ZERO1_SLURM_DIR:-/tmp/zero1-slurm}), or from the Python given as PYTHON if it
# already has mpi4py. srun's PMI for each MPI is chosen in examples/slurm.sbatch; see the
# docs/clusters.md (Slurm) for what was tested.
set -euo pipefail
cd "$(dirname "$0")/.."
preempt=0
if [ "${1:-}" = --preempt ]; then preempt=1; shift; fi
mpi=${1:-mpich}
case $mpi in
  mpich|openmpi|impi) ;;
  *) echo "usage: $0 [--preempt] [mpich|openmpi|impi]" >&2; exit 2 ;;
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

if [ "$preempt" = 1 ]; then
  steps=3000
  ckpt=$work/job/ckpt
  rm -rf "$ckpt"
  submit() {  # the example on 2 ranks with checkpoints in $ckpt; extra sbatch options first
    sbatch --parsable --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 --gpus-per-node=0 \
      --time=00:10:00 "$@" examples/slurm.sbatch --backend numpy --steps "$steps" \
      --log-every 100 --checkpoint "$ckpt" --save-every 100000
  }
  job=$(submit --output="$work/job/preempt-%j.out")
  log=$work/job/preempt-$job.out
  for _ in $(seq 300); do  # until it has logged progress twice: mid-run
    [ "$(grep -c 'ms/step' "$log" 2>/dev/null || true)" -ge 2 ] 2>/dev/null && break
    sleep 0.5
  done
  scancel --signal=USR1 "$job"
  for _ in $(seq 600); do squeue -h -j "$job" 2>/dev/null | grep -q . || break; sleep 0.5; done
  echo "--- job $job ($mpi), sent SIGUSR1 with scancel, wrote:"
  cat "$log"
  stopped=$(grep -o 'stopped by a signal after step [0-9]*' "$log" | grep -o '[0-9]*$') \
    || { echo "slurm_local: FAIL: the job did not stop on the signal"; exit 1; }
  [ "$stopped" -lt "$steps" ] || { echo "slurm_local: FAIL: the signal came too late"; exit 1; }
  latest=$(head -n 1 "$ckpt/LATEST")
  [ "${latest:0:13}" = "$(printf 'ckpt-%08d' "$stopped")" ] \
    || { echo "slurm_local: FAIL: LATEST is $latest, not step $stopped's"; exit 1; }
  state=$(sacct -n -X -j "$job" -o State 2>/dev/null | head -n 1 | tr -d ' ' || true)
  job2=$(submit --wait --output="$work/job/resume-%j.out") || true
  log2=$work/job/resume-$job2.out
  echo "--- job $job2 (resumed) wrote:"
  cat "$log2"
  grep -q "resumed from .* at step $stopped" "$log2" \
    || { echo "slurm_local: FAIL: the second job did not resume at step $stopped"; exit 1; }
  reference=$(PYTHONPATH=$PWD "$PY" -m zero1_mpi.launcher -n 2 -- "$PY" -m mpi4py \
    examples/train_mlp.py --steps "$steps" --log-every 1000 | tail -n 1)
  echo "--- the same training under mpiexec, uninterrupted: $reference"
  [ "${reference#* last_loss=}" = "$(tail -n 1 "$log2" | sed 's/.* last_loss=//')" ] \
    || { echo "slurm_local: FAIL: the resumed job's final loss differs"; exit 1; }
  echo "slurm_local: OK ($mpi: SIGUSR1 at step $stopped -> $latest${state:+, job $state};" \
    "resumed to ${reference#* last_loss=}, the uninterrupted loss)"
  exit 0
fi

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
