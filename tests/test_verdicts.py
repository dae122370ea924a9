"""decide() on known answers (numbers, intervals, conditions, preconditions), the verdict classes, rule validation,
the record of what a verdict was judged under, and the register's rules: every claim states both settings, every
decidable rule can fail, and a rule that no measurement can fail is refused."""

import math

import pytest

from kvlib.publish.verdicts import (
    VERDICTS,
    can_flip,
    decide,
    describe,
    label,
    rule_hash,
    stale_rules,
    validate,
    witness,
)


def test_tolerance_known_answers():
    r = {"kind": "tolerance", "value": 136, "rel": 0.02}
    assert decide(r, 136.0)[0] == "reproduced"
    assert decide(r, 138.7)[0] == "reproduced"  # 2% of 136 = 2.72
    assert decide(r, 139.0)[0] == "differs"
    assert decide({"kind": "tolerance", "value": 1.0, "abs": 0.1, "rel": 0.1}, 1.19)[0] == "reproduced"
    r = {"kind": "tolerance", "value": 1, "abs": 0, "measure": "median blocks"}
    verdict, why = decide(r, 2.0)
    assert verdict == "differs" and "median blocks 2 fails" in why
    assert decide(r, 1)[0] == "reproduced"


def test_threshold_ops_at_their_bounds():
    r = {"kind": "threshold", "op": "<=", "bound": 0.01}
    assert decide(r, 0.01)[0] == "reproduced"
    assert decide(r, 0.0101)[0] == "differs"
    assert decide({"kind": "threshold", "op": ">", "bound": 0}, 0)[0] == "differs"
    assert decide({"kind": "threshold", "op": "<", "bound": 0}, 0)[0] == "differs"
    assert decide({"kind": "threshold", "op": ">=", "bound": 82}, 90)[0] == "reproduced"


def test_an_interval_inside_reproduces_outside_differs_across_is_underpowered():
    eq = {"kind": "interval", "lo": 0.8, "hi": 1.25, "measure": "ratio"}
    assert decide(eq, (0.87, 1.03))[0] == "reproduced"
    assert decide(eq, (1.3, 2.0))[0] == "differs"
    verdict, why = decide(eq, (0.55, 1.53))  # the paper's own 4B interval: it holds both conclusions
    assert verdict == "not reproducible here" and why.startswith("underpowered")
    assert label(verdict, why) == "not reproducible here (underpowered)"
    assert decide(eq, 1.0)[0] == "reproduced" and decide(eq, 1.3)[0] == "differs"
    below = {"kind": "interval", "lo": -math.inf, "hi": 0.0}
    assert decide(below, (-5.0, -1.0))[0] == "reproduced"
    # a threshold judged on a CI: the whole interval must be on one side
    gt = {"kind": "threshold", "op": ">", "bound": 1.0}
    assert decide(gt, (1.2, 2.0))[0] == "reproduced"
    assert decide(gt, (0.9, 2.0))[0] == "not reproducible here"
    assert decide(gt, (0.5, 1.0))[0] == "differs"  # 1.0 itself is not > 1
    assert decide({"kind": "threshold", "op": "<", "bound": 0}, [0.0, 0.0])[0] == "differs"
    with pytest.raises(ValueError, match="lo > hi"):
        decide(eq, (2.0, 1.0), claim="c")


def test_checked_claims_never_read_reproduced():
    r = {"kind": "threshold", "op": "<=", "bound": 0, "checked": "a byte account"}
    assert decide(r, 0) == ("checked", "ours 0 meets <= 0")
    assert decide(r, 1)[0] == "differs"
    assert "checked" in VERDICTS and "reproduced" in VERDICTS


