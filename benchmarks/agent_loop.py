"""Agent-loop orchestration benchmark: prints JSON.

Measures what the framework itself costs, with a zero-latency in-process policy (so no model
time is included):

- ``orchestration``: turns/s and microseconds per turn of ``tool_agent`` episodes (tasks x a
  GRPO group of samples, ``--group``) run through the ``AgentLoopManager`` (generate -> parse -> tool call -> tokenized delta -> ...);
  one Python process, i.e. one core. Target: >= 2,000 turns/s. Also reported per CPU-second
  of this process (``turns_per_cpu_s``), which is what one core gives when the machine is shared.
- ``concurrent``: 1,000 episodes in flight at once on one worker, with a policy that sleeps
  ``--latency-ms`` per turn (a stand-in for server latency): wall time, completion count and
  peak memory (Python heap peak from tracemalloc, and the process's max RSS growth).

Run: ``python benchmarks/agent_loop.py [--episodes 400] [--turns 4] [--concurrent 1000]``.
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

from agentrl.inference.tiny_model import build_tiny_tokenizer
from agentrl.rollout.manager import AgentLoopManager, WorkerConfig
from agentrl.types import SamplingParams, StopReason, Task
from agents import AgentLimits
from tests.fakes import ScriptedPolicy
from tools import ToolSet, tool

CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'


@tool
async def multiply(a: int, b: int) -> int:
    """Multiply two integers (a tool that costs nothing, so only orchestration is measured).

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def _script(turns: int) -> list[str]:
    return [CALL] * (turns - 1) + ["The answer is 42."]


def _manager(tok, turns: int, *, latency_s: float, concurrency: int) -> AgentLoopManager:
    policy = ScriptedPolicy(tok, _script(turns), delay_s=latency_s, keep_requests=False)
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


def _tasks(n: int) -> list[Task]:
    return [Task(id=f"t{i}", prompt=f"What is 6*7? ({i})") for i in range(n)]


async def orchestration(
    tok, episodes: int, turns: int, concurrency: int, group: int
) -> dict[str, float]:
    await _manager(tok, turns, latency_s=0.0, concurrency=concurrency).generate(_tasks(8))  # warm
    mgr = _manager(tok, turns, latency_s=0.0, concurrency=concurrency)
    start, cpu_start = time.perf_counter(), time.process_time()
    out = await mgr.generate(_tasks(episodes // group), n_samples=group)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    n_turns = sum(t.num_turns for t in out)
    assert all(t.stop_reason == StopReason.EOS for t in out), "benchmark episodes must finish"
    return {
        "episodes": len(out),
        "group_size": group,
        "turns_per_episode": turns,
        "turns": n_turns,
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
    mgr = _manager(tok, turns, latency_s=latency_s, concurrency=episodes)
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
    ap.add_argument("--concurrent", type=int, default=1000)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    args = ap.parse_args()
    tok = build_tiny_tokenizer()
    result = {
        "benchmark": "agent_loop",
        "orchestration": asyncio.run(
            orchestration(tok, args.episodes, args.turns, args.concurrency, args.group)
        ),
        "concurrent": asyncio.run(
            concurrent(tok, args.concurrent, args.turns, args.latency_ms / 1e3)
        ),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
