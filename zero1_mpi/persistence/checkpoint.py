"""Sharded checkpoints: saved without gathering, loaded at any world size, never half-written.

A root holds complete checkpoints ``ckpt-<step>-<time>/`` and ``LATEST`` (the current one's name
and its manifest's SHA-256). A checkpoint is ``manifest.json`` (rule, rows, layout, step,
options, loss scaler, each file's ranges, size and SHA-256), ``manifest.sha256`` and a float32
``shard-<k>.npy`` (rows ``state_rows`` over the flat ranges held) per shard of the first group:
every byte is checked before ``load`` changes anything; nothing is unpickled. Flat positions
do not depend on the world size. ``save`` publishes by synced atomic renames, ``start_save``
from a host copy written in a thread (``PendingSave.finish``). Saves remove only saves' files,
following no link; a failed one removes what it wrote, then raises on every rank. It reads
and writes the sharded state (``state.ShardedState``) and the step's ``Counters``. All ranks.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import cast

import numpy as np

from ..flat.inputs import group_record, restore_options
from ..kernels.backend import to_numpy
from ..scaler import LossScaler

__all__ = [
    "save",
    "check_keep",
    "start_save",
    "PendingSave",
    "snapshot_shape",
    "load",
    "CheckpointError",
    "read_counters",
    "check_rule",
    "resolve",
    "read_manifest",
    "check_compatible",
    "VERSION",
    "VERSIONS",
    "fingerprint",
    "plan_reads",
    "CHUNK",
]

FORMAT = "zero1_mpi.checkpoint"  # the manifests' format name since 0.1.0: never the module's
VERSION = 2  # 2: manifest.sha256 and the digest in LATEST; 1 (still loaded): neither
VERSIONS = (1, 2)
MANIFEST = "manifest.json"
MANIFEST_DIGEST = "manifest.sha256"
LATEST = "LATEST"
#: Exactly the keys of a manifest (of each version) and of each of its file entries.
MANIFEST_KEYS = {
    2: frozenset(
        {
            "format",
            "version",
            "saved_at",
            "fingerprint",
            "world_size",
            "shard_group_size",
            "step",
            "param_dtype",
            "numel",
            "rule",
            "rows",
            "tensors",
            "param_groups",
            "rule_settings",
            "max_grad_norm",
            "loss_scaler",
            "files",
        }
    )
}
FILE_KEYS = frozenset({"file", "bytes", "sha256", "ranges"})
CHUNK = 1 << 20  # elements read or written at a time: 4 MiB of float32
_NAME = re.compile(r"^ckpt-\d{8,}-\d+$")
_SHARD = re.compile(r"^shard-\d{5,}\.npy$")
_LATEST = re.compile(r"^(ckpt-\d{8,}-\d+)\n([0-9a-f]{64})\n\Z")  # version 2
_LATEST_V1 = re.compile(r"^(ckpt-\d{8,}-\d+)\Z")


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded; raised on every rank."""


# -- saving ----------------------------------------------------------------------------------


def save(comm, state, counters, path, keep: int | None = None) -> Path:
    """Write a checkpoint of ``state`` and ``counters`` under the root ``path``; return its
    directory. A failure removes what this save wrote, then raises ``CheckpointError`` on
    every rank."""
    root, tmp = _begin(comm, counters.step, path, keep)
    info = error = None
    name = f"shard-{state.shard_rank:05d}.npy"
    try:  # one copy of the state: the first shard group writes it (the others replicate it)
        if state.writes:
            info = {
                **_write_shard(tmp / name, _shape(state), _state_chunks(state)),
                "ranges": _ranges(state),
            }
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
        error = CheckpointError(f"cannot write {tmp.name}/{name}: {exc}")
    _agree_written(comm, error, tmp)
    return _finish(comm, root, tmp, _manifest(comm, state, counters), info, keep)


