"""Every byte of a checkpoint is protected: any single-byte change, truncation or deletion of
any of its files (``LATEST``, ``manifest.json``, ``manifest.sha256``, a shard) is refused with
``CheckpointError`` and the optimizer left as it was; consistent rewrites of the manifest with
an unknown or a missing key, or a renamed directory, are refused too; version-1 checkpoints
still load. One process: that a refusal reaches every rank is tests/cases/checkpoint_errors.py's
part (``load`` raises through the same agreement for every error).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from casekit import digest
from zero1_mpi import CheckpointError, ZeroAdamW
from zero1_mpi.persistence.manifest import LATEST, MANIFEST, MANIFEST_DIGEST

pytestmark = pytest.mark.mpi_independent
SHAPES = {"w": (6, 5), "b": (5,), "s": ()}
FLIPS = (0x01, 0x20)  # the lowest bit, and the bit between lower and upper case


def make(bucket_elements=64):
    init = {k: np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s)
            for k, s in SHAPES.items()}
    return ZeroAdamW(init, MPI.COMM_SELF, lr=1e-2, param_dtype="bfloat16",
                     bucket_elements=bucket_elements)


state_digest = digest  # this rank's arrays, hashed, and the step count (tests/casekit.py)


def train(opt, steps):
    for step in steps:
        for name, grad in opt.grads.items():
            grad[...] = np.random.default_rng(step).standard_normal(grad.shape)
        opt.step()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(root, the checkpoint directory, the trained optimizer's state digest)``, with two
    complete checkpoints under root (steps 2 and 3), LATEST naming step 3's."""
    root = tmp_path_factory.mktemp("bytes") / "root"
    opt = make()
    train(opt, range(2))
    opt.save(root)
    train(opt, range(2, 3))
    ckpt = opt.save(root)
    return root, ckpt, state_digest(opt)


@pytest.fixture
def fresh():
    """An untrained optimizer whose state must survive every refused load."""
    return make()


def refused(opt, path, *words) -> str:
    before = state_digest(opt)
    with pytest.raises(CheckpointError) as caught:
        opt.load(path)
    assert state_digest(opt) == before, "a refused load changed the optimizer"
    for word in words:
        assert word in str(caught.value), caught.value
    return str(caught.value)


WHICH = [LATEST, MANIFEST, MANIFEST_DIGEST, "shard"]


def damaged_file(saved, which: str) -> tuple[Path, bytes]:
    """``(the file of the checkpoint that ``which`` names, its intact bytes)``."""
    root, ckpt, _ = saved
    file = {LATEST: root / LATEST, MANIFEST: ckpt / MANIFEST,
            MANIFEST_DIGEST: ckpt / MANIFEST_DIGEST}.get(which) or \
        sorted(ckpt.glob("shard-*.npy"))[0]
    return file, file.read_bytes()


def test_the_checkpoint_has_the_files_this_test_damages(saved):
    root, ckpt, _ = saved
    assert sorted(p.name for p in ckpt.iterdir()) == [MANIFEST, MANIFEST_DIGEST,
                                                       "shard-00000.npy"]
    latest = (root / LATEST).read_text()
    digest = hashlib.sha256((ckpt / MANIFEST).read_bytes()).hexdigest()
    assert latest == f"{ckpt.name}\n{digest}\n"
    assert (ckpt / MANIFEST_DIGEST).read_text() == f"{digest}  {MANIFEST}\n"


@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("flip", FLIPS)
def test_every_single_byte_change_is_refused(saved, fresh, which, flip):
    root, ckpt, _ = saved
    file, good = damaged_file(saved, which)
    try:
        for position in range(len(good)):
            damaged = bytearray(good)
            damaged[position] ^= flip
            file.write_bytes(bytes(damaged))
            refused(fresh, root)
            if file.parent == ckpt:  # named directly, without LATEST's digest
                refused(fresh, ckpt)
    finally:
        file.write_bytes(good)
    fresh.load(root)  # intact again: it loads
    assert state_digest(fresh) == saved[2]


