# source tools/impi_env.sh DIR: use the slim Intel MPI runtime that tools/pack_mpi.py packed,
# unpacked in DIR (tar -xJf .whl/impi-rt-slim.tar.xz -C DIR makes DIR/impi): its mpiexec,
# libmpi for mpi4py, and libfabric's providers. GPU buffers: also export I_MPI_OFFLOAD=1
# I_MPI_OFFLOAD_MODE=cuda.
impi_root=$(cd "$1/impi" && pwd) || return 1
export I_MPI_ROOT=$impi_root PATH=$impi_root/bin:$PATH FI_PROVIDER_PATH=$impi_root/lib
export LD_LIBRARY_PATH=$impi_root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export MPI4PY_LIBMPI=$impi_root/lib/libmpi.so.12
unset impi_root
