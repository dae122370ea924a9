"""The transformers ``Cache`` contract (issue 24, item 6), as transformers' own cache tests exercise it.

Every check runs against a *kind* of cache on tiny random Llama/Qwen2/Mistral decoders (CPU, fp32):

- ``dynamic``: transformers' DynamicCache itself; each check passes for the reference.
- ``kvlib:fp32`` / ``kvlib:bf16``: passthrough formats; the same tokens as DynamicCache (for bf16: a
  DynamicCache that stores K/V rounded to bf16, which is what a bf16 pool holds in an fp32 model);
  logits within fp32 rounding (1e-4 of their std; bf16: ``hf_helpers.BF16_TOL``).
- ``kvlib:<lossy>``: dither-int8, rtn-int8, kv4, kv4rl; they must run, and their logits, teacher-forced
  on DynamicCache's tokens, must agree with DynamicCache's within ``hf_helpers.LOSSY_TOL``.
- ``mutant:*`` (test_check_rejects_mutant): DynamicCache with one realistic bug each; every check
  must fail on its mutant, so none of them can pass vacuously.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hf_helpers import (
    MUTANTS,
    PAD,
    Kind,
    dynamic_kind,
    forced_logits,
    greedy,
    kvlib_kind,
    model_for,
    prompt,
    rel_err,
    repetitive_prompt,
    step,
    tiny_model,
)
from transformers import DynamicCache

import kvlib

torch.set_num_threads(1)

PASSTHROUGH = ("fp32", "bf16")
LOSSY = ("dither-int8", "rtn-int8", "kv4", "kv4rl")
PENDING_REASON = "known gap of the kvlib cache"
#: (check, kvlib format) pairs known to fail, as strict xfails: empty since the paged-pool cache (a fixed
#: gap turns its strict xfail into a failure, so this set cannot go stale).
PENDING: set[tuple[str, str]] = set()


def kinds(check: str, formats: tuple[str, ...] = PASSTHROUGH + LOSSY) -> list[Any]:
    out: list[Any] = [pytest.param(dynamic_kind(), id="dynamic")]
    for fmt in formats:
        marks = [pytest.mark.xfail(strict=True, reason=PENDING_REASON)] if (check, fmt) in PENDING else []
        out.append(pytest.param(fmt, id=f"kvlib:{fmt}", marks=marks))
    return out


def as_kind(k: Kind | str) -> Kind:
    return k if isinstance(k, Kind) else kvlib_kind(k)


def tokens_equal(kind: Kind, greedy_test: bool = False) -> bool:
    """Whether ``kind`` must reproduce its reference's tokens.

    fp32 passthrough everywhere; bf16 in greedy decoding, where the margins are checked to be
    decisive (sampling at temperature 0.3 and beam ranking can flip on one bf16 rounding of a near
    tie, so there bf16 is held to its logit tolerance).
    """
    return kind.exact or (greedy_test and kind.greedy_tokens)


def dyn(model: Any) -> DynamicCache:
    return DynamicCache(config=model.config)


def count_calls(obj: Any, name: str, pred: Callable[..., bool] = lambda *a: True) -> list[int]:
    """Wrap ``obj.name`` (instance attribute) to count the calls whose arguments satisfy ``pred``."""
    calls = [0]
    orig = getattr(obj, name)

    def spy(*a: Any, **kw: Any) -> Any:
        calls[0] += bool(pred(*a, **kw))
        return orig(*a, **kw)

    setattr(obj, name, spy)
    return calls


def assert_agrees(kind: Kind, got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = rel_err(got, ref)
    assert err <= kind.tol, f"{kind}: {what}: logits differ from DynamicCache by {err:.3g} std > tol {kind.tol}"


# -- the checks (each takes a Kind; each must reject its mutant) -----------------------------------

#: prompt seed per (arch, head_dim), picked among the first six for a wide greedy margin (0.019-0.054
#: std of the logits; check_greedy asserts the margin, so a near tie cannot pass for a cache bug)
GREEDY_SEED = {("llama", 32): 3, ("qwen2", 32): 6, ("mistral", 32): 4, ("llama", 16): 4}


def check_greedy(kind: Kind, arch: str = "llama", head_dim: int = 32) -> None:
    model = model_for(kind, arch, head_dim)
    ids = prompt(1, 12, seed=GREEDY_SEED[arch, head_dim])
    gen = dict(output_logits=True, return_dict_in_generate=True)
    ref = greedy(model, ids, kind.ref(model), **gen)
    ref_logits = torch.stack(ref.logits, 1).float()
    top2 = ref_logits.topk(2, -1).values
    margin = float((top2[..., 0] - top2[..., 1]).min() / ref_logits.std())
    out = greedy(model, ids, kind.make(model), **gen)
    assert out.sequences.shape == ref.sequences.shape == (1, 32)
    if tokens_equal(kind, greedy_test=True):
        assert margin > 2 * kind.tol, f"test not decisive: greedy margin {margin:.3g} std vs tol {kind.tol}"
        assert torch.equal(out.sequences, ref.sequences), f"{kind}: greedy tokens differ from DynamicCache"
        assert_agrees(kind, torch.stack(out.logits, 1), ref_logits, "greedy logits")
    else:
        forced = forced_logits(model, kind.make(model), ids, ref.sequences[:, 12:-1])
        assert_agrees(kind, forced, ref_logits, "teacher-forced greedy logits")


def check_padded(kind: Kind) -> None:
    model = model_for(kind)
    lens = (12, 7, 9)
    rows = [prompt(1, n, seed=20 + i) for i, n in enumerate(lens)]
    width = max(lens)
    ids = torch.cat([F.pad(r, (width - r.shape[1], 0), value=PAD) for r in rows])
    mask = torch.cat([F.pad(torch.ones_like(r), (width - r.shape[1], 0), value=0) for r in rows])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                         past_key_values=kind.make(model))
    alone = [greedy(model, r, kind.ref(model))[:, r.shape[1]:] for r in rows]
    assert out.shape == (3, width + 20)
    if tokens_equal(kind):
        for i, a in enumerate(alone):
            assert torch.equal(out[i:i + 1, width:], a), f"{kind}: row {i} of the padded batch differs from alone"
    else:
        fed = torch.cat([a[:, :-1] for a in alone])
        got = forced_logits(model, kind.make(model), ids, fed, mask)
        for i, r in enumerate(rows):
            ref = forced_logits(model, kind.ref(model), r, fed[i:i + 1])
            assert_agrees(kind, got[i:i + 1], ref, f"padded row {i}")


def check_sampling(kind: Kind) -> None:
    model = model_for(kind)
    ids = prompt(1, 10, seed=3)

    def sample(cache: Any, **kw: Any) -> torch.Tensor:
        torch.manual_seed(1234)
        return model.generate(ids, do_sample=True, top_k=0, temperature=0.3, max_new_tokens=20,
                              past_key_values=cache, **kw)

    for n_ret in (1, 3):  # num_return_sequences > 1 expands the batch (repeat_interleave) before the prefill
        ref = sample(kind.ref(model), num_return_sequences=n_ret)
        out = sample(kind.make(model), num_return_sequences=n_ret)
        assert out.shape == ref.shape == (n_ret, 30)
        if tokens_equal(kind):
            assert torch.equal(out, ref), f"{kind}: sampled tokens (num_return_sequences={n_ret}) differ"
        else:
            src = ids.repeat_interleave(n_ret, 0)
            got = forced_logits(model, kind.make(model), src, ref[:, 10:-1])
            assert_agrees(kind, got, forced_logits(model, kind.ref(model), src, ref[:, 10:-1]), "sampled sequences")


def check_beam(kind: Kind) -> None:
    model = model_for(kind)
    ids = prompt(2, 10, seed=4)
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=10, do_sample=False)
    ref = model.generate(ids, past_key_values=kind.ref(model), **kw)
    cache = kind.make(model)
    reorders = count_calls(cache, "reorder_cache")
    out = model.generate(ids, past_key_values=cache, **kw)
    assert reorders[0] > 0, "beam search never reordered the cache"
    assert out.shape == ref.shape == (4, 20)
    if tokens_equal(kind):
        assert torch.equal(out, ref), f"{kind}: beam search result differs from DynamicCache"
    else:
        src = ids.repeat_interleave(2, 0)
        got = forced_logits(model, kind.make(model), src, out[:, 10:-1])
        assert_agrees(kind, got, forced_logits(model, kind.ref(model), src, out[:, 10:-1]), "beam sequences")


def check_beam_padded(kind: Kind) -> None:
    """Beam search over a left-padded batch: rows of different pad counts trade places at every reorder, so the
    pad bookkeeping must follow the beams (a cache that reorders its K/V but not its pad columns attends at the
    wrong columns, or fails)."""
    model = model_for(kind)
    rows = [prompt(1, n, seed=50 + i) for i, n in enumerate((10, 6))]
    ids = torch.cat([F.pad(r, (10 - r.shape[1], 0), value=PAD) for r in rows])
    mask = torch.cat([F.pad(torch.ones_like(r), (10 - r.shape[1], 0), value=0) for r in rows])
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=10, do_sample=False, attention_mask=mask)
    ref = model.generate(ids, past_key_values=kind.ref(model), **kw)
    cache = kind.make(model)
    reorders = count_calls(cache, "reorder_cache", lambda idx, *a, **k: not torch.equal(
        torch.as_tensor(idx).cpu(), torch.arange(len(idx))))
    out = model.generate(ids, past_key_values=cache, **kw)
    assert reorders[0] > 0, "beam search never reordered the cache"
    assert out.shape == ref.shape == (4, 20)
    if tokens_equal(kind):
        assert torch.equal(out, ref), f"{kind}: left-padded beam search differs from DynamicCache"
    else:
        src, m = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)
        got = forced_logits(model, kind.make(model), src, out[:, 10:-1], m)
        assert_agrees(kind, got, forced_logits(model, kind.ref(model), src, out[:, 10:-1], m),
                      "left-padded beam sequences")


def check_reorder_padded(kind: Kind) -> None:
    """``reorder_cache`` across left-padded rows of different pad counts (what a beam search does whenever beams of
    unequal prompts trade places, e.g. a batch of beams of several requests): the pad bookkeeping must follow the
    rows. Beam search within one request never swaps rows of different pads, so check_beam_padded cannot see it."""
    model = model_for(kind)
    lens = (11, 5, 8)
    rows = [prompt(1, n, seed=60 + i) for i, n in enumerate(lens)]
    ids = torch.cat([F.pad(r, (11 - r.shape[1], 0), value=PAD) for r in rows])
    mask = torch.cat([F.pad(torch.ones_like(r), (11 - r.shape[1], 0), value=0) for r in rows])
    perm = torch.tensor([2, 0, 1])
    nxt = prompt(3, 2, seed=63)
    logits = []
    for cache in (kind.ref(model), kind.make(model)):
        step(model, cache, ids, mask)
        cache.reorder_cache(perm)
        m, out = mask[perm], []
        for t in range(2):
            m = torch.cat([m, m.new_ones(3, 1)], 1)
            out.append(step(model, cache, nxt[:, t:t + 1], m))
        logits.append(torch.stack(out, 1))
    assert_agrees(kind, logits[1], logits[0], "decode after reordering left-padded rows")


def check_batch_ops(kind: Kind) -> None:
    """batch_repeat_interleave and batch_select_indices on a filled cache, as transformers' cache tests do."""
    model = model_for(kind)
    ids = prompt(2, 10, seed=5)
    t1, t2 = prompt(4, 1, seed=6), prompt(2, 1, seed=7)
    logits = []
    for cache in (kind.ref(model), kind.make(model)):
        step(model, cache, ids)
        cache.batch_repeat_interleave(2)  # rows 0, 0, 1, 1
        a = step(model, cache, t1)
        cache.batch_select_indices(torch.tensor([3, 0]))
        b = step(model, cache, t2)
        assert cache.get_seq_length() == 12
        logits.append((a, b))
    (ra, rb), (ga, gb) = logits
    assert_agrees(kind, ga, ra, "after batch_repeat_interleave(2)")
    assert_agrees(kind, gb, rb, "after batch_select_indices([3, 0])")


