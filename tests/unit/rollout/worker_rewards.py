"""Reward functions the process-executor tests send to worker processes.

A worker imports the module of the function it is sent. This one imports only the standard
library, so a call costs the function, not an import of pytest and hypothesis (seconds on a
loaded machine, which a short ``timeout_s`` would count against the call).
"""

from __future__ import annotations

import os
import time
from typing import Any


def pid_reward(traj: Any, task: Any) -> dict:
    """Score 1 and the worker's pid."""
    return {"score": 1.0, "pid": os.getpid()}


def hanging_reward(traj: Any, task: Any) -> float:
    """A judge that never answers (in a worker process: until it is killed)."""
    while True:
        time.sleep(1)


def exiting_reward(traj: Any, task: Any) -> float:
    """A judge whose process dies mid-call."""
    os._exit(3)
