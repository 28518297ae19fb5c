"""Start-up of ``agentrl train`` on the quickstart: each phase, and the time to the first rollout.

The claim measured (issue 24): from launching ``agentrl train configs/quickstart.yaml`` (the
shipped warm start, 1 step) to the first generation request a server answers. Each run is the
command a user types, in a fresh process; the script reads the run's own start-up lines
(``agentrl.training.run_log.PhaseTimer``):

- ``start-up: NAME in X s``: the seconds of each phase (config resolved, servers up and models
  loaded, tracking ready, weights v0 pushed, validation before training, ...);
- ``start-up: first rollout answered X s after launch``: the headline, counted from the
  process's creation (interpreter start and imports included);

and, for every such line, when it was logged (seconds since this script launched the process:
``at_s``). ``--src LABEL=DIR`` (repeatable) runs other source trees (e.g. a checkout of the
commit before a change) with the same interpreter, interleaved run by run (A, B, A, B, ...), so
that load drifts hit them alike; the medians, minimums and maximums are printed per tree,
with the 1-minute load average after each run.

    python benchmarks/startup.py [--runs 5] [--src before=/tmp/before --src after=.]
    python benchmarks/startup.py --smoke     # one run, the smallest batch (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.threads import SMOKE_OVERRIDES  # noqa: E402 (the same smallest batch)

FIRST_ROLLOUT = "first rollout answered"
LINE = re.compile(
    r"^(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO agentrl[\w.]*: start-up: "
    r"(?P<name>.+?) (?:in (?P<took>[\d.]+) s|(?P<after>[\d.]+) s after launch)$"
)
"""A start-up line of ``run_log.PhaseTimer`` (``configure_logging``'s format)."""


def parse_startup(stderr: str, launched_at: float) -> dict[str, Any]:
    """``{"phases_s": {name: s}, "at_s": {name: s since launch}, "first_rollout_s": s}`` from
    a run's log (``launched_at``: the epoch seconds the process was launched)."""
    phases: dict[str, float] = {}
    at: dict[str, float] = {}
    first = None
    for line in stderr.splitlines():
        m = LINE.match(line.strip())
        if not m:
            continue
        name = _generic(m["name"])
        logged = datetime.strptime(m["ts"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        at.setdefault(name, round(logged - launched_at, 3))
        if m["took"] is not None:
            phases.setdefault(name, float(m["took"]))
        elif name == FIRST_ROLLOUT:
            first = float(m["after"])
    return {"phases_s": phases, "at_s": at, "first_rollout_s": first}


def _generic(name: str) -> str:
    """``2 server(s) up ...`` -> ``N server(s) up ...``: one key whatever the server count."""
    return re.sub(r"^\d+ ", "N ", name)


def run_once(src: Path, out: Path, overrides: list[str], timeout_s: float) -> dict[str, Any]:
    """One ``agentrl train`` of the quickstart (1 step) from source tree ``src``."""
    cmd = [
        sys.executable,
        "-m",
        "agentrl",
        "train",
        str(src / "configs" / "quickstart.yaml"),
        f"model.path={src / 'checkpoints' / 'calculator-sft'}",
        "trainer.total_steps=1",
        f"trainer.output_dir={out}",
        *overrides,
        "--log-level",
        "info",
    ]
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_WAIT_POLICY": "PASSIVE"}  # as quickstart
    launched_at = time.time()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=src, timeout=timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    parsed = parse_startup(proc.stderr, launched_at)
    if parsed["first_rollout_s"] is None:
        raise RuntimeError(f"no '{FIRST_ROLLOUT}' line in the log of {src}:\n{proc.stderr[-3000:]}")
    return {**parsed, "wall_s": round(wall, 3), "load_avg_1m": os.getloadavg()[0]}


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians (and spread) over one source tree's runs."""
    names = [n for n in runs[0]["at_s"] if all(n in r["at_s"] for r in runs)]
    return {
        "n": len(runs),
        "time_to_first_rollout_s": _spread([r["first_rollout_s"] for r in runs]),
        "phases_s_median": {
            n: round(statistics.median(r["phases_s"][n] for r in runs), 3)
            for n in names
            if all(n in r["phases_s"] for r in runs)
        },
        "at_s_median": {n: round(statistics.median(r["at_s"][n] for r in runs), 3) for n in names},
        "wall_s": _spread([r["wall_s"] for r in runs]),
        "load_avg_1m": [round(r["load_avg_1m"], 2) for r in runs],
        "first_rollout_s_each": [r["first_rollout_s"] for r in runs],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="runs per source tree")
    p.add_argument(
        "--src",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="a source tree to run (repeatable; default: this checkout, labelled 'this')",
    )
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--smoke", action="store_true", help="one run, the smallest batch (CI)")
    p.add_argument("overrides", nargs="*", help="extra dotted overrides for every run")
    args = p.parse_args(argv)
    sources = dict(_source(s) for s in args.src) or {"this": ROOT}
    runs = 1 if args.smoke else args.runs
    overrides = [*(SMOKE_OVERRIDES if args.smoke else []), *args.overrides]
    results: dict[str, list[dict[str, Any]]] = {label: [] for label in sources}
    with tempfile.TemporaryDirectory(prefix="agentrl-startup-") as tmp:
        for i in range(runs):
            for label, src in sources.items():  # interleaved: A, B, A, B, ...
                out = Path(tmp) / f"{label}-{i}"
                results[label].append(run_once(src, out, overrides, args.timeout_s))
                r = results[label][-1]
                print(
                    f"[startup] {label} run {i + 1}/{runs}: first rollout "
                    f"{r['first_rollout_s']:.2f} s after launch, load {r['load_avg_1m']:.1f}",
                    file=sys.stderr,
                    flush=True,
                )
    report: dict[str, Any] = {
        "benchmark": "startup",
        "command": "agentrl train configs/quickstart.yaml (shipped warm start, 1 step)",
        "overrides": overrides,
        "cpus": os.cpu_count(),
        "results": {label: summarize(rs) for label, rs in results.items()},
    }
    labels = list(sources)
    if len(labels) == 2:
        a, b = (report["results"][x]["time_to_first_rollout_s"]["median"] for x in labels)
        report[f"first_rollout_median_{labels[1]}_over_{labels[0]}"] = round(b / a, 3)
    print(json.dumps(report, indent=2))
    return 0


def _source(spec: str) -> tuple[str, Path]:
    label, sep, path = spec.partition("=")
    if not sep or not label or not path:
        raise SystemExit(f"--src wants LABEL=DIR (got {spec!r}), e.g. --src before=/tmp/before")
    return label, Path(path).resolve()


if __name__ == "__main__":
    sys.exit(main())
