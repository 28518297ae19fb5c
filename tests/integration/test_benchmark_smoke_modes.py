"""Every benchmark script runs: its ``--smoke`` mode (the real code path at the smallest size),
for the scripts test_benchmark_smoke.py does not cover (issue 21: ``benchmarks/service.py`` and
``benchmarks/async_speedup.py`` once crashed as shipped and nothing noticed).

Each test checks the keys of the printed JSON that the docs and the script's docstring name, with
values of the right kind (numbers meaningless at smoke size). The smokes that start whole
training runs (``agentrl train``, several embedded servers, vLLM or TRL) are marked slow.
``benchmarks/cli_runs.py`` is a helper module, run by the threads and peers/compare smokes;
``benchmarks/gpu_smoke.py`` runs in test_gpu_smoke_cpu.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_benchmark_smoke import trl_python_or_fail

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


def last_json(stdout: str) -> Any:
    """The last JSON document of ``stdout`` that starts a line (libraries print before it)."""
    lines = stdout.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i] in ("{", "["):
            return json.loads("\n".join(lines[i:]))
    raise AssertionError(f"no JSON document in the output:\n{stdout[-2000:]}")


def _smoke(script: str, *extra: str, python: Path | None = None) -> Any:
    """``benchmarks/SCRIPT --smoke EXTRA...``'s JSON; ``python`` is another venv's interpreter,
    which must not see ours (no PYTHONPATH)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if python is not None:
        env.pop("PYTHONPATH")
    proc = subprocess.run(
        [str(python or sys.executable), str(ROOT / "benchmarks" / script), "--smoke", *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return last_json(proc.stdout)


def _positive(*values: Any) -> bool:
    return all(isinstance(v, int | float) and math.isfinite(v) and v > 0 for v in values)


def test_agent_loop_smoke() -> None:
    report = _smoke("agent_loop.py")
    orch, conc = report["orchestration"], report["concurrent"]
    assert orch["episodes"] == 8 and _positive(orch["turns_per_s"], orch["us_per_turn"])
    assert 0.0 <= orch["delta_cache_hit_rate"] <= 1.0
    assert conc["completed"] == conc["episodes"] == 8
    assert _positive(conc["wall_s"], conc["ideal_wall_s"])


def test_correction_smoke() -> None:
    report = _smoke("correction.py")
    assert report["benchmark"] == "correction_full_pass" and report["n_metrics"] > 0
    for clock in ("wall", "cpu"):
        assert _positive(report[clock]["full_pass_ms_median"], report[clock]["ratio_median"])


def test_sandbox_overhead_smoke() -> None:
    report = _smoke("sandbox_overhead.py")
    for kind in ("pass", "files"):
        for mode in ("bare", "unsandboxed", "sandboxed"):
            assert _positive(report[kind][mode]["median_ms"]), (kind, mode)
        assert isinstance(report[kind]["sandbox_overhead_median_ms"], float)


def test_sft_warmstart_eval_smoke() -> None:
    results = _smoke("sft_warmstart_eval.py")
    # greedy, temperature 1, then greedy after a forced <tool_call> (every first turn calls)
    assert [(r["temperature"], r["force_tool_call"]) for r in results] == [
        (0.0, False),
        (1.0, False),
        (0.0, True),
    ]
    assert results[2]["tool_call_rate"] == 1.0
    for r in results:
        assert r["n"] == 4 and 0.0 <= r["accuracy"] <= 1.0
        for key in ("well_formed_rate", "expression_correct_rate", "accuracy_with_tool"):
            assert r[key] is None or 0.0 <= r[key] <= 1.0, key


def test_sft_speed_smoke() -> None:
    report = _smoke("sft_speed.py")
    assert report["steps_per_run"] == 2
    for stage in ("stage1_tool", "stage2_mixed"):
        s = report[stage]
        padded, micro = s["one_padded_batch@1t"], s["micro_batches@1t"]
        assert _positive(padded["s_per_step_median"], micro["s_per_step_median"])
        # the same token-mean loss either way (docs/training.md: "final losses equal")
        assert micro["final_loss"] == pytest.approx(padded["final_loss"], rel=1e-4)
        assert _positive(s["speedup_median one_padded_batch@1t / micro_batches@1t"])


def test_memory_savers_smoke() -> None:
    report = _smoke("memory_savers.py")
    med = report["median"]
    assert set(med) == {"offload", "checkpointing+small_micro"}
    for name, row in med.items():
        assert _positive(row["peak_rss_mb"], row["update_s"]), name
        assert row["peak_allocated_mb"] is None  # CPU: no allocator peak
    # a quarter of the token budget per micro-batch
    assert (
        med["checkpointing+small_micro"]["micro_batch_max_tokens"] * 4
        == (report["tokens_per_update"])
    )


def test_weight_sync_smoke() -> None:
    report = _smoke("weight_sync.py")
    rows = report["results"]
    assert [r["transport"] for r in rows] == ["shared_dir", "http", "collective"]
    for r in rows:
        assert r["pushes_ok"] == 1 and r["pushes_failed"] == 0, r.get("failure")
        assert _positive(r["push_s"], r["push_without_verify_s"], r["bytes_per_s"])
        assert _positive(r["vs_memory_copy"], r["vs_file_copy"])
        assert set(r["timing_s"]) >= {"stage", "pause", "transfer", "verify", "resume"}
        assert r["verify_max_abs_diff"] < 1e-4


def _check_inference(report: dict, systems: tuple[str, ...]) -> None:
    assert report["hf_loop_baseline"] in ("hf_loop_plan", "hf_loop_all_cpus")
    for system in systems:
        for c in (1, 32):
            assert _positive(report[f"{system}_c{c}"]["tokens_per_s_median"]), (system, c)
            assert _positive(report["ratios"][f"{system}_c{c}_over_hf_loop"]["median"])
    assert isinstance(report["target_embedded_c32_ge_4x_hf_loop"], bool)


def test_inference_smoke_embedded() -> None:
    report = _smoke("inference.py", "--skip-vllm")
    _check_inference(report, ("embedded",))
    assert "vllm_c32" not in report


def test_engine_paths_smoke() -> None:
    """The engine-level A/B the docs quote (docs/inference.md, "Prefix cache"): four engines,
    the same requests, the same tokens."""
    report = _smoke("engine_paths.py")
    res = report["results"]
    assert set(res) == {"old", "lean", "prefix_cache", "new"}
    assert res["old"]["forward"] == "HFForward" and res["new"]["forward"] == "LeanForward"
    for name, r in res.items():
        assert _positive(r["s_per_round_median"], r["speedup_vs_old_median"]), name
        assert r["same_sequences_as_old"] == 1.0, name
        assert r["max_abs_logprob_diff_vs_old"] < 1e-4, name
    assert res["old"]["prompt_tokens_cached"] == 0
    assert res["new"]["prompt_tokens_cached"] > 0
    total = res["old"]["prompt_tokens_computed"]
    assert res["new"]["prompt_tokens_computed"] + res["new"]["prompt_tokens_cached"] == total


def test_shared_prompts_smoke() -> None:
    """The update-level A/B the docs quote (docs/training.md, "Shared prompts"): the same
    updates with prompts shared and not, the shared actor reusing the repeated prompts."""
    report = _smoke("shared_prompts.py")
    res = report["results"]
    assert _positive(res["on"]["s_per_update_median"], res["off"]["s_per_update_median"])
    assert res["off"]["prompt_tokens_reused"] == 0.0
    assert res["on"]["prompt_tokens_reused"] == pytest.approx(0.5)  # 2 samples of each prompt
    assert res["max_abs_weight_diff_after_all_rounds"] < 1e-4


@pytest.mark.vllm
@pytest.mark.slow
def test_inference_smoke_with_vllm() -> None:
    from tests.integration.conftest import vllm_python_or_fail

    report = _smoke("inference.py", f"--vllm-python={vllm_python_or_fail()}")
    _check_inference(report, ("embedded", "vllm"))
    assert _positive(report["vllm_startup_s"], report["ratios"]["embedded_over_vllm_c32"]["median"])
    assert isinstance(report["target_embedded_c32_ge_1_2x_vllm"], bool)


def test_trl_grpo_smoke() -> None:
    report = _smoke("peers/trl_grpo.py", python=trl_python_or_fail())
    assert report["system"] == "trl" and report["mode"] == "tool"
    assert report["torch_threads"] == 1 and len(report["steps"]) == 2
    for step in report["steps"]:
        assert _positive(step["step_s"], step["num_tokens"]) and 0.0 <= step["reward"] <= 1.0


@pytest.mark.slow
def test_service_benchmark_smoke() -> None:
    report = _smoke("service.py")
    assert report["ratio"] > 0 and report["workload"]["smoke"] is True


@pytest.mark.slow
def test_async_speedup_smoke() -> None:
    report = _smoke("async_speedup.py")
    assert report["sync"]["max_staleness"] == 0 and report["async"]["max_staleness"] == 2
    for mode, measured in (("sync", 1), ("async", 1), ("generation_only", 2)):
        assert report[mode]["measured_steps"] == measured, mode
        assert _positive(report[mode]["s_per_sample"], report[mode]["s_per_step"]), mode
    assert report["sync"]["staleness_max"] == 0.0
    assert _positive(report["generation_only"]["finished_trajectories_per_s"])
    assert _positive(report["speedup"], report["limit_speedup"], report["speedup_over_limit"])
    assert isinstance(report["limit_holds"], bool)


@pytest.mark.slow
def test_colocate_smoke() -> None:
    report = _smoke("colocate.py")
    for mode in ("side_by_side", "colocated"):
        row = report[mode]
        assert _positive(row["peak_rss_mb"], row["wall_s"], row["step_s"]), mode
        assert len(row["rounds"]) == 1, mode
    assert _positive(report["colocated"]["freed_mb"], report["colocated"]["server_rss_asleep_mb"])
    assert _positive(*report["ratios"].values()) and len(report["ratios"]) == 5


@pytest.mark.slow
def test_threads_smoke() -> None:
    report = _smoke("threads.py")
    d = report["default"]
    assert _positive(d["wall_s_median"], d["s_per_step_median"], d["push_s_max"])
    assert 0.0 <= d["reward_last3"] <= 1.0
    assert len(d["val_accuracy_before"]) == len(d["val_accuracy_after"]) == 1
    assert report["best_by_median_wall"] == "default"
    assert isinstance(report["target_push_le_0_5s"], bool)


@pytest.mark.slow
def test_peers_compare_smoke() -> None:
    report = _smoke("peers/compare.py", f"--trl-python={trl_python_or_fail()}")
    tool = report["tool"]
    for system in ("agentrl", "trl"):
        s = tool[system]
        assert _positive(s["s_per_step_median"], s["tokens_per_s_median"]), system
        assert 0.0 <= s["reward_last3_steps"] <= 1.0, system
    assert _positive(tool["agentrl"]["push_s_max"], tool["agentrl_over_trl_s_per_step_median"])
    assert isinstance(tool["target_agentrl_s_per_step_le_trl"], bool)


@pytest.mark.slow
def test_startup_smoke() -> None:
    report = _smoke("startup.py")
    this = report["results"]["this"]
    assert this["n"] == 1 and _positive(this["time_to_first_rollout_s"]["median"])
    # the start-up lines the docs name, each read back (docs/training.md, "What a run prints")
    assert {"config resolved", "N server(s) up and models loaded", "tracking ready"} <= set(
        this["phases_s_median"]
    )
    assert _positive(this["at_s_median"]["first rollout answered"], this["wall_s"]["median"])
