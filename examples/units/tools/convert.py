"""``convert``: an async tool (it could await a web API; here it only yields once).

``from tools import ...`` is agentrl's ``tools`` package even though this file lives in a package
that is also called ``tools``: agentrl loads this project under its own namespace, so the
project's package never shadows agentrl's. Inside it, use relative imports (``from .units``).
"""

from __future__ import annotations

import asyncio

from tools import register_tool, tool

from .units import DIMENSION, FACTORS


@register_tool
@tool
async def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a quantity between units of the same dimension.

    Args:
        value: The number to convert.
        from_unit: Its unit (m, km, cm, mm, mi, ft, in, kg, g, lb, oz, s, min, h).
        to_unit: The unit to convert to.
    """
    await asyncio.sleep(0)
    for unit in (from_unit, to_unit):
        if unit not in FACTORS:
            return f"error: unknown unit {unit!r}; known: {', '.join(FACTORS)}"
    if DIMENSION[from_unit] != DIMENSION[to_unit]:
        return f"error: cannot convert {DIMENSION[from_unit]} to {DIMENSION[to_unit]}"
    return f"{value * FACTORS[from_unit] / FACTORS[to_unit]:.6g}"
