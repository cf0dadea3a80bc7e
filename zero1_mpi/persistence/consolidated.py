"""One consolidated file of the full fp32 optimizer state, by parameter name, for other tools.

A safetensors file (an 8-byte little-endian header length, a JSON header giving each tensor's
dtype, shape and byte range, then the raw data): ``<row>/<name>`` in float32 for each of the
optimizer's ``state_rows`` (``master/w``, ``exp_avg/w``, ...; ``param`` only where the 16-bit
parameters are not the masters rounded: 8-bit gathers, whose approximation a load restores), and
in ``__metadata__`` the rule, step, loss scaler and param groups. Both directions stream in
bounded chunks (rank 0 writes what the owners send it; each rank reads only its own slices), and
the file appears by an atomic rename once complete. They read and write the sharded state
(``state.ShardedState``) and the step's ``Counters``; all ranks, a path every rank sees.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import BinaryIO, cast

import numpy as np

from ..flat.inputs import group_record
from ..kernels.backend import to_numpy
from .checkpoint import CHUNK
from .manifest import CheckpointError, check_rule, read_counters, todays_groups, warn_old_names

__all__ = ["save_consolidated", "load_consolidated"]

FORMAT = "zero1_mpi.consolidated"
VERSION = "1"


def _rows(state) -> tuple[str, ...]:
    """The rows every file holds: all of ``state.rows`` but the 16-bit ``param``."""
    return tuple(row for row in state.rows if row != "param")


def _saved_rows(state) -> tuple[str, ...]:
    """The rows ``state`` saves: ``_rows``, and ``param`` where the parameters are not the
    masters rounded."""
    exact = state.gathers.exact
    return _rows(state) + (("param",) if "param" in state.rows and not exact else ())


def save_consolidated(comm, state, counters, path) -> Path:
    """Write the full fp32 state of ``state`` (and ``counters``) to the single file ``path``."""
    file = Path(path)
    tmp = file.with_name(f".{file.name}.tmp-{comm.bcast_object(time.time_ns())}")
    out: BinaryIO | None = None
    error = None
    if comm.rank == 0:
        try:
            header = _header(state, counters)
            file.parent.mkdir(parents=True, exist_ok=True)
            out = open(tmp, "wb")
            out.write(struct.pack("<Q", len(header)) + header)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
            error = CheckpointError(f"cannot write {file}: {exc}")
    comm.agree(error)
    out = cast(BinaryIO, out)  # opened on rank 0, the only rank that uses it

    with comm.abort_on_error(f"while writing {file}"):
        received = np.empty(CHUNK, np.float32) if comm.rank == 0 else None
        for kind in _saved_rows(state):
            for owner, lo, hi, first in _pieces_in_flat_order(state.layout):
                for start in range(lo, hi, CHUNK):
                    stop = min(hi, start + CHUNK)
                    if comm.rank == owner:
                        view = state.views(start, stop, first + start - lo, (kind,))[kind]
                        data = np.ascontiguousarray(to_numpy(view), dtype="<f4")
                        if owner == 0:
                            out.write(data.data)
                        else:
                            comm.send(data, dest=0)
                    elif comm.rank == 0:
                        piece = cast(np.ndarray, received)[: stop - start]  # rank 0's
                        comm.recv(piece, source=owner)
                        out.write(piece.data)

    error = None
    if comm.rank == 0:
        try:
            out.flush()
            os.fsync(out.fileno())
            out.close()
            os.replace(tmp, file)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
            error = CheckpointError(f"cannot write {file}: {exc}")
    comm.agree(error)
    return file


def load_consolidated(comm, state, counters, path, old_names: dict | None = None) -> Path:
    """Load a file written by ``save_consolidated`` (at any world size) into ``state`` and
    ``counters``; ``old_names``: as ``checkpoint.load``'s."""
    file = Path(path)
    error = None  # the try binds entries, data_start and saved, or agree() raises on every rank
    try:
        entries, data_start, metadata = _read_header(state, file, old_names or {})
        saved = read_counters(
            {
                "step": _int(metadata.get("step")),
                "loss_scaler": json.loads(metadata["loss_scaler"]),
                "param_groups": json.loads(metadata["param_groups"]),
            },
            counters.param_groups,
            state.rule,
            file,
        )
    except CheckpointError as exc:
        error = exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        error = CheckpointError(f"cannot load {file}: {exc}")
    comm.agree(error)

    tensors = state.layout.tensors
    params = "param" in state.rows and all(f"param/{t.name}" in entries for t in tensors)
    kinds = _rows(state) + (("param",) if params else ())
    with comm.abort_on_error(f"while reading {file}"), open(file, "rb") as f:
        buffer = np.empty((len(kinds), CHUNK), np.float32)
        for lo, hi, first in state.layout.owned(state.shard_rank):
            for tensor, a, b in state.layout.pieces(lo, hi):
                for start in range(a, b, CHUNK):
                    stop = min(b, start + CHUNK)
                    rows = {}
                    for i, kind in enumerate(kinds):
                        begin = entries[f"{kind}/{tensor.name}"][0]
                        f.seek(data_start + begin + 4 * (start - tensor.offset))
                        chunk = buffer[i, : stop - start]
                        if f.readinto(chunk.view(np.uint8).data) != chunk.nbytes:
                            raise CheckpointError(f"{file} ended early")
                        rows[kind] = chunk
                    # (without "param", the 16-bit parameters become the masters rounded)
                    state.write(start, stop, first + start - lo, rows)
        state.publish()
        counters.restore(*saved)
    return file


