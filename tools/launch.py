"""Run a tool's worker under ``mpiexec -n N`` and collect the JSON line its rank 0 prints.

Shared by the tools that measure across world sizes (``memory_table.py --measure``,
``checkpoint_bench.py``, ``bench.py --ranks``). The command line comes from
``zero1_mpi.launcher`` (``ZERO1_MPIEXEC``, or ``--mpiexec``, and what each MPI needs). On
timeout the job is killed whole (the launcher and every process below it).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

from zero1_mpi.launcher import MPIEXEC_ENV, LauncherError, kill_job, launch_command


def run_ranks(n: int, script: str, args: list[str], mpiexec: str | None = None,
              timeout: float = 300.0) -> dict:
    """The last JSON object that ``mpiexec -n n python -m mpi4py script *args`` printed,
    after checking that it ran on ``n`` ranks (its ``world_size`` field). ``mpiexec``: a
    launcher command line (default: ``ZERO1_MPIEXEC``, else ``mpiexec`` on PATH)."""
    environ = dict(os.environ)
    if mpiexec:
        environ[MPIEXEC_ENV] = mpiexec
    try:
        cmd, env = launch_command(n, [sys.executable, "-m", "mpi4py", script, *args],
                                  environ=environ)
    except LauncherError as exc:
        if not mpiexec:
            raise
        raise LauncherError(f"MPI launcher {mpiexec!r} not found on PATH: install one (pip "
                            "install mpich) or pass --mpiexec /path/to/mpiexec") from exc
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc.pid)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out, err = "", "(no output: the job's pipes stayed open after it was killed)"
        raise RuntimeError(f"`{shlex.join(cmd)}` did not finish in {timeout:g} s (raise "
                           f"--timeout or lower --params):\n{out}{err}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(cmd)}` exited with {proc.returncode}:\n{out}{err}")
    for line in reversed(out.splitlines()):
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict) and found.get("world_size") == n:
            return found
        break
    raise RuntimeError(f"`{shlex.join(cmd)}` did not report from {n} ranks (did the launcher "
                       f"start {n} singletons?):\n{out}{err}")
