"""Sharded checkpoints: saved without gathering, loaded at any world size, never half-written.

A root directory holds complete checkpoints ``ckpt-<step>-<time>/`` and ``LATEST`` naming the
current one; a checkpoint is ``manifest.json`` (rule, rows, layout, step, options, loss scaler,
and each file's ranges, size and SHA-256) plus one float32 ``shard-<k>.npy`` per shard of the
first shard group, whose rows are the optimizer's ``state_rows`` over the flat ranges it holds.
Flat positions do not depend on the world size, so any number of ranks loads any checkpoint.
``save`` publishes by synced atomic renames (a killed job leaves the previous checkpoint
loadable); ``load`` checks everything it needs before it changes anything. The optimizer is
read and written through ``shard_state``, ``gather_params`` and ``restore_counters`` only.
Both must be called on all ranks, with a path every rank sees. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import time
from pathlib import Path

import numpy as np

from . import backend
from .backend import to_numpy
from .params import group_record, restore_options
from .scaler import LossScaler

__all__ = ["save", "load", "CheckpointError", "read_counters", "check_rule", "resolve",
           "read_manifest", "check_compatible", "fingerprint", "plan_reads", "CHUNK"]

FORMAT = "zero1_mpi.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "LATEST"
CHUNK = 1 << 20  # elements read or written at a time: 4 MiB of float32
_NAME = re.compile(r"^ckpt-\d{8,}-\d+$")
_SHARD = re.compile(r"^shard-\d{5,}\.npy$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded; raised on every rank."""


# -- saving ----------------------------------------------------------------------------------

def save(opt, path, keep: int | None = None) -> Path:
    """Write a checkpoint of ``opt`` under the root ``path``; return its directory."""
    comm, root = opt.comm, Path(path)
    error = tmp_name = None
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        error = ValueError(f"keep={keep!r} must be None (keep all) or an integer >= 1")
    elif comm.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp_name = f".tmp-{opt.step_count:08d}-{time.time_ns()}"
            (root / tmp_name).mkdir()
        except OSError as exc:
            error = CheckpointError(f"cannot create a checkpoint under {root}: {exc}")
    comm.agree(error)
    tmp = root / comm.bcast_object(tmp_name)

    info = error = None
    name = f"shard-{opt.shard_rank:05d}.npy"
    try:  # one copy of the state: the first shard group writes it (the others replicate it)
        info = _write_shard(opt, tmp / name) if opt.rank < opt.shard_group_size else None
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
        error = CheckpointError(f"cannot write {tmp.name}/{name}: {exc}")
    comm.agree(error)
    infos = [i for i in comm.gather_objects(info) or [] if i is not None]

    final = error = None
    if comm.rank == 0:
        try:
            final = _publish(opt, root, tmp, infos, keep)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
            error = CheckpointError(f"cannot publish the checkpoint under {root}: {exc}")
    comm.agree(error)
    return root / comm.bcast_object(final)


def row_views(opt, lo: int, hi: int, state: int) -> list:
    """This rank's state over flat ``[lo, hi)`` (which starts at ``state`` in its shard
    arrays), one view per row of ``opt.state_rows``."""
    views = opt.shard_state(lo, hi, state)
    return [views[row] for row in opt.state_rows]


def check_rule(opt, saved_rule, where) -> None:
    """A checkpoint holds the state of one update rule: only that rule can load it."""
    if saved_rule != opt.rule.name:
        raise CheckpointError(f"{where} holds the state of the {saved_rule!r} rule, but the "
                              f"optimizer runs {opt.rule.name!r}: load it into an optimizer of "
                              "the rule that saved it")


def _write_shard(opt, file: Path) -> dict:
    ranges = opt.layout.owned(opt.shard_rank)
    count = sum(hi - lo for lo, hi, _ in ranges)
    header = io.BytesIO()
    np.lib.format.write_array_header_2_0(header, {"descr": "<f4", "fortran_order": False,
                                                  "shape": (len(opt.state_rows), count)})
    digest = hashlib.sha256(header.getvalue())
    size = len(header.getvalue())
    with open(file, "wb") as f:
        f.write(header.getvalue())
        for row in range(len(opt.state_rows)):
            for lo, hi, state in ranges:
                for start in range(lo, hi, CHUNK):
                    stop = min(hi, start + CHUNK)
                    view = row_views(opt, start, stop, state + start - lo)[row]
                    data = np.ascontiguousarray(to_numpy(view), dtype="<f4").data
                    f.write(data)
                    digest.update(data)
                    size += data.nbytes
        f.flush()
        os.fsync(f.fileno())
    return {"file": file.name, "bytes": size, "sha256": digest.hexdigest(),
            "ranges": [[lo, hi] for lo, hi, _ in ranges]}


