"""Sharded checkpoints: saved without gathering, loaded at any world size, never half-written.

A root holds complete checkpoints ``ckpt-<step>-<time>/`` and ``LATEST`` (the current one's name
and its manifest's SHA-256). A checkpoint is ``manifest.json`` (rule, rows, layout, step,
options, loss scaler, each file's ranges, size and SHA-256), ``manifest.sha256`` and a float32
``shard-<k>.npy`` (rows ``state_rows`` over the flat ranges held) per shard of the first group:
every byte is checked (``manifest``) before ``load`` changes anything; nothing is unpickled.
Flat positions do not depend on the world size. ``save`` writes the shards and ``publish``es
them; ``start_save`` writes from a host copy in a thread (``PendingSave.finish``); a failed save
removes what it wrote, then raises on every rank. It reads and writes the sharded state
(``state.ShardedState``) and the step's ``Counters``. All ranks.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
import threading
import time
from pathlib import Path
from typing import cast

import numpy as np

from ..flat.inputs import group_record
from ..kernels.backend import to_numpy
from .manifest import (
    FORMAT,
    LATEST,
    MANIFEST,
    VERSION,
    CheckpointError,
    check_checksum,
    check_compatible,
    check_header,
    fingerprint,
    read_counters,
    read_manifest,
    resolve,
    with_todays_names,
)
from .publish import publish, remove_tree, unlink

__all__ = [
    "save",
    "check_keep",
    "start_save",
    "PendingSave",
    "snapshot_shape",
    "load",
    "plan_reads",
    "row_views",
    "CHUNK",
]

CHUNK = 1 << 20  # elements read or written at a time: 4 MiB of float32


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
    """The ranges this rank's file holds, in packed positions (those of every layout)."""
    return [[lo, hi] for lo, hi, _, _ in state.layout.owned_packed(state.shard_rank)]


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
            final = publish(root, tmp, {**manifest, "files": infos}, keep)
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
            remove_tree(tmp)
        comm.bcast_object(None)  # every rank raises once it is gone
        raise


def row_views(state, lo: int, hi: int, start: int, rows=None) -> list:
    """``state``'s views over flat ``[lo, hi)`` (which starts at ``start`` in its shard
    arrays), one per row of ``state.rows`` (or of ``rows``: only those are read, which may
    need decoding)."""
    rows = state.rows if rows is None else rows
    views = state.views(lo, hi, start, rows)
    return [views[row] for row in rows]


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
            unlink(file)
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
        "tensors": [  # in the order given, at their packed positions (any layout's)
            {"name": t.name, "shape": list(t.shape), "offset": t.packed}
            for t in state.layout.given_order
        ],
        "param_groups": [group_record(g, state.rule) for g in counters.param_groups],
        "rule_settings": state.rule.settings(),
        "max_grad_norm": counters.max_grad_norm,
        "loss_scaler": counters.scaler.state(),
    }


def load(comm, state, counters, path, old_names: dict | None = None) -> Path:
    """Load the checkpoint at ``path`` (a root with ``LATEST``, or one checkpoint directory)
    into ``state`` and ``counters``, whatever world size saved it; return the checkpoint
    directory. ``old_names``: an earlier release's tensor names (theirs -> today's) that the
    checkpoint may hold instead, taken with a ``DeprecationWarning``."""
    error = None  # the try binds ckpt, reads and saved, or agree() raises on every rank
    try:
        ckpt, latest_digest = resolve(Path(path))
        manifest, saved_as = with_todays_names(
            read_manifest(ckpt, latest_digest), old_names or {}, ckpt
        )
        check_compatible(state, manifest, ckpt)
        saved = read_counters(manifest, counters.param_groups, state.rule, ckpt / MANIFEST)
        if manifest.get("fingerprint") != fingerprint(state, counters.param_groups, saved_as):
            raise CheckpointError(f"{ckpt}: the layout fingerprint differs from the optimizer's")
        reads = plan_reads(state.layout.owned_packed(state.shard_rank), manifest["files"])
        needed = {read[0] for read in reads}
        for index, entry in enumerate(manifest["files"]):
            if entry["file"] in needed:
                check_header(ckpt, entry, len(manifest["rows"]))
            if index % comm.size == comm.rank:  # every file is hashed by one rank
                check_checksum(ckpt, entry)
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


def plan_reads(owned, files) -> list[tuple[str, int, int, int, int]]:
    """``(file, first column, lo, hi, state)`` for every piece of the flat ranges this rank
    owns (``owned``: ``(packed lo, packed hi, state, flat lo)``, ``Layout.owned_packed``)
    that a saved file holds (its ranges in packed positions); ``lo, hi`` flat."""
    reads = []
    for entry in files:
        column = 0
        for f_lo, f_hi in entry["ranges"]:
            for lo, hi, state, flat in owned:
                a, b = max(lo, f_lo), min(hi, f_hi)
                if a < b:
                    at = flat + a - lo
                    reads.append((entry["file"], column + a - f_lo, at, at + b - a, state + a - lo))
            column += f_hi - f_lo
    return reads
