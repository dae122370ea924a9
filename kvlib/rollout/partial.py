"""A model of quota-based partial collection under a paged KV pool (KV4-RL Sec. 3-4, App. B/C).

This is a *model*, kept small on purpose, of one rollout replica:

* Each update trains ``T`` prompt groups of ``G`` responses. The collector keeps a pool of up to
  ``T (1 + beta)`` live groups (unfinished or complete-but-untrained), topped up with fresh groups
  at the start of every collection interval.
* Collection stops once ``T`` complete untrained groups exist and no unfinished group is ``eta``
  or more updates old. The oldest ``T`` complete groups train; the rest wait.
* Unfinished responses keep their token prefixes. After the update their KV is invalid, so they
  are re-prefilled on re-admission (counted, not timed) and resume with priority.
* Admission (FCFS: carried responses first, then groups in creation order) needs a free request
  slot (``max_requests``) and free pages for the request's context. Each decode step every active
  response attends over its context and writes one position; when the pool cannot hold the next
  step, the most recently admitted responses are preempted (pages freed, prefix kept, recompute
  on re-admission), as vLLM does.
* The synchronous baseline launches ``T`` groups and waits until all of them complete.

Pool capacity follows from the bytes per context position ``kappa`` of the cache format: the HBM
that holds the paper's BF16 pool (``pages_bf16 * page_size * kappa_bf16`` bytes) is re-cut into
pages of the chosen format after reserving any fixed per-request side buffer. Only decode steps
are simulated; prefill, re-prefill and learner time are not. Times are in decode steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvlib.rollout.laws import LengthLaw, check_block

# Paper, App. B: pool pinned to these many BF16 pages per GPU; 16 positions per page
# (83,022 pages hold 1,328,352 positions); kappa = 73,728 nominal BF16 KV bytes per position per
# GPU under TP2 (Qwen3-4B/8B: 36 layers x 4 KV heads per GPU x 128 dims x K,V x 2 bytes).
POOL_PAGES_4B = 83_022
POOL_PAGES_8B = 79_639
PAGE_SIZE = 16
KAPPA_BF16 = 73_728
MAX_REQUESTS = 1024
HEAD_DIM = 128


@dataclass(frozen=True)
class CacheFormat:
    """Storage cost of one KV cache format, relative to BF16.

    ``bits`` per stored element including per-vector quantizer metadata; ``side_positions`` of
    a fixed per-request side buffer stored at ``side_bits`` (KV4-RL: 16 sinks + 128 recent in INT8).
    """

    name: str
    bits: float
    side_positions: int = 0
    side_bits: float = 0.0

    def kappa(self, kappa_bf16: float = KAPPA_BF16) -> float:
        """Bytes per context position under this format."""
        return kappa_bf16 * self.bits / 16.0

    def side_bytes_per_request(self, kappa_bf16: float = KAPPA_BF16) -> float:
        return kappa_bf16 * self.side_bits / 16.0 * self.side_positions


CACHE_FORMATS: dict[str, CacheFormat] = {
    "bf16": CacheFormat("bf16", 16.0),
    "int8": CacheFormat("int8", 8.0 + 16.0 / HEAD_DIM),  # one fp16 scale per token-head vector
    "int4": CacheFormat("int4", 4.0 + 32.0 / HEAD_DIM),  # fp16 scale + offset per token-head vector (KV4)
    "int4+side": CacheFormat("int4+side", 4.0 + 32.0 / HEAD_DIM, 16 + 128, 8.0 + 16.0 / HEAD_DIM),  # KV4-RL
}


@dataclass(frozen=True)
class PagePool:
    """The KV page pool of one GPU of a replica, re-cut for ``fmt``."""

    fmt: CacheFormat
    pages_bf16: int = POOL_PAGES_8B
    page_size: int = PAGE_SIZE
    kappa_bf16: float = KAPPA_BF16
    max_requests: int = MAX_REQUESTS

    @property
    def budget_bytes(self) -> float:
        """HBM that holds the BF16 pool (per GPU)."""
        return float(self.pages_bf16) * self.page_size * self.kappa_bf16

    @property
    def kappa(self) -> float:
        return self.fmt.kappa(self.kappa_bf16)

    @property
    def positions(self) -> int:
        """Context positions the pool holds after reserving side buffers for every request slot."""
        side = self.max_requests * self.fmt.side_bytes_per_request(self.kappa_bf16)
        return int((self.budget_bytes - side) // self.kappa)

    @property
    def pages(self) -> int:
        return self.positions // self.page_size


def make_pool(fmt: str | CacheFormat = "bf16", *, model: str = "8B", **kw) -> PagePool:
    """Pool of the paper's 4B or 8B replica (``pages_bf16`` 83,022 / 79,639) for a format name."""
    if isinstance(fmt, str):
        if fmt not in CACHE_FORMATS:
            raise ValueError(f"fmt must be one of {sorted(CACHE_FORMATS)}, got {fmt!r}")
        fmt = CACHE_FORMATS[fmt]
    if model not in ("4B", "8B"):
        raise ValueError(f"model must be '4B' or '8B', got {model!r}")
    kw.setdefault("pages_bf16", POOL_PAGES_4B if model == "4B" else POOL_PAGES_8B)
    return PagePool(fmt, **kw)


