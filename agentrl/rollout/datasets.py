"""Task files (JSONL and Parquet) and a resumable, deterministically shuffled task stream.

A task file has one row per :class:`~agentrl.types.Task`. Columns:

- ``prompt`` (string) **or** ``messages`` (list of ``{"role", "content", ...}`` objects);
  exactly one per row;
- ``id`` (string or integer; default ``{file_stem}-{row}``);
- ``agent`` (string, default ``tool_agent``), ``data_source`` (string, default ``default``);
- ``reward_spec`` and ``extra`` (objects; a JSON string holding an object is accepted too,
  as Parquet files often store them that way).

verl's column names are understood too: a ``prompt`` holding a list of messages,
``agent_name`` for ``agent`` and ``reward_model`` for ``reward_spec``. Any other column goes
into ``extra``.
A null value means "not given". Every error names the file, the row (and the line for JSONL)
and the column, and says what was expected.

:class:`TaskDataset` walks the tasks epoch after epoch in an order fixed by ``(seed, epoch)``;
its position is saved with :meth:`TaskDataset.state_dict` and restored with
:meth:`TaskDataset.load_state_dict`, so a resumed trainer continues with exactly the tasks it
would have seen.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agentrl.types import Task

__all__ = ["DatasetError", "TaskDataset", "load_tasks", "write_tasks_jsonl"]

_KNOWN = ("id", "prompt", "messages", "agent", "data_source", "reward_spec", "extra")


class DatasetError(ValueError):
    """A task file is unreadable or a row is malformed; the message names file, row and column."""


def _where(path: Path, row: int, line: int | None) -> str:
    return f"{path}: row {row}" + (f" (line {line})" if line is not None else "")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _as_object(value: Any, column: str, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DatasetError(
                f"{where}: column {column!r}: a string here must hold a JSON object ({exc})"
            ) from exc
    if not isinstance(value, dict):
        raise DatasetError(
            f"{where}: column {column!r}: expected an object (dict), got {_type_name(value)}"
        )
    return value


def _row_to_task(raw: Any, path: Path, row: int, line: int | None) -> Task:
    """One row as a :class:`Task` (verl's column names accepted); a bad row is a
    :class:`DatasetError` naming the file, row (and line) and column."""
    where = _where(path, row, line)
    if not isinstance(raw, dict):
        raise DatasetError(f"{where}: expected a JSON object per row, got {_type_name(raw)}")
    data = {k: v for k, v in raw.items() if v is not None}
    # verl's column names: a chat-format `prompt`, `agent_name`, `reward_model`.
    if isinstance(data.get("prompt"), list) and "messages" not in data:
        data["messages"] = data.pop("prompt")
    for alias, column in (("agent_name", "agent"), ("reward_model", "reward_spec")):
        if alias in data and column not in data:
            data[column] = data.pop(alias)
    fields = _prompt_fields(data, sorted(raw), where)
    fields["id"] = _task_id(data, path, row, where)
    for column in ("agent", "data_source"):
        if column in data:
            if not isinstance(data[column], str) or not data[column]:
                raise DatasetError(
                    f"{where}: column {column!r}: expected a non-empty string, got {data[column]!r}"
                )
            fields[column] = data[column]
    for column in ("reward_spec", "extra"):
        if column in data:
            fields[column] = _as_object(data[column], column, where)
    others = {k: v for k, v in data.items() if k not in _KNOWN}
    if others:
        fields["extra"] = {**others, **fields.get("extra", {})}
    try:
        return Task(**fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"column {'.'.join(str(p) for p in e['loc'])!r}: {e['msg']}" for e in exc.errors()
        )
        raise DatasetError(f"{where}: {problems}") from exc


def _prompt_fields(data: dict[str, Any], columns: list[str], where: str) -> dict[str, Any]:
    """``{"prompt": str}`` or ``{"messages": [...]}`` of a row (exactly one must be set; a
    ``messages`` string must hold a JSON list of messages with a string ``role``)."""
    prompt, messages = data.get("prompt"), data.get("messages")
    if prompt is None and messages is None:
        raise DatasetError(
            f"{where}: missing column 'prompt' or 'messages'; each row needs exactly one "
            f"(columns present: {columns})"
        )
    if prompt is not None and messages is not None:
        raise DatasetError(
            f"{where}: columns 'prompt' and 'messages' are both set; give exactly one of them"
        )
    if prompt is not None:
        if not isinstance(prompt, str):
            raise DatasetError(
                f"{where}: column 'prompt': expected a string, got {_type_name(prompt)}"
            )
        return {"prompt": prompt}
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError as exc:
            raise DatasetError(
                f"{where}: column 'messages': a string here must hold a JSON list ({exc})"
            ) from exc
    if not isinstance(messages, list) or not messages:
        raise DatasetError(
            f"{where}: column 'messages': expected a non-empty list of messages, got "
            f"{_type_name(messages)}"
        )
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise DatasetError(
                f"{where}: column 'messages': item {i} must be an object with a string "
                f"'role' (and 'content'), got {msg!r}"
            )
    return {"messages": [{k: v for k, v in m.items() if v is not None} for m in messages]}


def _task_id(data: dict[str, Any], path: Path, row: int, where: str) -> str:
    """The row's ``id`` column as a string, or ``<file stem>-<row>`` when it has none."""
    if "id" not in data:
        return f"{path.stem}-{row}"
    task_id = data["id"]
    if isinstance(task_id, bool) or not isinstance(task_id, str | int):
        raise DatasetError(
            f"{where}: column 'id': expected a string or integer, got {_type_name(task_id)}"
        )
    return str(task_id)


def _read_jsonl(path: Path) -> list[Task]:
    tasks: list[Task] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = len(tasks)
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    f"{_where(path, row, line_no)}: not valid JSON ({exc.msg} at column {exc.colno})"
                ) from exc
            tasks.append(_row_to_task(raw, path, row, line_no))
    return tasks


