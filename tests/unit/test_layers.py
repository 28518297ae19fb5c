"""Layers point one way: a module imports only its own layer or lower ones (docs/design.md).

Every ``import`` counts, at module level or inside a function (a lazy import is still a
dependency). Entry points (the CLIs, the quickstart) may import anything. Edit ``LAYERS`` only
together with the map in docs/design.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agentrl", "agents", "tools", "correction")

LAYERS: list[tuple[str, ...]] = [
    # 0: contracts and foundations: no runtime, no servers
    (
        "correction",
        "agentrl.types",
        "agentrl.registry",
        "agentrl.user_code",
        "agentrl.threads",
        "agentrl.config",
        "agentrl.auth",
        "agentrl.tracking",
        "agentrl.traces",
        "agentrl.jsonsafe",
        "agentrl.http_limits",
        "agentrl.lifetime",
        "agentrl.kv_cache",
    ),
    # 1: the tool contract, the episode recorder, batches, the RL math
    ("tools", "agentrl.episode", "agentrl.batch", "agentrl.algos"),
    # 2: the agent contract and the built-in agents
    ("agents",),
    # 3: inference servers, clients, the pool
    ("agentrl.inference",),
    # 4: the agent loop, rewards, datasets, the recording proxy
    ("agentrl.rollout",),
    # 5: server specs and launch (every server: policy, reward model, judge; local or Ray), weight sync
    ("agentrl.serving", "agentrl.weightsync"),
    # 6: training, evaluation, the rollout-service SDK
    ("agentrl.training", "agentrl.evaluation", "agentrl.client"),
    # 7: placement and services built from the rest
    ("agentrl.service", "agentrl.distributed"),
]
ENTRY_POINTS = (
    "agentrl",
    "agentrl.__main__",
    "agentrl.cli",
    "agentrl.quickstart",
    "agentrl.training.train_cli",
    "agentrl.training.eval_cli",
    "agentrl.training.sft_cli",
    "agentrl.service.cli",
)


def _layer(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for i, names in enumerate(LAYERS):
        for name in names:
            matches = module == name or module.startswith(name + ".")
            if matches and (best is None or len(name) > best[0]):
                best = (len(name), i)
    return None if best is None else best[1]


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in _modules() if m not in ENTRY_POINTS and _layer(m) is None]
    assert unplaced == [], "place these modules in LAYERS (and in docs/design.md)"


def test_no_module_imports_a_higher_layer() -> None:
    violations = []
    for module, path in _modules().items():
        if module in ENTRY_POINTS:
            continue
        mine = _layer(module)
        assert mine is not None
        for imported in _imports(path):
            theirs = _layer(imported)
            if theirs is not None and theirs > mine and imported not in ENTRY_POINTS:
                violations.append(f"{module} (layer {mine}) imports {imported} (layer {theirs})")
    assert violations == []


def test_the_lower_layers_import_no_server_tracking_or_ray_library() -> None:
    """``import correction`` / ``agentrl.algos`` need torch only; tools need pydantic only."""
    heavy = {"fastapi", "uvicorn", "mlflow", "ray", "vllm", "httpx", "transformers"}
    offenders = []
    for module, path in _modules().items():
        if module.startswith(("correction", "agentrl.algos", "tools", "agentrl.types")):
            tree = ast.parse(path.read_text())
            for node in tree.body:  # module level: what `import x` pulls in
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                offenders += [f"{module}: {n}" for n in names if n.split(".")[0] in heavy]
    assert offenders == []


def _module_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (``from pkg import name`` counts ``pkg.name`` when that
    is a module), lazy imports included."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            graph[module].update(n for n in names if n in modules and n != module)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circles() -> None:
    """No module reaches itself through imports (lazy ones count): each circle is two files that
    are one thing, or a function in the wrong file (issue 20)."""
    assert _cycles(_module_graph()) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_service_and_distributed_use_only_the_public_entry_of_training() -> None:
    """``agentrl.service`` and ``agentrl.distributed`` import ``from agentrl.training import X``
    (the names its ``__init__`` lists), never a module inside it (issue 20); their CLIs are
    entry points and may."""
    import agentrl.training

    inside = []
    for module, path in _modules().items():
        if (
            module.startswith(("agentrl.service", "agentrl.distributed"))
            and module not in ENTRY_POINTS
        ):
            inside += [
                f"{module} imports {m}" for m in _imports(path) if m.startswith("agentrl.training.")
            ]
    assert inside == []
    for name, module in agentrl.training._PUBLIC.items():  # each is defined where it says
        tree = ast.parse((ROOT / "agentrl" / "training" / f"{module}.py").read_text())
        defined = {
            getattr(node, "name", None) or getattr(getattr(node, "targets", [None])[0], "id", None)
            for node in tree.body
        }
        assert name in defined, f"agentrl.training.{module} defines no {name}"
    assert sorted(agentrl.training.__all__) == sorted(agentrl.training._PUBLIC)
