"""Verdict rules: what counts as "reproduced" is declared per claim in ``data/claims/*.yml``, and :func:`decide` is
the one place where a measurement and its rule become a verdict.

A rule is declared before the run that judges it, and the run records which rule it was judged under
(:func:`rule_hash`, the claims file's commit): the build refuses a verdict whose rule changed since its
measurement, and the register labels a rule committed after the claim was first measured as post hoc.

Verdicts (:data:`VERDICTS`):

``reproduced``
    an empirical measurement, which could have come out otherwise, meets the rule.
``checked``
    the rule carries ``checked: <why this is an identity>``: the claim is an identity, arithmetic or a byte
    account that our code fixes. Meeting the rule checks our code; it reproduces no measured result and never
    counts as reproduced.
``differs``
    the measurement is on the other side of the rule.
``not reproducible here``
    not measured, below ``min_n``, undefined, a ``not_reproducible`` rule, or *underpowered*: our interval holds
    both the paper's side and the opposite conclusion (its ``why`` then starts with ``underpowered``).

A rule is a mapping with a ``kind``. Every region below can be met by a number (our measurement) or by an interval
``(lo, hi)`` (our confidence interval): an interval inside the region is reproduced, one disjoint from it differs,
and one that straddles its edge is underpowered.

``tolerance``
    ``value`` (the paper's number), ``rel`` and/or ``abs``: the region ``value ± (abs + rel * |value|)``.
``interval``
    ``lo``, ``hi``: the region ``[lo, hi]`` (one end may be infinite).
``threshold``
    ``op`` one of ``>=, <=, >, <`` and ``bound``: the region ``op bound``.
``all``
    ``of``: a list of conditions on named quantities, each ``{quantity, measure, op, bound}`` (a threshold),
    ``{quantity, measure, lo, hi}`` (a range) or ``{quantity, measure, monotone}`` (a sequence of numbers,
    ``increasing``/``decreasing`` strictly, ``nondecreasing``/``nonincreasing``). ``measured`` is a mapping from
    each quantity to its value. Reproduced when every condition holds; differs when any fails.
``not_reproducible``
    ``reason``: the claim cannot be tested here (e.g. needs 8B weights or a training run).

Every kind but the last takes ``min_n`` (the sample size needed: below it, "not reproducible here"), ``measure``
(what the number is), ``note``, ``checked`` (see above) and ``needs`` (the run that would measure it, e.g. a GPU
script, for a rule declared before its measurement exists). A rule that no measurement can fail is refused.
``measured=None`` means nothing was measured in this run: "not reproducible here".

A claim entry may instead carry ``context_of: <primary claim id>`` and no rule: a context row shown beneath that
claim (another setting of the same paper statement, or the best-of our variants), with no verdict of its own.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import operator
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvlib.publish.provenance import repo_root

VERDICTS = ("reproduced", "checked", "differs", "not reproducible here")
#: the word a context row carries in place of a verdict
CONTEXT = "context"
KINDS = ("tolerance", "interval", "threshold", "all", "not_reproducible")
MONOTONE = ("increasing", "decreasing", "nondecreasing", "nonincreasing")
UNDERPOWERED = "underpowered"
_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
_FIELDS = {
    "tolerance": {"value", "rel", "abs"},
    "interval": {"lo", "hi"},
    "threshold": {"op", "bound"},
    "all": {"of"},
    "not_reproducible": {"reason"},
}
_COMMON = {"kind", "min_n", "measure", "note", "checked", "needs", "requires"}
_COND = {"quantity", "measure", "op", "bound", "lo", "hi", "monotone"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _num(x: Any, claim: str, field: str, finite: bool = False) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(float(x)):
        raise ValueError(f"claim {claim!r}: rule field {field!r} must be a number, got {x!r}")
    if finite and not math.isfinite(float(x)):
        raise ValueError(f"claim {claim!r}: rule field {field!r} must be finite, got {x!r}")
    return float(x)


def _text(rule: Mapping, f: str, claim: str, where: str = "rule") -> None:
    if not isinstance(rule.get(f), str) or not rule[f].strip():
        raise ValueError(f"claim {claim!r}: {where} needs a non-empty string field {f!r}")


# -- regions: every rule but `all` (and each condition of `all` but `monotone`) is one interval of the real line --

def _region(spec: Mapping[str, Any]) -> tuple[float, float, bool, bool]:
    """``(a, b, a_closed, b_closed)``: the measurements that meet ``spec`` (a threshold, range or tolerance)."""
    if "op" in spec:
        op, b = spec["op"], float(spec["bound"])
        return {">=": (b, math.inf, True, False), ">": (b, math.inf, False, False),
                "<=": (-math.inf, b, False, True), "<": (-math.inf, b, False, False)}[op]
    if "value" in spec:
        tol = spec.get("abs", 0.0) + spec.get("rel", 0.0) * abs(spec["value"])
        return spec["value"] - tol, spec["value"] + tol, True, True
    return float(spec["lo"]), float(spec["hi"]), True, True


def _inside(x: float, r: tuple[float, float, bool, bool]) -> bool:
    a, b, ca, cb = r
    return (x > a or (ca and x == a)) and (x < b or (cb and x == b))


def _can_fail(r: tuple[float, float, bool, bool]) -> bool:
    return math.isfinite(r[0]) or math.isfinite(r[1])


def _g(x: float) -> str:
    return f"{x:.4g}"


def _region_text(spec: Mapping[str, Any]) -> str:
    if "op" in spec:
        return f"{spec['op']} {_g(spec['bound'])}"
    if "value" in spec:
        tol = " + ".join(([_g(spec["abs"])] if "abs" in spec else [])
                         + ([f"{_g(100 * spec['rel'])}%"] if "rel" in spec else []))
        return f"= {_g(spec['value'])} ± {tol}"
    lo, hi = spec["lo"], spec["hi"]
    if math.isinf(lo):
        return f"<= {_g(hi)}"
    if math.isinf(hi):
        return f">= {_g(lo)}"
    return f"in [{_g(lo)}, {_g(hi)}]"


def _check_region(spec: Mapping[str, Any], claim: str, where: str) -> None:
    if "op" in spec:
        if spec.get("op") not in _OPS:
            raise ValueError(f"claim {claim!r}: {where} field 'op' must be one of {tuple(_OPS)}, "
                             f"got {spec.get('op')!r}")
        _num(spec.get("bound"), claim, "bound")
    else:
        lo, hi = _num(spec.get("lo"), claim, "lo"), _num(spec.get("hi"), claim, "hi")
        if lo > hi:
            raise ValueError(f"claim {claim!r}: {where} fields 'lo' > 'hi' ({lo} > {hi})")
    if not _can_fail(_region(spec)):
        raise ValueError(f"claim {claim!r}: {where} admits every measurement: a rule that cannot fail")


def _check_condition(c: Any, claim: str, i: int, field: str = "of") -> None:
    where = f"condition {i} of {field!r}"
    if not isinstance(c, Mapping):
        raise ValueError(f"claim {claim!r}: {where} must be a mapping, got {c!r}")
    extra = set(c) - _COND
    if extra:
        raise ValueError(f"claim {claim!r}: {where} has unknown field(s) {sorted(extra)}")
    if not isinstance(c.get("quantity"), str) or not _NAME.match(c["quantity"]):
        raise ValueError(f"claim {claim!r}: {where} needs field 'quantity', an identifier, got {c.get('quantity')!r}")
    _text(c, "measure", claim, where)
    forms = [f for f in ("op", "lo", "monotone") if f in c]
    if len(forms) != 1:
        raise ValueError(f"claim {claim!r}: {where} needs exactly one of 'op'+'bound', 'lo'+'hi' or 'monotone'")
    if "monotone" in c:
        if c["monotone"] not in MONOTONE or {"bound", "hi"} & set(c):
            raise ValueError(f"claim {claim!r}: {where} field 'monotone' must be one of {MONOTONE}, alone")
    else:
        _check_region(c, claim, where)


def validate(rule: Any, claim: str = "?") -> dict[str, Any]:
    """Check a rule's shape; return it as a plain dict. ValueError names the claim and the field."""
    if not isinstance(rule, Mapping):
        raise ValueError(f"claim {claim!r}: field 'rule' must be a mapping with a 'kind', got {rule!r}")
    rule = dict(rule)
    kind = rule.get("kind")
    if kind == "qualitative":
        raise ValueError(f"claim {claim!r}: rule kind 'qualitative' is removed: a bare boolean is not a measurement; "
                         "report the quantities and state the conditions in a rule of kind 'all'")
    if kind not in KINDS:
        raise ValueError(f"claim {claim!r}: rule field 'kind' must be one of {KINDS}, got {kind!r}")
    extra = set(rule) - _FIELDS[kind] - _COMMON
    if kind == "not_reproducible":
        extra |= {"min_n", "checked", "requires"} & set(rule)
    if extra:
        raise ValueError(f"claim {claim!r}: rule of kind {kind!r} has unknown field(s) {sorted(extra)}")
    if "min_n" in rule and (isinstance(rule["min_n"], bool) or not isinstance(rule["min_n"], int)
                            or rule["min_n"] < 1):
        raise ValueError(f"claim {claim!r}: rule field 'min_n' must be a positive integer, got {rule['min_n']!r}")
    for f in ("measure", "note", "checked", "needs"):
        if f in rule and (not isinstance(rule[f], str) or not rule[f].strip()):
            raise ValueError(f"claim {claim!r}: rule field {f!r} must be a non-empty string")
    if "requires" in rule:
        req = rule["requires"]
        if not isinstance(req, list) or not req:
            raise ValueError(f"claim {claim!r}: rule field 'requires' must be a non-empty list of conditions")
        for i, c in enumerate(req):
            _check_condition(c, claim, i, "requires")
            if "monotone" in c:
                raise ValueError(f"claim {claim!r}: condition {i} of 'requires' must be a threshold or a range")
        rule["requires"] = [dict(c) for c in req]
    if kind == "tolerance":
        _num(rule.get("value"), claim, "value", finite=True)
        if "rel" not in rule and "abs" not in rule:
            raise ValueError(f"claim {claim!r}: tolerance rule needs field 'rel' and/or 'abs'")
        for f in ("rel", "abs"):
            if f in rule and not 0 <= _num(rule[f], claim, f, finite=True):
                raise ValueError(f"claim {claim!r}: rule field {f!r} must be >= 0")
    elif kind in ("interval", "threshold"):
        _check_region(rule, claim, "rule")
    elif kind == "all":
        of = rule.get("of")
        if not isinstance(of, list) or not of:
            raise ValueError(f"claim {claim!r}: rule of kind 'all' needs field 'of', a non-empty list of conditions")
        for i, c in enumerate(of):
            _check_condition(c, claim, i)
        names = [c["quantity"] for c in of]
        if len(set(names)) != len(names):
            raise ValueError(f"claim {claim!r}: rule field 'of' names a quantity twice ({names})")
        rule["of"] = [dict(c) for c in of]
    else:
        _text(rule, "reason", claim, "not_reproducible rule")
    return rule


