"""Sleep: give the engine's memory back while a colocated trainer holds the device.

Why it exists: in colocated mode (``distributed.colocate``) the trainer and the servers share
the devices, so a server must not hold its memory while the trainer updates (verl's hybrid
engine, vLLM's ``/sleep``). Two levels, as vLLM's:

- level 1 drops what generation builds: the running batch's KV cache and the staging buffer
  weights arrive in (re-allocated by the next push); the weights stay;
- level 2 also drops the served weights (the next full push replaces them anyway). The last
  verified weights stay (a host copy: the rollback target), so a load or a wake without a load
  re-allocates the weights from that copy first; the server never serves garbage.

States: ``awake (0) --sleep(1|2)--> asleep(level) --wake_up--> awake``; sleeping deeper only
raises the level. While asleep the engine runs control operations (weight loads, probes when
the weights are there, ``/weight_info``) but no prefill and no decode step: generation requests
are *held* in the queue (with their deadlines) and served after the wake-up. Requests that were
running keep their tokens and re-prefill after the wake-up (on the weights of that moment).
A sleep has no deadline (unlike a pause): waking the weights up behind a trainer that holds the
device could run it out of memory; a colocated server dies with its run.

On the CPU the freed tensors go back to the C allocator, which may keep them (glibc keeps
small and mid-sized blocks in its arenas); :func:`trim_host_memory` asks it to return them
(``malloc_trim``), so a sleeping server's resident memory really drops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Any

import torch

__all__ = [
    "SLEEP_LEVELS",
    "ParamShapes",
    "release_params",
    "resident_bytes",
    "restore_params",
    "trim_host_memory",
]

log = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)
"""1: drop the KV cache and staging buffer; 2: also drop the served weights."""

ParamShapes = dict[str, torch.Size]
"""The shape of every (deduplicated) parameter of a model, by name."""


def release_params(model: Any) -> tuple[ParamShapes, int]:
    """Free every parameter's storage (each becomes an empty tensor of its dtype and device);
    the shapes to re-allocate them with and the bytes freed. Tied parameters are one
    ``Parameter`` object, so they are freed once and stay tied."""
    shapes: ParamShapes = {}
    freed = 0
    for name, p in model.named_parameters():  # deduplicated: a tied weight appears once
        shapes[name] = p.shape
        freed += p.numel() * p.element_size()
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return shapes, freed


def restore_params(model: Any, shapes: ParamShapes) -> None:
    """Re-allocate the parameters :func:`release_params` freed (uninitialized: the caller
    fills them)."""
    for name, p in model.named_parameters():
        p.data = torch.empty(shapes[name], dtype=p.dtype, device=p.device)


def trim_host_memory() -> bool:
    """Ask glibc to return freed heap memory to the OS (``malloc_trim(0)``); False where there is
    no glibc (then the allocator keeps what it keeps). Also empties CUDA's cache when present."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False


def resident_bytes() -> int:
    """This process's resident memory in bytes (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
