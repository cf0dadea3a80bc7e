"""Sharded checkpoints and consolidated exports across world sizes, crashes and bad files."""

import re

import pytest

from mpirun import run_mpi
from zero1_mpi.checkpoint import MANIFEST, MANIFEST_DIGEST, plan_reads

MANIFEST_FILES = (MANIFEST, MANIFEST_DIGEST)

RANKS = [1, 2, 3, 4]


def test_every_world_size_loads_every_other(tmp_path):
    for n in RANKS:
        run_mpi(n, "checkpoint.py", "save", str(tmp_path / f"N{n}"))
    for m in RANKS:
        out = run_mpi(m, "checkpoint.py", "load", str(tmp_path), timeout=300).stdout
        assert f"OK checkpoints: {2 * len(RANKS)} loads on {m} ranks" in out


def assert_killed_at(moment: str, n: int, out: str) -> None:
    """The crash case's ``KILLED at <moment>: <what was on disk>`` line shows the kill
    happened at that point of the save of step 5, with step 3's checkpoint still LATEST."""
    found = re.search(rf"^KILLED at {moment}: (.*); LATEST=(\S+)$", out, re.MULTILINE)
    assert found, out
    entries = dict(re.findall(r"(\S+)/\[([^\]]*)\]", found.group(1)))
    assert found.group(2).startswith("ckpt-00000003-") and found.group(2) in entries, out
    shards = {f"shard-{r:05d}.npy" for r in range(n)}
    tmp = [files.split() for name, files in entries.items() if name.startswith(".tmp-00000005-")]
    new = [files.split() for name, files in entries.items() if name.startswith("ckpt-00000005-")]
    complete = shards | set(MANIFEST_FILES)
    if moment in ("mid-shard", "background"):  # the last rank's file is being written
        assert len(tmp) == 1 and f"shard-{n - 1:05d}.npy" in tmp[0], out
        assert not set(MANIFEST_FILES) & set(tmp[0]) and not new, out
    elif moment == "before-rename":  # everything written, not yet renamed into place
        assert len(tmp) == 1 and set(tmp[0]) == complete and not new, out
    else:  # renamed into place, but LATEST still names the old checkpoint
        assert not tmp and len(new) == 1 and set(new[0]) == complete, out


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("moment", ["mid-shard", "background", "before-rename",
                                    "before-latest"])
def test_a_job_killed_while_saving_leaves_the_previous_checkpoint(tmp_path, n, moment):
    run_mpi(n, "checkpoint_crash.py", "prepare", str(tmp_path))
    crashed = run_mpi(n, "checkpoint_crash.py", "crash", str(tmp_path), moment, check=False,
                      timeout=120)
    assert crashed.returncode != 0 and "UNREACHABLE" not in crashed.stdout
    record = tmp_path / "KILLED"  # the killed rank's record, also when its stdout is lost
    assert_killed_at(moment, n, crashed.stdout + (record.read_text() if record.exists() else ""))
    out = run_mpi(n, "checkpoint_crash.py", "check", str(tmp_path)).stdout
    assert f"OK crash recovery on {n} ranks" in out


@pytest.mark.parametrize("n", RANKS)
def test_bad_checkpoints_are_refused_on_every_rank(tmp_path, n):
    out = run_mpi(n, "checkpoint_errors.py", str(tmp_path), timeout=120).stdout
    assert f"OK bad checkpoints: 17 cases on {n} ranks" in out


def test_plan_reads_maps_saved_ranges_onto_owned_ones():
    # Saved by 2 ranks with two buckets each; now owned: [5, 25) starting at state 0, and
    # [40, 44) starting at state 20.
    files = [{"file": "shard-00000.npy", "ranges": [[0, 10], [20, 30]]},
             {"file": "shard-00001.npy", "ranges": [[10, 20], [30, 44]]}]
    reads = plan_reads([(5, 25, 0), (40, 44, 20)], files)
    assert sorted(reads) == sorted([
        ("shard-00000.npy", 5, 5, 10, 0),     # column 5 of file 0 holds flat 5
        ("shard-00000.npy", 10, 20, 25, 15),  # its second range starts at column 10
        ("shard-00001.npy", 0, 10, 20, 5),
        ("shard-00001.npy", 10 + 10, 40, 44, 20),
    ])
    assert sum(hi - lo for _, _, lo, hi, _ in reads) == 20 + 4


def test_the_export_is_a_safetensors_file(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    np = pytest.importorskip("numpy")
    from mpi4py import MPI

    from zero1_mpi import ZeroAdamW

    init = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "s": np.float32(2.0)}
    opt = ZeroAdamW(init, MPI.COMM_SELF, param_dtype="bfloat16")  # a NumPy scalar is 0-d
    for _ in range(2):
        opt.grads["w"][...] = 1.0
        opt.step()
    opt.save_consolidated(tmp_path / "state.safetensors")
    loaded = safetensors_numpy.load_file(tmp_path / "state.safetensors")
    assert sorted(loaded) == sorted(f"{kind}/{name}" for kind in ("master", "exp_avg",
                                                                  "exp_avg_sq") for name in init)
    for t in opt.layout.tensors:
        flat = slice(t.offset, t.offset + t.numel)  # one rank: state index == flat index
        assert np.array_equal(loaded[f"master/{t.name}"].reshape(-1), opt.state.master[flat])
        assert np.array_equal(loaded[f"exp_avg_sq/{t.name}"].reshape(-1),
                              opt.state.state["exp_avg_sq"][flat])
        assert loaded[f"exp_avg/{t.name}"].shape == t.shape
    assert loaded["exp_avg/w"].min() > 0 and not loaded["exp_avg/s"].any()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_export_holds_the_reference_state_and_reloads_keep_scaler_and_options(tmp_path, n):
    out = run_mpi(n, "checkpoint_content.py", str(tmp_path), timeout=180).stdout
    assert f"OK checkpoint content on {n} ranks" in out


@pytest.mark.mpi_independent
def test_every_byte_of_a_shard_header_changed_is_a_checkpoint_error(tmp_path):
    """A changed byte in a shard's .npy header can make NumPy's header parser raise
    SyntaxError or tokenize.TokenError: load() must turn whatever it is into CheckpointError
    (raised on every rank by its agreement), never let it escape on one rank."""
    import numpy as np
    from mpi4py import MPI

    from zero1_mpi import CheckpointError, ZeroSGD
    opt = ZeroSGD({"w": np.ones((3, 5), np.float32)}, MPI.COMM_SELF, lr=0.1)
    shard = opt.save(tmp_path) / "shard-00000.npy"
    data = shard.read_bytes()
    header = data.index(b"}") + 1  # the header dict ends here; the data follows the padding
    for i in range(header):
        shard.write_bytes(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:])
        with pytest.raises(CheckpointError):
            opt.load(tmp_path)
