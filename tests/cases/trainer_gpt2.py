"""zero1_mpi.transformers.ZeroTrainer on N ranks: a tiny GPT-2 trained by transformers' Trainer.

One run per job, its arguments from the command line; tests/test_transformers_trainer.py
launches several and compares them. Rank 0 writes ``--dump`` (JSON): Trainer's log history,
every rank's evaluation metrics and every rank's list of the files it wrote outside the
optimizer's shards (recorded by wrapping the writers Trainer uses: ``open`` for writing,
``torch.save``, safetensors' ``save_file``). ``--consolidated DIR`` writes the optimizer's full
state (``save_consolidated``) at each checkpoint (``save-<step>``), after a resume has loaded
(``begin-<step>``) and at the end (``end-<step>``). ``--signal-at K``: the last rank sends
itself SIGUSR1 as step K begins (``stop_signals``); ``--mismatch``: the last rank asks for
one more step, which every rank refuses; ``--zero overlap`` / ``--zero shard_gradients``:
``zero_options``. The labels of some tokens are -100, so the
ranks' token counts differ; dropout is on, so the RNG states matter.
"""

import argparse
import builtins
import json
import os
import signal
from pathlib import Path

import safetensors.torch
import torch
import transformers.modeling_utils
from mpi4py import MPI
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from zero1_mpi.transformers import OPTIMIZER_DIR, ZeroTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-steps", type=int, default=4)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--signal-at", type=int)
parser.add_argument("--dump")
parser.add_argument("--consolidated")
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--zero", action="append", default=[], choices=["overlap", "shard_gradients"],
                    help="zero_options={<this>: True}")
parser.add_argument("--mismatch", action="store_true",
                    help="the last rank asks for one more step: refused on every rank")
args = parser.parse_args()
comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
torch.set_num_threads(1)

written = []  # files this rank wrote (ranks > 0 should write only their shards and RNG state)


def recording(write, path_of):
    def wrapper(*a, **k):
        written.append(os.fspath(path_of(*a, **k)))
        return write(*a, **k)
    return wrapper


real_open = builtins.open
builtins.open = lambda file, mode="r", *a, **k: (
    written.append(os.fspath(file)) if isinstance(file, (str, os.PathLike))
    and any(m in mode for m in "wax+") else None) or real_open(file, mode, *a, **k)
torch.save = recording(torch.save, lambda obj, f, *a, **k: f)
safetensors.torch.save_file = recording(safetensors.torch.save_file, lambda t, f, *a, **k: f)
transformers.modeling_utils.safe_save_file = recording(
    transformers.modeling_utils.safe_save_file, lambda t, f, *a, **k: f)

# ---- data: characters of Python's documentation, some labels masked --------------------------

from pydoc_data.topics import topics  # noqa: E402

TEXT = "".join(topics[key] for key in sorted(topics))[:20000]
CHARS = sorted(set(TEXT))
IDS = torch.tensor([CHARS.index(c) for c in TEXT])
CONTEXT = 16


class Rows(torch.utils.data.Dataset):
    def __init__(self, start, count, masked):
        self.rows = IDS[start * CONTEXT:(start + count) * CONTEXT].view(count, CONTEXT)
        self.masked = masked

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        labels = self.rows[i].clone()
        if self.masked:
            labels[: i % 4] = -100  # a different token count per sequence
        return {"input_ids": self.rows[i], "labels": labels}


# ---- the run -------------------------------------------------------------------------------


class Probe(TrainerCallback):
    """The test's hooks: the signal, and the optimizer's state at the points compared."""

    def dump_state(self, optimizer, name):
        if args.consolidated:
            Path(args.consolidated).mkdir(exist_ok=True)
            optimizer.save_consolidated(os.path.join(args.consolidated, name + ".safetensors"))

    def on_train_begin(self, a, state, control, optimizer=None, **kwargs):
        if state.global_step:
            self.dump_state(optimizer, f"begin-{state.global_step}")

    def on_step_begin(self, a, state, control, **kwargs):
        if state.global_step + 1 == args.signal_at and rank == size - 1:
            os.kill(os.getpid(), signal.SIGUSR1)

    def on_save(self, a, state, control, optimizer=None, **kwargs):
        self.dump_state(optimizer, f"save-{state.global_step}")

    def on_train_end(self, a, state, control, optimizer=None, **kwargs):
        self.dump_state(optimizer, f"end-{state.global_step}")


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=len(CHARS), n_positions=CONTEXT, n_embd=32,
                                   n_layer=2, n_head=2, bos_token_id=None,
                                   eos_token_id=None))
steps = args.steps + (args.mismatch and rank == size - 1)
training_args = TrainingArguments(
    output_dir=args.out, max_steps=steps, per_device_train_batch_size=4,
    per_device_eval_batch_size=4, gradient_accumulation_steps=args.accumulate,
    learning_rate=3e-3, weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=2,
    max_grad_norm=0.5, logging_steps=1, eval_strategy="steps", eval_steps=4,
    save_strategy="steps", save_steps=args.save_steps, seed=0, report_to="none",
    disable_tqdm=True, use_cpu=True,
)
try:
    trainer = ZeroTrainer(
        model=model, args=training_args, train_dataset=Rows(0, 40, True),
        eval_dataset=Rows(40, 8, False), callbacks=[Probe()], stop_signals=("SIGUSR1",),
        zero_options=dict.fromkeys(args.zero, True),
    )
except Exception as exc:
    if not args.mismatch:
        raise
    print(f"rank {rank} refused: {type(exc).__name__}: {exc}", flush=True)
    raise SystemExit(0) from None
trainer.train(resume_from_checkpoint=True if args.resume else None)
metrics = trainer.evaluate()

evals = comm.gather(metrics)
writes = comm.gather(written)
if rank == 0:
    print(f"OK trainer: step {trainer.state.global_step} on {size} ranks")
    if args.dump:
        Path(args.dump).write_text(json.dumps({
            "log_history": trainer.state.log_history, "evals": evals, "writes": writes,
            "optimizer_dir": OPTIMIZER_DIR, "step": trainer.state.global_step,
        }))