def test_all_conditions_and_monotone():
    r = {"kind": "all", "of": [
        {"quantity": "err", "op": "<", "bound": 0.05, "measure": "max error"},
        {"quantity": "kl", "monotone": "decreasing", "measure": "KL by group"},
        {"quantity": "level", "lo": 0.7, "hi": 0.9, "measure": "coverage"}]}
    assert decide(r, {"err": 0.01, "kl": [3, 2, 1], "level": 0.8})[0] == "reproduced"
    verdict, why = decide(r, {"err": 0.01, "kl": [3, 3, 1], "level": 0.8})
    assert verdict == "differs" and "is not decreasing" in why and "max error" not in why
    assert decide(r, {"err": 0.2, "kl": [3, 2, 1], "level": 0.28})[0] == "differs"
    assert decide(dict(r, of=[dict(r["of"][1], monotone="nonincreasing")]), {"kl": [3, 3, 1]})[0] == "reproduced"
    assert decide(r, {"err": (0.01, 0.09), "kl": [3, 2, 1], "level": 0.8})[0] == "not reproducible here"
    with pytest.raises(ValueError, match="missing \\['level'\\]"):
        decide(r, {"err": 0.01, "kl": [3, 2, 1]}, claim="c")
    with pytest.raises(ValueError, match="unknown \\['extra'\\]"):
        decide(r, {"err": 0.01, "kl": [3, 2, 1], "level": 0.8, "extra": 1}, claim="c")
    with pytest.raises(ValueError, match="at least two numbers"):
        decide(r, {"err": 0.01, "kl": [3], "level": 0.8}, claim="c")


def test_a_bare_boolean_is_not_a_measurement():
    with pytest.raises(ValueError, match="bare boolean"):
        decide({"kind": "threshold", "op": ">", "bound": 0}, True, claim="c")
    with pytest.raises(ValueError, match="qualitative.*removed"):
        validate({"kind": "qualitative", "test": "t", "tests": "x"}, "c")


def test_min_n_and_requires_say_too_little_data_not_differs():
    r = {"kind": "threshold", "op": ">=", "bound": 0.75, "min_n": 25}
    verdict, why = decide(r, 1.0, n=2)  # perfect accuracy on 2 prompts shows nothing
    assert verdict == "not reproducible here" and "2" in why and "25" in why
    assert decide(r, 0.8, n=25)[0] == "reproduced"
    assert decide(r, 0.5, n=150)[0] == "differs"
    with pytest.raises(ValueError, match="n must be given"):
        decide(r, 0.8, claim="c1")
    q = {"kind": "interval", "lo": -0.5, "hi": 0.5,
         "requires": [{"quantity": "iters", "op": ">=", "bound": 100, "measure": "matched iteration"}]}
    verdict, why = decide(q, (-3.0, -1.0), given={"iters": 41})
    assert verdict == "not reproducible here" and "precondition" in why and "matched iteration 41" in why
    assert decide(q, (-3.0, -1.0), given={"iters": 150})[0] == "differs"
    with pytest.raises(ValueError, match="given="):
        decide(q, (-3.0, -1.0), claim="c")


def test_not_measured_and_not_reproducible_and_nan():
    nr = {"kind": "not_reproducible", "reason": "needs 8B weights"}
    assert decide(nr, 3.0) == ("not reproducible here", "needs 8B weights")
    t = {"kind": "threshold", "op": "<", "bound": 1, "needs": "a GPU run of x"}
    assert decide(t, None) == ("not reproducible here", "not measured in this run (needs a GPU run of x)")
    assert decide(t, float("nan"))[0] == "not reproducible here"
    assert decide(t, (0.1, float("nan")))[0] == "not reproducible here"


@pytest.mark.parametrize("rule, field", [
    ({"kind": "fuzzy"}, "kind"),
    ({"kind": "tolerance", "value": 1}, "rel"),
    ({"kind": "tolerance", "value": "x", "rel": 0.1}, "value"),
    ({"kind": "tolerance", "value": 1, "rel": math.inf}, "rel"),
    ({"kind": "threshold", "op": "==", "bound": 1}, "op"),
    ({"kind": "interval", "lo": 2, "hi": 1}, "lo"),
    ({"kind": "threshold", "op": "<", "bound": 1, "min_n": 0}, "min_n"),
    ({"kind": "threshold", "op": "<", "bound": 1, "colour": "red"}, "colour"),
    ({"kind": "threshold", "op": "<", "bound": 1, "checked": ""}, "checked"),
    ({"kind": "all", "of": []}, "of"),
    ({"kind": "all", "of": [{"quantity": "a", "op": "<", "bound": 1}]}, "measure"),
    ({"kind": "all", "of": [{"quantity": "a b", "op": "<", "bound": 1, "measure": "m"}]}, "quantity"),
    ({"kind": "all", "of": [{"quantity": "a", "monotone": "up", "measure": "m"}]}, "monotone"),
    ({"kind": "all", "of": [{"quantity": "a", "op": "<", "bound": 1, "measure": "m"},
                            {"quantity": "a", "op": ">", "bound": 0, "measure": "m"}]}, "twice"),
    ({"kind": "not_reproducible"}, "reason"),
    ({"kind": "not_reproducible", "reason": "r", "checked": "c"}, "checked"),
])
def test_validation_names_claim_and_field(rule, field):
    with pytest.raises(ValueError, match=f"my-claim.*{field}"):
        validate(rule, "my-claim")