def _read_parquet(path: Path) -> list[Task]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise DatasetError(f"{path}: cannot read as Parquet ({exc})") from exc
    return [_row_to_task(raw, path, row, None) for row, raw in enumerate(table.to_pylist())]


def load_tasks(path: str | Path) -> list[Task]:
    """Read every task of a ``.jsonl`` (or ``.json`` lines) or ``.parquet`` file, in file order.

    Raises :class:`DatasetError` naming the file, row (and line) and column of the first bad row.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such task file")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        tasks = _read_jsonl(path)
    elif suffix in (".parquet", ".pq"):
        tasks = _read_parquet(path)
    else:
        raise DatasetError(f"{path}: unknown task file type {suffix!r}; use .jsonl or .parquet")
    seen: dict[str, int] = {}
    for row, task in enumerate(tasks):
        if task.id in seen:
            raise DatasetError(
                f"{path}: row {row}: column 'id': {task.id!r} repeats row {seen[task.id]}; "
                "task ids must be unique within a file"
            )
        seen[task.id] = row
    return tasks


def write_tasks_jsonl(tasks: Iterable[Task], path: str | Path) -> Path:
    """Write tasks as JSONL (one ``Task`` per line, unset optional fields left out)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for task in tasks:
            f.write(task.model_dump_json(exclude_none=True) + "\n")
    return path


class TaskDataset:
    """An endless, resumable stream of tasks: each epoch a fresh permutation fixed by
    ``(seed, epoch)`` (or file order when ``shuffle=False``).

    Example::

        data = TaskDataset(load_tasks("train.jsonl"), seed=0)
        batch = data.next_batch(8)          # may cross into the next epoch
        state = data.state_dict()           # save with the checkpoint
        data2 = TaskDataset(load_tasks("train.jsonl"), seed=0)
        data2.load_state_dict(state)        # continues exactly where data stopped
    """

    def __init__(self, tasks: Sequence[Task], *, seed: int = 0, shuffle: bool = True) -> None:
        if not tasks:
            raise DatasetError("TaskDataset needs at least one task; the task list is empty")
        self.tasks = list(tasks)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    @classmethod
    def from_file(cls, path: str | Path, *, seed: int = 0, shuffle: bool = True) -> TaskDataset:
        """A dataset of the tasks in the ``.jsonl`` or ``.parquet`` file ``path``."""
        return cls(load_tasks(path), seed=seed, shuffle=shuffle)

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, index: int) -> Task:
        return self.tasks[index]

    def epoch_order(self, epoch: int) -> list[int]:
        """Task indices in the order epoch ``epoch`` visits them (same for the same seed)."""
        order = list(range(len(self.tasks)))
        if self.shuffle:
            # Seeding with a string is stable across processes and Python versions (sha512).
            random.Random(f"agentrl-tasks-{self.seed}-{epoch}").shuffle(order)
        return order

    def _current_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            self._order = self.epoch_order(self.epoch)
            self._order_epoch = self.epoch
        return self._order

    def next_task(self) -> Task:
        """The next task; moves to the next epoch after the last one."""
        task = self.tasks[self._current_order()[self.position]]
        self.position += 1
        if self.position == len(self.tasks):
            self.epoch += 1
            self.position = 0
        return task

    def next_batch(self, batch_size: int) -> list[Task]:
        """The next ``batch_size`` tasks (continuing into the next epoch when needed)."""
        if batch_size < 1:
            raise ValueError(f"batch_size = {batch_size}; it must be >= 1")
        return [self.next_task() for _ in range(batch_size)]

    def __iter__(self) -> Iterator[Task]:
        """Endless iteration from the current position (advances it)."""
        while True:
            yield self.next_task()

    def state_dict(self) -> dict[str, int | bool]:
        """The position to save with a checkpoint (epoch, position, seed, shuffle, task count)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_tasks": len(self.tasks),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses one saved for different data or seed."""
        for key, mine in (
            ("num_tasks", len(self.tasks)),
            ("seed", self.seed),
            ("shuffle", self.shuffle),
        ):
            if key in state and state[key] != mine:
                raise DatasetError(
                    f"dataset state has {key}={state[key]!r} but this dataset has {key}={mine!r}; "
                    "resume with the same task file, seed and shuffle setting"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.tasks):
            raise DatasetError(
                f"dataset state epoch={epoch}, position={position} is out of range for "
                f"{len(self.tasks)} tasks"
            )
        self.epoch, self.position = epoch, position
