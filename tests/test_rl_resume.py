"""Checkpoint and resume of a GRPO run (dev.rlvr_runs train, --tiny on the CPU): 4 iterations straight equal
2 + resume 2 (history and weights), and a resume without a checkpoint refuses to start afresh."""

import json

import pytest
import torch

from dev import rlvr_runs as run

TIMED = ("seconds", "memory")  # wall-clock metrics differ between any two runs


def _common(tmp, out, ckpt=None):
    cal = tmp / "calibration.json"
    if not cal.exists():
        from kvlib.rl import task

        cal.write_text(json.dumps({"difficulty": dict(task.DIFFICULTY)}))
    a = ["train", "--tiny", "--device", "cpu", "--arm", "kv4rl", "--seed", "3", "--out", str(out),
         "--calibration", str(cal), "--results", str(tmp / "results"), "--iterations", "4", "--prompts", "2",
         "--group", "2", "--max-new-tokens", "6", "--micro-batch", "2", "--heldout", "2", "--eval-batch", "2",
         "--train-pool", "16", "--shots", "2", "--budget-s", "900", "--lr", "1e-3"]
    if ckpt:
        a += ["--ckpt-dir", str(ckpt)]
    return a


def _deterministic(hist):
    return {k: v for k, v in hist.items() if not any(t in k for t in TIMED)}


def test_resume_continues_bit_compatibly(tmp_path):
    assert run.main(_common(tmp_path, tmp_path / "a", tmp_path / "cka")) == 0
    straight = json.loads((tmp_path / "a" / "rlvr" / "kv4rl_seed3.json").read_text())
    w_straight = torch.load(tmp_path / "cka" / "kv4rl_seed3" / run.CKPT_STATE, weights_only=False)["policy"]
    ck = tmp_path / "ckb"
    assert run.main(_common(tmp_path, tmp_path / "b", ck) + ["--segment-iterations", "2"]) == 0
    first = json.loads((tmp_path / "b" / "rlvr" / "kv4rl_seed3.json").read_text())
    assert first["iterations_done"] == 2 and first["status"] == "partial" and first["resumable"]
    w_mid = torch.load(ck / "kv4rl_seed3" / run.CKPT_STATE, weights_only=False)["policy"]
    assert run.main(_common(tmp_path, tmp_path / "c", ck) + ["--resume"]) == 0
    resumed = json.loads((tmp_path / "c" / "rlvr" / "kv4rl_seed3.json").read_text())
    w_resumed = torch.load(ck / "kv4rl_seed3" / run.CKPT_STATE, weights_only=False)["policy"]
    assert straight["status"] == resumed["status"] == "complete"
    assert resumed["n_segments"] == 2 and [s["first_iteration"] for s in resumed["segments"]] == [0, 2]
    assert all(s["commit"] for s in resumed["segments"])
    assert _deterministic(resumed["history"]) == _deterministic(straight["history"])
    assert straight["history"]["reward_mean"] is not None and len(straight["history"]["iteration"]) == 4
    for k, v in w_straight.items():
        assert torch.equal(v, w_resumed[k]), k
    # the second segment trained (a resume that only reloaded would keep the segment-1 weights)
    assert any(not torch.equal(v, w_mid[k]) for k, v in w_resumed.items())
    assert resumed["eval"]["final"]["uids"] == straight["eval"]["final"]["uids"]
    assert resumed["eval"]["final"]["correct"] == straight["eval"]["final"]["correct"]


def test_resume_without_checkpoint_refuses(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint"):
        run.main(_common(tmp_path, tmp_path / "o", tmp_path / "empty") + ["--resume"])
    # `all --resume` says so and fails before loading anything
    rc = run.main(["all", "--device", "cpu", "--tiny", "--out", str(tmp_path / "o2"), "--ckpt-dir",
                   str(tmp_path / "empty"), "--resume"])
    assert rc == 2


def test_dynamic_sampling_run_records_and_resumes_bit_compatibly(tmp_path):
    """`train --dynamic-sampling`: every iteration records its rounds and counts within the target and the cap,
    the rollout info counts the rounds, and a resumed run (the later rounds draw from the run's generator too)
    equals the straight one."""
    dyn = ["--dynamic-sampling", "--target-groups", "2", "--max-sampling-rounds", "2", "--iterations", "3"]
    assert run.main(_common(tmp_path, tmp_path / "a", tmp_path / "cka") + dyn) == 0
    straight = json.loads((tmp_path / "a" / "rlvr" / "kv4rl_seed3.json").read_text())
    h = straight["history"]
    assert straight["config"]["dynamic_sampling"] and straight["config"]["target_groups"] == 2
    assert len(h["dyn_sampling_rounds"]) == 3
    for rounds, kept, sampled, reached in zip(h["dyn_sampling_rounds"], h["dyn_groups_kept"], h["dyn_groups_sampled"],
                                              h["dyn_target_reached"], strict=True):
        assert 1 <= rounds <= 2 and sampled == 2 * rounds and 0 <= kept <= 2
        assert reached == float(kept == 2) and (reached or rounds == 2)  # short of the target only at the cap
    assert [x["rounds"] for x in straight["rollout_info"]] == h["dyn_sampling_rounds"]
    ck = tmp_path / "ckb"
    assert run.main(_common(tmp_path, tmp_path / "b", ck) + dyn + ["--segment-iterations", "1"]) == 0
    assert run.main(_common(tmp_path, tmp_path / "c", ck) + dyn + ["--resume"]) == 0
    resumed = json.loads((tmp_path / "c" / "rlvr" / "kv4rl_seed3.json").read_text())
    assert _deterministic(resumed["history"]) == _deterministic(h)


def test_all_forwards_dynamic_sampling_to_the_runs(monkeypatch):
    """`all` starts each run with the parent's dynamic-sampling options (and none of them when off)."""
    seen = []
    monkeypatch.setattr(run, "run_all", lambda args: seen.append(args) or 0)
    run.main(["all", "--device", "cpu", "--tiny", "--dynamic-sampling", "--target-groups", "3",
              "--max-sampling-rounds", "5"])
    run.main(["all", "--device", "cpu", "--tiny"])
    on, off = (run._forward_args(a) for a in seen)
    assert "--dynamic-sampling" in on and on[on.index("--target-groups") + 1] == "3"
    assert on[on.index("--max-sampling-rounds") + 1] == "5"
    assert "--dynamic-sampling" not in off and run.grpo_config(seen[1]).dynamic_sampling is False
    cfg = run.grpo_config(seen[0])
    assert cfg.dynamic_sampling and cfg.target_groups == 3 and cfg.max_sampling_rounds == 5


def test_run_all_writes_provenance_into_every_file(tmp_path):
    """`all` (tiny, CPU): the shared files it writes (task setting, rollout timing, initial evaluation) and the
    run record each say which commit, device and parameters produced them."""
    rc = run.main(["all", "--device", "cpu", "--tiny", "--out", str(tmp_path / "o"), "--results",
                   str(tmp_path / "res"), "--arms", "kv4", "--n-seeds", "1", "--iterations", "1", "--prompts", "2",
                   "--group", "2", "--max-new-tokens", "6", "--micro-batch", "2", "--heldout", "2", "--eval-batch",
                   "2", "--train-pool", "16", "--shots", "2", "--budget-s", "600"])
    assert rc == 0
    for name in ("calibration.json", "timing.json", "initial_eval.json", "kv4_seed0.json"):
        prov = json.loads((tmp_path / "o" / "rlvr" / name).read_text())["provenance"]
        assert prov["commit"] and prov["device"]["device"] == "cpu" and prov["params"]["iterations"] == 1, name
