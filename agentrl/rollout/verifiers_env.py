"""verifiers environments: a verifiers (0.4) taskset + env trained through the recording proxy.

Why it exists: a researcher with an environment written for `verifiers` (its ``Taskset`` of
``Task`` rows with ``@vf.reward`` / ``@vf.metric`` methods, optionally an ``Env`` whose ``run``
plays a multi-turn game through ``agents.<seat>.interaction``) trains it here unchanged:
``data.generator: verifiers`` names it, its tasks become ours, its episodes run under verifiers'
own ``Env.run_episode`` against our policy, and its rubric is the reward.

How it bends to verifiers' model (verifiers owns the message loop):

- every seat's program (verifiers' "harness") is :class:`AgentrlHarness`, an in-process chat
  loop (the ``null`` harness's loop: model turn, MCP tool calls, repeat until a reply without
  calls), non-streaming, with no uv and no network; seats run in the ``subprocess`` runtime;
- verifiers sends every model call through its interception server (that is what fills its
  trace, which its rewards read); the interception forwards it, unchanged, to our recording
  proxy (:mod:`agentrl.rollout.proxy`, in-process through an ASGI transport) with one proxy
  session per episode, so the tokens trained are the tokens the policy sampled, exactly as for
  :class:`~agentrl.rollout.openai_agent.OpenAIAgent`;
- a multi-turn env's later turns resend the whole conversation; the proxy recognises the
  continuation and appends only the new turn's tokens (mask 0), so the episode is one
  token-exact sequence. A history rewrite (a prefix break) keeps the last segment, counted as
  ``proxy_extra_segments``;
- verifiers scores the trace (its rewards, weights and metrics); the agent stores the weighted
  total as ``verifiers/reward`` and each reward function's score as ``verifiers/reward/<name>``
  (each metric as ``verifiers/metric/<name>``) in the trajectory's metrics, and the ``verifiers``
  reward returns them (its ``score`` is the total).

Mistakes fail before any server starts (:func:`check_verifiers_config`): a taskset or env module
that does not import, or config keys its config classes do not take, name the key, the value and
the fix. ``verifiers`` is imported only when configured (the ``verifiers`` extra).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from agentrl.config.verifiers import VerifiersConfig
from agentrl.registry import RegistryError
from agentrl.types import StopReason, Task, Trajectory
from agents import AgentContext, AgentLoop

__all__ = [
    "EXTRA_KEY",
    "VerifiersAgent",
    "VerifiersError",
    "check_verifiers_config",
    "generate_verifiers_tasks",
    "verifiers_reward",
]

EXTRA_KEY = "verifiers"
"""Key of ``Task.extra`` holding the env config (JSON) and the task's index in the taskset."""
HARNESS_ID = "agentrl_verifiers_harness"
"""verifiers harness id of :class:`AgentrlHarness`: verifiers imports harness ids as top-level
modules, so this alias stands for :mod:`agentrl.rollout.verifiers_harness`."""
AGENT_SPEC = "agentrl.rollout.verifiers_env:VerifiersAgent"


class VerifiersError(RegistryError):
    """``data.verifiers`` names something verifiers cannot load, or options it does not take."""