def check_crop(kind: Kind) -> None:
    model = model_for(kind)
    asst = tiny_model("llama", 32, seed=1)  # another network of the same vocabulary
    ids = prompt(1, 12, seed=8)
    removed = lambda n, *a, **k: n < 0  # noqa: E731  (generate crops with a negative count)
    plain = greedy(model, ids, kind.ref(model))
    for label, src, kw in (("assisted", ids, dict(assistant_model=asst)),
                           ("prompt lookup", repetitive_prompt(24, seed=9), dict(prompt_lookup_num_tokens=3))):
        ref_plain = plain if label == "assisted" else greedy(model, src, kind.ref(model))
        ref_cache = kind.ref(model)
        ref_crops = count_calls(ref_cache, "crop", removed)
        ref = greedy(model, src, ref_cache, **kw)
        assert ref_crops[0] > 0 and torch.equal(ref, ref_plain), f"test setup: {label} must crop and be lossless"
        cache = kind.make(model)
        crops = count_calls(cache, "crop", removed)
        out = greedy(model, src, cache, **kw)
        assert out.shape == ref.shape and crops[0] > 0
        assert cache.get_seq_length() - out.shape[1] == ref_cache.get_seq_length() - ref.shape[1]
        if tokens_equal(kind):
            assert torch.equal(out, ref_plain), f"{kind}: {label} decoding differs from plain greedy"
    # crop itself: 5 decode steps, drop 3, decode 2 other tokens
    a, b = prompt(1, 5, seed=10), prompt(1, 2, seed=11)
    logits = []
    for cache in (kind.ref(model), kind.make(model)):
        forced_logits(model, cache, ids, a)
        cache.crop(-3)
        assert cache.get_seq_length() == 14
        logits.append(torch.stack([step(model, cache, b[:, i:i + 1]) for i in range(2)], 1))
    assert_agrees(kind, logits[1], logits[0], "decode after crop(-3)")
    # and the cropped cache is the cache that never held the removed tokens, to rounding; a dithered
    # format may draw fresh dither for the tokens after a crop (a slot is never reused, so dither
    # stays independent), which moves the logits within the format's own tolerance only
    want = forced_logits(model, kind.make(model), ids, torch.cat([a[:, :2], b], 1))[:, -2:]
    err = rel_err(logits[1], want)
    fresh_tol = kind.tol if kind.name == "kvlib:dither-int8" else 1e-5
    assert err <= fresh_tol, f"{kind}: decode after crop(-3) differs from a fresh cache of the same format by {err:.3g}"