def _publish(opt, root: Path, tmp: Path, infos: list, keep: int | None) -> str:
    manifest = {
        "format": FORMAT, "version": VERSION, "saved_at": time.time(),
        "fingerprint": fingerprint(opt),
        "world_size": opt.world_size, "shard_group_size": opt.shard_group_size,
        "step": opt.step_count,
        "param_dtype": opt.param_dtype.name, "numel": opt.layout.numel,
        "rule": opt.rule.name, "rows": list(opt.state_rows),
        "tensors": [{"name": t.name, "shape": list(t.shape), "offset": t.offset}
                    for t in opt.layout.tensors],
        "param_groups": [group_record(g, opt.rule) for g in opt.param_groups],
        "rule_settings": opt.rule.settings(),
        "max_grad_norm": opt.max_grad_norm, "loss_scaler": opt.scaler.state(),
        "files": infos,
    }
    _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    _sync_dir(tmp)
    final = f"ckpt-{opt.step_count:08d}-{tmp.name.rsplit('-', 1)[1]}"
    os.rename(tmp, root / final)
    _sync_dir(root)
    _write_synced(root / f".{LATEST}.tmp", final.encode())
    os.replace(root / f".{LATEST}.tmp", root / LATEST)
    _sync_dir(root)
    _prune(root, final, keep)
    return final


def _prune(root: Path, latest: str, keep: int | None) -> None:
    """Remove what crashed saves left, and complete checkpoints beyond the newest ``keep``."""
    for entry in root.iterdir():
        if entry.name.startswith(".tmp-") and entry.is_dir():
            _remove_tree(entry)
    if keep is None:
        return
    complete = sorted((e for e in root.iterdir() if _NAME.match(e.name) and e.is_dir()),
                      key=lambda e: int(e.name.rsplit("-", 1)[1]))
    for entry in complete[:-keep]:
        if entry.name != latest:
            _remove_tree(entry)


def _remove_tree(path: Path) -> None:
    for entry in path.iterdir():
        entry.unlink()
    path.rmdir()


def _write_synced(file: Path, data: bytes) -> None:
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- loading ---------------------------------------------------------------------------------

def load(opt, path) -> Path:
    """Load the checkpoint at ``path`` (a root with ``LATEST``, or one checkpoint directory)
    into ``opt``, whatever world size saved it; return the checkpoint directory."""
    comm = opt.comm
    error = reads = manifest = ckpt = counters = None
    try:
        ckpt = resolve(Path(path))
        manifest = read_manifest(ckpt)
        check_compatible(opt, manifest, ckpt)
        counters = read_counters(manifest, opt.param_groups, opt.rule, ckpt / MANIFEST)
        if manifest.get("fingerprint") != fingerprint(opt):
            raise CheckpointError(f"{ckpt}: the layout fingerprint differs from the "
                                  "optimizer's")
        reads = plan_reads(opt.layout.owned(opt.shard_rank), manifest["files"])
        needed = {read[0] for read in reads}
        for index, entry in enumerate(manifest["files"]):
            if entry["file"] in needed:
                _check_header(ckpt, entry, len(manifest["rows"]))
            if index % comm.size == comm.rank:  # every file is hashed by one rank
                _check_checksum(ckpt, entry)
    except CheckpointError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - whatever a damaged checkpoint raises, raised
        # on every rank by agree() (one rank's alone would leave the others waiting)
        error = CheckpointError(f"cannot load a checkpoint from {path}: {exc!r}")
    comm.agree(error)
    comm.check_same(ckpt.name, "the checkpoint that LATEST names", "do not save into the root "
                    "while loading from it (or pass the checkpoint directory itself)")

    with comm.abort_on_error(f"while reading the checkpoint {ckpt}"):
        maps = {}
        for file, column, lo, hi, state in reads:
            if file not in maps:
                maps[file] = np.load(ckpt / file, mmap_mode="r", allow_pickle=False)
            for start in range(lo, hi, CHUNK):
                stop = min(hi, start + CHUNK)
                columns = slice(column + start - lo, column + stop - lo)
                for row, view in enumerate(row_views(opt, start, stop, state + start - lo)):
                    view[...] = backend.like(view, maps[file][row, columns])  # exact casts
        del maps
        opt.gather_params()
        opt.restore_counters(*counters)
    return ckpt


def read_counters(manifest: dict, groups: list, rule, where) -> tuple:
    """``(step, loss scaler, group options)`` of a checkpoint, checked before anything
    changes: the arguments of ``opt.restore_counters``."""
    step = manifest.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{where}: step={step!r} is not a step count")
    try:
        scaler = LossScaler.from_state(manifest["loss_scaler"])
        options = restore_options(groups, manifest["param_groups"], rule)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    return step, scaler, options


def resolve(path: Path) -> Path:
    """The checkpoint directory ``path`` names: itself, or the one its ``LATEST`` names."""
    if (path / MANIFEST).is_file():
        return path
    latest = path / LATEST
    if not latest.is_file():
        raise CheckpointError(f"no checkpoint at {path}: it holds neither {MANIFEST} nor "
                              f"{LATEST} (pass the directory given to save())")
    name = latest.read_text().strip()
    if not _NAME.match(name):
        raise CheckpointError(f"{latest} names {name!r}, which is not a checkpoint of this "
                              "root (expected ckpt-<step>-<time>): it may point outside it")
    if not (path / name / MANIFEST).is_file():
        raise CheckpointError(f"{latest} names {name!r}, but {path / name / MANIFEST} is "
                              "missing")
    return path / name


