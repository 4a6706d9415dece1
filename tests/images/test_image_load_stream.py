"""Loading an image into containerd streams buildah's export into `ctr images import -`
(containerd_runtime.import_stream): the archive reaches the importer whole with no file between them,
and a failure of either side is reported as that side's."""

from __future__ import annotations

import sys
from pathlib import Path

import containerd_runtime
import pytest

pytestmark = pytest.mark.unit

ARCHIVE = b"layer-bytes\n" * 200_000  # 2.4 MB: more than a pipe's buffer, so both sides must run at once


def _producer(tmp_path: Path, rc: int = 0) -> list[str]:
    source = tmp_path / "archive.tar"
    source.write_bytes(ARCHIVE)
    code = (
        "import sys, shutil; shutil.copyfileobj(open(sys.argv[1], 'rb'), sys.stdout.buffer); "
        "sys.stdout.flush(); sys.stderr.write('export said why\\n'); sys.exit(int(sys.argv[2]))"
    )
    return [sys.executable, "-c", code, str(source), str(rc)]


def _importer(monkeypatch: pytest.MonkeyPatch, received: Path, rc: int = 0) -> list[list[str]]:
    """Stands in for `ctr`: copies its stdin to `received`; records the arguments it was given."""
    calls: list[list[str]] = []
    code = (
        "import sys, shutil; shutil.copyfileobj(sys.stdin.buffer, open(sys.argv[1], 'wb')); "
        "sys.stderr.write('ctr: import refused\\n'); sys.exit(int(sys.argv[2]))"
    )

    def command(rt: containerd_runtime.Runtime, *args: str) -> list[str]:
        calls.append(list(args))
        return [sys.executable, "-c", code, str(received), str(rc)]

    monkeypatch.setattr(containerd_runtime, "ctr_command", command)
    return calls


def test_the_export_is_piped_whole_into_ctr_import_from_stdin(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    received = tmp_path / "received"
    calls = _importer(monkeypatch, received)
    containerd_runtime.import_stream(containerd_runtime.Runtime(tmp_path), _producer(tmp_path))
    assert calls == [["images", "import", "--snapshotter", "overlayfs", "-"]]
    assert received.read_bytes() == ARCHIVE


def test_a_failed_export_is_reported_with_its_own_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _importer(monkeypatch, tmp_path / "received")
    with pytest.raises(RuntimeError, match=r"exit 3\): export said why"):
        containerd_runtime.import_stream(containerd_runtime.Runtime(tmp_path), _producer(tmp_path, rc=3))


def test_a_refused_import_is_reported_as_ctrs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _importer(monkeypatch, tmp_path / "received", rc=1)
    with pytest.raises(RuntimeError, match="ctr images import -: ctr: import refused"):
        containerd_runtime.import_stream(containerd_runtime.Runtime(tmp_path), _producer(tmp_path))