def check_continue(kind: Kind) -> None:
    model = model_for(kind)
    ids1, user = prompt(1, 10, seed=12), prompt(1, 5, seed=13)
    cache = kind.make(model)
    out1 = greedy(model, ids1, cache, n=6)
    ids2 = torch.cat([out1, user], 1)
    out2 = greedy(model, ids2, cache, n=8)
    ref_cache = kind.ref(model)
    ref = greedy(model, ids2, ref_cache, n=8)
    assert out2.shape == ref.shape and cache.get_seq_length() == ref_cache.get_seq_length()
    if tokens_equal(kind):
        assert torch.equal(out2, ref), f"{kind}: continued conversation differs from one DynamicCache run"
    else:
        got, want = [], []
        for c, res in ((kind.make(model), got), (kind.ref(model), want)):
            res.append(forced_logits(model, c, ids1, out1[:, 10:]))
            res.append(forced_logits(model, c, user, ref[:, 21:-1]))
        assert_agrees(kind, torch.cat(got, 1), torch.cat(want, 1), "continued conversation")


def check_deepcopy(kind: Kind) -> None:
    """A deep copy is independent: interleaved steps on original and copy equal fresh runs."""
    model = model_for(kind)
    ids = prompt(1, 12, seed=14)
    a, b, c = (prompt(1, 1, seed=s) for s in (15, 16, 17))
    orig = kind.make(model)
    step(model, orig, ids)
    dup = copy.deepcopy(orig)
    lb = step(model, dup, b)
    la = step(model, orig, a)
    lc = step(model, dup, c)
    assert orig.get_seq_length() == 13 and dup.get_seq_length() == 14
    fresh_a, fresh_bc = kind.make(model), kind.make(model)
    ra = forced_logits(model, fresh_a, ids, a)[:, -1]
    rbc = forced_logits(model, fresh_bc, ids, torch.cat([b, c], 1))
    for got, want, what in ((la, ra, "original"), (lb, rbc[:, 1], "copy, step 1"), (lc, rbc[:, 2], "copy, step 2")):
        err = rel_err(got, want)
        assert err <= 1e-5, f"{kind}: {what} after deepcopy differs from a fresh cache by {err:.3g}"


