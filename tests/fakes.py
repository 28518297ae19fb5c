"""Scripted fakes shared by the test suite (one place, so tests agree on how fakes behave)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

# ---- FakeInferenceServer (PolicyClient / ServerPool unit tests) -------------------------------


class PoolMembers:
    """The ServerPool's membership calls over :attr:`members` (what a supervisor adds and
    removes); mixed into fake pools."""

    members: set[str]

    def add_server(self, url: str) -> str:
        self.members.add(url)
        return url

    async def remove_server(self, url: str) -> bool:
        self.members.discard(url)
        return True


class FakeInferenceServer:
    """A scripted in-process inference server speaking the completions + control subset.

    Use ``PolicyClient(fake.url, transport=fake.transport())``. It answers like the embedded
    server (``version_in_body=True``: int versions, ``weight_version`` in every completion body)
    or like vLLM (``version_in_body=False``: string versions, ``"default"`` at start). Script
    failures with ``fail_next`` (an int status code, ``"connect"`` for a refused connection or
    ``"drop"`` for a connection dropped mid-request), set ``alive = False`` to make every call
    fail to connect, or close ``gate`` to hold generate requests in flight.

    The generated tokens are a function of the prompt (``prompt[-1] + 1 + i``) with logprob
    ``-0.5``, so tests can check which request got which answer; ``/probe`` (the embedded
    server's verify route, served while paused) answers the same way.
    """

    def __init__(
        self,
        url: str = "http://fake",
        *,
        version: int = 0,
        version_in_body: bool = True,
        model: str = "fake-model",
    ) -> None:
        self.url = url
        self.version = version
        self.version_in_body = version_in_body
        self.model = model
        self.alive = True
        self.paused = False
        self.fail_next: list[int | str] = []
        self.generate_requests: list[dict[str, Any]] = []
        self.probe_requests: list[dict[str, Any]] = []
        """``/probe`` bodies, each with whether the server was paused when it was served."""
        self.completed: list[dict[str, Any]] = []
        self.control_calls: list[tuple[str, Any]] = []
        self.paths: list[str] = []
        """Every path requested, in order (including health and probes)."""
        self.gate = asyncio.Event()
        self.gate.set()
        self.bump_version_during_generate = False
        self.finish_reason = "length"
        """What every completion reports (``abort``: the server cut it, e.g. its deadline)."""

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self._handle)

    def _version_value(self) -> Any:
        if self.version_in_body:
            return self.version
        return "default" if self.version == 0 else str(self.version)

    @staticmethod
    def _error(status: int, message: str) -> httpx.Response:
        return httpx.Response(
            status, json={"error": {"message": message, "type": "invalid_request_error"}}
        )

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        if not self.alive:
            raise httpx.ConnectError("connection refused (fake server is down)", request=request)
        path = request.url.path
        self.paths.append(path)
        is_json = request.headers.get("content-type", "").startswith("application/json")
        body: Any = json.loads(request.content) if request.content and is_json else None
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": self.model}]})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self._version_value()})
        if path == "/v1/completions":
            return await self._complete(request, body)
        if path == "/probe":
            return self._probe(body)
        self.control_calls.append((path, body if body is not None else dict(request.url.params)))
        if path == "/pause":
            self.paused = True
            return httpx.Response(200, json={"status": "paused"})
        if path == "/resume":
            self.paused = False
            return httpx.Response(200, json={"status": "resumed"})
        if path == "/is_paused":
            return httpx.Response(200, json={"is_paused": self.paused})
        if path == "/abort_requests":
            return httpx.Response(200, json={"status": "aborted", "aborted": 0})
        if path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        if path == "/collective_rpc":
            return httpx.Response(200, json={"results": [None]})
        if path == "/update_weight_version":
            raw = body.get("version", body.get("new_version"))
            self.version = 0 if raw == "default" else int(raw)
            return httpx.Response(200, json={"success": True})
        if path == "/update_weights":
            self.version = int(request.headers["x-weight-version"])
            return httpx.Response(200, json={"success": True})
        return self._error(404, f"no route {path}")

    def _probe(self, body: dict[str, Any]) -> httpx.Response:
        """``POST /probe`` (served while paused): same tokens and logprobs as a completion."""
        self.probe_requests.append({"body": body, "paused": self.paused})
        n = len(body["token_ids"]) if body.get("token_ids") else body["max_tokens"]
        tokens = body.get("token_ids") or [body["prompt"][-1] + 1 + i for i in range(n)]
        return httpx.Response(
            200,
            json={"token_ids": tokens, "logprobs": [-0.5] * n, "weight_version": self.version},
        )

    async def _complete(self, request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        self.generate_requests.append(
            {"body": body, "headers": dict(request.headers), "server": self.url}
        )
        if self.fail_next:
            failure = self.fail_next.pop(0)
            if failure == "connect":
                raise httpx.ConnectError("connection refused (scripted)", request=request)
            if failure == "drop":
                raise httpx.RemoteProtocolError("server disconnected (scripted)", request=request)
            assert isinstance(failure, int)
            return self._error(failure, f"scripted HTTP {failure}")
        await self.gate.wait()
        if not self.alive:  # died while the request was held
            raise httpx.RemoteProtocolError("server disconnected", request=request)
        if self.bump_version_during_generate:
            self.version += 1
        prompt = body["prompt"]
        n = body["max_tokens"]
        tokens = [prompt[-1] + 1 + i for i in range(n)]
        payload: dict[str, Any] = {
            "choices": [
                {
                    "index": 0,
                    "finish_reason": self.finish_reason,
                    "logprobs": {
                        "tokens": [f"token_id:{t}" for t in tokens],
                        "token_logprobs": [-0.5] * n,
                    },
                }
            ]
        }
        if self.version_in_body:
            payload["weight_version"] = self.version
        self.completed.append({"prompt": prompt, "tokens": tokens, "server": self.url})
        return httpx.Response(200, json=payload)


# ---- ScriptedPolicy (agent loop / manager unit tests, agent-loop benchmark) ------------------


class ScriptedPolicy:
    """An in-process policy that replays scripted model turns, with zero latency by default.

    ``script`` gives the turns of *each* episode: turn ``k`` of a session (``session_id``) is
    ``script[k]`` (the last entry repeats), or ``script(prompt_ids, k)`` when callable. A turn is
    text (tokenized once and cached; the EOS id is appended so it ends like a real turn), a list
    of token ids (returned as is), a ``Generation`` (returned as is), an ``Exception`` instance
    (raised) or the string ``"abort"`` (an aborted, empty generation). Output longer than ``sampling.max_tokens`` is cut, with
    ``finish_reason="length"``. Logprobs vary per position (``-0.05 * (1 + i % 7)``) so tests
    can check their alignment; ``delay_s`` adds latency; every request is kept in ``requests``
    as ``(prompt_ids, sampling, session_id)`` (``keep_requests=False`` for benchmarks).
    """

    def __init__(
        self,
        tokenizer: Any,
        script: Any,
        *,
        version: int = 0,
        delay_s: float = 0.0,
        keep_requests: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.version = version
        self.delay_s = delay_s
        self.keep_requests = keep_requests
        self.requests: list[tuple[list[int], Any, str | None]] = []
        self._turns: dict[str | None, int] = {}
        self._encoded: dict[str, list[int]] = {}
        self._logprobs: list[float] = []
        self.calls = 0

    def _ids(self, text: str) -> list[int]:
        ids = self._encoded.get(text)
        if ids is None:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            ids.append(self.tokenizer.eos_token_id)
            self._encoded[text] = ids
        return ids

    async def generate(self, prompt_ids: list[int], sampling: Any, session_id: str | None = None):
        from agentrl.types import Generation

        self.calls += 1
        if self.keep_requests:
            self.requests.append((list(prompt_ids), sampling, session_id))
        k = self._turns.get(session_id, 0)
        self._turns[session_id] = k + 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if callable(self.script):
            turn = self.script(prompt_ids, k)
        else:
            turn = self.script[min(k, len(self.script) - 1)]
        if isinstance(turn, BaseException):
            raise turn
        if isinstance(turn, Generation):
            return turn
        if turn == "abort":
            return Generation(
                token_ids=[], logprobs=[], finish_reason="abort", weight_version=self.version
            )
        ids = list(turn) if isinstance(turn, list) else self._ids(turn)
        finish = "stop"
        if len(ids) > sampling.max_tokens:
            ids, finish = ids[: sampling.max_tokens], "length"
        while len(self._logprobs) < len(ids):
            self._logprobs.append(-0.05 * (1 + len(self._logprobs) % 7))
        logprobs = self._logprobs[: len(ids)]
        return Generation(
            token_ids=ids, logprobs=logprobs, finish_reason=finish, weight_version=self.version
        )


# ---- synthetic trajectories (actor / critic unit tests) ----------------------------------------


def random_trajectories(n: int, seed: int = 0) -> list[Any]:
    """``n`` random multi-turn-like episodes over byte ids: prompts of 3-9 tokens, responses of
    2-12 with ~30% tool tokens (mask 0, the first token always sampled), rollout log-prob -1 on
    sampled tokens, GRPO groups of two (``uid`` g0, g0, g1, ...) with rewards 0, 1, 0, 1, ..."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = rng.randint(3, 9)
        r = rng.randint(2, 12)
        mask = [1 if rng.random() < 0.7 else 0 for _ in range(r)]
        mask[0] = 1
        out.append(synthetic_trajectory(rng, i, p, mask))
    return out


def grouped_trajectories(seed: int = 0) -> list[Any]:
    """A GRPO batch whose rows repeat prompts (``trainer.share_prompts``): prompts of 4, 9 and 6
    tokens with 3, 2 and 3 samples each, then one with a single sample; responses of 2-12
    tokens with ~30 % tool tokens (mask 0)."""
    import random

    rng = random.Random(seed)
    out = []
    for n, p_len in ((3, 4), (2, 9), (3, 6), (1, 5)):
        prompt = [rng.randrange(256) for _ in range(p_len)]
        for _ in range(n):
            mask = [1 if rng.random() < 0.7 else 0 for _ in range(rng.randint(2, 12))]
            mask[0] = 1
            traj = synthetic_trajectory(rng, len(out), p_len, mask)
            traj.prompt_ids = list(prompt)
            out.append(traj)
    return out


def synthetic_trajectory(rng: Any, i: int, prompt_len: int, loss_mask: list[int]) -> Any:
    """Trajectory ``i`` of a GRPO batch (groups of two, reward ``i % 2``): random byte ids for a
    ``prompt_len``-token prompt and a response as long as ``loss_mask``, rollout log-prob -1 and
    version 0 on sampled tokens (``random.Random`` ``rng``)."""
    from agentrl.types import StopReason, Trajectory

    return Trajectory(
        prompt_ids=[rng.randrange(256) for _ in range(prompt_len)],
        response_ids=[rng.randrange(256) for _ in range(len(loss_mask))],
        loss_mask=loss_mask,
        rollout_logprobs=[-1.0 if m else 0.0 for m in loss_mask],
        policy_version=[0 if m else -1 for m in loss_mask],
        uid=f"g{i // 2}",
        index=i % 2,
        reward=float(i % 2),
        stop_reason=StopReason.EOS,
    )


# ---- model settings from the config (agentrl.config is the only home of defaults) ------------


def experiment(*overrides: str) -> Any:
    """An ``ExperimentConfig`` of the defaults plus dotted ``overrides``."""
    from agentrl.config import load_config

    return load_config(None, list(overrides))


def actor_config(*overrides: str, **fields: Any) -> Any:
    """``ActorConfig.from_config`` of the default config (+ overrides), then ``fields`` replaced.

    ``mini_batch_size`` in ``fields`` is in rows; ``loss="name"`` picks a registered loss.
    """
    import dataclasses

    from agentrl.training.actor import ActorConfig
    from agentrl.training.algorithm import build_algorithm

    cfg = experiment(*overrides)
    out = ActorConfig.from_config(cfg, build_algorithm(cfg.algorithm))
    if isinstance(fields.get("loss"), str):
        fields["loss"] = build_algorithm(
            experiment(*overrides, f"algorithm.loss={fields['loss']}").algorithm
        ).loss
    fields.setdefault("mini_batch_size", None)  # the whole batch, unless a test says otherwise
    return dataclasses.replace(out, **fields)


def critic_config(*overrides: str, **fields: Any) -> Any:
    """``CriticConfig.from_config`` of the default config (+ overrides), then ``fields`` replaced."""
    import dataclasses

    from agentrl.training.critic import CriticConfig

    out = CriticConfig.from_config(experiment(*overrides))
    fields.setdefault("mini_batch_size", None)
    return dataclasses.replace(out, **fields)


MODEL_ARGS = {"device": "cpu", "dtype": "auto", "trust_remote_code": False}
"""The keyword arguments every Actor / Critic / FrozenPolicy in a CPU test takes."""


def count_resolutions(monkeypatch: Any) -> list[Any]:
    """Every :func:`~agentrl.training.resolve.resolve_experiment` call from now on (the test's
    end undoes it), as the list of the ``Resolved`` each returned: every module that bound the
    function by name gets the counting wrapper, so no caller escapes the count."""
    import sys

    # every module that binds it, imported first so that its binding is seen
    import agentrl.distributed.ray_backend
    import agentrl.training.build
    import agentrl.training.eval_cli
    import agentrl.training.resolve
    import agentrl.training.train_cli
    import agentrl.training.trainer

    original = agentrl.training.resolve.resolve_experiment
    made: list[Any] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        resolved = original(*args, **kwargs)
        made.append(resolved)
        return resolved

    for module in list(sys.modules.values()):
        # __dict__, not getattr: agentrl.training's lazy names follow the patched module
        if getattr(module, "__dict__", {}).get("resolve_experiment") is original:
            monkeypatch.setattr(module, "resolve_experiment", counting)
    return made