class PendingSave:
    """A checkpoint that ``save(..., blocking=False)`` is writing in the background.

    Each writing rank's shard was copied into a host buffer when the save began; a thread
    writes and syncs it while training goes on. The checkpoint is published (renamed into
    place, ``LATEST`` replaced, exactly as ``save`` does) by the first step after every rank's
    write has finished, or by ``wait()``. ``path``: the checkpoint directory once published;
    ``error``: the ``CheckpointError`` if it failed (what it wrote is removed; the previous
    checkpoint stays ``LATEST``).
    """

    def __init__(self, comm, state, root: Path, tmp: Path, keep, manifest: dict):
        self._comm, self._state, self.root, self._tmp = comm, state, root, tmp
        self._keep, self.step = keep, manifest["step"]
        self._manifest = manifest  # what the snapshot is of, taken with it
        self._info: dict | None = None
        self._write_error: CheckpointError | None = None
        self._thread: threading.Thread | None = None
        self.path: Path | None = None
        self.error: CheckpointError | None = None
        self.done = False

    def _start(self, snapshot) -> None:
        name, ranges = f"shard-{self._state.shard_rank:05d}.npy", _ranges(self._state)

        def write():
            try:
                self._info = {
                    **_write_shard(self._tmp / name, snapshot.shape, _snapshot_chunks(snapshot)),
                    "ranges": ranges,
                }
            except Exception as exc:  # noqa: BLE001 - reported on every rank by finish()
                self._write_error = CheckpointError(f"cannot write {self._tmp.name}/{name}: {exc}")

        self._thread = threading.Thread(target=write, name="zero1_mpi checkpoint writer")
        self._thread.start()

    @property
    def written(self) -> bool:
        """Whether this rank's part is on disk (or failed): its thread has ended."""
        return self._thread is None or not self._thread.is_alive()

    def finish(self) -> None:
        """Wait for this rank's write, then publish on every rank (or record the error on
        every rank). Must be called on all ranks; a second call does nothing."""
        if self.done:
            return
        if self._thread is not None:
            self._thread.join()
        comm = self._comm
        try:
            _agree_written(comm, self._write_error, self._tmp)
            self.path = _finish(comm, self.root, self._tmp, self._manifest, self._info, self._keep)
        except CheckpointError as exc:  # raised on every rank by agree()
            self.error = exc
        self.done = True
        if self.error is not None and comm.rank == 0:
            sys.stderr.write(
                f"zero1_mpi: the checkpoint of step {self.step} under "
                f"{self.root} failed: {self.error}; the previous one stays "
                f"{LATEST}\n"
            )
            sys.stderr.flush()

    def wait(self) -> Path:
        """Finish the save (all ranks) and return the checkpoint's directory, or raise its
        ``CheckpointError`` on every rank."""
        self.finish()
        if self.error is not None:
            raise self.error
        return cast(Path, self.path)  # finish() sets it unless it sets the error


def start_save(comm, state, counters, path, keep: int | None, snapshot) -> PendingSave:
    """Begin a checkpoint of ``state`` and ``counters`` under ``path`` written in the
    background: copy this rank's shard into ``snapshot`` (a host float32 array of
    ``snapshot_shape(state)``, or None on a rank that writes nothing) and start the writer.
    All ranks."""
    root, tmp = _begin(comm, counters.step, path, keep)
    pending = PendingSave(comm, state, root, tmp, keep, _manifest(comm, state, counters))
    if snapshot is not None:
        with comm.abort_on_error("while copying the shard for a checkpoint"):
            column = 0
            for data in _state_chunks(state, by_row=False):
                for row, values in enumerate(data):
                    snapshot[row, column : column + values.size] = values
                column += data[0].size
        pending._start(snapshot)
    return pending


def snapshot_shape(state) -> tuple[int, int] | None:
    """The host buffer a non-blocking save copies this rank's shard into (None: this rank
    writes no file: it holds a replica of the first shard group's state)."""
    return _shape(state) if state.writes else None


def _ranges(state) -> list[list[int]]:
    return [[lo, hi] for lo, hi, _ in state.layout.owned(state.shard_rank)]


def _shape(state) -> tuple[int, int]:
    owned = state.layout.owned(state.shard_rank)
    return len(state.rows), sum(hi - lo for lo, hi, _ in owned)