def check_lengths(kind: Kind) -> None:
    model = model_for(kind)
    ids, nxt = prompt(2, 12, seed=18), prompt(2, 3, seed=19)
    ref, cache = kind.ref(model), kind.make(model)

    def compare(when: str) -> None:
        assert cache.get_seq_length() == ref.get_seq_length(), f"get_seq_length {when}"
        for layer in range(model.config.num_hidden_layers):
            assert cache.get_seq_length(layer) == ref.get_seq_length(layer), f"get_seq_length({layer}) {when}"
            for q in (1, 5):
                assert tuple(cache.get_mask_sizes(q, layer)) == tuple(ref.get_mask_sizes(q, layer)), \
                    f"get_mask_sizes({q}, {layer}) {when}"

    for c in (ref, cache):
        step(model, c, ids)
    compare("after prefill")
    for i in range(3):
        for c in (ref, cache):
            step(model, c, nxt[:, i:i + 1])
    compare("after 3 decode steps")


EDIT_ERROR = re.compile(r"(?i)edit|press|read.?only|assign|rewrit|modif")


def check_edit(kind: Kind, variant: str = "prune") -> None:
    """kvpress-style: rewrite each layer's keys/values after the prefill; honoured, or a clear error."""
    model = model_for(kind)
    ids, nxt = prompt(1, 16, seed=30), prompt(1, 1, seed=31)
    pos = torch.tensor([[16]])  # kvpress keeps the original positions for the tokens after a prune
    keep = torch.tensor([i for i in range(16) if not 2 <= i < 10])  # a press dropping half the prompt

    def edit(cache: Any) -> None:
        for layer in cache.layers:
            if variant == "prune":
                layer.keys, layer.values = layer.keys[:, :, keep].contiguous(), layer.values[:, :, keep].contiguous()
            elif variant == "rewrite":  # same length, values rewritten and assigned back
                v = layer.values.clone()
                v[:, :, :8] = 0
                layer.values = v
            else:  # in place, on the tensor the layer hands out
                layer.values[:, :, :8] = 0

    plain, edited = kind.ref(model), kind.ref(model)
    for c in (plain, edited):
        step(model, c, ids)
    edit(edited)
    ref_plain, ref_edit = step(model, plain, nxt, position_ids=pos), step(model, edited, nxt, position_ids=pos)
    size = rel_err(ref_edit, ref_plain)
    assert size > 1.5 * kind.tol, f"test setup: the edit moves the logits by only {size:.3g} std"
    cache = kind.make(model)
    step(model, cache, ids)
    try:
        edit(cache)
        got = step(model, cache, nxt, position_ids=pos)
    except (ValueError, TypeError, NotImplementedError, AttributeError, RuntimeError) as e:
        assert EDIT_ERROR.search(str(e)), f"{kind}: an edit of keys/values failed without a clear error: {e!r}"
        return
    err_edit = rel_err(got, ref_edit)
    assert err_edit < rel_err(got, ref_plain), f"{kind}: the {variant} edit was silently undone"
    assert_agrees(kind, got, ref_edit, f"next step after a {variant} edit")
    assert cache.get_seq_length() == edited.get_seq_length()


