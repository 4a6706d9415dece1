"""The driver's lines reach the head container's log (container_log): only in a head pod, best effort."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from rlhf_trainer import container_log

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    container_log.reset()
    yield
    container_log.reset()


def test_head_pod_lines_reach_the_container_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLHF_ROLE", "head")
    stream = tmp_path / "stdout"
    assert container_log.echo('{"step": 1}', str(stream))
    assert container_log.echo("error: boom\n", str(stream))
    assert stream.read_text() == '{"step": 1}\nerror: boom\n'


def test_outside_a_head_pod_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLHF_ROLE", "trainer")
    stream = tmp_path / "stdout"
    assert not container_log.echo('{"step": 1}', str(stream))
    assert not stream.exists()


def test_a_stream_that_cannot_be_opened_is_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLHF_ROLE", "head")
    assert not container_log.echo("x", str(tmp_path / "missing" / "stdout"))
    assert not container_log.echo("x", str(tmp_path / "missing" / "stdout"))  # disabled, no retry storm
