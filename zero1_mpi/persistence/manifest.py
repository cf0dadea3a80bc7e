"""What a checkpoint is on disk, checked before anything is read into the state.

The names (``manifest.json``, ``manifest.sha256``, ``LATEST``, ``ckpt-<step>-<time>``,
``shard-<k>.npy``), the manifest's keys per format version, and the checks that a load runs
first: ``resolve`` (a root's ``LATEST``, or a checkpoint named directly), ``read_manifest``
(every byte against its digest, its keys, its files' names and ranges), ``check_compatible``
(the rule, the tensors, the param groups), ``check_header`` and ``check_checksum`` (each shard
file); ``fingerprint`` of what must agree; ``read_counters``. Nothing here writes. Any failure is
a ``CheckpointError`` naming the file and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from ..flat.inputs import restore_options
from ..moved import warn_deprecated
from ..scaler import LossScaler

__all__ = [
    "CheckpointError",
    "FORMAT",
    "VERSION",
    "VERSIONS",
    "MANIFEST",
    "MANIFEST_DIGEST",
    "LATEST",
    "MANIFEST_KEYS",
    "FILE_KEYS",
    "NAME_PATTERN",
    "check_rule",
    "read_counters",
    "resolve",
    "read_manifest",
    "check_compatible",
    "with_todays_names",
    "todays_groups",
    "warn_old_names",
    "fingerprint",
    "check_header",
    "check_checksum",
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
NAME_PATTERN = re.compile(r"^ckpt-\d{8,}-\d+\Z")  # (\Z: $ would take a trailing newline)
_SHARD = re.compile(r"^shard-\d{5,}\.npy\Z")
_LATEST = re.compile(r"^(ckpt-\d{8,}-\d+)\n([0-9a-f]{64})\n\Z")  # version 2
_LATEST_V1 = re.compile(r"^(ckpt-\d{8,}-\d+)\Z")


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded; raised on every rank."""


def check_rule(rule, saved_rule, where) -> None:
    """A checkpoint holds the state of one update rule: only that ``rule`` can load it."""
    if saved_rule != rule.name:
        raise CheckpointError(
            f"{where} holds the state of the {saved_rule!r} rule, but the "
            f"optimizer runs {rule.name!r}: load it into an optimizer of "
            "the rule that saved it"
        )


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
    named = NAME_PATTERN.match(ckpt.name)
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


def with_todays_names(manifest: dict, old_names: dict, ckpt: Path) -> tuple[dict, dict]:
    """``(manifest, saved_as)``: a manifest of an earlier release's tensor names (``old_names``:
    theirs -> today's; 0.1.0's nnx names) with today's in their place, and today's name ->
    the saved one; ``manifest`` as it is, and ``{}``, when it holds none of them."""
    saved = (t["name"] for t in manifest.get("tensors", []))
    renamed = {n: old_names[n] for n in saved if n in old_names}
    if not renamed:
        return manifest, {}
    warn_old_names(ckpt, renamed)
    manifest = {
        **manifest,
        "tensors": [{**t, "name": renamed.get(t["name"], t["name"])} for t in manifest["tensors"]],
        "param_groups": todays_groups(manifest["param_groups"], renamed),
    }
    return manifest, {new: old for old, new in renamed.items()}


def todays_groups(groups: list, renamed: dict) -> list:
    """Saved param-group records with their tensors' ``names`` given today's (``renamed``:
    saved -> today's)."""
    return [{**g, "names": [renamed.get(n, n) for n in g.get("names", [])]} for g in groups]


def warn_old_names(where, renamed: dict) -> None:
    """The ``DeprecationWarning`` of a checkpoint or export ``where`` that holds an earlier
    release's tensor names (``renamed``: saved -> today's), loaded by today's."""
    warn_deprecated(
        f"{where} holds 0.1.0's names of {len(renamed)} tensors (such as "
        f"{next(iter(renamed))!r}): loaded by today's; save again to write them (0.1.0's are "
        "taken until 0.2.0)"
    )


def check_compatible(state, manifest: dict, ckpt: Path) -> None:
    """The checkpoint must hold the same tensors, dtype, rule and rows as ``state``."""
    mine = [(t.name, list(t.shape)) for t in state.layout.given_order]
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


def fingerprint(state, param_groups, saved_as: dict | None = None) -> str:
    """What a checkpoint and an optimizer must share, independent of the world size;
    ``saved_as``: the name a checkpoint holds for a tensor, where it is not today's."""
    name = (saved_as or {}).get
    text = repr(
        (
            [(name(t.name, t.name), t.shape) for t in state.layout.given_order],
            state.dtype.name,
            [[name(n, n) for n in g["names"]] for g in param_groups],
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()


def check_header(ckpt: Path, entry: dict, rows: int) -> None:
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


def check_checksum(ckpt: Path, entry: dict) -> None:
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