def rule_hash(rule: Any) -> str:
    """sha256 of the rule as declared (canonical JSON): what a result records it was judged under."""
    doc = json.dumps(rule, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(doc.encode()).hexdigest()


def _cond_text(c: Mapping[str, Any]) -> str:
    if "monotone" in c:
        return f"{c['measure']} {c['monotone']}"
    return f"{c['measure']} {_region_text(c)}"


def describe(rule: Mapping[str, Any]) -> str:
    """One line for tables: what counts as reproduced (or, for a checked claim, as checked)."""
    rule = validate(rule)
    kind = rule["kind"]
    what = rule.get("measure", "ours")
    if kind == "not_reproducible":
        return f"not reproducible here: {rule['reason']}"
    if kind == "all":
        s = "; ".join(_cond_text(c) for c in rule["of"])
    else:
        s = f"{what} {_region_text(rule)}"
    if "min_n" in rule:
        s += f" (n >= {rule['min_n']})"
    if "requires" in rule:
        s += "; judged only if " + " and ".join(_cond_text(c) for c in rule["requires"])
    return s


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _scalar(x: Any) -> Any:
    return x.item() if hasattr(x, "item") and getattr(x, "ndim", 0) == 0 else x


def _value(m: Any, claim: str, what: str) -> float | tuple[float, float]:
    """A number, or an interval ``(lo, hi)``."""
    m = _scalar(m)
    if _is_num(m):
        return float(m)
    if isinstance(m, (str, bytes)) or not isinstance(m, Sequence) or len(m) != 2:
        raise ValueError(f"claim {claim!r}: {what} must be a number or an interval (lo, hi), got {m!r}")
    try:
        lo, hi = (float(_scalar(v)) for v in m)
    except (TypeError, ValueError):
        raise ValueError(f"claim {claim!r}: {what} must be two numbers, got {m!r}") from None
    if isinstance(m[0], bool) or isinstance(m[1], bool):
        raise ValueError(f"claim {claim!r}: {what} must be numbers, not booleans, got {m!r}")
    if lo > hi:
        raise ValueError(f"claim {claim!r}: {what} has lo > hi ({lo} > {hi})")
    return lo, hi


def _show(v: float | tuple[float, float]) -> str:
    return _g(v) if isinstance(v, float) else f"[{_g(v[0])}, {_g(v[1])}]"


def _judge_region(spec: Mapping[str, Any], v: float | tuple[float, float]) -> str:
    """'pass', 'fail', 'straddle' (an interval on both sides) or 'nan'."""
    r = _region(spec)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("pass" if _inside(v, r) else "fail")
    lo, hi = v
    if math.isnan(lo) or math.isnan(hi):
        return "nan"
    if _inside(lo, r) and _inside(hi, r):
        return "pass"
    a, b, ca, cb = r
    if hi < a or (hi == a and not ca) or lo > b or (lo == b and not cb):
        return "fail"
    return "straddle"


def _judge_monotone(c: Mapping[str, Any], m: Any, claim: str) -> tuple[str, str]:
    if isinstance(m, (str, bytes)) or not isinstance(m, Sequence) or len(m) < 2:
        raise ValueError(f"claim {claim!r}: quantity {c['quantity']!r} must be a sequence of at least two numbers "
                         f"(a monotone condition on fewer cannot fail), got {m!r}")
    xs = [float(_scalar(x)) for x in m]
    if any(math.isnan(x) for x in xs):
        return "nan", f"{c['measure']} is undefined (nan)"
    ops = {"increasing": operator.lt, "decreasing": operator.gt, "nondecreasing": operator.le,
           "nonincreasing": operator.ge}
    ok = all(ops[c["monotone"]](a, b) for a, b in zip(xs, xs[1:]))
    seq = " -> ".join(_g(x) for x in xs)
    return ("pass" if ok else "fail"), f"{c['measure']} {seq} {'is' if ok else 'is not'} {c['monotone']}"


def _judge_condition(c: Mapping[str, Any], m: Any, claim: str) -> tuple[str, str]:
    if "monotone" in c:
        return _judge_monotone(c, m, claim)
    v = _value(m, claim, f"quantity {c['quantity']!r}")
    side = _judge_region(c, v)
    words = {"pass": "meets", "fail": "fails", "straddle": "straddles", "nan": "cannot be judged against"}[side]
    shown = "undefined (nan)" if side == "nan" else _show(v)
    return side, f"{c['measure']} {shown} {words} {_region_text(c)}"


def _verdict_of(sides: list[str], reasons: list[str], checked: bool) -> tuple[str, str]:
    if "nan" in sides:
        return "not reproducible here", "; ".join(r for s, r in zip(sides, reasons) if s == "nan")
    if "fail" in sides:
        return "differs", "; ".join(r for s, r in zip(sides, reasons) if s == "fail")
    if "straddle" in sides:
        return "not reproducible here", (f"{UNDERPOWERED}: our interval holds both conclusions ("
                                         + "; ".join(r for s, r in zip(sides, reasons) if s == "straddle") + ")")
    return ("checked" if checked else "reproduced"), "; ".join(reasons)


def decide(rule: Mapping[str, Any], measured: Any, n: int | None = None, *, claim: str = "?",
           given: Mapping[str, Any] | None = None) -> tuple[str, str]:
    """``(verdict, why)`` for one measurement under its claim's rule.

    ``measured``: a number or an interval ``(lo, hi)`` (tolerance, interval, threshold), a mapping from quantity
    to value (``all``), or None (not measured in this run). ``n``: the sample size behind it, required when the
    rule has ``min_n``. ``given``: the values of the rule's ``requires`` conditions (what the data must have before
    the claim is judged; one unmet gives "not reproducible here").
    """
    rule = validate(rule, claim)
    kind = rule["kind"]
    if kind == "not_reproducible":
        return "not reproducible here", rule["reason"]
    if "requires" in rule and measured is not None:
        want = [c["quantity"] for c in rule["requires"]]
        if not isinstance(given, Mapping) or set(want) - set(given):
            raise ValueError(f"claim {claim!r}: its rule requires {want}, so given= must state them, got {given!r}")
        unmet = [r for s, r in (_judge_condition(c, given[c["quantity"]], claim) for c in rule["requires"])
                 if s != "pass"]
        if unmet:
            return "not reproducible here", "not judged, a precondition of the rule is unmet: " + "; ".join(unmet)
    if "min_n" in rule and n is not None and not isinstance(n, bool) and isinstance(n, int) and n < rule["min_n"]:
        return "not reproducible here", f"n = {n} is below the {rule['min_n']} needed to show it"
    if measured is None:
        return "not reproducible here", "not measured in this run" + (f" (needs {rule['needs']})"
                                                                      if "needs" in rule else "")
    if "min_n" in rule:
        if n is None:
            raise ValueError(f"claim {claim!r}: its rule has min_n = {rule['min_n']}, so n must be given")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"claim {claim!r}: n must be a non-negative integer, got {n!r}")
    checked = "checked" in rule
    if kind == "all":
        if not isinstance(measured, Mapping):
            raise ValueError(f"claim {claim!r}: a rule of kind 'all' needs measured = {{quantity: value}}, "
                             f"got {measured!r}")
        want = [c["quantity"] for c in rule["of"]]
        missing, extra = sorted(set(want) - set(measured)), sorted(set(measured) - set(want))
        if missing or extra:
            raise ValueError(f"claim {claim!r}: measured must give exactly the quantities {want}"
                             + (f"; missing {missing}" if missing else "") + (f"; unknown {extra}" if extra else ""))
        judged = [_judge_condition(c, measured[c["quantity"]], claim) for c in rule["of"]]
        return _verdict_of([s for s, _ in judged], [r for _, r in judged], checked)
    if isinstance(_scalar(measured), bool):
        raise ValueError(f"claim {claim!r}: a bare boolean is not a measurement; report the quantity, got {measured!r}")
    v = _value(measured, claim, "measured")
    side = _judge_region(rule, v)
    if side == "nan":
        return "not reproducible here", "the measurement is undefined (nan)"
    what = rule.get("measure", "ours")
    words = {"pass": "meets", "fail": "fails", "straddle": "straddles"}[side]
    return _verdict_of([side], [f"{what} {_show(v)} {words} {_region_text(rule)}"], checked)


