"""Exact token bookkeeping for one multi-turn episode.

Why this module exists: the most common silent bug in multi-turn RL is training on tokens the
model never saw, because each turn re-renders and re-tokenizes the whole conversation and the
chat template (or the tokenizer's merges) drift. :class:`EpisodeRecorder` never re-tokenizes an
earlier turn. It guarantees, for every episode it records:

- the prompt of every request is exactly the previous request's prompt, plus exactly the tokens
  the server generated, plus the tokenized *delta* of the new messages
  (``context_ids()`` is the next request's prompt);
- ``loss_mask`` is 1 only on tokens the policy sampled; there ``rollout_logprobs`` and
  ``policy_version`` are the server's values; elsewhere they are ``0.0`` and ``-1``;
- the four per-token lists always have the same length, also after truncation, which keeps the
  response within ``max_response_tokens`` and the whole context within ``max_context_tokens``.

How the delta is rendered: the new messages are rendered after a fixed dummy conversation that
ends with an assistant turn, and only the text after that turn's end-of-turn token
(``<|im_end|>`` for Qwen-style templates) is tokenized. So the template's newline after
``<|im_end|>`` belongs to the delta (mask 0), and the delta carries the generation prompt for the
next assistant turn. Because the delta starts right after a special token, tokenizing it alone
gives the same ids as tokenizing the whole render. The first delta per tokenizer is checked at the
token level (``render(prefix) + delta == render(all)``); a template that is not prefix-stable
raises :class:`ChatTemplateError` naming the template.

The delta ids are cached per renderer (a bounded LRU, :meth:`DeltaRenderer.cache_info`): the
samples of one GRPO group usually make the same tool calls and get the same tool outputs, so
the same delta is rendered and tokenized again and again. The cache is exact: its key is the
messages themselves (every key and value, which must all be plain strings or ``None``; other
messages are not cached), the tools that matter to the delta and ``add_generation_prompt``, and
a template that can render differently for the same messages (one that calls
``strftime_now`` or ``random``) is never cached.

A model turn that ended without the end-of-turn token (``max_tokens`` reached, a custom stop
token, an aborted request) is closed by appending the end-of-turn token with mask 0 before any
new message, exactly as the chat template would have rendered it.

Example::

    rec = EpisodeRecorder.from_messages(
        [{"role": "user", "content": "What is 2+2?"}], tokenizer, tools=toolset.schemas()
    )
    gen = await policy.generate(rec.context_ids(), sampling)
    rec.add_generation(gen)
    rec.add_messages([{"role": "tool", "content": "4"}], tokenizer)
    traj = rec.to_trajectory(uid="g0", stop_reason=StopReason.EOS)
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from agentrl.types import Generation, Message, Trajectory, TurnRecord

__all__ = [
    "ChatTemplateError",
    "DeltaRenderer",
    "EpisodeRecorder",
    "get_delta_renderer",
    "render_prompt_ids",
]


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used for exact incremental rendering."""


_DUMMY_PREFIX: list[Message] = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
]


def _template_name(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def _render(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]] | None,
    add_generation_prompt: bool,
) -> str:
    try:
        text = tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except Exception as exc:  # jinja errors carry no context of which template failed
        raise ChatTemplateError(
            f"the chat template of tokenizer {_template_name(tokenizer)!r} failed to render "
            f"{len(messages)} message(s) with roles {[m.get('role') for m in messages]}: {exc}"
        ) from exc
    if not isinstance(text, str):
        raise ChatTemplateError(
            f"apply_chat_template(tokenize=False) of {_template_name(tokenizer)!r} returned "
            f"{type(text).__name__}, expected str"
        )
    return text


def _direct_template(tokenizer: Any) -> tuple[Any, dict[str, Any]] | None:
    """The compiled chat template and the variables ``apply_chat_template`` adds, for rendering
    without tools with no per-call overhead; None where the tokenizer renders some other way.

    Uses transformers' template compiler (cached per template source); callers check the result
    against ``apply_chat_template`` once before relying on it.
    """
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers layout: apply_chat_template it is
        return None
    own = getattr(type(tokenizer), "apply_chat_template", None)
    if own is not PreTrainedTokenizerBase.apply_chat_template:
        return None
    try:
        compiled = _compile_jinja_template(tokenizer.get_chat_template(None, None))
        variables = dict(tokenizer.special_tokens_map)
    except Exception:  # no template, or one the compiler rejects: the slow path reports it
        return None
    return compiled, variables


