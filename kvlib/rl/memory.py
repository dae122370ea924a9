"""A device-memory plan for colocated GRPO with the continuous engine: what is reserved, what is left for KV pages.

KV4-RL App. B: "the allocator first reserves model state, execution workspace, quantization metadata, and any
protected side-cache storage, then converts the remaining HBM capacity into pages of the corresponding KV format".
:func:`memory_plan` does the first part from the shapes, hands the rest to :func:`kvlib.rl.pool.plan_pool` (which
reserves the format's per-row state and tables and cuts the remainder into pages), and says how many responses of
a given context fit in flight. Everything is an estimate from shapes except the pool, whose bytes are measured
from the backend's tensors; on the GPU :func:`measured_headroom` compares it with ``torch.cuda.mem_get_info``.

Reserved, colocated (generation and the learner alternate on one device; the pages stay allocated across the
update, since carried prefixes are re-prefilled anyway):

* *model state*: fp32 policy, its gradients, AdamW's two moments, the fp32 reference policy and the rollout copy in
  the engine's dtype (:func:`memory_estimate`'s 22 bytes a parameter for a bf16 copy);
* *learner peak*: the activations of one micro-batch of the update (:func:`memory_estimate`'s learner
  term: activations per token and layer, the chunked LM head);
* *engine workspace*: a decode step at the largest bucket (fp32 logits, their softmax and the float64 CDF of the
  sampler, the hidden states) and a prefill call (its tokens' activations, SDPA's fp32 scores over the chunk and
  the prior context, the prior K/V dequantised for one layer);
* *runtime*: the CUDA context and allocator slack (a fixed reserve, and a fraction of the device).

The learner and the engine do not run at once, so the larger of their two peaks is reserved, not the sum.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvlib.core.checks import check_positive_int
from kvlib.rl.pool import PoolPlan, model_shape, plan_pool

GIB = 2**30
#: the H200 of the device lane: 139 GiB usable (what torch.cuda.mem_get_info reports on it, rounded down)
H200_BYTES = 139 * GIB
#: the CUDA context, cuBLAS workspaces, Triton's and graph pools' fixed part
RUNTIME_RESERVE = 2 * GIB


@dataclass(frozen=True)
class MemoryPlan:
    """The plan's parts in bytes, the pool it leaves, and the concurrency it allows (see :func:`memory_plan`)."""

    device_bytes: int
    model_state: int
    learner_peak: int
    engine_workspace: int
    runtime: int
    slack: int
    pool: PoolPlan
    context: int  # the context each in-flight response is planned at (prompt + its longest response)
    n_params: int

    @property
    def reserved(self) -> int:
        return self.model_state + max(self.learner_peak, self.engine_workspace) + self.runtime + self.slack

    @property
    def in_flight(self) -> int:
        """Responses of ``context`` positions the pool and the slots hold at once."""
        return self.pool.concurrency_at(self.context)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pool"] = self.pool.as_dict()
        return d | {"reserved": self.reserved, "in_flight": self.in_flight}

    def rows(self) -> list[tuple[str, float, str]]:
        """``(part, GiB, how)`` rows of the plan, the pool last."""
        p = self.pool
        return [
            ("model state", self.model_state / GIB, f"{self.n_params / 1e6:.1f}M parameters: fp32 weights, grads, "
                                                    "AdamW moments, fp32 reference, rollout copy"),
            ("learner peak", self.learner_peak / GIB, "one micro-batch's activations + chunked LM head"),
            ("engine workspace", self.engine_workspace / GIB, f"decode at {p.slots} rows + one prefill call"),
            ("reserved: state + max(learner, engine)", (self.model_state + max(self.learner_peak,
                                                                                self.engine_workspace)) / GIB, ""),
            ("runtime + slack", (self.runtime + self.slack) / GIB, "CUDA context, workspaces, fragmentation"),
            ("KV pool", p.allocated_bytes / GIB, f"{p.pages + 1:,} pages of {p.block_size} positions "
                                                 f"({p.page_bytes:,} B), {p.rows} rows x {p.row_bytes:,} B side state"),
            ("device", self.device_bytes / GIB, ""),
        ]

    def describe(self) -> str:
        lines = [f"memory plan ({self.pool.fmt}, {self.device_bytes / GIB:.1f} GiB device):"]
        lines += [f"  {name:<42s} {gib:8.2f} GiB  {how}" for name, gib, how in self.rows()]
        p = self.pool
        lines.append(f"  => {p.positions:,} KV positions (kappa {p.kappa:,.0f} B); {self.in_flight} responses of "
                     f"{self.context:,} positions in flight ({p.slots} slots, {p.requests_at(self.context)} by pages)")
        return "\n".join(lines)


