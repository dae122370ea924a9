"""A small real-text corpus in three domains (code, technical prose, narrative), shipped in data/corpus.

Every document is long enough for SmolLM2's 8192-token context. Sources and licences are in
``data/corpus/SOURCES.md``; ``data/corpus/build_corpus.py`` rebuilds the files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CORPUS_DIR = Path(__file__).resolve().parents[2] / "data" / "corpus"
DOMAINS = ("code", "prose", "narrative")


@dataclass(frozen=True)
class Document:
    """One corpus document: ``name`` (file stem), ``domain`` and its text."""

    name: str
    domain: str
    path: Path

    @property
    def text(self) -> str:
        return self.path.read_text(encoding="utf-8")


def documents(domain: str | None = None, root: Path | None = None) -> list[Document]:
    """All documents (sorted by domain, then name), or those of one ``domain``."""
    root = CORPUS_DIR if root is None else Path(root)
    if domain is not None and domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    if not root.is_dir():
        raise FileNotFoundError(f"corpus directory {root} is missing")
    out = []
    for dom in DOMAINS if domain is None else (domain,):
        for p in sorted((root / dom).glob("*.txt")):
            out.append(Document(p.name.split(".")[0], dom, p))
    return out


def document(name: str) -> Document:
    """The document called ``name``."""
    docs = {d.name: d for d in documents()}
    if name not in docs:
        raise ValueError(f"unknown document {name!r}; available: {', '.join(docs)}")
    return docs[name]


def token_ids(doc: Document | str, tokenizer: Any, max_len: int = 8192, *, bos: bool = False) -> torch.Tensor:
    """int64 ``[n]`` token ids of the document's first ``max_len`` tokens (``n <= max_len``)."""
    if isinstance(doc, str):
        doc = document(doc)
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    ids = tokenizer(doc.text, add_special_tokens=False)["input_ids"]
    if bos and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    return torch.tensor(ids[:max_len], dtype=torch.int64)


def sequences(tokenizer: Any, length: int, domain: str | None = None, per_domain: int | None = None) -> list[
        tuple[Document, torch.Tensor]]:
    """``(document, ids [length])`` for every document (or ``per_domain`` of each domain) long enough."""
    out = []
    for dom in DOMAINS if domain is None else (domain,):
        docs = documents(dom)[: per_domain]
        for d in docs:
            ids = token_ids(d, tokenizer, length)
            if ids.numel() < length:
                raise ValueError(f"document {d.name!r} has only {ids.numel()} tokens, fewer than length={length}")
            out.append((d, ids))
    return out
