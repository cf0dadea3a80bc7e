"""Publishing a written checkpoint directory atomically, and cleaning a root up.

``publish`` makes a save visible by synced renames (the directory, then ``LATEST``), so a crash
at any moment leaves the previous checkpoint loadable; ``prune`` removes what crashed saves left
and complete checkpoints beyond ``keep``. Only saves' own files are removed (``remove_tree``:
the names a save writes, following no link), so foreign files named almost like ours stay.
``write_synced``/``sync_dir``: data and directory entries on disk before a rename counts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

from .manifest import LATEST, MANIFEST, MANIFEST_DIGEST, NAME_PATTERN

__all__ = ["publish", "prune", "remove_tree", "unlink", "write_synced", "sync_dir"]

#: The names of the files a save writes into its directory.
_OWN = re.compile(r"^(shard-\d{5,}\.npy|manifest\.json|manifest\.sha256)\Z")


def publish(root: Path, tmp: Path, manifest: dict, keep: int | None) -> str:
    """Publish the written directory ``tmp`` as a checkpoint of ``root``: its manifest and
    digest synced, the directory renamed, then ``LATEST`` replaced; prune to ``keep``; return
    the checkpoint's name. A failure before ``LATEST`` names it removes what it wrote."""
    manifest = {**manifest, "saved_at": time.time()}
    text = json.dumps(manifest, indent=1).encode()
    digest = hashlib.sha256(text).hexdigest()
    final = f"ckpt-{manifest['step']:08d}-{tmp.name.rsplit('-', 1)[1]}"
    written = tmp  # until LATEST names it, a failure removes what this save wrote
    try:
        write_synced(tmp / MANIFEST, text)
        write_synced(tmp / MANIFEST_DIGEST, f"{digest}  {MANIFEST}\n".encode())
        sync_dir(tmp)
        os.rename(tmp, root / final)
        written = root / final
        sync_dir(root)
        write_synced(root / f".{LATEST}.tmp", f"{final}\n{digest}\n".encode())
        os.replace(root / f".{LATEST}.tmp", root / LATEST)
    except BaseException:
        unlink(root / f".{LATEST}.tmp")
        remove_tree(written)
        raise
    sync_dir(root)
    prune(root, final, keep)
    return final


def prune(root: Path, latest: str, keep: int | None) -> None:
    """Remove what crashed saves left, and complete checkpoints beyond the newest ``keep``;
    never raises (what cannot be removed stays). Only real directories are candidates: a link
    named ``.tmp-*`` or ``ckpt-*`` (an archived checkpoint linked back) is the user's, left in
    place and not counted; ``remove_tree`` leaves a directory holding anything else."""
    try:
        with os.scandir(root) as entries:
            dirs = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for name in dirs:
        if name.startswith(".tmp-"):
            remove_tree(root / name)
    if keep is None:
        return
    complete = sorted(
        (name for name in dirs if NAME_PATTERN.match(name)),
        key=lambda name: int(name.rsplit("-", 1)[1]),
    )
    for name in complete[:-keep]:
        if name != latest:
            remove_tree(root / name)


def remove_tree(path: Path) -> None:
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


def unlink(file: Path) -> None:
    """Remove ``file`` (a link itself, never what it points to) if it is there; never
    raises."""
    try:
        os.unlink(file)
    except OSError:
        pass


def write_synced(file: Path, data: bytes) -> None:
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