CHECKS: dict[str, Callable[..., None]] = {
    "greedy": check_greedy, "padded": check_padded, "sampling": check_sampling, "beam": check_beam,
    "beam_padded": check_beam_padded, "reorder_padded": check_reorder_padded,
    "batch_ops": check_batch_ops, "crop": check_crop, "continue": check_continue, "deepcopy": check_deepcopy,
    "lengths": check_lengths, "edit": check_edit,
    "edit-rewrite": lambda kind: check_edit(kind, "rewrite"), "edit-inplace": lambda kind: check_edit(kind, "inplace"),
}


# -- tests -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", kinds("greedy"))
def test_greedy(kind: Kind | str) -> None:
    check_greedy(as_kind(kind))


@pytest.mark.parametrize("arch,head_dim", [("qwen2", 32), ("mistral", 32), ("llama", 16)])
@pytest.mark.parametrize("kind", kinds("greedy_arch", PASSTHROUGH))
def test_greedy_arch(kind: Kind | str, arch: str, head_dim: int) -> None:
    check_greedy(as_kind(kind), arch, head_dim)


@pytest.mark.parametrize("kind", kinds("padded"))
def test_left_padded_batch(kind: Kind | str) -> None:
    check_padded(as_kind(kind))


@pytest.mark.parametrize("kind", kinds("sampling"))
def test_sampling(kind: Kind | str) -> None:
    check_sampling(as_kind(kind))


