"""The Ray driver without a cluster: ``run_with_ray`` against a fake ``ray`` that records every
actor it is asked to place (constructor arguments pickled, as Ray ships them).

A real cluster runs the same path in ``tests/integration/test_ray.py``.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from agentrl.config import load_config
from agentrl.distributed.ray_backend import TrainerActor, run_with_ray
from agentrl.training.resolve import resolve_experiment
from tests.fakes import count_resolutions

UNITS = Path(__file__).resolve().parents[3] / "examples" / "units" / "config.yaml"


class _Method:
    def __init__(self, name: str) -> None:
        self.name = name

    def remote(self, *args: Any, **kwargs: Any) -> tuple[str, str]:
        return ("ref", self.name)


class _Handle:
    """A placed actor: its class and the constructor arguments it arrived with."""

    def __init__(self, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.cls, self.args, self.kwargs = cls, args, kwargs

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(name)


class FakeRay:
    """``ray.remote`` / ``get`` / ``wait`` / ``kill`` in-process; :attr:`placed` lists the actors."""

    def __init__(self) -> None:
        self.placed: list[_Handle] = []

    def get(self, refs: Any, timeout: float | None = None) -> Any:
        if isinstance(refs, list):
            return [self.get(r) for r in refs]
        return "the run's result" if refs == ("ref", "run") else {}

    def actors(self, cls: type) -> list[_Handle]:
        return [h for h in self.placed if h.cls is cls]


class _Remote:
    """``ray.remote(cls)``: ``.options(...)`` then ``.remote(*args)`` places one actor."""

    def __init__(self, fake: FakeRay, cls: type) -> None:
        self.fake, self.cls = fake, cls

    def options(self, **_: Any) -> _Remote:
        return self

    def remote(self, *args: Any, **kwargs: Any) -> _Handle:
        args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))  # what crosses to the actor
        handle = _Handle(self.cls, args, kwargs)
        self.fake.placed.append(handle)
        return handle


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> FakeRay:
    import ray

    import agentrl.distributed.ray_backend as backend

    fake = FakeRay()
    monkeypatch.setattr(ray, "remote", lambda cls: _Remote(fake, cls))
    monkeypatch.setattr(ray, "get", fake.get)
    monkeypatch.setattr(ray, "wait", lambda refs, **_: (refs, []))
    monkeypatch.setattr(ray, "kill", lambda actor: None)
    monkeypatch.setattr(backend, "_connect", lambda address: False)
    return fake


def _config(tmp_path: Path) -> Any:
    # external servers: nothing to launch, so no server actor is placed
    return load_config(
        UNITS,
        [
            f"trainer.output_dir={tmp_path}",
            "distributed.backend=ray",
            "inference.backend=external",
            "inference.urls=[http://127.0.0.1:9]",
        ],
    )


def test_the_trainer_actor_gets_the_callers_resolution(
    fake_ray: FakeRay, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cfg = _config(tmp_path)
    resolved = resolve_experiment(cfg)  # as `agentrl train` does before it calls run_with_ray
    made = count_resolutions(monkeypatch)
    assert run_with_ray(cfg, resolved=resolved) == "the run's result"
    assert made == [], "run_with_ray resolved the config again"
    (trainer,) = fake_ray.actors(TrainerActor)
    assert trainer.kwargs["resolved"] == resolved  # pickled across, the same resolution
    assert [t.id for t in trainer.kwargs["resolved"].train_tasks] == [
        t.id for t in resolved.train_tasks
    ]


def test_run_with_ray_resolves_a_plain_config_once_in_the_driver(
    fake_ray: FakeRay, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    made = count_resolutions(monkeypatch)
    run_with_ray(_config(tmp_path))
    assert len(made) == 1
    (trainer,) = fake_ray.actors(TrainerActor)
    assert trainer.kwargs["resolved"] == made[0]
    # the actor keeps it (for its RayTrainer) through its own pickling
    actor = TrainerActor(*trainer.args, **trainer.kwargs)
    assert pickle.loads(pickle.dumps(actor)).resolved == made[0]