def render_prompt_ids(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered by the chat template with the generation prompt."""
    text = _render(tokenizer, messages, tools, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _tools_key(tools: Sequence[dict[str, Any]] | None) -> str:
    return json.dumps(tools, sort_keys=True) if tools else ""


_MessagesKey = tuple[tuple[tuple[str, str | None], ...], ...]


def _messages_key(messages: Sequence[Message]) -> _MessagesKey | None:
    """An exact, hashable key of ``messages``, or None when a key or value is not a plain str.

    Only ``str`` (not a subclass) and ``None`` values qualify: hashing would make ``1``, ``1.0``
    and ``True`` equal although a template renders them differently, and nested content (lists,
    dicts) would need a deep key. Two messages with the same items in another order get
    different keys (a miss, never a wrong hit).
    """
    key = []
    for m in messages:
        items = tuple(m.items())
        for k, v in items:
            if type(k) is not str or (v is not None and type(v) is not str):
                return None
        key.append(items)
    return tuple(key)


def _template_is_deterministic(tokenizer: Any) -> bool:
    """False when the chat template may render the same messages differently (date, random)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    source = str(template or "")
    return "strftime_now" not in source and "random" not in source


class DeltaRenderer:
    """Renders the token delta of new messages appended after an assistant turn.

    One instance per tokenizer (see :func:`get_delta_renderer`); it caches the rendered dummy
    prefix per tools list and verifies prefix stability once, on its first delta.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        end_of_turn_token: the token that ends an assistant turn (default: ``eos_token``).
        cache_size: most deltas kept in the LRU cache of delta ids (0 = no cache).
    """

    def __init__(
        self, tokenizer: Any, end_of_turn_token: str | None = None, cache_size: int = 4096
    ) -> None:
        if cache_size < 0:
            raise ValueError(f"DeltaRenderer(cache_size={cache_size}): use 0 (off) or more")
        self.tokenizer = tokenizer
        eot = end_of_turn_token or getattr(tokenizer, "eos_token", None)
        if not eot:
            raise ChatTemplateError(
                f"tokenizer {_template_name(tokenizer)!r} has no eos_token; pass "
                "end_of_turn_token= (the token that ends an assistant turn, e.g. '<|im_end|>')"
            )
        self.end_of_turn_token: str = eot
        self.eos_token: str | None = getattr(tokenizer, "eos_token", None)
        """The tokenizer's EOS text (read once: a tokenizer attribute lookup is not free)."""
        self.end_of_turn_ids: list[int] = list(tokenizer.encode(eot, add_special_tokens=False))
        if not self.end_of_turn_ids:
            raise ChatTemplateError(f"end-of-turn token {eot!r} encodes to no ids")
        self._prefix_cache: dict[str, str] = {}
        self._tools_matter: dict[str, bool] = {}
        self._prompts: OrderedDict[tuple[_MessagesKey | str, str], list[int]] = OrderedDict()
        self._verified = False
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if hasattr(backend, "encode") else None
        self._direct: tuple[Any, dict[str, Any]] | None = _direct_template(tokenizer)
        self._direct_checked: set[bool] = set()
        self.cache_size = cache_size if _template_is_deterministic(tokenizer) else 0
        self._deltas: OrderedDict[tuple[_MessagesKey, str, bool], list[int]] = OrderedDict()
        self._hits = 0
        self._misses = 0

    def cache_info(self) -> dict[str, int]:
        """Delta-cache counters: ``hits``, ``misses`` (every uncached delta), ``size``, ``maxsize``."""
        return {
            "hits": self._hits,
            "misses": self._misses,
            "size": len(self._deltas),
            "maxsize": self.cache_size,
        }

    def cache_clear(self) -> None:
        """Empty the delta cache and reset its counters."""
        self._deltas.clear()
        self._hits = self._misses = 0

    def _encode(self, text: str) -> list[int]:
        # The Rust backend skips the Python wrapper (a third of the cost per turn); the first
        # delta is verified against ``tokenizer.encode`` below, so both paths must agree.
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
        tools_key: str | None = None,
    ) -> list[int]:
        """:func:`render_prompt_ids`, cached: the samples of one task share their prompt."""
        # The exact key of plain-str messages; JSON (key order kept) for anything else.
        msgs_key: _MessagesKey | str | None = _messages_key(messages)
        if msgs_key is None:
            msgs_key = json.dumps(messages)
        key = (msgs_key, _tools_key(tools) if tools_key is None else tools_key)
        ids = self._prompts.get(key)
        if ids is None:
            text = _render(self.tokenizer, messages, tools, add_generation_prompt=True)
            ids = self._encode(text)
            self._prompts[key] = ids
            if len(self._prompts) > 1024:
                self._prompts.popitem(last=False)
        else:
            self._prompts.move_to_end(key)
        return list(ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with special tokens kept."""
        if self._backend is not None:
            return self._backend.decode(list(token_ids), skip_special_tokens=False)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def _prefix_text(self, tools: Sequence[dict[str, Any]] | None, key: str | None = None) -> str:
        key = _tools_key(tools) if key is None else key
        cached = self._prefix_cache.get(key)
        if cached is not None:
            return cached
        text = _render(self.tokenizer, _DUMMY_PREFIX, tools, add_generation_prompt=False)
        cut = text.rfind(self.end_of_turn_token)
        if cut < 0:
            raise ChatTemplateError(
                f"the chat template of {_template_name(self.tokenizer)!r} does not end an "
                f"assistant turn with {self.end_of_turn_token!r}; pass the right "
                "end_of_turn_token= to the recorder"
            )
        prefix = text[: cut + len(self.end_of_turn_token)]
        if len(self._prefix_cache) > 64:
            self._prefix_cache.clear()
        self._prefix_cache[key] = prefix
        return prefix

    def _render_full(
        self, messages: list[Message], tools: Sequence[dict[str, Any]] | None, agp: bool
    ) -> str:
        """:func:`_render`; without tools, through the compiled template directly (a third
        cheaper), after checking once per ``add_generation_prompt`` that both give the same text."""
        direct = self._direct
        if tools or direct is None:
            return _render(self.tokenizer, messages, tools, agp)
        template, variables = direct
        try:
            text = template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=agp,
                **variables,
            )
        except Exception:  # the slow path raises its descriptive error...
            text = _render(self.tokenizer, messages, None, agp)
            self._direct = None  # ... or renders what the direct path could not: use it from now
            return text
        if agp not in self._direct_checked:
            if text != _render(self.tokenizer, messages, None, agp):
                self._direct = None
                return _render(self.tokenizer, messages, None, agp)
            self._direct_checked.add(agp)
        return text

    def _delta_text(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool,
        tools_key: str | None = None,
    ) -> str:
        prefix = self._prefix_text(tools, tools_key)
        full = self._render_full([*_DUMMY_PREFIX, *messages], tools, add_generation_prompt)
        if not full.startswith(prefix):
            raise ChatTemplateError(
                f"the chat template of {_template_name(self.tokenizer)!r} is not prefix-stable: "
                "rendering new messages changes how the earlier assistant turn is rendered, so "
                "token-exact multi-turn episodes are impossible with it; use a template that "
                "renders earlier turns independently of later ones"
            )
        return full[len(prefix) :]

    def delta_ids(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tools_key: str | None = None,
    ) -> list[int]:
        """Ids of ``messages`` as the template renders them after a finished assistant turn.

        Starts with whatever the template puts after the end-of-turn token (e.g. ``\\n``) and ends
        with the generation prompt of the next assistant turn when ``add_generation_prompt``.
        """
        if not messages:
            raise ValueError("delta_ids needs at least one message")
        if tools:
            # Most templates render tools only in the system prompt, before the delta. Check that
            # once per tools list; if so, later deltas skip rendering the tools (the costly part).
            key = _tools_key(tools) if tools_key is None else tools_key
            matter = self._tools_matter.get(key)
            if matter is None:
                with_tools = self._delta_text(messages, tools, add_generation_prompt, key)
                matter = with_tools != self._delta_text(messages, None, add_generation_prompt)
                if len(self._tools_matter) > 64:
                    self._tools_matter.clear()
                self._tools_matter[key] = matter
            if matter:
                tools_key = key
            else:
                tools, tools_key = None, ""
        else:
            tools, tools_key = None, ""
        cache_key = None
        if self.cache_size:  # empty until the first delta is verified (never cached if not)
            msgs_key = _messages_key(messages)
            if msgs_key is not None:
                cache_key = (msgs_key, tools_key, add_generation_prompt)
                cached = self._deltas.get(cache_key)
                if cached is not None:
                    self._deltas.move_to_end(cache_key)
                    self._hits += 1
                    return list(cached)
        self._misses += 1
        delta = self._render_delta(messages, tools, add_generation_prompt, tools_key)
        if cache_key is not None:
            self._deltas[cache_key] = delta
            if len(self._deltas) > self.cache_size:
                self._deltas.popitem(last=False)
            return list(delta)
        return delta

    def _render_delta(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool,
        tools_key: str,
    ) -> list[int]:
        """Render and tokenize one delta (uncached); the first one is verified token by token."""
        text = self._delta_text(messages, tools, add_generation_prompt, tools_key)
        delta = self._encode(text)
        if not self._verified:
            prefix = self._prefix_text(tools, tools_key)
            full = prefix + text
            whole = list(self.tokenizer.encode(full, add_special_tokens=False))
            head = list(self.tokenizer.encode(prefix, add_special_tokens=False))
            if whole != head + delta:
                raise ChatTemplateError(
                    f"tokenizer {_template_name(self.tokenizer)!r}: tokenizing the rendered prefix "
                    "and the new messages separately differs from tokenizing the whole render "
                    f"(first mismatch at token {_first_mismatch(whole, head + delta)}); the "
                    "end-of-turn token must be a special token so that tokenization restarts "
                    "after it"
                )
            self._verified = True
        return delta


def _first_mismatch(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


_RENDERERS: dict[int, DeltaRenderer] = {}


def get_delta_renderer(tokenizer: Any, end_of_turn_token: str | None = None) -> DeltaRenderer:
    """The (cached) :class:`DeltaRenderer` of ``tokenizer``."""
    key = id(tokenizer)
    renderer = _RENDERERS.get(key)
    if (
        renderer is None
        or renderer.tokenizer is not tokenizer
        or (end_of_turn_token is not None and renderer.end_of_turn_token != end_of_turn_token)
    ):
        renderer = DeltaRenderer(tokenizer, end_of_turn_token)
        if len(_RENDERERS) > 256:
            _RENDERERS.clear()
        _RENDERERS[key] = renderer
    return renderer


class EpisodeRecorder:
    """Token-exact record of one episode: prompt, response, loss mask, logprobs, versions.

    Args:
        prompt_ids: the tokens the episode starts from (chat template applied, with the
            generation prompt of the first assistant turn).
        tokenizer: the tokenizer whose chat template renders later messages (needed by
            :meth:`add_messages`).
        tools: OpenAI function schemas passed to the chat template.
        max_response_tokens: budget for everything after the prompt (model and environment
            tokens); ``None`` = unlimited.
        max_context_tokens: budget for prompt + response (the model's context); ``None`` =
            unlimited.
        end_of_turn_token: the token that ends an assistant turn (default: the tokenizer's EOS).
        tools_key: ``json.dumps(tools, sort_keys=True)`` if the caller already has it (it keys
            the renderer's caches); computed when ``None``.
        clock: wall clock for :attr:`turns` (``time.time``; injected by tests).
    """

    def __init__(
        self,
        prompt_ids: Sequence[int],
        *,
        tokenizer: Any = None,
        tools: Sequence[dict[str, Any]] | None = None,
        max_response_tokens: int | None = None,
        max_context_tokens: int | None = None,
        end_of_turn_token: str | None = None,
        tools_key: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not prompt_ids:
            raise ValueError("EpisodeRecorder needs a non-empty prompt_ids")
        self.prompt_ids: list[int] = list(prompt_ids)
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.rollout_logprobs: list[float] = []
        self.policy_version: list[int] = []
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self._tools_key = _tools_key(self.tools) if tools_key is None else tools_key
        self._eot: list[int] | None = None
        self.max_response_tokens = max_response_tokens
        self.max_context_tokens = max_context_tokens
        self.end_of_turn_token = end_of_turn_token
        self.num_turns = 0
        """Model turns recorded (generations that produced at least one token)."""
        self.truncated = False
        """True once a budget cut the response (the episode should stop with ``length``)."""
        self._turn_open = False
        self._turn_has_tokens = False
        self.clock = clock
        self.turns: list[TurnRecord] = []
        """Each model turn and environment answer as it happened (for traces)."""
        self._mark = clock()

    @classmethod
    def from_messages(
        cls,
        messages: Sequence[Message],
        tokenizer: Any,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        max_response_tokens: int | None = None,
        max_context_tokens: int | None = None,
        end_of_turn_token: str | None = None,
    ) -> EpisodeRecorder:
        """Start an episode from a conversation rendered with the generation prompt."""
        renderer = get_delta_renderer(tokenizer, end_of_turn_token)
        tools_key = _tools_key(tools)
        return cls(
            renderer.prompt_ids(messages, tools, tools_key),
            tokenizer=tokenizer,
            tools=tools,
            max_response_tokens=max_response_tokens,
            max_context_tokens=max_context_tokens,
            end_of_turn_token=end_of_turn_token,
            tools_key=tools_key,
        )

    # ---- budget ---------------------------------------------------------------------------
    @property
    def remaining_budget(self) -> int:
        """Tokens that may still be appended before a budget is hit (large if unlimited)."""
        left = 1 << 62
        if self.max_response_tokens is not None:
            left = min(left, self.max_response_tokens - len(self.response_ids))
        if self.max_context_tokens is not None:
            left = min(
                left, self.max_context_tokens - len(self.prompt_ids) - len(self.response_ids)
            )
        return max(left, 0)

    @property
    def response_limit(self) -> int | None:
        """The largest allowed response length under both budgets (None = unlimited)."""
        limits = []
        if self.max_response_tokens is not None:
            limits.append(self.max_response_tokens)
        if self.max_context_tokens is not None:
            limits.append(self.max_context_tokens - len(self.prompt_ids))
        return max(min(limits), 0) if limits else None

    def context_ids(self) -> list[int]:
        """Prompt + response so far: exactly the prompt of the next generate request."""
        return self.prompt_ids + self.response_ids

    # ---- appending ------------------------------------------------------------------------
    def add_generation(self, gen: Generation, *, continue_turn: bool = False) -> None:
        """Append a model turn: mask 1, the server's logprobs, each token's weight version.

        ``continue_turn=True`` appends to the current (open) model turn instead of starting a
        new one, e.g. when a request aborted by a weight push is resumed with the new weights;
        each token keeps the version that produced it. Tokens past the budget are cut (and
        :attr:`truncated` is set).
        """
        versions = gen.versions()
        if versions and min(versions) < 0:
            raise ValueError(
                f"generation weight_version={gen.weight_version} (token versions "
                f"{sorted(set(versions))}); sampled tokens need the version (>= 0) of the "
                "weights that produced them"
            )
        n, before = len(gen.token_ids), len(self.response_ids)
        self.response_ids.extend(gen.token_ids)
        self.loss_mask.extend([1] * n)
        self.rollout_logprobs.extend(gen.logprobs)  # floats: Generation validated them
        self.policy_version.extend(versions)
        if n and not (continue_turn and self._turn_has_tokens):
            self.num_turns += 1
        merge = continue_turn and self._turn_has_tokens
        self._turn_has_tokens = bool(n) or merge
        eot = self._eot_ids()
        self._turn_open = eot is None or list(gen.token_ids[-len(eot) :]) != eot
        self._enforce_budget()
        if n:
            kept = max(len(self.response_ids) - before, 0)
            self._note("model", kept, merge, gen.weight_version, gen.finish_reason)

    def _note(
        self,
        kind: str,
        n: int,
        merge: bool,
        version: int = -1,
        finish_reason: str | None = None,
    ) -> None:
        """Record a step in :attr:`turns` (or extend the last one when ``merge``)."""
        now = self.clock()
        last = self.turns[-1] if self.turns else None
        if merge and last is not None and last.kind == kind:
            last.end, last.tokens = now, last.tokens + n
            last.version, last.finish_reason = version, finish_reason
        else:
            self.turns.append(
                TurnRecord(
                    kind=kind,  # type: ignore[arg-type]  # "model" | "environment"
                    start=self._mark,
                    end=now,
                    tokens=n,
                    version=version,
                    finish_reason=finish_reason,
                )
            )
        self._mark = now

    def add_environment_tokens(self, token_ids: Sequence[int]) -> None:
        """Append tokens the policy did not sample (mask 0, logprob 0.0, version -1)."""
        n, before = len(token_ids), len(self.response_ids)
        self.response_ids.extend(token_ids)
        self.loss_mask.extend([0] * n)
        self.rollout_logprobs.extend([0.0] * n)
        self.policy_version.extend([-1] * n)
        self._enforce_budget()
        if n:
            self._note("environment", max(len(self.response_ids) - before, 0), merge=True)

    def close_turn(self) -> list[int]:
        """End an open model turn with the end-of-turn token (mask 0); returns what was added."""
        if not self._turn_open:
            return []
        self._turn_open = False
        eot = self._eot_ids() or []
        self.add_environment_tokens(eot)
        return list(eot)

    def add_messages(
        self,
        messages: Sequence[Message],
        tokenizer: Any = None,
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Append the tokenized delta of new (tool/user) messages with mask 0.

        Pass all messages of one turn in one call (templates group consecutive tool messages).
        Closes an open model turn first. Returns the ids appended (before any budget cut).
        """
        tok = tokenizer if tokenizer is not None else self.tokenizer
        if tok is None:
            raise ValueError("add_messages needs a tokenizer (pass it here or to the recorder)")
        renderer = get_delta_renderer(tok, self.end_of_turn_token)
        if tools is None:
            delta = renderer.delta_ids(messages, self.tools, add_generation_prompt, self._tools_key)
        else:
            delta = renderer.delta_ids(messages, tools, add_generation_prompt)
        added = self.close_turn()
        self.add_environment_tokens(delta)
        return added + delta

    def truncate_to(self, max_len: int) -> bool:
        """Cut the response to at most ``max_len`` tokens; True if anything was cut."""
        if max_len < 0:
            raise ValueError(f"truncate_to(max_len={max_len}): max_len must be >= 0")
        if len(self.response_ids) <= max_len:
            return False
        del self.response_ids[max_len:]
        del self.loss_mask[max_len:]
        del self.rollout_logprobs[max_len:]
        del self.policy_version[max_len:]
        self.truncated = True
        return True

    def _enforce_budget(self) -> None:
        limit = self.response_limit
        if limit is not None:
            self.truncate_to(limit)

    def _eot_ids(self) -> list[int] | None:
        if self._eot is None and self.tokenizer is not None:
            self._eot = get_delta_renderer(self.tokenizer, self.end_of_turn_token).end_of_turn_ids
        return self._eot

    # ---- output ---------------------------------------------------------------------------
    def to_trajectory(self, **meta: Any) -> Trajectory:
        """Freeze the record into a :class:`Trajectory`; ``meta`` sets the other fields."""
        meta.setdefault("num_turns", self.num_turns)
        meta.setdefault("turns", self.turns)
        # Validation builds new lists, so the trajectory never aliases the recorder's.
        return Trajectory(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            loss_mask=self.loss_mask,
            rollout_logprobs=self.rollout_logprobs,
            policy_version=self.policy_version,
            **meta,
        )
