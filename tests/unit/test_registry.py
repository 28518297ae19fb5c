"""The one name registry: duplicate policy, unknown-name messages, import specs, user paths."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from agentrl.registry import (
    DuplicateNameError,
    Registry,
    RegistryError,
    UnknownNameError,
    import_spec,
)
from agentrl.user_code import import_user_modules


def test_aliases_names_and_the_duplicate_policy() -> None:
    reg: Registry = Registry("widget", config_key="widgets.name")

    @reg.register("one", "uno")
    def one() -> int:
        return 1

    assert reg.get("uno") is one and "one" in reg and reg.names() == ["one", "uno"]
    reg.register("one")(one)  # the same object again: harmless
    with pytest.raises(DuplicateNameError, match="'one' is already registered"):
        reg.register("one")(lambda: 2)


def test_unknown_names_name_the_key_the_choices_and_the_closest() -> None:
    reg: Registry = Registry("agent", config_key="agent.default")
    reg.add("tool_agent", object())
    with pytest.raises(UnknownNameError) as err:
        reg.get("tool_agnt")
    msg = str(err.value)
    assert msg.startswith("agent.default: unknown agent 'tool_agnt'")
    assert "registered: tool_agent" in msg and "did you mean 'tool_agent'?" in msg
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)


def test_lazy_builtins_import_on_first_use_and_cannot_be_shadowed() -> None:
    reg: Registry = Registry("thing")
    reg.add_lazy("join", "os.path:join")
    import os.path

    assert reg.get("join") is os.path.join
    fresh: Registry = Registry("thing")
    fresh.add_lazy("join", "os.path:join")
    with pytest.raises(DuplicateNameError, match="is a built-in"):
        fresh.add("join", print)


def test_check_refuses_objects_of_another_family() -> None:
    def check(obj: object) -> None:
        if not isinstance(obj, int):
            raise TypeError("must be an int")

    reg: Registry = Registry("number", check=check)
    with pytest.raises(TypeError, match="must be an int"):
        reg.add("x", "not a number")
    with pytest.raises(RegistryError, match="must be an int"):
        reg.get("os:sep")


def test_module_attr_specs_and_their_errors() -> None:
    import json

    assert import_spec("json:dumps") is json.dumps
    with pytest.raises(RegistryError, match=r"k: cannot import module 'no_such_mod'"):
        import_spec("no_such_mod:f", key="k")
    with pytest.raises(RegistryError, match="did you mean 'dump'"):
        import_spec("json:dumpz")
    with pytest.raises(RegistryError, match="is not of the form"):
        import_spec("json")


def test_a_user_package_named_tools_loads_beside_ours(tmp_path: Path) -> None:
    project = tmp_path / "proj"
    pkg = project / "tools"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "units.py").write_text("FACTOR = 1000\n")
    (pkg / "convert.py").write_text(
        textwrap.dedent(
            """
            from .units import FACTOR
            def km_to_m(x):
                return x * FACTOR
            """
        )
    )
    (mod,) = import_user_modules(["tools/convert.py"], base_dir=project)
    assert mod.km_to_m(2) == 2000
    assert mod.__name__.startswith("agentrl_user_") and mod.__name__.endswith(".tools.convert")
    import tools  # ours is untouched

    assert hasattr(tools, "ToolSet")
    fn = import_spec("tools/convert.py:km_to_m", base_dir=project)
    assert fn is mod.km_to_m  # one module, however it is named


def test_user_import_errors_say_where_they_looked(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match=r"imports\[0\]: 'missing.py' does not exist"):
        import_user_modules(["missing.py"], base_dir=tmp_path)
    with pytest.raises(RegistryError, match="agentrl's own package: give your file's path"):
        import_user_modules(["tools.not_there"], base_dir=tmp_path)
    (tmp_path / "broken.py").write_text("import definitely_not_installed_xyz\n")
    with pytest.raises(RegistryError, match=r"importing 'broken.py' failed: ModuleNotFoundError"):
        import_user_modules(["broken.py"], base_dir=tmp_path)


def test_user_modules_import_in_a_child_process(tmp_path: Path) -> None:
    """The project namespace is on PYTHONPATH, so pickled references import in children."""
    import pickle
    import subprocess
    import sys

    (tmp_path / "rewards.py").write_text("def score(traj, task):\n    return 1.0\n")
    fn = import_spec("rewards.py:score", base_dir=tmp_path)
    blob = pickle.dumps(fn)
    code = "import pickle, sys; f = pickle.loads(sys.stdin.buffer.read()); print(f(None, None))"
    import os

    out = subprocess.run(
        [sys.executable, "-c", code], input=blob, capture_output=True, env=dict(os.environ)
    )
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().strip() == "1.0"


def test_a_file_under_imports_resolves_by_its_stem(tmp_path: Path) -> None:
    """``imports: [plugin_x.py]`` then ``reward.sources.s: "plugin_x:score"`` (issue 22)."""
    (tmp_path / "plugin_x.py").write_text("def score(traj, task):\n    return 1.0\n")
    with pytest.raises(RegistryError, match="list its file under `imports:`"):
        import_spec("plugin_x:score", key="reward.sources.s")
    (module,) = import_user_modules(["plugin_x.py"], tmp_path)
    assert import_spec("plugin_x:score", key="reward.sources.s") is module.score
    with pytest.raises(RegistryError, match="has no attribute 'scroe'; did you mean 'score'"):
        import_spec("plugin_x:scroe", key="reward.sources.s")