@pytest.mark.parametrize("which", WHICH)
def test_every_truncation_and_the_deletion_of_every_file_are_refused(saved, fresh, which):
    root = saved[0]
    file, good = damaged_file(saved, which)
    try:
        for length in range(len(good)):
            file.write_bytes(good[:length])
            refused(fresh, root)
        file.unlink()
        refused(fresh, root)
    finally:
        file.write_bytes(good)
    fresh.load(root)
    assert state_digest(fresh) == saved[2]


def test_latest_naming_another_complete_checkpoint_is_refused(saved, fresh, tmp_path):
    root, ckpt, _ = saved
    other = next(p for p in root.iterdir() if p.is_dir() and p != ckpt)
    copy = tmp_path / "root"
    shutil.copytree(root, copy)
    latest = (copy / LATEST).read_text().splitlines()
    (copy / LATEST).write_text(f"{other.name}\n{latest[1]}\n")  # step 2's name, step 3's digest
    refused(fresh, copy, "LATEST", "another checkpoint")
    digest = hashlib.sha256((other / MANIFEST).read_bytes()).hexdigest()
    (copy / LATEST).write_text(f"{other.name}\n{digest}\n")  # consistent: step 2 loads
    fresh.load(copy)
    assert fresh.step_count == 2


def rewrite(root: Path, change, rename: str | None = None) -> Path:
    """Change the manifest consistently (its checksum file and LATEST follow), as a careless
    tool would; with ``rename``, move the directory to that name. Returns the directory."""
    ckpt = root / (root / LATEST).read_text().splitlines()[0]
    manifest = json.loads((ckpt / MANIFEST).read_text())
    change(manifest)
    text = json.dumps(manifest).encode()
    digest = hashlib.sha256(text).hexdigest()
    (ckpt / MANIFEST).write_bytes(text)
    (ckpt / MANIFEST_DIGEST).write_text(f"{digest}  {MANIFEST}\n")
    if rename:
        ckpt = ckpt.rename(root / rename)
    (root / LATEST).write_text(f"{ckpt.name}\n{digest}\n")
    return ckpt


@pytest.mark.parametrize("change, words", [
    (lambda m: m.update(comment="hand-edited"), ["keys ['comment']", "not written by save"]),
    (lambda m: m.pop("max_grad_norm"), ["lacks ['max_grad_norm']"]),
    (lambda m: m["files"][0].update(note=1), ["exactly the keys"]),
    (lambda m: m["files"][0].pop("sha256"), ["exactly the keys"]),
    (lambda m: m["loss_scaler"].update(margin=2), ["LossScaler", "'margin'"]),
    (lambda m: m.update(param_groups=[]), ["param group"]),
    (lambda m: None, None),  # unchanged but rewritten: it loads
])
def test_consistent_rewrites_with_unknown_or_missing_keys_are_refused(saved, fresh, tmp_path,
                                                                      change, words):
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    rewrite(root, change)
    if words is None:
        fresh.load(root)
        assert state_digest(fresh) == saved[2]
    else:
        refused(fresh, root, *words)


def test_a_renamed_directory_is_refused(saved, fresh, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    ckpt = rewrite(root, lambda m: None, rename="ckpt-00000007-1")
    refused(fresh, root, "ckpt-00000007-1", "step 7", "step 3")
    refused(fresh, ckpt, "step 7", "step 3")


def test_a_version_1_checkpoint_still_loads(saved, fresh, tmp_path):
    """Version 1, as the previous zero1_mpi wrote it: no manifest.sha256, LATEST the name
    alone; the manifest the same keys but the version."""
    root = tmp_path / "root"
    shutil.copytree(saved[0], root)
    ckpt = root / (root / LATEST).read_text().splitlines()[0]
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["version"] = 1
    (ckpt / MANIFEST).write_text(json.dumps(manifest, indent=1))
    (ckpt / MANIFEST_DIGEST).unlink()
    (root / LATEST).write_text(ckpt.name)
    fresh.load(root)
    assert state_digest(fresh) == saved[2]
    other = make()
    other.load(ckpt)
    assert state_digest(other) == saved[2]
    # A version-2 manifest whose checksum file is gone is not taken for version 1.
    manifest["version"] = 2
    (ckpt / MANIFEST).write_text(json.dumps(manifest, indent=1))
    refused(make(), root, MANIFEST_DIGEST, "missing")
