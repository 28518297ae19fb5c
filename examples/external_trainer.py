"""An external trainer on the rollout service: GRPO-style REINFORCE in about 100 lines.

Nothing here is agentrl's Trainer: rollouts, rewards and weight sync come from `agentrl serve`
over HTTP through `agentrl.client.RolloutClient`; the update is plain PyTorch. Each step asks
for a batch of calculator tasks x n samples (`group=True`: GRPO groups arrive together), turns
the rewards into group-normalized advantages, takes one policy-gradient step, and pushes the
new weights, which the service verifies on every inference server before the next batch.

    agentrl serve configs/quickstart.yaml model.path=checkpoints/calculator-sft \
        inference.num_servers=1 --port 8400 &
    python examples/external_trainer.py --url http://127.0.0.1:8400 \
        --model checkpoints/calculator-sft --steps 20

It prints one JSON line per step, and the held-out accuracy (greedy) before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.client import RolloutClient, to_batch


def group_advantages(trajs: list) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps): GRPO's advantage, one per sample."""
    groups: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        groups[t.uid].append(t.reward)
    stats = {u: (statistics.mean(r), statistics.pstdev(r)) for u, r in groups.items()}
    return torch.tensor([(t.reward - stats[t.uid][0]) / (stats[t.uid][1] + 1e-6) for t in trajs])


def policy_loss(model, batch, adv: torch.Tensor, temperature: float) -> torch.Tensor:
    """REINFORCE: -A * log pi(token), averaged over the sampled tokens of the batch."""
    prompt_len, resp_len = batch["prompts"].shape[1], batch["responses"].shape[1]
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).logits[:, prompt_len - 1 : prompt_len - 1 + resp_len]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = batch["response_mask"].float()
    return -(adv[:, None] * logp * mask).sum() / mask.sum().clamp(min=1)


def accuracy(client: RolloutClient, tasks: int) -> float:
    """Greedy held-out accuracy, measured by the service on the config's val split."""
    job = client.submit(dataset={"split": "val", "limit": tasks}, sampling={"temperature": 0.0})
    trajs = client.collect(job.id)
    return statistics.mean(float(t.reward_info.get("correct", t.reward > 0.5)) for t in trajs)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8400")
    p.add_argument("--api-key", default=None, help="default: $AGENTRL_API_KEY")
    p.add_argument("--model", required=True, help="the model the service serves (same weights)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tasks-per-step", type=int, default=8)
    p.add_argument("--n", type=int, default=4, help="samples per task (the group)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--temperature", type=float, default=1.0, help="the service's sampling temperature"
    )
    p.add_argument("--eval-tasks", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    client = RolloutClient(args.url, api_key=args.api_key)
    version = client.weights()["version"]
    history = {
        "reward": [],
        "verify_max_abs_diff": [],
        "acc_before": accuracy(client, args.eval_tasks),
    }
    for step in range(args.steps):
        job = client.submit(
            dataset={
                "split": "train",
                "offset": step * args.tasks_per_step,
                "limit": args.tasks_per_step,
            },
            n=args.n,
            group=True,
            max_staleness=0,  # on-policy: every token sampled by the weights we are about to update
        )
        trajs = client.collect(job.id)
        rewards = [t.reward for t in trajs]
        batch = to_batch(trajs, pad_token_id=tokenizer.pad_token_id)
        model.train()
        loss = policy_loss(model, batch, group_advantages(trajs), args.temperature)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        version += 1
        report = client.push_weights(model.state_dict(), version=version)
        assert report["ok"] and report["verified"], f"weight push not verified: {report}"
        history["reward"].append(statistics.mean(rewards))
        history["verify_max_abs_diff"].append(report["max_abs_diff"])
        print(
            json.dumps(
                {
                    "step": step + 1,
                    "version": version,
                    "reward_mean": round(statistics.mean(rewards), 4),
                    "episodes": len(trajs),
                    "loss": round(loss.item(), 4),
                    "verify_max_abs_diff": report["max_abs_diff"],
                    "push_s": round(report["total_seconds"], 3),
                }
            ),
            flush=True,
        )
    history["acc_after"] = accuracy(client, args.eval_tasks)
    print(json.dumps({"acc_before": history["acc_before"], "acc_after": history["acc_after"]}))
    client.close()
    return history


if __name__ == "__main__":
    main()
