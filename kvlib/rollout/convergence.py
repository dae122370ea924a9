"""Simulation against the closed forms (concentration_theory): running means of the async and sync
simulators over many seeds, their relative error to ``concentration``'s closed forms at log-spaced
checkpoints, the final error's z score over seeds, and the slope of the RMS error against log n."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlib import rollout as ro

# label: (scheduler, running-mean field, closed-form field)
QUANTITIES = {
    "async mean context": ("async", "mean_context", "async_mean_context"),
    "sync mean context": ("sync", "mean_context", "sync_mean_context"),
    "sync occupancy": ("sync", "batch", "sync_occupancy"),
    "sync volume": ("sync", "volume", "sync_mean_volume"),
}


def convergence(laws: dict[str, Any], exact: dict[str, Any], B: int, P: int, n_steps: int, n_seeds: int,
                seed: int, quantities: dict[str, tuple[str, str, str]] = QUANTITIES):
    """For each law, ``n_seeds`` async and sync runs of ``n_steps``: the checkpoints, the relative errors
    ``{law: {quantity: [seed, checkpoint]}}`` (C_KV has no running error, a NaN row), and one row per (law,
    quantity) with the closed form, the final mean relative error, its z and the fitted slope (upper half of
    the checkpoints); C_KV's row compares the async / sync volume ratio."""
    checkpoints = np.unique(np.logspace(3, np.log10(n_steps), 25).astype(int))
    upper = checkpoints >= np.sqrt(checkpoints[0] * checkpoints[-1])  # fit the slope on the upper half
    errors, rows = {}, []
    for name, law in laws.items():
        c = exact[name]
        err = {q: [] for q in quantities}
        ratio = []
        for s in range(n_seeds):
            tr = {"async": ro.simulate_async(law, B, n_steps, P=P, seed=seed + 2 * s),
                  "sync": ro.simulate_sync(law, B, n_steps, P=P, seed=seed + 2 * s + 1)}
            rm = {k: t.running_means(checkpoints) for k, t in tr.items()}
            for q, (k, field, ex) in quantities.items():
                err[q].append(rm[k][field] / getattr(c, ex) - 1.0)
            ratio.append(rm["async"]["volume"][-1] / rm["sync"]["volume"][-1])
        err["C_KV (volume ratio)"] = [np.full(checkpoints.size, np.nan)]
        errors[name] = {q: np.asarray(v) for q, v in err.items()}
        for q in quantities:
            e = errors[name][q]
            rms = np.sqrt(np.mean(e**2, axis=0))
            final, se = e[:, -1].mean(), e[:, -1].std(ddof=1) / np.sqrt(n_seeds)
            rows.append(dict(law=name, quantity=q, exact=getattr(c, quantities[q][2]), rel_error=final, z=final / se,
                             slope=np.polyfit(np.log(checkpoints[upper]), np.log(rms[upper]), 1)[0]))
        r = np.asarray(ratio)
        rows.append(dict(law=name, quantity="C_KV", exact=c.concentration_factor,
                         rel_error=r.mean() / c.concentration_factor - 1,
                         z=(r.mean() - c.concentration_factor) / (r.std(ddof=1) / np.sqrt(n_seeds)), slope=np.nan))
    return checkpoints, errors, rows
