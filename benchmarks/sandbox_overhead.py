"""Python-tool sandbox overhead benchmark: prints JSON.

What the OS boundary costs per call. Three ways to run the same snippet, interleaved round by
round (A, B, C, A, B, C, ...) so that load on a shared machine hits all of them alike:

- ``bare``: ``python -I -S -c CODE`` in a subprocess (no tool at all: the floor);
- ``unsandboxed``: ``PythonTool(allow_unsandboxed=True)`` without bubblewrap (supervisor,
  limits and audit hook, no isolation: the unsafe fallback);
- ``sandboxed``: ``PythonTool()`` (bubblewrap: namespaces, private root, tmpfs, per-call user).

Two snippets: ``pass`` (start-up only) and ``files`` (writes 1 MB in 10 files, so the episode
archive is saved and restored on the next call). Reported per way: median and p90 wall time in
ms, and the sandbox's median overhead over ``unsandboxed``.

Run: ``python benchmarks/sandbox_overhead.py [--rounds 30]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.python_sandbox import PythonTool

SNIPPETS = {
    "pass": "pass",
    "files": "for i in range(10):\n    open(f'f{i}', 'wb').write(b'x' * 100_000)\n",
}


def _bare(code: str, cwd: str) -> None:
    subprocess.run(
        [sys.executable, "-I", "-S", "-c", code],
        check=True,
        cwd=cwd,
        env={"OMP_NUM_THREADS": "1"},
    )


async def _measure(rounds: int, snippet: str) -> dict[str, list[float]]:
    code = SNIPPETS[snippet]
    sandboxed = PythonTool()
    unsandboxed = PythonTool(bwrap="/nonexistent/bwrap", allow_unsandboxed=True)
    states = {"sandboxed": await sandboxed.create(), "unsandboxed": await unsandboxed.create()}
    times: dict[str, list[float]] = {"bare": [], "unsandboxed": [], "sandboxed": []}
    scratch = tempfile.mkdtemp(prefix="agentrl-bench-")
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            await asyncio.to_thread(_bare, code, scratch)
            times["bare"].append(time.perf_counter() - t0)
            for name, tool in (("unsandboxed", unsandboxed), ("sandboxed", sandboxed)):
                t0 = time.perf_counter()
                result = await tool.execute(states[name], {"code": code})
                times[name].append(time.perf_counter() - t0)
                if result.error:
                    raise RuntimeError(f"{name}: {result.content}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        await sandboxed.release(states["sandboxed"])
        await unsandboxed.release(states["unsandboxed"])
    return times


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_ms": round(1000 * statistics.median(ordered), 1),
        "p90_ms": round(1000 * ordered[int(0.9 * (len(ordered) - 1))], 1),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="one round (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.rounds = 1
    report: dict[str, object] = {"rounds": args.rounds}
    for snippet in SNIPPETS:
        times = await _measure(args.rounds, snippet)
        summary = {name: _summary(values) for name, values in times.items()}
        overhead = summary["sandboxed"]["median_ms"] - summary["unsandboxed"]["median_ms"]
        report[snippet] = {**summary, "sandbox_overhead_median_ms": round(overhead, 1)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