def check_keep(keep) -> None:
    """A ValueError naming ``keep`` unless it is None (keep all) or an integer >= 1."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep={keep!r} must be None (keep all) or an integer >= 1")


def _begin(comm, step: int, path, keep) -> tuple[Path, Path]:
    """Check ``keep``, make the hidden directory a save writes into; all ranks."""
    root = Path(path)
    error = tmp_name = None
    try:
        check_keep(keep)
    except ValueError as exc:
        error = exc
    if error is None and comm.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp_name = f".tmp-{step:08d}-{time.time_ns()}"
            (root / tmp_name).mkdir()
        except OSError as exc:
            error = CheckpointError(f"cannot create a checkpoint under {root}: {exc}")
    comm.agree(error)
    return root, root / comm.bcast_object(tmp_name)


def _finish(comm, root: Path, tmp: Path, manifest: dict, info, keep) -> Path:
    """Gather the files' entries and publish on rank 0; return the checkpoint's directory or
    raise rank 0's ``CheckpointError`` on every rank. All ranks, once every file is synced."""
    infos = [i for i in comm.gather_objects(info) or [] if i is not None]
    final = error = None
    if comm.rank == 0:
        try:
            final = _publish(root, tmp, {**manifest, "files": infos}, keep)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
            error = CheckpointError(f"cannot publish the checkpoint under {root}: {exc}")
    comm.agree(error)
    return root / comm.bcast_object(final)


def _agree_written(comm, error, tmp: Path) -> None:
    """Agree on the ranks' write errors; if any rank failed, rank 0 removes the save's hidden
    directory (every rank's file in it) before the error is raised on every rank, so the
    space is free for the next save. All ranks."""
    try:
        comm.agree(error)
    except Exception:
        if comm.rank == 0:
            _remove_tree(tmp)
        comm.bcast_object(None)  # every rank raises once it is gone
        raise


def row_views(state, lo: int, hi: int, start: int, rows=None) -> list:
    """``state``'s views over flat ``[lo, hi)`` (which starts at ``start`` in its shard
    arrays), one per row of ``state.rows`` (or of ``rows``: only those are read, which may
    need decoding)."""
    rows = state.rows if rows is None else rows
    views = state.views(lo, hi, start, rows)
    return [views[row] for row in rows]


def check_rule(rule, saved_rule, where) -> None:
    """A checkpoint holds the state of one update rule: only that ``rule`` can load it."""
    if saved_rule != rule.name:
        raise CheckpointError(
            f"{where} holds the state of the {saved_rule!r} rule, but the "
            f"optimizer runs {rule.name!r}: load it into an optimizer of "
            "the rule that saved it"
        )


def _state_chunks(state, by_row: bool = True):
    """This rank's state rows over the ranges it owns, in the file's order, at most ``CHUNK``
    elements at a time: arrays (``by_row``: row by row, as the file holds them) or, else, the
    list of every row's piece of one chunk of columns."""
    ranges = state.layout.owned(state.shard_rank)
    pieces = [
        (start, min(hi, start + CHUNK), first + start - lo)
        for lo, hi, first in ranges
        for start in range(lo, hi, CHUNK)
    ]
    if by_row:
        for row in state.rows:
            for start, stop, first in pieces:
                yield to_numpy(row_views(state, start, stop, first, [row])[0])
    else:
        for start, stop, first in pieces:
            yield [to_numpy(view) for view in row_views(state, start, stop, first)]


def _snapshot_chunks(snapshot):
    for row in snapshot:
        for start in range(0, row.size, CHUNK):
            yield row[start : start + CHUNK]


def _write_shard(file: Path, shape: tuple[int, int], chunks) -> dict:
    """Write the float32 array of ``shape`` that ``chunks`` give in order to ``file`` as
    ``.npy``, synced; return its manifest entry (without ranges: added by the caller)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_2_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": tuple(shape)}
    )
    digest = hashlib.sha256(header.getvalue())
    size = len(header.getvalue())
    with open(file, "wb") as f:
        try:
            f.write(header.getvalue())
            for chunk in chunks:
                data = np.ascontiguousarray(chunk, dtype="<f4").data
                f.write(data)
                digest.update(data)
                size += data.nbytes
            f.flush()
            os.fsync(f.fileno())
        except BaseException:  # a partial file (a full disk) is not left holding the space
            _unlink(file)
            raise
    return {"file": file.name, "bytes": size, "sha256": digest.hexdigest()}


def _manifest(comm, state, counters) -> dict:
    """The manifest of ``state`` and ``counters`` as they are now, but the files (and the
    time of writing)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": fingerprint(state, counters.param_groups),
        "world_size": comm.size,
        "shard_group_size": state.layout.group_size,
        "step": counters.step,
        "param_dtype": state.dtype.name,
        "numel": state.layout.numel,
        "rule": state.rule.name,
        "rows": list(state.rows),
        "tensors": [
            {"name": t.name, "shape": list(t.shape), "offset": t.offset}
            for t in state.layout.tensors
        ],
        "param_groups": [group_record(g, state.rule) for g in counters.param_groups],
        "rule_settings": state.rule.settings(),
        "max_grad_norm": counters.max_grad_norm,
        "loss_scaler": counters.scaler.state(),
    }