@pytest.mark.parametrize("kind", kinds("beam"))
def test_beam_search(kind: Kind | str) -> None:
    check_beam(as_kind(kind))


@pytest.mark.parametrize("kind", kinds("beam_padded"))
def test_beam_search_left_padded(kind: Kind | str) -> None:
    check_beam_padded(as_kind(kind))


@pytest.mark.parametrize("kind", kinds("reorder_padded"))
def test_reorder_left_padded_rows(kind: Kind | str) -> None:
    check_reorder_padded(as_kind(kind))


@pytest.mark.parametrize("kind", kinds("batch_ops"))
def test_batch_repeat_and_select(kind: Kind | str) -> None:
    check_batch_ops(as_kind(kind))


@pytest.mark.parametrize("kind", kinds("crop"))
def test_crop_assisted_and_prompt_lookup(kind: Kind | str) -> None:
    check_crop(as_kind(kind))


@pytest.mark.parametrize("kind", kinds("continue"))
def test_continue_conversation(kind: Kind | str) -> None:
    check_continue(as_kind(kind))


@pytest.mark.parametrize("kind", kinds("deepcopy"))
def test_deepcopy_independent(kind: Kind | str) -> None:
    check_deepcopy(as_kind(kind))


@pytest.mark.parametrize("kind", kinds("lengths"))
def test_seq_length_and_mask_sizes(kind: Kind | str) -> None:
    check_lengths(as_kind(kind))


EDIT_PARAMS = [pytest.param(p.values[0], variant, id=f"{p.id}-{variant}", marks=p.marks)
               for variant in ("prune", "rewrite", "inplace") for p in kinds(f"edit-{variant}")]


