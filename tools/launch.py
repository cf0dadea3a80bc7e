"""Run a tool's worker under ``mpiexec -n N`` and collect the JSON line its rank 0 prints.

Shared by the tools that measure across world sizes (``memory_table.py --measure``,
``checkpoint_bench.py``). The job runs in its own process group, killed whole on timeout.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys


def run_ranks(n: int, script: str, args: list[str], mpiexec: str = "mpiexec",
              timeout: float = 300.0) -> dict:
    """The last JSON object that ``mpiexec -n n python -m mpi4py script *args`` printed,
    after checking that it ran on ``n`` ranks (its ``world_size`` field)."""
    launcher = shlex.split(mpiexec)
    if not launcher or shutil.which(launcher[0]) is None:
        raise RuntimeError(f"MPI launcher {mpiexec!r} not found on PATH: install one "
                           f"(pip install mpich) or pass --mpiexec /path/to/mpiexec")
    cmd = [*launcher, "-n", str(n), sys.executable, "-m", "mpi4py", script, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
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
