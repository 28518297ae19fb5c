"""Per-token weight versions end to end: a ``keep`` push in the middle of a long generation on a
real embedded server. The tokens sampled before the push carry the old version, the ones after it
the new, through the HTTP response, the client's ``Generation``, the episode recorder, the
trajectory, the trainer's batch and the staleness metrics.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from agentrl.batch import trajectories_to_batch
from agentrl.episode import EpisodeRecorder
from agentrl.inference.client import PolicyClient
from agentrl.training.offpolicy import row_staleness
from agentrl.training.step import token_version_metrics
from agentrl.types import SamplingParams, StopReason
from agentrl.weightsync.engine import CheckpointEngine, HttpStreamTransport

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


async def _gauge(base_url: str, name: str) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(base_url + "/metrics", timeout=10)).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.split(" ", 1)[0].split("{")[0] == name
    )


def _perturbed_state(model_dir: Path) -> tuple[dict[str, torch.Tensor], object]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(25)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    return state, model


def _scorer(model):
    def score(prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        ids = torch.tensor([prompt_ids + token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, torch.tensor(token_ids)[:, None])[:, 0].tolist()

    return score


async def test_a_push_mid_generation_splits_the_versions_of_its_tokens(
    own_embedded_server, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    state, model = _perturbed_state(tiny_model_dir)
    url = own_embedded_server.base_url
    async with PolicyClient(url) as client:
        v_old = await client.weight_version()
        rec = EpisodeRecorder.from_messages([{"role": "user", "content": "count"}], tok)
        steps0 = await _gauge(url, "agentrl_decode_steps")
        sampling = SamplingParams(max_tokens=300, seed=3)
        gen_task = asyncio.create_task(
            client.generate(rec.context_ids(), sampling, extra_body={"ignore_eos": True})
        )
        try:
            async with asyncio.timeout(120):  # some tokens are sampled on the old weights
                while await _gauge(url, "agentrl_decode_steps") < steps0 + 5:
                    await asyncio.sleep(0.01)
            engine = CheckpointEngine([client], HttpStreamTransport(), pause_mode="keep")
            report = await engine.push(state, v_old + 1, score=_scorer(model))
            report.raise_if_failed()
            gen = await asyncio.wait_for(gen_task, 300)
        finally:
            gen_task.cancel()
    # the wire and the client: one version per token, old then new, the oldest on top
    versions = gen.versions()
    assert gen.token_versions is not None and len(versions) == len(gen.token_ids) == 300
    assert versions[0] == v_old and versions[-1] == v_old + 1, "the push did not split it"
    k = versions.index(v_old + 1)
    assert versions == [v_old] * k + [v_old + 1] * (300 - k)
    assert gen.weight_version == v_old
    # the recorder and the trajectory
    rec.add_generation(gen)
    traj = rec.to_trajectory(uid="u", index=0, stop_reason=StopReason.LENGTH)
    sampled = [v for v, m in zip(traj.policy_version, traj.loss_mask, strict=True) if m]
    assert sampled == versions
    # the batch and the staleness the trainer computes at version v_old + 1
    batch = trajectories_to_batch([traj], pad_token_id=0)
    row = batch["policy_version"][0][batch["response_mask"][0] > 0].tolist()
    assert row == versions
    assert row_staleness(batch, v_old + 1).tolist() == [1]  # the oldest token: conservative
    m = token_version_metrics([traj], v_old + 1)
    assert m["async/mixed_version_episodes"] == 1.0
    assert m["async/token_staleness_mean"] == pytest.approx(k / 300)
