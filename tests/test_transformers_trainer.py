"""zero1_mpi.transformers.ZeroTrainer: transformers' Trainer under mpiexec (skipped where
transformers is not installed, failed instead where ``ZERO1_REQUIRE_TRANSFORMERS=1``, as in CI).

- examples/trainer_gpt2.py on 2 ranks logs the losses, grad norms, learning rates and eval
  losses of the same script under ``torchrun`` (Trainer's own DDP, gloo), step by step, with
  gradient accumulation and clipping that bites.
- tests/cases/trainer_gpt2.py (a tiny GPT-2, token counts that differ between ranks, dropout):
  a run stopped by SIGUSR1 on one rank checkpoints at a step boundary and, resumed in a new
  job (overlapped), goes on with an uninterrupted run's losses and ends with its optimizer
  state, bit for bit; a 2-rank checkpoint loads on 1 rank exactly (into stage 2); rank 0
  alone writes and logs; every rank evaluates to the same metrics; arguments that differ
  between ranks are refused on each.
- In one process: the refusals, the private Trainer methods relied on, the arguments' copy.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import signal
import subprocess
import sys

import numpy as np
import pytest

from mpirun import ROOT, run_mpi

REQUIRED = os.environ.get("ZERO1_REQUIRE_TRANSFORMERS") == "1"
try:
    import accelerate  # noqa: F401
    import torch
    import transformers
except ImportError as exc:
    if REQUIRED:
        raise ImportError("ZERO1_REQUIRE_TRANSFORMERS=1 but transformers does not import: "
                          "pip install torch transformers accelerate") from exc
    pytest.skip(f"transformers is not installed: {exc}", allow_module_level=True)

from safetensors.numpy import load_file  # noqa: E402 (after the skip)

EXAMPLE = "examples/trainer_gpt2.py"
LAUNCH = "mpiexec -n 2 python -m mpi4py examples/trainer_gpt2.py"
TINY = ("--max-steps", "10", "--layers", "2", "--dim", "32", "--heads", "2", "--context", "32",
        "--batch", "4", "--grad-accum", "2", "--warmup", "3", "--eval-steps", "5",
        "--eval-size", "16")


def torchrun(n: int, script: str, *args: str, timeout: float = 300) -> str:
    """``script`` under ``torchrun --standalone`` (a free port) on ``n`` CPU processes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "MV2_"))}
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
                "OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", script, *args]
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, _ = job.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s\n{out}")
    assert job.returncode == 0, f"{' '.join(cmd)} exited with {job.returncode}\n{out}"
    return out


def history(path) -> list[dict]:
    return json.loads(path.read_text())


def steps(log: list[dict], key: str = "loss") -> dict[int, float]:
    return {entry["step"]: entry[key] for entry in log if key in entry}


@pytest.mark.mpi_independent
def test_example_opens_with_its_launch_command():
    doc = ast.get_docstring(ast.parse((ROOT / EXAMPLE).read_text(encoding="utf-8")))
    assert doc.splitlines()[0].strip() == LAUNCH


def test_example_logs_the_losses_of_trainer_under_torchrun(tmp_path):
    """The same script, arguments and 2 ranks: ZeroTrainer under mpiexec, Trainer's DDP under
    torchrun. Per-step loss within 1e-5 relative (fp32); clipping bites (grad norm > 1)."""
    ours, ddp = tmp_path / "ours.json", tmp_path / "ddp.json"
    out = run_mpi(2, EXAMPLE, *TINY, "--output-dir", str(tmp_path / "ours"),
                  "--log-history", str(ours), timeout=240).stdout
    assert "eval loss " in out, out
    torchrun(2, EXAMPLE, *TINY, "--output-dir", str(tmp_path / "ddp"), "--log-history", str(ddp))
    ours, ddp = history(ours), history(ddp)
    assert sorted(steps(ours)) == sorted(steps(ddp)) == list(range(1, 11))
    for key, rel in (("loss", 1e-5), ("grad_norm", 1e-5), ("learning_rate", 1e-12)):
        mine, theirs = steps(ours, key), steps(ddp, key)
        assert [mine[s] for s in mine] == pytest.approx([theirs[s] for s in mine], rel=rel), key
    assert max(steps(ours, "grad_norm").values()) > 1.0  # max_grad_norm=1.0 clips
    assert steps(ours, "eval_loss") == pytest.approx(steps(ddp, "eval_loss"), rel=1e-5)
    assert steps(ours)[10] < steps(ours)[1] - 0.2  # it learns
    assert (tmp_path / "ours" / "model.safetensors").exists()