@pytest.mark.parametrize("kind,variant", EDIT_PARAMS)
def test_edit_keys_values(kind: Kind | str, variant: str) -> None:
    check_edit(as_kind(kind), variant)


@pytest.mark.parametrize("fmt", [
    pytest.param(f, marks=[pytest.mark.xfail(strict=True, reason=PENDING_REASON)] if ("static", f) in PENDING
                 else []) for f in PASSTHROUGH + LOSSY])
def test_static_pool(fmt: str) -> None:
    """With batch_size and max_len given (pages allocated up front): the same contract; past max_len a
    ValueError naming it, never a silent wrap-around."""
    static = kvlib_kind(fmt, batch_size=1, max_len=48)
    check_greedy(static)  # 12 + 20 tokens
    check_crop(static)  # assisted and prompt-lookup decoding, 24 + 20 tokens
    model = model_for(static)
    with pytest.raises(ValueError, match="max_len"):
        greedy(model, prompt(1, 12, seed=41), static.make(model), n=40)


MUTANT_OF = [
    ("greedy", "zero_oldest"), ("padded", "batch_scale"), ("sampling", "zero_oldest"), ("beam", "no_reorder"),
    ("beam_padded", "no_reorder"), ("reorder_padded", "no_reorder"),
    ("batch_ops", "tile_repeat"), ("batch_ops", "select_first"), ("crop", "no_crop"),
    ("continue", "reset_on_prefill"), ("deepcopy", "shared_copy"), ("lengths", "off_by_one"),
    ("lengths", "mask_size"), ("edit", "undo_edits"), ("edit-rewrite", "undo_edits"), ("edit-inplace", "copy_out"),
]


@pytest.mark.parametrize("check,mutant", MUTANT_OF, ids=[f"{c}-{m}" for c, m in MUTANT_OF])
def test_check_rejects_mutant(check: str, mutant: str) -> None:
    """Each check fails on a DynamicCache with the bug it exists to catch."""
    with pytest.raises(AssertionError):
        CHECKS[check](MUTANTS[mutant])


def test_tolerance_excludes_bugs() -> None:
    """The int8 tolerance is far tighter than what one zeroed value row costs (see hf_helpers.LOSSY_TOL)."""
    model = tiny_model()
    ids, fed = prompt(1, 12, seed=1), prompt(1, 19, seed=2)
    ref = forced_logits(model, dyn(model), ids, fed)
    bug = forced_logits(model, MUTANTS["zero_oldest"].make(model), ids, fed)
    assert rel_err(bug, ref) > 4 * max(as_kind(f).tol for f in ("dither-int8", "rtn-int8"))


# -- make_cache validation and the kvlib-only API --------------------------------------------------

BAD_OPTIONS = [
    ("int3-magic", {}, ValueError, "format"),
    ("rtn-int8", {"group": 24}, ValueError, "group"),  # 24 does not divide head_dim 32
    ("dither-int8", {"group": 24}, ValueError, "group"),
    ("kv4", {"group": 24}, ValueError, "group"),
    ("dither-int8", {"seed": "x"}, (TypeError, ValueError), "seed"),
    ("dither-int8", {"delta_req": 2.0}, ValueError, "delta_req"),
    ("block-int8", {}, ValueError, "block-int8"),  # offline-only: cannot decode token by token
    ("fp32", {"block_size": 0}, ValueError, "block_size"),
    ("fp32", {"batch_size": 0}, ValueError, "batch_size"),
    ("fp32", {"max_len": -5}, ValueError, "max_len"),
    ("fp32", {"no_such_option": 1}, (TypeError, ValueError), "no_such_option"),
]


@pytest.mark.parametrize("fmt,opts,exc,name", [
    pytest.param(*case, id=f"{case[0]}-{case[3]}",
                 marks=[pytest.mark.xfail(strict=True, reason=PENDING_REASON)] if ("validate", case[3]) in PENDING
                 else [])
    for case in BAD_OPTIONS])
