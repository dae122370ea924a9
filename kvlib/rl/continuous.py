"""A rollout engine with continuous batching over kvlib's paged pools (issue 39).

The static engine (:mod:`kvlib.rl.engine`) decodes one fixed batch in a wave. This one keeps a set of requests in
flight over a :class:`~kvlib.rl.pool.PagedKV` (a byte budget cut into pages of the arm's format) and refills it:

* *admission*: a queued request is admitted when a request slot is free (at most ``plan.slots`` in flight), a
  staging row is free, and pages for its context plus the next position are free above a small watermark;
* *prefill*: arrivals are prefilled in staging rows, chunked (at most ``prefill_tokens`` tokens per engine step,
  over all arrivals) and batched (one forward, right-padded, a 4D mask). A chunk attends over the float K/V of its
  own tokens and over what the pool holds for the earlier chunks of its row (dequantised); a request whose prefill
  completes samples its next token from the last position's logits and moves into the decode region;
* *decode*: one token for every request in the decode region, rows ``[0, n)``, at the bucketed batch size
  ``B >= n`` (:attr:`ContinuousEngine.buckets`). The step reads only device tensors of fixed shape for a bucket
  (block table and ``seq_lens`` rows ``[0, B)``, the input ids, a live mask computed from a one-element count):
  padding rows are reset to length 0 inside the step and read and write the null page. On CUDA with a decode kernel
  every layer takes, the step is captured once per bucket and replayed (:attr:`ContinuousEngine.graphed`);
  sampling runs eagerly on the step's logits;
* *retirement*: a response that ends (EOS or its token limit) frees its pages at once and the last decode row moves
  into its row, so the next engine step admits a waiting request before the next decode call. When a decode step
  needs a page that is not free, the most recently admitted requests are preempted (pages freed, tokens and
  recorded log-probabilities kept, re-prefilled on re-admission), as vLLM does.

Sampling: temperature 1, no top-k/top-p (or argmax with ``greedy``), by inverse CDF with a uniform drawn from Philox
at ``(request id, token index)`` under the engine's seed. A request's tokens therefore do not depend on which other
requests share its steps (only on its context and the weights); the recorded behaviour log-probability is
``log_softmax(logits)`` of the sampled token in float32, from the very logits it was drawn from.

Policy versions: :meth:`ContinuousEngine.drain` takes every request out (pages freed, tokens kept);
after the weights change, :meth:`ContinuousEngine.weights_changed` bumps :attr:`version` and the carried requests,
resubmitted at the front, are re-prefilled under the new weights (KV4-RL App. B). Every token records the version
that sampled it.

The trace (:attr:`ContinuousEngine.trace`): one row per decode call with the active batch, the bucket, the
resident context (sum of the active requests' context lengths, the carried part apart), pages in use, the nominal
resident KV bytes (``kappa`` of the format x context), admissions and prefill tokens of the engine step, step time;
:attr:`ContinuousEngine.prefills` one row per prefill call. Certificates (dither-int8 keys): the decode kernel's
(CPU: its float64 reference's) TV bound per (layer, query head, live row), summarised per decode call
(coverage at ``tau``, vacuous fraction, mean and max of the finite ones): telemetry, nothing is gated on it.
"""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlib.core.checks import check_positive_int
from kvlib.core.philox import philox4x32_10, seed_key
from kvlib.hf.cache import _Tag
from kvlib.rl.pool import PagedKV, PoolPlan, model_shape

#: decode paths that are not a kernel (kvlib.rl.engine.REFERENCE_PATHS)
REFERENCE_PATHS = ("torch-reference", "none")
#: Philox counter word 3 of the sampler's uniforms (apart from every dither stream)
_SAMPLER_TAG = 0x53414D50


@dataclass
class Request:
    """One response in the making: its prompt, the tokens so far with the behaviour log-probability and policy
    version recorded at each, and why it ended (``"eos"``, ``"length"``; None while unfinished)."""

    rid: int
    prompt_ids: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None
    meta: Any = None
    admissions: int = 0
    preemptions: int = 0
    #: updates this request crossed unfinished (a carried prefix is re-prefilled under new weights)
    carried: int = 0
    #: indices of the tokens sampled from a prefill's logits (the first one, and the first after every re-prefill);
    #: every other token was sampled by a decode call that attended ``len(prompt) + index`` positions
    prefill_sampled: list[int] = field(default_factory=list)

    @property
    def context(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)

    @property
    def done(self) -> bool:
        return self.finish is not None

    def context_ids(self) -> list[int]:
        return list(self.prompt_ids) + list(self.tokens)