def _vf() -> Any:
    """``verifiers.v1``, or an error saying how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise VerifiersError(
            "data.generator: 'verifiers' needs the verifiers package (0.4); install it with "
            "`pip install -e '.[verifiers]'` (or `make setup`)"
        ) from exc
    return vf


ALIASES_KEY = "_agentrl_modules"
"""Key of the env config JSON mapping flat module aliases to the project modules they stand for."""


def _module_id(spec: str | None, key: str, base_dir: Any, aliases: dict[str, str]) -> str:
    """A verifiers plugin id: a module name as given, or a ``.py`` file / package folder of the
    user's project imported by path. verifiers imports ids as top-level modules, so a project
    module (``agentrl_user_<hash>.game``, the same in every process) gets a flat alias."""
    if not spec:
        return ""
    if spec.endswith(".py") or "/" in spec:
        from agentrl.user_code import import_path

        name = import_path(spec, base_dir=base_dir, key=key).__name__
        alias = name.replace(".", "__")
        aliases[alias] = name
        _install_aliases({alias: name})
        return alias
    return spec


def _install_aliases(aliases: dict[str, str]) -> None:
    """Make each alias importable as the project module it names (in this process)."""
    import importlib
    import sys

    for alias, name in aliases.items():
        if alias not in sys.modules:
            sys.modules[alias] = importlib.import_module(name)


def env_config_dict(cfg: VerifiersConfig, base_dir: Any = None) -> dict[str, Any]:
    """The verifiers ``EnvConfig`` data of ``cfg``: every seat runs :class:`AgentrlHarness` in the
    subprocess runtime and goes through the interception server on loopback."""
    raw: dict[str, Any] = dict(cfg.env_args)
    aliases: dict[str, str] = {}
    raw["id"] = _module_id(cfg.env, "data.verifiers.env", base_dir, aliases)
    taskset = _module_id(cfg.taskset, "data.verifiers.taskset", base_dir, aliases)
    raw["taskset"] = {**cfg.taskset_args, "id": taskset}
    raw[ALIASES_KEY] = aliases
    raw["interception"] = {"type": "server"}
    return raw


def _seat_defaults(vf: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with each seat's harness and runtime set to ours (what the user set for a seat's
    sampling, caps and timeouts is kept)."""
    cls = vf.env_config_type(raw["taskset"]["id"], raw["id"])
    out = dict(raw)
    for name, info in cls.model_fields.items():
        if isinstance(info.default, vf.AgentConfig):
            seat = dict(out.get(name) or {})
            seat["harness"] = {"id": HARNESS_ID}
            seat["runtime"] = {"type": "subprocess"}
            out[name] = seat
    return out


def _explain(exc: Exception, cfg_key: str) -> str:
    """A verifiers/pydantic error as one line naming our config keys."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()))
            loc = (
                loc.replace("taskset.", "taskset_args.", 1)
                if loc.startswith("taskset.")
                else f"env_args.{loc}"
            )
            parts.append(f"{cfg_key}.{loc}: {err.get('msg')} (got {err.get('input')!r})")
        return "; ".join(parts)
    return f"{cfg_key}: {exc}"


@functools.cache
def _load(raw_json: str) -> tuple[Any, list[Any]]:
    """The resolved verifiers env config of an env config (JSON) and its tasks, once per
    process (each episode builds its own ``Env`` from it: serving state is per instance)."""
    vf = _vf()
    raw = json.loads(raw_json)
    _install_aliases({**raw.pop(ALIASES_KEY, {}), HARNESS_ID: "agentrl.rollout.verifiers_harness"})
    try:
        raw = _seat_defaults(vf, raw)
        config = vf.resolve_env_config(raw)
        env = vf.load_environment(config)
    except ModuleNotFoundError as exc:
        key = "data.verifiers.taskset" if str(exc).startswith("taskset") else "data.verifiers.env"
        raise VerifiersError(
            f"{key}: {str(exc).rstrip('.')}. Install the environment's package, or name a "
            "file of this project (`game.py`, relative to the config)"
        ) from None
    except Exception as exc:
        raise VerifiersError(
            f"{_explain(exc, 'data.verifiers')}; see the taskset's / env's config class for "
            "the keys it takes"
        ) from None
    tasks = list(env.taskset)
    return config, tasks


def check_verifiers_config(cfg: VerifiersConfig, base_dir: Any = None) -> int:
    """Load the env of ``cfg`` (before any server starts); its number of tasks."""
    if not cfg.taskset:
        raise VerifiersError(
            "data.verifiers.taskset is empty; name the verifiers taskset module to train "
            "(e.g. `taskset: my_game`, a module exporting its Taskset in `__all__`)"
        )
    _, tasks = _load(json.dumps(env_config_dict(cfg, base_dir), sort_keys=True))
    if not tasks:
        raise VerifiersError(f"data.verifiers.taskset {cfg.taskset!r} yields no tasks")
    return len(tasks)


def _prompt_messages(data: Any) -> list[dict[str, Any]]:
    """The task's opening conversation as our messages (what prompt-length checks see)."""
    messages: list[dict[str, Any]] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages += [{"role": m.role, "content": m.content or ""} for m in data.prompt]
    if not any(m["role"] != "system" for m in messages):
        messages.append({"role": "user", "content": ""})  # the env opens the conversation
    return messages