@dataclass
class CollectionResult:
    """Per-update statistics and the per-decode-step trace of one simulated run."""

    updates: dict[str, np.ndarray]
    trace: dict[str, np.ndarray]
    pool: PagePool
    synchronous: bool
    warmup: int
    params: dict = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        """Averages over decode steps of the measured updates (after ``warmup``), as in App. B."""
        keep = self.trace["update"] >= self.warmup
        b = self.trace["batch"][keep]
        ctx = self.trace["context_sum"][keep]
        up = {k: v[self.warmup :] for k, v in self.updates.items()}
        return {
            "mean_batch": float(b.mean()),
            "mean_resident_positions": float(ctx.mean()),
            "mean_resident_gb_bf16": float(ctx.mean() * self.pool.kappa_bf16 / 1e9),
            "mean_resident_gb_format": float(ctx.mean() * self.pool.kappa / 1e9),
            "pool_gb_bf16": self.pool.budget_bytes / 1e9,
            "pool_fill": float(self.trace["pages"][keep].mean() / self.pool.pages),
            "mean_context": float(ctx.sum() / b.sum()),
            "steps_per_update": float(up["steps"].mean()),
            "tokens_per_update": float(up["tokens"].mean()),
            "preemptions_per_update": float(up["preemptions"].mean()),
            "reprefill_tokens_per_update": float(up["reprefill_tokens"].mean()),
            "carried_fraction": float(self.trace["carried_sum"][keep].sum() / max(ctx.sum(), 1)),
            "page_limited_fraction": float(self.trace["page_limited"][keep].mean()),
        }


