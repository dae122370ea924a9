"""The one registry of chapters and notebooks: ``notebooks/registry.yml``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlib.publish.provenance import PROFILES, repo_root

REGISTRY = "notebooks/registry.yml"


@dataclass(frozen=True)
class NotebookEntry:
    name: str
    path: str
    chapter: str
    title: str
    profiles: dict[str, dict[str, Any]]
    needs_gpu: bool = False

    def params(self, profile: str) -> dict[str, Any] | None:
        """Parameters for ``profile`` (``None``: the notebook does not run at that profile)."""
        if profile not in self.profiles:
            return None
        return dict(self.profiles[profile] or {}, profile=profile)


@dataclass(frozen=True)
class Chapter:
    id: str
    title: str
    pages: list[str] = field(default_factory=list)
    notebooks: list[NotebookEntry] = field(default_factory=list)
    #: the chapter's story, shown on its index page above the claims table (``book/<id>/story.md``)
    story: str | None = None
    #: the chapter's question in one sentence, and the claim id the landing page shows for it (no numbers here:
    #: those come from the result files)
    question: str | None = None
    headline: str | None = None


def load_registry(path: Path | None = None) -> list[Chapter]:
    import yaml

    path = path or repo_root() / REGISTRY
    doc = yaml.safe_load(Path(path).read_text()) or {}
    chapters = []
    seen: set[str] = set()
    for ch in doc.get("chapters", []):
        nbs = []
        for nb in ch.get("notebooks", []):
            if nb["name"] in seen:
                raise ValueError(f"{path}: notebook name {nb['name']!r} appears twice")
            seen.add(nb["name"])
            profiles = nb.get("profiles") or {}
            bad = set(profiles) - set(PROFILES)
            if bad:
                raise ValueError(f"{path}: notebook {nb['name']!r} names unknown profiles {sorted(bad)}")
            nbs.append(
                NotebookEntry(
                    name=nb["name"],
                    path=nb["path"],
                    chapter=ch["id"],
                    title=nb.get("title", nb["name"]),
                    profiles=profiles,
                    needs_gpu=bool(nb.get("needs_gpu", False)),
                )
            )
        chapters.append(Chapter(id=ch["id"], title=ch["title"], pages=list(ch.get("pages", [])), notebooks=nbs,
                                story=ch.get("story"), question=ch.get("question"), headline=ch.get("headline")))
    return chapters


def all_notebooks(chapters: list[Chapter] | None = None) -> list[NotebookEntry]:
    return [nb for ch in (chapters or load_registry()) for nb in ch.notebooks]