def generate_verifiers_tasks(
    cfg: VerifiersConfig, n: int, *, offset: int = 0, split: str = "train", base_dir: Any = None
) -> list[Task]:
    """Tasks ``offset .. offset+n`` of the taskset (fewer when it has fewer), in its order."""
    raw = env_config_dict(cfg, base_dir)
    raw_json = json.dumps(raw, sort_keys=True)
    check_verifiers_config(cfg, base_dir)
    _, vtasks = _load(raw_json)
    out = []
    for vt in vtasks[offset : offset + n]:
        idx = int(vt.data.idx)
        out.append(
            Task(
                id=str(vt.data.id or f"{cfg.taskset}-{idx}"),
                messages=_prompt_messages(vt.data),
                agent=AGENT_SPEC,
                data_source=str(cfg.taskset).removesuffix(".py").rsplit("/", 1)[-1],
                extra={EXTRA_KEY: {"env": raw_json, "idx": idx, "split": split}},
            )
        )
    return out


def _proxy_client(app: Any, config: Any) -> Any:
    """A verifiers ``EvalClient`` for ``config`` that reaches the proxy ``app`` in-process (an
    ASGI transport: no port)."""
    import httpx
    from verifiers.v1.clients.eval import EvalClient

    client = EvalClient(config)
    client.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=None)
    return client


class VerifiersAgent(AgentLoop):
    """Runs one episode of a verifiers env (the task's ``extra["verifiers"]``) through the proxy."""

    name = "verifiers"

    async def run(self, task: Task, ctx: AgentContext) -> Trajectory:
        from agentrl.rollout.openai_agent import _proxy_app

        vf = _vf()
        info = task.extra.get(EXTRA_KEY) or {}
        if "env" not in info:
            raise ValueError(
                f"task {task.id!r} has no extra[{EXTRA_KEY!r}]: the verifiers agent runs only "
                "tasks made by data.generator: verifiers"
            )
        config, vtasks = _load(str(info["env"]))
        env = vf.load_environment(config)
        vtask = next(t for t in vtasks if t.data.idx == info["idx"])
        app = _proxy_app(ctx)
        recorder = app.state.recorder
        sid = recorder.open_session(
            task, sampling=ctx.sampling, index=ctx.index, agent=ctx.agent_name
        )
        client_cfg = vf.EvalClientConfig(
            base_url=f"http://agentrl-proxy/sessions/{sid}/v1", api_key_var="_"
        )
        mctx = vf.ModelContext(model="policy", client=client_cfg)
        finished = False
        try:
            async with env.serving():
                # The interception server keys its upstream clients by config: ours is the
                # proxy, in-process (its base_url is not a host anyone can reach).
                proxy = _proxy_client(app, client_cfg)
                env._interception.clients[client_cfg.model_dump_json()] = proxy
                env._interception.stack.push_async_callback(proxy.close)
                episode = await env.run_episode(vtask, mctx)
            trajs = recorder.finish(sid, uid=ctx.uid)
            finished = True
        finally:
            if not finished:
                recorder.discard(sid)
        if not trajs:
            errors = "; ".join(
                f"{e.type}: {e.message}"
                for e in [*episode.errors, *(e for t in episode.traces for e in t.errors)]
            )
            raise RuntimeError(
                f"verifiers episode of task {task.id!r} made no model call (errors: {errors or 'none'})"
            )
        traj = trajs[-1]
        if len(trajs) > 1:
            traj.metrics["proxy_extra_segments"] = float(len(trajs) - 1)
        traj.metrics.update(_scores(episode))
        if not episode.ok:
            traj.stop_reason = StopReason.ERROR
            traj.metrics["verifiers/errors"] = float(len(episode.errors))
        return traj


def _scores(episode: Any) -> dict[str, float]:
    """The episode's rubric as metrics: the weighted total, each reward's score, each metric."""
    out: dict[str, float] = {"verifiers/reward": 0.0}
    for trace in episode.traces:
        out["verifiers/reward"] += float(trace.reward)
        for name, r in trace.rewards.items():
            if r is not None:
                out[f"verifiers/reward/{name}"] = float(r.score)
        for name, v in trace.metrics.items():
            if v is not None:
                out[f"verifiers/metric/{name}"] = float(v)
    return out


def verifiers_reward(traj: Trajectory, task: Task) -> dict[str, Any]:
    """The score verifiers' rubric gave the episode (its weighted total), with each reward
    function's score and each metric beside it."""
    if "verifiers/reward" not in traj.metrics:
        raise ValueError(
            f"task {task.id!r}: no verifiers score on the trajectory; the `verifiers` reward "
            "scores only episodes run by the verifiers agent (data.generator: verifiers)"
        )
    info = {
        k.removeprefix("verifiers/"): v
        for k, v in traj.metrics.items()
        if k.startswith("verifiers/")
    }
    info.pop("reward", None)
    return {"score": float(traj.metrics["verifiers/reward"]), **info}
