"""Sharded checkpoints and consolidated exports of every rule across world sizes, what they hold,
crashes while saving and bad files refused on every rank."""

import re
import shutil

import pytest

from casekit import shard_arrays, state_rows
from mpirun import SIBLING, run_mpi
from zero1_mpi.persistence.checkpoint import plan_reads
from zero1_mpi.persistence.manifest import MANIFEST, MANIFEST_DIGEST
from zero1_mpi.rules.registry import builtin_rules

MANIFEST_FILES = (MANIFEST, MANIFEST_DIGEST)


@pytest.mark.mpi_independent  # the loads at another N: cases/exits.py's, in every MPI's pass
def test_every_rules_checkpoints_load_on_other_world_sizes(tmp_path):
    """Saved on 1 and 4 ranks, loaded on 1 and 3: the same size (bitwise training on), fewer
    ranks (4 -> 1, 4 -> 3: uneven) and more (1 -> 3); each rule's variants, fp32 and bf16,
    load and load_consolidated; the export against the float64 reference; the loss scaler and
    changed options through both ways of saving (tests/cases/checkpoint.py)."""
    saved, loaded = [1, 4], [1, 3]
    for n in saved:
        run_mpi(n, "checkpoint.py", "save", str(tmp_path / f"N{n}"), timeout=240)
    variants = sum(len(entry.variants) for entry in builtin_rules().values())
    for m in loaded:
        out = run_mpi(m, "checkpoint.py", "load", str(tmp_path), timeout=300).stdout
        loads = len(saved) * variants * 2 * 2  # x dtypes x (load, load_consolidated)
        assert f"OK checkpoints: {loads} loads on {m} ranks ({', '.join(builtin_rules())})" \
            in out, out


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


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A good checkpoint of 3 ranks and its export (``checkpoint_crash.py prepare``), made
    once and copied for each crash."""
    where = tmp_path_factory.mktemp("prepared")
    run_mpi(3, "checkpoint_crash.py", "prepare", str(where))
    return where


@pytest.mark.parametrize("moment", ["mid-shard", "background", SIBLING("before-rename"),
                                    SIBLING("before-latest")])
def test_a_job_killed_while_saving_leaves_the_previous_checkpoint(tmp_path, prepared, moment):
    n = 3
    tmp_path = tmp_path / "job"
    shutil.copytree(prepared, tmp_path)
    crashed = run_mpi(n, "checkpoint_crash.py", "crash", str(tmp_path), moment, check=False,
                      timeout=120)
    assert crashed.returncode != 0 and "UNREACHABLE" not in crashed.stdout
    record = tmp_path / "KILLED"  # the killed rank's record, also when its stdout is lost
    assert_killed_at(moment, n, crashed.stdout + (record.read_text() if record.exists() else ""))
    out = run_mpi(n, "checkpoint_crash.py", "check", str(tmp_path)).stdout
    assert f"OK crash recovery on {n} ranks" in out


def test_bad_checkpoints_are_refused_on_every_rank(tmp_path):
    """On 3 ranks: the damage is in the last rank's shard, which the others never read."""
    out = run_mpi(3, "checkpoint_errors.py", str(tmp_path), timeout=120).stdout
    assert "OK bad checkpoints: 17 cases on 3 ranks" in out


def test_plan_reads_maps_saved_ranges_onto_owned_ones():
    # Saved by 2 ranks with two buckets each; now owned: packed [5, 25) starting at state 0
    # (flat 5), and packed [40, 44) starting at state 20, at flat 100 (a unit's padding before).
    files = [{"file": "shard-00000.npy", "ranges": [[0, 10], [20, 30]]},
             {"file": "shard-00001.npy", "ranges": [[10, 20], [30, 44]]}]
    reads = plan_reads([(5, 25, 0, 5), (40, 44, 20, 100)], files)
    assert sorted(reads) == sorted([
        ("shard-00000.npy", 5, 5, 10, 0),     # column 5 of file 0 holds flat 5
        ("shard-00000.npy", 10, 20, 25, 15),  # its second range starts at column 10
        ("shard-00001.npy", 0, 10, 20, 5),
        ("shard-00001.npy", 10 + 10, 100, 104, 20),  # packed 40 is flat 100
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
    arrays, masters = shard_arrays(opt), state_rows(opt)["master"]
    for t in opt.layout.tensors:
        flat = slice(t.offset, t.offset + t.numel)  # one rank: state index == flat index
        assert np.array_equal(loaded[f"master/{t.name}"].reshape(-1), masters[flat])
        assert np.array_equal(loaded[f"exp_avg_sq/{t.name}"].reshape(-1),
                              arrays["state"]["exp_avg_sq"][flat])
        assert loaded[f"exp_avg/{t.name}"].shape == t.shape
    assert loaded["exp_avg/w"].min() > 0 and not loaded["exp_avg/s"].any()


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


def test_every_mode_through_every_exit_keeps_the_docs_promise(tmp_path):
    """tests/cases/exits.py on 4 ranks: a pairwise matrix of rule x stage x dtype x masters x
    state encoding x wire x offload share x exit (checkpoint, non-blocking save, consolidated
    file, loaded on 2 of the 4 ranks), each resumed run against the uninterrupted one: bit for
    bit, or within the bound docs/checkpoints.md gives where a way out loses something."""
    out = run_mpi(4, "exits.py", str(tmp_path), timeout=300).stdout
    assert "OK exits on 4 ranks: " in out and " bit for bit, " in out, out