def default_buckets(slots: int) -> list[int]:
    """Decode batch sizes captured: powers of two below ``slots``, then ``slots``."""
    out = [1]
    while out[-1] * 2 < slots:
        out.append(out[-1] * 2)
    return sorted(set(out + [slots]))


def sampler_uniforms(seed: int, rids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in (0, 1), one per ``(request id, token index)``: Philox4x32-10 keyed by ``seed``,
    53 bits from two output words (so the draw of a request's token does not depend on its batch)."""
    k0, k1 = seed_key(seed)
    r = rids.to(torch.int64)
    ctr = torch.stack([r & 0xFFFFFFFF, (r >> 32) & 0xFFFFFFFF, index.to(torch.int64) & 0xFFFFFFFF,
                       torch.full_like(r, _SAMPLER_TAG)], dim=-1)
    key = torch.tensor([k0, k1], dtype=torch.int64, device=r.device).expand(r.shape[0], 2)
    w = philox4x32_10(ctr, key)
    hi, lo = (w[:, 0] >> 5).double(), (w[:, 1] >> 6).double()  # 27 + 26 bits
    return (hi * 2.0**26 + lo + 0.5) / 2.0**53


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, float32 log-probs)`` from ``logits [n, V]`` at temperature 1 by inverse CDF at ``uniforms``
    (float64 ``[n]``), or by argmax when ``uniforms`` is None."""
    lf = logits.float()
    logp = torch.log_softmax(lf, dim=-1)
    if uniforms is None:
        tok = lf.argmax(dim=-1)
    else:
        cdf = torch.softmax(lf.double(), dim=-1).cumsum(dim=-1)
        x = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
        tok = torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp(max=lf.shape[-1] - 1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class _StepTable:
    """What a backend's decode reads of a page table (``block_table``, ``seq_lens``, ``slot_table()``): views of the
    engine's rows ``[0, B)`` for one decode step."""

    def __init__(self, block_table: torch.Tensor, seq_lens: torch.Tensor, slot_table: torch.Tensor) -> None:
        self.block_table, self.seq_lens, self._slots = block_table, seq_lens, slot_table

    def slot_table(self) -> torch.Tensor:
        return self._slots


class _EngineLayer(CacheLayerMixin):
    """One decoder layer of :class:`_EngineCache`: writes through the engine's backend, hands kvlib's attention
    (:mod:`kvlib.hf.attention`) the new tokens tagged, and answers its decode-step / dequantised reads."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: _EngineCache, layer_idx: int) -> None:
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.path = "none"
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # never used: the engine passes 4D masks

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return self.cache.kv.plan.max_context

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        c, st, i = self.cache, self.cache.kv.backend, self.layer_idx
        if c.phase == "decode":
            st.write(i, key_states[:, :, 0], value_states[:, :, 0], c.slots, c.rows, c.pos, c.lens_after,
                     one_per_row=True)
            key_states._kvlib = _Tag(self, "step")  # read by kvlib.hf.attention
            return key_states, value_states
        if c.phase != "prefill":
            raise RuntimeError("the engine cache is used only inside the engine's own forwards")
        prior = c.prior_kv(i) if c.prior_width else None  # before the write (kv4rl: its side buffer as it was)
        kt = key_states.permute(0, 2, 1, 3)[c.tok_row, c.tok_col]
        vt = value_states.permute(0, 2, 1, 3)[c.tok_row, c.tok_col]
        st.write(i, kt, vt, c.slots, c.rows, c.pos, c.lens_after)
        k, v = st.as_attended(key_states, value_states)  # what the pool holds (a bf16 pool, fp32 model)
        if prior is not None:
            k, v = torch.cat([k, prior[0]], dim=2), torch.cat([v, prior[1]], dim=2)
        k = k.detach() if k.requires_grad else k
        k._kvlib = _Tag(self, "prefill")
        return k, v

    # -- reads for kvlib.hf.attention ---------------------------------------------------------------
    def rewrite_without_pads(self, k: torch.Tensor, v: torch.Tensor, pad: list[int]) -> None:
        raise RuntimeError(f"the engine's prefill masks have no left padding, got {pad}")

    def decode_step(self, query: torch.Tensor, scaling: float, mask: torch.Tensor | None = None
                    ) -> torch.Tensor | None:
        """The backend's :class:`~kvlib.backends.Step` (its kernel, or for dithered keys its float reference with
        the certificate), or None: :mod:`kvlib.hf.attention` attends over :meth:`reference_kv`. ``mask`` is the
        engine's own (no sliding window: refused at construction)."""
        c = self.cache
        step = c.kv.backend.decode(self.layer_idx, query[:, :, 0], c.table, scaling, c.delta_loc)
        if step.certificate is not None:
            c.record_certificates(step.certificate)
        if step.o is None:
            return None
        self.path = step.path
        return step.o

    def reference_kv(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The reference path's K, V (:meth:`dequantized`, keys unrotated) for :mod:`kvlib.hf.attention`."""
        return (*self.dequantized(), False)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Float K, V ``[B, H, n, d]`` of decode rows ``[0, B)`` up to the step's width (the reference path)."""
        c, st = self.cache, self.cache.kv.backend
        n = c.width
        slots = c.table.slot_table()[:, :n]
        lens = c.table.seq_lens
        k, v = st.gather_rows(self.layer_idx, slots, lens)
        valid = (torch.arange(n, device=k.device)[None, :] < lens[:, None].long())[:, None, :, None]
        return (k * valid).to(c.dtype), (v * valid).to(c.dtype)


class _EngineCache(Cache):
    """The transformers ``Cache`` the engine passes to the model: per-forward addressing set by the engine."""

    def __init__(self, engine: ContinuousEngine) -> None:
        self.engine, self.kv = engine, engine.kv
        self.n_layers = engine.kv.plan.n_layers
        super().__init__(layers=[_EngineLayer(self, i) for i in range(self.n_layers)])
        self.windowed = [False] * self.n_layers  # kvlib.hf.attention asks; the engine refuses windowed models
        self.hook = None  # kvlib.hf.attention asks (a cache hook, e.g. kvlib.gate's); the engine has none
        self.phase = "idle"
        self.dtype = engine.dtype
        self.delta_loc = engine.cert_delta_req / (self.n_layers * engine.n_heads * engine.cert_steps)
        self.width = 0
        self.prior_width = 0
        self.cert_acc = torch.zeros(5, dtype=torch.float64, device=engine.device)
        self.cert_live: torch.Tensor | None = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def prior_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the pool holds for the staging rows' earlier chunks: float ``[A, H, prior_width, d]``."""
        st, p = self.kv.backend, self.prior_width
        # row rows_phys[a]'s side buffer (kv4rl) for staging row a's slots; keys in the original basis
        k, v = st.gather_rows(layer, self.prior_slots, self.prior_lens, rows=self.rows_phys)
        valid = (torch.arange(p, device=k.device)[None, :] < self.prior_lens[:, None])[:, None, :, None]
        return (k * valid).to(self.dtype), (v * valid).to(self.dtype)

    def record_certificates(self, cert: torch.Tensor) -> None:
        """Accumulate a step's certificates ``[B, Hq]`` over live rows on the device (capturable)."""
        live = self.cert_live[:, None].expand_as(cert)
        c = cert.double()
        fin = torch.isfinite(c) & live
        acc = self.cert_acc
        acc[0] += live.sum()
        acc[1] += (fin & (c <= self.engine.cert_tau)).sum()
        acc[2] += (live & ~torch.isfinite(c)).sum()
        acc[3] += torch.where(fin, c, torch.zeros_like(c)).sum()
        acc[4] = torch.maximum(acc[4], torch.where(fin, c, torch.full_like(c, -math.inf)).amax())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ContinuousEngine:
    """Continuous batching over a paged pool of one format (module docstring).

    ``model``: a ``*ForCausalLM`` (its ``.model`` decoder and output embedding are used for prefill);
    ``plan``: the pool (:func:`kvlib.rl.pool.plan_pool`); ``prefill_tokens``: tokens per prefill call over all
    arrivals; ``buckets``: decode batch sizes (default :func:`default_buckets`); ``watermark``: fraction of pages
    kept free at admission; ``graph`` (default: on CUDA) captures each bucket's decode step after two eager uses;
    ``require_kernel`` (default: on CUDA) raises when a layer's decode took the torch reference; ``interpret``: run
    the Triton kernels on CPU tensors (TRITON_INTERPRET=1; tests). ``cert_tau``/``cert_delta_req``/``cert_steps``:
    the certificate's threshold and allocation (dither-int8 only, as :func:`kvlib.make_cache`'s).
    """

    def __init__(self, model: Any, plan: PoolPlan, *, eos_token_id: int, seed: int = 0, greedy: bool = False,
                 prefill_tokens: int = 2048, buckets: Sequence[int] | None = None, watermark: float = 0.01,
                 graph: bool | None = None, require_kernel: bool | None = None, interpret: bool = False,
                 cert_tau: float = 0.2, cert_delta_req: float = 1e-2, cert_steps: int = 256) -> None:
        if not isinstance(plan, PoolPlan):
            raise TypeError(f"plan must be a PoolPlan (kvlib.rl.pool.plan_pool), got {type(plan).__name__}")
        L, n_kv, d, n_heads = model_shape(model.config)
        # as kvlib.hf.cache reads it: layer_types, else a sliding_window with none (Mistral's)
        types = getattr(model.config, "layer_types", None) or (
            ["sliding_attention"] if getattr(model.config, "sliding_window", None) is not None else [])
        if "sliding_attention" in types:
            raise ValueError("model: the engine's decode kernels take no mask, so a sliding-window model is refused")
        if (L, n_kv, d) != (plan.n_layers, plan.n_kv, plan.head_dim):
            want = (plan.n_layers, plan.n_kv, plan.head_dim)
            raise ValueError(f"plan was made for (layers, kv heads, head dim) = {want}, the model has {(L, n_kv, d)}")
        if not isinstance(eos_token_id, int):
            raise TypeError(f"eos_token_id must be an int, got {type(eos_token_id).__name__}")
        self.prefill_tokens = check_positive_int("prefill_tokens", prefill_tokens)
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must lie in [0, 1), got {watermark!r}")
        self.decoder = getattr(model, "model", None)
        self.lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if self.decoder is None or self.lm_head is None:
            raise TypeError(f"model must be a *ForCausalLM with .model and an output embedding, got "
                            f"{type(model).__name__}")
        if getattr(model.config, "final_logit_softcapping", None) or (getattr(model.config, "logits_scaling", None)
                                                                      or 1.0) != 1.0:
            raise ValueError("logit soft-capping / scaling is not applied by the engine's prefill head")
        self.model, self.plan, self.eos, self.seed, self.greedy = model, plan, eos_token_id, int(seed), bool(greedy)
        seed_key(self.seed)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.n_heads = n_heads
        cuda = self.device.type == "cuda"
        self.use_graph = cuda if graph is None else bool(graph)
        if self.use_graph and not cuda:
            raise ValueError("graph=True needs a CUDA model")
        self.require_kernel = cuda if require_kernel is None else bool(require_kernel)
        self.cert_tau, self.cert_delta_req = float(cert_tau), float(cert_delta_req)
        self.cert_steps = check_positive_int("cert_steps", cert_steps)
        S = plan.slots
        self.buckets = sorted(set(default_buckets(S) if buckets is None else [int(b) for b in buckets]))
        if self.buckets[0] < 1 or self.buckets[-1] != S:
            raise ValueError(f"buckets must be positive and end at plan.slots={S}, got {self.buckets}")
        self.watermark_pages = int(plan.pages * watermark)
        if cuda:
            gc.collect()  # earlier pools are freed only by the cyclic collector (kvlib.rl.engine)
        self.kv = PagedKV(plan, self.device, seed=self.seed, interpret=interpret)
        self.cache = _EngineCache(self)
        from kvlib.hf.attention import activate

        activate(model.config)
        dev = self.device
        bs = plan.block_size
        self.ids = torch.zeros(S, 1, dtype=torch.long, device=dev)
        self.pos_ids = torch.zeros(S, 1, dtype=torch.long, device=dev)
        self.n_live = torch.zeros((), dtype=torch.int32, device=dev)
        self.row_ids = torch.arange(S, dtype=torch.int64, device=dev)
        self.lens_after = torch.zeros(plan.rows, dtype=torch.int64, device=dev)
        self.const_mask = torch.ones(S, 1, 1, 1, dtype=torch.bool, device=dev)
        self.page_offsets = torch.arange(bs, dtype=torch.int32, device=dev)
        self.kernel: bool | None = None
        self.paths: set[str] = set()
        self.graphs: dict[int, Any] = {}
        self.graph_out: dict[int, torch.Tensor] = {}
        self.graph_error: str | None = None
        self.bucket_uses: dict[int, int] = {}
        self._pool = None
        # requests
        self.queue: deque[Request] = deque()
        self.rows: list[Request | None] = [None] * plan.rows
        self.admitted_at = [0] * plan.rows  # admission order of each row's request (preemption takes the newest)
        self.n_dec = 0
        self.version = 0
        self.interval = 0
        self._admit_seq = 0
        self.trace: list[dict[str, Any]] = []
        self.prefills: list[dict[str, Any]] = []
        self._step_admitted = 0
        self._step_prefill_tokens = 0
        self._step_preempted = 0
        self.n_steps = 0

    # -- requests -------------------------------------------------------------------------------------
    def submit(self, requests: Iterable[Request], *, front: bool = False) -> None:
        """Queue ``requests`` (in order; ``front``: ahead of every queued one, as carried prefixes resume)."""
        reqs = list(requests)
        for r in reqs:
            if not isinstance(r, Request):
                raise TypeError(f"requests must be Request objects, got {type(r).__name__}")
            if r.done:
                raise ValueError(f"request {r.rid} has already finished ({r.finish})")
            if not r.prompt_ids:
                raise ValueError(f"request {r.rid}: empty prompt")
            if len(r.prompt_ids) + r.max_new_tokens > self.plan.max_context:
                raise ValueError(f"request {r.rid}: prompt {len(r.prompt_ids)} + max_new_tokens {r.max_new_tokens} "
                                 f"exceeds the pool's max_context={self.plan.max_context}")
            if r.max_new_tokens < 1 or len(r.tokens) >= r.max_new_tokens:
                raise ValueError(f"request {r.rid}: max_new_tokens={r.max_new_tokens} leaves nothing to generate")
        if front:
            self.queue.extendleft(reversed(reqs))
        else:
            self.queue.extend(reqs)

    @property
    def staging_rows(self) -> range:
        return range(self.plan.slots, self.plan.rows)

    @property
    def in_flight(self) -> list[Request]:
        return [r for r in self.rows if r is not None]

    @property
    def idle(self) -> bool:
        return not self.queue and not self.in_flight

    @property
    def graphed(self) -> bool:
        return bool(self.graphs)

    def drain(self) -> list[Request]:
        """Take every in-flight request out (pages freed; tokens and log-probabilities kept), oldest admission
        first; queued requests stay queued. Returns them (for resubmission, e.g. after a weight update)."""
        out = sorted(((self.admitted_at[i], r) for i, r in enumerate(self.rows) if r is not None),
                     key=lambda x: x[0])
        for i in range(self.plan.rows):
            if self.rows[i] is not None:
                self.rows[i] = None
                self.kv.release(i)
        self.n_dec = 0
        return [r for _, r in out]

    def take_queue(self) -> list[Request]:
        out = list(self.queue)
        self.queue.clear()
        return out

    def weights_changed(self) -> None:
        """The model's weights were updated in place: bump the policy version. Every resident KV would be stale,
        so nothing may be in flight (:meth:`drain` first)."""
        if self.in_flight:
            raise RuntimeError(f"{len(self.in_flight)} requests in flight hold KV of the old weights: drain() first")
        self.version += 1

    # -- one engine step --------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Admit, prefill one chunk, decode one token for the decode rows; returns the requests that ended."""
        if self.idle:
            return []
        self._step_admitted = self._step_prefill_tokens = self._step_preempted = 0
        self._admit()
        if not self.in_flight:
            head = self.queue[0]
            raise RuntimeError(f"request {head.rid} (context {head.context}) cannot be admitted into an empty pool of "
                               f"{self.plan.pages} pages of {self.plan.block_size} positions")
        ended = self._prefill()
        if self.n_dec:
            ended += self._decode()
        self.n_steps += 1
        return ended

    def run(self, max_steps: int | None = None) -> list[Request]:
        """Step until nothing is queued or in flight; returns every request that ended."""
        out: list[Request] = []
        n = 0
        while not self.idle:
            out += self.step()
            n += 1
            if max_steps is not None and n >= max_steps:
                break
        return out

    def _admit(self) -> None:
        free_rows = [i for i in self.staging_rows if self.rows[i] is None]
        while self.queue and free_rows:
            in_flight = self.n_dec + sum(self.rows[i] is not None for i in self.staging_rows)
            if in_flight >= self.plan.slots:
                return
            r = self.queue[0]
            need = self.kv.pages_for(r.context + 1)
            if self.kv.free_pages - need < self.watermark_pages and (self.n_dec or in_flight):
                return  # the watermark holds only while something runs (an empty pool admits what fits)
            row = free_rows.pop(0)
            if not self.kv.ensure(row, r.context + 1):
                return
            self.queue.popleft()
            self.rows[row] = r
            self._admit_seq += 1
            self.admitted_at[row] = self._admit_seq
            r.admissions += 1
            self._step_admitted += 1

    # -- prefill --------------------------------------------------------------------------------------
    def _prefill(self) -> list[Request]:
        todo = sorted((self.admitted_at[i], i) for i in self.staging_rows if self.rows[i] is not None)
        chunks, budget = [], self.prefill_tokens
        for _, row in todo:
            r = self.rows[row]
            start = self.kv.lens[row]
            n = min(r.context - start, budget)
            if n <= 0:
                break
            chunks.append((row, r, start, n))
            budget -= n
        if not chunks:
            return []
        t0 = time.perf_counter()
        logits = self._prefill_forward(chunks)
        ended: list[Request] = []
        done_rows = [(row, r) for row, r, start, n in chunks if start + n == r.context]
        if done_rows:
            idx = [i for i, (row, r, start, n) in enumerate(chunks) if start + n == r.context]
            reqs = [r for _, r in done_rows]
            tok, lp = self._sample(logits[idx], reqs)
            for (row, r), t, p in zip(done_rows, tok, lp, strict=True):
                r.prefill_sampled.append(len(r.tokens))
                if self._append(r, t, p):
                    ended.append(r)
                    self.rows[row] = None
                    self.kv.release(row)
                else:
                    self._to_decode(row, t)
        _sync(self.device)
        n_tok = sum(c[3] for c in chunks)
        self._step_prefill_tokens += n_tok
        self.prefills.append({"step": self.n_steps, "interval": self.interval, "version": self.version,
                              "rows": len(chunks), "tokens": n_tok, "completed": len(done_rows),
                              "seconds": time.perf_counter() - t0})
        return ended

    def _prefill_forward(self, chunks: list[tuple[int, Request, int, int]]) -> torch.Tensor:
        """One batched forward over the chunks (right-padded); returns the logits of each chunk's last token."""
        dev, c, kv = self.device, self.cache, self.kv
        A = len(chunks)
        C = max(n for *_, n in chunks)
        P = max(start for _, _, start, _ in chunks)
        ids = torch.zeros(A, C, dtype=torch.long)
        pos = torch.zeros(A, C, dtype=torch.long)
        # keys: [the chunk's own C | the row's earlier positions P]; every query attends key 0 (its chunk's first
        # token), so kvlib's attention reads no left padding off the mask, and pad queries get no NaN row
        mask = torch.zeros(A, 1, C, C + P, dtype=torch.bool)
        for i, (_, r, start, n) in enumerate(chunks):
            ctx = r.context_ids()
            ids[i, :n] = torch.tensor(ctx[start:start + n])
            pos[i, :n] = torch.arange(start, start + n)
            pos[i, n:] = start + n - 1
            mask[i, 0, :n, :n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
            mask[i, 0, :n, C:C + start] = True
            mask[i, 0, n:, 0] = True
        rows = torch.tensor([row for row, *_ in chunks], dtype=torch.int64)
        starts = torch.tensor([s for _, _, s, _ in chunks], dtype=torch.int64)
        counts = torch.tensor([n for *_, n in chunks], dtype=torch.int64)
        keep = torch.arange(C)[None, :] < counts[:, None]
        tr, tc = keep.nonzero(as_tuple=True)
        tok_pos = starts[tr] + tc
        lens_after = torch.tensor(kv.lens, dtype=torch.int64)
        lens_after[rows] = starts + counts
        bs = self.plan.block_size
        bt = kv.block_table[rows.to(dev)].long()
        c.tok_row, c.tok_col = tr.to(dev), tc.to(dev)
        c.rows = rows.to(dev)[c.tok_row]
        c.pos = tok_pos.to(dev)
        c.slots = bt[c.tok_row, c.pos // bs] * bs + c.pos % bs
        c.lens_after = lens_after.to(dev)
        c.prior_width = P
        if P:
            p = torch.arange(P, device=dev)
            c.prior_slots = bt[:, p // bs] * bs + p % bs
            c.prior_lens = starts.to(dev)
            c.rows_phys = rows.to(dev)
        c.phase = "prefill"
        try:
            with torch.no_grad():
                hidden = self.decoder(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                                      past_key_values=c, use_cache=True).last_hidden_state
                last = hidden[torch.arange(A, device=dev), (counts - 1).to(dev)]
                logits = self.lm_head(last)
        finally:
            c.phase = "idle"
        for (row, _, start, n) in chunks:
            kv.lens[row] = start + n
        kv.seq_lens[rows.to(dev)] = (starts + counts).to(dev, torch.int32)
        return logits

    def _to_decode(self, row: int, token: int) -> None:
        """Move a prefilled staging row into decode row ``n_dec`` with its next input token."""
        dst = self.n_dec
        self.kv.move(row, dst)
        self.rows[dst], self.rows[row] = self.rows[row], None
        self.admitted_at[dst] = self.admitted_at[row]
        self.ids[dst, 0] = token
        self.n_dec += 1

    # -- decode ---------------------------------------------------------------------------------------
    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} rows exceed the largest bucket {self.buckets[-1]}")

    def _reserve_decode_pages(self) -> None:
        """Pages for one more position in every decode row; preempt the newest admissions while short."""
        while self.n_dec:
            need = sum(self.kv.pages_for(self.kv.lens[r] + 1) - len(self.kv.blocks[r]) for r in range(self.n_dec))
            if need <= self.kv.free_pages:
                break
            newest = max(range(self.n_dec), key=lambda r: self.admitted_at[r])
            req = self.rows[newest]
            req.preemptions += 1
            self._step_preempted += 1
            self._retire(newest)
            self.queue.appendleft(req)
        for r in range(self.n_dec):
            if not self.kv.ensure(r, self.kv.lens[r] + 1):
                raise RuntimeError("page reservation failed after preemption")

    def _retire(self, row: int) -> None:
        """Free decode row ``row`` and move the last decode row into it (the decode region stays ``[0, n)``)."""
        self.rows[row] = None
        self.kv.release(row)
        last = self.n_dec - 1
        if row != last:
            self.kv.move(last, row)
            self.rows[row], self.rows[last] = self.rows[last], None
            self.admitted_at[row] = self.admitted_at[last]
            self.ids[row] = self.ids[last]
        self.n_dec -= 1

    def _decode(self) -> list[Request]:
        self._reserve_decode_pages()
        n = self.n_dec
        if not n:
            return []
        B = self.bucket(n)
        lens_before = self.kv.lens[:n]
        reqs = self.rows[:n]
        t0 = time.perf_counter()
        self.cache.cert_acc.zero_()
        self.cache.cert_acc[4] = -math.inf
        self.n_live.fill_(n)
        self.cache.width = max(lens_before) + 1
        logits = self._run_step(B)[:n]
        tok, lp = self._sample(logits, reqs)
        for r in range(n):
            self.kv.lens[r] += 1
        ended, finished_rows = [], []
        for r, (req, t, p) in enumerate(zip(reqs, tok, lp, strict=True)):
            if self._append(req, t, p):
                ended.append(req)
                finished_rows.append(r)
        self.ids[:n, 0] = torch.tensor(tok, dtype=torch.long).to(self.device)
        cert = self.cache.cert_acc.tolist()
        _sync(self.device)
        seconds = time.perf_counter() - t0
        ctx = [x + 1 for x in lens_before]  # positions each request attended in this step
        carried = sum(x for x, q in zip(ctx, reqs, strict=True) if q.carried)
        self.trace.append({
            "step": self.n_steps, "interval": self.interval, "version": self.version, "batch": n, "bucket": B,
            "context_sum": sum(ctx), "carried_context_sum": carried, "max_context": max(ctx),
            "pages_used": self.kv.used_pages, "kv_bytes": self.plan.kappa * sum(ctx),
            "page_bytes_used": self.kv.used_pages * self.plan.page_bytes,
            "admitted": self._step_admitted, "prefill_tokens": self._step_prefill_tokens,
            "preempted": self._step_preempted, "finished": len(finished_rows), "seconds": seconds,
            "graphed": B in self.graphs,
            "cert_n": cert[0], "cert_coverage": cert[1] / cert[0] if cert[0] else math.nan,
            "cert_vacuous": cert[2] / cert[0] if cert[0] else math.nan,
            "cert_mean_finite": cert[3] / max(cert[0] - cert[2], 1) if cert[0] else math.nan,
            "cert_max_finite": cert[4] if cert[0] else math.nan})
        for r in sorted(finished_rows, reverse=True):
            self._retire(r)
        return ended

    def _prologue(self, B: int) -> None:
        """The step's addressing, on the device only (part of the captured step)."""
        c, kv, bs = self.cache, self.kv, self.plan.block_size
        live = self.row_ids[:B] < self.n_live
        lens = kv.seq_lens[:B]
        pos = lens * live  # padding rows restart at 0 on the null page
        lens.copy_(pos + 1)
        bt = kv.block_table[:B]
        c.rows = self.row_ids[:B]
        c.pos = pos.long()
        self.lens_after[:B] = c.pos + 1  # one entry per pool row (kv4rl's fused side write reads it so)
        c.lens_after = self.lens_after
        c.slots = bt[c.rows, c.pos // bs].long() * bs + c.pos % bs
        slot_table = (bt[:, :, None] * bs + self.page_offsets).reshape(B, -1)
        c.table = _StepTable(bt, lens, slot_table)
        c.cert_live = live
        self.pos_ids[:B, 0] = c.pos

    def _forward(self, B: int, mask: torch.Tensor) -> torch.Tensor:
        self._prologue(B)
        self.cache.phase = "decode"
        try:
            out = self.model(input_ids=self.ids[:B], attention_mask=mask, position_ids=self.pos_ids[:B],
                             past_key_values=self.cache, use_cache=True).logits[:, -1]
        finally:
            self.cache.phase = "idle"
        return out

    def step_inputs(self, B: int) -> dict[str, tuple[tuple[int, ...], int]]:
        """``{name: (shape, data_ptr)}`` of the device tensors a decode step at bucket ``B`` reads and advances: the
        same for every step of a bucket, whatever requests are in flight (what a CUDA-graph replay needs)."""
        kv = self.kv
        ts = {"ids": self.ids[:B], "pos_ids": self.pos_ids[:B], "n_live": self.n_live,
              "block_table": kv.block_table[:B], "seq_lens": kv.seq_lens[:B], "const_mask": self.const_mask[:B]}
        return {k: (tuple(t.shape), t.data_ptr()) for k, t in ts.items()}

    def _run_step(self, B: int) -> torch.Tensor:
        uses = self.bucket_uses.get(B, 0)
        self.bucket_uses[B] = uses + 1
        if B in self.graphs:
            self.graphs[B].replay()
            return self.graph_out[B]
        if self.kernel is None or not self.kernel:
            # the reference path (or the first step, finding the path): the real mask over the step's width
            w = self.cache.width
            lens = self.kv.seq_lens[:B].long() * (self.row_ids[:B] < self.n_live) + 1
            mask = (torch.arange(w, device=self.device)[None, :] < lens[:, None])[:, None, None, :]
            with torch.no_grad():
                out = self._forward(B, mask)
            if self.kernel is None:
                paths = [la.path for la in self.cache.layers]
                self.paths.update(paths)
                self.kernel = not any(p in REFERENCE_PATHS for p in paths)
                if self.require_kernel and not self.kernel:
                    raise RuntimeError(f"format {self.plan.fmt!r}: decode took the torch reference on {self.device} "
                                       f"(layer paths {sorted(set(paths))}); the rollout must run on the kernel path")
            return out
        if self.use_graph and uses >= 2 and self.graph_error is None:
            return self._capture(B)
        with torch.no_grad():
            out = self._forward(B, self.const_mask[:B])
        self.paths.update(la.path for la in self.cache.layers)
        return out

    def _capture(self, B: int) -> torch.Tensor:
        kv = self.kv
        saved = kv.seq_lens.clone()
        g = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            with torch.no_grad(), torch.cuda.graph(g, pool=self._pool):  # recorded, not run: replayed below
                out = self._forward(B, self.const_mask[:B])
        except Exception as e:  # noqa: BLE001 - recorded in graph_error; the steps then run eager
            torch.cuda.synchronize(self.device)
            self.graph_error = f"{type(e).__name__}: {str(e)[:300]}"
            kv.seq_lens.copy_(saved)
            with torch.no_grad():
                return self._forward(B, self.const_mask[:B])
        kv.seq_lens.copy_(saved)
        self.graphs[B], self.graph_out[B] = g, out
        g.replay()
        return out

    # -- sampling -------------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, reqs: Sequence[Request]) -> tuple[list[int], list[float]]:
        if self.greedy:
            u = None
        else:
            rid = torch.tensor([r.rid for r in reqs], dtype=torch.int64)
            idx = torch.tensor([len(r.tokens) for r in reqs], dtype=torch.int64)
            u = sampler_uniforms(self.seed, rid, idx)
        tok, lp = sample_tokens(logits, u)
        return tok.tolist(), lp.tolist()

    def _append(self, r: Request, token: int, logprob: float) -> bool:
        """Record a sampled token; True when the request has now ended."""
        r.tokens.append(int(token))
        r.logprobs.append(float(logprob))
        r.versions.append(self.version)
        if token == self.eos:
            r.finish = "eos"
        elif len(r.tokens) >= r.max_new_tokens:
            r.finish = "length"
        return r.finish is not None

    # -- checks ---------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError when the rows, pages or lengths disagree (tests)."""
        self.kv.check()
        S = self.plan.slots
        for r in range(S):
            assert (self.rows[r] is not None) == (r < self.n_dec), f"decode row {r} out of place (n={self.n_dec})"
        for r, q in enumerate(self.rows):
            if q is None:
                assert not self.kv.blocks[r], f"row {r} holds pages without a request"
            else:
                want = q.context - 1 if r < S else None  # a decode row holds all but its last sampled token
                if want is not None:
                    assert self.kv.lens[r] == want, f"row {r}: {self.kv.lens[r]} positions for context {q.context}"
        ids = [id(q) for q in self.in_flight] + [id(q) for q in self.queue]
        assert len(set(ids)) == len(ids), "a request is in two places"
