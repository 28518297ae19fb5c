"""FSDP2 data parallelism on CPU: two gloo ranks train exactly like one process on the whole batch.

Two real processes (``torch.multiprocessing``, fork, gloo over a file store) each build an
``Actor(..., dist=DistContext)`` on the tiny model (FSDP2 ``fully_shard`` per decoder layer and
the root), and run one update on a fixed batch with uneven response lengths (one row trains
nothing), two mini-batches (two optimizer steps) and a small token budget, so the ranks get
different numbers of micro-batches. The same batch goes through a single-process ``Actor``. The
test compares: π_old from ``compute_log_probs``, the first-pass log-probs, the loss metrics and
the pre-clip gradient norm, the last mini-batch's gradients, and every updated
parameter of the gathered full state dict, which must also carry the original model's Hugging
Face names and shapes. Both normalizer families are covered: ``token-mean`` (global token
count; unclipped, so the raw gradients are compared) and ``seq-mean-token-mean`` (global
sequence count; gradient clipping acts). The same for the critic (backbone + value head sharded
as one module: values, two updates, gradients, gathered weights) and for a ``FrozenPolicy``
(the reference: log-probs and Σπ²). Shared prompts are on (the default): rows of one prompt go
to one rank, every rank runs two forwards per micro-batch, and the single-process update without
sharing is the same.

Mutation check (by hand, on this batch, token-mean with a 0.5 clip): with the world-size loss
scale removed the gradient norm halved (9.5 vs 19.0; the clipped gradients and Adam's step hid
it, hence the unclipped run); with local instead of global normalizers the clipped gradients
differed by 49% of the largest entry and the weights by 4e-4.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from tensordict import TensorDict

from agentrl.batch import trajectories_to_batch
from agentrl.training.actor import Actor, ActorConfig, FrozenPolicy
from agentrl.training.critic import Critic
from tests.fakes import MODEL_ARGS, actor_config, critic_config, synthetic_trajectory

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

WORLD = 2
PAD = 256
MODES = ("token-mean", "seq-mean-token-mean")
# token-mean runs unclipped, so its gradient comparison sees any error in the loss scale (a
# clip, like Adam's first step, would hide one); seq-mean-token-mean clips, so its update
# depends on the norm being the global one.
GRAD_CLIP = {"token-mean": 1e6, "seq-mean-token-mean": 0.5}
WORKER_TIMEOUT_S = 600.0  # wall time on a heavily shared machine; the work is ~3 s CPU


def _config(mode: str, share: bool = True) -> ActorConfig:
    return actor_config(
        share_prompts=share,
        lr=1e-4,
        grad_clip=GRAD_CLIP[mode],
        micro_batch_max_tokens=40,
        mini_batch_size=4,
        loss_agg_mode=mode,
        entropy_coeff=0.01,
        kl_loss_coef=0.1,
    )


def _batch(model_dir: Path) -> TensorDict:
    """7 rows, responses of 2..24 tokens, row 3 with no sampled token, rows 0-2 and 4-5 with one
    prompt each (``trainer.share_prompts``, on by default, runs it once); π_old perturbed."""
    rng = random.Random(5)
    trajs = []
    for i in range(7):
        p, r = rng.randint(3, 9), rng.choice([2, 5, 9, 14, 24])
        mask = [0] * r if i == 3 else [1 if rng.random() < 0.75 else 0 for _ in range(r)]
        trajs.append(synthetic_trajectory(rng, i, p, mask))
    for i, j in ((1, 0), (2, 0), (5, 4)):  # GRPO groups: rows that repeat a prompt share it
        trajs[i].prompt_ids = list(trajs[j].prompt_ids)
    batch = trajectories_to_batch(trajs, pad_token_id=PAD)
    mask = batch["response_mask"].float()
    gen = torch.Generator().manual_seed(0)
    # π_old: the model's own log-probs (a single-process Actor) plus noise, so that some
    # ratios leave the clip range; the reference policy a little further away for the KL term.
    logp = Actor(model_dir, _config(MODES[0]), **MODEL_ARGS).compute_log_probs(batch)
    batch["old_log_probs"] = (logp + 0.15 * torch.randn(logp.shape, generator=gen)) * mask
    batch["ref_log_prob"] = (logp + 0.3 * torch.randn(logp.shape, generator=gen)) * mask
    batch["advantages"] = torch.randn(len(trajs), 1, generator=gen) * mask
    return batch


def _run(actor: Actor, batch: TensorDict) -> dict[str, Any]:
    """One update; everything the test compares (collectives: every rank calls this)."""
    old = actor.compute_log_probs(batch)
    metrics, first = actor.update_with_log_probs(batch)
    grads = _full_grads(actor.model.named_parameters())
    return {
        "old": old,
        "first": first,
        "metrics": metrics,
        "grads": grads,
        "weights": actor.state_dict_for_push(),
    }


def _full_grads(params: Any) -> dict[str, torch.Tensor | None]:
    grads = {}
    for name, param in params:
        grad = param.grad
        if grad is not None and hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grads[name] = None if grad is None else grad.detach().cpu().clone()
    return grads


def _run_critic(critic: Critic, batch: TensorDict) -> dict[str, Any]:
    """Two value updates (the first from the zero head, the second through the backbone)."""
    gen = torch.Generator().manual_seed(1)
    mask = batch["response_mask"].float()
    metrics = []
    for _ in range(2):
        b = batch.clone()
        b["values"] = critic.compute_values(b)
        b["returns"] = (b["values"] + torch.randn(mask.shape, generator=gen)) * mask
        metrics.append(critic.update(b))
    return {
        "values": critic.compute_values(batch),
        "metrics": metrics,
        "grads": _full_grads(critic.module.named_parameters()),
        "weights": critic.full_state_dict(),
    }


def _critic(model_dir: str | Path, **dist: Any) -> Critic:
    config = critic_config(micro_batch_max_tokens=40, mini_batch_size=4, lr=1e-4, grad_clip=1e6)
    return Critic(model_dir, config, **MODEL_ARGS, **dist)


def _reference(model_dir: str | Path, batch: TensorDict, **dist: Any) -> Any:
    ref = FrozenPolicy(model_dir, temperature=0.7, micro_batch_max_tokens=40, **MODEL_ARGS, **dist)
    return ref.compute_log_probs_and_sum_pi_squared(batch)


def _worker(rank: int, init_file: str, model_dir: str, batch: TensorDict, out_dir: str) -> None:
    from agentrl.training.fsdp import DistContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        ctx = DistContext.current("cpu")
        result: dict[str, Any] = {}
        for mode in MODES:
            actor = Actor(model_dir, _config(mode), **MODEL_ARGS, dist=ctx)
            result[mode] = _run(actor, batch)
        result["critic"] = _run_critic(_critic(model_dir, dist=ctx), batch)
        result["reference"] = _reference(model_dir, batch, dist=ctx)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path: Path, model_dir: Path, batch: TensorDict) -> list[dict[str, Any]]:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    context = mp.start_processes(
        _worker,
        args=(str(tmp_path / "store"), str(model_dir), batch, str(out_dir)),
        nprocs=WORLD,
        join=False,
        start_method="fork",  # the parent's imports are reused: seconds, not a minute
    )
    assert context is not None  # join=False always returns the context
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        while not context.join(timeout=2.0):  # raises with the worker's traceback on error
            if time.monotonic() > deadline:
                pytest.fail(f"FSDP workers did not finish within {WORKER_TIMEOUT_S:.0f} s")
    finally:
        for proc in context.processes:
            if proc is not None and proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@pytest.fixture(scope="module")
def two_ranks(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[TensorDict, list[dict[str, Any]]]:
    """The fixed batch, and what each of the two ranks computed on it (one spawn per module)."""
    batch = _batch(tiny_model_dir)
    return batch, _spawn(tmp_path_factory.mktemp("fsdp"), tiny_model_dir, batch)


def test_fsdp2_update_matches_single_process(
    tiny_model_dir: Path, two_ranks: tuple[TensorDict, list[dict[str, Any]]], report_metric
) -> None:
    batch, ranks = two_ranks
    single = {}
    for mode in MODES:
        single[mode] = _run(Actor(tiny_model_dir, _config(mode), **MODEL_ARGS), batch)

    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        hf_shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118

    # shared prompts on both sides (the default); the plain forward gives the same update
    plain = _run(Actor(tiny_model_dir, _config(MODES[0], share=False), **MODEL_ARGS), batch)
    assert ranks[0][MODES[0]]["metrics"]["actor/prompt_tokens_reused"] > 0
    assert plain["metrics"]["actor/prompt_tokens_reused"] == 0
    assert _max_diff(plain["first"], single[MODES[0]]["first"]) < 1e-5
    assert (
        max(_max_diff(plain["weights"][k], w) for k, w in single[MODES[0]]["weights"].items())
        < 1e-5
    )

    for mode in MODES:
        ref, got = single[mode], ranks[0][mode]
        # every rank returns the same (gathered) log-probs and metrics
        for other in ranks[1:]:
            assert torch.equal(other[mode]["first"], got["first"])
            assert torch.equal(other[mode]["old"], got["old"])
            assert other[mode]["metrics"] == got["metrics"]
            assert other[mode]["weights"] == {}, "only rank 0 receives the full state dict"

        # π_old, sharded over ranks and gathered
        assert _max_diff(got["old"], ref["old"]) < 1e-5
        assert _max_diff(got["first"], ref["first"]) < 1e-5
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
            assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-7)
        if mode == "seq-mean-token-mean":  # the clip really acted: its norm had to be global
            assert ref["metrics"]["actor/grad_norm"] > GRAD_CLIP[mode]
        else:
            assert ref["metrics"]["actor/grad_norm"] < GRAD_CLIP[mode]

        # the last mini-batch's gradient (clipped or not), parameter by parameter
        grad_scale = max(float(g.abs().max()) for g in ref["grads"].values() if g is not None)
        worst_grad = 0.0
        for name, g in ref["grads"].items():
            assert g is not None and got["grads"][name] is not None, name
            worst_grad = max(worst_grad, _max_diff(got["grads"][name], g))
        assert worst_grad <= 1e-5 * grad_scale, (worst_grad, grad_scale)

        # the gathered weights: HF names and shapes of the original model, values of the
        # single-process update (which moved them by far more than the tolerance)
        weights = got["weights"]
        assert {k: tuple(v.shape) for k, v in weights.items()} == hf_shapes
        assert all(v.device.type == "cpu" and v.is_contiguous() for v in weights.values())
        worst = max(_max_diff(weights[k], ref["weights"][k]) for k in weights)
        with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
            moved = max(_max_diff(ref["weights"][k], f.get_tensor(k)) for k in hf_shapes)
        assert moved > 1e-4
        assert worst <= 1e-5, f"{mode}: max |FSDP - single| = {worst:.3g}"
        report_metric(f"{mode}/max_abs_param_diff", worst)
        report_metric(f"{mode}/max_abs_grad_diff_rel", worst_grad / grad_scale)


def test_fsdp2_critic_and_reference_match_single_process(
    tiny_model_dir: Path, two_ranks: tuple[TensorDict, list[dict[str, Any]]], report_metric
) -> None:
    batch, ranks = two_ranks
    ref = _run_critic(_critic(tiny_model_dir), batch)
    logp, spp = _reference(tiny_model_dir, batch)
    got = ranks[0]["critic"]
    assert ranks[1]["critic"]["weights"] == {}, "only rank 0 receives the full weights"
    for r in ranks:  # every rank gets the whole result of a forward-only pass
        assert _max_diff(r["reference"][0], logp) < 1e-5
        assert _max_diff(r["reference"][1], spp) < 1e-5
        assert _max_diff(r["critic"]["values"], ref["values"]) < 1e-5
    for mine, theirs in zip(got["metrics"], ref["metrics"], strict=True):
        assert mine.keys() == theirs.keys()
        for key in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean", "critic/lr"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), key
    assert ref["metrics"][1]["critic/vf_loss"] > 0
    scale = max(float(g.abs().max()) for g in ref["grads"].values() if g is not None)
    worst_grad = max(_max_diff(got["grads"][k], g) for k, g in ref["grads"].items())
    assert worst_grad <= 1e-5 * scale, (worst_grad, scale)
    backbone = [k for k, g in ref["grads"].items() if k.startswith("backbone.")]
    assert any(float(ref["grads"][k].abs().max()) > 0 for k in backbone)  # it trains too
    assert got["weights"].keys() == ref["weights"].keys()
    worst = max(_max_diff(got["weights"][k], w) for k, w in ref["weights"].items())
    assert worst <= 1e-5, worst
    assert float(ref["weights"]["value_head.weight"].abs().max()) > 1e-4  # moved off zero
    report_metric("critic/max_abs_param_diff", worst)
    report_metric("critic/max_abs_grad_diff_rel", worst_grad / scale)
