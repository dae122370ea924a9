"""Where a notebook's source and its executions live, and what code a notebook runs.

A notebook's source is a MyST markdown file (``notebooks/<chapter>/<name>.md``, jupytext's ``md:myst``); its
executions are ``book/executed/<profile>/<name>.ipynb``. The runner (:mod:`kvlib.publish.runner`) and the cache
keys (:mod:`kvlib.publish.cache`) both read them through this module.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat

from kvlib.publish.provenance import repo_root
from kvlib.publish.registry import NotebookEntry

#: jupytext's name for the sources' format
SOURCE_FORMAT = "md:myst"


def executed_path(name: str, profile: str) -> Path:
    """Where the executed notebook of ``name`` at ``profile`` is kept (``$KVLIB_EXECUTED_DIR`` overrides)."""
    override = os.environ.get("KVLIB_EXECUTED_DIR")
    base = Path(override) if override else repo_root() / "book" / "executed"
    return base / profile / f"{name}.ipynb"


def source_path(entry: NotebookEntry) -> Path:
    """The entry's MyST source, absolute; a missing file or another format is an error."""
    path = Path(entry.path) if Path(entry.path).is_absolute() else repo_root() / entry.path
    if path.suffix != ".md":
        raise ValueError(f"notebook {entry.name!r}: path must be a MyST markdown source (.md), got {entry.path!r}")
    if not path.exists():
        raise FileNotFoundError(f"notebook {entry.name!r}: {entry.path} does not exist")
    return path


def load_source(path: str | Path) -> nbformat.NotebookNode:
    """The notebook a MyST source stands for, with stable cell ids (``<stem>-<index>``), so that two runs
    of unchanged code give notebooks that differ only in their outputs."""
    import jupytext

    path = Path(path)
    nb = jupytext.read(path, fmt=SOURCE_FORMAT)
    # The executed notebook is not a jupytext pair of the source; without this key Jupyter treats it as plain.
    nb.metadata.pop("jupytext", None)
    nb.metadata.setdefault("language_info", {"name": "python"})
    stem = re.sub(r"[^A-Za-z0-9_-]", "-", path.stem)[:56]
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{stem}-{i:03d}"
    nbformat.validate(nb)
    return nb


def code_cells(nb: nbformat.NotebookNode) -> list[str]:
    """The code a notebook runs, cell by cell: papermill's injected parameters cell left out, and trailing
    whitespace at the end of a cell ignored (a MyST source cannot carry it)."""
    return [c.source.rstrip() for c in nb.cells
            if c.cell_type == "code" and "injected-parameters" not in c.metadata.get("tags", [])]


def stale_cells(source: nbformat.NotebookNode, executed: nbformat.NotebookNode) -> list[str]:
    """Where ``executed`` did not run ``source``'s current code: one line per differing cell (empty: it did)."""
    want, ran = code_cells(source), code_cells(executed)
    out = [f"code cell {i}: source and executed run differ" for i, (a, b) in enumerate(zip(want, ran)) if a != b]
    if len(want) != len(ran):
        out.append(f"the source has {len(want)} code cells, the executed run {len(ran)}")
    return out


def shown(path: Path) -> str:
    """``path`` relative to the repository root where it lies inside it (as messages show it)."""
    try:
        return str(path.relative_to(repo_root()))
    except ValueError:
        return str(path)
