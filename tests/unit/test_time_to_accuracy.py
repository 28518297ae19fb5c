"""The time-to-accuracy benchmark's arithmetic: crossings and the ratio to TRL."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "peers"))

from time_to_accuracy import (
    AGENTRL_SYSTEM_ENV,
    CONFIG,
    SYSTEMS,
    agentrl_overrides,
    first_crossing,
    main,
    parse,
    summarize,
)


def test_first_crossing_interpolates_and_says_never() -> None:
    curve = [(0.0, 0.1), (10.0, 0.3), (20.0, 0.7), (30.0, 0.6)]
    assert first_crossing(curve, 0.5) == pytest.approx(15.0)
    assert first_crossing(curve, 0.7) == pytest.approx(20.0)
    assert first_crossing(curve, 0.05) == 0.0
    assert first_crossing(curve, 0.8) is None


def test_the_ratio_is_agentrls_time_to_trls_final_accuracy_over_trls() -> None:
    def run(system: str, seed: int, points: list[tuple[float, float]]) -> dict:
        snaps = [{"wall_s": t, "acc": a} for t, a in points]
        return {"system": system, "seed": seed, "snapshots": snaps}

    runs = [
        run("agentrl_async", 0, [(5.0, 0.4), (10.0, 0.8)]),
        run("trl", 0, [(10.0, 0.3), (20.0, 0.6)]),
        run("agentrl_async", 1, [(5.0, 0.2), (10.0, 0.3)]),
        run("trl", 1, [(10.0, 0.5), (20.0, 0.5)]),
    ]
    out = summarize(runs, warm=0.1, systems=["agentrl_async", "trl"])
    vs = out["systems"]["agentrl_async"]["vs_trl"]
    seed0, seed1 = vs["per_seed"]
    assert seed0["target_acc"] == 0.6 and seed0["trl_s"] == pytest.approx(20.0)
    assert seed0["agentrl_s"] == pytest.approx(5.0 + 5.0 * (0.2 / 0.4))  # 7.5 s
    assert seed0["ratio"] == pytest.approx(7.5 / 20.0)
    assert seed1["agentrl_s"] is None and seed1["ratio"] is None  # never reached 0.5
    assert seed1["note"] == "agentrl never reached 0.500"
    assert vs["reached"] == "1/2" and not vs["target_le_0_7x_trl"]
    assert out["systems"]["trl"]["curves"]["0"][0] == (
        0.0,
        0.1,
    )  # every curve starts at the warm start


def test_fixed_targets_time_every_seed_to_the_same_accuracy() -> None:
    def run(system: str, seed: int, points: list[tuple[float, float]]) -> dict:
        return {
            "system": system,
            "seed": seed,
            "snapshots": [{"wall_s": t, "acc": a} for t, a in points],
        }

    runs = [
        run("agentrl_sync", 0, [(10.0, 0.5), (20.0, 0.7)]),
        run("trl", 0, [(10.0, 0.3), (20.0, 0.9)]),  # TRL's final (0.9) is out of reach
    ]
    out = summarize(runs, warm=0.1, systems=["agentrl_sync", "trl"], fixed_targets=[0.5, 0.8])
    vs = out["systems"]["agentrl_sync"]["vs_trl"]
    assert vs["reached"] == "0/1"  # to TRL's final: never
    half = vs["fixed_targets"]["0.5"]["per_seed"][0]
    assert half["agentrl_s"] == pytest.approx(10.0)
    assert half["trl_s"] == pytest.approx(10.0 + 10.0 * (0.2 / 0.6))
    assert half["ratio"] == pytest.approx(10.0 / (10.0 + 10.0 / 3))
    assert vs["fixed_targets"]["0.8"]["reached"] == "0/1"


def test_pool_summarizes_the_runs_of_several_files_as_one(tmp_path: Path) -> None:
    """``--pool``: two result files' runs, one summary (the warm starts averaged); a seed run in
    both files is refused."""
    import json

    def report(seed: int, warm: float, ours: float) -> dict:
        def run(system: str, acc: float) -> dict:
            snaps = [{"wall_s": 10.0, "acc": acc}, {"wall_s": 20.0, "acc": acc + 0.2}]
            return {"system": system, "seed": seed, "snapshots": snaps}

        return {"warm_start_acc": warm, "runs": [run("agentrl_async", ours), run("trl", 0.3)]}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(report(0, 0.1, 0.5)))
    b.write_text(json.dumps(report(1, 0.2, 0.2)))
    out = main(["--pool", str(a), str(b), "--out", str(tmp_path / "p"), "--fixed-targets", "0.5"])
    assert out is not None and (tmp_path / "p.json").is_file() and (tmp_path / "p.png").is_file()
    assert out["warm_start_acc"] == pytest.approx(0.15)
    vs = out["systems"]["agentrl_async"]["vs_trl"]
    assert [p["seed"] for p in vs["per_seed"]] == [0, 1]
    assert vs["fixed_targets"]["0.5"]["per_seed"][0]["agentrl_s"] == pytest.approx(10.0)
    assert vs["fixed_targets"]["0.5"]["per_seed"][1]["agentrl_s"] is None  # 0.2 -> 0.4
    with pytest.raises(SystemExit, match="more than one file"):
        main(["--pool", str(a), str(a), "--out", str(tmp_path / "q")])


def test_each_agentrl_system_loads_and_differs_only_in_its_own_overrides(tmp_path: Path) -> None:
    """The systems compared are the quickstart's defaults, sync, async without the warmup, and
    sync on the engine before its prefix cache and lean forward; each config loads, and their
    staleness and engine settings are the ones the docs name."""
    from agentrl.config import load_config

    args = parse([])
    args.paths = {"tool": tmp_path / "t.jsonl", "heldout": tmp_path / "h.jsonl"}
    seen = {}
    for system in (s for s in SYSTEMS if s != "trl"):
        cfg = load_config(CONFIG, agentrl_overrides(args, system, 0, tmp_path))
        t = cfg.trainer
        seen[system] = (t.max_staleness, t.staleness_warmup_steps, cfg.inference.prefix_cache_mb)
    assert seen == {
        "agentrl_sync": (0, 6, 256.0),  # the warmup of η = 0 is a no-op: its bound stays 0
        "agentrl_async": (2, 6, 256.0),
        "agentrl_async_no_warmup": (2, 0, 256.0),
        "agentrl_sync_old_engine": (0, 6, 0.0),
    }
    assert AGENTRL_SYSTEM_ENV == {"agentrl_sync_old_engine": {"AGENTRL_LEAN_FORWARD": "0"}}
