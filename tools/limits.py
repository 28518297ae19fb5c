"""The limits of tool calls: how long a call may run, how much of its output the model reads.

Why it exists: the limits are one value (:class:`ToolLimits`) rather than loose attributes of a
:class:`~tools.toolset.ToolSet`, so that everything that runs tool calls for an episode applies
the same ones (the ``tools:`` section of a config: ``timeout_s``, ``max_output_chars``,
``max_output_tokens``, ``truncate_side``), and a set of tools built for one episode can be given the limits of the
run instead of the class defaults.

What it guarantees: a :class:`ToolLimits` is validated when built (a bad value raises a
``ValueError`` naming the field and the accepted values) and never changes afterwards;
:func:`truncate` never returns more than ``max_chars`` characters plus its marker;
:func:`truncate_tokens` never returns text that the tokenizer encodes (alone) to more than
``max_tokens`` tokens, its marker included, when the budget can hold the marker at all.

Example::

    limits = ToolLimits(timeout_s=5.0, max_output_chars=2000, truncate_side="middle")
    truncate("x" * 10, 4, "right")   # ("xxxx...[truncated 6 chars]", 6)
    truncate_tokens(text, 256, "right", tokenizer)   # at most 256 tokens of the policy's tokenizer
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = ["TextTokenizer", "ToolLimits", "TruncateSide", "truncate", "truncate_tokens"]

TruncateSide = Literal["left", "right", "middle"]
_SIDES = ("left", "right", "middle")


@dataclass(frozen=True)
class ToolLimits:
    """The limits a :class:`~tools.toolset.ToolSet` applies to every call of its tools.

    A tool's own ``timeout_s`` / ``max_output_chars`` (when not ``None``) override the first
    two for that tool. ``None`` disables a limit.
    """

    timeout_s: float | None = 10.0
    """Seconds one call may take; then it returns a ``timed out`` error."""
    max_output_chars: int | None = 4000
    """Most characters of a tool message; longer output is cut (:func:`truncate`)."""
    max_output_tokens: int | None = None
    """Most tokens (of the policy's tokenizer) of a tool message, marker included; applied after
    the character cap (:func:`truncate_tokens`). ``None`` = no token budget."""
    truncate_side: TruncateSide = "right"
    """Which side of a long output is cut (``right`` keeps the head)."""
    release_timeout_s: float = 10.0
    """Seconds one ``release`` may take before it is abandoned (counted as a release error)."""
    sync_workers: int = 16
    """Most sync ``@tool`` functions running at once (threads of the ToolSet's own pool)."""

    def __post_init__(self) -> None:
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(
                f"tools.max_output_tokens must be >= 1 or null, got {self.max_output_tokens}"
            )
        if self.sync_workers < 1:
            raise ValueError(f"sync_workers must be >= 1, got {self.sync_workers}")
        if self.truncate_side not in _SIDES:
            raise ValueError(
                f"truncate_side must be 'left', 'right' or 'middle', got {self.truncate_side!r}"
            )

    def timeout_of(self, tool_timeout_s: float | None) -> float | None:
        """The timeout of a call of a tool whose own ``timeout_s`` is ``tool_timeout_s``."""
        return tool_timeout_s if tool_timeout_s is not None else self.timeout_s

    def output_chars_of(self, tool_max_output_chars: int | None) -> int | None:
        """The output limit of a tool whose own ``max_output_chars`` is the argument."""
        if tool_max_output_chars is not None:
            return tool_max_output_chars
        return self.max_output_chars


def truncate(text: str, max_chars: int | None, side: TruncateSide = "right") -> tuple[str, int]:
    """Keep at most ``max_chars`` characters of ``text``; return (text, characters dropped).

    ``side`` is the side that is cut: ``right`` keeps the head, ``left`` keeps the tail,
    ``middle`` keeps both ends. A marker ``...[truncated N chars]`` (not counted in
    ``max_chars``) shows where text was dropped. ``max_chars=None`` disables truncation.
    """
    if max_chars is None or len(text) <= max_chars:
        return text, 0
    max_chars = max(0, max_chars)
    dropped = len(text) - max_chars
    marker = f"...[truncated {dropped} chars]"
    if side == "right":
        return text[:max_chars] + marker, dropped
    if side == "left":
        return marker + text[len(text) - max_chars :], dropped
    if side == "middle":
        head = max_chars - max_chars // 2
        tail = max_chars // 2
        return text[:head] + marker + (text[len(text) - tail :] if tail else ""), dropped
    raise ValueError(f"truncate_side must be 'left', 'right' or 'middle', got {side!r}")


class TextTokenizer(Protocol):
    """What :func:`truncate_tokens` needs of a tokenizer (a Hugging Face tokenizer has it)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


def _token_marker(dropped: int) -> str:
    return f"...[truncated {dropped} tokens]"


def truncate_tokens(
    text: str, max_tokens: int | None, side: TruncateSide, tokenizer: TextTokenizer
) -> tuple[str, int]:
    """Keep at most ``max_tokens`` tokens of ``text`` (as ``tokenizer`` encodes it alone, without
    special tokens), the marker ``...[truncated N tokens]`` counted in the budget; return (text,
    tokens dropped). ``side`` is cut as in :func:`truncate`. A budget too small for the marker
    keeps only the marker. ``max_tokens=None`` disables truncation.
    """
    if side not in _SIDES:
        raise ValueError(f"truncate_side must be 'left', 'right' or 'middle', got {side!r}")
    if max_tokens is None:
        return text, 0
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) <= max_tokens:
        return text, 0

    def cut(keep: int) -> str:
        marker = _token_marker(len(ids) - keep)
        if side == "right":
            return tokenizer.decode(ids[:keep]) + marker
        if side == "left":
            return marker + tokenizer.decode(ids[len(ids) - keep :])
        head, tail = keep - keep // 2, keep // 2
        return (
            tokenizer.decode(ids[:head])
            + marker
            + (tokenizer.decode(ids[len(ids) - tail :]) if tail else "")
        )

    def length(out: str) -> int:
        return len(tokenizer.encode(out, add_special_tokens=False))

    # Re-encoding can differ from the kept ids (a split multi-byte character, merges with the
    # marker), so the result itself is measured until it fits.
    keep = max(0, max_tokens - length(_token_marker(len(ids) - max_tokens)))
    out = cut(keep)
    while keep > 0 and length(out) > max_tokens:
        keep -= 1
        out = cut(keep)
    return out, len(ids) - keep
