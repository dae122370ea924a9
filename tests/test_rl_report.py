"""The RLVR chapter's verdict rules on synthetic run records: each rule can come out either way."""

import json

import pytest

from kvlib.rl import report


def _rec(arm, seed, acc, lengths, refkl, n=64):
    correct = [1] * int(round(acc * n)) + [0] * (n - int(round(acc * n)))
    ev = {"accuracy": sum(correct) / n, "correct": correct, "uids": [f"u{i}" for i in range(n)]}
    return {"arm": arm, "seed": seed, "status": "complete", "iterations_done": len(lengths),
            "history": {"reward_mean": [0.3] * len(lengths), "response_length_mean": lengths, "ref_kl_k3": refkl,
                        "sampler_learner_kl_k3": [1e-3] * len(lengths), "sampler_learner_kl_k1": [1e-3] * len(lengths),
                        "rollout_seconds": [1.0] * len(lengths)},
            "rollout_info": [{"decode_paths": [f"{arm}-triton"], "graphed": True}] * len(lengths),
            "eval": {"initial": ev, "final": ev}}


def _stretch(v, iters):
    """A curve of len(v) points as ``iters`` iterations (each point held for iters / len(v) of them)."""
    k = -(-iters // len(v))
    return [x for x in v for _ in range(k)][:iters]


def _data(accs, kv4_len, kv4_kl, speedup=None, iters=120):
    """Synthetic runs of ``iters`` iterations (the rules judge only from 100 iterations on)."""
    runs = {}
    kv4_len, kv4_kl = _stretch(kv4_len, iters), _stretch(kv4_kl, iters)
    for arm, per_seed in accs.items():
        for s, a in enumerate(per_seed):
            lengths = kv4_len if arm == "kv4" else [100.0] * iters
            kl = kv4_kl if arm == "kv4" else [1e-3] * iters
            runs[(arm, s)] = _rec(arm, s, a, lengths, kl)
    summary = {"kv4rl": {"speedup_vs_bf16": speedup}}
    timing = None if speedup is None else {"batch": 64, "steps": 256, "summary": summary}
    return {"runs": runs, "timing": timing, "calibration": None}


def _by_id(data):
    return {v["id"]: v for v in report.verdicts(data)}


def test_no_runs_is_not_measured():
    v = _by_id({"runs": {}, "timing": None, "calibration": None})
    assert len(v) == 4
    assert all(x["verdict"] == "not reproducible here" and x["why"].startswith("not measured") for x in v.values())


def test_kv4_degradation_and_trajectory_reproduced():
    short, rising = [100.0, 95, 90, 85, 80, 75, 70, 65], [1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3, 7e-3, 8e-3]
    d = _data({"bf16": [0.50, 0.52, 0.55], "kv4": [0.30, 0.33, 0.31], "kv4rl": [0.50, 0.52, 0.55]}, short, rising,
              speedup=2.0)
    v = _by_id(d)
    assert v["kv4rl-rlvr-kv4-below-bf16"]["verdict"] == "reproduced"
    assert v["kv4rl-rlvr-kv4-trajectory"]["verdict"] == "reproduced"
    assert v["kv4rl-rlvr-rollout-speedup"]["verdict"] == "reproduced"
    assert v["kv4rl-rlvr-accuracy-parity"]["verdict"] == "reproduced"  # identical per seed: CI [0, 0]


def test_no_degradation_and_slow_rollout_differ():
    flat, kl = [100.0] * 8, [1e-3] * 8
    d = _data({"bf16": [0.50, 0.52, 0.55], "kv4": [0.52, 0.53, 0.57], "kv4rl": [0.40, 0.41, 0.44]}, flat, kl,
              speedup=0.8)
    v = _by_id(d)
    assert v["kv4rl-rlvr-kv4-below-bf16"]["verdict"] == "differs"
    assert v["kv4rl-rlvr-accuracy-parity"]["verdict"] == "differs"  # ~-10.6 pp, the CI far below -0.5
    assert v["kv4rl-rlvr-rollout-speedup"]["verdict"] == "differs"
    assert v["kv4rl-rlvr-kv4-trajectory"]["verdict"] == "differs"


def test_two_seeds_are_underpowered():
    d = _data({"bf16": [0.5, 0.52], "kv4": [0.3, 0.3], "kv4rl": [0.5, 0.5]}, [90.0] * 8, [1e-3] * 8)
    v = _by_id(d)
    for cid in ("kv4rl-rlvr-accuracy-parity", "kv4rl-rlvr-kv4-below-bf16", "kv4rl-rlvr-kv4-trajectory"):
        assert v[cid]["verdict"] == "not reproducible here" and "below the 3 needed" in v[cid]["why"], cid


def test_short_runs_are_too_little_data_however_large_the_effect():
    """Runs that stopped at iteration 41 of 200 are not judged, even with a large, consistent KV4 deficit."""
    short, rising = [100.0, 95, 90, 85, 80, 75, 70, 65], [1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3, 7e-3, 8e-3]
    d = _data({"bf16": [0.50, 0.52, 0.55], "kv4": [0.30, 0.33, 0.31], "kv4rl": [0.50, 0.52, 0.55]}, short, rising,
              iters=41)
    v = _by_id(d)
    for cid in ("kv4rl-rlvr-accuracy-parity", "kv4rl-rlvr-kv4-below-bf16", "kv4rl-rlvr-kv4-trajectory"):
        assert v[cid]["verdict"] == "not reproducible here" and "iterations every run reached 41" in v[cid]["why"]


def test_kv4_below_bf16_needs_the_contrast_with_kv4rl():
    """KV4 below BF16 but KV4-RL just as far below: the paper's KV4 vs KV4-RL contrast is missing."""
    d = _data({"bf16": [0.50, 0.52, 0.55], "kv4": [0.30, 0.33, 0.31], "kv4rl": [0.31, 0.34, 0.30]},
              [100.0] * 8, [1e-3] * 8)
    v = _by_id(d)
    assert v["kv4rl-rlvr-kv4-below-bf16"]["verdict"] != "reproduced"


def test_load_and_tables(tmp_path):
    d = _data({"bf16": [0.5], "kv4": [0.4]}, [90.0] * 8, [1e-3] * 8)
    for (arm, s), r in d["runs"].items():
        (tmp_path / f"{arm}_seed{s}.json").write_text(json.dumps(r))
    got = report.load(tmp_path)
    assert set(got["runs"]) == {("bf16", 0), ("kv4", 0)} and got["timing"] is None
    assert len(report.runs_table(got["runs"])) == 2
    acc = report.accuracy_table(got["runs"])
    assert list(acc["arm"]) == ["bf16", "kv4"]
    assert abs(acc.loc[1, "vs bf16 there, pp"] - (-9.375)) < 1e-9  # 26/64 - 32/64 at the matched iteration 8


def _segmented(rec, evals):
    """``rec`` with held-out evaluations at the ends of device calls: [(iteration, accuracy), ...]."""
    rec = json.loads(json.dumps(rec))
    rec["eval"]["segment_final"] = [{"segment": i, "iterations": it, "accuracy": a} for i, (it, a) in enumerate(evals)]
    rec["iterations_done"] = evals[-1][0]
    rec["eval"]["final"]["accuracy"] = evals[-1][1]
    for k in ("reward_mean", "response_length_mean", "ref_kl_k3", "rollout_seconds"):
        rec["history"][k] = (rec["history"][k] * 100)[:evals[-1][0]]
    return rec


def test_heldout_interpolation_known_answer_and_no_extrapolation():
    r = _segmented(_rec("bf16", 0, 0.1, [1.0] * 8, [1e-3] * 8), [(20, 0.3), (60, 0.7)])
    r["eval"]["initial"]["accuracy"] = 0.1
    it, acc = report.heldout_curve(r)
    assert list(it) == [0, 20, 60] and list(acc) == [0.1, 0.3, 0.7]
    assert abs(report.heldout_at(r, 40) - 0.5) < 1e-12 and abs(report.heldout_at(r, 10) - 0.2) < 1e-12
    with pytest.raises(ValueError, match="iteration"):
        report.heldout_at(r, 61)


def test_unequal_runs_are_compared_at_the_matched_iteration():
    """bf16 ran longer and kept improving; at the iteration every run reached the arms are equal, so the
    parity claim must not read bf16's extra iterations as a kv4rl deficit."""
    runs = {}
    for s in range(3):
        b = _segmented(_rec("bf16", s, 0.1, [1.0] * 8, [1e-3] * 8), [(20, 0.30 + 0.01 * s), (40, 0.5), (90, 0.9)])
        q = _segmented(_rec("kv4rl", s, 0.1, [1.0] * 8, [1e-3] * 8), [(20, 0.30 + 0.01 * s), (40, 0.5)])
        for x in (b, q):
            x["eval"]["initial"]["accuracy"] = 0.1
        runs[("bf16", s)], runs[("kv4rl", s)] = b, q
    assert report.matched_iteration(runs) == 40
    d = report.paired_difference(runs, "kv4rl", at=40)
    assert d["diffs_pp"] == [0.0, 0.0, 0.0] and "problem_ci_pp" not in d
    v = _by_id({"runs": runs, "timing": None, "calibration": None})
    assert v["kv4rl-rlvr-accuracy-parity"]["verdict"] == "not reproducible here"  # 40 iterations: not judged
    assert "precondition" in v["kv4rl-rlvr-accuracy-parity"]["why"]
    assert report.paired_difference(runs, "kv4rl")["mean_pp"] < -30  # the unequal ends would say otherwise
    cum = report.cumulative_rollout(runs)
    assert cum["bf16"]["seconds"] == cum["kv4rl"]["seconds"] == 3 * 40.0 and cum["kv4rl"]["speedup_vs_bf16"] == 1.0


def test_smooth_and_sampling_table():
    assert list(report.smooth([0.0, 2.0, 4.0, 6.0], 2)) == [0.0, 1.0, 3.0, 5.0]
    d = _data({"bf16": [0.5, 0.6], "kv4": [0.4, 0.4]}, [90.0] * 8, [1e-3] * 8)
    for r in d["runs"].values():
        r["history"]["informative_group_fraction"] = [0.5] * 8
    t = report.sampling_table({"static": d["runs"]})
    assert list(t["arm"]) == ["bf16", "kv4"] and (t["mixed-reward groups"] == 0.5).all()
    assert "rounds / iteration" not in t.columns
