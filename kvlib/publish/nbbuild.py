"""Tiny helpers for the chapters' ``make_notebooks.py`` scripts: build cells, write a notebook.

The notebooks are kept as Python code so their cells stay reviewable in diffs; these helpers make
every chapter build its cells the same way and make regeneration deterministic (stable cell ids,
fixed metadata), so rerunning a script on unchanged code leaves the ``.ipynb`` unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

__all__ = ["code", "md", "params", "write"]

KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def md(text: str) -> nbformat.NotebookNode:
    """A markdown cell (surrounding blank lines stripped)."""
    return new_markdown_cell(text.strip())


def code(src: str, *, tags: Iterable[str] = (), hide_input: bool = False) -> nbformat.NotebookNode:
    """A code cell with optional cell tags; ``hide_input`` adds the book's ``hide-input`` tag."""
    tags = list(tags)
    if hide_input and "hide-input" not in tags:
        tags.append("hide-input")
    return new_code_cell(src.strip(), metadata={"tags": tags} if tags else {})


def params(src: str) -> nbformat.NotebookNode:
    """The cell tagged ``parameters`` that papermill overrides per profile."""
    return code(src, tags=["parameters"])


def _cell_id(name: str, index: int) -> str:
    """A stable cell id from the notebook name and the cell index (nbformat: [A-Za-z0-9-_], <= 64)."""
    stem = re.sub(r"[^A-Za-z0-9_-]", "-", name)[:56]
    return f"{stem}-{index:03d}"


def write(cells: Sequence[nbformat.NotebookNode], path: str | Path) -> Path:
    """Write ``cells`` as a python3 notebook at ``path`` with stable cell ids; returns the path."""
    path = Path(path)
    if path.suffix != ".ipynb":
        raise ValueError(f"path must end in .ipynb, got {str(path)!r}")
    nb = new_notebook(cells=list(cells))
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = _cell_id(path.stem, i)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return path
