"""MyST list-tables: the one table markup the register, the chapter pages and the notebooks' claims tables share."""

from __future__ import annotations

import re

_LIST_MARKER = re.compile(r"^([-*+]|\d+[.)])(\s|$)")


def _cell(text: str) -> str:
    """Inline text for a list-table cell: one line, and nothing a list item would read as a marker of its own."""
    text = " ".join(str(text).split())
    return _LIST_MARKER.sub(lambda m: m.group(1)[:-1] + "\\" + m.group(1)[-1] + m.group(2), text, count=1)


def list_table(rows: list[list[str]], header: list[str], widths: list[int], cls: str = "claims-table",
               caption: str = "") -> str:
    """A MyST ``list-table``: cells are parsed as MyST inline text, so ``$...$`` typesets (a pipe table would
    split a formula's ``|x|`` into cells). ``caption`` becomes the table's ``<caption>``."""
    out = [f":::{{list-table}} {_cell(caption)}".rstrip(),
           ":header-rows: 1", f":class: {cls}", f":widths: {' '.join(map(str, widths))}", ""]
    for r in [header, *rows]:
        out.append(f"* - {_cell(r[0]) or '&nbsp;'}")
        out += [f"  - {_cell(c) or '&nbsp;'}" for c in r[1:]]
    out.append(":::")
    return "\n".join(out) + "\n"
