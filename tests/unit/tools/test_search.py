"""BM25 search over a JSONL corpus: exact scores, ranking, snippets, corpus errors."""

from __future__ import annotations

import json
import math

import pytest

from tools import ToolSet
from tools.search import (
    BM25Index,
    CorpusError,
    Document,
    SearchTool,
    load_corpus,
    snippet,
    tokenize,
)


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_tokenize_is_documented_behaviour():
    assert tokenize("Hello, World-2! snake_case ÉCOLE ﬁne") == [
        "hello",
        "world",
        "2",
        "snake",
        "case",
        "école",
        "fine",  # NFKC folds the ligature
    ]


def test_bm25_scores_match_the_formula_by_hand():
    docs = [
        Document("0", "", "apple banana"),
        Document("1", "", "apple apple cherry"),
        Document("2", "", "durian"),
    ]
    index = BM25Index(docs)
    # N = 3, avgdl = 2, df(apple) = 2 -> idf = ln(1 + 1.5 / 2.5)
    idf = math.log(1.6)
    scores = index.scores("apple")
    assert scores[0] == pytest.approx(idf * 1 * 2.5 / (1 + 1.5 * (0.25 + 0.75 * 2 / 2)))
    assert scores[1] == pytest.approx(idf * 2 * 2.5 / (2 + 1.5 * (0.25 + 0.75 * 3 / 2)))
    assert 2 not in scores
    # a rarer term outweighs a common one; repeated query terms count per repetition
    assert index.scores("durian")[2] == pytest.approx(
        math.log(1 + 2.5 / 1.5) * 2.5 / (1 + 1.5 * (0.25 + 0.75 * 1 / 2))
    )
    assert index.scores("apple apple")[0] == pytest.approx(2 * scores[0])
    assert [d.id for d, _ in index.search("apple", k=5)] == ["1", "0"]
    assert index.search("nothing here", k=5) == []


def test_title_is_indexed_and_ties_keep_corpus_order():
    docs = [
        Document("a", "Paris", "capital"),
        Document("b", "Lyon", "city"),
        Document("c", "", "x"),
    ]
    index = BM25Index(docs)
    assert [d.id for d, _ in index.search("paris")] == ["a"]
    same = BM25Index([Document("x", "", "cat"), Document("y", "", "cat")])
    assert [d.id for d, _ in same.search("cat")] == ["x", "y"]


def test_snippet_centres_on_the_query_terms():
    text = "filler " * 100 + "the quokka is a small marsupial " + "filler " * 100
    s = snippet(text, "quokka marsupial", max_chars=60)
    assert "quokka" in s and "marsupial" in s
    assert s.startswith("... ") and s.endswith(" ...")
    assert snippet("short text", "x", 60) == "short text"


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"id": 1, "text": "a"}', "{not json"], r"c\.jsonl:2: not valid JSON"),
        (['{"id": 1, "text": "a"}', "", '{"text": "b"}'], r"c\.jsonl:3: missing field 'id'"),
        (['{"id": 1}'], r"c\.jsonl:1: missing field 'text'"),
        (['{"id": 1, "text": 5}'], r"c\.jsonl:1: field 'text' must be a string"),
        (['{"id": [1], "text": "a"}'], r"c\.jsonl:1: field 'id' must be a string or an integer"),
        (["[1, 2]"], r"c\.jsonl:1: expected a JSON object"),
        (
            ['{"id": 1, "text": "a"}', '{"id": "1", "text": "b"}'],
            r"c\.jsonl:2: id '1' repeats the id on line 1",
        ),
        ([""], "holds no documents"),
    ],
)
def test_corpus_errors_name_file_and_line(tmp_path, lines, message):
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CorpusError, match=message):
        load_corpus(path)


def test_missing_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(CorpusError, match=r"does not exist.*JSONL"):
        SearchTool(tmp_path / "nope.jsonl")


async def test_search_tool_end_to_end(tmp_path):
    corpus = _write(
        tmp_path / "wiki.jsonl",
        [
            {"id": "p1", "title": "Paris", "text": "Paris is the capital of France."},
            {"id": "b1", "title": "Berlin", "text": "Berlin is the capital of Germany."},
            {
                "id": "m1",
                "title": "Mont Blanc",
                "text": "Mont Blanc is the highest mountain in the Alps.",
            },
        ],
    )
    search = SearchTool(corpus, top_k=2)
    ts = ToolSet([search])
    async with ts.episode() as ep:
        r = await ep.call("search", {"query": "capital of France"})
        one = await ep.call("search", {"query": "capital", "k": 1})
        none = await ep.call("search", {"query": "volcano"})
        empty = await ep.call("search", {"query": "?!"})
        too_many = await ep.call("search", {"query": "capital", "k": 99})
    lines = r.content.splitlines()
    assert lines[0].startswith("[1] Paris (id: p1, score: ")
    assert lines[1] == "Paris is the capital of France."
    assert "[2] Berlin (id: b1" in r.content and "Mont Blanc" not in r.content
    assert one.content.count("[") == 1
    assert none.content == "no results for 'volcano'" and not none.error
    assert empty.error and "no words" in empty.content
    assert too_many.error and "k: Input should be less than or equal to 10" in too_many.content
    params = search.schema()["function"]["parameters"]
    assert params["required"] == ["query"]
    assert params["properties"]["k"]["maximum"] == 10
    assert ts.metrics()["tools/search/hits"] == pytest.approx((2 + 1 + 0) / 3)


def test_in_memory_documents_and_argument_checks():
    tool = SearchTool(documents=[{"id": 1, "title": None, "text": "hello world"}])
    assert [d.id for d, _ in tool.search("hello")] == ["1"]
    with pytest.raises(ValueError, match="exactly one"):
        SearchTool()
    with pytest.raises(ValueError, match="top_k"):
        SearchTool(documents=[], top_k=0)
