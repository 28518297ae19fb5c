"""Build a tiny, deterministic Qwen2 model and byte-level tokenizer for tests and quickstarts.

Why it exists: every test in this project (engine, server, agent loop, trainer, vLLM backend)
needs a real Hugging Face model directory, and the machine has no network. ``build_tiny_model``
writes one in a second: a randomly initialised Qwen2 causal LM plus a tokenizer and a chat
template, saved with ``save_pretrained`` so that ``transformers`` and vLLM both load it.

Guarantees:

- **Deterministic.** The same arguments (including ``seed``) write byte-identical files.
- **Lossless tokenizer.** A byte-level BPE with no merges: every UTF-8 byte is one token, so
  ``decode(encode(text)) == text`` for any text, and ``encode(a + b) == encode(a) + encode(b)``
  whenever no special token straddles the boundary (the agent loop appends token deltas).
  ``AutoTokenizer`` (and vLLM) load a saved copy as ``Qwen2Tokenizer``, which adds Qwen's NFC
  normalizer: text that is not in NFC comes back normalized, as with real Qwen models.
- **Optional learned merges** (:func:`learn_bpe_merges`): the quickstart's warm start learns
  BPE merges from its own conversations, split with Qwen2's pre-tokenizer pattern, so words
  become single tokens while digits stay one token each.
- **Special tokens** are single ids: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>``
  (EOS: the tokenizer's ``eos_token`` and ``generation_config.eos_token_id``), ``<tool_call>``,
  ``</tool_call>``, ``<tool_response>``, ``</tool_response>``. The tool tags are *not* marked
  special, so ``skip_special_tokens=True`` keeps them in decoded text (as Qwen does).
- **vLLM-compatible shapes.** ``hidden_size / num_heads`` must be >= 32 (vLLM's CPU attention).
- **Prefix-stable chat template** (Qwen2.5-like, hermes tools)::

      <|im_start|>system\\n{system}[\\n\\n# Tools ... <tools>\\n{json per tool}\\n</tools> ...]<|im_end|>\\n
      <|im_start|>user\\n{content}<|im_end|>\\n
      <|im_start|>assistant\\n{content}[\\n]<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>\\n
      <|im_start|>tool\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n
      [<|im_start|>assistant\\n]          (add_generation_prompt=True)

  Every message renders on its own, independent of the messages after it, so
  ``render(messages[:k])`` is a prefix of ``render(messages)``. A system block is rendered only
  when there is a system message or a tools list (no hidden default system prompt).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "add_arguments",
    "build_scripted_model",
    "build_tiny_model",
    "build_tiny_reward_model",
    "build_tiny_tokenizer",
    "learn_bpe_merges",
    "run",
    "tiny_tokenizer",
]

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
"""Added tokens, in id order after the 256 byte tokens (``<|endoftext|>`` is id 256)."""

_CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""The added tokens that ``skip_special_tokens`` removes; the tool tags stay visible."""

CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{%- set system_message = none %}"
    "{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if system_message is not none %}{{- system_message + '\\n\\n' }}{%- endif %}"
    # A compact hermes tools block (Qwen2.5's wording is ~400 characters longer): with one token
    # per byte, every character of the system prompt is a position the tiny model attends over.
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool with <tool_call>\\n"
    '{\\"name\\": <name>, \\"arguments\\": <json>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif system_message is not none %}"
    "{{- '<|im_start|>system\\n' + system_message + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- if message['tool_calls'] %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}"
    "{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}"
    "{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""The Jinja chat template stored in ``tokenizer_config.json`` (see the module docstring)."""


def build_tiny_tokenizer(merges: Sequence[tuple[str, str]] = ()) -> Any:
    """A byte-level BPE tokenizer (256 byte tokens) plus :data:`SPECIAL_TOKENS`, plus ``merges``.

    With no ``merges`` (the default) every UTF-8 byte is one token. ``merges`` (from
    :func:`learn_bpe_merges`, in the ByteLevel alphabet) add one token each, with ids after the
    special tokens, so ids 0..255 stay the bytes and ``<|endoftext|>`` stays id 256 either way.
    Returns a ``transformers.PreTrainedTokenizerFast`` with the chat template, pad and EOS set.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_unicode = _bytes_to_unicode()
    # Ids 0..255 are the bytes in order, so a token id below 256 *is* the byte value.
    vocab = {byte_to_unicode[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    # The special tokens sit in the model vocab too, so that the added tokens below reuse these
    # ids (256..262) whatever the number of merges.
    for i, t in enumerate(SPECIAL_TOKENS):
        vocab[t] = 256 + i
    for a, b in merges:
        if a not in vocab or b not in vocab:
            raise ValueError(f"merge ({a!r}, {b!r}) uses a token that no earlier merge made")
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in SPECIAL_TOKENS
            if t in _CONTROL_TOKENS
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t in SPECIAL_TOKENS
            if t not in _CONTROL_TOKENS
        ]
    )
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(256, 256 + len(SPECIAL_TOKENS))), ids

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""Qwen2's pre-tokenizer pattern: words, single digits, punctuation runs, newlines."""


