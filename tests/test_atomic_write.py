"""torchkvops.cli.atomic_write, called directly: the whole file or nothing. (That bench writes its JSON
through it after every case, and retries a failed write, is tests/test_cli.py's.)"""

import json
import os

import pytest

from torchkvops.cli import atomic_write


def test_write_json_atomic_replaces_the_whole_file_or_nothing(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    atomic_write.write_json_atomic(path, {"a": 1})
    path.chmod(0o640)
    atomic_write.write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2} and path.stat().st_mode & 0o777 == 0o640
    with pytest.raises(TypeError):  # not serializable: nothing written
        atomic_write.write_json_atomic(path, {"a": object()})

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        atomic_write.write_json_atomic(path, {"a": 3})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left behind
