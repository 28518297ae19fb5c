"""Model rewards: a reward model or an LLM judge, served beside the policy, scoring each episode.

Why it exists: most agent tasks without a verifier are scored by a model. Here a model reward
is one entry of ``reward.models`` (a reward model, ``type: reward_model``, or a judge,
``type: judge``) with its own servers, started by the run's builder next to the policy servers
(:func:`agentrl.serving.start_model_servers`); a data source names it in ``reward.sources``
alone or mixed with function rewards (:class:`CombinedReward`: weights, or a user combiner).

- **Reward model** (:class:`RewardModelReward`): any local Hugging Face
  ``AutoModelForSequenceClassification`` directory, served by the embedded server
  (``--task score``) or by vLLM (``--runner pooling``); both answer vLLM's ``POST /pooling``.
  The episode is sent as its conversation (rendered by the reward model's own chat template
  on the server) or as its token ids; the score is the raw logit of ``label``.
- **Judge** (:class:`JudgeReward`): a chat model served like the policy. Its rubric prompt
  (``{question}``, ``{answer}``, ``{reference}`` placeholders) goes to
  ``/v1/chat/completions``; the score is read from the reply (:func:`parse_judge_score`) and
  mapped from ``[min_score, max_score]`` to ``[0, 1]``.

Guarantees:

- a model reward is an ``async`` reward function: the :class:`~agentrl.rollout.rewards.
  RewardManager` runs it on the event loop under ``reward.timeout_s`` (whatever the executor),
  the moment the episode ends; at most ``max_concurrency`` of its requests are in flight;
- a reply that holds no score (the judge answered garbage), a score outside the range, a server
  that fails or cannot be reached (after trying each of its servers once) raise
  :class:`ModelRewardError`; the manager counts it and the episode becomes a counted drop,
  never a 0.0 that is trained on. Each model counts ``reward/models/<name>/requests``,
  ``scored``, ``errors``, ``unparsed`` (replies without a score) and its latency;
- nothing connects before :meth:`ModelReward.connect`; a model reward pickles (URLs and key,
  no connections) and reconnects lazily in the process and event loop that uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from agentrl.rollout.answers import final_answer_text, last_boxed, parse_number
from agentrl.types import Task, Trajectory

__all__ = [
    "CombinedReward",
    "JudgeReward",
    "ModelReward",
    "ModelRewardError",
    "ModelServers",
    "RewardModelReward",
    "build_model_reward",
    "combine_terms",
    "local_model_servers",
    "parse_judge_score",
    "render_judge_prompt",
]

logger = logging.getLogger(__name__)

MAX_REPLY_CHARS = 1000
"""Longest judge reply kept in ``reward_info`` (and in error messages)."""


class ModelRewardError(RuntimeError):
    """A model reward could not score an episode: its servers failed, or the judge's reply held
    no usable score (``unparsed`` is True then)."""

    def __init__(self, message: str, *, unparsed: bool = False) -> None:
        super().__init__(message)
        self.unparsed = unparsed


# ---- the servers of one model ------------------------------------------------------------------
class ModelServers:
    """The servers of one model reward: least-outstanding choice, the next server on a connection
    error, a timeout or a 5xx (each server tried at most once per call), 4xx raised at once.

    Clients are created lazily per event loop and dropped when pickled. ``transport`` lets
    tests pass an in-process ASGI app (it does not survive pickling).
    """

    def __init__(
        self,
        name: str,
        urls: Sequence[str],
        *,
        api_key: str | None,
        timeout_s: float,
        max_concurrency: int,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not urls:
            raise ValueError(f"reward.models.{name}: no server URLs to connect to")
        self.name = name
        self.urls = [u.rstrip("/") for u in urls]
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.transport = transport
        self._outstanding = dict.fromkeys(self.urls, 0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._semaphore: asyncio.Semaphore | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_loop=None, _clients={}, _semaphore=None, transport=None)
        state["_outstanding"] = dict.fromkeys(self.urls, 0)
        return state

    def _bind(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._semaphore is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            timeout = httpx.Timeout(self.timeout_s, connect=min(5.0, self.timeout_s))
            self._clients = {
                url: httpx.AsyncClient(
                    base_url=url, headers=headers, timeout=timeout, transport=self.transport
                )
                for url in self.urls
            }
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
            self._loop = loop
        return self._semaphore

    async def post(self, path: str, payload: dict[str, Any]) -> Any:
        """POST ``payload`` (JSON) to ``path`` on one server; the parsed JSON answer."""
        async with self._bind():
            order = sorted(self.urls, key=lambda u: self._outstanding[u])
            failures: list[str] = []
            for url in order:
                self._outstanding[url] += 1
                try:
                    response = await self._clients[url].post(path, json=payload)
                except httpx.HTTPError as exc:
                    failures.append(f"{url}: {type(exc).__name__}: {exc}")
                    continue
                finally:
                    self._outstanding[url] -= 1
                if response.status_code >= 500:
                    failures.append(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
                    continue
                if response.status_code >= 400:
                    raise ModelRewardError(
                        f"reward.models.{self.name}: {url}{path} rejected the request "
                        f"(HTTP {response.status_code}): {response.text[:500]}"
                    )
                try:
                    return response.json()
                except ValueError as exc:
                    raise ModelRewardError(
                        f"reward.models.{self.name}: {url}{path} answered non-JSON: "
                        f"{response.text[:200]!r}"
                    ) from exc
            raise ModelRewardError(
                f"reward.models.{self.name}: every server failed: " + "; ".join(failures)
            )

    async def aclose(self) -> None:
        """Close the clients of the current event loop (idempotent)."""
        clients, self._clients = self._clients, {}
        self._loop, self._semaphore = None, None
        for client in clients.values():
            with contextlib.suppress(RuntimeError):  # a client of a loop that is gone
                await client.aclose()


# ---- model rewards -----------------------------------------------------------------------------
class ModelReward:
    """Base of the model rewards: a name, a spec (``reward.models.<name>``), servers, counters.

    ``score(traj, task)`` is the async reward function the manager calls.
    """

    def __init__(self, name: str, spec: Any, *, timeout_s: float) -> None:
        self.name = name
        self.spec = spec
        self.timeout_s = timeout_s
        self.servers: ModelServers | None = None
        self._counts = {"requests": 0, "scored": 0, "errors": 0, "unparsed": 0}
        self._latency_sum = 0.0
        self._latency_max = 0.0

    def connect(
        self,
        urls: Sequence[str],
        api_key: str | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """Point this reward at its servers (``spec.api_key`` wins over ``api_key``)."""
        self.servers = ModelServers(
            self.name,
            urls,
            api_key=self.spec.api_key or api_key,
            timeout_s=self.timeout_s,
            max_concurrency=self.spec.max_concurrency,
            transport=transport,
        )

    async def aclose(self) -> None:
        """Close the HTTP clients."""
        if self.servers is not None:
            await self.servers.aclose()

    async def _post(self, path: str, payload: dict[str, Any]) -> Any:
        if self.servers is None:
            raise ModelRewardError(
                f"reward.models.{self.name} is not connected to any server; build the run with "
                "agentrl.training.build.build_serving (it starts them), or call connect(urls)"
            )
        return await self.servers.post(path, payload)

    async def score(self, traj: Trajectory, task: Task) -> dict[str, Any]:
        """``{"score": float, ...}`` for ``traj``; raises :class:`ModelRewardError`."""
        self._counts["requests"] += 1
        start = time.perf_counter()
        try:
            result = await self._score(traj, task)
        except ModelRewardError as exc:
            self._counts["errors"] += 1
            self._counts["unparsed"] += int(exc.unparsed)
            raise
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            self._counts["errors"] += 1
            raise ModelRewardError(
                f"reward.models.{self.name}: malformed answer ({type(exc).__name__}: {exc})"
            ) from exc
        elapsed = time.perf_counter() - start
        self._counts["scored"] += 1
        self._latency_sum += elapsed
        self._latency_max = max(self._latency_max, elapsed)
        return result

    async def _score(self, traj: Trajectory, task: Task) -> dict[str, Any]:
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        """``reward/models/<name>/...``: requests, scored, errors, unparsed, latency."""
        prefix = f"reward/models/{self.name}/"
        out = {prefix + k: float(v) for k, v in self._counts.items()}
        n = self._counts["scored"]
        out[prefix + "latency_mean_s"] = self._latency_sum / n if n else 0.0
        out[prefix + "latency_max_s"] = self._latency_max
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class RewardModelReward(ModelReward):
    """A sequence classifier's logit ``label`` for the episode (``type: reward_model``)."""

    async def _score(self, traj: Trajectory, task: Task) -> dict[str, Any]:
        spec = self.spec
        payload: dict[str, Any] = {"use_activation": spec.use_activation, "task": "classify"}
        if spec.model_name:
            payload["model"] = spec.model_name
        if spec.input == "tokens":
            payload["input"] = [*traj.prompt_ids, *traj.response_ids]
        else:
            payload["messages"] = traj.messages
        body = await self._post("/pooling", payload)
        logits = [float(v) for v in body["data"][0]["data"]]
        if not 0 <= spec.label < len(logits):
            raise ModelRewardError(
                f"reward.models.{self.name}.label = {spec.label}, but the model gives "
                f"{len(logits)} logits; pick a label in [0, {len(logits)})"
            )
        score = logits[spec.label]
        if not math.isfinite(score):
            raise ModelRewardError(f"reward.models.{self.name}: non-finite score {score}")
        return {"score": score, "logits": logits}


