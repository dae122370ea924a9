"""What a notebook calls: glue numbers and figures, record claims, save the result file."""

from __future__ import annotations

import datetime as _dt
import math
import os
from typing import Any

from kvlib.publish.provenance import PROFILES, provenance, repo_root, save_result
from kvlib.publish.verdicts import VERDICTS, judge, validate

__all__ = ["VERDICTS", "Run", "fmt", "load_claims"]


def _glue(key: str, value: Any) -> None:
    # myst_nb is only present where the book is built; elsewhere glue is a no-op beside the record.
    try:
        from myst_nb import glue
    except ImportError:
        return
    glue(key, value, display=False)


def _inline_figures() -> None:
    # Figures must carry image/png in the notebook; a non-inline backend (e.g. MPLBACKEND=Agg
    # inherited from CI) would leave only "<Figure ...>" text for the book to show.
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is not None and hasattr(ip, "run_line_magic"):
        ip.run_line_magic("matplotlib", "inline")


def load_claims(chapter: str | None = None) -> dict[str, dict[str, Any]]:
    """The paper side of every claim: ``data/claims/<chapter>.yml`` merged into ``{id: entry}``."""
    import yaml

    out: dict[str, dict[str, Any]] = {}
    folder = repo_root() / "data" / "claims"
    files = [folder / f"{chapter}.yml"] if chapter else sorted(folder.glob("*.yml"))
    for f in files:
        if not f.exists():
            continue
        doc = yaml.safe_load(f.read_text()) or {}
        for c in doc.get("claims", []):
            c = dict(c, chapter=doc.get("chapter", f.stem))
            if c["id"] in out:
                raise ValueError(f"claim id {c['id']!r} appears twice (in {f.name})")
            if "rule" not in c:
                raise ValueError(f"claim {c['id']!r} in {f.name} has no field 'rule' (what counts as reproduced)")
            c["rule"] = validate(c["rule"], c["id"])
            out[c["id"]] = c
    return out


def _plain(x: Any) -> Any:
    """The measurement as JSON can hold it (numpy scalars and tuples unwrapped)."""
    if hasattr(x, "item") and getattr(x, "ndim", 0) == 0:
        return x.item()
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    return x


