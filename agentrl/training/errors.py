"""How a run says it cannot go on: one exception, below everything that raises it.

Why it exists: the loop, the servers' watcher and the Ray driver all end a run the same way,
and the CLI turns it into exit status 1; defining it here lets each raise it without importing
the others.
"""

from __future__ import annotations

__all__ = ["RunFailed"]


class RunFailed(RuntimeError):
    """The run cannot make progress (nothing could be scored, a fatal drop); says why."""
