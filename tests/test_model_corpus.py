"""The shipped three-domain corpus and its loader."""

from __future__ import annotations

import pytest

from kvlib.analysis import corpus
from kvlib.hf import model as kvmodel


def test_three_domains_three_documents_each() -> None:
    docs = corpus.documents()
    assert {d.domain for d in docs} == set(corpus.DOMAINS)
    for dom in corpus.DOMAINS:
        assert len(corpus.documents(dom)) >= 3
    total = sum(d.path.stat().st_size for d in docs)
    assert total < 2_000_000
    assert (corpus.CORPUS_DIR / "SOURCES.md").read_text().count("|") > 20
    for d in docs:
        assert d.name in (corpus.CORPUS_DIR / "SOURCES.md").read_text()
        assert len(d.text) > 30_000


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="domain"):
        corpus.documents("poetry")
    with pytest.raises(ValueError, match="unknown document"):
        corpus.document("nope")


@pytest.mark.skipif(not kvmodel.model_available(), reason=f"SmolLM2 GGUF absent; {kvmodel.install_command()}")
def test_every_document_fills_the_context() -> None:
    _, tok = kvmodel.load_model()
    for d in corpus.documents():
        ids = corpus.token_ids(d, tok, 8192)
        assert ids.shape == (8192,), d.name
    seqs = corpus.sequences(tok, 64, per_domain=1)
    assert [d.domain for d, _ in seqs] == list(corpus.DOMAINS)
    assert all(ids.shape == (64,) for _, ids in seqs)
    with pytest.raises(ValueError, match="max_len"):
        corpus.token_ids("argparse", tok, 0)