def simulate_collection(
    law: LengthLaw,
    *,
    fmt: str | CacheFormat = "bf16",
    model: str = "8B",
    pool: PagePool | None = None,
    P: int = 256,
    T: int = 64,
    G: int = 8,
    beta: float = 1.0,
    eta: int = 12,
    updates: int = 8,
    warmup: int = 3,
    synchronous: bool = False,
    watermark: float = 0.01,
    seed: int | None = 0,
    max_steps: int = 10_000_000,
) -> CollectionResult:
    """Simulate ``updates`` collection intervals of one replica; see the module docstring.

    Defaults: one of the paper's two replicas (global quota T = 128, G = 8, beta = 1, eta = 12,
    1,024 request slots, the 8B BF16 pool). ``P`` (prompt length) is an assumption of this model.
    """
    if not isinstance(law, LengthLaw):
        raise TypeError(f"law must be a LengthLaw, got {type(law).__name__}")
    T, G, updates = check_block("T", T), check_block("G", G), check_block("updates", updates)
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if isinstance(eta, bool) or not isinstance(eta, (int, np.integer)) or eta < 1:
        raise ValueError(f"eta must be an int >= 1, got {eta!r}")
    if not 0 <= warmup < updates:
        raise ValueError(f"warmup must lie in [0, updates), got {warmup}")
    if not 0.0 <= watermark < 1.0:
        raise ValueError(f"watermark must lie in [0, 1), got {watermark}")
    P = int(P)
    if P < 0:
        raise ValueError(f"P must be >= 0, got {P}")
    pool = pool or make_pool(fmt, model=model)
    ps, cap = pool.page_size, pool.pages
    admit_cap = int(cap * (1.0 - watermark))
    if (P + int(law.lengths.max()) + ps) // ps > admit_cap:
        raise ValueError("pool: a single longest response does not fit in the page pool")
    rng = np.random.default_rng(seed)
    pool_groups = T if synchronous else int(np.floor(T * (1.0 + beta)))

    # requests and groups, preallocated (at most pool_groups new groups per update)
    max_groups = pool_groups * updates + T
    req_len = np.zeros(max_groups * G, dtype=np.int64)
    req_prog = np.zeros(max_groups * G, dtype=np.int64)
    grp_created = np.full(max_groups, -1, dtype=np.int64)
    grp_done = np.zeros(max_groups, dtype=np.int64)
    grp_trained = np.zeros(max_groups, dtype=bool)
    n_groups = 0

    rows: dict[str, list] = {
        k: []
        for k in (
            "steps",
            "tokens",
            "preemptions",
            "reprefill_tokens",
            "new_groups",
            "carried_requests",
            "trained_mean_age",
            "max_unfinished_age",
        )
    }
    tr: dict[str, list] = {k: [] for k in ("batch", "context_sum", "carried_sum", "pages", "page_limited", "update")}
    total_steps = 0

    for u in range(updates):
        live = np.flatnonzero(~grp_trained[:n_groups])
        n_new = max(pool_groups - live.size, 0) if not synchronous else T
        for _ in range(n_new):
            grp_created[n_groups] = u
            req_len[n_groups * G : (n_groups + 1) * G] = law.sample(G, rng)
            n_groups += 1
        live = np.flatnonzero(~grp_trained[:n_groups])
        unfinished = live[grp_done[live] < G]
        overdue = int(np.count_nonzero(u - grp_created[unfinished] >= eta))
        complete_untrained = int(np.count_nonzero(grp_done[live] == G))
        # waiting queue: carried (progress > 0) first, then by group creation order
        rids = (unfinished[:, None] * G + np.arange(G)).ravel()
        rids = rids[req_prog[rids] < req_len[rids]]
        order = np.lexsort((rids, grp_created[rids // G], req_prog[rids] == 0))
        queue = deque(rids[order].tolist())
        carried_requests = int(np.count_nonzero(req_prog[rids] > 0))
        carried = set(rids[req_prog[rids] > 0].tolist())

        act_id = np.zeros(0, dtype=np.int64)
        act_ctx = np.zeros(0, dtype=np.int64)  # positions attended at the next step: P + progress
        act_rem = np.zeros(0, dtype=np.int64)
        act_car = np.zeros(0, dtype=bool)
        used = 0
        steps = tokens = preempt = reprefill = 0
        done_already = (complete_untrained >= T) if synchronous else (complete_untrained >= T and overdue == 0)
        while not done_already:
            # -- admission: a free slot and pages for the context plus the next position
            page_limited = False
            if queue and act_id.size < pool.max_requests:
                new_id, new_ctx = [], []
                while queue and act_id.size + len(new_id) < pool.max_requests:
                    r = queue[0]
                    ctx = P + int(req_prog[r])
                    need = (ctx + 1 + ps - 1) // ps
                    if used + need > admit_cap:
                        page_limited = True
                        break
                    queue.popleft()
                    used += need
                    new_id.append(r)
                    new_ctx.append(ctx)
                    reprefill += int(req_prog[r])
                if new_id:
                    ids = np.asarray(new_id, dtype=np.int64)
                    act_id = np.concatenate([act_id, ids])
                    act_ctx = np.concatenate([act_ctx, np.asarray(new_ctx, dtype=np.int64)])
                    act_rem = np.concatenate([act_rem, req_len[ids] - req_prog[ids]])
                    act_car = np.concatenate([act_car, np.fromiter((i in carried for i in new_id), bool, ids.size)])
            if act_id.size == 0:
                raise RuntimeError("no response can be admitted; the collection cannot make progress")
            # -- pages for this step (attend over ctx, write one position); preempt newest if short
            pages = (act_ctx + ps) // ps
            need_tot = int(pages.sum())
            if need_tot > cap:
                csum = np.cumsum(pages)
                k = int(np.searchsorted(csum, cap, side="right"))  # keep the k oldest admissions
                for j in range(act_id.size - 1, k - 1, -1):
                    r = int(act_id[j])
                    req_prog[r] = act_ctx[j] - P
                    queue.appendleft(r)
                preempt += act_id.size - k
                act_id, act_ctx, act_rem, act_car = act_id[:k], act_ctx[:k], act_rem[:k], act_car[:k]
                need_tot = int(csum[k - 1]) if k else 0
                page_limited = True
            # -- one decode step
            tr["batch"].append(act_id.size)
            tr["context_sum"].append(int(act_ctx.sum()))
            tr["carried_sum"].append(int(act_ctx[act_car].sum()) if act_car.any() else 0)
            tr["pages"].append(need_tot)
            tr["page_limited"].append(page_limited)
            tr["update"].append(u)
            steps += 1
            tokens += act_id.size
            act_ctx += 1
            act_rem -= 1
            used = need_tot
            fin = act_rem == 0
            if fin.any():
                done_ids = act_id[fin]
                req_prog[done_ids] = req_len[done_ids]
                used -= int(((act_ctx[fin] + ps - 1) // ps).sum())
                g, cnt = np.unique(done_ids // G, return_counts=True)
                grp_done[g] += cnt
                newly = g[grp_done[g] == G]
                complete_untrained += newly.size
                overdue -= int(np.count_nonzero(u - grp_created[newly] >= eta))
                keep = ~fin
                act_id, act_ctx, act_rem, act_car = act_id[keep], act_ctx[keep], act_rem[keep], act_car[keep]
                stop = (complete_untrained == T) if synchronous else (complete_untrained >= T and overdue == 0)
                if stop:
                    break
            if total_steps + steps > max_steps:
                raise RuntimeError(f"max_steps={max_steps} exceeded")
        total_steps += steps
        # -- keep prefixes of the unfinished; select the oldest T complete groups for training
        req_prog[act_id] = act_ctx - P
        live = np.flatnonzero(~grp_trained[:n_groups])
        done_groups = live[grp_done[live] == G]
        pick = done_groups[np.lexsort((done_groups, grp_created[done_groups]))[:T]]
        grp_trained[pick] = True
        rows["steps"].append(steps)
        rows["tokens"].append(tokens)
        rows["preemptions"].append(preempt)
        rows["reprefill_tokens"].append(reprefill)
        rows["new_groups"].append(n_new)
        rows["carried_requests"].append(carried_requests)
        rows["trained_mean_age"].append(float(np.mean(u - grp_created[pick])))
        left = live[grp_done[live] < G]
        rows["max_unfinished_age"].append(int((u - grp_created[left]).max()) if left.size else -1)

    return CollectionResult(
        updates={k: np.asarray(v) for k, v in rows.items()},
        trace={k: np.asarray(v) for k, v in tr.items()},
        pool=pool,
        synchronous=synchronous,
        warmup=warmup,
        params=dict(P=P, T=T, G=G, beta=beta, eta=eta, updates=updates, seed=seed, law=law.name),
    )