def is_underpowered(verdict: str, why: str) -> bool:
    return verdict == "not reproducible here" and str(why).startswith(UNDERPOWERED)


def label(verdict: str, why: str = "") -> str:
    """The verdict as tables show it: "not reproducible here (underpowered)" where that is the reason."""
    return verdict + (f" ({UNDERPOWERED})" if is_underpowered(verdict, why) else "")


# -- every rule can fail: a measurement on either side -------------------------------------------------------------

def _region_witness(spec: Mapping[str, Any], side: str) -> float:
    a, b, ca, cb = _region(spec)
    scale = max([abs(x) for x in (a, b) if math.isfinite(x)] + [1.0])
    d = 0.5 * scale
    if side == "pass":
        if math.isfinite(a) and math.isfinite(b):
            return (a + b) / 2
        if math.isfinite(a):
            return a if ca else a + d
        return b if cb else b - d
    if math.isfinite(a):
        return a if not ca else a - d
    return b if not cb else b + d


def witness(rule: Mapping[str, Any], side: str, like: Any = None) -> Any:
    """A measurement that meets (``side='pass'``) or fails (``'fail'``) ``rule``, shaped like ``like`` (a recorded
    measurement: an interval gives an interval). ValueError when the rule cannot go that way."""
    rule = validate(rule)
    if side not in ("pass", "fail"):
        raise ValueError(f"side must be 'pass' or 'fail', got {side!r}")
    if rule["kind"] == "not_reproducible":
        raise ValueError("a not_reproducible rule decides nothing")
    if rule["kind"] == "all":
        like = like if isinstance(like, Mapping) else {}
        out = {}
        for i, c in enumerate(rule["of"]):
            want = "fail" if side == "fail" and i == 0 else "pass"
            if "monotone" in c:
                prev = like.get(c["quantity"])
                k = len(prev) if isinstance(prev, Sequence) and not isinstance(prev, str) and len(prev) >= 2 else 3
                up = c["monotone"] in ("increasing", "nondecreasing")
                seq = [float(j) for j in range(k)]
                out[c["quantity"]] = seq if up == (want == "pass") else seq[::-1]
            else:
                out[c["quantity"]] = _shaped(_region_witness(c, want), like.get(c["quantity"]))
        return out
    return _shaped(_region_witness(rule, side), like)