def _pre_tokenizer() -> Any:
    """Qwen2's pre-tokenizer: split by :data:`QWEN2_PRETOKENIZE_REGEX`, then map bytes.

    ``AutoTokenizer`` loads a saved Qwen2 model's tokenizer as ``Qwen2Tokenizer``, which installs
    exactly this pre-tokenizer (and an NFC normalizer) whatever ``tokenizer.json`` says, and so
    does vLLM; building the same one here keeps the in-memory tokenizer, the learned merges
    and every loaded copy in agreement. With no merges the split does not change any id.
    """
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (what ByteLevel uses)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def learn_bpe_merges(
    texts: Iterable[str], num_merges: int, max_token_bytes: int = 16
) -> list[tuple[str, str]]:
    """Learn up to ``num_merges`` byte-level BPE merges from ``texts`` (deterministic).

    Words are split as the tokenizer splits them (:func:`_pre_tokenizer`, Qwen2's pattern), so
    merges never join two words: every digit stays its own token (numbers are read and written
    digit by digit) and no token reaches from one line into the next (turn boundaries, which
    end in a newline or a special token, stay token boundaries). No token is longer than
    ``max_token_bytes`` bytes (as HF's ``BpeTrainer(max_token_length=...)``). Ties between
    equally frequent pairs go to the lexicographically smallest pair, so the same texts always
    give the same merges.

    Why: with one token per byte, a fixed system prompt and tools block is hundreds of positions
    that a tiny model must attend across; merges learned from the task's own conversations (as
    real tokenizers are learned from their corpus) make most words one token. Any other text
    still encodes losslessly, byte by byte where no merge applies.
    """
    if num_merges < 0:
        raise ValueError(f"num_merges={num_merges}; it must be >= 0")
    if max_token_bytes < 2:
        raise ValueError(f"max_token_bytes={max_token_bytes}; it must be >= 2 for any merge")
    pre_tokenizer = _pre_tokenizer()
    special = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    words: collections.Counter[tuple[str, ...]] = collections.Counter()
    for text in texts:
        for segment in special.split(text):
            for word, _ in pre_tokenizer.pre_tokenize_str(segment):
                if len(word) > 1:
                    words[tuple(word)] += 1
    merges: list[tuple[str, str]] = []
    corpus = list(words.items())
    for _ in range(num_merges):
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for symbols, count in corpus:
            for pair in itertools.pairwise(symbols):
                # One ByteLevel character is one byte, so len() counts bytes.
                if len(pair[0]) + len(pair[1]) <= max_token_bytes:
                    pairs[pair] += count
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        joined = best[0] + best[1]
        new_corpus = []
        for symbols, count in corpus:
            out: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            if len(out) > 1:
                new_corpus.append((tuple(out), count))
        corpus = new_corpus
    return merges


def _tiny_config(
    tokenizer: Any,
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    tie_embeddings: bool = False,
    num_labels: int | None = None,
) -> Any:
    """The ``Qwen2Config`` of every tiny model (causal LM or classifier), shapes checked."""
    from transformers import Qwen2Config

    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers}; need at least 1 layer")
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}; pick "
            "num_heads so that hidden_size / num_heads is a whole number"
        )
    head_dim = hidden_size // num_heads
    if head_dim < 32:
        raise ValueError(
            f"head_dim = hidden_size / num_heads = {head_dim}; vLLM's CPU attention needs >= 32, "
            "use fewer heads or a larger hidden_size"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads} (grouped-query "
            "attention needs whole groups)"
        )
    extra: dict[str, Any] = {} if num_labels is None else {"num_labels": num_labels}
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        tie_word_embeddings=tie_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        use_sliding_window=False,
        dtype="float32",
        **extra,
    )