@pytest.mark.parametrize("rule", [
    {"kind": "threshold", "op": ">=", "bound": -math.inf},
    {"kind": "interval", "lo": -math.inf, "hi": math.inf},
    {"kind": "all", "of": [{"quantity": "a", "op": "<=", "bound": math.inf, "measure": "m"}]},
])
def test_a_rule_no_measurement_can_fail_is_refused(rule):
    with pytest.raises(ValueError, match="cannot fail"):
        validate(rule, "c")


def test_witnesses_fall_on_both_sides():
    for rule in ({"kind": "threshold", "op": "<", "bound": 1e-12}, {"kind": "threshold", "op": ">=", "bound": 82},
                 {"kind": "tolerance", "value": 1.0, "abs": 0}, {"kind": "interval", "lo": -math.inf, "hi": 0.0},
                 {"kind": "all", "of": [{"quantity": "q", "monotone": "nonincreasing", "measure": "m"},
                                        {"quantity": "r", "lo": 0.5, "hi": 2, "measure": "m"}]}):
        assert decide(rule, witness(rule, "pass"))[0] == "reproduced", rule
        assert decide(rule, witness(rule, "fail"))[0] == "differs", rule
        assert can_flip(rule)
    ci = witness({"kind": "interval", "lo": 0.8, "hi": 1.25}, "fail", like=[0.9, 1.0])
    assert isinstance(ci, list) and len(ci) == 2


def test_describe():
    assert describe({"kind": "tolerance", "value": 136, "rel": 0.02, "measure": "B"}) == "B = 136 ± 2%"
    assert describe({"kind": "threshold", "op": "<=", "bound": 0.01, "min_n": 30}) == "ours <= 0.01 (n >= 30)"
    assert describe({"kind": "not_reproducible", "reason": "no GPU"}).startswith("not reproducible here")
    text = describe({"kind": "all", "of": [{"quantity": "a", "op": "<", "bound": 1, "measure": "error"}],
                     "requires": [{"quantity": "n", "op": ">=", "bound": 3, "measure": "seeds"}]})
    assert text == "error < 1; judged only if seeds >= 3"


def test_rule_hash_is_canonical_and_sensitive():
    a = {"kind": "threshold", "op": "<", "bound": 1.0}
    assert rule_hash(a) == rule_hash({"bound": 1.0, "kind": "threshold", "op": "<"})
    assert rule_hash(a) != rule_hash(dict(a, bound=1.01)) and len(rule_hash(a)) == 64


# -- the register's rules --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def claims():
    from kvlib.publish.verdicts import load_claims

    return load_claims()


def test_every_claim_names_both_settings_and_a_rule_or_its_primary(claims):
    assert claims
    for cid, c in claims.items():
        assert c["setting"].strip() and c["ours_setting"].strip(), cid
        if "context_of" in c:
            assert "rule" not in c and "context_of" not in claims[c["context_of"]], cid
        else:
            assert describe(c["rule"]) and decide(c["rule"], None, claim=cid)[0] in VERDICTS


def test_every_checked_claim_says_why_it_is_an_identity(claims):
    checked = [c for c in claims.values() if "checked" in c.get("rule", {})]
    assert len(checked) >= 16  # the identities, byte accounts and acceptance tests of the register
    for c in checked:
        assert len(c["rule"]["checked"].split()) >= 3, c["id"]


def test_every_decidable_rule_can_fail(claims):
    """A test that every rule can fail: a measurement on each side of each rule flips decide()."""
    for cid, c in claims.items():
        rule = c.get("rule")
        if rule is None or rule["kind"] == "not_reproducible":
            continue
        assert can_flip(rule), f"{cid}: no measurement makes its rule fail"


