"""Local document search: BM25 over a JSONL collection, as a tool the model can call.

Why it exists: search-augmented agents (Search-R1 style) need a retriever that runs offline, in
tests and in CI, with no server and no embedding model. This module is a small, exact BM25.

Corpus format: one JSON object per line, ``{"id": ..., "title": ..., "text": ...}``; ``id``
and ``text`` are required, ``title`` is optional; blank lines are skipped. A missing file, a
line that is not JSON, a missing or non-string field, or a repeated id raises
:class:`CorpusError` naming the file and line.

Tokenization (documents and queries alike): Unicode NFKC normalization, lowercase
(``str.casefold``), then maximal runs of letters and digits (``[^\\W_]+``); no stemming, no
stop words. The title is indexed together with the text.

Scoring (Robertson/Sparck Jones BM25 with Lucene's non-negative idf), for a query q and a
document d of length |d| (tokens) in a corpus of N documents with mean length avgdl::

    score(d, q) = Σ_{t ∈ q}  idf(t) · tf(t, d) · (k1 + 1) / (tf(t, d) + k1 · (1 − b + b · |d| / avgdl))
    idf(t)      = ln(1 + (N − df(t) + 0.5) / (df(t) + 0.5))

with k1 = 1.5 and b = 0.75 by default; a query term repeated counts once per repetition. Ties
are broken by corpus order. Results show the title, the id, the score and a snippet: the
window of ``snippet_chars`` characters of the text holding the most query-term occurrences.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from tools.base import Tool, ToolResult
from tools.schema import clean_schema

__all__ = ["BM25Index", "CorpusError", "Document", "SearchTool", "load_corpus", "tokenize"]

_TOKEN = re.compile(r"[^\W_]+")


def tokenize(text: str) -> list[str]:
    """NFKC, casefold, runs of letters/digits: ``"Hello, World-2!"`` -> ``["hello", "world", "2"]``."""
    return _TOKEN.findall(unicodedata.normalize("NFKC", text).casefold())


class CorpusError(ValueError):
    """The corpus file is missing or malformed; the message names the file and line."""


@dataclass(frozen=True)
class Document:
    """One corpus entry: its id, title and text (a line of the JSONL corpus)."""

    id: str
    title: str
    text: str


def load_corpus(path: str | Path) -> list[Document]:
    """Read a JSONL corpus; raise :class:`CorpusError` with ``file:line`` on any problem."""
    p = Path(path)
    if not p.is_file():
        raise CorpusError(
            f"search corpus {str(p)!r} does not exist or is not a file; pass the path of a "
            'JSONL file with one {"id", "title", "text"} object per line'
        )
    docs: list[Document] = []
    seen: dict[str, int] = {}
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(
                    f"{where}: not valid JSON ({exc.msg} at column {exc.colno})"
                ) from None
            if not isinstance(row, dict):
                raise CorpusError(f"{where}: expected a JSON object, got {type(row).__name__}")
            doc = _document(row, where)
            if doc.id in seen:
                raise CorpusError(f"{where}: id {doc.id!r} repeats the id on line {seen[doc.id]}")
            seen[doc.id] = lineno
            docs.append(doc)
    if not docs:
        raise CorpusError(f"search corpus {str(p)!r} holds no documents")
    return docs


def _document(row: dict[str, Any], where: str) -> Document:
    if "id" not in row:
        raise CorpusError(f"{where}: missing field 'id'")
    if "text" not in row:
        raise CorpusError(f"{where}: missing field 'text'")
    doc_id = row["id"]
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
        raise CorpusError(f"{where}: field 'id' must be a string or an integer, got {doc_id!r}")
    text = row["text"]
    title = row.get("title", "")
    if not isinstance(text, str):
        raise CorpusError(f"{where}: field 'text' must be a string, got {type(text).__name__}")
    if title is None:
        title = ""
    if not isinstance(title, str):
        raise CorpusError(f"{where}: field 'title' must be a string, got {type(title).__name__}")
    return Document(id=str(doc_id), title=title, text=text)


class BM25Index:
    """An in-memory BM25 index (see the module docstring for the exact formula)."""

    def __init__(self, documents: Iterable[Document], *, k1: float = 1.5, b: float = 0.75):
        if k1 < 0 or not 0.0 <= b <= 1.0:
            raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.documents = list(documents)
        self.k1 = k1
        self.b = b
        self.doc_len: list[int] = []
        self.postings: dict[str, list[tuple[int, int]]] = {}
        for i, doc in enumerate(self.documents):
            tokens = tokenize(f"{doc.title}\n{doc.text}")
            self.doc_len.append(len(tokens))
            for term, tf in Counter(tokens).items():
                self.postings.setdefault(term, []).append((i, tf))
        n = len(self.documents)
        self.avgdl = (sum(self.doc_len) / n) if n else 0.0
        self.idf = {
            term: math.log(1.0 + (n - len(p) + 0.5) / (len(p) + 0.5))
            for term, p in self.postings.items()
        }

    def __len__(self) -> int:
        return len(self.documents)

    def scores(self, query: str) -> dict[int, float]:
        """BM25 score of every document that shares at least one term with ``query``."""
        out: dict[int, float] = {}
        avgdl = self.avgdl or 1.0
        for term in tokenize(query):
            postings = self.postings.get(term)
            if not postings:
                continue
            idf = self.idf[term]
            for i, tf in postings:
                norm = tf + self.k1 * (1.0 - self.b + self.b * self.doc_len[i] / avgdl)
                out[i] = out.get(i, 0.0) + idf * tf * (self.k1 + 1.0) / norm
        return out

    def search(self, query: str, k: int = 5) -> list[tuple[Document, float]]:
        """The top ``k`` documents with a positive score, best first (ties: corpus order)."""
        scored = sorted(self.scores(query).items(), key=lambda kv: (-kv[1], kv[0]))
        return [(self.documents[i], s) for i, s in scored[:k] if s > 0.0]


def snippet(text: str, query: str, max_chars: int = 300) -> str:
    """The ``max_chars`` window of ``text`` with the most query-term occurrences."""
    if len(text) <= max_chars:
        return text
    terms = set(tokenize(query))
    hits = [m.start() for m in _TOKEN.finditer(text) if m.group(0).casefold() in terms]
    if not hits:
        return text[:max_chars].rstrip() + " ..."
    best_start, best_count = hits[0], 0
    j = 0
    for i, start in enumerate(hits):
        while j < len(hits) and hits[j] < start + max_chars:
            j += 1
        if j - i > best_count:
            best_start, best_count = start, j - i
    # Start a little before the first hit so it reads in context.
    begin = max(0, min(best_start - max_chars // 5, len(text) - max_chars))
    window = text[begin : begin + max_chars].strip()
    prefix = "... " if begin > 0 else ""
    suffix = " ..." if begin + max_chars < len(text) else ""
    return prefix + window + suffix


class SearchTool(Tool):
    """``search(query, k)``: BM25 over a local JSONL corpus, returning the top-k snippets.

    The corpus is loaded and indexed at construction (so a bad path fails at start-up, not in
    the middle of training) and shared, read-only, by every episode.

    Args:
        corpus_path: A JSONL file of ``{"id", "title", "text"}`` objects.
        documents: Documents to index instead of a file (exactly one of the two).
        top_k: Results returned when the model does not ask for a number.
        max_k: Most results one call may ask for.
        snippet_chars: Characters of text shown per result.
        k1: BM25 term-frequency saturation.
        b: BM25 length normalization.
        name: Tool name the model sees.
    """

    description = (
        "Search a local document collection. Returns the most relevant documents, best first, "
        "each with its title, id and a snippet of its text."
    )

    def __init__(
        self,
        corpus_path: str | Path | None = None,
        *,
        documents: Iterable[Document | dict[str, Any]] | None = None,
        top_k: int = 3,
        max_k: int = 10,
        snippet_chars: int = 300,
        k1: float = 1.5,
        b: float = 0.75,
        name: str = "search",
    ) -> None:
        if (corpus_path is None) == (documents is None):
            raise ValueError("SearchTool needs exactly one of corpus_path or documents")
        if not 1 <= top_k <= max_k:
            raise ValueError(
                f"SearchTool needs 1 <= top_k <= max_k, got top_k={top_k}, max_k={max_k}"
            )
        if corpus_path is not None:
            docs = load_corpus(corpus_path)
        else:
            assert documents is not None
            docs = [
                d if isinstance(d, Document) else _document(d, f"documents[{i}]")
                for i, d in enumerate(documents)
            ]
        self.name = name
        self.index = BM25Index(docs, k1=k1, b=b)
        self.top_k = top_k
        self.max_k = max_k
        self.snippet_chars = snippet_chars
        self._args: type[BaseModel] = self._arguments_model()
        self.parameters = clean_schema(self._args)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_args")  # a dynamic pydantic model does not pickle; rebuilt on load
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
        self._args = self._arguments_model()

    def _arguments_model(self) -> type[BaseModel]:
        return create_model(
            f"{self.name}_arguments",
            __config__=ConfigDict(extra="forbid"),
            query=(str, Field(description="What to look for (keywords or a question).")),
            k=(
                int,
                Field(
                    self.top_k,
                    ge=1,
                    le=self.max_k,
                    description=f"How many results to return (1-{self.max_k}).",
                ),
            ),
        )

    def validate_arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """``{"query", "k"}`` checked by the arguments model (``k`` bounded by ``max_k``)."""
        model = self._args.model_validate(arguments)
        return {"query": getattr(model, "query"), "k": getattr(model, "k")}  # noqa: B009 (dynamic model)

    def search(self, query: str, k: int | None = None) -> list[tuple[Document, float]]:
        """The top ``k`` (default ``top_k``) documents for ``query``."""
        return self.index.search(query, k or self.top_k)

    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        """The top ``k`` documents for the query, numbered, with titles and scores."""
        query: str = arguments["query"]
        k: int = arguments.get("k", self.top_k)
        if not tokenize(query):
            return ToolResult(content="error: the query has no words to search for", error=True)
        hits = self.search(query, k)
        if not hits:
            return ToolResult(content=f"no results for {query!r}", metrics={"hits": 0.0})
        blocks = []
        for rank, (doc, score) in enumerate(hits, start=1):
            title = doc.title or "(untitled)"
            body = snippet(doc.text, query, self.snippet_chars)
            blocks.append(f"[{rank}] {title} (id: {doc.id}, score: {score:.2f})\n{body}")
        return ToolResult(content="\n\n".join(blocks), metrics={"hits": float(len(hits))})
