"""What a notebook calls: glue numbers and figures, record claims, save the result file."""

from __future__ import annotations

import datetime as _dt
import math
import os
from typing import Any

from kvlib.publish.provenance import PROFILES, provenance, save_result
from kvlib.publish.verdicts import CLAIM_FIELDS, PAPERS, VERDICTS, judge, load_claims  # noqa: F401 (re-exported)

__all__ = ["VERDICTS", "Run", "fmt", "load_claims"]


def _glue(key: str, value: Any) -> None:
    # myst_nb is only present where the book is built; elsewhere glue is a no-op beside the record. Outside a
    # running IPython shell there is nothing to glue into, and myst_nb's glue would create a bare InteractiveShell
    # singleton (IPython's format_display_data), which a later Run in the same process would then try to switch
    # to the inline backend.
    try:
        from IPython import get_ipython
        from myst_nb import glue
    except ImportError:
        return
    if get_ipython() is None:
        return
    glue(key, value, display=False)


def _inline_figures() -> None:
    # Figures must carry image/png in the notebook; a non-inline backend (e.g. MPLBACKEND=Agg
    # inherited from CI) would leave only "<Figure ...>" text for the book to show.
    try:
        from IPython import get_ipython
    except ImportError:
        return
    from IPython.core.interactiveshell import InteractiveShell

    ip = get_ipython()
    # only a shell with a front end (a kernel, a terminal) can switch backends: a bare InteractiveShell, which
    # IPython's display helpers create when called outside one, raises NotImplementedError from enable_gui
    if ip is not None and type(ip).enable_gui is not InteractiveShell.enable_gui:
        ip.run_line_magic("matplotlib", "inline")


def _plain(x: Any) -> Any:
    """The measurement as JSON can hold it (numpy scalars, tuples and mappings unwrapped)."""
    if hasattr(x, "item") and getattr(x, "ndim", 0) == 0:
        return x.item()
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
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
        from kvlib.publish.figures import apply_style

        apply_style()  # the book's palette, markers, line styles and text sizes

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
        """Glue a matplotlib figure; it is shown where a ``{glue:figure}`` directive places it (with its numbered
        caption). Text too small for the text column is enlarged and a legend over data moves outside its axes
        (:func:`kvlib.publish.figures.make_readable`); a figure that still would not read (two series that look
        alike) is refused."""
        from kvlib.publish.figures import figure_problems, make_readable

        make_readable(fig)
        problems = figure_problems(fig, f"figure {key!r} of {self.name}")
        if problems:
            raise ValueError("; ".join(problems))
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
              given: dict[str, Any] | None = None, **removed: Any) -> None:
        """Our side of a paper claim listed in ``data/claims/*.yml``.

        The verdict is not ours to choose: :func:`kvlib.publish.verdicts.decide` turns ``measured`` (and the
        sample size ``n``) into it under the claim's declared ``rule``. ``measured`` is the quantity the rule
        compares (a number, an interval, or for a rule of kind ``all`` a mapping from quantity to value), never a
        bare boolean. ``given``: the values the rule ``requires`` before it judges (e.g. the iterations every run
        reached). ``why`` is a note on the setting, shown after the rule's reason. ``measured=None`` records
        "not reproducible here" (nothing measured). The record keeps the rule's hash and the claims file's commit,
        so the build can refuse a verdict whose rule changed after it was measured.
        """
        if "verdict" in removed:
            raise TypeError(f"claim {claim_id!r}: verdict= is removed; pass measured= (data/claims' rule decides)")
        if removed:
            raise TypeError(f"claim {claim_id!r}: unexpected argument(s) {sorted(removed)}")
        j = judge(claim_id, ours=ours, measured=measured, n=n, note=why, device=_device_name(), given=given)
        self.claims = [c for c in self.claims if c["id"] != claim_id]
        self.claims.append({k: (_plain(v) if k in ("measured", "given") else v) for k, v in j.items() if k != "note"})

    def claims_frame(self):
        import pandas as pd

        known = load_claims()
        rows = [claim_cells(known[c["id"]], c) for c in _ordered(self.claims, known)]
        return pd.DataFrame(rows, columns=list(CLAIM_COLUMNS))

    def claims_table(self) -> None:
        """Display the paper-vs-ours table (claim; paper, with its setting; ours, with ours; verdict), then the
        rules and reasons in a fold, with where these numbers were measured."""
        from IPython.display import Markdown, display

        from kvlib.publish.provenance import SOURCES

        prov = provenance(self.params, self.started)
        dev = prov["device"].get("device", "cpu")
        def value(v: Any) -> str:  # a nested structure (a list of configurations) is in the parameters cell above
            nested = isinstance(v, dict) or (isinstance(v, (list, tuple)) and any(isinstance(x, dict) for x in v))
            if isinstance(v, bool):
                return "yes" if v else "no"
            return f"{len(v)} entries (see the parameters cell)" if nested else str(v)

        shown = ", ".join(f"{k} = {value(v)}" for k, v in self.params.items())
        text = (f"*This run:* profile `{self.profile}`, device `{dev}`, commit `{prov['commit']}`, "
                f"started {prov['started']}; parameters: {shown or 'none'}.")
        here = f"this run ({self.profile} profile, {dev})"
        where = [here]
        if SOURCES:
            # a page that renders committed measurements says where those were made, not only where it ran
            by: dict[tuple[str, str], list[str]] = {}
            for path, (d, c) in sorted(SOURCES.items()):
                by.setdefault((d, c), []).append(path)
            text += " *Measurements rendered:* " + "; ".join(
                f"{', '.join(f'`{p}`' for p in paths[:3])}{f' (+{len(paths) - 3} more)' if len(paths) > 3 else ''}"
                f" on {d} at commit `{c}`" for (d, c), paths in by.items()) + "."
            where = [f"committed measurements on {d}" for d in sorted({d for d, _ in by})] + [here]
        display(Markdown(text))
        if not self.claims:
            display(Markdown("*No paper claim is addressed in this section.*"))
            return
        from kvlib.publish.listtable import list_table

        known = load_claims()
        records = _ordered(self.claims, known)
        rows = [list(claim_cells(known[c["id"]], c).values()) for c in records]
        caption = (f"Paper vs this run: {len(rows)} claim{'s' if len(rows) != 1 else ''} of this page; ours from "
                   + " and ".join(where) + "; each row names both settings, and a declared rule decides the verdict.")
        display(Markdown(list_table(rows, list(CLAIM_COLUMNS), [34, 24, 28, 14], caption=caption)
                         + "\n" + reasons_fold(records, known)))

    # -- saving -------------------------------------------------------------------------------
    def save(self, overwrite: bool = False) -> None:
        """Write ``data/results/<profile>/<name>.json`` atomically, with provenance."""
        payload = {"values": self.values, "claims": self.claims, "extra": self.extra}
        # written quietly: the page a reader sees names its result file on "Where the numbers come from"
        save_result(self.name, self.profile, payload, self.params, self.started, overwrite=overwrite)


