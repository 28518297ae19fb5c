"""Colocated mode on the trainer's side (issue 26): the CheckpointEngine puts a real embedded
server (in process, over ASGI) to sleep and every push wakes it, failed or not; the config
refuses the combinations that cannot colocate, naming the key, the value and the fix."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from agentrl.config import load_config
from agentrl.inference.client import PolicyClient
from agentrl.inference.engine import InferenceEngine
from agentrl.inference.server import create_app
from agentrl.rollout.admission import StalenessAdmission
from agentrl.weightsync import CheckpointEngine, SharedDirTransport, StagedWeights

ROOT = Path(__file__).resolve().parents[3]


class _BrokenTransfer(SharedDirTransport):
    """Stages as usual, then fails to load (a transfer that breaks mid-push)."""

    async def load(self, client: PolicyClient, staged: StagedWeights) -> None:
        raise OSError("transfer broke")


@pytest.fixture
def server(tiny_model_dir: Path):
    engine = InferenceEngine(tiny_model_dir, max_batch_size=2, max_model_len=128)
    app = create_app(engine, served_model_name="tiny")
    client = PolicyClient("http://test", transport=httpx.ASGITransport(app=app), max_retries=0)
    yield engine, client
    engine.close()


async def test_every_push_wakes_the_server_it_put_to_sleep(server, tmp_path: Path) -> None:
    engine, client = server
    digest = engine.weight_info()["digest"]
    new = {k: v.detach().clone() + 0.01 for k, v in engine.model.state_dict().items()}
    broken = CheckpointEngine([client], _BrokenTransfer(tmp_path / "a"))
    await broken.sleep(2)
    assert engine.sleep_level == 2 and engine.weights.released
    report = await broken.push(new, 1)
    status = report.servers["http://test"]
    assert not report.ok and "transfer broke" in (status.error or "")
    assert status.woken and engine.sleep_level == 0 and not engine.is_paused
    assert engine.weight_version == 0 and engine.weight_info()["digest"] == digest  # verified ones

    good = CheckpointEngine([client], SharedDirTransport(tmp_path / "b"))
    await good.sleep(2)
    report = await good.push(new, 1)
    assert report.ok, report.describe()
    assert report.servers["http://test"].woken and good.sleeping == 0
    assert engine.sleep_level == 0 and engine.weight_version == 1
    assert report.metrics()["colocate/woken_servers"] == 1.0
    await good.sleep(1)
    assert await good.wake_up() == 1 and engine.sleep_level == 0  # a step without a push
    await broken.aclose()
    await good.aclose()


def test_admission_holds_while_the_servers_sleep() -> None:
    admission = StalenessAdmission(batch_size=2, max_staleness=1)
    assert admission.may_start()
    admission.hold()
    assert not admission.may_start() and admission.capacity > 0
    admission.release()
    assert admission.may_start()


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["distributed.backend=ray"], ["distributed.colocate", "distributed.backend", "local"]),
        (
            ["inference.backend=vllm", "inference.device=cpu"],
            ["distributed.colocate", "inference.backend", "embedded", "CUDA"],
        ),
    ],
)
def test_colocate_is_refused_where_it_cannot_run(overrides: list[str], names: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        load_config(ROOT / "configs" / "quickstart.yaml", ["distributed.colocate=true", *overrides])
    assert all(n in str(info.value) for n in names), str(info.value)


def test_colocate_with_vllm_on_a_machine_without_cuda_is_refused_before_any_server(
    monkeypatch,
) -> None:
    from agentrl.training.trainer import check_colocate

    cfg = load_config(
        ROOT / "configs" / "quickstart.yaml",
        [
            "distributed.colocate=true",
            "inference.backend=vllm",
            "trainer.device=auto",
            "inference.device=auto",
        ],
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"inference\.backend: embedded"):
        check_colocate(cfg)