def build_tiny_model(
    out_dir: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    tie_embeddings: bool = False,
    merges: Sequence[tuple[str, str]] = (),
) -> Path:
    """Write a random Qwen2 causal LM, its tokenizer and chat template to ``out_dir``.

    Deterministic: the same arguments give byte-identical files. Returns ``out_dir`` as a Path.
    ``merges`` (from :func:`learn_bpe_merges`) extend the byte-level tokenizer and the vocabulary.
    Raises ``ValueError`` naming the argument when the shapes are unusable
    (``hidden_size`` not divisible by ``num_heads``, head_dim < 32, ...).
    """
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer(merges)
    config = _tiny_config(
        tokenizer,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_embeddings=tie_embeddings,
    )
    eos_id, pad_id = config.eos_token_id, config.pad_token_id
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # A random init from a seeded generator; initializer_range 0.02 gives near-uniform outputs,
    # so scale the LM head up a little to make sampling distributions non-trivial.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.08)
    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_reward_model(
    out_dir: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    num_labels: int = 1,
    seed: int = 0,
) -> Path:
    """Write a random ``Qwen2ForSequenceClassification`` (a reward model) and the tiny tokenizer.

    It is what the reward-model role serves (``agentrl serve-model --task score``, vLLM's
    ``--runner pooling``): a causal transformer whose score head reads the hidden state of the
    last token that is not padding, ``num_labels`` logits per sequence. Deterministic like
    :func:`build_tiny_model` (same shape arguments, same checks). Returns ``out_dir``.
    """
    import torch
    from transformers import Qwen2ForSequenceClassification

    if num_labels < 1:
        raise ValueError(f"num_labels={num_labels}; a reward model has at least one label")
    tokenizer = build_tiny_tokenizer()
    config = _tiny_config(
        tokenizer,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        num_labels=num_labels,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.08)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def build_scripted_model(out_dir: str | Path, reply: str, *, hidden_size: int = 128) -> Path:
    """Write a Qwen2 causal LM that answers every chat with ``reply`` (greedy), then EOS.

    Why: a test needs a judge whose answer is known (the random tiny model answers garbage).
    The model is a bigram table: attention and MLP outputs are zero (``o_proj``, ``down_proj``),
    so the logits at a position depend only on that position's token; each token of the chain
    ``"\\n"`` (the end of ``<|im_start|>assistant\\n``) -> reply bytes -> ``<|im_end|>`` gets
    its own embedding direction, and the LM head maps it to the next token of the chain. The
    embedded server and vLLM load it like any Qwen2 model. Raises ``ValueError`` when a token
    of the chain would need two different successors (a repeated byte in ``reply``) or when the
    chain is longer than ``hidden_size``.
    """
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    chain = [*tokenizer.encode("\n" + reply, add_special_tokens=False)]
    chain.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    successors: dict[int, int] = {}
    for cur, nxt in itertools.pairwise(chain):
        if successors.setdefault(cur, nxt) != nxt:
            raise ValueError(
                f"reply {reply!r}: token {tokenizer.decode([cur])!r} is followed by two different "
                "tokens; a scripted model can only say replies whose bytes do not repeat"
            )
    if len(successors) > hidden_size:
        raise ValueError(f"reply {reply!r} is too long for hidden_size={hidden_size}")
    config = _tiny_config(
        tokenizer,
        num_layers=1,
        hidden_size=hidden_size,
        num_heads=hidden_size // 32,
        num_kv_heads=1,
        intermediate_size=64,
        max_position_embeddings=2048,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.norm.weight.fill_(1.0)
        layers: Any = model.model.layers
        for layer in layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        for slot, (cur, nxt) in enumerate(successors.items()):
            model.model.embed_tokens.weight[cur, slot] = 1.0
            model.lm_head.weight[nxt, slot] = 1.0
    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def tiny_tokenizer(path: str | Path) -> Any:
    """Load the tokenizer of a model directory (``AutoTokenizer``), for tests and scripts."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


# ---- CLI: ``agentrl tiny-model OUT_DIR`` -------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", help="directory to write the model and tokenizer into")
    parser.add_argument("--layers", type=int, default=2, help="number of decoder layers")
    parser.add_argument("--hidden-size", type=int, default=128, help="model width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (head_dim >= 32)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    parser.add_argument("--intermediate-size", type=int, default=256, help="MLP width")
    parser.add_argument("--max-position-embeddings", type=int, default=2048, help="context size")
    parser.add_argument("--seed", type=int, default=0, help="weight-init seed (deterministic)")
    parser.add_argument(
        "--tie-embeddings", action="store_true", help="share input embedding and LM head"
    )
    parser.add_argument(
        "--reward-model",
        action="store_true",
        help="write a Qwen2ForSequenceClassification (one label) instead: a tiny reward model "
        "for `agentrl serve-model --task score`",
    )


def run(args: argparse.Namespace) -> int:
    shape = {
        "num_layers": args.layers,
        "hidden_size": args.hidden_size,
        "num_heads": args.heads,
        "num_kv_heads": args.kv_heads,
        "intermediate_size": args.intermediate_size,
        "max_position_embeddings": args.max_position_embeddings,
        "seed": args.seed,
    }
    if getattr(args, "reward_model", False):
        out = build_tiny_reward_model(args.out_dir, **shape)
    else:
        out = build_tiny_model(args.out_dir, tie_embeddings=args.tie_embeddings, **shape)
    print(json.dumps({"model_dir": str(out)}))
    return 0