def fmt(x: float, digits: int = 3) -> str:
    """Short human formatting for table cells (significant digits, keeps 0 and inf readable)."""
    if isinstance(x, (int,)) and not isinstance(x, bool):
        return f"{x:,}"
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{digits}g}"


# -- the paper-vs-ours table (notebook pages; the chapter pages and the register use the same cells) -------------

CLAIM_COLUMNS = ("claim", "paper (setting)", "ours (setting)", "verdict")


def _device_name() -> str:
    from kvlib.publish.provenance import device_info

    d = device_info().get("device", "cpu")
    return "CPU" if d == "cpu" else d


def _ordered(records: list[dict[str, Any]], known: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Primary claims in their order, each followed by the context rows of this page beneath it."""
    ids = {c["id"] for c in records}
    out = []
    for c in records:
        parent = known.get(c["id"], {}).get("context_of")
        if parent in ids:
            continue  # placed under its primary
        out.append(c)
        out += [k for k in records if known.get(k["id"], {}).get("context_of") == c["id"]]
    return out


def claim_text(entry: dict[str, Any]) -> str:
    paper = {"witcert": "WitCert", "kv4rl": "KV4-RL"}.get(entry["paper"], entry["paper"])
    return f"**{entry['where']}** ({paper}): {entry['statement']}"


def claim_cells(entry: dict[str, Any], record: dict[str, Any] | None) -> dict[str, str]:
    """The four cells of a claim's row: claim; the paper's figure with its setting; ours with our setting (the
    record's, else the declared one); the verdict (a context row: the claim it is context for)."""
    from kvlib.publish.verdicts import label

    setting = (record or {}).get("setting") or entry["ours_setting"].replace("{device}", "the run's device")
    ours = f"{record['ours']}; *{setting}*" if record else f"*{setting}*"
    if "context_of" in entry:
        verdict = "*context*"
    elif record is None:
        verdict = "**pending**"
    else:
        verdict = "**" + label(record["verdict"], record.get("why", "")) + "**"
    return {"claim": ("↳ " if "context_of" in entry else "") + claim_text(entry),
            "paper (setting)": f"{entry['paper_value']}; *{entry['setting']}*",
            "ours (setting)": ours, "verdict": verdict}


def reasons_fold(records: list[dict[str, Any]], known: dict[str, dict[str, Any]], title: str = "Rules and reasons"
                 ) -> str:
    """A folded list: per claim, the rule that decides it, the reason for its verdict, and what it was judged
    under (the rule's hash, the claims file's commit at run time)."""
    from kvlib.publish.verdicts import label

    items = []
    for c in records:
        e = known.get(c["id"], {})
        if "context_of" in e:
            p = known.get(e["context_of"], {})
            head = (f"- **{e['where']}**, context for the claim of {p.get('where', e['context_of'])} "
                    f"(`{e['context_of']}`): {e.get('measure', '')}; no verdict of its own.")
        else:
            why = " ".join(str(c.get("why") or "").split())
            head = (f"- **{e.get('where', c['id'])}**, {label(c['verdict'], c.get('why', ''))}. "
                    f"Rule: {c.get('rule') or 'none recorded'}." + (f" Reason: {why}." if why else ""))
            if "rule" in e and "checked" in e["rule"]:
                head += f" Checked, not reproduced: {e['rule']['checked'].rstrip('.')}."
        h, cc = c.get("rule_sha256"), c.get("claims_commit")
        if h:
            head += f" Judged under rule `{h[:12]}` of `{c.get('claims_file', '')}` (at `{str(cc)[:12]}`" + (
                ", uncommitted" if "modified" in str(cc) or cc == "uncommitted" else "") + ")."
        items.append(head)
    return f":::{{admonition}} {title}\n:class: dropdown\n\n" + "\n".join(items) + "\n:::\n"
