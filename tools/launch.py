"""Run a tool's worker under ``mpiexec -n N`` and collect the JSON line its rank 0 prints.

Shared by the tools that measure across world sizes (``memory_table.py --measure``, and
``bench.py``'s benchmarks with ``--ranks``). ``zero1_mpi.launcher.run`` gives the command
line (``ZERO1_MPIEXEC``, or ``--mpiexec``, and what each MPI needs) and kills the whole job on
timeout.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

from zero1_mpi.launcher import MPIEXEC_ENV, LauncherError, LaunchTimeout, run


def run_ranks(n: int, script: str, args: list[str], mpiexec: str | None = None,
              timeout: float = 300.0) -> dict:
    """The last JSON object that ``mpiexec -n n python -m mpi4py script *args`` printed,
    after checking that it ran on ``n`` ranks (its ``world_size`` field). ``mpiexec``: a
    launcher command line (default: ``ZERO1_MPIEXEC``, else ``mpiexec`` on PATH)."""
    environ = dict(os.environ)
    if mpiexec:
        environ[MPIEXEC_ENV] = mpiexec
    try:
        proc = run(n, [sys.executable, "-m", "mpi4py", script, *args], timeout=timeout,
                   environ=environ)
    except LauncherError as exc:
        if not mpiexec:
            raise
        raise LauncherError(f"MPI launcher {mpiexec!r} not found on PATH: install one (pip "
                            "install mpich) or pass --mpiexec /path/to/mpiexec") from exc
    except LaunchTimeout as exc:
        raise RuntimeError(f"`{shlex.join(exc.cmd)}` did not finish in {timeout:g} s (raise "
                           f"--timeout or lower --params):\n{exc.stdout}{exc.stderr}") from None
    cmd, out, err = proc.args, proc.stdout, proc.stderr
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
