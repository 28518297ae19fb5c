"""Agent-loop orchestration benchmark: prints JSON.

Measures what the framework itself costs, with a zero-latency in-process policy (so no model
time is included):

- ``orchestration``: turns/s and microseconds per turn of ``tool_agent`` episodes (tasks x a
  GRPO group of samples, ``--group``) run through the ``AgentLoopManager`` (generate -> parse ->
  tool call -> tokenized delta -> ...); one Python process, i.e. one core. Target: >= 2,000
  turns/s. Also reported per CPU-second of this process (``turns_per_cpu_s``), which is what one
  core gives when the machine is shared.

  The workload is shaped like real RL so that caches hit only where a real run would hit: every
  task has its own operands, and turn ``k`` of an episode calls ``multiply(a, b + k)``, so tool
  outputs differ across tasks and across the turns of an episode. The samples of one GRPO group
  share the task and (``--diversity group``, the default) make the same calls, as a policy that
  agrees with itself does; ``--diversity sample`` gives every sample its own operands (no two
  episodes share a tool output: the cache-miss worst case). The delta cache's hit rate is
  reported (``delta_cache_hit_rate``).
- ``concurrent``: 1,000 episodes in flight at once on one worker, with a policy that sleeps
  ``--latency-ms`` per turn (a stand-in for server latency): wall time, completion count and
  peak memory (Python heap peak from tracemalloc, and the process's max RSS growth).

Run: ``python benchmarks/agent_loop.py [--episodes 400] [--turns 4] [--diversity group|sample]
[--concurrent 1000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentrl.episode import get_delta_renderer
from agentrl.inference.tiny_model import build_tiny_tokenizer
from agentrl.rollout.manager import AgentLoopManager, WorkerConfig
from agentrl.types import Generation, SamplingParams, StopReason, Task
from agents import AgentLimits
from tools import ToolSet, tool


@tool
async def multiply(a: int, b: int) -> int:
    """Multiply two integers (a tool that costs nothing, so only orchestration is measured).

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def _operands(task: int, sample: int, diversity: str) -> tuple[int, int]:
    """The factors of a task (of one sample, with ``diversity="sample"``)."""
    key = task * 1009 + (sample if diversity == "sample" else 0)
    return 2 + key % 997, 3 + (key * 7919) % 991


def _script(a: int, b: int, turns: int) -> list[str]:
    calls = [
        f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b + k}}}}}\n</tool_call>'
        for k in range(turns - 1)
    ]
    return [*calls, f"The answer is {a * b}."]


class TaskScriptPolicy:
    """Zero-latency policy: each episode replays the scripted turns of its task (and sample).

    The turns are tokenized before the clock starts (a real policy's cost is the server's, not
    the orchestration's); the episode is found from the session id ``"{task}#{group}/{index}"``
    that the manager gives every turn of an episode.
    """

    def __init__(self, tok, turns: int, diversity: str, n_tasks: int, group: int, delay_s: float):
        self.delay_s = delay_s
        self._ids: dict[tuple[str, int], list[list[int]]] = {}
        eos = tok.eos_token_id
        for i in range(n_tasks):
            for j in range(group if diversity == "sample" else 1):
                script = _script(*_operands(i, j, diversity), turns)
                self._ids[(f"t{i}", j)] = [
                    [*tok.encode(text, add_special_tokens=False), eos] for text in script
                ]
        self._per_sample = diversity == "sample"
        self._turn: dict[str | None, int] = {}
        longest = max(len(ids) for turns_ in self._ids.values() for ids in turns_)
        self._logprobs = [-0.05 * (1 + i % 7) for i in range(longest)]

    async def generate(self, prompt_ids, sampling, session_id=None) -> Generation:
        assert session_id is not None, "the manager gives every turn a session id"
        k = self._turn.get(session_id, 0)
        self._turn[session_id] = k + 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        group_key, index = session_id.rsplit("/", 1)
        turns = self._ids[(group_key.split("#", 1)[0], int(index) if self._per_sample else 0)]
        ids = turns[min(k, len(turns) - 1)]
        return Generation(
            token_ids=ids,
            logprobs=self._logprobs[: len(ids)],
            finish_reason="stop",
            weight_version=0,
        )


def _manager(
    tok, turns: int, *, latency_s: float, concurrency: int, diversity: str, n_tasks: int, group: int
) -> AgentLoopManager:
    policy = TaskScriptPolicy(tok, turns, diversity, n_tasks, group, latency_s)
    cfg = WorkerConfig(
        sampling=SamplingParams(max_tokens=128),
        limits=AgentLimits(max_turns=turns, max_response_tokens=8192),
    )
    return AgentLoopManager(
        policy,
        tok,
        tools=ToolSet([multiply]),
        config=cfg,
        num_workers=1,
        max_concurrency=concurrency,
    )


