"""Task files (JSONL, Parquet): loading, defaults, errors naming file/row/column; TaskDataset
shuffling and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentrl.rollout.datasets import DatasetError, TaskDataset, load_tasks, write_tasks_jsonl
from agentrl.types import Task


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_loads_all_columns_and_defaults(tmp_path):
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {
                "id": "a",
                "prompt": "What is 2+2?",
                "agent": "single_turn",
                "data_source": "gsm8k",
                "reward_spec": {"ground_truth": "4"},
                "extra": {"level": 1},
            },
            "",
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
            {"prompt": "p", "id": 7, "difficulty": "hard", "reward_spec": '{"ground_truth": "9"}'},
        ],
    )
    tasks = load_tasks(path)
    assert [t.id for t in tasks] == ["a", "train-1", "7"]
    assert tasks[0].agent == "single_turn" and tasks[0].data_source == "gsm8k"
    assert tasks[0].reward_spec == {"ground_truth": "4"} and tasks[0].extra == {"level": 1}
    assert tasks[1].prompt is None and tasks[1].messages[1]["content"] == "u"
    # no agent column: None, i.e. the run's agent.default
    assert tasks[1].agent is None and tasks[1].data_source == "default"
    assert tasks[2].extra == {"difficulty": "hard"} and tasks[2].reward_spec["ground_truth"] == "9"


def test_parquet_loads_like_jsonl(tmp_path):
    rows = [
        {"prompt": "p0", "data_source": "calc", "reward_spec": {"ground_truth": "1"}},
        {"prompt": "p1", "data_source": "calc", "reward_spec": {"ground_truth": "2"}},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "calc.parquet")
    tasks = load_tasks(tmp_path / "calc.parquet")
    assert [(t.id, t.prompt, t.reward_spec["ground_truth"]) for t in tasks] == [
        ("calc-0", "p0", "1"),
        ("calc-1", "p1", "2"),
    ]


def test_parquet_nulls_mean_not_given_and_verl_columns_are_understood(tmp_path):
    rows = [
        {
            "prompt": [{"role": "user", "content": "hi"}],
            "agent_name": "tool_agent",
            "reward_model": {"ground_truth": "3", "style": "rule"},
            "data_source": "openai/gsm8k",
        },
        {
            "prompt": [{"role": "user", "content": "yo"}],
            "agent_name": None,
            "reward_model": {"ground_truth": "4", "style": "rule"},
            "data_source": None,
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "verl.parquet")
    tasks = load_tasks(tmp_path / "verl.parquet")
    assert tasks[0].messages == [{"role": "user", "content": "hi"}]
    assert tasks[0].reward_spec == {"ground_truth": "3", "style": "rule"}
    assert tasks[0].data_source == "openai/gsm8k" and tasks[1].data_source == "default"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"id": "x"}, r"row 1 \(line 2\): missing column 'prompt' or 'messages'"),
        ({"prompt": 5}, r"row 1 \(line 2\): column 'prompt': expected a string, got int"),
        (
            {"prompt": "p", "messages": [{"role": "user"}]},
            r"row 1 \(line 2\): columns 'prompt' and 'messages' are both set",
        ),
        (
            {"messages": "oops"},
            r"row 1 \(line 2\): column 'messages': a string here must hold a JSON list",
        ),
        (
            {"messages": [{"content": "x"}]},
            r"column 'messages': item 0 must be an object with a string 'role'",
        ),
        ({"messages": []}, r"column 'messages': expected a non-empty list"),
        (
            {"prompt": "p", "reward_spec": [1]},
            r"row 1 \(line 2\): column 'reward_spec': expected an object \(dict\), got list",
        ),
        (
            {"prompt": "p", "extra": "{bad"},
            r"column 'extra': a string here must hold a JSON object",
        ),
        ({"prompt": "p", "agent": 3}, r"column 'agent': expected a non-empty string, got 3"),
        ({"prompt": "p", "data_source": ""}, r"column 'data_source': expected a non-empty string"),
        ({"prompt": "p", "id": 1.5}, r"column 'id': expected a string or integer, got float"),
        ([1, 2], r"row 1 \(line 2\): expected a JSON object per row, got list"),
        ('{"prompt": "p",', r"row 1 \(line 2\): not valid JSON"),
    ],
)
def test_jsonl_errors_name_file_row_and_column(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(DatasetError, match=message) as err:
        load_tasks(path)
    assert str(path) in str(err.value)


def test_parquet_errors_name_file_row_and_column(tmp_path):
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "a", "extra": "{}"}, {"prompt": "b", "extra": "[1]"}]),
        tmp_path / "bad.parquet",
    )
    with pytest.raises(
        DatasetError, match=r"bad\.parquet: row 1: column 'extra': expected an object"
    ):
        load_tasks(tmp_path / "bad.parquet")


def test_file_level_errors(tmp_path):
    with pytest.raises(DatasetError, match="no such task file"):
        load_tasks(tmp_path / "missing.jsonl")
    (tmp_path / "t.csv").write_text("prompt\nx\n")
    with pytest.raises(
        DatasetError, match=r"unknown task file type '\.csv'; use \.jsonl or \.parquet"
    ):
        load_tasks(tmp_path / "t.csv")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="cannot read as Parquet"):
        load_tasks(tmp_path / "broken.parquet")
    dup = write_jsonl(
        tmp_path / "dup.jsonl", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}]
    )
    with pytest.raises(DatasetError, match=r"row 1: column 'id': 'a' repeats row 0"):
        load_tasks(dup)


def test_write_then_load_round_trips(tmp_path):
    tasks = [
        Task(id="a", prompt="p", data_source="calculator", reward_spec={"ground_truth": "3"}),
        Task(id="b", messages=[{"role": "user", "content": "m"}], extra={"k": [1, 2]}),
    ]
    assert load_tasks(write_tasks_jsonl(tasks, tmp_path / "sub" / "rt.jsonl")) == tasks


def _tasks(n: int) -> list[Task]:
    return [Task(id=str(i), prompt=f"p{i}") for i in range(n)]


def test_shuffle_is_deterministic_per_seed_and_epoch():
    a, b, c = (
        TaskDataset(_tasks(50), seed=1),
        TaskDataset(_tasks(50), seed=1),
        TaskDataset(_tasks(50), seed=2),
    )
    assert a.epoch_order(0) == b.epoch_order(0)
    assert a.epoch_order(0) != a.epoch_order(1)
    assert a.epoch_order(0) != c.epoch_order(0)
    assert sorted(a.epoch_order(3)) == list(range(50))
    assert TaskDataset(_tasks(5), shuffle=False).epoch_order(4) == [0, 1, 2, 3, 4]


def test_batches_cover_each_epoch_once_and_cross_epochs():
    data = TaskDataset(_tasks(10), seed=0)
    first = data.next_batch(4) + data.next_batch(4)
    crossing = data.next_batch(4)
    epoch0 = [data.tasks[i].id for i in data.epoch_order(0)]
    epoch1 = [data.tasks[i].id for i in data.epoch_order(1)]
    assert [t.id for t in first + crossing] == epoch0 + epoch1[:2]
    assert data.state_dict()["epoch"] == 1 and data.state_dict()["position"] == 2


def test_resume_continues_exactly():
    data = TaskDataset(_tasks(7), seed=3)
    data.next_batch(9)
    state = data.state_dict()
    expected = [t.id for t in data.next_batch(12)]
    resumed = TaskDataset(_tasks(7), seed=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [t.id for t in resumed.next_batch(12)] == expected


def test_resume_refuses_other_data_or_seed():
    state = TaskDataset(_tasks(7), seed=3).state_dict()
    with pytest.raises(DatasetError, match="num_tasks=7 but this dataset has num_tasks=8"):
        TaskDataset(_tasks(8), seed=3).load_state_dict(state)
    with pytest.raises(DatasetError, match="seed=3 but this dataset has seed=4"):
        TaskDataset(_tasks(7), seed=4).load_state_dict(state)
    with pytest.raises(DatasetError, match="out of range"):
        TaskDataset(_tasks(7), seed=3).load_state_dict({**state, "position": 7})


def test_empty_dataset_and_bad_batch_size():
    with pytest.raises(DatasetError, match="at least one task"):
        TaskDataset([])
    with pytest.raises(ValueError, match="batch_size"):
        TaskDataset(_tasks(2)).next_batch(0)