def _publish(root: Path, tmp: Path, manifest: dict, keep: int | None) -> str:
    manifest = {**manifest, "saved_at": time.time()}
    text = json.dumps(manifest, indent=1).encode()
    digest = hashlib.sha256(text).hexdigest()
    final = f"ckpt-{manifest['step']:08d}-{tmp.name.rsplit('-', 1)[1]}"
    written = tmp  # until LATEST names it, a failure removes what this save wrote
    try:
        _write_synced(tmp / MANIFEST, text)
        _write_synced(tmp / MANIFEST_DIGEST, f"{digest}  {MANIFEST}\n".encode())
        _sync_dir(tmp)
        os.rename(tmp, root / final)
        written = root / final
        _sync_dir(root)
        _write_synced(root / f".{LATEST}.tmp", f"{final}\n{digest}\n".encode())
        os.replace(root / f".{LATEST}.tmp", root / LATEST)
    except BaseException:
        _unlink(root / f".{LATEST}.tmp")
        _remove_tree(written)
        raise
    _sync_dir(root)
    _prune(root, final, keep)
    return final


def _prune(root: Path, latest: str, keep: int | None) -> None:
    """Remove what crashed saves left, and complete checkpoints beyond the newest ``keep``;
    never raises (what cannot be removed stays). Only real directories are candidates: a link
    named ``.tmp-*`` or ``ckpt-*`` (an archived checkpoint linked back) is the user's, left in
    place and not counted; ``_remove_tree`` leaves a directory holding anything else."""
    try:
        with os.scandir(root) as entries:
            dirs = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for name in dirs:
        if name.startswith(".tmp-"):
            _remove_tree(root / name)
    if keep is None:
        return
    complete = sorted(
        (name for name in dirs if _NAME.match(name)), key=lambda name: int(name.rsplit("-", 1)[1])
    )
    for name in complete[:-keep]:
        if name != latest:
            _remove_tree(root / name)


#: The names of the files a save writes into its directory.
_OWN = re.compile(r"^(shard-\d{5,}\.npy|manifest\.json|manifest\.sha256)\Z")


