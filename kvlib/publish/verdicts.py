"""Verdict rules: what counts as "reproduced" is declared per claim in ``data/claims/*.yml`` before any run,
and :func:`decide` is the one place where a measurement and its rule become a verdict.

A rule is a mapping with a ``kind``:

``tolerance``
    ``value`` (the paper's number), ``rel`` and/or ``abs`` (at least one): reproduced when
    ``|measured - value| <= abs + rel * |value|``. ``measured`` is a number.
``interval``
    ``mode: paper_in_ci``: ``measured`` is our confidence interval ``(lo, hi)`` and ``value`` (the paper's figure)
    must lie in it. ``mode: ours_in``: ``measured`` is a number that must lie in ``[lo, hi]`` (stated in the rule).
    ``mode: ci_within``: ``measured`` is our CI ``(lo, hi)``; inside ``[lo, hi]`` is reproduced, disjoint from it
    differs, and a CI straddling an end is "not reproducible here" (too wide to tell).
``threshold``
    ``op`` one of ``>=, <=, >, <`` and ``bound``: reproduced when ``measured op bound``.
``qualitative``
    ``test`` (a name of the boolean the notebook computes) and ``tests`` (what it checks, in words):
    ``measured`` is that boolean.
``not_reproducible``
    ``reason``: the claim cannot be tested here (e.g. needs 8B weights or a training run); always reported so.

Every kind but the last takes an optional ``min_n`` (the sample size needed to show the claim: below it the
verdict is "not reproducible here", saying so) and an optional ``measure`` (what the number is, for tables).
``measured=None`` means nothing was measured in this run: "not reproducible here".
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from kvlib.publish.provenance import repo_root

VERDICTS = ("reproduced", "differs", "not reproducible here")
KINDS = ("tolerance", "interval", "threshold", "qualitative", "not_reproducible")
_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
_FIELDS = {
    "tolerance": {"value", "rel", "abs"},
    "interval": {"mode", "value", "lo", "hi"},
    "threshold": {"op", "bound"},
    "qualitative": {"test", "tests"},
    "not_reproducible": {"reason"},
}
_COMMON = {"kind", "min_n", "measure", "note"}


def _num(x: Any, claim: str, field: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(float(x)):
        raise ValueError(f"claim {claim!r}: rule field {field!r} must be a number, got {x!r}")
    return float(x)


def validate(rule: Any, claim: str = "?") -> dict[str, Any]:
    """Check a rule's shape; return it as a plain dict. ValueError names the claim and the field."""
    if not isinstance(rule, Mapping):
        raise ValueError(f"claim {claim!r}: field 'rule' must be a mapping with a 'kind', got {rule!r}")
    rule = dict(rule)
    kind = rule.get("kind")
    if kind not in KINDS:
        raise ValueError(f"claim {claim!r}: rule field 'kind' must be one of {KINDS}, got {kind!r}")
    extra = set(rule) - _FIELDS[kind] - _COMMON
    if kind == "not_reproducible":
        extra |= {"min_n"} & set(rule)
    if extra:
        raise ValueError(f"claim {claim!r}: rule of kind {kind!r} has unknown field(s) {sorted(extra)}")
    if "min_n" in rule and (isinstance(rule["min_n"], bool) or not isinstance(rule["min_n"], int)
                            or rule["min_n"] < 1):
        raise ValueError(f"claim {claim!r}: rule field 'min_n' must be a positive integer, got {rule['min_n']!r}")
    for f in ("measure", "note"):
        if f in rule and not isinstance(rule[f], str):
            raise ValueError(f"claim {claim!r}: rule field {f!r} must be a string")
    if kind == "tolerance":
        _num(rule.get("value"), claim, "value")
        if "rel" not in rule and "abs" not in rule:
            raise ValueError(f"claim {claim!r}: tolerance rule needs field 'rel' and/or 'abs'")
        for f in ("rel", "abs"):
            if f in rule and _num(rule[f], claim, f) < 0:
                raise ValueError(f"claim {claim!r}: rule field {f!r} must be >= 0")
    elif kind == "interval":
        mode = rule.get("mode")
        if mode == "paper_in_ci":
            _num(rule.get("value"), claim, "value")
        elif mode in ("ours_in", "ci_within"):
            lo, hi = _num(rule.get("lo"), claim, "lo"), _num(rule.get("hi"), claim, "hi")
            if lo > hi:
                raise ValueError(f"claim {claim!r}: rule fields 'lo' > 'hi' ({lo} > {hi})")
        else:
            raise ValueError(f"claim {claim!r}: rule field 'mode' must be 'paper_in_ci', 'ours_in' or 'ci_within', "
                             f"got {mode!r}")
    elif kind == "threshold":
        if rule.get("op") not in _OPS:
            raise ValueError(f"claim {claim!r}: rule field 'op' must be one of {tuple(_OPS)}, got {rule.get('op')!r}")
        _num(rule.get("bound"), claim, "bound")
    elif kind == "qualitative":
        for f in ("test", "tests"):
            if not isinstance(rule.get(f), str) or not rule[f].strip():
                raise ValueError(f"claim {claim!r}: qualitative rule needs a non-empty string field {f!r}")
    else:
        if not isinstance(rule.get("reason"), str) or not rule["reason"].strip():
            raise ValueError(f"claim {claim!r}: not_reproducible rule needs a non-empty string field 'reason'")
    return rule


