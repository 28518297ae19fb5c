"""RunState: what a run saves and resumes, and the checkpoint format.

Why it exists: resume bugs are the staleness bugs users hit most (AReaL #1388 lost the
accounting after a restart). Everything that must survive a restart lives in one object, is
written in one place and read in one place.

What is saved, together and after the weight push of a step (``<output_dir>/checkpoint``,
written to ``checkpoint.tmp`` and renamed, so a crash mid-save keeps the previous one):

- ``trainer_state.json``: step, version, the dataset position, the **pending tasks**
  (dispatched, not yet trained on or dropped; a resumed run re-dispatches them first, so no
  admitted task is lost and none is trained twice), the buffer counters, the admission counters
  (diagnostics), the KL controller's coefficient and the MLflow run id;
- ``actor.pt`` (model, optimizer, scheduler), ``critic.pt`` when there is a critic; with
  ``trainer.world_size`` N > 1 one file per rank instead (``actor.rank{r}.pt``, each rank's own
  FSDP2 shard of model and optimizer, written and read by that rank; :func:`model_file`), and
  ``trainer_state.json`` records N: resuming with another world size is an error that says so;
- ``rng.pt``: Python, NumPy and torch RNG states.

Task accounting (asserted by tests): every dispatched task id is, at any time, pending or
trained or dropped (``dispatched == trained + dropped + pending`` as multisets).

Example::

    state = RunState.fresh()                      # or RunState.load(out / "checkpoint")
    for task in state.task_stream(dataset): ...   # replays pending tasks first
    state.save(out / "checkpoint", dataset=..., buffer=..., actor=..., ...)
"""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agentrl.types import Task

__all__ = [
    "STATE_FILE",
    "RunState",
    "load_model_state",
    "model_file",
    "save_model_state",
    "seed_everything",
]

STATE_FILE = "trainer_state.json"


def model_file(ckpt: Path, name: str, rank: int, world_size: int) -> Path:
    """Where rank ``rank`` keeps model ``name`` (``actor``, ``critic``) in checkpoint ``ckpt``."""
    return ckpt / (f"{name}.pt" if world_size == 1 else f"{name}.rank{rank}.pt")


def save_model_state(model: Any, rank: int, world_size: int, ckpt: Path, name: str) -> None:
    """Save ``model.state_dict()`` (this rank's shard under FSDP2) as :func:`model_file`."""
    import torch  # here, not at import: a run imports torch after its servers' zygote starts

    torch.save(model.state_dict(), model_file(ckpt, name, rank, world_size))


def load_model_state(model: Any, rank: int, world_size: int, ckpt: Path, name: str) -> None:
    """Load what :func:`save_model_state` saved into ``model``."""
    import torch

    model.load_state_dict(torch.load(model_file(ckpt, name, rank, world_size), weights_only=False))


def _world_size(model: Any) -> int:
    """Ranks a model is sharded over (a ``RankedModel`` says; a plain model is 1)."""
    return int(getattr(model, "world_size", 1))