def render_judge_prompt(template: str, question: str, answer: str, reference: str) -> str:
    """``template`` with ``{question}``, ``{answer}`` and ``{reference}`` filled in.

    Only those three placeholders are replaced (one pass, so text inside an answer is never
    expanded again); any other brace, like the ``\\boxed{N}`` of a rubric, is left as is.
    """
    values = {"question": question, "answer": answer, "reference": reference}
    return re.sub(r"\{(question|answer|reference)\}", lambda m: values[m.group(1)], template)


def parse_judge_score(
    reply: str, *, parse: str = "boxed", pattern: str | None = None
) -> float | None:
    """The number a judge's ``reply`` gives as its score, or None when it gives none.

    ``parse``: ``boxed`` (the last ``\\boxed{...}`` holds one number), ``number`` (the whole
    reply, trimmed, is one number) or ``regex`` (the first group of ``pattern``'s first match).
    Numbers are read like the rule rewards read them (``7``, ``7.5``, ``3/4``, ``80%``).
    """
    if parse == "boxed":
        text = last_boxed(reply)
    elif parse == "number":
        text = reply.strip()
    elif parse == "regex":
        if pattern is None:
            raise ValueError("parse='regex' needs a pattern with one group")
        match = re.search(pattern, reply, re.DOTALL)
        text = match.group(1) if match else None
    else:
        raise ValueError(f"parse={parse!r}: use 'boxed', 'number' or 'regex'")
    if text is None:
        return None
    value = parse_number(text)
    return None if value is None else float(value)