def _int(text):
    return int(text) if isinstance(text, str) and text.isdigit() else text


def _pieces_in_flat_order(layout):
    """``(owner, lo, hi, state)``: the real elements of the flat range, in order, by owner."""
    pieces = [
        (lo, owner, hi, state)
        for owner in range(layout.group_size)
        for lo, hi, state in layout.owned(owner)
    ]
    return [(owner, lo, hi, state) for lo, owner, hi, state in sorted(pieces)]


def _header(state, counters) -> bytes:
    header = {
        "__metadata__": {
            "format": FORMAT,
            "version": VERSION,
            "rule": state.rule.name,
            "step": str(counters.step),
            "param_dtype": state.dtype.name,
            "loss_scaler": json.dumps(counters.scaler.state()),
            "param_groups": json.dumps(
                [group_record(g, state.rule) for g in counters.param_groups]
            ),
        }
    }
    offset = 0
    for kind in _saved_rows(state):
        for t in state.layout.tensors:
            header[f"{kind}/{t.name}"] = {
                "dtype": "F32",
                "shape": list(t.shape),
                "data_offsets": [offset, offset + 4 * t.numel],
            }
            offset += 4 * t.numel
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes


def _with_todays_names(header: dict, old_names: dict, file: Path) -> dict:
    """``header`` with the entries (``kind/name``) and the param groups' names of an earlier
    release's tensor names (``old_names``: theirs -> today's) given today's; as it is when it
    holds none."""
    today, renamed = {}, {}
    for key, info in header.items():
        kind, _, name = key.partition("/")
        if name in old_names:
            renamed[name] = old_names[name]
            key = f"{kind}/{old_names[name]}"
        today[key] = info
    if not renamed:
        return header
    metadata = dict(header.get("__metadata__", {}))
    if "param_groups" in metadata:
        groups = todays_groups(json.loads(metadata["param_groups"]), renamed)
        metadata["param_groups"] = json.dumps(groups)
    today["__metadata__"] = metadata
    warn_old_names(file, renamed)
    return today


def _read_header(state, file: Path, old_names: dict):
    """``({key: (begin, end)}, first data byte, metadata)`` after checking everything: the
    rows every file holds, and ``param`` where the file has it for every tensor; an earlier
    release's tensor names (``old_names``) read as today's, with a warning."""
    if not file.is_file():
        raise CheckpointError(f"{file} is missing")
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file} is too short to be a consolidated state file")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise CheckpointError(
                f"{file}: its header claims {length} bytes, the file has "
                f"{size - 8} after the length: it is truncated or corrupted"
            )
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{file}: its header is not JSON: {exc}") from None
    header = _with_todays_names(header, old_names, file)
    metadata = header.get("__metadata__", {})
    if metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
        raise CheckpointError(
            f"{file} is not a zero1_mpi consolidated state file of version "
            f"{VERSION} (metadata: {metadata.get('format')!r} version "
            f"{metadata.get('version')!r})"
        )
    check_rule(state.rule, metadata.get("rule", "adam"), file)
    entries, data_bytes = {}, size - 8 - length
    optional = all(f"param/{t.name}" in header for t in state.layout.tensors)
    for kind in _rows(state) + (("param",) if optional else ()):
        for t in state.layout.tensors:
            key = f"{kind}/{t.name}"
            info = header.get(key)
            if info is None:
                raise CheckpointError(
                    f"{file} has no tensor {key!r}: it was saved from other parameters"
                )
            if info.get("dtype") != "F32" or list(info.get("shape", [])) != list(t.shape):
                raise CheckpointError(
                    f"{file}: {key!r} is {info.get('dtype')} of shape "
                    f"{tuple(info.get('shape', []))}, the optimizer needs "
                    f"F32 of shape {t.shape}"
                )
            begin, end = info["data_offsets"]
            if end - begin != 4 * t.numel or not 0 <= begin <= end <= data_bytes:
                raise CheckpointError(
                    f"{file}: {key!r} lies outside the file's data "
                    f"({begin}..{end} of {data_bytes} bytes): truncated?"
                )
            entries[key] = (begin, end)
    return entries, 8 + length, metadata
