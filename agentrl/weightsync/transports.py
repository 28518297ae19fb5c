"""Weight transports: how the bytes of one weight version reach an inference server.

Why it exists: the :class:`~agentrl.weightsync.engine.CheckpointEngine` runs the push
protocol (pause, transfer, verify, resume) the same way whatever moves the bytes; a transport
only stages a version once (:meth:`WeightTransport.stage`) and loads it into one server
(:meth:`WeightTransport.load`). Every transport moves the same safetensors bytes under the
Hugging Face parameter names:

- :class:`SharedDirTransport`: ``v{version}/model.safetensors`` in a directory every server sees
  (tmpfs on one machine), written atomically; the embedded server and vLLM's
  ``reload_weights`` load it;
- :class:`HttpStreamTransport`: the bytes over HTTP from the tensors' own memory, pulled by
  each server from a trainer-side weight server (or pushed in the body); embedded server;
- :class:`~agentrl.weightsync.collective.CollectiveTransport` (its own module):
  bucketed ``torch.distributed`` broadcasts.

A LoRA adapter is staged as peft's files (``adapter_model.safetensors`` +
``adapter_config.json``) and moves the same way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from agentrl.inference.client import InferenceRequestError, PolicyClient
from agentrl.inference.lora import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    METADATA_KEY,
    VLLM_LORA_NAME,
    LoraSpec,
)
from agentrl.inference.weights import SafetensorsPayload, WeightServer

__all__ = [
    "HttpStreamTransport",
    "SharedDirTransport",
    "StagedWeights",
    "WeightTransport",
    "tied_aliases",
]

logger = logging.getLogger(__name__)


class StagedWeights:
    """One version's weights, staged once for every server: a ``path`` (shared directory), a
    ``payload`` laid out over the trainer's tensors (HTTP), or explicit ``data`` bytes."""

    def __init__(
        self,
        version: int,
        num_bytes: int,
        path: Path | None = None,
        payload: SafetensorsPayload | None = None,
        data: bytes | None = None,
        token: str | None = None,
        lora: LoraSpec | None = None,
        extra: Any = None,
    ) -> None:
        self.version = version
        self.num_bytes = num_bytes
        self.path = path
        self.payload = payload
        """The file laid out over the caller's tensors (HTTP): streamed without a copy."""
        self.token = token
        """Where the payload is published on the transport's weight server (HTTP pull)."""
        self.lora = lora
        """Set when the weights are a LoRA adapter (peft naming) with this spec."""
        self.extra = extra
        """Transport-specific staging (the collective transport's buckets and broadcast)."""
        self._data = data

    @property
    def data(self) -> bytes | None:
        """The whole file as bytes: the explicit ``data``, else the payload's bytes (a copy,
        made once; for tests and custom transports)."""
        if self._data is None and self.payload is not None:
            self._data = self.payload.to_bytes()
        return self._data

    @property
    def explicit_bytes(self) -> bool:
        """True when built from ``data`` (a custom transport's bytes), not from a payload."""
        return self.payload is None and self._data is not None


class WeightTransport(ABC):
    """How serialized weights reach a server.

    ``stage`` is called with ``lora=`` (a :class:`~agentrl.inference.lora.LoraSpec`) only for
    adapter pushes, so a transport written for full weights keeps working for them."""

    name: str = "abstract"

    @abstractmethod
    def stage(self, state_dict: dict[str, torch.Tensor], version: int) -> StagedWeights:
        """Prepare the weights once (before any server is paused)."""

    @abstractmethod
    async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
        """Make one (paused) server load the staged weights."""

    async def prepare(self, clients: Sequence[PolicyClient]) -> None:  # noqa: B027 - optional
        """Called once per push before any server is paused (e.g. to set up a weight group);
        raising fails the push on every server without pausing any."""

    def cleanup(self, keep_version: int) -> None:  # noqa: B027 - optional hook
        """Free staged data of versions other than ``keep_version``."""


def _lora_metadata(lora: LoraSpec | None) -> dict[str, str] | None:
    return None if lora is None else {"format": "pt", METADATA_KEY: lora.to_json()}