def _g(x: float) -> str:
    return f"{x:.4g}"


def describe(rule: Mapping[str, Any]) -> str:
    """One line for tables: what counts as reproduced."""
    rule = validate(rule)
    kind = rule["kind"]
    what = rule.get("measure", "ours")
    if kind == "tolerance":
        tol = " + ".join(([f"{_g(rule['abs'])}"] if "abs" in rule else [])
                         + ([f"{_g(100 * rule['rel'])}%"] if "rel" in rule else []))
        s = f"{what} = {_g(rule['value'])} ± {tol}"
    elif kind == "interval":
        if rule["mode"] == "paper_in_ci":
            s = f"paper's {_g(rule['value'])} inside our CI of {what}"
        elif rule["mode"] == "ci_within":
            s = f"our CI of {what} inside [{_g(rule['lo'])}, {_g(rule['hi'])}]"
        else:
            s = f"{what} in [{_g(rule['lo'])}, {_g(rule['hi'])}]"
    elif kind == "threshold":
        s = f"{what} {rule['op']} {_g(rule['bound'])}"
    elif kind == "qualitative":
        s = f"test `{rule['test']}`: {rule['tests']}"
    else:
        return f"not reproducible here: {rule['reason']}"
    if "min_n" in rule:
        s += f" (n >= {rule['min_n']})"
    return s


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _pair(measured: Any, claim: str) -> tuple[float, float]:
    if isinstance(measured, (str, bytes)) or not isinstance(measured, Sequence) or len(measured) != 2:
        raise ValueError(f"claim {claim!r}: interval rule needs measured = (lo, hi), got {measured!r}")
    try:
        lo, hi = (float(v) for v in measured)
    except (TypeError, ValueError):
        raise ValueError(f"claim {claim!r}: interval rule needs two numbers, got {measured!r}") from None
    if lo > hi:
        raise ValueError(f"claim {claim!r}: measured interval has lo > hi ({lo} > {hi})")
    return lo, hi