def case(n: int, out, *args: str, **kwargs):
    return run_mpi(n, "trainer_gpt2.py", "--out", str(out), *args, timeout=240, **kwargs).stdout


def state(path) -> dict:
    return load_file(str(path))


def same_state(a, b) -> bool:
    a, b = state(a), state(b)
    return a.keys() == b.keys() and all(
        np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """8 steps on 2 ranks, checkpoints at 4 and 8, the optimizer's state dumped at each."""
    root = tmp_path_factory.mktemp("uninterrupted")
    stdout = case(2, root / "out", "--dump", str(root / "run.json"),
                  "--consolidated", str(root / "state"))
    return root, stdout, json.loads((root / "run.json").read_text())


def test_rank_0_alone_logs_and_writes_and_every_rank_evaluates_alike(uninterrupted):
    root, stdout, run = uninterrupted
    assert run["step"] == 8
    logged = [line for line in stdout.splitlines() if line.startswith("{'loss'")]
    assert len(logged) == 8, stdout  # each step's log printed once, not once per rank
    checkpoint = root / "out" / "checkpoint-4"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "rng_state_0.pth",
        "rng_state_1.pth", "scheduler.pt", "trainer_state.json", "training_args.bin",
        run["optimizer_dir"]]
    for rank, written in enumerate(run["writes"][1:], 1):  # the other ranks' files
        for path in written:
            assert f"/{run['optimizer_dir']}/" in path or path.endswith(
                f"rng_state_{rank}.pth"), (rank, path)
    assert any(path.endswith("model.safetensors") for path in run["writes"][0])
    evals = run["evals"]
    assert len(evals) == 2 and evals[0]["eval_loss"] == evals[1]["eval_loss"]
    assert steps(run["log_history"], "eval_loss").keys() == {4, 8}
    args = torch.load(checkpoint / "training_args.bin", weights_only=False)
    assert type(args) is transformers.TrainingArguments  # the ranks' copy pickles as its base


def test_a_signal_checkpoints_and_the_resumed_run_is_the_uninterrupted_one(uninterrupted,
                                                                          tmp_path):
    """SIGUSR1 to the last rank as step 3 begins: every rank stops after step 3 with a Trainer
    checkpoint; a new job (resume_from_checkpoint=True, overlapped reductions this time) goes
    on to step 8 with the uninterrupted run's losses and ends with its optimizer state, bit
    for bit."""
    root, _, full = uninterrupted
    case(2, tmp_path / "out", "--signal-at", "3", "--dump", str(tmp_path / "stopped.json"))
    stopped = json.loads((tmp_path / "stopped.json").read_text())
    assert stopped["step"] == 3
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["checkpoint-3"]
    case(2, tmp_path / "out", "--resume", "--zero", "overlap", "--dump",
         str(tmp_path / "resumed.json"), "--consolidated", str(tmp_path / "state"))
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    for key in ("loss", "grad_norm", "learning_rate", "eval_loss"):
        assert steps(resumed["log_history"], key) == steps(full["log_history"], key), key
    assert same_state(tmp_path / "state" / "end-8.safetensors",
                      root / "state" / "end-8.safetensors")


def test_a_2_rank_checkpoint_loads_exactly_on_1_rank(uninterrupted, tmp_path):
    """The optimizer state and parameters loaded on 1 rank are those saved on 2, bit for bit,
    also into stage 2 (shard_gradients); the run goes on (its own data order) at the
    schedule's learning rates, its grad norms the optimizer's (accelerate's would be 0)."""
    root, _, full = uninterrupted
    (tmp_path / "out").mkdir()
    os.symlink(root / "out" / "checkpoint-4", tmp_path / "out" / "checkpoint-4")
    case(1, tmp_path / "out", "--resume", "--zero", "shard_gradients", "--dump",
         str(tmp_path / "one.json"), "--consolidated", str(tmp_path / "state"))
    assert same_state(tmp_path / "state" / "begin-4.safetensors",
                      root / "state" / "save-4.safetensors")
    one = json.loads((tmp_path / "one.json").read_text())
    assert one["step"] == 8
    assert steps(one["log_history"], "learning_rate") == steps(full["log_history"],
                                                                "learning_rate")
    assert all(np.isfinite(list(steps(one["log_history"]).values())))
    assert min(steps(one["log_history"], "grad_norm").values()) > 0.1


