"""kvlib.analysis.generators: the soundness trials with the generator as a parameter reproduce certify_trials for
Philox4x32-10; the stream battery rejects weak generators and the multiple-testing rule is Bonferroni."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlib.analysis.generators import (
    _birthday_spacings,
    event_homogeneity,
    quantize_keys,
    soundness,
    soundness_trials,
    stream_tests,
    stream_verdict,
)


@pytest.mark.parametrize("layout", ["h8", "w24"])
def test_soundness_trials_equal_certify_trials_for_philox10(layout):
    from kvlib.certify.bound import certify_trials, synthetic_keys

    g = torch.Generator().manual_seed(1)
    k = synthetic_keys("massive", 48, 64, generator=g)
    q = 3 * torch.randn(10, 64, generator=g)
    a = certify_trials(k, q, trials=2, deltas=(0.1, 0.01), seed0=5, layout=layout)
    b = soundness_trials(k, q, generator="philox4x32-10", trials=2, deltas=(0.1, 0.01), seed0=5, layout=layout)
    for f in ("tv", "cert", "event"):
        assert torch.equal(a[f], b[f]), f


def test_quantize_keys_is_the_write_path_for_philox10():
    from kvlib.formats.dither_int8 import dither_quantize

    x = torch.randn(30, 64, generator=torch.Generator().manual_seed(3))
    qt = dither_quantize(x, layer=0, kv_head=0, slots=torch.arange(30), seed=11, dither_layout="h8")
    w = quantize_keys(x, generator="philox4x32-10", seed=11)
    assert torch.equal(w["codes"], qt.codes) and torch.equal(w["scales"], qt.scales)
    w7 = quantize_keys(x, generator="philox4x32-7", seed=11)
    assert not torch.equal(w7["codes"], qt.codes)  # another dither, other codes


def test_soundness_rows_state_the_rule():
    rows = soundness("threefry4x32-13", families=("heavy",), S=32, d=64, rows=8, trials=3, deltas=(0.5, 0.01))
    assert [r["delta"] for r in rows] == [0.5, 0.01] and all(r["pairs"] == 24 for r in rows)
    for r in rows:
        assert r["sound"] == (r["rate 95% hi"] <= r["delta"] or r["TV > cert"] == 0)
        assert 0 <= r["event fails"] <= r["pairs"]


def test_battery_passes_philox10_and_rejects_weak_controls():
    kw = dict(n_slots=1 << 10, avalanche_n=1 << 9)
    assert stream_verdict(stream_tests("philox", 10, **kw))["pass"]
    for fam, rounds in (("philox", 3), ("threefry", 4)):
        v = stream_verdict(stream_tests(fam, rounds, **kw))
        assert not v["pass"] and v["failed"], (fam, rounds)


def test_bonferroni_and_holm_on_known_p_values():
    rows = [{"test": f"t{i}", "p": p} for i, p in enumerate([0.5, 0.002, 0.0004, 0.2])]
    v = stream_verdict(rows, alpha=0.01)  # threshold 0.0025: t1 and t2 rejected
    assert v["threshold"] == 0.0025 and v["failed"] == ["t1", "t2"] and not v["pass"]
    assert v["holm_rejections"] == 2  # 0.0004 <= 0.01/4, 0.002 <= 0.01/3, 0.2 > 0.01/2
    assert stream_verdict([{"test": "a", "p": 0.3}])["pass"]


def test_birthday_spacings_accepts_uniform_and_rejects_a_lattice():
    ps = [_birthday_spacings(np.random.default_rng(s).integers(0, 2**24, 1 << 17), 512, 24, seed=100 + s)[2]
          for s in range(4)]
    assert min(ps) > 1e-3  # uniform values against the PCG64 reference: no systematic rejection
    lattice = (np.arange(1 << 16) * 4099) % (1 << 24)  # evenly spread: every spacing repeats
    assert _birthday_spacings(lattice, 512, 24)[2] < 1e-6


def test_event_homogeneity_flags_a_shifted_count():
    row = lambda f: {"keys": "gaussian", "delta": 0.5, "pairs": 10000, "event fails": f}  # noqa: E731
    same = event_homogeneity({"a": [row(200)], "b": [row(210)], "c": [row(195)]})[0]
    assert same["p"] > 0.05
    assert event_homogeneity({"a": [row(200)], "b": [row(400)]})[0]["p"] < 1e-10
    assert event_homogeneity({"a": [row(0)], "b": [row(0)]})[0]["p"] == 1.0