def read_manifest(ckpt: Path) -> dict:
    file = ckpt / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file} cannot be read as JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a zero1_mpi checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{file} has format version {manifest.get('version')!r}; this "
                              f"zero1_mpi reads version {VERSION}: load it with the version "
                              "that wrote it")
    for entry in manifest["files"]:
        name = entry["file"]
        if not isinstance(name, str) or not _SHARD.match(name) or Path(name).name != name:
            raise CheckpointError(f"{file} lists the file {name!r}, which is not a shard name "
                                  "(shard-<rank>.npy): it may point outside the checkpoint")
    covered = sorted((lo, hi) for entry in manifest["files"] for lo, hi in entry["ranges"])
    ends = [0] + [hi for _, hi in covered]
    if [lo for lo, _ in covered] != ends[:-1] or ends[-1] != manifest["numel"] \
            or any(lo >= hi for lo, hi in covered):
        raise CheckpointError(f"{file}: the files' ranges do not cover the "
                              f"{manifest['numel']} parameters exactly once")
    return manifest


def check_compatible(opt, manifest: dict, ckpt: Path) -> None:
    """The checkpoint must hold the same tensors, dtype and param groups as ``opt``."""
    mine = [(t.name, list(t.shape)) for t in opt.layout.tensors]
    theirs = [(t["name"], list(t["shape"])) for t in manifest["tensors"]]
    if mine != theirs:
        if len(mine) != len(theirs):
            diff = f"{len(theirs)} tensors, the optimizer {len(mine)}"
        else:
            a, b = next((a, b) for a, b in zip(theirs, mine) if a != b)
            diff = f"{a[0]!r} with shape {tuple(a[1])}, the optimizer {b[0]!r} with shape " \
                   f"{tuple(b[1])}"
        raise CheckpointError(f"{ckpt} holds different parameters: the checkpoint has {diff}: "
                              "build the optimizer with the names and shapes it was saved with")
    if manifest["param_dtype"] != opt.param_dtype.name:
        raise CheckpointError(f"{ckpt} was saved with param_dtype={manifest['param_dtype']!r}, "
                              f"the optimizer has {opt.param_dtype.name!r}: use the same")
    check_rule(opt, manifest.get("rule", "adam"), ckpt)  # version 1 without it: Adam's
    if manifest["rows"] != list(opt.state_rows):
        raise CheckpointError(f"{ckpt} holds the rows {manifest['rows']}, the optimizer keeps "
                              f"{list(opt.state_rows)}")



def fingerprint(opt) -> str:
    """What a checkpoint and an optimizer must share, independent of the world size."""
    text = repr(([(t.name, t.shape) for t in opt.layout.tensors], opt.param_dtype.name,
                 [list(g["names"]) for g in opt.param_groups]))
    return hashlib.sha256(text.encode()).hexdigest()


def plan_reads(owned, files) -> list[tuple[str, int, int, int, int]]:
    """``(file, first column, lo, hi, state)`` for every piece of the flat ranges this rank
    owns (``owned``: ``(lo, hi, state)``) that a saved file holds."""
    reads = []
    for entry in files:
        column = 0
        for f_lo, f_hi in entry["ranges"]:
            for lo, hi, state in owned:
                a, b = max(lo, f_lo), min(hi, f_hi)
                if a < b:
                    reads.append((entry["file"], column + a - f_lo, a, b, state + a - lo))
            column += f_hi - f_lo
    return reads


def _check_header(ckpt: Path, entry: dict, rows: int) -> None:
    file = ckpt / entry["file"]
    if not file.is_file():
        raise CheckpointError(f"{file} is missing")
    if file.stat().st_size != entry["bytes"]:
        raise CheckpointError(f"{file} has {file.stat().st_size} bytes, the manifest says "
                              f"{entry['bytes']}: it is truncated or was replaced")
    count = sum(hi - lo for lo, hi in entry["ranges"])
    readers = {(1, 0): np.lib.format.read_array_header_1_0,
               (2, 0): np.lib.format.read_array_header_2_0}
    with open(file, "rb") as f:
        try:
            reader = readers.get(np.lib.format.read_magic(f))
            if reader is None:
                raise ValueError("unknown .npy version")
            shape, fortran, dtype = reader(f)
        except Exception as exc:  # noqa: BLE001 - a damaged header makes NumPy's parser raise
            # anything (SyntaxError, tokenize.TokenError, ...): raised here it would escape
            # the agreement below on this rank alone, and the others would wait for ever
            raise CheckpointError(f"{file} is not a NumPy array file: {exc!r}") from None
    if (shape, fortran, dtype) != ((rows, count), False, np.dtype("<f4")):
        raise CheckpointError(f"{file} holds a {dtype} array of shape {shape}; the manifest "
                              f"needs float32 of shape {(rows, count)}")


def _check_checksum(ckpt: Path, entry: dict) -> None:
    file = ckpt / entry["file"]
    if not file.is_file():
        raise CheckpointError(f"{file} is missing")
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    if digest.hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{file} does not match its checksum in the manifest: it is "
                              "corrupted")