def _question(task: Task) -> str:
    if task.prompt is not None:
        return task.prompt
    for msg in reversed(task.messages or []):
        if msg.get("role") == "user" and isinstance(msg.get("content"), str):
            return str(msg["content"])
    return ""


def _reference(task: Task) -> str:
    gt = task.reward_spec.get("ground_truth")
    if gt is None:
        return ""
    return " or ".join(str(g) for g in gt) if isinstance(gt, list | tuple) else str(gt)


class JudgeReward(ModelReward):
    """An LLM judge's score for the episode's final answer (``type: judge``), in ``[0, 1]``."""

    async def _score(self, traj: Trajectory, task: Task) -> dict[str, Any]:
        spec = self.spec
        prompt = render_judge_prompt(
            spec.prompt, _question(task), final_answer_text(traj), _reference(task)
        )
        messages = [{"role": "user", "content": prompt}]
        if spec.system_prompt:
            messages.insert(0, {"role": "system", "content": spec.system_prompt})
        payload: dict[str, Any] = {
            "messages": messages,
            "max_tokens": spec.max_tokens,
            "temperature": spec.temperature,
        }
        if spec.model_name:
            payload["model"] = spec.model_name
        body = await self._post("/v1/chat/completions", payload)
        reply = body["choices"][0]["message"].get("content") or ""
        raw = parse_judge_score(reply, parse=spec.parse, pattern=spec.pattern)
        lo, hi = spec.min_score, spec.max_score
        if raw is None or not math.isfinite(raw) or not lo <= raw <= hi:
            what = "no score" if raw is None else f"score {raw:g} outside [{lo:g}, {hi:g}]"
            raise ModelRewardError(
                f"judge reward.models.{self.name} replied with {what} (parse={spec.parse!r}): "
                f"{reply[:MAX_REPLY_CHARS]!r}",
                unparsed=True,
            )
        return {
            "score": (raw - lo) / (hi - lo),
            "judge_score": raw,
            "judge_reply": reply[:MAX_REPLY_CHARS],
        }


