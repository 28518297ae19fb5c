"""TRL's GRPOTrainer on the calculator tasks: the peer side of ``benchmarks/peers/compare.py``.

Runs in TRL's own virtual environment (``make setup-peers`` creates ``.venv-trl``), so it imports
nothing from agentrl: the driver writes the tasks (the exact chat messages agentrl's agent
starts from, and the ground truth) and the tool schema agentrl shows, and this script trains
on them and writes one JSON file of per-step timings, tokens and rewards.

Two settings, the same as agentrl's:

- ``--mode single``: one completion per sample, no tools;
- ``--mode tool``: TRL's tool-calling GRPO (``GRPOTrainer(tools=[calculator])``), a Python
  calculator function, up to ``--max-turns`` model turns.

With ``--snapshot-every K`` the model (and tokenizer) is saved every K steps and at the last
step under ``--snapshot-dir``, each with the epoch time it was taken and how long the save took
(``benchmarks/peers/time_to_accuracy.py`` evaluates them with agentrl's evaluator).

The reward mirrors agentrl's ``calculator`` reward: 1.0 when the last ``\\boxed{N}`` of the final
assistant message (else its last number) equals the ground truth. The prompts render with the
tool schema agentrl offers (TRL would derive a slightly different one from the function's
docstring; the warm start was trained on agentrl's), by passing that schema to the chat
template in place of the function.

    .venv-trl/bin/python benchmarks/peers/trl_grpo.py --model-dir DIR --tasks T.jsonl \\
        --tools-json TOOLS.json --mode tool --steps 10 --out result.json
    .venv-trl/bin/python benchmarks/peers/trl_grpo.py --smoke   # 2 steps of 2 x 2, tool mode (CI)

``--smoke`` needs no other argument: the shipped warm start, four built-in tasks, one thread,
2 steps of 2 tasks x 2 samples; it writes the same JSON (to a temporary ``--out`` unless one is
given) and prints it.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Div):
            if isinstance(left, int) and isinstance(right, int) and right and left % right == 0:
                return left // right
            return left / right
        if isinstance(node.op, ast.Pow | ast.BitXor):
            if abs(right) > 64:
                raise ValueError("exponent too large")
            return left**right
        if type(node.op) in _OPS:
            return _OPS[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(expression: str) -> str:
    """Exact arithmetic: numbers, ( ), + - * / // % ** (^ is power).

    Args:
        expression: The expression, e.g. "(3 + 4) * 2".
    """
    try:
        value = _eval(ast.parse(expression.replace("^", "**"), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as exc:
        return f"error: {exc}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _answer(text: str) -> float | None:
    boxed = _BOXED.findall(text)
    found = boxed[-1] if boxed else None
    if found is None:
        numbers = _NUMBER.findall(text.replace(",", ""))
        found = numbers[-1] if numbers else None
    try:
        return float(found.replace(",", "").strip()) if found is not None else None
    except ValueError:
        return None


def calculator_reward(completions: list, answer: list[str], **_: Any) -> list[float]:
    """1.0 when the final assistant message's answer equals the ground truth, else 0.0."""
    scores = []
    for completion, truth in zip(completions, answer, strict=True):
        if isinstance(completion, list):
            finals = [m for m in completion if m.get("role") == "assistant"]
            text = str(finals[-1].get("content") or "") if finals else ""
        else:
            text = str(completion)
        value = _answer(text)
        scores.append(1.0 if value is not None and value == float(truth) else 0.0)
    return scores


def _use_schema(tokenizer: Any, schemas: list[dict]) -> None:
    """Render ``schemas`` wherever TRL passes the tool functions to the chat template."""
    by_name = {s["function"]["name"]: s for s in schemas}
    original = tokenizer.apply_chat_template

    def apply_chat_template(*args: Any, tools: Any = None, **kwargs: Any) -> Any:
        if tools:
            tools = [by_name.get(getattr(t, "__name__", ""), t) for t in tools]
        return original(*args, tools=tools, **kwargs)

    tokenizer.apply_chat_template = apply_chat_template


ROOT = Path(__file__).resolve().parents[2]
SMOKE_SYSTEM_PROMPT = (
    "Use the calculator tool for arithmetic. Answer with the result as \\boxed{N}."
)
SMOKE_TASKS = [
    ("12", "+", "34", "46"),
    ("7", "*", "8", "56"),
    ("90", "-", "15", "75"),
    ("6", "*", "11", "66"),
]
"""``--smoke``'s tasks: (a, op, b, answer), asked as agentrl's calculator tasks ask them."""


