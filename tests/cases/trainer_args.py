"""The ``TrainingArguments`` a script builds and gives ``ZeroTrainer`` tell each rank its MPI
rank and the world size (the script's ``args`` is ``trainer.args``), on N ranks."""

import tempfile

import torch
from mpi4py import MPI

from zero1_mpi.transformers import ZeroTrainer  # before TrainingArguments(...)
from transformers import TrainingArguments  # noqa: I001

comm = MPI.COMM_WORLD
args = TrainingArguments(output_dir=comm.bcast(tempfile.mkdtemp() if comm.rank == 0 else None),
                         use_cpu=True, report_to=[])
trainer = ZeroTrainer(model=torch.nn.Linear(2, 2), args=args)
got = (args.process_index, args.world_size, args.should_save, trainer.args is args)
expected = (comm.rank, comm.size, comm.rank == 0, True)
if got != expected:
    raise AssertionError(f"rank {comm.rank}: the script's args say {got}, expected {expected}")
if comm.rank == 0:
    print(f"OK the script's TrainingArguments know the ranks on {comm.size} ranks")