_MODEL_TYPES: dict[str, type[ModelReward]] = {
    "reward_model": RewardModelReward,
    "judge": JudgeReward,
}


def build_model_reward(
    name: str, spec: Any, *, timeout_s: float, base_dir: str | Path | None = None
) -> ModelReward:
    """The model reward for ``reward.models.<name>`` (a config entry or a dict of one); a
    local model directory is checked now (it exists, and is a classifier for a reward model and
    not one for a judge), before any server starts."""
    if isinstance(spec, Mapping):
        from pydantic import TypeAdapter

        from agentrl.config import ModelRewardSpec

        spec = TypeAdapter(ModelRewardSpec).validate_python(dict(spec))
    if spec.backend != "external":
        from agentrl.inference.scoring import is_classifier_dir

        path = model_path(name, spec, base_dir)
        if is_classifier_dir(path) != (spec.type == "reward_model"):
            want = "a *ForSequenceClassification" if spec.type == "reward_model" else "a causal LM"
            raise ValueError(
                f"reward.models.{name}.path = {spec.path!r}: a {spec.type} needs {want} model "
                f"directory; {path}/config.json names {_architectures(path)}"
            )
    return _MODEL_TYPES[spec.type](name, spec, timeout_s=timeout_s)


def _architectures(path: Path) -> list[str]:
    import json

    try:
        return list(json.loads((path / "config.json").read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return []


# ---- several rewards for one data source -------------------------------------------------------
@dataclass(frozen=True)
class CombinedReward:
    """Several rewards for one data source: ``sum(weight * score)`` of the terms, or a user
    ``combine(scores, traj, task)`` over their raw scores. Run by the RewardManager (each term
    under its own executor and deadline, concurrently)."""

    terms: tuple[tuple[str, Callable[..., Any], float], ...]
    """``(name, reward function, weight)`` per term."""
    combine: Callable[..., Any] | None = None
    """``fn(scores: dict[str, float], traj, task) -> float | dict``; None = the weighted sum."""

    def __repr__(self) -> str:  # how the manager's messages name it
        return "combined(" + ", ".join(name for name, _, _ in self.terms) + ")"


def combine_terms(
    results: Mapping[str, tuple[float, list[float] | None, dict[str, Any]]],
    weights: Mapping[str, float],
    num_turns: int,
) -> dict[str, Any]:
    """The weighted sum of the terms' normalized results ``{name: (score, turn_rewards, info)}``.

    ``score = sum(w * score)``; ``turn_rewards = sum(w * turn_rewards)`` over the terms that give
    them (None when none does), so the trained return ``score + sum(turn_rewards)`` is the same
    weighted sum of the terms' returns. ``reward_info`` keeps every term's score under
    ``terms`` and each term's own info under its name.
    """
    score = sum(weights[name] * s for name, (s, _, _) in results.items())
    turns: list[float] | None = None
    for name, (_, term_turns, _) in results.items():
        if term_turns is not None:
            turns = turns or [0.0] * (num_turns or len(term_turns))
            turns = [t + weights[name] * r for t, r in zip(turns, term_turns, strict=True)]
    out: dict[str, Any] = {"score": score, "terms": {n: s for n, (s, _, _) in results.items()}}
    out.update({name: info for name, (_, _, info) in results.items() if info})
    if turns is not None:
        out["turn_rewards"] = turns
    return out


# ---- servers -----------------------------------------------------------------------------------
def local_model_servers(cfg: Any) -> int:
    """How many embedded model-reward servers ``cfg`` starts on this machine (thread plan)."""
    return sum(m.num_servers for m in cfg.reward.models.values() if m.backend == "embedded")


def model_path(name: str, spec: Any, base_dir: str | Path | None) -> Path:
    """``reward.models.<name>.path`` resolved against ``base_dir`` (the config file's folder);
    raises ``FileNotFoundError`` naming the key when it is not a model directory."""
    path = Path(spec.path).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"reward.models.{name}.path = {spec.path!r}: {path} is not a Hugging Face model "
            "directory (no config.json)"
        )
    return path
