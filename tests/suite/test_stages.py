"""tests/testkit/stages.py and its hook in conftest.py: every collected test runs in a stage of `make test`, and a
test that no stage selects fails collection with its name (issue 32: 18 tests once ran in none)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from testkit.stages import TEST_SCRIPT, Stage, outside_paths, stage_table, stages_of

pytestmark = pytest.mark.unit

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def test_the_stage_table_is_read_from_scripts_test_sh() -> None:
    table = stage_table()
    for name in ("trainer", "unit", "cluster", "security", "reliability", "kueue", "alerting", "realnode"):
        assert name in table, f"{TEST_SCRIPT} lost its {name} stage (or the parser does not see it)"
    assert table["unit"] == Stage(("tests",), "unit")
    assert table["security"] == Stage(("tests/e2e/security",), "security and not realnode")
    assert table["floor"].paths == ("tests/e2e/cluster/test_kubernetes_floor.py",)


def test_a_test_is_in_the_stages_whose_marker_expression_selects_it() -> None:
    table = {
        name: Stage(("tests",), expr)
        for name, expr in {
            "unit": "unit",
            "security": "security and not realnode",
            "realnode": "realnode",
        }.items()
    }
    assert stages_of(["unit"], table) == ["unit"]
    assert stages_of(["security"], table) == ["security"]
    assert stages_of(["security", "realnode"], table) == ["realnode"]  # not run twice
    assert stages_of(["parametrize"], table) == []
    assert stages_of([], table) == []


def test_a_stage_line_that_does_not_select_by_marker_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "test.sh"
    script.write_text(
        "pytest_stage unit tests -m unit || status=1\npytest_stage odd tests/unit || status=1\n"
    )
    with pytest.raises(ValueError, match=r"PATH\.\.\. -m EXPR"):
        stage_table(script)
    script.write_text('pytest_stage odd /elsewhere -m "odd" || status=1\n')
    with pytest.raises(ValueError, match="paths under tests/"):
        stage_table(script)


def test_a_stage_collects_its_paths_and_the_files_under_them() -> None:
    stage = Stage(("tests/e2e/cluster", "tests/e2e/io/test_s3.py"), "cluster")
    assert stage.collects("tests/e2e/cluster/test_admission.py")
    assert stage.collects("tests/e2e/io/test_s3.py")
    assert not stage.collects("tests/e2e/clusterx/test_admission.py")  # a prefix of a name is not a folder
    assert not stage.collects("tests/e2e/io/test_s3_more.py")


def test_a_test_its_stage_selects_outside_the_stages_paths_is_named(pytester: pytest.Pytester) -> None:
    """A new file whose marker's stage collects elsewhere would run in no stage: the check names it."""
    (pytester.path / "tests" / "e2e" / "io").mkdir(parents=True)
    (pytester.path / "tests" / "e2e" / "io" / "test_in_place.py").write_text(
        "import pytest\n\n@pytest.mark.io\ndef test_here():\n    pass\n"
    )
    (pytester.path / "tests" / "operator").mkdir(parents=True)
    (pytester.path / "tests" / "operator" / "test_misplaced.py").write_text(
        "import pytest\n\n@pytest.mark.io\ndef test_there():\n    pass\n\n@pytest.mark.unit\ndef test_unit():\n    pass\n"
    )
    items, _ = pytester.inline_genitems("tests")
    assert len(items) == 3
    table = {"unit": Stage(("tests",), "unit"), "io": Stage(("tests/e2e/io",), "io")}
    found = outside_paths(items, table, pytester.path)
    assert found == ["tests/operator/test_misplaced.py::test_there (stage io collects only tests/e2e/io)"], (
        found
    )


def test_conftest_fails_collection_naming_a_test_no_stage_selects(pytester: pytest.Pytester) -> None:
    """The real conftest's hook, run over a file with one staged and one unstaged test."""
    pytester.makeconftest(
        f"""
import importlib.util, sys
sys.path[:0] = [{str(CONFTEST.parent)!r}, {str(CONFTEST.parent.parent / "devcluster")!r}]  # our ini's pythonpath
spec = importlib.util.spec_from_file_location("rlhf_tests_conftest", {str(CONFTEST)!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
pytest_collection_modifyitems = module.pytest_collection_modifyitems
"""
    )
    pytester.makepyfile(
        test_probe="""
import pytest

@pytest.mark.unit
def test_staged():
    pass

def test_forgotten():
    pass
"""
    )
    result = pytester.runpytest_subprocess("--collect-only", "-q", "-p", "no:cacheprovider")
    assert result.ret != 0, result.stdout.str()
    err = result.stderr.str()
    assert "1 test(s) run in no stage of `make test`" in err, err
    assert "test_probe.py::test_forgotten" in err
    assert "test_probe.py::test_staged" not in err


def test_every_collected_test_of_the_suite_is_in_a_stage(request: pytest.FixtureRequest) -> None:
    """The session collecting this test passed the check: when the whole tree is collected (make lint,
    `pytest tests`), that is the union of the stages equal to the collection."""
    assert importlib.util.find_spec("testkit.stages") is not None
    hooks = [
        impl.plugin_name
        for impl in request.config.pluginmanager.hook.pytest_collection_modifyitems.get_hookimpls()
    ]
    assert any(name.endswith("tests/conftest.py") for name in hooks), hooks


def test_collection_fails_naming_a_test_outside_its_stages_paths(pytester: pytest.Pytester) -> None:
    """check_collection (the hook's body) over a tree with its own test.sh: io collects only tests/e2e/io."""
    (pytester.path / "scripts").mkdir()
    (pytester.path / "scripts" / "test.sh").write_text(
        'pytest_stage unit tests -m unit || status=1\npytest_stage io tests/e2e/io -m "io" || status=1\n'
    )
    pytester.makeconftest(
        f"""
import sys
from pathlib import Path
sys.path[:0] = [{str(CONFTEST.parent)!r}]
from testkit import stages

def pytest_collection_modifyitems(items):
    stages.check_collection(items, Path({str(pytester.path / "scripts" / "test.sh")!r}))
"""
    )
    (pytester.path / "tests" / "operator").mkdir(parents=True)
    (pytester.path / "tests" / "operator" / "test_misplaced.py").write_text(
        "import pytest\n\n@pytest.mark.io\ndef test_there():\n    pass\n"
    )
    result = pytester.runpytest_subprocess("--collect-only", "-q", "-p", "no:cacheprovider", "tests")
    assert result.ret != 0, result.stdout.str()
    err = result.stderr.str()
    assert "1 test(s) lie outside the paths of a stage that selects them" in err, err
    assert "tests/operator/test_misplaced.py::test_there (stage io collects only tests/e2e/io)" in err, err