class Run:
    """One notebook execution: parameters, glued values, claims, and the result file."""

    def __init__(self, name: str, *, profile: str, params: dict[str, Any] | None = None) -> None:
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
        # the runner names the profile it executes at: a notebook parameter cannot reroute a run's results into
        # another profile's files (a ci-sized run saved as the committed cpu result)
        ran_at = os.environ.get("KVLIB_PROFILE")
        if ran_at and ran_at != profile:
            raise ValueError(f"profile={profile!r}: this notebook is being executed at the {ran_at!r} profile; its "
                             f"results go to data/results/{ran_at} (run with --profile {profile} instead)")
        self.name = name
        self.profile = profile
        self.params = dict(params or {})
        self.started = _dt.datetime.now(_dt.UTC)
        self.values: dict[str, Any] = {}
        self.claims: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        _inline_figures()

    # -- numbers and figures --------------------------------------------------------------
    def glue(self, key: str, value: Any) -> Any:
        """Record ``value`` in the result file and glue it for the book's prose."""
        if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
            value = value.item()
        if key in self.values:
            # The book would warn (and the strict build fail) on a key glued twice.
            raise ValueError(f"glue key {key!r} is glued twice in {self.name}")
        self.values[key] = value
        _glue(key, value)
        return value

    def glue_fig(self, key: str, fig: Any) -> None:
        """Glue a matplotlib figure; it is shown where a ``{glue:figure}`` directive places it."""
        _glue(key, fig)
        self.values.setdefault("_figures", []).append(key)
        # Closed, so the inline backend does not show it a second time at the end of the cell.
        import matplotlib.pyplot as plt

        plt.close(fig)

    def record(self, key: str, value: Any) -> None:
        """Keep a larger structure (arrays, tables) in the result file without gluing it."""
        self.extra[key] = value

    # -- claims -----------------------------------------------------------------------------
    def claim(self, claim_id: str, *, ours: str, measured: Any = None, n: int | None = None, why: str = "",
              **removed: Any) -> None:
        """Our side of a paper claim listed in ``data/claims/*.yml``.

        The verdict is not ours to choose: :func:`kvlib.publish.verdicts.decide` turns ``measured`` (and the
        sample size ``n``) into it under the claim's declared ``rule``. ``why`` is a note on the setting, shown
        after the rule's reason. ``measured=None`` records "not reproducible here" (nothing measured).
        """
        if "verdict" in removed:
            raise TypeError(f"claim {claim_id!r}: verdict= is removed; pass measured= (data/claims' rule decides)")
        if removed:
            raise TypeError(f"claim {claim_id!r}: unexpected argument(s) {sorted(removed)}")
        j = judge(claim_id, ours=ours, measured=measured, n=n, note=why)
        self.claims = [c for c in self.claims if c["id"] != claim_id]
        self.claims.append({"id": claim_id, "ours": ours, "verdict": j["verdict"], "why": j["why"],
                            "rule": j["rule"], "measured": _plain(measured), "n": n})

    def claims_frame(self):
        import pandas as pd

        known = load_claims()
        rows = []
        for c in self.claims:
            p = known[c["id"]]
            rows.append(
                {
                    "claim": f"{p['paper']} {p.get('where', '')}".strip(),
                    "statement": p["statement"],
                    "paper": f"{p['paper_value']}" + (f" ({p['setting']})" if p.get("setting") else ""),
                    "ours": c["ours"],
                    "rule": c.get("rule", ""),
                    "verdict": c["verdict"] + (f": {c['why']}" if c["why"] else ""),
                }
            )
        return pd.DataFrame(rows, columns=["claim", "statement", "paper", "ours", "rule", "verdict"])

    def claims_table(self) -> None:
        """Display the paper-vs-ours table, with where these numbers came from."""
        from IPython.display import Markdown, display

        from kvlib.publish.provenance import SOURCES

        prov = provenance(self.params, self.started)
        dev = prov["device"].get("device", "cpu")
        text = (f"*This run:* profile `{self.profile}`, device `{dev}`, commit `{prov['commit']}`, "
                f"started {prov['started']}, parameters `{self.params}`.")
        if SOURCES:
            # a page that renders committed measurements says where those were made, not only where it ran
            by = {}
            for path, (d, c) in sorted(SOURCES.items()):
                by.setdefault((d, c), []).append(path)
            text += " *Measurements rendered:* " + "; ".join(
                f"{', '.join(f'`{p}`' for p in paths[:3])}{f' (+{len(paths) - 3} more)' if len(paths) > 3 else ''}"
                f" on {d} at commit `{c}`" for (d, c), paths in by.items()) + "."
        display(Markdown(text))
        df = self.claims_frame()
        if df.empty:
            display(Markdown("*No paper claim is addressed in this section.*"))
            return
        # A MyST list-table (the book parses displayed Markdown as MyST): it carries a caption, and its cells are
        # MyST inline text, so a statement's ``$...$`` typesets where a pipe table would split ``|x|`` into cells.
        from kvlib.publish.assemble import list_table

        caption = (f"Paper vs this run: {len(df)} claim{'s' if len(df) != 1 else ''} of this page, the paper's "
                   f"figure beside ours from this run ({self.profile} profile, {dev}); the rule decides the verdict.")
        rows = [[str(v) if v is not None else "n/a" for v in r] for r in df.itertuples(index=False)]
        display(Markdown(list_table(rows, list(df.columns), [14, 26, 14, 18, 10, 18], caption=caption)))

    # -- saving -------------------------------------------------------------------------------
    def save(self, overwrite: bool = False) -> None:
        """Write ``data/results/<profile>/<name>.json`` atomically, with provenance."""
        payload = {"values": self.values, "claims": self.claims, "extra": self.extra}
        path = save_result(self.name, self.profile, payload, self.params, self.started, overwrite=overwrite)
        try:
            shown = path.relative_to(repo_root())
        except ValueError:
            shown = path
        print(f"results: {shown}")


def fmt(x: float, digits: int = 3) -> str:
    """Short human formatting for table cells (significant digits, keeps 0 and inf readable)."""
    if isinstance(x, (int,)) and not isinstance(x, bool):
        return f"{x:,}"
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{digits}g}"
