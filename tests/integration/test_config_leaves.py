"""Every leaf of ``ExperimentConfig`` is read by the run it configures: no knob is accepted and
ignored.

How: every config section records which of its fields are read (attribute access, or a
``model_dump`` of the section, which is how the correction and tool sections are consumed; the
whole-config dumps for logging, ``flatten`` and ``to_yaml``, do not count). Then a real run
(one embedded server, one step, most features on: KL loss and KL reward with the adaptive
controller, periodic validation, checkpoints, MLflow, sample tables) and the builders of the
other modes (a GAE critic, vLLM and external servers) are run. A leaf that nothing read fails
the test, unless it is in ``READ_ELSEWHERE`` with the test that covers it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import agentrl.config as config_module
from agentrl.config import ExperimentConfig, VariantSection, load_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]

READ_ELSEWHERE = {
    "kind": "picks the schema at load time (tests/unit/test_config.py)",
    "distributed.backend": "agentrl train dispatches on it (tests/integration/test_ray.py)",
    "distributed.ray_address": "Ray placement (tests/integration/test_ray.py)",
    "distributed.num_gpus_per_server": "Ray placement of server actors (agentrl/distributed)",
    "distributed.num_trainer_gpus": "Ray placement of the trainer actor (agentrl/distributed)",
    "distributed.max_actor_restarts": "Ray restarts (tests/integration/test_ray_faults.py)",
    "distributed.placement": "Ray placement (tests/integration/test_ray_multinode.py)",
    "distributed.resources": "Ray placement (tests/unit/distributed/test_placement.py)",
    "trainer.max_failed_episode_share": "agentrl train's exit status (test_first_hour.py)",
    "data.reasoning_gym.tasks": "the reasoning_gym generator (test_reasoning_gym.py)",
    "data.reasoning_gym.system_prompt": "the reasoning_gym generator (test_reasoning_gym.py)",
    "data.reasoning_gym.answer_tag": "the reasoning_gym generator (test_reasoning_gym.py)",
    "data.verifiers.taskset": "the verifiers generator (test_verifiers_env.py)",
    "data.verifiers.env": "the verifiers generator (test_verifiers_env.py)",
    "data.verifiers.taskset_args": "the verifiers generator (test_verifiers_env.py)",
    "data.verifiers.env_args": "the verifiers generator (test_verifiers_env.py)",
    "environment.kwargs": "an environment's constructor (tests/unit/agents/test_environment.py)",
    **{
        f"teacher.{k}": "a distillation run with teacher.path set (test_distill.py)"
        for k in ("backend", "num_servers", "max_concurrency", "timeout_s", "mode", "coef")
    },
    "teacher.vllm_extra_args": "a vLLM teacher's spec (tests/unit/serving/test_launch.py)",
}


def leaves(model: BaseModel, prefix: str = "") -> Iterator[tuple[str, BaseModel, str]]:
    """(dotted path, owning section, field name) of every leaf."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        path = f"{prefix}{name}"
        if isinstance(value, BaseModel) and not isinstance(value, VariantSection):
            yield from leaves(value, path + ".")
        else:
            yield path, model, name


