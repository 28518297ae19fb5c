"""Shared pytest configuration. Scripted fakes live in ``tests/fakes.py`` (one place).

Parallel runs (``make test``: ``pytest -n 2 --dist loadgroup``, pytest-xdist): most integration
tests wait more than they compute (servers starting, paced episodes, timeouts), so on 2 cores
two tests at a time finish the suite sooner. What must not run twice at once, or is costly to
set up twice, stays in one lane (:func:`_lane`): every test of the session's Ray head, and every
test of a real vLLM server. Within each lane order, the slow tests go first, so that no long
test starts last while the other lane idles.
"""

import pytest

RAY_MODULES = ("test_ray", "test_ray_auth", "test_ray_faults", "test_ray_multinode")
"""Modules that start or join Ray clusters: one lane, never two clusters at once."""


def _lane(item: pytest.Item) -> str | None:
    """``ray`` (a Ray cluster), ``vllm`` (a real vLLM server), or None (anywhere)."""
    names = set(getattr(item, "fixturenames", ()))
    params = getattr(getattr(item, "callspec", None), "params", {})
    if item.get_closest_marker("ray") or "ray_cluster" in names:
        return "ray"
    module = getattr(item, "module", None)
    if module is not None and module.__name__.rsplit(".", 1)[-1] in RAY_MODULES:
        return "ray"
    if item.get_closest_marker("vllm") or "vllm_server" in names:
        return "vllm"
    if params.get("inference_server") == "vllm":
        return "vllm"
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist: the lanes as ``xdist_group`` marks, and the slow tests first."""
    if not getattr(config.option, "numprocesses", None):
        return
    for item in items:
        lane = _lane(item)
        if lane is not None:
            item.add_marker(pytest.mark.xdist_group(lane))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable


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