def _tasks(n: int, offset: int = 0) -> list[Task]:
    out = []
    for i in range(offset, offset + n):
        a, b = _operands(i, 0, "group")
        out.append(Task(id=f"t{i}", prompt=f"What is {a}*{b}?"))
    return out


def _cache_stats(tok) -> tuple[int, int]:
    info = getattr(get_delta_renderer(tok), "cache_info", None)
    if info is None:  # a renderer without a delta cache
        return 0, 0
    stats = info()
    return stats["hits"], stats["misses"]


async def orchestration(
    tok, episodes: int, turns: int, concurrency: int, group: int, diversity: str
) -> dict[str, float]:
    n_tasks = episodes // group
    warm_tasks = 8  # warm-up tasks are numbered after the measured ones: no shared tool outputs
    kw = {"concurrency": concurrency, "diversity": diversity, "group": group}
    warm = _manager(tok, turns, latency_s=0.0, n_tasks=n_tasks + warm_tasks, **kw)
    await warm.generate(_tasks(warm_tasks, offset=n_tasks))
    mgr = _manager(tok, turns, latency_s=0.0, n_tasks=n_tasks, **kw)
    hits0, misses0 = _cache_stats(tok)
    start, cpu_start = time.perf_counter(), time.process_time()
    out = await mgr.generate(_tasks(n_tasks), n_samples=group)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    hits, misses = _cache_stats(tok)
    hits, misses = hits - hits0, misses - misses0
    n_turns = sum(t.num_turns for t in out)
    assert all(t.stop_reason == StopReason.EOS for t in out), "benchmark episodes must finish"
    for t in out:  # the workload is what it claims: each episode saw its own tool outputs
        a, b = _operands(int(t.task_id[1:]), t.index, diversity)
        got = [m["content"] for m in t.messages if m["role"] == "tool"]
        assert got == [str(a * (b + k)) for k in range(turns - 1)], (t.task_id, t.index, got)
    return {
        "episodes": len(out),
        "group_size": group,
        "diversity": diversity,
        "turns_per_episode": turns,
        "turns": n_turns,
        "delta_cache_hits": hits,
        "delta_cache_misses": misses,
        "delta_cache_hit_rate": round(hits / (hits + misses), 3) if hits + misses else 0.0,
        "wall_s": round(wall, 3),
        "turns_per_s": round(n_turns / wall, 1),
        "us_per_turn": round(wall / n_turns * 1e6, 1),
        "cpu_s": round(cpu, 3),
        "turns_per_cpu_s": round(n_turns / cpu, 1),
        "target_turns_per_s": 2000,
    }


async def concurrent(tok, episodes: int, turns: int, latency_s: float) -> dict[str, float]:
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    mgr = _manager(
        tok,
        turns,
        latency_s=latency_s,
        concurrency=episodes,
        diversity="group",
        n_tasks=episodes,
        group=1,
    )
    start, cpu_start = time.perf_counter(), time.process_time()
    out = await mgr.generate(_tasks(episodes))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "episodes": episodes,
        "completed": sum(1 for t in out if t.stop_reason == StopReason.EOS),
        "turns_per_episode": turns,
        "policy_latency_ms": latency_s * 1e3,
        "wall_s": round(wall, 3),
        "ideal_wall_s": round(turns * latency_s, 3),
        "cpu_s_with_tracemalloc": round(cpu, 3),
        "python_heap_peak_mb": round(peak / 2**20, 1),
        "max_rss_growth_mb": round((rss1 - rss0) / 1024, 1),  # ru_maxrss is KiB on Linux
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=400)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--group", type=int, default=4, help="samples per task (GRPO group size)")
    ap.add_argument(
        "--diversity",
        choices=["group", "sample"],
        default="group",
        help="who shares tool calls: the samples of a group (real GRPO) or nobody (worst case)",
    )
    ap.add_argument("--concurrent", type=int, default=1000)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--smoke", action="store_true", help="a few episodes of each part (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.episodes, args.concurrency, args.concurrent, args.latency_ms = 8, 4, 8, 1.0
    tok = build_tiny_tokenizer()
    result = {
        "benchmark": "agent_loop",
        "orchestration": asyncio.run(
            orchestration(
                tok, args.episodes, args.turns, args.concurrency, args.group, args.diversity
            )
        ),
        "concurrent": asyncio.run(
            concurrent(tok, args.concurrent, args.turns, args.latency_ms / 1e3)
        ),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
