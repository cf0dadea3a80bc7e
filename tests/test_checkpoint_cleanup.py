"""Saves delete only what they wrote (links in the root are never followed, foreign entries never
removed), and a failed save, a full disk's included, removes what it wrote on every rank, so
the next save that fits succeeds: tests/cases/checkpoint_cleanup.py on 2 ranks."""

import os
import subprocess

import pytest

from mpirun import run_mpi


@pytest.mark.parametrize("mode", ["links", "failures"])
def test_saves_remove_only_their_own_files(tmp_path, mode):
    out = run_mpi(2, "checkpoint_cleanup.py", mode, str(tmp_path), timeout=120).stdout
    assert f"OK checkpoint cleanup ({mode}) on 2 ranks" in out


@pytest.fixture
def small_disk(tmp_path):
    """A 600 KiB tmpfs, mounted for the test (root only)."""
    if os.geteuid() != 0:
        pytest.skip("a full disk needs a small tmpfs, and mounting one needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(disk)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], check=False)


def test_after_a_full_disk_the_next_save_that_fits_succeeds(small_disk):
    out = run_mpi(2, "checkpoint_cleanup.py", "full", str(small_disk), timeout=120).stdout
    assert "OK checkpoint cleanup (full) on 2 ranks" in out


# -- foreign names: ours with something added ------------------------------------------------

#: Names a save writes or prunes: a checkpoint directory, its files, LATEST.
OURS = ["ckpt-00000003-1796446583008601425", "LATEST", "manifest.json", "manifest.sha256",
        "shard-00000.npy"]


@pytest.mark.mpi_independent
@pytest.mark.parametrize("as_directories", [True, False])
def test_pruning_leaves_every_name_made_from_ours_with_something_added(tmp_path, as_directories):
    """The checkpoint root holds a save's checkpoints beside the user's entries named like
    ours with a prefix or a suffix (``.bak``, ``~``, a newline, a digit, ``old-``, ...): with
    ``keep=1`` every checkpoint of ours but the newest goes, and every foreign entry (and what
    it holds) stays, byte for byte."""
    from zero1_mpi.persistence.publish import prune
    root = tmp_path / "root"
    root.mkdir()
    ours = [f"ckpt-{step:08d}-{100 + step}" for step in (1, 2, 3)]
    for name in ours:
        (root / name).mkdir()
        for file in OURS[2:]:
            (root / name / file).write_bytes(b"ours")
    additions = [".bak", "~", "\n", " ", "0x", "-old", ".tmp", "\t", ".npy", "_"]
    foreign = {name for base in ours + OURS[1:] for add in additions
               for name in (add + base, base + add, "." + base)} - set(ours) - set(OURS)
    foreign |= {".tmp", ".tmpx", "tmp-1"}  # beside the prefix of a crashed save's, .tmp-
    for name in sorted(foreign):
        path = root / name
        if as_directories:  # a directory holding only files named as a save's
            path.mkdir()
            for file in OURS[2:]:
                (path / file).write_bytes(name.encode())
        else:
            path.write_bytes(name.encode())
    prune(root, ours[-1], keep=1)
    left = set(os.listdir(root))
    assert left == foreign | {ours[-1]}, sorted(left ^ (foreign | {ours[-1]}))
    for name in foreign:
        path = root / name
        if path.is_dir():
            assert sorted(os.listdir(path)) == sorted(OURS[2:])
            assert all((path / f).read_bytes() == name.encode() for f in OURS[2:])
        else:
            assert path.read_bytes() == name.encode()
