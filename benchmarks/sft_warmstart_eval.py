"""How good a warm start is: tool use and accuracy of an SFT checkpoint on held-out calculator tasks.

Why it exists: the quickstart ships ``checkpoints/calculator-sft`` (made by ``agentrl sft
configs/sft_calculator.yaml``) as an *imperfect* start for RL: it should emit well-formed tool
calls that copy the expression when it calls the tool, but call it only part of the time. This
script measures exactly that, through the real tool loop, and prints JSON:

1. render ``[system, user]`` + the calculator schema with the model's chat template, generate
   the first assistant turn (greedy, or sampled at ``--temperature`` with no top-k/top-p);
2. parse it as hermes ``<tool_call>`` JSON (:func:`agentrl.inference.chat.parse_hermes_tool_calls`);
3. for a well-formed ``calculator`` call, run the built-in calculator tool, append the assistant
   turn and the tool message through the chat template, and generate the final answer;
4. score the final answer like the ``calculator`` reward (``\\boxed{N}`` first, else the last
   number) against the exact ground truth.

Reported rates (over all tasks unless named): ``tool_call_rate`` (the first turn opens a
``<tool_call>``), ``well_formed_rate`` (of the tool calls: parsed, name ``calculator``, an
``expression`` string), ``expression_correct_rate`` (of the well-formed calls: the expression is
the task's ``a op b``, spaces ignored), ``accuracy``, ``accuracy_with_tool`` and
``accuracy_without_tool``.

Run: ``python benchmarks/sft_warmstart_eval.py checkpoints/calculator-sft [--n 64] [--seed 777]``
(greedy and temperature 1 by default, then greedy with the ``<tool_call>`` opener forced, which
measures the calls the model writes when it decides to call the tool). ``--smoke`` runs the same
three evaluations on 4 tasks with one thread (the CI check; rates meaningless).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _generate(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    *,
    temperature: float,
    max_new_tokens: int,
    seed: int,
) -> list[str]:
    """One continuation per prompt; text up to ``<|im_end|>``.

    Every prompt starts with the same tools system prompt (~500 tokens), so that common prefix is
    run once and its KV cache is copied into each generation; prompts are grouped by length so
    no row needs padding (the logits are those of a plain forward over the whole prompt)."""
    import copy

    import torch

    from agentrl.kv_cache import cache_kwargs, output_cache

    first = prompts[0]
    limit = min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    kwargs: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        kwargs = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    torch.manual_seed(seed)
    texts: list[str] = [""] * len(prompts)
    with torch.no_grad():
        prefix = output_cache(model(input_ids=torch.tensor([first[:n]]), use_cache=True))
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_len.setdefault(len(p), []).append(i)
        for length, idx in sorted(by_len.items()):
            cache = copy.deepcopy(prefix)
            cache.batch_repeat_interleave(len(idx))
            ids = torch.tensor([prompts[i] for i in idx])
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                **cache_kwargs(model, cache),
                **kwargs,
            )
            for i, row in zip(idx, out[:, length:].tolist(), strict=True):
                if tokenizer.eos_token_id in row:
                    row = row[: row.index(tokenizer.eos_token_id)]
                text = tokenizer.decode(row, skip_special_tokens=False)
                texts[i] = text.replace("<|endoftext|>", "")
    return texts


def _render(tokenizer: Any, messages: list[dict], tools: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def _is_correct(text: str, truth: str) -> bool:
    from agentrl.rollout.rewards import extract_answer, parse_number

    answer = extract_answer(text)
    if answer is None:
        nums = [t for t in text.replace("\\boxed{", " ").replace("}", " ").split() if t]
        answer = nums[-1] if nums else ""
    value = parse_number(answer)
    return value is not None and value == parse_number(truth)


def evaluate_warmstart(
    model_dir: str | Path,
    *,
    n: int = 64,
    seed: int = 777,
    temperature: float = 0.0,
    min_digits: int = 2,
    max_digits: int = 3,
    max_new_tokens: int = 96,
    batch_size: int = 32,
    force_tool_call: bool = False,
    model: Any = None,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """Run ``n`` held-out calculator tasks (``seed``) through the two-turn tool loop; return rates.

    ``force_tool_call`` appends the ``<tool_call>`` token to every first-turn prompt: the rates
    then describe the calls the model writes *when it decides to call the tool*."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.inference.chat import parse_hermes_tool_calls
    from agentrl.rollout.calculator_task import (
        CALCULATOR_SYSTEM_PROMPT,
        calculator_tool_schemas,
        generate_calculator_tasks,
    )
    from tools.calculator import Calculator, CalculatorError, format_number

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model_dir))
    model = model or AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    schemas = calculator_tool_schemas()
    calc = Calculator()
    tasks = generate_calculator_tasks(n, seed=seed, min_digits=min_digits, max_digits=max_digits)
    t0 = time.perf_counter()
    convs = [
        [
            {"role": "system", "content": CALCULATOR_SYSTEM_PROMPT},
            {"role": "user", "content": t.prompt},
        ]
        for t in tasks
    ]
    first: list[str] = []
    opener = tokenizer.convert_tokens_to_ids("<tool_call>") if force_tool_call else None
    for i in range(0, n, batch_size):
        prompts = [_render(tokenizer, c, schemas) for c in convs[i : i + batch_size]]
        if opener is not None:
            prompts = [[*p, opener] for p in prompts]
        texts = _generate(
            model,
            tokenizer,
            prompts,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            seed=seed + i,
        )
        first += [("<tool_call>" if force_tool_call else "") + t for t in texts]
    rows: list[dict[str, Any]] = []
    second_idx: list[int] = []
    for k, (task, text) in enumerate(zip(tasks, first, strict=True)):
        parsed = parse_hermes_tool_calls(text)
        row: dict[str, Any] = {"first": text, "tool_call": "<tool_call>" in text}
        call = parsed.tool_calls[0] if parsed.tool_calls and not parsed.errors else None
        args = json.loads(call["function"]["arguments"]) if call else {}
        well = bool(
            call
            and call["function"]["name"] == "calculator"
            and isinstance(args.get("expression"), str)
        )
        row["well_formed"] = well
        row["final"] = text
        if well:
            expr = args["expression"]
            want = f"{task.extra['a']}{task.extra['op']}{task.extra['b']}"
            row["expression_correct"] = expr.replace(" ", "") == want
            try:
                result = format_number(calc.evaluate(expr))
            except CalculatorError as exc:
                result = f"error: {exc}"
            assert call is not None
            convs[k] += [
                {
                    "role": "assistant",
                    "content": parsed.content or "",
                    "tool_calls": [
                        {
                            "id": "call_0",
                            "type": "function",
                            "function": {"name": "calculator", "arguments": args},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": result},
            ]
            second_idx.append(k)
        rows.append(row)
    for i in range(0, len(second_idx), batch_size):
        idx = second_idx[i : i + batch_size]
        prompts = [_render(tokenizer, convs[k], schemas) for k in idx]
        texts = _generate(
            model,
            tokenizer,
            prompts,
            temperature=temperature,
            max_new_tokens=24,
            seed=seed + 10_000 + i,
        )
        for k, text in zip(idx, texts, strict=True):
            rows[k]["final"] = text
    for task, row in zip(tasks, rows, strict=True):
        row["correct"] = _is_correct(row["final"], task.reward_spec["ground_truth"])

    def rate(num: int, den: int) -> float | None:
        return round(num / den, 4) if den else None

    calls = [r for r in rows if r["tool_call"]]
    well = [r for r in rows if r["well_formed"]]
    no_tool = [r for r in rows if not r["tool_call"]]
    return {
        "model_dir": str(model_dir),
        "n": n,
        "seed": seed,
        "temperature": temperature,
        "force_tool_call": force_tool_call,
        "tool_call_rate": rate(len(calls), n),
        "well_formed_rate": rate(len(well), len(calls)),
        "expression_correct_rate": rate(sum(r["expression_correct"] for r in well), len(well)),
        "accuracy": rate(sum(r["correct"] for r in rows), n),
        "accuracy_with_tool": rate(sum(r["correct"] for r in well), len(well)),
        "accuracy_without_tool": rate(sum(r["correct"] for r in no_tool), len(no_tool)),
        "boxed_rate": rate(sum("\\boxed{" in r["final"] for r in rows), n),
        "wall_s": round(time.perf_counter() - t0, 1),
        "examples": [{"first": r["first"], "final": r["final"]} for r in rows[:3]],
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    import torch

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "model_dir", nargs="?", default=str(ROOT / "checkpoints" / "calculator-sft")
    )
    parser.add_argument("--n", type=int, default=64, help="held-out tasks")
    parser.add_argument("--seed", type=int, default=777, help="task seed (the SFT data used 1234)")
    parser.add_argument("--min-digits", type=int, default=2)
    parser.add_argument("--max-digits", type=int, default=3)
    parser.add_argument(
        "--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="0 = greedy"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="4 tasks, one thread (CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.n, args.threads = 4, 1
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    results = [
        evaluate_warmstart(
            args.model_dir,
            n=args.n,
            seed=args.seed,
            temperature=t,
            min_digits=args.min_digits,
            max_digits=args.max_digits,
            model=model,
            tokenizer=tok,
        )
        for t in args.temperatures
    ]
    # Conditional on calling the tool: greedy after a forced ``<tool_call>`` opener.
    results.append(
        evaluate_warmstart(
            args.model_dir,
            n=args.n,
            seed=args.seed,
            temperature=0.0,
            min_digits=args.min_digits,
            max_digits=args.max_digits,
            force_tool_call=True,
            model=model,
            tokenizer=tok,
        )
    )
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
