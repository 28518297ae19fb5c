"""The ToolSet: the tools of an agent, the limits of their calls, and their counters.

Why it exists: every episode of a worker uses the same tools under the same limits, and the
trainer wants one set of counters for all of them. A :class:`ToolSet` holds exactly that and
nothing per episode: ``toolset.episode()`` hands each episode a
:class:`~tools.episode.ToolEpisode` that owns the episode's tool states.

What it guarantees:

- tool names are unique and every entry is a :class:`~tools.base.Tool` (checked when built);
- the limits (:class:`~tools.limits.ToolLimits`) are validated when built, and every episode
  started from the set applies them;
- sync ``@tool`` functions run on the set's own bounded pool of daemon threads
  (``sync_workers``, created on first use), never on the event loop's default executor, so
  hung tools cannot starve what else uses that pool (weight staging), nor keep the process
  from exiting;
- counters (:class:`~tools.metrics.ToolMetrics`) are shared by every episode of the set and
  read by :meth:`ToolSet.metrics` from any thread;
- a ToolSet pickles (for Ray workers) with its tools, limits and counters; the thread pool is
  rebuilt on first use.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from tools.base import Tool
from tools.episode import ToolEpisode
from tools.executor import DaemonThreadPool
from tools.limits import TextTokenizer, ToolLimits, TruncateSide
from tools.metrics import ToolMetrics
from tools.registry import get_tool, registered_tools

__all__ = ["ToolSet"]


class ToolSet:
    """The tools of an agent, their limits, and their metrics.

    Args:
        tools: The tools; names must be unique.
        timeout_s: Seconds one call may take (``None`` = no limit); a tool's own
            ``timeout_s`` overrides it.
        max_output_chars: Most characters of a tool message (``None`` = no limit); a tool's
            own ``max_output_chars`` overrides it.
        max_output_tokens: Most tokens of a tool message, counted in the tokenizer that each
            episode is given (``episode(tokenizer=...)``: the policy's); ``None`` = no token
            budget. Applied after the character cap.
        truncate_side: Which side of a long output is cut (``right`` keeps the head).
        release_timeout_s: Seconds one ``release`` may take before it is abandoned (counted
            as a release error).
        sync_workers: Most sync ``@tool`` functions running at once (threads of the ToolSet's
            own pool; more calls wait, within their timeout).
        clock: Where call latencies are read from (seconds; tests inject a fake clock).

    A ToolSet is shared by all episodes of an agent worker: it holds no per-episode state,
    only the tools, the limits (:attr:`limits`) and the metric counters (updated from the
    event loop, guarded by a lock so that worker threads may read them).
    """

    def __init__(
        self,
        tools: Sequence[Tool] = (),
        *,
        timeout_s: float | None = 10.0,
        max_output_chars: int | None = 4000,
        max_output_tokens: int | None = None,
        truncate_side: TruncateSide = "right",
        release_timeout_s: float = 10.0,
        sync_workers: int = 16,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.clock = clock
        """Where call latencies are read from (seconds; tests inject a fake clock)."""
        self.limits = ToolLimits(
            timeout_s=timeout_s,
            max_output_chars=max_output_chars,
            max_output_tokens=max_output_tokens,
            truncate_side=truncate_side,
            release_timeout_s=release_timeout_s,
            sync_workers=sync_workers,
        )
        self._tools: dict[str, Tool] = {}
        for t in tools:
            if not isinstance(t, Tool):
                raise TypeError(
                    f"ToolSet takes Tool objects, got {type(t).__name__} ({t!r}); decorate a "
                    "function with @tool or subclass tools.Tool"
                )
            if not t.name:
                raise ValueError(f"{t!r} has an empty name; set Tool.name")
            if t.name in self._tools:
                raise ValueError(f"two tools are named {t.name!r}; tool names must be unique")
            self._tools[t.name] = t
        self._metrics = ToolMetrics()
        self._pool: DaemonThreadPool | None = None
        self._parent: ToolSet | None = None

    def with_tools(self, tools: Sequence[Tool]) -> ToolSet:
        """Other tools under this set's limits, counters and thread pool.

        This is how an agent's or an environment's own tools (built per episode, e.g. bound to
        the episode's state) run under the config's ``tools.timeout_s`` /
        ``max_output_chars`` / ``truncate_side`` and are counted in the run's
        ``tools/<name>/...`` metrics, instead of a fresh set's class defaults.
        """
        child = ToolSet(tools, clock=self.clock)
        child.limits = self.limits
        child._metrics = self._metrics
        child._parent = self._parent or self
        return child

    def tools(self) -> list[Tool]:
        """The tools, in order."""
        return list(self._tools.values())

    @classmethod
    def from_names(
        cls,
        names: Sequence[str],
        *,
        options: dict[str, dict[str, Any]] | None = None,
        extra: Sequence[Tool] = (),
        base_dir: Any = None,
        **limits: Any,
    ) -> ToolSet:
        """A ToolSet of tools looked up by name (:func:`~tools.registry.get_tool`), e.g. from a
        config.

        ``options[name]`` are that tool's constructor arguments (options of known tools that
        are not in ``names`` are ignored, so a config may hold settings of disabled tools; a
        name no tool has is an error); ``extra`` are Tool objects added as they are; ``limits``
        go to the constructor (``timeout_s``, ``max_output_chars``, ``max_output_tokens``,
        ``truncate_side``,
        ``release_timeout_s``)::

            ToolSet.from_names(["calculator", "python"], options={"python": {"wall_time_s": 2}},
                               timeout_s=10, max_output_chars=2000)
        """
        options = options or {}
        unknown = set(options) - set(names) - set(registered_tools())
        if unknown:
            raise ValueError(
                f"options given for unknown tools: {sorted(unknown)}; known tools: "
                f"{', '.join(registered_tools())}"
            )
        built: list[Tool] = []
        for name in names:
            try:
                built.append(get_tool(name, base_dir=base_dir, **options.get(name, {})))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"cannot build tool {name!r}: {exc}") from exc
        return cls([*built, *extra], **limits)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_pool")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool = None

    def _sync_pool(self) -> DaemonThreadPool:
        """The pool of sync tools (created on the first call that needs it)."""
        if self._parent is not None:
            return self._parent._sync_pool()
        if self._pool is None:
            self._pool = DaemonThreadPool(self.limits.sync_workers, name="agentrl-tool")
        return self._pool

    # -- the limits, one by one (read-only: build another ToolSet to change them) --
    @property
    def timeout_s(self) -> float | None:
        """Seconds one call may take (``None`` = no limit)."""
        return self.limits.timeout_s

    @property
    def max_output_chars(self) -> int | None:
        """Most characters of a tool message (``None`` = no limit)."""
        return self.limits.max_output_chars

    @property
    def truncate_side(self) -> TruncateSide:
        """Which side of a long output is cut."""
        return self.limits.truncate_side

    @property
    def release_timeout_s(self) -> float:
        """Seconds one ``release`` may take."""
        return self.limits.release_timeout_s

    @property
    def sync_workers(self) -> int:
        """Most sync ``@tool`` functions running at once."""
        return self.limits.sync_workers

    # -- introspection --
    def names(self) -> list[str]:
        """The tool names, in order."""
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI function schemas of all tools, in order (pass as ``tools=`` to a chat API)."""
        return [t.schema() for t in self._tools.values()]

    def get(self, name: str) -> Tool | None:
        """The tool called ``name``, or None."""
        return self._tools.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def episode(self, tokenizer: TextTokenizer | None = None) -> ToolEpisode:
        """A new episode: ``async with toolset.episode() as ep: await ep.call(...)``;
        ``tokenizer`` (the policy's) is what ``max_output_tokens`` counts in (needed with it)."""
        return ToolEpisode(
            self._tools, self.limits, self._metrics, self._sync_pool, self.clock, tokenizer
        )

    # -- metrics --
    def metrics(self, reset: bool = False) -> dict[str, float]:
        """Per-tool counters since the start (or the last ``reset=True``).

        Keys (:mod:`tools.metrics`): ``tools/<name>/calls``, ``errors``, ``timeouts``,
        ``cancelled`` (calls cut off by the caller's cancellation, e.g. the episode deadline),
        ``abandoned`` (timed-out or cancelled calls still running ``ABANDON_GRACE_S`` later),
        ``truncated``, ``release_errors``, ``latency_mean_s``, ``latency_max_s``, plus the mean
        of every number tools put in ``ToolResult.metrics``; and ``tools/unknown_calls``,
        ``tools/abandoned_running`` (abandoned calls still running now) and
        ``tools/sync_threads_busy`` (threads of the sync pool running a call now).
        """
        pool = self._parent._pool if self._parent is not None else self._pool
        busy = pool.busy if pool else 0
        return self._metrics.snapshot(reset, sync_threads_busy=busy)
