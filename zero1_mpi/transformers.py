"""transformers' ``Trainer`` under ``mpiexec -n N`` with zero1_mpi's sharded optimizer.

``ZeroTrainer`` takes ``Trainer``'s arguments (and ``comm``, ``zero_options``, ``stop_signals``):
a Trainer script trains with zero1_mpi by using it instead of ``Trainer`` and launching with
``mpiexec -n N python -m mpi4py script.py``. Each rank reads DDP rank r's batches, the
optimizer clips, saves its shards into ``<checkpoint>/zero1_optimizer`` and resumes at any N,
rank 0 alone logs and writes the rest, and every rank evaluates everything (the same metrics).
The constructor and the methods that train, evaluate or save must be called on all ranks;
argument errors are raised on every rank. What it overrides and why: ``ZeroTrainer``'s
docstring and docs/transformers.md. Imported only by its users (transformers, accelerate).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from typing import Any

import torch

try:
    import transformers
    from accelerate.data_loader import prepare_data_loader
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_pt_utils import reissue_pt_warnings
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"zero1_mpi.transformers needs transformers and accelerate ({exc}): "
        "pip install transformers accelerate"
    ) from exc

from .comm.capabilities import mpi_library
from .comm.communicator import Communicator
from .torch import ZeroOptimizer

__all__ = [
    "ZeroTrainer",
    "TrainerZeroOptimizer",
    "OPTIMIZER_DIR",
    "PRIVATE_HOOKS",
    "hide_launch",
    "check_import_order",
]

#: The subdirectory of a Trainer checkpoint that holds the sharded optimizer.
OPTIMIZER_DIR = "zero1_optimizer"
SCHEDULER_NAME, TORCH_OPTIMIZER_NAME = "scheduler.pt", "optimizer.pt"
#: An MPI launcher's size variables, which accelerate takes for its own multi-CPU launch (it
#: would start torch.distributed over them): hidden once MPI has read them (``hide_launch``).
LAUNCH_SIZES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
#: Trainer's private methods that ZeroTrainer overrides (checked to exist at construction).
PRIVATE_HOOKS = (
    "_clip_grad_norm",
    "_get_grad_norm",
    "_save_optimizer_and_scheduler",
    "_load_optimizer_and_scheduler",
    "_save_rng_state",
)
#: Arguments every rank must share (a difference would hang or split the run).
AGREED_ARGS = (
    "output_dir", "max_steps", "num_train_epochs", "per_device_train_batch_size",
    "gradient_accumulation_steps", "learning_rate", "weight_decay", "max_grad_norm",
    "lr_scheduler_type", "warmup_steps", "seed", "data_seed", "optim", "bf16",
    "logging_strategy", "logging_steps", "save_strategy", "save_steps", "eval_strategy",
    "eval_steps", "average_tokens_across_devices", "dataloader_drop_last",
)  # fmt: skip


class TrainerZeroOptimizer(ZeroOptimizer):
    """``ZeroOptimizer`` as accelerate takes it: already prepared (accelerate's wrapper would
    call ``state_dict()``), telling whether the last step was skipped (an overflow)."""

    _is_accelerate_prepared = True

    @property
    def step_was_skipped(self) -> bool:
        return self.last_step is not None and self.last_step.skipped


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` training with ``zero1_mpi`` on the ranks of ``comm``.

    Args:
        model, args, ...: ``Trainer``'s arguments, as they are.
        comm: an mpi4py intracommunicator (``MPI.COMM_WORLD`` when None).
        zero_options: for ``ZeroOptimizer`` (``rule``, ``shard_gradients``, ``reduce_dtype``,
            ``offload``, ...), over the AdamW options that ``args`` gives.
        stop_signals: signals (e.g. ``("SIGTERM", "SIGUSR1")``) that, arriving at any rank,
            make every rank save a Trainer checkpoint after the step in progress and stop.

    There is no ``torch.distributed``: accelerate sees one process and does not wrap the model
    in DDP (the optimizer averages the gradients). What must know the ranks is told:

    - ``args`` (the object given, in place: the script's ``args`` is ``trainer.args``) reads
      ``world_size``, ``process_index`` and ``local_process_index`` from MPI, so
      ``should_save``/``should_log``, the per-rank ``rng_state_<r>.pth``, the progress bar
      and the reporting integrations behave as under DDP. It pickles (``training_args.bin``)
      as the original class.
    - The train dataloader is accelerate's prepared for ``num_processes=N,
      process_index=rank``: each rank reads the batches DDP rank r reads under ``torchrun``.
    - The optimizer is a ``ZeroOptimizer`` over Trainer's two param groups with ``args``'
      AdamW options; clipping and the logged grad norm are ``opt.clip_grad_norm_``'s.
    - Loss: with ``average_tokens_across_devices`` the token count is summed over the ranks
      and the loss scaled by N, as under DDP; each micro-batch's loss is averaged over the
      ranks before Trainer accumulates it, so the logged loss is DDP's, on every rank.
    - Checkpoints: the optimizer saves its shards into ``<checkpoint>/zero1_optimizer`` on all
      ranks (loadable at any N, its param groups' ``lr`` as at the save); Trainer writes the
      rest, rank 0 alone, ``trainer_state.json`` after every rank's files are written.
      Resuming loads the parameters and optimizer state exactly at any N; at the same N the
      run goes on bit for bit (data, dropout RNG, schedule), at another N with its data order.
    - Evaluation: every rank evaluates the whole eval set (the same metrics everywhere).

    What cannot work is refused naming the fix (``_refusal``: fp16, DataParallel, a passed
    optimizer, ...). The private Trainer methods overridden (``PRIVATE_HOOKS``) are checked.
    """

    optimizer: Any  # Trainer's attribute: a TrainerZeroOptimizer once built

    def __init__(self, model=None, args=None, *rest, comm=None, zero_options=None,
                 stop_signals=None, **kwargs):  # fmt: skip
        #: The optimizer's communicator (mpi4py); ``comm`` (a ``Communicator``) serves the rest.
        self.mpi_comm = comm
        self.comm = Communicator(comm)
        self.zero_options = dict(zero_options or {})
        self.stop_signals = stop_signals
        args = TrainingArguments(output_dir="trainer_output") if args is None else args
        self.comm.agree(_refusal(args, model, rest, kwargs, self.zero_options))
        self.comm.check_same(
            {f"TrainingArguments.{key}": repr(getattr(args, key, None)) for key in AGREED_ARGS},
            "TrainingArguments",
            "give every rank the same arguments",
        )
        super().__init__(model, _ranked(args, self.comm), *rest, **kwargs)
        self.add_callback(_ZeroCallback(self))

    # -- the optimizer -----------------------------------------------------------------------

    def create_optimizer(self, model=None):
        """A ``ZeroOptimizer`` over Trainer's param groups (all ranks)."""
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": {n: p for n, p in named if (n in decay) == wanted}, "weight_decay": wd}
            for wanted, wd in ((True, self.args.weight_decay), (False, 0.0))
        ]
        args, options = self.args, dict(self.zero_options)
        rule = options.pop("rule", None)
        if rule is None:  # args.optim is AdamW (_refusal): its options
            betas, eps = (args.adam_beta1, args.adam_beta2), args.adam_epsilon
            rule, options = "adamw", {"betas": betas, "eps": eps, **options}
        groups = [g for g in groups if g["params"]]
        self.optimizer = TrainerZeroOptimizer(
            groups, rule, self.mpi_comm, module=model, lr=args.learning_rate, **options
        )
        return self.optimizer

    # (private: PRIVATE_HOOKS) The optimizer's own clipping, rather than accelerate's through
    # torch.nn.utils (which zero1_mpi.torch makes global): that sees no .grad with
    # shard_gradients, where it would log a norm of 0 and not clip.
    def _clip_grad_norm(self, model):
        return self.optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return self.optimizer.clip_grad_norm_(None) if grad_norm is None else grad_norm

    # -- data and loss -----------------------------------------------------------------------

    def get_train_dataloader(self):
        """Trainer's train dataloader, prepared by accelerate as for DDP rank ``rank`` of N."""
        acc = self.accelerator
        if acc.dispatch_batches:
            raise ValueError(
                "accelerator_config dispatch_batches=True reads the batches on rank 0 and "
                "sends them with torch.distributed, which mpiexec does not start: leave it unset"
            )

        def prepare(loader, device_placement=None, slice_fn_for_dispatch=None):
            placement = acc.device_placement if device_placement is None else device_placement
            return prepare_data_loader(
                loader, acc.device, num_processes=self.comm.size, process_index=self.comm.rank,
                split_batches=acc.split_batches, put_on_device=placement,
                rng_types=acc.rng_types.copy(), dispatch_batches=False,
                even_batches=acc.even_batches, use_seedable_sampler=acc.use_seedable_sampler,
                data_seed=acc.dataloader_config.data_seed, non_blocking=acc.non_blocking,
                use_stateful_dataloader=acc.use_stateful_dataloader,
            )  # fmt: skip

        acc.prepare_data_loader = prepare  # for the one call in Trainer's get_train_dataloader
        try:
            loader = super().get_train_dataloader()
        finally:
            del acc.prepare_data_loader
        self.comm.check_same(
            len(loader) if hasattr(loader, "__len__") else None,
            "the train dataloader's length",
            "give every rank the same train_dataset (each reads its own share of it)",
        )
        return loader

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Trainer's, with the token count summed over the ranks (as DDP's gather does)."""
        batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
        if count is not None and self.args.average_tokens_across_devices:
            total = float(self.comm.allreduce_sum([float(count)])[0])
            count = torch.as_tensor(total, dtype=getattr(count, "dtype", None))
            count = count.to(device)
        self._summed_count = count  # compute_loss scales the loss it divides by this
        return batches, count

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Trainer's; a training loss divided by the ranks' total token count is scaled by N,
        as Trainer scales it by DDP's world size (evaluation counts this rank's tokens)."""
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if (
            num_items_in_batch is not None
            and num_items_in_batch is getattr(self, "_summed_count", None)
            and (self.model_accepts_loss_kwargs or self.compute_loss_func)
        ):
            if return_outputs:
                return result[0] * self.comm.size, result[1]
            return result * self.comm.size
        return result

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's (under ``opt.no_sync()`` but for a step's last micro-batch), returning
        the loss averaged over the ranks (what Trainer logs under DDP)."""
        last = self.accelerator.sync_gradients
        with contextlib.nullcontext() if last else self.optimizer.no_sync():
            loss = super().training_step(model, inputs, num_items_in_batch)
        losses = torch.tensor(self.comm.allgather_objects(loss.item()), dtype=loss.dtype)
        return losses.mean().to(loss.device)

    # -- checkpoints -------------------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir):  # (private: PRIVATE_HOOKS)
        self.optimizer.save(os.path.join(output_dir, OPTIMIZER_DIR))  # each rank its shard
        if self.args.should_save:
            with warnings.catch_warnings(record=True) as caught:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            reissue_pt_warnings(caught)

    def _save_rng_state(self, output_dir):  # (private: PRIVATE_HOOKS)
        super()._save_rng_state(output_dir)  # rng_state_<rank>.pth
        self.comm.allgather_objects(None)  # every rank's files before trainer_state.json

    def _load_optimizer_and_scheduler(self, checkpoint):  # (private: PRIVATE_HOOKS)
        if checkpoint is None:
            return
        found = (
            os.path.isdir(os.path.join(checkpoint, OPTIMIZER_DIR)),
            os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)),
            os.path.isfile(os.path.join(checkpoint, TORCH_OPTIMIZER_NAME)),
        )
        seen = self.comm.allgather_objects(found)
        problem = None
        if len(set(seen)) > 1:
            problem = (
                f"the ranks see different files in {checkpoint} ({OPTIMIZER_DIR}/, scheduler.pt, "
                f"optimizer.pt by rank: {seen}): put output_dir on a file system every rank sees"
            )
        elif found[2] and not found[0]:
            problem = (
                f"{checkpoint} holds a torch optimizer.pt (a run without zero1_mpi), which the "
                "sharded optimizer cannot load: resume from a ZeroTrainer checkpoint, or start "
                "from the model alone (model.from_pretrained(checkpoint) and no resume)"
            )
        self.comm.agree(problem)
        if not (found[0] and found[1]):
            return  # as Trainer: nothing to load (save_only_model)
        self.optimizer.load(os.path.join(checkpoint, OPTIMIZER_DIR))  # param groups, lr too
        with warnings.catch_warnings(record=True) as caught:
            state = torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
            self.lr_scheduler.load_state_dict(state)
        reissue_pt_warnings(caught)


class _ZeroCallback(TrainerCallback):
    """Keeps each ``.grad`` a view of the gradient buffer after Trainer's ``model.zero_grad()``
    (no second copy of the gradients), and turns a stop signal into a checkpoint and a stop."""

    def __init__(self, trainer: ZeroTrainer):
        self.signals = trainer.stop_signals
        self.handler: Any = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        optimizer.zero_grad()
        if self.signals and self.handler is None:
            self.handler = optimizer.checkpoint_on_signal(None, signals=self.signals)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        optimizer.zero_grad()
        if optimizer.last_step is not None and optimizer.last_step.stop:
            control.should_save = control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.handler is not None:
            self.handler.close()
            self.handler = None


# -- the arguments ---------------------------------------------------------------------------

_RANKED: dict[type, type] = {}


def _ranked(args, comm):
    """``args``, its class made a subclass whose ranks are ``comm``'s (in place: the script's
    own ``args`` and ``trainer.args`` are one object)."""
    base = getattr(type(args), "_zero1_base", type(args))
    cls = _RANKED.get(base)
    if cls is None:
        cls = _RANKED[base] = type(f"Ranked{base.__name__}", (base,), {
            "_zero1_base": base, "__module__": __name__,
            "world_size": property(lambda self: self._zero1_comm.size),
            "process_index": property(lambda self: self._zero1_comm.rank),
            "local_process_index": property(lambda self: self._zero1_local_rank),
            "main_process_first": _main_process_first, "__reduce_ex__": _reduce_as_base,
        })  # fmt: skip
    # the user's own object, not a copy: an args kept by the script reads the same ranks
    args.__class__, args._zero1_comm, args._zero1_local_rank = cls, comm, comm.node_rank()
    return args


@contextlib.contextmanager
def _main_process_first(self, local=True, desc="work"):
    """``TrainingArguments.main_process_first`` over MPI: the main process first, then the
    others (all ranks)."""
    main = (self.local_process_index if local else self.process_index) == 0
    if not main:
        self._zero1_comm.allgather_objects(None)  # waits for the main process's
    try:
        yield
    finally:
        if main:
            self._zero1_comm.allgather_objects(None)


def _reduce_as_base(self, protocol):
    """Pickle (``training_args.bin``) and copy as the original arguments class."""
    state = {k: v for k, v in vars(self).items() if not k.startswith("_zero1")}
    return object.__new__, (self._zero1_base,), state


def _refusal(args, model, rest, kwargs, zero_options) -> str | None:
    """Why ZeroTrainer cannot train with these arguments (the fix included), or None."""
    given = inspect.signature(Trainer.__init__).bind(None, model, args, *rest, **kwargs)
    optimizers = given.arguments.get("optimizers") or (None, None)
    cls_kwargs = given.arguments.get("optimizer_cls_and_kwargs")
    if optimizers[0] is not None:
        return "optimizers=(optimizer, ...): ZeroTrainer builds its own ZeroOptimizer from " \
            "args (and zero_options=): pass optimizers=(None, scheduler) or nothing"  # fmt: skip
    adamw = ("adamw_torch", "adamw_torch_fused")
    if not (zero_options.get("rule") or (args.optim in adamw and cls_kwargs is None)):
        return (
            f"optim={args.optim!r}: ZeroTrainer shards AdamW from args (optim="
            "'adamw_torch' or 'adamw_torch_fused'); for another rule pass zero_options="
            "{'rule': 'sgd' | 'lion' | 'lamb' | ..., <its options>}"
        )
    if args.fp16:
        return (
            "fp16=True: torch's GradScaler checks overflow on each rank alone, so ranks "
            "would disagree on skipping a step: use bf16=True, or zero_options="
            "{'param_dtype': 'float16', 'loss_scale': 'dynamic'} (zero1_mpi's own scaling)"
        )
    if args.deepspeed or args.fsdp:
        return "deepspeed/fsdp: ZeroTrainer is the sharding; leave deepspeed and fsdp unset"
    if args.enable_jit_checkpoint:
        return (
            "enable_jit_checkpoint=True: its SIGTERM flag is per process, so one rank "
            "would save alone; use ZeroTrainer(..., stop_signals=('SIGTERM',)) instead"
        )
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return (
            "torch.distributed is initialized (launched by torchrun?): launch ZeroTrainer "
            "with mpiexec -n N python -m mpi4py script.py, or use Trainer under torchrun"
        )
    if args.n_gpu > 1:
        return (
            f"this rank sees {args.n_gpu} GPUs, which Trainer would use with DataParallel: "
            "give each rank one GPU (CUDA_VISIBLE_DEVICES=<node-local rank>)"
        )
    missing = [name for name in PRIVATE_HOOKS if not hasattr(Trainer, name)]
    if missing:
        return f"transformers {transformers.__version__}'s Trainer lacks {missing}: use 5.x"
    return None


def check_import_order() -> None:
    """A RuntimeError (not an ImportError, which optional-dependency guards would take for
    "not installed") if torch.distributed was started before this module was imported (and
    torchrun did not launch this process): a ``TrainingArguments(...)`` built before the
    import, under ``mpiexec`` with ``MASTER_ADDR`` set, starts it for accelerate, and without
    ``MASTER_ADDR`` fails there with torch's "MASTER_ADDR expected" before zero1_mpi runs."""
    import torch.distributed as dist

    if "LOCAL_RANK" in os.environ or not (dist.is_available() and dist.is_initialized()):
        return
    raise RuntimeError(
        "zero1_mpi.transformers was imported after torch.distributed had started (a "
        "TrainingArguments(...) built before this import starts it under mpiexec): import "
        "zero1_mpi.transformers before building TrainingArguments (the same order avoids "
        "torch's 'MASTER_ADDR expected' error at TrainingArguments(...)); see "
        "docs/transformers.md"
    )


def hide_launch(environ=os.environ) -> list[str]:
    """Remove ``LAUNCH_SIZES`` from ``environ`` after starting MPI (which reads them), unless
    torchrun launched this process; returns the names removed. Run when this module is
    imported: ``TrainingArguments(use_cpu=True)`` would otherwise start torch.distributed."""
    found = [name for name in LAUNCH_SIZES if name in environ]
    if not found or "LOCAL_RANK" in environ:
        return []
    mpi_library()  # imports mpi4py.MPI, which starts MPI
    for name in found:
        del environ[name]
    return found


check_import_order()
hide_launch()