def test_every_recorded_verdict_flips_on_the_other_side(claims):
    """For each committed claim record judged under the current rule, a measurement shaped like the recorded one
    but on the other side of the rule gives the other verdict."""
    import glob
    import json

    from kvlib.publish.provenance import repo_root
    from kvlib.publish.verdicts import rule_of

    seen = 0
    for path in glob.glob(str(repo_root() / "data" / "results" / "*" / "*.json")):
        for rec in json.loads(open(path).read()).get("claims", []):
            c = claims.get(rec["id"])
            if c is None or "rule" not in c or rec.get("rule_sha256") != rule_hash(rule_of(c)):
                continue
            if rec["verdict"] not in ("reproduced", "checked", "differs"):
                continue
            other = "fail" if rec["verdict"] != "differs" else "pass"
            flipped = decide(c["rule"], witness(c["rule"], other, rec["measured"]),
                             max(rec.get("n") or 0, c["rule"].get("min_n", 0)) or None,
                             given={k: v for k, v in (rec.get("given") or {}).items()})
            assert flipped[0] != rec["verdict"], rec["id"]
            seen += 1
    if not seen:
        pytest.skip("no committed result was judged under the current rules yet (re-execute the notebooks)")


def test_judge_records_what_it_was_judged_under(claims):
    from kvlib.publish import verdicts

    rec = verdicts.judge("witcert-fallback-block", ours="2 blocks", measured=2.0)
    assert rec["verdict"] == "differs" and rec["role"] == "primary"
    assert rec["rule_sha256"] == rule_hash(verdicts.rule_of(claims["witcert-fallback-block"]))
    assert rec["claims_file"] == "data/claims/witcert_certificate.yml" and rec["claims_commit"]
    assert rec["judged_at"] and rec["setting"] == claims["witcert-fallback-block"]["ours_setting"]
    assert verdicts.JUDGED["witcert-fallback-block"] == rec["rule_sha256"]
    ctx = verdicts.judge("witcert-sdpa-ratio", ours="7.25x", measured=7.25)
    assert ctx["verdict"] == "context" and ctx["role"] == "context" and ctx["why"] == ""
    assert stale_rules({"witcert-fallback-block": rec["rule_sha256"]}) == []
    assert stale_rules({"witcert-fallback-block": "0" * 64, "gone": "x"}) == [
        "gone (no longer in data/claims)", "witcert-fallback-block"]


def test_run_claim_decides_and_refuses_verdict():
    from kvlib.publish.run import Run

    run = Run("t", profile="ci")
    run.claim("witcert-fallback-block", ours="median 2 blocks", measured=2.0)
    rec = run.claims[-1]
    assert rec["verdict"] == "differs" and rec["rule"] and rec["measured"] == 2.0 and rec["rule_sha256"]
    with pytest.raises(TypeError, match="verdict"):
        run.claim("witcert-fallback-block", ours="x", verdict="reproduced")
    assert list(run.claims_frame().columns) == ["claim", "paper (setting)", "ours (setting)", "verdict"]


def test_claims_table_four_columns_both_settings_and_a_fold(monkeypatch):
    # The book parses displayed Markdown as MyST: a list-table with a caption (its <caption>), cells kept inline,
    # then the rules and reasons in a dropdown.
    import IPython.display

    from kvlib.publish.run import Run, load_claims

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj.data))
    run = Run("t", profile="ci")
    run.claim("witcert-latency-other-kernels", ours="7.25x", measured=7.25)  # a context row, given first
    run.claim("witcert-latency-vs-fp16", ours="1.20x", measured=1.20)
    run.claims_table()
    table = shown[-1]
    head = table.splitlines()[0]
    assert head.startswith(":::{list-table} Paper vs this run: 2 claims of this page") and "ci profile" in head
    assert "* - claim" in table and "  - paper (setting)" in table and "  - ours (setting)" in table
    c = load_claims()["witcert-latency-vs-fp16"]
    assert f"  - 1.20x; *{c['ours_setting']}*" in table and c["setting"] in table
    rows = table.split(":::{admonition}")[0]
    assert rows.index("5.41x slower") < rows.index("↳ ")  # the context row sits beneath its primary
    assert "**differs**" in table and "  - *context*" in table
    fold = table.split(":::{admonition} Rules and reasons\n:class: dropdown", 1)[1]
    assert "Rule: certified INT8 / SDPA bf16 latency at the paper's shape = 5.41 ± 15%." in fold
    assert "Judged under rule `" in fold
