"""Issue 13 item 8: the lookup corpus is indexed once, on arrival, one document per path."""

from __future__ import annotations

import pytest


@pytest.fixture
def engine(tiny_model_dir):
    from engine import Engine

    e = Engine(str(tiny_model_dir), prefix_cache=False, mode="lookup")
    yield e
    e.close()


def test_corpus_is_indexed_once_not_per_request(engine, monkeypatch):
    from engine import GenerationRequest
    from engine.drafting import lookup

    doc = list(range(5, 600))
    engine.add_corpus(doc, path="big.py")
    indexed = []
    real_extend = lookup.TokenIndex.extend
    monkeypatch.setattr(lookup.TokenIndex, "extend", lambda self, toks: (indexed.append(len(toks)), real_extend(self, toks))[1])
    for _ in range(2):
        engine.submit(GenerationRequest(prompt_ids=[1, 2, 3], max_tokens=4)).result()
    assert sum(indexed) < len(doc)  # each request indexes its own context, not the corpus again


def test_one_document_per_path_replaced_on_change(engine):
    from engine import GenerationRequest

    engine.add_corpus([7, 8, 9, 10, 11, 12], path="a.py")
    engine.add_corpus([7, 8, 9, 20, 21, 22], path="a.py")  # the file was edited
    engine.add_corpus([30, 31, 32], path="b.py")
    assert engine.info()["corpus_docs"] == 2
    engine.add_corpus([40, 41, 42])  # no path: each text is its own document, once
    engine.add_corpus([40, 41, 42])
    assert engine.info()["corpus_docs"] == 3
    # drafts come from the current text of a.py only
    done = engine.submit(GenerationRequest(prompt_ids=[7, 8, 9], max_tokens=3, max_draft=3)).result()
    assert done.stats.rounds >= 1


def test_http_corpus_route_keys_on_path(engine):
    from starlette.testclient import TestClient

    from agent_bridge.app import create_app

    client = TestClient(create_app(engine))
    for text in ("def f():\n    return 1\n", "def f():\n    return 2\n", "def f():\n    return 3\n"):
        r = client.post("/v1/corpus", json={"text": text, "path": "src/f.py"})
        assert r.status_code == 200, r.text
    assert engine.info()["corpus_docs"] == 1
