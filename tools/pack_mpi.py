"""Pack the MPI that tools/gpu_check.sh needs on a machine with no package registry into ./.whl:

    python tools/pack_mpi.py [--out .whl]

The mpi4py and mpich wheels (MPICH, the staged path), and a slim Intel MPI runtime
(``impi-rt-slim.tar.xz``): the impi-rt 2021.18 wheel is 129 MB, over what a device run may
carry, and most of it is Fortran, Java, benchmarks and tuning tables. The slim tree keeps
what one node needs: ``mpiexec`` with its Hydra proxies, ``libmpi``, libfabric with its
shared-memory and TCP providers, and the GPU collectives' kernels (``coll.fatbin``).
``source tools/impi_env.sh DIR`` (after unpacking into DIR) sets the paths Intel MPI expects.
Downloads with pip (the wheels' versions are the ones ``.ci/run`` tests).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

IMPI = "impi-rt==2021.18.1"
WHEELS = ("mpi4py", "mpich")
#: What the slim tree keeps, relative to the wheel's data directory.
KEEP = ("bin/mpiexec", "bin/mpiexec.hydra", "bin/hydra_pmi_proxy", "bin/hydra_bstrap_proxy",
        "bin/impi_info", "lib/libmpi.so.12", "lib/libfabric.so.1", "lib/libshm-fi.so",
        "lib/libtcp-fi.so", "lib/librxm-fi.so", "lib/libmpi_shm_heap_proxy.so",
        "opt/mpi/etc/coll.fatbin", "opt/mpi/etc/collectives.conf", "opt/mpi/etc/pt2pt.conf",
        "opt/mpi/etc/tuning_generic_shm.dat", "opt/mpi/etc/tuning_generic_shm-ofi.dat",
        "opt/mpi/etc/tuning_generic_ofi.dat", "share/doc/mpi/licensing/license.txt",
        "share/doc/mpi/licensing/third-party-programs.txt")
#: Linux x86-64 wheels a device machine takes (pip matches each tag exactly).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")
LINKS = {"lib/libmpi.so": "libmpi.so.12", "lib/libfabric.so": "libfabric.so.1"}


def slim_impi(wheel: Path, out: Path) -> Path:
    """Write ``out`` (tar.xz) with the ``KEEP`` files of the impi-rt ``wheel``."""
    with zipfile.ZipFile(wheel) as z:
        data = next(n for n in z.namelist() if ".data/data/" in n).split(".data/data/")[0]
        prefix = f"{data}.data/data/"
        missing = [k for k in KEEP if prefix + k not in z.namelist()]
        if missing:
            raise SystemExit(f"{wheel.name} lacks {missing}: update KEEP in {__file__}")
        with tempfile.TemporaryDirectory() as tmp, tarfile.open(out, "w:xz") as tar:
            for name in KEEP:
                target = Path(tmp, name)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(prefix + name))
                target.chmod(0o755 if name.startswith(("bin/", "lib/")) else 0o644)
            for link, points_to in LINKS.items():
                Path(tmp, link).symlink_to(points_to)
            tar.add(tmp, arcname="impi")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".whl"))
    parser.add_argument("--python-version", default="3.12",
                        help="the device machine's Python (mpi4py's wheel is built per version)")
    args = parser.parse_args(argv)
    args.out.mkdir(exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d"]
    target = ["--only-binary=:all:", "--python-version", args.python_version,
              "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS)]
    subprocess.run(pip + [str(args.out), *target, *WHEELS], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(pip + [tmp, IMPI], check=True)
        wheel = next(Path(tmp).glob("impi_rt-*.whl"))
        slim = slim_impi(wheel, args.out / "impi-rt-slim.tar.xz")
    for path in sorted(args.out.iterdir()):
        print(f"{path}  {path.stat().st_size / 2**20:.1f} MiB")
    print(f"from {wheel.name}: {slim.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