def _remove_tree(path: Path) -> None:
    """Remove the directory ``path`` if it is a save's: a directory (not a link to one) that
    holds only regular files of the names a save writes. Anything else in it (another file, a
    link, a directory) leaves it whole; nothing is followed. Never raises."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # gone, not a directory, or a link
        return
    try:
        with os.scandir(fd) as entries:
            found = [
                (e.name, _OWN.match(e.name) and e.is_file(follow_symlinks=False)) for e in entries
            ]
        names = [name for name, own in found if own]
        if len(names) < len(found):  # something that is not a save's: none of it is touched
            return
        for name in names:
            os.unlink(name, dir_fd=fd)
        os.rmdir(path)  # fails on anything that appeared meanwhile, and on a link
    except OSError:
        return
    finally:
        os.close(fd)


def _unlink(file: Path) -> None:
    """Remove ``file`` (a link itself, never what it points to) if it is there; never
    raises."""
    try:
        os.unlink(file)
    except OSError:
        pass


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


def load(comm, state, counters, path) -> Path:
    """Load the checkpoint at ``path`` (a root with ``LATEST``, or one checkpoint directory)
    into ``state`` and ``counters``, whatever world size saved it; return the checkpoint
    directory."""
    error = None  # the try binds ckpt, reads and saved, or agree() raises on every rank
    try:
        ckpt, latest_digest = resolve(Path(path))
        manifest = read_manifest(ckpt, latest_digest)
        check_compatible(state, manifest, ckpt)
        saved = read_counters(manifest, counters.param_groups, state.rule, ckpt / MANIFEST)
        if manifest.get("fingerprint") != fingerprint(state, counters.param_groups):
            raise CheckpointError(f"{ckpt}: the layout fingerprint differs from the optimizer's")
        reads = plan_reads(state.layout.owned(state.shard_rank), manifest["files"])
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
    comm.check_same(
        ckpt.name,
        "the checkpoint that LATEST names",
        "do not save into the root while loading from it (or pass the checkpoint directory itself)",
    )

    with comm.abort_on_error(f"while reading the checkpoint {ckpt}"):
        maps = {}
        for file, column, lo, hi, first in reads:
            if file not in maps:
                maps[file] = np.load(ckpt / file, mmap_mode="r", allow_pickle=False)
            for start in range(lo, hi, CHUNK):
                stop = min(hi, start + CHUNK)
                columns = slice(column + start - lo, column + stop - lo)
                rows = {row: maps[file][i, columns] for i, row in enumerate(state.rows)}
                state.write(start, stop, first + start - lo, rows)  # exact casts
        del maps
        state.publish()
        counters.restore(*saved)
    return ckpt


def read_counters(manifest: dict, groups: list, rule, where) -> tuple:
    """``(step, loss scaler, group options)`` of a checkpoint, checked before anything
    changes: the arguments of ``Counters.restore``."""
    step = manifest.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{where}: step={step!r} is not a step count")
    try:
        scaler = LossScaler.from_state(manifest["loss_scaler"])
        options = restore_options(groups, manifest["param_groups"], rule)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    return step, scaler, options


def resolve(path: Path) -> tuple[Path, str | None]:
    """``(the checkpoint directory path names, the manifest digest LATEST gives or None)``:
    ``path`` itself, or the checkpoint its ``LATEST`` names."""
    if (path / MANIFEST).is_file():
        return path, None
    latest = path / LATEST
    if not latest.is_file():
        raise CheckpointError(
            f"no checkpoint at {path}: it holds neither {MANIFEST} nor "
            f"{LATEST} (pass the directory given to save())"
        )
    data = latest.read_bytes()
    text: str | bytes
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        text = data  # shown as bytes in the message
    found = isinstance(text, str) and (_LATEST.match(text) or _LATEST_V1.match(text))
    if not found:
        raise CheckpointError(
            f"{latest} holds {text!r}, not the name of a checkpoint of this "
            "root and its manifest's SHA-256 (ckpt-<step>-<time>, then 64 "
            "hex digits): it is damaged, or points outside the root"
        )
    name = found.group(1)
    if not (path / name / MANIFEST).is_file():
        raise CheckpointError(f"{latest} names {name!r}, but {path / name / MANIFEST} is missing")
    return path / name, (found.group(2) if found.re is _LATEST else "")


def read_manifest(ckpt: Path, latest_digest: str | None = None) -> dict:
    """The manifest of the checkpoint directory ``ckpt``, every byte of it checked: against
    its ``manifest.sha256`` and ``latest_digest`` (from ``resolve``: None when ``ckpt`` was
    named directly, ``""`` for a version-1 ``LATEST``), its keys, its files' names and
    ranges, and the directory name's step."""
    file = ckpt / MANIFEST
    try:
        data = file.read_bytes()
        manifest = json.loads(data)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file} cannot be read as JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a zero1_mpi checkpoint manifest")
    version = manifest.get("version")
    if version not in VERSIONS or isinstance(version, bool):
        raise CheckpointError(
            f"{file} has format version {version!r}; this zero1_mpi reads "
            f"versions {', '.join(map(str, VERSIONS))}: load it with the "
            "version that wrote it"
        )
    if version >= 2:
        _check_manifest_digest(ckpt, hashlib.sha256(data).hexdigest(), latest_digest)
        keys = set(manifest)
        if keys != MANIFEST_KEYS[version]:
            raise CheckpointError(
                f"{file} has the keys {sorted(keys - MANIFEST_KEYS[version])} that format "
                f"version {version} does not, and lacks {sorted(MANIFEST_KEYS[version] - keys)}"
                ": it was not written by save()"
            )
    elif latest_digest:
        raise CheckpointError(
            f"{ckpt.parent / LATEST} gives a manifest digest, but {file} "
            "is of format version 1, which has none: LATEST names another "
            "checkpoint than the one saved with it"
        )
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        raise CheckpointError(f"{file} lists no files")
    for entry in files:
        if not isinstance(entry, dict) or (version >= 2 and set(entry) != FILE_KEYS):
            raise CheckpointError(
                f"{file}: a file entry must have exactly the keys "
                f"{sorted(FILE_KEYS)}, not {entry!r}"
            )
        name = entry.get("file")
        if not isinstance(name, str) or not _SHARD.match(name) or Path(name).name != name:
            raise CheckpointError(
                f"{file} lists the file {name!r}, which is not a shard name "
                "(shard-<rank>.npy): it may point outside the checkpoint"
            )
    covered = sorted((lo, hi) for entry in files for lo, hi in entry["ranges"])
    ends = [0] + [hi for _, hi in covered]
    if (
        [lo for lo, _ in covered] != ends[:-1]
        or ends[-1] != manifest["numel"]
        or any(lo >= hi for lo, hi in covered)
    ):
        raise CheckpointError(
            f"{file}: the files' ranges do not cover the "
            f"{manifest['numel']} parameters exactly once"
        )
    named = _NAME.match(ckpt.name)
    if named and int(ckpt.name.split("-")[1]) != manifest.get("step"):
        raise CheckpointError(
            f"{ckpt.name} is the directory of step "
            f"{int(ckpt.name.split('-')[1])}, but its manifest says step "
            f"{manifest.get('step')!r}: one of them was changed"
        )
    return manifest


