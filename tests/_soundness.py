"""Shared check: the kernel's certificate bounds the true TV of every row (float64, exact keys)."""

import math

import torch

from kvlib.certify.bound import tv_distance


def assert_rows_within_certificate(q, K, slot_ids, slots, seq, probs, tv_bound) -> None:
    """``TV(softmax(q K^T / sqrt d), p_tilde) <= tv_bound`` for every (batch row, query head).

    ``K`` holds the unquantised keys in write order (``slot_ids[t]`` is token ``t``'s slot), ``probs``
    the reference's computed weights per batch row (``decode_reference(..., return_probs=True)``)."""
    pos = {int(s): t for t, s in enumerate(slot_ids)}
    q, slots = q.cpu(), slots.cpu()
    gqa = q.shape[1] // K.shape[1]
    for b in range(q.shape[0]):
        rows = [pos[int(s)] for s in slots[b, : int(seq[b])]]
        for h in range(q.shape[1]):
            z = (q[b, h].double() @ K[rows, h // gqa].double().T) / math.sqrt(q.shape[-1])
            assert tv_distance(torch.softmax(z, -1), probs[b][h]) <= tv_bound[b, h].cpu()