def write_smoke_tasks(path: Path) -> Path:
    """The four ``--smoke`` tasks as the driver's JSONL rows (this venv cannot import agentrl)."""
    rows = [
        {
            "prompt": [
                {"role": "system", "content": SMOKE_SYSTEM_PROMPT},
                {"role": "user", "content": f"What is {a} {op} {b}? Use the calculator tool."},
            ],
            "answer": answer,
        }
        for a, op, b, answer in SMOKE_TASKS
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def apply_smoke(args: argparse.Namespace) -> None:
    """Fill ``--smoke``'s defaults: the shipped warm start, built-in tasks, 2 tiny steps."""
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="trl-grpo-smoke-"))
    args.model_dir = args.model_dir or str(ROOT / "checkpoints" / "calculator-sft")
    args.tasks = args.tasks or str(write_smoke_tasks(work / "tasks.jsonl"))
    args.mode = args.mode or "tool"
    args.out = args.out or str(work / "result.json")
    args.threads = args.threads or 1
    args.steps, args.batch_tasks, args.n_samples, args.max_tokens, args.max_turns = 2, 2, 2, 24, 2


REQUIRED = ("model_dir", "tasks", "mode", "threads", "out")
"""Arguments a full run must give (``--smoke`` fills them)."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--model-dir``, ``--tasks``, ``--mode``, ``--threads`` and ``--out``
    are required unless ``--smoke`` fills them."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model-dir", default=None, help="required unless --smoke")
    p.add_argument("--tasks", default=None, help="JSONL rows {prompt: [messages], answer}")
    p.add_argument("--tools-json", default=None, help="the tool schemas agentrl shows")
    p.add_argument("--mode", choices=["single", "tool"], default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-tasks", type=int, default=8)
    p.add_argument("--n-samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per model turn")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (from the plan)")
    p.add_argument("--out", default=None)
    p.add_argument("--snapshot-every", type=int, default=0, help="save the model every K steps")
    p.add_argument("--snapshot-dir", default=None)
    p.add_argument("--smoke", action="store_true", help="2 tiny steps on built-in tasks (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        apply_smoke(args)
    missing = [f"--{k.replace('_', '-')}" for k in REQUIRED if getattr(args, k) is None]
    if missing:
        p.error(f"{', '.join(missing)} required (or --smoke, which fills them)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)

    import torch

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    rows = [json.loads(line) for line in Path(args.tasks).read_text().splitlines() if line]
    dataset = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tools: list = []
    # Tool turns count against TRL's completion budget: give it every turn's tokens.
    max_completion = args.max_tokens
    if args.mode == "tool":
        tools = [calculator]
        max_completion = args.max_tokens * args.max_turns
        # The tiny model's template is Qwen's hermes format; TRL parses it with Qwen's template.
        tokenizer.response_template = qwen3_template
        if args.tools_json:
            _use_schema(tokenizer, json.loads(Path(args.tools_json).read_text()))
    out_dir = Path(args.out).with_suffix(".trl")
    config = GRPOConfig(
        output_dir=str(out_dir),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_tasks * args.n_samples,
        gradient_accumulation_steps=1,
        num_generations=args.n_samples,
        max_completion_length=max_completion,
        max_tool_calling_iterations=args.max_turns - 1 if tools else None,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )

    steps: list[dict[str, float]] = []
    snapshots: list[dict[str, Any]] = []
    plain_tokenizer = AutoTokenizer.from_pretrained(args.model_dir)

    class Timing(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            steps.append({"step_s": time.perf_counter() - self.t0})

        def on_log(self, _args: Any, state: Any, _control: Any, logs: Any = None, **k: Any) -> None:
            if logs and steps and "reward" in logs:
                steps[-1].update({k2: float(v) for k2, v in logs.items() if _is_num(v)})

    class Snapshots(TrainerCallback):
        """The model every ``--snapshot-every`` steps and at the end, timed (epoch seconds)."""

        def on_step_end(self, _args: Any, state: Any, *a: Any, **k: Any) -> None:
            every, step = args.snapshot_every, state.global_step
            if not every or (step % every and step != args.steps):
                return
            t0 = time.time()
            path = Path(args.snapshot_dir) / f"step_{step:05d}"
            model.save_pretrained(str(path))
            plain_tokenizer.save_pretrained(str(path))  # the warm start's, unpatched
            snapshots.append(
                {"step": step, "epoch_s": t0, "save_s": time.time() - t0, "path": str(path)}
            )

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[calculator_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=tools or None,
        callbacks=[Timing(), Snapshots()],
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    result = {
        "system": "trl",
        "trl_version": _version("trl"),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "mode": args.mode,
        "train_wall_s": wall,
        "steps": steps,
        "snapshots": snapshots,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.smoke:
        print(json.dumps(result, indent=1))
    return 0


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