def tied_aliases(state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{"lm_head.weight": <embedding name>}`` when the state dict leaves out a tied LM head.

    A tied model's ``state_dict_for_push`` holds the shared tensor once (under the embedding's
    name). The embedded server re-ties by itself; vLLM 0.32's ``reload_weights`` does not, so
    the head must be sent explicitly, under its own name, with the embedding's bytes.
    """
    if "lm_head.weight" in state_dict:
        return {}
    embeddings = [k for k in state_dict if k.endswith(("embed_tokens.weight", "wte.weight"))]
    return {"lm_head.weight": embeddings[0]} if len(embeddings) == 1 else {}


class SharedDirTransport(WeightTransport):
    """Write ``model.safetensors`` under ``root/v{version}``; servers load that directory.

    ``root`` must be visible to every server at the same path (tmpfs ``/dev/shm`` on one
    machine, a shared filesystem across machines). Only the latest version is kept.
    """

    name = "shared_dir"

    def __init__(self, root: str | Path | None = None) -> None:
        if root is None:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            root = tempfile.mkdtemp(prefix="agentrl-weights-", dir=base)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_run(cls, base: str | Path) -> SharedDirTransport:
        """A transport staging in a directory of its own under ``base`` (``run-<pid>-*``), so
        two runs given the same ``checkpoint.shared_dir`` (or both the default) never delete
        each other's versions; :meth:`remove` deletes only that directory."""
        Path(base).mkdir(parents=True, exist_ok=True)
        return cls(tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=base))

    def stage(
        self, state_dict: dict[str, torch.Tensor], version: int, *, lora: LoraSpec | None = None
    ) -> StagedWeights:
        """Write ``v{version}/model.safetensors`` (a LoRA adapter: peft's
        ``adapter_model.safetensors`` + ``adapter_config.json``), atomically."""
        payload = SafetensorsPayload.from_state_dict(state_dict, metadata=_lora_metadata(lora))
        out = self.root / f"v{version}"
        tmp = self.root / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with (tmp / (ADAPTER_FILE if lora else "model.safetensors")).open("wb") as f:
            for chunk in payload.chunks():
                f.write(chunk)
        if lora is not None:
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(lora.adapter_config(), indent=2))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)  # atomic: a server never sees a half-written version directory
        return StagedWeights(version=version, num_bytes=payload.num_bytes, path=out, lora=lora)

    async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
        """``reload_weights`` from the version directory (vLLM + LoRA: ``load_lora_adapter``)."""
        assert staged.path is not None
        if staged.lora is not None and await client.resolve_backend() == "vllm":
            await client.load_lora_adapter(VLLM_LORA_NAME, staged.path)
            await client.set_weight_version(staged.version)
            return
        await client.update_weights_from_path(staged.path, staged.version)

    def cleanup(self, keep_version: int) -> None:
        """Delete every version directory but ``keep_version``'s."""
        for child in self.root.glob("v*"):
            if child.name != f"v{keep_version}":
                shutil.rmtree(child, ignore_errors=True)

    def remove(self) -> None:
        """Delete the whole staging root."""
        shutil.rmtree(self.root, ignore_errors=True)


class HttpStreamTransport(WeightTransport):
    """The safetensors bytes over HTTP, from the tensors' own memory (no shared filesystem).

    ``mode="pull"`` (default): staging publishes the payload on a trainer-side
    :class:`~agentrl.inference.weights.WeightServer` (one unguessable URL per version, bound to
    the interface that reaches each server, or ``advertise_host``) and each server pulls it with
    one ``readinto`` (``POST /update_weights_from_url``). A server that cannot reach the trainer
    falls back to ``mode="push"`` (the bytes streamed in the request body) for the rest of the
    run, with a warning. Staging copies nothing, so the tensors must not change until the push
    returns (the trainer awaits it).
    """

    name = "http"

    mode: Literal["pull", "push"] = "pull"
    _advertise_host: str | None = None
    _server: WeightServer | None = None

    def __init__(
        self, *, mode: Literal["pull", "push"] = "pull", advertise_host: str | None = None
    ) -> None:
        if mode not in ("pull", "push"):
            raise ValueError(f"HttpStreamTransport mode={mode!r}; use 'pull' or 'push'")
        self.mode = mode
        self._advertise_host = advertise_host

    @property
    def _push_only(self) -> set[str]:
        """Servers that could not pull (they get the bytes pushed). Created on first use, so a
        subclass that does not call ``__init__`` still works."""
        return vars(self).setdefault("_push_only_urls", set())

    @property
    def _tokens(self) -> dict[int, str]:
        return vars(self).setdefault("_token_by_version", {})

    def stage(
        self, state_dict: dict[str, torch.Tensor], version: int, *, lora: LoraSpec | None = None
    ) -> StagedWeights:
        """Lay the file out over the tensors (a LoRA spec goes in its metadata); publish it."""
        payload = SafetensorsPayload.from_state_dict(state_dict, metadata=_lora_metadata(lora))
        staged = StagedWeights(
            version=version, num_bytes=payload.num_bytes, payload=payload, lora=lora
        )
        if self.mode == "pull":
            if self._server is None:
                self._server = WeightServer(self._advertise_host)
            staged.token = self._server.publish(payload)
            self._tokens[version] = staged.token
        return staged

    async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
        """Pull (or, as a fallback, push) the staged file into ``client``'s server."""
        if staged.explicit_bytes:
            assert staged.data is not None
            await client.update_weights_from_bytes(staged.data, staged.version)
            return
        assert staged.payload is not None
        if self._server is None or staged.token is None or client.base_url in self._push_only:
            await client.update_weights_from_bytes(staged.payload, staged.version)
            return
        try:
            url = await asyncio.to_thread(self._server.url_for, client.base_url, staged.token)
            await client.update_weights_from_url(url, staged.version)
        except (OSError, InferenceRequestError) as exc:
            if isinstance(exc, InferenceRequestError) and "could not fetch" not in exc.message:
                raise
            logger.warning(
                "%s cannot pull weights from this trainer (%s); pushing them in the request "
                "body from now on (set advertise_host if the trainer is reachable elsewhere)",
                client.base_url,
                exc,
            )
            self._push_only.add(client.base_url)
            await client.update_weights_from_bytes(staged.payload, staged.version)

    def cleanup(self, keep_version: int) -> None:
        """Serve only ``keep_version`` (older URLs answer 404)."""
        if self._server is not None:
            keep = self._tokens.get(keep_version)
            for version in [v for v in self._tokens if v != keep_version]:
                del self._tokens[version]
            self._server.unpublish(keep={keep} if keep is not None else set())

    def close(self) -> None:
        """Stop the weight server (it is a daemon thread; the process exit stops it too)."""
        if self._server is not None:
            self._server.close()
            self._server = None