def _shaped(x: float, like: Any) -> Any:
    like = _scalar(like)
    if like is not None and not _is_num(like) and isinstance(like, Sequence) and len(like) == 2:
        return [x, x]
    return x


def can_flip(rule: Mapping[str, Any], like: Any = None, n: int | None = None) -> bool:
    """Whether ``decide`` gives the rule's verdict on one witness and "differs" on the other (the rule can fail)."""
    rule = validate(rule)
    if rule["kind"] == "not_reproducible":
        return False
    n = max(n or 0, rule.get("min_n", 0)) or None
    given = {c["quantity"]: _region_witness(c, "pass") for c in rule.get("requires", [])}
    good = decide(rule, witness(rule, "pass", like), n, given=given)[0]
    bad = decide(rule, witness(rule, "fail", like), n, given=given)[0]
    return good in ("reproduced", "checked") and bad == "differs"


# -- judging, with the record of what it was judged under ---------------------------------------------------------

#: claim id -> rule hash of every claim judged in this process; the execution cache records it (a notebook's
#: execution goes stale when the rule of a claim it judged changes, not when any claims file does)
JUDGED: dict[str, str] = {}

_FILE_COMMITS: dict[str, str] = {}


def claims_file_commit(rel: str) -> str:
    """The last commit of the claims file ``rel`` at run time, ``+modified`` when the working copy differs from
    it (a rule not yet committed); ``$KVLIB_COMMIT`` stands in where the tree travelled without ``.git``."""
    if rel in _FILE_COMMITS:
        return _FILE_COMMITS[rel]
    import os
    import subprocess

    out = "unknown"
    try:
        root = repo_root()
        last = subprocess.run(["git", "log", "-1", "--format=%H", "--", rel], cwd=root, capture_output=True,
                              text=True, timeout=30)
        if last.returncode == 0 and last.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--", rel], cwd=root, capture_output=True,
                                   text=True, timeout=30).stdout.strip()
            out = last.stdout.strip() + ("+modified" if dirty else "")
        elif last.returncode == 0:
            out = "uncommitted"
        elif os.environ.get("KVLIB_COMMIT"):
            out = os.environ["KVLIB_COMMIT"] + " (the run's commit; no git here)"
    except (OSError, subprocess.SubprocessError):
        pass
    _FILE_COMMITS[rel] = out
    return out