def decide(rule: Mapping[str, Any], measured: Any, n: int | None = None, *, claim: str = "?") -> tuple[str, str]:
    """``(verdict, why)`` for one measurement under its claim's rule.

    ``measured``: a number (tolerance, threshold, interval ``ours_in``), a pair ``(lo, hi)`` (interval
    ``paper_in_ci``), a bool (qualitative), or None (not measured in this run). ``n``: the sample size behind it,
    required when the rule has ``min_n``.
    """
    rule = validate(rule, claim)
    kind = rule["kind"]
    if kind == "not_reproducible":
        return "not reproducible here", rule["reason"]
    if "min_n" in rule and n is not None and not isinstance(n, bool) and isinstance(n, int) and n < rule["min_n"]:
        return "not reproducible here", f"n = {n} is below the {rule['min_n']} needed to show it"
    if measured is None:
        return "not reproducible here", "not measured in this run"
    if "min_n" in rule:
        if n is None:
            raise ValueError(f"claim {claim!r}: its rule has min_n = {rule['min_n']}, so n must be given")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"claim {claim!r}: n must be a non-negative integer, got {n!r}")
        if n < rule["min_n"]:
            return "not reproducible here", f"n = {n} is below the {rule['min_n']} needed to show it"
    if kind == "qualitative":
        if not isinstance(measured, bool) and type(measured).__name__ != "bool_":
            raise ValueError(f"claim {claim!r}: qualitative rule {rule['test']!r} needs a bool, got {measured!r}")
        ok = bool(measured)
        return ("reproduced", f"{rule['test']} holds") if ok else ("differs", f"{rule['test']} fails")
    if kind == "interval" and rule["mode"] in ("paper_in_ci", "ci_within"):
        lo, hi = _pair(measured, claim)
        if math.isnan(lo) or math.isnan(hi):
            return "not reproducible here", "our interval is undefined (nan)"
        if rule["mode"] == "paper_in_ci":
            ok = lo <= rule["value"] <= hi
            return ("reproduced" if ok else "differs",
                    f"paper's {_g(rule['value'])} {'inside' if ok else 'outside'} our [{_g(lo)}, {_g(hi)}]")
        a, b = rule["lo"], rule["hi"]
        if a <= lo and hi <= b:
            return "reproduced", f"our [{_g(lo)}, {_g(hi)}] inside [{_g(a)}, {_g(b)}]"
        if hi < a or lo > b:
            return "differs", f"our [{_g(lo)}, {_g(hi)}] outside [{_g(a)}, {_g(b)}]"
        return "not reproducible here", f"our [{_g(lo)}, {_g(hi)}] straddles [{_g(a)}, {_g(b)}]: too wide to tell"
    if hasattr(measured, "item"):
        measured = measured.item()
    if not _is_num(measured):
        raise ValueError(f"claim {claim!r}: a {kind} rule needs a number, got {measured!r}")
    m = float(measured)
    if math.isnan(m):
        return "not reproducible here", "the measurement is undefined (nan)"
    if kind == "tolerance":
        tol = rule.get("abs", 0.0) + rule.get("rel", 0.0) * abs(rule["value"])
        ok = abs(m - rule["value"]) <= tol
        return ("reproduced" if ok else "differs",
                f"{_g(m)} is {'within' if ok else 'outside'} {_g(rule['value'])} ± {_g(tol)}")
    if kind == "threshold":
        ok = _OPS[rule["op"]](m, rule["bound"])
        return ("reproduced" if ok else "differs",
                f"{_g(m)} {rule['op'] if ok else 'fails ' + rule['op']} {_g(rule['bound'])}")
    lo, hi = rule["lo"], rule["hi"]
    ok = lo <= m <= hi
    return "reproduced" if ok else "differs", f"{_g(m)} {'in' if ok else 'outside'} [{_g(lo)}, {_g(hi)}]"


def judge(claim_id: str, *, ours: str, measured: Any = None, n: int | None = None, note: str = "") -> dict[str, Any]:
    """One claim record, its verdict decided under the rule of ``data/claims/*.yml``: ``{id, ours, measured, n,
    note, rule, verdict, why}`` (``why`` = the rule's reason, then ``note``). Report modules return these;
    :meth:`kvlib.publish.run.Run.claim` records the same."""
    known = load_claims()
    if claim_id not in known:
        raise ValueError(f"claim {claim_id!r} is not in data/claims/*.yml; add the paper's side there first")
    rule = known[claim_id]["rule"]
    verdict, reason = decide(rule, measured, n, claim=claim_id)
    return {"id": claim_id, "ours": ours, "measured": measured, "n": n, "note": note, "rule": describe(rule),
            "verdict": verdict, "why": reason + (f"; {note}" if note else "")}


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
