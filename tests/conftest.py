"""Shared pytest configuration. Scripted fakes live in ``tests/fakes.py`` (one place); how
``make test`` runs two tests at a time, in lanes, is ``tests/lanes.py``."""

import os
import resource
import shutil
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

_LANES_DIR = pytest.StashKey[Path]()
"""The controller's directory for the workers' lanes file."""


def _xdist_controller(config: pytest.Config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


_TMP_DIR = pytest.StashKey[Path]()
"""The session's own temp folder (``TMPDIR`` of every test and every process they start)."""


def pytest_configure(config: pytest.Config) -> None:
    """The session's temp folder (see :func:`_own_tmpdir`); under xdist, the controller names
    the file its workers write their lanes to."""
    _own_tmpdir(config)
    if _xdist_controller(config):
        config.stash[_LANES_DIR] = Path(tempfile.mkdtemp(prefix="agentrl-lanes-"))


def _own_tmpdir(config: pytest.Config) -> None:
    """Point ``TMPDIR`` at a folder of this session's, removed when it ends: what the tests'
    processes leave in the temp folder (a killed server's log, a benchmark smoke's work
    folder, vLLM's and multiprocessing's scratch) goes with it, not into the machine's /tmp.
    xdist workers inherit it from the controller; a run inside another keeps the outer's."""
    if hasattr(config, "workerinput") or os.environ.get(_TMP_ENV):
        return
    tmp = Path(tempfile.mkdtemp(prefix="agentrl-tests-"))
    os.environ["TMPDIR"] = os.environ[_TMP_ENV] = str(tmp)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    config.stash[_TMP_DIR] = tmp


_TMP_ENV = "AGENTRL_TEST_TMPDIR"


def pytest_unconfigure(config: pytest.Config) -> None:
    lanes_dir = config.stash.get(_LANES_DIR, None)
    if lanes_dir is not None:
        shutil.rmtree(lanes_dir, ignore_errors=True)
    own = config.stash.get(_TMP_DIR, None)
    if own is not None:
        shutil.rmtree(own, ignore_errors=True)
        os.environ.pop(_TMP_ENV, None)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist: tell each worker where to write its lanes."""
    from tests.lanes import LANES_KEY

    node.workerinput[LANES_KEY] = str(node.config.stash[_LANES_DIR] / "lanes.json")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist: the lanes' scheduler (``tests/lanes.py``)."""
    from tests.lanes import LaneScheduling

    return LaneScheduling(config, log, config.stash[_LANES_DIR] / "lanes.json")


_CPU_START = pytest.StashKey[float]()


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and of its children it has waited for."""
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    item.stash[_CPU_START] = _cpu_s()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    """Each test's CPU seconds (this process and the children it waited for: servers it
    stopped, commands it ran; not Ray's actors) as the junit property ``cpu_s``: where the
    suite's CPU goes on a 2-core machine, where two tests at a time contend. A string, so
    the measured-values summary leaves it out."""
    yield
    start = item.stash.get(_CPU_START, None)
    if start is not None:
        item.user_properties.append(("cpu_s", f"{_cpu_s() - start:.1f}"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker: the slow tests first, and the lanes written for the controller."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    from tests.lanes import LANES_KEY, slow_first, write_lanes

    slow_first(items)
    write_lanes(Path(workerinput[LANES_KEY]), items, workerinput["workerid"])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The measured values (``report_metric``), from the reports: they reach the controller
    from every xdist worker, which a list in a worker's memory would not."""
    lines = [
        f"{report.nodeid}: {name} = {value:.3g}"
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", ())
        if isinstance(value, int | float)
    ]
    if lines:
        terminalreporter.section("measured values (agentrl integration tests)")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen2 model + byte-level tokenizer (``agentrl.inference.tiny_model``), built once."""
    from agentrl.inference.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model") / "tiny-qwen2", seed=0)