def test_make_cache_validates(fmt: str, opts: dict, exc: Any, name: str) -> None:
    """Bad options are refused by make_cache itself (not at the first forward), naming the option."""
    with pytest.raises(exc, match=re.escape(name)):
        kvlib.make_cache(fmt, tiny_model().config, **opts)


def _mismatch_caches() -> dict[str, Any]:
    small = copy.deepcopy(tiny_model().config)
    small.num_hidden_layers = 1
    if getattr(small, "layer_types", None):
        small.layer_types = small.layer_types[:1]
    return {"head_dim": tiny_model(head_dim=16).config, "layer": small}


@pytest.mark.parametrize("what", [
    pytest.param(w, marks=[pytest.mark.xfail(strict=True, reason=PENDING_REASON)] if ("mismatch", w) in PENDING
                 else []) for w in ("head_dim", "layer")])
def test_cache_refuses_another_model(what: str) -> None:
    """A cache made for one config, used by a model of another shape: a ValueError naming the mismatch."""
    cache = kvlib.make_cache("fp32", _mismatch_caches()[what])
    with pytest.raises(ValueError, match=what):
        step(tiny_model(), cache, prompt(1, 4))


KERNEL_FORMATS = ("dither-int8", "rtn-int8", "kv4", "kv4rl", "bf16")
#: bytes per cached element, lower (the payload) and upper (payload + scales/offsets); with the
#: pages allowed to be up to twice the tokens (a growth policy), a float copy beside the packed store
#: (>= 4 bytes per element of the tokens) still exceeds the upper bound
BYTES_PER_ELEMENT = {"fp32": (4, 4.25), "bf16": (2, 2.25), "rtn-int8": (1, 1.25), "dither-int8": (1, 1.25),
                     "kv4": (0.5, 0.75), "kv4rl": (0.5, 1.25)}


@pytest.mark.xfail(("kernel_formats", "") in PENDING, strict=True, reason=PENDING_REASON)
def test_kernel_formats() -> None:
    kf = set(kvlib.kernel_formats())
    assert set(KERNEL_FORMATS) <= kf <= set(kvlib.available_formats())
    assert not kf & {"kivi2", "fp8-e4m3", "mxfp4", "nvfp4", "sr-int8"}  # reference path only (issue 24)


@pytest.mark.parametrize("fmt", [
    pytest.param(f, marks=[pytest.mark.xfail(strict=True, reason=PENDING_REASON)] if ("bytes", f) in PENDING
                 else []) for f in BYTES_PER_ELEMENT])
def test_kv_nbytes_and_kernel_path(fmt: str) -> None:
    """kv_nbytes counts the format's bytes on whole pages (block_size 16), not a float copy."""
    kind = as_kind(fmt)
    model = model_for(kind)
    cfg = model.config
    b, s, block = 2, 40, 16
    cache = kvlib.make_cache(fmt, cfg, block_size=block, **({"sink": 4, "recent": 16} if fmt == "kv4rl" else {}))
    step(model, cache, prompt(b, s, seed=40))
    elements = 2 * cfg.num_hidden_layers * b * cfg.num_key_value_heads * cfg.head_dim  # per token
    lo, hi = BYTES_PER_ELEMENT[fmt]
    n = cache.kv_nbytes()
    pages = 2 * -(-s // block)  # at most twice the pages the tokens need
    page_table = 8 * cfg.num_hidden_layers * b * (pages + 2)  # int32 block table + seq_lens, generous
    assert isinstance(n, int)
    assert elements * s * lo <= n <= elements * pages * block * hi + page_table, (n, elements * s)
    step(model, cache, prompt(b, 1, seed=41))  # a decode step: the path the decode kernel dispatch took
    path = cache.kernel_path(layer_idx=0)
    assert isinstance(path, str) and "reference" in path, path  # on the CPU: the torch reference, said so