def _check_manifest_digest(ckpt: Path, actual: str, latest_digest: str | None) -> None:
    """A version-2 manifest's SHA-256 must be the one its ``manifest.sha256`` holds (exactly as
    ``save`` wrote it) and, loaded through ``LATEST``, the one ``LATEST`` gives."""
    file = ckpt / MANIFEST_DIGEST
    try:
        text = file.read_bytes()
    except OSError as exc:
        raise CheckpointError(
            f"{file} cannot be read ({exc}): the manifest's checksum is missing"
        ) from None
    if text != f"{actual}  {MANIFEST}\n".encode():
        raise CheckpointError(
            f"{ckpt / MANIFEST} does not match its checksum in {file}: one of them is corrupted"
        )
    if latest_digest is not None and latest_digest != actual:
        raise CheckpointError(
            f"{ckpt / MANIFEST} does not match the checksum in "
            f"{ckpt.parent / LATEST}: one of them is corrupted, or LATEST "
            "names another checkpoint than the one saved with it"
        )


def check_compatible(state, manifest: dict, ckpt: Path) -> None:
    """The checkpoint must hold the same tensors, dtype, rule and rows as ``state``."""
    mine = [(t.name, list(t.shape)) for t in state.layout.tensors]
    theirs = [(t["name"], list(t["shape"])) for t in manifest["tensors"]]
    if mine != theirs:
        if len(mine) != len(theirs):
            diff = f"{len(theirs)} tensors, the optimizer {len(mine)}"
        else:
            a, b = next((a, b) for a, b in zip(theirs, mine) if a != b)
            diff = (
                f"{a[0]!r} with shape {tuple(a[1])}, the optimizer {b[0]!r} with shape "
                f"{tuple(b[1])}"
            )
        raise CheckpointError(
            f"{ckpt} holds different parameters: the checkpoint has {diff}: "
            "build the optimizer with the names and shapes it was saved with"
        )
    if manifest["param_dtype"] != state.dtype.name:
        raise CheckpointError(
            f"{ckpt} was saved with param_dtype={manifest['param_dtype']!r}, "
            f"the optimizer has {state.dtype.name!r}: use the same"
        )
    check_rule(state.rule, manifest.get("rule", "adam"), ckpt)  # version 1 without it: Adam's
    if manifest["rows"] != list(state.rows):
        raise CheckpointError(
            f"{ckpt} holds the rows {manifest['rows']}, the optimizer keeps {list(state.rows)}"
        )


def fingerprint(state, param_groups) -> str:
    """What a checkpoint and an optimizer must share, independent of the world size."""
    text = repr(
        (
            [(t.name, t.shape) for t in state.layout.tensors],
            state.dtype.name,
            [list(g["names"]) for g in param_groups],
        )
    )
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
        raise CheckpointError(
            f"{file} has {file.stat().st_size} bytes, the manifest says "
            f"{entry['bytes']}: it is truncated or was replaced"
        )
    count = sum(hi - lo for lo, hi in entry["ranges"])
    readers = {
        (1, 0): np.lib.format.read_array_header_1_0,
        (2, 0): np.lib.format.read_array_header_2_0,
    }
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
        raise CheckpointError(
            f"{file} holds a {dtype} array of shape {shape}; the manifest "
            f"needs float32 of shape {(rows, count)}"
        )


def _check_checksum(ckpt: Path, entry: dict) -> None:
    file = ckpt / entry["file"]
    if not file.is_file():
        raise CheckpointError(f"{file} is missing")
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    if digest.hexdigest() != entry["sha256"]:
        raise CheckpointError(
            f"{file} does not match its checksum in the manifest: it is corrupted"
        )
