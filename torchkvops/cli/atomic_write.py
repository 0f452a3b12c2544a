"""Files written whole or not at all: through a temporary file in the same folder, renamed into place.

Used for every file the command line writes (`rollout --output`, `bench --output`, `bench-op --output`),
so that an interrupted or crashed run never leaves half a file. No torch here.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

__all__ = ["write_text_atomic", "write_json_atomic"]


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write text to path through a temporary file in the same folder renamed into place: readers
    see the old file or the new one, never half of one; on failure the old file stays. (A symlink is
    followed: the file it points to is replaced, the link stays.)"""
    path = os.path.realpath(os.fspath(path))
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        if os.path.exists(path):  # keep the permissions of the file it replaces
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """json.dumps(obj) first (an unserializable object changes nothing on disk), then write_text_atomic."""
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")
