"""The transformers ``Cache`` contract for the gated cache (issue 24 items 5-6): beam search, batch repeat/select,
crop with assisted and prompt-lookup decoding, continuing a conversation, deepcopy, on tiny random Llama models
on CPU (the checks of tests/test_hf_contract.py, run on kinds of gated caches).

Two properties pin the gate's batch operations down:

- ``tau=0`` with an fp32 shadow repairs every (row, KV head) group at every decode step from the shadow, so the
  gated cache must give DynamicCache's tokens (logits to fp32 rounding), whatever the stored format: only a
  shadow that follows every reorder, repeat, selection and crop can. Both repair paths (eager and fixed-shape)
  and three pool kinds (dithered INT8: codes never move; rtn-int8: pages are copied; kivi2: an unpaged store by
  row) are run.
- ``tau=inf`` never repairs, so the gated cache must give exactly the ungated cache's tokens.

A mutant whose shadow does not follow a selection must fail the beam check (so it cannot pass vacuously).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from hf_helpers import EXACT_TOL, Kind, prompt, repetitive_prompt, step, tiny_model
from test_hf_contract import (
    check_batch_ops,
    check_beam,
    check_continue,
    check_crop,
    check_deepcopy,
    check_greedy,
    check_padded,
)

from kvlib.gate import GatedCache, make_gated_cache
from kvlib.hf.cache import make_cache

torch.set_num_threads(1)

SHORT_KIVI = {"group": 4, "residual": 4}  # a 2-bit body within the prompts


def _opts(fmt: str) -> dict[str, Any]:
    return dict(SHORT_KIVI) if fmt == "kivi2" else {}


def exact_kind(fmt: str, max_repairs: int | None = None) -> Kind:
    """tau=0, fp32 shadow: every group repaired every step; DynamicCache's tokens."""
    def make(model: Any) -> GatedCache:
        return make_gated_cache(fmt, model.config, tau=0.0, shadow_dtype=torch.float32,
                                max_repairs_per_step=max_repairs, **_opts(fmt))
    path = "eager" if max_repairs is None else f"fixed{max_repairs}"
    return Kind(f"gated-tau0:{fmt}:{path}", make, exact=True, tol=EXACT_TOL)


#: a budget no step of these checks exceeds (beam search: 2 prompts x 3 beams x 2 KV heads = 12 groups a layer)
BIG = 16

EXACT_KINDS = [exact_kind("dither-int8"), exact_kind("rtn-int8"), exact_kind("dither-int8", BIG),
               exact_kind("rtn-int8", BIG)]
CHECKS = {"beam": check_beam, "batch_ops": check_batch_ops, "continue": check_continue, "deepcopy": check_deepcopy}


def _all_repaired(cache: GatedCache) -> None:
    s = cache.gate_summary()
    assert s["unrepaired"] == 0 and s["repair_events"] > 0 and s["n_over"] == s["n_certs"]


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("kind", EXACT_KINDS, ids=repr)
def test_tau_zero_gives_dynamic_cache_tokens(kind: Kind, check: str) -> None:
    CHECKS[check](kind)


@pytest.mark.parametrize("kind", EXACT_KINDS, ids=repr)
def test_tau_zero_crop_assisted_and_prompt_lookup(kind: Kind) -> None:
    check_crop(kind)


@pytest.mark.parametrize("kind", [exact_kind("dither-int8"), exact_kind("dither-int8", BIG)], ids=repr)
def test_tau_zero_greedy_and_padded(kind: Kind) -> None:
    check_greedy(kind)
    check_padded(kind)


@pytest.mark.parametrize("check", ["beam", "batch_ops", "continue"])
@pytest.mark.parametrize("max_repairs", [None, BIG])
def test_tau_zero_unpaged_stateful_store(check: str, max_repairs: int | None) -> None:
    """kivi2 (an unpaged stateful store): the shadow is by row and position and follows the rows."""
    CHECKS[check](exact_kind("kivi2", max_repairs))


def test_tau_zero_beam_search_repairs_every_group() -> None:
    """The tokens above come from the shadow: every certificate over tau=0, every group repaired, none left."""
    model = tiny_model()
    for max_repairs in (None, BIG):
        cache = exact_kind("rtn-int8", max_repairs).make(model)
        model.generate(prompt(2, 10, seed=4), past_key_values=cache, num_beams=3, max_new_tokens=6, do_sample=False)
        _all_repaired(cache)
        s = cache.gate_summary()
        assert s["repair_path"] == ("eager" if max_repairs is None else "fixed")
        assert s["repair_events"] == s["n_certs"] // (cache.n_heads // cache.n_kv)  # one per group and step


# -- tau = inf: the gate never repairs, the tokens are the ungated cache's -----------------------------------

def _ungated(fmt: str):
    return lambda model: make_cache(fmt, model.config, block_size=32, **_opts(fmt))


def _never(fmt: str, max_repairs: int | None = None):
    return lambda model: make_gated_cache(fmt, model.config, tau=float("inf"), max_repairs_per_step=max_repairs,
                                          **_opts(fmt))