def rule_of(entry: Mapping[str, Any]) -> dict[str, Any]:
    """What a claim entry's verdict depends on: its rule, or for a context row the claim it sits under."""
    if "context_of" in entry:
        return {"context_of": entry["context_of"], "measure": entry.get("measure", "")}
    return dict(entry["rule"])


def judge(claim_id: str, *, ours: str, measured: Any = None, n: int | None = None, note: str = "",
          device: str | None = None, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One claim record, its verdict decided under the rule of ``data/claims/*.yml``, with what it was judged under:
    ``{id, ours, measured, n, note, rule, verdict, why, role, setting, rule_sha256, claims_file, claims_commit,
    judged_at}`` (``why`` = the rule's reason, then ``note``; ``setting`` = the claim's ``ours_setting`` with
    ``{device}`` filled). A context row gets the verdict :data:`CONTEXT`. Report modules return these;
    :meth:`kvlib.publish.run.Run.claim` records the same."""
    known = load_claims()
    if claim_id not in known:
        raise ValueError(f"claim {claim_id!r} is not in data/claims/*.yml; add the paper's side there first")
    entry = known[claim_id]
    if "context_of" in entry:
        verdict, reason, rule_text = CONTEXT, "", f"context of {entry['context_of']}"
    else:
        verdict, reason = decide(entry["rule"], measured, n, claim=claim_id, given=given)
        rule_text = describe(entry["rule"])
    h = rule_hash(rule_of(entry))
    JUDGED[claim_id] = h
    setting = str(entry.get("ours_setting", "")).replace("{device}", device or "this run's device")
    return {"id": claim_id, "ours": ours, "measured": measured, "n": n, "given": dict(given) if given else None,
            "note": note, "rule": rule_text,
            "verdict": verdict, "why": "; ".join(x for x in (reason, note if note != reason else "") if x),
            "role": CONTEXT if "context_of" in entry else "primary", "setting": setting,
            "rule_sha256": h, "claims_file": entry["file"], "claims_commit": claims_file_commit(entry["file"]),
            "judged_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}


def stale_rules(recorded: Mapping[str, str]) -> list[str]:
    """Claims (of ``{id: rule hash}`` recorded at execution) whose rule is gone or changed since: the execution
    cache's test for the claims a notebook judged."""
    known = load_claims()
    out = []
    for cid, h in sorted(recorded.items()):
        if cid not in known:
            out.append(f"{cid} (no longer in data/claims)")
        elif rule_hash(rule_of(known[cid])) != h:
            out.append(cid)
    return out


# -- the claims files -----------------------------------------------------------------------------------------

#: fields every claim entry states (the paper's side and the two settings); ``rule`` or ``context_of`` besides
CLAIM_FIELDS = ("id", "paper", "where", "statement", "paper_value", "setting", "ours_setting")
_OPTIONAL = {"rule", "context_of", "measure", "post_hoc", "chapter", "file"}
PAPERS = ("witcert", "kv4rl")


def _check_entry(c: Any, fname: str) -> None:
    if not isinstance(c, dict):
        raise ValueError(f"{fname}: each claim must be a mapping, got {c!r}")
    cid = c.get("id", "?")
    for f in CLAIM_FIELDS:
        if not isinstance(c.get(f), str) or not c[f].strip():
            raise ValueError(f"claim {cid!r} in {fname}: field {f!r} must be a non-empty string "
                             + ("(our setting: model, hardware, scale)" if f == "ours_setting" else ""))
    if c["paper"] not in PAPERS:
        raise ValueError(f"claim {cid!r} in {fname}: field 'paper' must be one of {PAPERS}, got {c['paper']!r}")
    extra = set(c) - set(CLAIM_FIELDS) - _OPTIONAL
    if extra:
        raise ValueError(f"claim {cid!r} in {fname}: unknown field(s) {sorted(extra)}")
    if ("rule" in c) == ("context_of" in c):
        raise ValueError(f"claim {cid!r} in {fname}: needs exactly one of 'rule' (what counts as reproduced) and "
                         "'context_of' (the primary claim it is context for)")
    if "context_of" in c and (not isinstance(c.get("measure"), str) or not c["measure"].strip()):
        raise ValueError(f"claim {cid!r} in {fname}: a context row needs field 'measure' (what it measures)")
    if "post_hoc" in c and (not isinstance(c["post_hoc"], str) or not c["post_hoc"].strip()):
        raise ValueError(f"claim {cid!r} in {fname}: field 'post_hoc' must say when the number was seen first")


def load_claims(chapter: str | None = None) -> dict[str, dict[str, Any]]:
    """The paper side of every claim: ``data/claims/<chapter>.yml`` merged into ``{id: entry}``; each entry also
    gets ``chapter`` and ``file`` (the claims file, relative to the repository)."""
    import yaml

    out: dict[str, dict[str, Any]] = {}
    folder = repo_root() / "data" / "claims"
    files = [folder / f"{chapter}.yml"] if chapter else sorted(folder.glob("*.yml"))
    for f in files:
        if not f.exists():
            continue
        doc = yaml.safe_load(f.read_text()) or {}
        for c in doc.get("claims", []):
            _check_entry(c, f.name)
            c = dict(c, chapter=doc.get("chapter", f.stem), file=f"data/claims/{f.name}")
            if c["id"] in out:
                raise ValueError(f"claim id {c['id']!r} appears twice (in {f.name})")
            if "rule" in c:
                c["rule"] = validate(c["rule"], c["id"])
            out[c["id"]] = c
    if chapter is None:
        for cid, c in out.items():
            p = c.get("context_of")
            if p is not None and (p not in out or "context_of" in out[p]):
                raise ValueError(f"claim {cid!r}: context_of names {p!r}, which is not a primary claim")
    return out