def engine_workspace(config: Any, *, slots: int, prefill_tokens: int, prefill_rows: int, max_context: int,
                     dtype_bytes: int = 2) -> int:
    """Peak bytes of the engine's own activations: a decode step at ``slots`` rows or a prefill call of
    ``prefill_tokens`` tokens over ``prefill_rows`` rows whose earlier context is up to ``max_context``."""
    L, n_kv, d, n_heads = model_shape(config)
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    # decode: logits (model dtype) -> fp32 log-softmax -> fp64 softmax and its cumsum; a few hidden-size rows
    decode = slots * vocab * (dtype_bytes + 4 + 4 + 8 + 8) + slots * (8 * h + 3 * inter) * 4
    # prefill: per token the layer's hidden/intermediate activations (one layer live at a time, no grad), the
    # SDPA scores of the chunk against chunk + prior (fp32), the prior K/V of one layer dequantised (fp32 + dtype)
    chunk = max(1, prefill_tokens // max(prefill_rows, 1))
    per_tok = (6 * h + 3 * inter) * dtype_bytes + h * 4
    scores = prefill_rows * n_heads * chunk * (chunk + max_context) * 4
    prior = prefill_rows * max_context * 2 * n_kv * d * (4 + dtype_bytes)
    prefill = prefill_tokens * per_tok + scores + prior + prefill_rows * vocab * 4
    return int(max(decode, prefill))


def memory_estimate(config: Any, n_params: int, *, rollout_batch: int, prompt_tokens: int, max_new_tokens: int,
                    micro_batch: int, eval_batch: int, chunk_tokens: int = 2048, grad_ckpt: bool = False,
                    shared_prefix_tokens: int = 0) -> dict:
    """Peak CUDA bytes of one training process, from the shapes (an estimate, printed at start and checked
    against ``torch.cuda.max_memory_allocated`` per iteration on the GPU).

    * weights: fp32 policy + its grads + AdamW's two moments + the fp32 reference + the bf16 rollout copy,
      22 bytes a parameter;
    * rollout: the bf16 KV pools (an upper bound for kv4/kv4rl) of ``rollout_batch`` rows at
      ``prompt + max_new_tokens`` (rounded up to 256-token pages), or of the evaluator's batch if larger,
      plus three fp32 ``[rows, vocab]`` sampling buffers;
    * learner: the activations autograd keeps for one micro-batch at sequence ``prompt + response``
      (per token and layer ~12 hidden + 5 intermediate values in bf16, the residual stream in fp32;
      with ``grad_ckpt`` only each layer's fp32 input, plus one layer recomputed), plus the LM-head
      chunk (fp32 logits, their softmax and gradient: 3 x ``chunk_tokens`` x vocab x 4 bytes). With
      ``shared_prefix_tokens`` (the learner's shared-prefix path) a micro-batch is one prefix row plus
      ``micro_batch`` suffix rows, and the expanded prefix KV (bf16) is kept per row and layer.
    """
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    vocab = config.vocab_size
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    seq = prompt_tokens + max_new_tokens
    max_len = -(-(seq + 1) // 256) * 256
    weights = 22 * n_params
    kv_row = layers * 2 * kv_heads * head_dim * 2 * max_len
    rollout = max(rollout_batch, eval_batch) * (kv_row + 3 * vocab * 4)
    per_tok_layer = (12 * h + 5 * inter) * 2 + 2 * h * 4
    # tokens through the decoder per micro-batch, and the prefix KV expanded to every row
    pre = min(shared_prefix_tokens, prompt_tokens)
    toks = micro_batch * seq if not pre else pre + micro_batch * (seq - pre)
    kv_expand = micro_batch * pre * layers * 2 * kv_heads * head_dim * 2 * 2 if pre else 0  # + the concat copy
    act_full = toks * layers * per_tok_layer + kv_expand
    act = (toks * (layers * h * 4 + per_tok_layer) + kv_expand) if grad_ckpt else act_full
    head = 3 * chunk_tokens * vocab * 4
    learner = act + head + toks * h * 4 * 2  # + the final hidden states and their gradient
    total = weights + max(rollout, learner)  # rollout pools are freed before the learner runs
    return {"weights": weights, "rollout": rollout, "learner": learner, "activations_no_ckpt": act_full,
            "grad_ckpt": grad_ckpt, "shared_prefix_tokens": pre, "learner_tokens_per_micro_batch": toks,
            "total": total, "total_gib": total / 2**30}


def memory_plan(fmt: str, config: Any, n_params: int, *, slots: int, prompt_tokens: int, max_new_tokens: int,
                micro_batch: int, device_bytes: int = H200_BYTES, staging: int = 8, prefill_tokens: int = 8192,
                grad_ckpt: bool = False, shared_prefix_tokens: int = 0, slack_fraction: float = 0.05,
                runtime_bytes: int = RUNTIME_RESERVE, **format_options: Any) -> MemoryPlan:
    """Reserve model state, the larger of the learner's and the engine's peaks, the runtime and a slack fraction of
    ``device_bytes``; cut the rest into pages of ``fmt`` (:func:`kvlib.rl.pool.plan_pool`, ``slots`` requests of
    at most ``prompt_tokens + max_new_tokens`` positions). Raises ValueError when nothing is left for pages."""
    for name, v in (("slots", slots), ("prompt_tokens", prompt_tokens), ("max_new_tokens", max_new_tokens),
                    ("micro_batch", micro_batch), ("device_bytes", device_bytes), ("n_params", n_params)):
        check_positive_int(name, v)
    if not 0 <= slack_fraction < 0.5:
        raise ValueError(f"slack_fraction must lie in [0, 0.5), got {slack_fraction!r}")
    context = prompt_tokens + max_new_tokens
    est = memory_estimate(config, n_params, rollout_batch=0, prompt_tokens=prompt_tokens,
                          max_new_tokens=max_new_tokens, micro_batch=micro_batch, eval_batch=0, grad_ckpt=grad_ckpt,
                          shared_prefix_tokens=shared_prefix_tokens)
    ws = engine_workspace(config, slots=slots, prefill_tokens=prefill_tokens, prefill_rows=staging,
                          max_context=context)
    slack = int(slack_fraction * device_bytes)
    left = device_bytes - est["weights"] - max(est["learner"], ws) - runtime_bytes - slack
    if left <= 0:
        raise ValueError(f"device_bytes={device_bytes / GIB:.1f} GiB: model state {est['weights'] / GIB:.2f} GiB + "
                         f"peak {max(est['learner'], ws) / GIB:.2f} GiB + runtime leave nothing for KV pages")
    pool = plan_pool(fmt, config, budget_bytes=int(left), slots=slots, staging=staging, max_context=context,
                     **format_options)
    return MemoryPlan(device_bytes=int(device_bytes), model_state=int(est["weights"]),
                      learner_peak=int(est["learner"]), engine_workspace=ws, runtime=int(runtime_bytes), slack=slack,
                      pool=pool, context=context, n_params=int(n_params))


def measured_headroom(plan: MemoryPlan) -> dict[str, float]:
    """On CUDA after the pool is allocated: free and total device memory (GiB) against the plan's reserve for
    what is not yet allocated (the learner / engine peaks); nothing to measure elsewhere."""
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"free_gib": free / GIB, "total_gib": total / GIB,
            "planned_peak_gib": max(plan.learner_peak, plan.engine_workspace) / GIB}
