"""What this pytest session collected, kept before `-m` deselects anything.

The layout test reads the whole tree's test files from here instead of collecting the tree a second
time (17 s of imports in the unit stage) when the session itself collected the whole tree, as the unit
stage and `make lint` do; run alone, it collects the tree itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit import TESTKIT

TESTS = TESTKIT.parent
_FILES: pytest.StashKey[dict[str, set[Path]]] = pytest.StashKey()


def remember(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the files of the unit tests and of the others, when the session's only argument is tests/."""
    args = [(config.invocation_params.dir / a.split("::")[0]).resolve() for a in config.args]
    if args != [TESTS]:
        return
    found: dict[str, set[Path]] = {"unit": set(), "slow": set()}
    for item in items:
        found["unit" if any(m.name == "unit" for m in item.iter_markers()) else "slow"].add(item.path)
    config.stash[_FILES] = found


def files(config: pytest.Config) -> dict[str, set[Path]] | None:
    """{"unit": files, "slow": files} over the whole tree, or None when this session did not collect it."""
    return config.stash.get(_FILES, None)
