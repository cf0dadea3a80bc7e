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
