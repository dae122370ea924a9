"""Rebuild data/corpus/ from material the OS and Python ship (see SOURCES.md). Run from the repo root.

code:      Python 3.11 standard-library modules (PSF License), first ~45 kB of each.
prose:     Python 3.11 reference documentation as shipped in ``pydoc_data.topics`` (PSF License).
narrative: King James Version narrative books (public domain text) decoded with the Debian
           ``bible-kjv`` package's ``bible`` program from ``bible-kjv-text`` (both .debs extracted, not installed):
           ``apt-get download bible-kjv bible-kjv-text && dpkg-deb -x <deb> /tmp/kjv`` for each.
"""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from pathlib import Path

OUT = Path(__file__).resolve().parent
TARGET = 45_000  # characters per document: >= 8192 SmolLM2 tokens for code and prose, ~10k for KJV
KJV = Path("/tmp/kjv")

CODE = ["argparse.py", "dataclasses.py", "textwrap.py", "shlex.py", "configparser.py"]
PROSE = [["specialnames"], ["compound", "execmodel", "naming"], ["types", "typesseq", "string-methods"]]
NARRATIVE = {
    "joseph": ["Ge37:1-Ge50:26"],
    "ruth_esther": ["Ru1:1-Ru4:22", "Es1:1-Es10:3", "Jon1:1-Jon4:11"],
    "david": ["1Sa16:1-1Sa31:13"],
}


def _cut(text: str, n: int = TARGET) -> str:
    """At most ``n`` characters, cut at a line end."""
    if len(text) <= n:
        return text
    return text[: text.rfind("\n", 0, n) + 1]


def build_code() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / f for f in CODE]
    docs = [("argparse", files[0].read_text()), ("dataclasses", files[1].read_text()),
            ("text_utils", "".join(f.read_text() for f in files[2:]))]
    for name, text in docs:
        (OUT / "code" / f"{name}.py.txt").write_text(_cut(text))


def build_prose() -> None:
    from pydoc_data import topics

    for keys in PROSE:
        text = "\n\n".join(topics.topics[k] for k in keys)
        (OUT / "prose" / f"pyref_{keys[0].replace('-', '_')}.txt").write_text(_cut(text))


def build_narrative() -> None:
    exe = KJV / "usr/bin/bible"
    if not exe.exists():
        sys.exit(f"{exe} missing: extract the bible-kjv and bible-kjv-text .debs into {KJV} first")
    for name, specs in NARRATIVE.items():
        parts = []
        for spec in specs:
            raw = subprocess.run([str(exe), "-p", str(KJV / "usr/lib"), "-l1000", spec], check=True,
                                 capture_output=True, text=True).stdout
            # output: a "Book N" header per chapter, then "  V text" per verse; one paragraph per
            # chapter, verse numbers dropped
            chapters: list[list[str]] = []
            for line in raw.splitlines():
                verse = re.match(r"^\s+\d+ (.*)$", line)
                if verse and chapters:
                    chapters[-1].append(verse.group(1).strip())
                elif line.strip():
                    chapters.append([])
            parts += [" ".join(v) for v in chapters if v]
        (OUT / "narrative" / f"kjv_{name}.txt").write_text(_cut("\n\n".join(parts) + "\n"))


if __name__ == "__main__":
    for d in ("code", "prose", "narrative"):
        (OUT / d).mkdir(exist_ok=True)
    build_code()
    build_prose()
    build_narrative()
