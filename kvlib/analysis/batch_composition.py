"""How much one sequence's logits move with the rows that share its batch (issue 37, item 4).

A batched forward computes each row's projections with matmuls whose blocking depends on the batch shape, so the
same sequence gets fp32 K/V that differ in the last bits between batch compositions (the model's own noise, with
no cache involved). A 4-bit cache can turn such a difference into a different code (a value near a rounding
boundary of its 15 steps), and the flipped code moves the attention and so the logits by far more. That is part of
the sampler-learner mismatch an RL run with KV4 rollouts sees (its sampler batches rows, its learner scores them in
other batches), and it is not a cache bug: the cache is deterministic given its inputs.

:func:`batch_spread` teacher-forces one target sequence through a cache of ``spec`` alone and inside batches of
other sequences, and reports the largest change of its logits against the alone run (and how often the greedy token
flips), beside the same measure for the model's own fp32 path (a full-precision cache), which is the noise being
amplified.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvlib.analysis.fidelity import CacheSpec, forced_logits_batch


def _compositions(target: torch.Tensor, vocab: int, sizes: Sequence[int], seed: int) -> list[torch.Tensor]:
    """Batches holding ``target [N]`` at a varying row among random token rows, one per size (the rows differ per
    size too), token ids in ``[3, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, b in enumerate(sizes):
        rows = torch.randint(3, vocab, (b, target.shape[0]), generator=g)
        rows[i % b] = target
        out.append(rows)
    return out


@torch.no_grad()
def batch_spread(model: Any, target: torch.Tensor, prompt_len: int, spec: CacheSpec, *,
                 sizes: Sequence[int] = (1, 2, 4, 8), seed: int = 0) -> dict[str, Any]:
    """Teacher-force ``target [N]`` (its first ``prompt_len`` tokens as the prompt) through a cache of ``spec`` in
    batches of ``sizes`` rows (the first size should be 1: the reference run), and through a full-precision cache
    the same way. Returns the largest absolute change of the target's logits against the first size's run
    (``max_abs``; ``max_abs_fp32`` for the full-precision cache), the ratio of the two, the largest change in units
    of the logits' standard deviation, and the fraction of the target's positions whose greedy token differs from
    the reference run in some batch (``argmax_flips``)."""
    if target.ndim != 1:
        raise ValueError(f"target must be one sequence [N], got shape {tuple(target.shape)}")
    if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes):
        raise ValueError(f"sizes must be positive ints, got {sizes!r}")
    vocab = int(model.config.vocab_size)
    batches = _compositions(target, vocab, sizes, seed)
    res: dict[str, Any] = {"sizes": list(sizes), "positions": target.shape[0] - prompt_len}
    for name, s in (("", spec), ("_fp32", "fp32")):
        logits = []
        for i, ids in enumerate(batches):
            out = forced_logits_batch(model, ids, prompt_len, s, mode="decode")
            logits.append(out[i % ids.shape[0]])
        ref = logits[0]
        diffs = [float((x - ref).abs().max()) for x in logits[1:]]
        flips = torch.stack([(x.argmax(-1) != ref.argmax(-1)) for x in logits[1:]]).any(0) if diffs else None
        res[f"max_abs{name}"] = max(diffs, default=0.0)
        res[f"max_std{name}"] = max(diffs, default=0.0) / float(ref.std())
        res[f"argmax_flips{name}"] = float(flips.double().mean()) if flips is not None else 0.0
    res["amplification"] = res["max_abs"] / res["max_abs_fp32"] if res["max_abs_fp32"] > 0 else float("inf")
    res["spec"] = spec if isinstance(spec, str) else repr(spec)
    return res
