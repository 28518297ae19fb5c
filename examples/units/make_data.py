"""Write data/train.jsonl and data/val.jsonl (deterministic): ``python make_data.py``."""

from __future__ import annotations

import json
import random
from pathlib import Path

FACTORS = {
    "m": 1.0,
    "km": 1000.0,
    "cm": 0.01,
    "mi": 1609.344,
    "ft": 0.3048,
    "in": 0.0254,
    "kg": 1.0,
    "g": 0.001,
    "lb": 0.45359237,
    "oz": 0.028349523125,
    "s": 1.0,
    "min": 60.0,
    "h": 3600.0,
}
GROUPS = [["m", "km", "cm", "mi", "ft", "in"], ["kg", "g", "lb", "oz"], ["s", "min", "h"]]


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.sample(rng.choice(GROUPS), 2)
        value = rng.choice([1, 2, 3, 5, 10, 12, 25, 100, 250])
        truth = value * FACTORS[a] / FACTORS[b]
        out.append(
            {
                "id": f"u{seed}-{i}",
                "prompt": f"How many {b} is {value} {a}?",
                "data_source": "units",
                "reward_spec": {"ground_truth": f"{truth:.6g}"},
            }
        )
    return out


if __name__ == "__main__":
    here = Path(__file__).parent / "data"
    here.mkdir(exist_ok=True)
    for name, n, seed in (("train", 64, 0), ("val", 16, 1)):
        with open(here / f"{name}.jsonl", "w") as f:
            for row in rows(n, seed):
                f.write(json.dumps(row) + "\n")
