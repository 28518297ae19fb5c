"""The service's durable weights: saved atomically with version and digests, reloaded exactly,
and never trusted when the bytes do not match."""

from __future__ import annotations

import json

import pytest

from agentrl.service.weight_state import (
    LATEST,
    WeightStateError,
    load_latest,
    save_latest,
    sha256_of,
)


def _file(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_nothing_saved_is_none(tmp_path):
    assert load_latest(tmp_path / "state") is None


def test_the_latest_save_is_reloaded_and_older_files_are_gone(tmp_path):
    state = tmp_path / "state"
    a, b = _file(tmp_path, "a", b"weights A"), _file(tmp_path, "b", b"weights B")
    save_latest(state, a, 3, sha256_of(a), "digest-a")
    saved = save_latest(state, b, 5, sha256_of(b), None)
    loaded = load_latest(state)
    assert loaded is not None and loaded == saved
    assert (loaded.version, loaded.sha256, loaded.digest) == (5, sha256_of(b), None)
    assert loaded.path.read_bytes() == b"weights B"
    assert sorted(p.name for p in state.iterdir()) == [LATEST, "v5.safetensors"]


def test_a_crash_before_the_pointer_moves_keeps_the_previous_version(tmp_path):
    state = tmp_path / "state"
    a = _file(tmp_path, "a", b"weights A")
    save_latest(state, a, 3, sha256_of(a), "digest-a")
    # what a crash mid-save leaves: a temporary file and a new version file, no new pointer
    (state / ".v4.safetensors.tmp").write_bytes(b"half")
    (state / "v4.safetensors").write_bytes(b"weights B")
    loaded = load_latest(state)
    assert loaded is not None and loaded.version == 3 and loaded.path.read_bytes() == b"weights A"


def test_corrupted_bytes_or_pointer_are_refused_with_the_fix(tmp_path):
    state = tmp_path / "state"
    a = _file(tmp_path, "a", b"weights A")
    saved = save_latest(state, a, 3, sha256_of(a), None)
    saved.path.write_bytes(b"weights X")
    with pytest.raises(WeightStateError, match=r"SHA-256.*delete"):
        load_latest(state)
    (state / LATEST).write_text(json.dumps({"version": "x"}))
    with pytest.raises(WeightStateError, match="unreadable"):
        load_latest(state)
    (state / LATEST).write_text(
        json.dumps(
            {
                **{"version": 3, "sha256": "0", "num_bytes": 1, "saved_at": 0.0},
                "file": "../escape.safetensors",
            }
        )
    )
    with pytest.raises(WeightStateError, match="missing"):
        load_latest(state)
