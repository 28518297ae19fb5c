"""The rollout service's durable weights: the latest verified push, on disk.

Why it exists: a restarted ``agentrl serve`` must come back serving the weights a trainer last
pushed, at that version, not version 0 from ``model.path`` (a resumed job would otherwise sample
from the old policy with nothing telling the trainer); and a server that the service restarts,
or that comes back after being ejected, must be brought to the current weights before it
serves. Both read this file.

Layout of the state directory (``<store stem>-weights/`` next to the service's SQLite store)::

    v{N}.safetensors    the pushed bytes of version N, exactly as received
    latest.json         {"version": N, "file": "v{N}.safetensors", "sha256", "digest", ...}

Guarantees:

- :func:`save_latest` is atomic: the weights file is written under a temporary name, fsynced
  and renamed, then ``latest.json`` is replaced the same way; a crash at any point leaves the
  previous state readable (older files are deleted only after the new pointer is in place);
- :func:`load_latest` returns None when nothing was ever saved, and raises
  :class:`WeightStateError` (naming the file and the fix) when the state is unreadable or the
  file's SHA-256 is not the recorded one: corrupt weights are never served silently.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["LATEST", "SavedWeights", "WeightStateError", "load_latest", "save_latest", "sha256_of"]

LATEST = "latest.json"
"""The pointer file: which version is the latest verified push, and its digests."""


class WeightStateError(RuntimeError):
    """The saved weights cannot be trusted (unreadable, or their SHA-256 does not match)."""


@dataclass(frozen=True)
class SavedWeights:
    """One persisted version: where its bytes are and what names them."""

    version: int
    path: Path
    sha256: str
    """Of the safetensors bytes (what the push response reported)."""
    digest: str | None
    """The servers' content digest of the loaded weights (``/weight_info``), when they agreed."""
    num_bytes: int
    saved_at: float
    """Unix time of the save."""


def sha256_of(path: Path) -> str:
    """The SHA-256 (hex) of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(target: Path, write: object) -> None:
    """Write ``target`` through a temporary sibling: ``write(f)``, fsync, rename."""
    tmp = target.with_name(f".{target.name}.tmp")
    with tmp.open("wb") as f:
        write(f)  # type: ignore[operator]  # a callable taking the open file
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def save_latest(
    state_dir: Path, source: Path, version: int, sha256: str, digest: str | None
) -> SavedWeights:
    """Persist ``source`` (a verified push's safetensors file) as the latest ``version``."""
    state_dir.mkdir(parents=True, exist_ok=True)
    name = f"v{version}.safetensors"
    with source.open("rb") as src:
        _write_atomic(state_dir / name, lambda f: shutil.copyfileobj(src, f, 1 << 20))
    saved = SavedWeights(
        version=version,
        path=state_dir / name,
        sha256=sha256,
        digest=digest,
        num_bytes=source.stat().st_size,
        saved_at=time.time(),
    )
    meta = {**asdict(saved), "path": None, "file": name}
    _write_atomic(state_dir / LATEST, lambda f: f.write(json.dumps(meta, indent=2).encode()))
    _fsync_dir(state_dir)
    for old in state_dir.glob("v*.safetensors"):
        if old.name != name:
            with contextlib.suppress(OSError):
                old.unlink()
    return saved


def load_latest(state_dir: Path, *, check: bool = True) -> SavedWeights | None:
    """The latest persisted version (None when none was saved); ``check`` re-hashes the file."""
    pointer = state_dir / LATEST
    if not pointer.is_file():
        return None
    fix = f"delete {state_dir} to start from model.path at version 0 (the trainer re-pushes)"
    try:
        meta = json.loads(pointer.read_text())
        saved = SavedWeights(
            version=int(meta["version"]),
            path=state_dir / str(meta["file"]),
            sha256=str(meta["sha256"]),
            digest=meta.get("digest"),
            num_bytes=int(meta["num_bytes"]),
            saved_at=float(meta["saved_at"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightStateError(f"{pointer} is unreadable ({exc}); {fix}") from None
    if saved.path.parent != state_dir or not saved.path.is_file():
        raise WeightStateError(f"{pointer} names {saved.path.name}, which is missing; {fix}")
    if check and sha256_of(saved.path) != saved.sha256:
        raise WeightStateError(
            f"{saved.path} does not have the SHA-256 recorded in {pointer} (corrupted); {fix}"
        )
    return saved