class ReadRecorder:
    """Records the dotted paths of config fields read while installed."""

    def __init__(self) -> None:
        self.paths: dict[int, str] = {}
        self.read: set[str] = set()
        self.suspended = 0

    def watch(self, cfg: ExperimentConfig) -> ExperimentConfig:
        self.paths[id(cfg)] = ""
        for path, section, _ in leaves(cfg):
            prefix = path.rpartition(".")[0]
            self.paths.setdefault(id(section), prefix + "." if prefix else "")
        return cfg

    @contextlib.contextmanager
    def installed(self) -> Iterator[ReadRecorder]:
        recorder = self
        original_get = BaseModel.__getattribute__
        original_dump = BaseModel.model_dump
        original_flatten, original_yaml = ExperimentConfig.flatten, ExperimentConfig.to_yaml

        def getattribute(obj: Any, name: str) -> Any:
            prefix = recorder.paths.get(id(obj))
            watched = prefix is not None and not recorder.suspended and not name.startswith("_")
            if watched and name in type(obj).model_fields:
                recorder.read.add(prefix + name)
            return original_get(obj, name)

        def model_dump(obj: Any, *args: Any, **kwargs: Any) -> Any:
            prefix = recorder.paths.get(id(obj))
            if prefix is not None and not recorder.suspended:
                recorder.suspended += 1
                try:
                    recorder.read.update(p for p, _, _ in leaves(obj, prefix))
                finally:
                    recorder.suspended -= 1
            return original_dump(obj, *args, **kwargs)

        def quiet(fn: Any) -> Any:
            def wrapped(obj: Any) -> Any:
                recorder.suspended += 1
                try:
                    return fn(obj)
                finally:
                    recorder.suspended -= 1

            return wrapped

        config_module.Section.__getattribute__ = getattribute  # type: ignore[method-assign]
        VariantSection.__getattribute__ = getattribute  # type: ignore[method-assign]
        BaseModel.model_dump = model_dump  # type: ignore[method-assign]
        ExperimentConfig.flatten = quiet(original_flatten)  # type: ignore[method-assign]
        ExperimentConfig.to_yaml = quiet(original_yaml)  # type: ignore[method-assign]
        try:
            yield self
        finally:
            del config_module.Section.__getattribute__
            del VariantSection.__getattribute__
            BaseModel.model_dump = original_dump  # type: ignore[method-assign]
            ExperimentConfig.flatten, ExperimentConfig.to_yaml = original_flatten, original_yaml


def _run_config(tiny_model_dir: Path, out: Path) -> ExperimentConfig:
    return load_config(
        ROOT / "configs" / "quickstart.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"trainer.output_dir={out}",
            "trainer.total_steps=1",
            "trainer.val_every=1",
            "trainer.save_every=1",
            "data.batch_size=2",
            "data.n_samples=2",
            "data.generator_val_size=2",
            "trainer.mini_batch_size=2",
            "inference.num_servers=1",
            "inference.max_tokens_per_turn=8",
            "agent.max_turns=2",
            "agent.max_response_tokens=32",
            "algorithm.use_kl_loss=true",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive",
            "tracking.enabled=true",
            f"tracking.tracking_uri=sqlite:///{out}/mlflow.db",
            "tracking.num_sample_trajectories=2",
            f"checkpoint.shared_dir={out / 'weights'}",
        ],
    )


def test_every_config_leaf_is_read_by_the_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from agentrl.serving import launch_call, spec_for, start_servers
    from agentrl.threads import make_plan
    from agentrl.training.actor import wrap_lora
    from agentrl.training.critic import CriticConfig
    from agentrl.training.trainer import Trainer

    recorder = ReadRecorder()
    cfg = recorder.watch(_run_config(tiny_model_dir, tmp_path / "run"))
    gae = recorder.watch(load_config(None, ["algorithm.advantage={name: gae, lam: 0.9}"]))
    vllm = recorder.watch(load_config(None, ["inference.backend=vllm"]))
    external = recorder.watch(
        load_config(None, ["inference.backend=external", "inference.urls=[http://127.0.0.1:1]"])
    )
    lora = recorder.watch(load_config(None, ["model.lora.rank=4", "model.lora.use_rslora=true"]))
    with recorder.installed():
        result = Trainer(cfg).run_sync()
        CriticConfig.from_config(gae)
        wrap_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora.model.lora)
        launch_call(spec_for(vllm, model=tiny_model_dir, plan=make_plan(1), log_dir=tmp_path))
        asyncio.run(
            start_servers(external, tiny_model_dir, make_plan(0), contextlib.AsyncExitStack())
        )
    assert result.steps == 1
    all_leaves = {path for path, _, _ in leaves(cfg)}
    unread = sorted(all_leaves - recorder.read - set(READ_ELSEWHERE))
    assert unread == [], (
        "these config keys are accepted but nothing reads them; honour them or remove them"
    )
    stale = sorted(set(READ_ELSEWHERE) - all_leaves)
    assert stale == [], "READ_ELSEWHERE names keys that no longer exist"
