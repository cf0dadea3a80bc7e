"""mpiexec -n 2 python -m mpi4py examples/trainer_gpt2.py

A transformers ``Trainer`` script: a small GPT-2 (``GPT2LMHeadModel`` built from a
``GPT2Config``, no download) learns Python's own documentation (``pydoc_data.topics``, shipped
with CPython) character by character, with AdamW, a warm-up then cosine schedule, gradient
clipping, evaluation and checkpoints, all from ``TrainingArguments``. It trains with
zero1_mpi's sharded optimizer under ``mpiexec``: the lines marked ``# zero1_mpi`` are all that
differs from a plain Trainer script. Under ``torchrun`` the same script trains with Trainer's
own DistributedDataParallel instead (on the CPU, gloo), the reference to compare with: with the
same arguments and rank count the logged losses are the same step by step, to fp32 rounding
(docs/transformers.md has the table).

    mpiexec -n 2 python -m mpi4py examples/trainer_gpt2.py --max-steps 200
    mpiexec -n 2 python -m mpi4py examples/trainer_gpt2.py --output-dir run --save-steps 50
    mpiexec -n 4 python -m mpi4py examples/trainer_gpt2.py --output-dir run --resume
    torchrun --standalone --nproc-per-node 2 examples/trainer_gpt2.py --max-steps 200

``--resume`` continues from the newest checkpoint in ``--output-dir`` (saved at any number of
ranks: at as many as before, the run goes on bit for bit). ``--stop-on-signal``: a SIGTERM or
SIGUSR1 to any rank saves a checkpoint after the step in progress and stops (Slurm's
``--signal=USR1@60``). ``--log-history FILE`` writes Trainer's log history (JSON, rank 0).
"""

import argparse
import json
import os
from pathlib import Path
from pydoc_data.topics import topics

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

TORCHRUN = "LOCAL_RANK" in os.environ  # launched by torchrun: Trainer's own DDP, to compare
if not TORCHRUN:
    from zero1_mpi.transformers import ZeroTrainer  # zero1_mpi

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--max-steps", type=int, default=100)
parser.add_argument("--context", type=int, default=64, help="characters per sequence")
parser.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-batch")
parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--dim", type=int, default=128)
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--warmup", type=int, default=10)
parser.add_argument("--eval-steps", type=int, default=50)
parser.add_argument("--eval-size", type=int, default=64, help="sequences held out to evaluate")
parser.add_argument("--output-dir", default="trainer_gpt2_output")
parser.add_argument("--save-steps", type=int, default=0, help="0: no checkpoints")
parser.add_argument("--resume", action="store_true", help="from the newest checkpoint")
parser.add_argument("--stop-on-signal", action="store_true")
parser.add_argument("--log-history", metavar="FILE")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

# ---- data: the text cut into sequences of --context characters ------------------------------

TEXT = "\n\n".join(topics[key] for key in sorted(topics))
CHARS = sorted(set(TEXT))
STOI = {c: i for i, c in enumerate(CHARS)}
ids = torch.tensor([STOI[c] for c in TEXT])
sequences = ids[: len(ids) // args.context * args.context].view(-1, args.context)


class Sequences(torch.utils.data.Dataset):
    """Each item a causal-LM example: the model shifts ``labels`` by one itself."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


train_dataset = Sequences(sequences[: -args.eval_size])
eval_dataset = Sequences(sequences[-args.eval_size :])

# ---- the model and the Trainer ---------------------------------------------------------------

torch.manual_seed(args.seed)
config = GPT2Config(vocab_size=len(CHARS), n_positions=args.context, n_embd=args.dim,
                    n_layer=args.layers, n_head=args.heads,
                    bos_token_id=None, eos_token_id=None)
model = GPT2LMHeadModel(config)
training_args = TrainingArguments(
    output_dir=args.output_dir,
    max_steps=args.max_steps,
    per_device_train_batch_size=args.batch,
    per_device_eval_batch_size=args.batch,
    gradient_accumulation_steps=args.grad_accum,
    learning_rate=args.lr,
    weight_decay=0.1,
    lr_scheduler_type="cosine",
    warmup_steps=args.warmup,
    max_grad_norm=1.0,
    logging_steps=1,
    eval_strategy="steps",
    eval_steps=args.eval_steps,
    save_strategy="steps" if args.save_steps else "no",
    save_steps=args.save_steps or 500,
    seed=args.seed,
    report_to="none",
    disable_tqdm=True,
    use_cpu=not torch.cuda.is_available(),
    ddp_backend="gloo" if TORCHRUN and not torch.cuda.is_available() else None,
)
if TORCHRUN:
    trainer_class, zero1_mpi_arguments = Trainer, {}
else:
    trainer_class = ZeroTrainer  # zero1_mpi (was: Trainer)
    signals = ("SIGTERM", "SIGUSR1") if args.stop_on_signal else None
    zero1_mpi_arguments = {"stop_signals": signals}  # zero1_mpi
trainer = trainer_class(
    model=model,
    args=training_args,
    train_dataset=train_dataset,
    eval_dataset=eval_dataset,
    **zero1_mpi_arguments,
)
trainer.train(resume_from_checkpoint=args.resume or None)
metrics = trainer.evaluate()  # the same on every rank
if trainer.is_world_process_zero():
    print(f"eval loss {metrics['eval_loss']:.4f} after {trainer.state.global_step} steps")
    if args.log_history:
        Path(args.log_history).write_text(json.dumps(trainer.state.log_history) + "\n")
if trainer.state.global_step < args.max_steps:  # stopped by a signal
    if trainer.is_world_process_zero():
        print(f"stopped at step {trainer.state.global_step}: go on with --resume")
else:
    trainer.save_model()  # rank 0 writes it
if TORCHRUN and torch.distributed.is_initialized():
    # torch's own DDP: end its gloo group before exit (left to the interpreter's exit, its
    # threads can abort a rank: "terminate called without an active exception")
    torch.distributed.destroy_process_group()