def _on_every_rank(model: Any, fn: Any, ckpt: Path, name: str) -> None:
    """``fn(model, rank, world_size, ckpt, name)`` on every rank that holds a shard of ``model``."""
    every = getattr(model, "on_every_rank", None)
    if every is None:
        fn(model, 0, 1, ckpt, name)
    else:
        every(fn, ckpt, name)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch."""
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


@dataclass
class RunState:
    """Step, version and task accounting of one run (see the module docstring)."""

    step: int = 0
    version: int = 0
    dataset: dict[str, Any] = field(default_factory=dict)
    buffer: dict[str, Any] = field(default_factory=dict)
    consumed_trajectories: int = 0
    kl_coef: float | None = None
    mlflow_run_id: str | None = None
    replay: list[Task] = field(default_factory=list)
    """Tasks to dispatch before the dataset continues (the pending tasks of a resumed run)."""
    pending: Counter[str] = field(default_factory=Counter)
    tasks_by_id: dict[str, Task] = field(default_factory=dict)
    dispatched_task_ids: list[str] = field(default_factory=list)
    trained_task_ids: list[str] = field(default_factory=list)
    dropped_task_ids: list[str] = field(default_factory=list)
    dispatched_at_save: int = 0
    """``len(dispatched_task_ids)`` when the last checkpoint was written."""
    resumed: bool = False
    world_size: int = 1
    """Trainer ranks the model files were written by (one file per rank when > 1)."""

    @classmethod
    def fresh(cls) -> RunState:
        """A run at step 0."""
        return cls()

    # ---- task accounting ------------------------------------------------------------------
    def task_stream(self, dataset: Iterable[Task]) -> Iterator[Task]:
        """The pending tasks of a resumed run, then the dataset; each one marked dispatched."""
        while self.replay:
            task = self.replay.pop(0)
            self._dispatched(task)
            yield task
        for task in dataset:
            self._dispatched(task)
            yield task

    def _dispatched(self, task: Task) -> None:
        self.dispatched_task_ids.append(task.id)
        self.pending[task.id] += 1
        self.tasks_by_id[task.id] = task

    def _settle(self, task_id: str) -> None:
        self.pending[task_id] -= 1
        if self.pending[task_id] <= 0:
            del self.pending[task_id]

    def trained(self, task_id: str) -> None:
        """A group of ``task_id`` was trained on."""
        self.trained_task_ids.append(task_id)
        self._settle(task_id)

    def dropped(self, task_id: str) -> None:
        """A group of ``task_id`` was dropped (stale, uniform reward, incomplete)."""
        self.dropped_task_ids.append(task_id)
        self._settle(task_id)

    def pending_tasks(self) -> list[Task]:
        """Dispatched, not yet settled (one entry per pending dispatch)."""
        return [self.tasks_by_id[tid] for tid, n in self.pending.items() for _ in range(n)]

    # ---- persistence ----------------------------------------------------------------------
    def save(
        self,
        ckpt: Path,
        *,
        dataset: Any,
        buffer: Any,
        actor: Any,
        critic: Any | None,
        admission: Any,
        kl_coef: float | None,
        mlflow_run_id: str | None,
    ) -> None:
        """Write the checkpoint atomically (``<ckpt>.tmp`` then rename)."""
        import torch

        tmp = ckpt.with_name(ckpt.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        self.world_size = _world_size(actor)
        _on_every_rank(actor, save_model_state, tmp, "actor")
        if critic is not None:
            _on_every_rank(critic, save_model_state, tmp, "critic")
        torch.save(
            {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
            },
            tmp / "rng.pt",
        )
        state = {
            "step": self.step,
            "version": self.version,
            "dataset": dataset.state_dict(),
            "pending_tasks": [t.model_dump(mode="json") for t in self.pending_tasks()],
            "consumed_trajectories": buffer.consumed,
            "buffer": buffer.state_dict(),
            # Diagnostics only: on resume, accepted = consumed (buffered and running episodes
            # were lost with the process; their tasks are in pending_tasks and re-dispatched).
            "admission": {
                "version": admission.version,
                "accepted": admission.accepted,
                "running": admission.running,
            },
            "kl_coef": kl_coef,
            "mlflow_run_id": mlflow_run_id,
            "world_size": self.world_size,
        }
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        self.dispatched_at_save = len(self.dispatched_task_ids)
        if ckpt.exists():
            shutil.rmtree(ckpt)
        tmp.rename(ckpt)

    @classmethod
    def load(cls, ckpt: Path, *, world_size: int | None = None) -> RunState | None:
        """The saved state (None when ``ckpt`` holds no checkpoint); RNG states are restored.

        ``world_size`` (the run's ``trainer.world_size``), when given, must be the one the
        checkpoint was written with (checked here, before anything starts).
        """
        path = ckpt / STATE_FILE
        if not path.exists():
            return None
        saved = json.loads(path.read_text())
        if world_size is not None:
            _check_world_size(ckpt, int(saved.get("world_size", 1)), world_size)
        rng_path = ckpt / "rng.pt"
        if rng_path.exists():
            import torch

            rng = torch.load(rng_path, weights_only=False)
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])
        return cls(
            step=int(saved["step"]),
            version=int(saved["version"]),
            dataset=saved["dataset"],
            buffer=saved["buffer"],
            consumed_trajectories=int(saved.get("consumed_trajectories", 0)),
            kl_coef=saved.get("kl_coef"),
            mlflow_run_id=saved.get("mlflow_run_id"),
            replay=[Task.model_validate(t) for t in saved["pending_tasks"]],
            resumed=True,
            world_size=int(saved.get("world_size", 1)),
        )

    @staticmethod
    def load_weights(ckpt: Path, actor: Any, critic: Any | None) -> None:
        """Restore the actor (and the critic, when the checkpoint has one); every rank loads
        its own shard. A checkpoint of another world size is an error that says so."""
        saved = json.loads((ckpt / STATE_FILE).read_text()) if (ckpt / STATE_FILE).exists() else {}
        world = _world_size(actor)
        _check_world_size(ckpt, int(saved.get("world_size", 1)), world)
        _on_every_rank(actor, load_model_state, ckpt, "actor")
        if critic is not None and model_file(ckpt, "critic", 0, world).exists():
            _on_every_rank(critic, load_model_state, ckpt, "critic")
        elif critic is not None:
            import logging

            logging.getLogger(__name__).warning(
                "%s has no critic.pt (saved by a run without a critic): the critic starts fresh",
                ckpt,
            )


def _check_world_size(ckpt: Path, saved: int, current: int) -> None:
    if saved != current:
        raise ValueError(
            f"{ckpt} was saved by {saved} trainer rank(s) (trainer.world_size={saved}) but this "
            f"run has trainer.world_size={current}; a checkpoint holds one model and optimizer "
            f"shard per rank, so resume with trainer.world_size={saved} (or start a fresh run "
            "in another trainer.output_dir)"
        )