def test_arguments_that_differ_between_ranks_are_refused_on_every_rank(tmp_path):
    out = case(2, tmp_path / "out", "--mismatch")
    for rank in (0, 1):
        assert f"rank {rank} refused: CollectiveError: TrainingArguments.max_steps ('8' on " \
               "rank 0, '9' on rank 1) differs between ranks" in out, out


# -- in one process --------------------------------------------------------------------------

from mpi4py import MPI  # noqa: E402

from zero1_mpi.transformers import PRIVATE_HOOKS, ZeroTrainer, hide_launch  # noqa: E402


@pytest.mark.mpi_independent
def test_importing_the_package_imports_no_transformers():
    code = "import sys, zero1_mpi; print(sorted({'transformers', 'accelerate'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.mpi_independent
def test_the_private_trainer_methods_relied_on_exist():
    """ZeroTrainer overrides these private methods of Trainer: a transformers release that
    renames one fails here (and ZeroTrainer refuses to start, naming it)."""
    for name in PRIVATE_HOOKS:
        assert callable(getattr(transformers.Trainer, name, None)), name


def tiny_model():
    config = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1,
                                     n_head=2, bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(config)


def arguments(tmp_path, **kwargs):
    return transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                          report_to="none", **kwargs)


@pytest.mark.mpi_independent
@pytest.mark.parametrize("kwargs, trainer_kwargs, text", [
    ({"optim": "sgd"}, {}, "zero_options={'rule'"),
    ({"enable_jit_checkpoint": True}, {}, "stop_signals=('SIGTERM',)"),
    ({}, {"optimizers": "given"}, "ZeroTrainer builds its own ZeroOptimizer"),
])
def test_what_cannot_work_is_refused_with_the_fix(tmp_path, kwargs, trainer_kwargs, text):
    model = tiny_model()
    if trainer_kwargs.get("optimizers") == "given":
        trainer_kwargs = {"optimizers": (torch.optim.SGD(model.parameters(), lr=0.1), None)}
    with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
        ZeroTrainer(model=model, args=arguments(tmp_path, **kwargs), comm=MPI.COMM_SELF,
                    **trainer_kwargs)


@pytest.mark.mpi_independent
def test_the_trainer_s_arguments_know_the_ranks_and_pickle_as_the_user_s(tmp_path):
    args = arguments(tmp_path)
    base = type(args)
    trainer = ZeroTrainer(model=tiny_model(), args=args, comm=MPI.COMM_SELF)
    assert trainer.args is args and isinstance(args, base)  # the script's own args, in place
    assert (trainer.args.world_size, trainer.args.process_index) == (1, 0)
    assert trainer.args.should_save and trainer.is_world_process_zero()
    assert type(pickle.loads(pickle.dumps(trainer.args))) is base
    with trainer.args.main_process_first():
        pass


def test_the_script_s_args_read_the_mpi_ranks_on_every_rank():
    """tests/cases/trainer_args.py: the args a script built and handed to ZeroTrainer tell each
    of 2 ranks its MPI rank and the world size, as trainer.args does (they are one object)."""
    out = run_mpi(2, "trainer_args.py", timeout=180).stdout
    assert "OK the script's TrainingArguments know the ranks on 2 ranks" in out, out


@pytest.mark.mpi_independent
def test_importing_after_torch_distributed_started_names_the_order(tmp_path):
    """A TrainingArguments built before the import under mpiexec (with MASTER_ADDR set) has
    started torch.distributed: importing zero1_mpi.transformers then says what to do."""
    code = (
        "import torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'rdv'}', rank=0, "
        "world_size=1)\n"
        "try:\n"
        "    import zero1_mpi.transformers\n"
        "except RuntimeError as exc:\n"
        "    print('RAISED', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env={**env, "PYTHONPATH": str(ROOT)})
    assert "RAISED zero1_mpi.transformers was imported after torch.distributed" in done.stdout, \
        done.stdout + done.stderr
    assert "import zero1_mpi.transformers before building TrainingArguments" in done.stdout


@pytest.mark.mpi_independent
def test_the_launcher_s_size_variables_are_hidden_from_accelerate_unless_torchrun():
    environ = {"PMI_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "2", "PATH": "x"}
    assert hide_launch(environ) == ["PMI_SIZE", "OMPI_COMM_WORLD_SIZE"]
    assert environ == {"PATH": "x"}
    torchrun_environ = {"PMI_SIZE": "2", "LOCAL_RANK": "0"}
    assert hide_launch(torchrun_environ) == [] and "PMI_SIZE" in torchrun_environ
