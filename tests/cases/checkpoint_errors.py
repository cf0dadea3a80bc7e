"""Bad checkpoints give a clear error on every rank, naming the file and the problem, and
leave the optimizer as it was.

    mpiexec -n N python -m mpi4py tests/cases/checkpoint_errors.py DIR

A good checkpoint and export are made, then damaged copies of them (rank 0 damages, everyone
loads). The damage is in the last rank's shard where it matters, so on more than one rank some
ranks never read the damaged file and must still raise.
"""

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from zero1_mpi import CheckpointError, ZeroAdamW
import casekit as kit
from casekit import check

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SHAPES = {"w": (40, 30), "b": (30,)}


def make(shapes=SHAPES, dtype="bfloat16"):
    init = {k: np.full(s, 0.5, np.float32) for k, s in shapes.items()}
    return ZeroAdamW(init, comm, lr=1e-2, param_dtype=dtype, bucket_elements=300)


digest = kit.digest  # this rank's state, hashed, and the step count


def on_root(fn):
    if rank == 0:
        fn()
    comm.Barrier()


def copy_of(good: Path, name: str) -> Path:
    target = good.parent / name
    on_root(lambda: shutil.copytree(good, target))
    return target


def ckpt_dir(root: Path) -> Path:
    return root / (root / "LATEST").read_text().splitlines()[0]


def last_shard(root: Path) -> Path:
    return sorted(ckpt_dir(root).glob("shard-*.npy"))[-1]


def edit_manifest(root: Path, change):
    """Change the manifest on purpose, and its checksums with it (as a writer that means it
    would), so that the load gets past them to the check under test."""
    ckpt = ckpt_dir(root)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    change(manifest)
    text = json.dumps(manifest).encode()
    (ckpt / "manifest.json").write_bytes(text)
    digest = hashlib.sha256(text).hexdigest()
    (ckpt / "manifest.sha256").write_text(f"{digest}  manifest.json\n")
    (root / "LATEST").write_text(f"{ckpt.name}\n{digest}\n")


def set_export_rule(file: Path, rule: str):
    data = file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    header["__metadata__"]["rule"] = rule
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:])


def truncate(file: Path):
    data = file.read_bytes()
    file.write_bytes(data[:-40])


def flip_byte(file: Path):
    data = bytearray(file.read_bytes())
    data[len(data) - 3] ^= 0xFF
    file.write_bytes(bytes(data))


def flip_in(file: Path, after: bytes):
    """Change the digit that follows ``after`` (in the manifest, a number load() reads nowhere
    but in its checksum; in LATEST, the manifest's digest)."""
    data = bytearray(file.read_bytes())
    at = data.index(after) + len(after)
    data[at] = ord("1") if data[at] != ord("1") else ord("2")
    file.write_bytes(bytes(data))


def expect_error(opt, load, words):
    before = digest(opt)
    try:
        load()
    except CheckpointError as exc:
        missing = [w for w in words if w not in str(exc)]
        if missing:
            raise AssertionError(f"message {str(exc)!r} lacks {missing}") from None
    else:
        raise AssertionError(f"no CheckpointError on rank {rank} (expected {words})")
    check(digest(opt) == before, "a failed load changed the optimizer")


def main(directory: Path):
    trained = make()
    kit.train(trained, range(3), SHAPES)
    good = directory / "good"
    trained.save(good)
    export = directory / "good.safetensors"
    trained.save_consolidated(export)

    opt = make()
    cases = 0

    def case(name, damage, words, target=None, loader=None):
        nonlocal cases
        root = copy_of(good, name)
        on_root(lambda: damage(root))
        expect_error(target or opt, lambda: (loader or (target or opt).load)(root), words)
        cases += 1

    case("truncated", lambda r: truncate(last_shard(r)),
         [last_shard(good).name, "truncated"])
    case("corrupted", lambda r: flip_byte(last_shard(r)),
         [last_shard(good).name, "checksum", "corrupted"])
    case("missing", lambda r: last_shard(r).unlink(), [last_shard(good).name, "missing"])
    case("future", lambda r: edit_manifest(r, lambda m: m.update(version=99)),
         ["manifest.json", "version 99"])
    case("escaping-file",
         lambda r: edit_manifest(r, lambda m: m["files"][0].update(file="../../shard-00000.npy")),
         ["'../../shard-00000.npy'", "outside the checkpoint"])
    case("escaping-latest", lambda r: (r / "LATEST").write_text("../../etc"),
         ["LATEST", "'../../etc'", "outside"])
    case("no-manifest", lambda r: (ckpt_dir(r) / "manifest.json").write_text("{not json"),
         ["manifest.json", "JSON"])
    case("manifest-byte", lambda r: flip_in(ckpt_dir(r) / "manifest.json", b'"saved_at": '),
         ["manifest.json", "does not match its checksum"])
    case("latest-digest", lambda r: flip_in(r / "LATEST", b"\n"),
         ["manifest.json", "LATEST", "corrupted"])
    case("other-shapes", lambda r: None, ["'w' with shape (40, 30)", "(30, 40)"],
         target=make({"w": (30, 40), "b": (30,)}))
    case("other-names", lambda r: None, ["'b'", "'c'"], target=make({"w": (40, 30), "c": (30,)}))
    case("other-dtype", lambda r: None, ["param_dtype='bfloat16'", "'float32'"],
         target=make(dtype="float32"))
    case("other-rule", lambda r: edit_manifest(r, lambda m: m.update(rule="sgd")),
         ["'sgd' rule", "runs 'adam'"])
    expect_error(opt, lambda: opt.load(directory / "nothing-here"), ["no checkpoint"])

    # The consolidated export: truncated, or missing a tensor the optimizer has.
    def bad_export(name, damage, words, target=None):
        nonlocal cases
        file = directory / name
        on_root(lambda: (shutil.copy(export, file), damage(file)))
        target = target or opt
        expect_error(target, lambda: target.load_consolidated(file), [name] + words)
        cases += 1

    bad_export("short.safetensors", truncate, ["truncated"])
    bad_export("lion.safetensors", lambda f: set_export_rule(f, "lion"),
               ["'lion' rule", "runs 'adam'"])
    bad_export("other.safetensors", lambda f: None, ["no tensor 'master/c'"],
               target=make({"w": (40, 30), "c": (30,)}))

    opt.load(good)  # after all that, the good ones still load
    check(digest(opt)[1] == 3)
    opt.load_consolidated(export)
    if rank == 0:
        print(f"OK bad checkpoints: {cases + 1} cases on {size} ranks")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