@pytest.mark.parametrize("max_repairs", [None, 2])
@pytest.mark.parametrize("fmt", ["dither-int8", "rtn-int8"])
def test_tau_inf_gives_the_ungated_tokens(fmt: str, max_repairs: int | None) -> None:
    model, asst = tiny_model(), tiny_model("llama", 32, seed=1)
    ids = prompt(2, 10, seed=4)
    runs = {
        "beam": dict(input_ids=ids, num_beams=2, num_return_sequences=2, max_new_tokens=8),
        "assisted": dict(input_ids=prompt(1, 12, seed=8), assistant_model=asst, max_new_tokens=12),
        "prompt lookup": dict(input_ids=repetitive_prompt(24, seed=9), prompt_lookup_num_tokens=3, max_new_tokens=12),
        "sampling": dict(input_ids=ids, do_sample=True, top_k=0, temperature=0.3, num_return_sequences=2,
                         max_new_tokens=8),
    }
    for label, kw in runs.items():
        outs = []
        for make in (_ungated(fmt), _never(fmt, max_repairs)):
            torch.manual_seed(1234)
            kw = {"do_sample": False, **kw}
            cache = make(model)
            outs.append(model.generate(past_key_values=cache, **kw))
        assert torch.equal(outs[0], outs[1]), f"{fmt} {label}: the gate at tau=inf changed the tokens"
        s = cache.gate_summary()
        assert s["repair_events"] == 0 == s["bytes_moved"] and s["n_certs"] > 0 and s["unrepaired"] == 0
        assert (s["bytes_padding"] > 0) == (max_repairs is not None)  # the fixed shape's (redirected) loads


def test_crop_then_continue_equals_a_cache_that_never_held_the_tokens() -> None:
    """rtn-int8 (deterministic codes), tau=0: crop(-3) and two new tokens equal a fresh cache fed the same tokens,
    bit for bit (the shadow's cropped positions are overwritten, never read)."""
    model = tiny_model()
    ids, a, b = prompt(1, 12, seed=8), prompt(1, 5, seed=10), prompt(1, 2, seed=11)
    for max_repairs in (None, BIG):
        make = exact_kind("rtn-int8", max_repairs).make
        cropped, fresh = make(model), make(model)
        for c, fed in ((cropped, a), (fresh, a[:, :2])):
            step(model, c, ids)
            for i in range(fed.shape[1]):
                step(model, c, fed[:, i:i + 1])
        cropped.crop(-3)
        got = [step(model, cropped, b[:, i:i + 1]) for i in range(2)]
        want = [step(model, fresh, b[:, i:i + 1]) for i in range(2)]
        assert all(torch.equal(x, y) for x, y in zip(got, want))


def _staged_host(model: Any) -> GatedCache:
    """A host shadow whose decode writes are staged (as on a GPU) and flushed every 3 steps: a batch operation must
    land the staged writes at their old slots before the rows move."""
    cache = make_gated_cache("rtn-int8", model.config, tau=0.0, shadow="host", shadow_dtype=torch.float32)
    cache._stage_writes = lambda k: True
    cache.STAGE_STEPS = 3
    return cache


@pytest.mark.parametrize("check", ["beam", "batch_ops", "crop"])
def test_tau_zero_staged_host_shadow(check: str) -> None:
    kind = Kind("gated-tau0:rtn-int8:host-staged", _staged_host, exact=True, tol=EXACT_TOL)
    {"crop": check_crop, **CHECKS}[check](kind)


def test_row_tallies_follow_a_selection() -> None:
    model = tiny_model()
    cache = make_gated_cache("dither-int8", model.config, tau=0.0, max_repairs_per_step=1)  # one repair a layer
    step(model, cache, prompt(2, 10, seed=5))
    step(model, cache, prompt(2, 1, seed=6))
    before = cache.row_summaries()
    cache.batch_select_indices(torch.tensor([1, 1, 0]))
    after = cache.row_summaries()
    assert [r["unrepaired"] for r in after] == [before[i]["unrepaired"] for i in (1, 1, 0)]
    assert [r["n_over"] for r in after] == [before[i]["n_over"] for i in (1, 1, 0)]
    with pytest.warns(RuntimeWarning, match="max_repairs_per_step=1"):
        assert sum(r["unrepaired"] for r in before) == cache.gate_summary()["unrepaired"] > 0


# -- the checks can fail: a shadow that does not follow a selection ---------------------------------------------

class _StaleShadow(GatedCache):
    """The pools follow reorders; the shadow keeps the old rows' positions (the bug the batch ops exist to avoid)."""

    def _batch_op(self, op, rows):
        op()


@pytest.mark.parametrize("max_repairs", [None, BIG])
def test_beam_check_rejects_a_stale_shadow(max_repairs: int | None) -> None:
    cls = functools.partial(_StaleShadow, shadow="device", shadow_dtype=torch.float32, gate=True, level="head",
                            max_repairs_per_step=max_repairs)
    kind = Kind("stale-shadow", lambda model: make_cache("rtn-int8", model.config, cache_class=cls, tau=0.0,
                                                         block_size=32), exact=True, tol=EXACT_TOL)
    with pytest.raises(AssertionError):
        check_beam(kind)

