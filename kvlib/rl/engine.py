"""The rollout engine: prefill and token-by-token decode through ``kvlib.make_cache(fmt, ...)``'s static pools.

Why not ``model.generate``: at 135M the decode step is launch-bound (~30 layers x a dozen kernels per
token), so the step is captured once in a CUDA graph and replayed; ``generate`` cannot replay a graph
over a kvlib cache. The loop here is what ``generate`` does for temperature-1 sampling with no
processors (left-padded prompts, position ids ``cumsum(mask) - 1``, rows stop at their first EOS),
written out so that the forward of a step can be a graph replay:

* the cache is ``make_cache(fmt, config, batch_size=B, max_len=P + T, device, dtype)``: pools and page
  tables allocated once, ``seq_lens`` advanced on the device (capturable);
* prefill is one eager forward over the left-padded prompts (kvlib's attention drops the pads from the
  pools and reports ``sdpa-prefill``);
* decode steps 1-2 run eager (compile, autotune, lazy allocations) and say which path every layer took
  (``cache.kernel_path(layer)``); with ``require_kernel`` (the default on CUDA) a layer that took the
  torch reference raises: no silent fallback to the float reference;
* from step 3 on, the step (forward + position increment) is a CUDA-graph replay (``graph=True``, the
  default on CUDA); sampling (``torch.multinomial`` over ``softmax(logits)`` at temperature 1, or argmax
  with ``greedy``) runs eagerly on the replay's output, and the recorded log-probability is taken from
  those very logits (the sampler's own distribution).

On the kernel path the decode attention reads only the pools (page table + ``seq_lens``), never the
mask, so steps get a constant 4D mask (HF's ``create_causal_mask`` returns a 4D mask as is). Without a
kernel (CPU) the step takes the real growing padding mask, as ``generate`` would, and runs eager.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvlib.rl.sampler import Rollout, _encode, _seed_from

#: page size per format: the INT4 kernels read whole pages only when a page is a multiple of their
#: block_n = 256 (kvlib.bench.e2e.BLOCK_SIZE); the INT8/bf16 kernels gather per token (make_cache's 16)
BLOCK_SIZE = {"kv4": 256, "kv4rl": 256}
#: decode paths that are not a kernel
REFERENCE_PATHS = ("torch-reference", "none")
#: a failed CUDA-graph capture (its error) turns capture off for the rest of the process: the steps then run
#: eager on the same kernels, and every rollout's info says graphed False with the error
_CAPTURE_FAILED: list[str] = []


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_paths(cache: Any) -> list[str]:
    """The path each layer's last step took (``cache.kernel_path(layer)``)."""
    return [cache.kernel_path(i) for i in range(cache.n_layers)]


def sample_static(model: Any, tokenizer: Any, prompts: Sequence[str] | Sequence[Sequence[int]], *, fmt: str,
                  max_new_tokens: int, generator: torch.Generator | None, greedy: bool = False,
                  min_new_tokens: int = 0, eos_token_id: int | None = None, pad_token_id: int | None = None,
                  graph: bool | None = None, require_kernel: bool | None = None,
                  cache_options: dict | None = None) -> Rollout:
    """Sample (temperature 1, no top-k/top-p; or ``greedy``) one response per prompt through a kvlib cache.

    Returns a :class:`~kvlib.rl.sampler.Rollout` whose ``info`` says what ran: ``fmt``,
    ``prefill_path``, ``decode_paths`` (distinct per-layer paths of the eager steps), ``graphed``,
    ``steps``, ``prefill_seconds``, ``capture_seconds``, ``decode_seconds``. ``min_new_tokens``: decode
    at least this many steps even when every row has ended (the timing phase fixes lengths with it).
    """
    if not isinstance(fmt, str):
        raise TypeError(f"fmt must be a str (a kvlib format name), got {type(fmt).__name__}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(min_new_tokens, int) or not 0 <= min_new_tokens <= max_new_tokens:
        raise ValueError(f"min_new_tokens must be an int in [0, max_new_tokens], got {min_new_tokens!r}")
    import kvlib

    eos = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("eos_token_id is needed (pass it, or a tokenizer that has one)")
    pad = pad_token_id if pad_token_id is not None else (getattr(tokenizer, "pad_token_id", None) or eos)
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    graph = cuda if graph is None else bool(graph)
    require_kernel = cuda if require_kernel is None else bool(require_kernel)
    if graph and not cuda:
        raise ValueError("graph=True needs a CUDA model")
    prompt_ids, prompt_mask = _encode(tokenizer, prompts, pad, device)
    batch, width = prompt_ids.shape
    steps_max = max_new_tokens
    opts = {"block_size": BLOCK_SIZE.get(fmt, 16), **(cache_options or {})}
    bs = opts["block_size"]
    max_len = -(-(width + steps_max + 1) // bs) * bs
    seed = _seed_from(generator)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))

    if cuda:
        # kvlib's caches hold reference cycles (cache -> layer -> cache), so a finished rollout's KV pool is freed
        # only by the cyclic collector; without this, GRPO iterations pile up one pool each until OOM.
        gc.collect()
    _sync(device)
    t0 = time.perf_counter()
    cache = kvlib.make_cache(fmt, model.config, batch_size=batch, max_len=max_len, device=device, dtype=model.dtype,
                             **opts)
    real = prompt_mask.sum(dim=1)
    with torch.no_grad():
        out = model(input_ids=prompt_ids, attention_mask=prompt_mask,
                    position_ids=(prompt_mask.cumsum(dim=1) - 1).clamp(min=0), past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1]
    prefill_path = sorted(set(kernel_paths(cache)))
    _sync(device)
    t_prefill = time.perf_counter()

    ids_buf = torch.full((batch, 1), pad, dtype=torch.long, device=device)
    pos_buf = real.view(batch, 1).clone()
    const_mask = torch.ones(batch, 1, 1, 1, dtype=torch.bool, device=device)
    full_mask = torch.cat([prompt_mask, torch.ones(batch, steps_max, dtype=prompt_mask.dtype, device=device)], 1)
    state: dict[str, Any] = {"kernel": None, "graph": None, "out": None, "paths": set()}

    def forward(t: int) -> torch.Tensor:
        # on the kernel path the decode attention never reads the mask (module docstring)
        mask = const_mask if state["kernel"] else full_mask[:, :width + t + 1]
        o = model(input_ids=ids_buf, attention_mask=mask, position_ids=pos_buf, past_key_values=cache,
                  use_cache=True).logits[:, -1]
        pos_buf.add_(1)
        return o

    def step(t: int) -> torch.Tensor:
        if state["graph"] is not None:
            state["graph"].replay()
            return state["out"]
        if state["kernel"] is None:  # first step: find the path with the real mask (safe on either path)
            state["kernel"] = False
            o = forward(t)
            paths = kernel_paths(cache)
            state["paths"].update(paths)
            state["kernel"] = not any(p in REFERENCE_PATHS for p in paths)
            if require_kernel and not state["kernel"]:
                raise RuntimeError(f"format {fmt!r}: decode took the torch reference on {device} (layer paths "
                                   f"{sorted(set(paths))}); the rollout must run on the kernel path")
            return o
        if graph and state["kernel"] and t >= 2 and not _CAPTURE_FAILED:
            tc = time.perf_counter()
            g = torch.cuda.CUDAGraph()
            pos_before = pos_buf.clone()
            try:
                with torch.cuda.graph(g):  # recorded, not run: the replay below is step t
                    state["out"] = forward(t)
            except Exception as e:  # noqa: BLE001 - recorded in info["graph_error"]; this step then runs eager
                torch.cuda.synchronize(device)
                _CAPTURE_FAILED.append(f"{type(e).__name__}: {str(e)[:300]}")
                pos_buf.copy_(pos_before)  # nothing of the failed capture ran on the device
                return step_eager(t)
            state["graph"] = g
            state["capture_seconds"] = time.perf_counter() - tc
            g.replay()
            return state["out"]
        return step_eager(t)

    def step_eager(t: int) -> torch.Tensor:
        o = forward(t)
        state["paths"].update(kernel_paths(cache))
        return o

    tokens = torch.full((batch, steps_max), pad, dtype=torch.long, device=device)
    logq = torch.zeros(batch, steps_max, dtype=torch.float32, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    n = 0
    with torch.no_grad():
        for t in range(steps_max):
            lf = logits.float()
            logp = torch.log_softmax(lf, dim=-1)
            if greedy:
                tok = lf.argmax(dim=-1)
            else:
                tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
            lp = logp.gather(-1, tok[:, None]).squeeze(1)
            tok = torch.where(finished, torch.full_like(tok, pad), tok)
            tokens[:, t] = tok
            logq[:, t] = lp
            finished |= tok == eos
            n = t + 1
            if n == steps_max:
                break
            if n >= min_new_tokens and n % 16 == 0 and bool(finished.all()):  # one host sync per 16 steps
                break
            ids_buf.copy_(tok[:, None])
            logits = step(t)
    _sync(device)
    t_end = time.perf_counter()
    response_ids = tokens[:, :n]
    is_eos = response_ids == eos
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1),
                        torch.full((batch,), n, dtype=torch.long, device=device))
    response_mask = (torch.arange(n, device=device)[None, :] <= first[:, None]).long()
    logq = logq[:, :n].masked_fill(~response_mask.bool(), 0.0)
    texts = []
    if tokenizer is not None and hasattr(tokenizer, "decode"):
        texts = [tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True)
                 for r, m in zip(response_ids.cpu(), response_mask.cpu(), strict=True)]
    info = {"fmt": fmt, "prefill_path": prefill_path, "decode_paths": sorted(state["paths"]),
            "kernel": bool(state["kernel"]), "graphed": state["graph"] is not None, "steps": n,
            "graph_error": _CAPTURE_FAILED[0] if graph and _CAPTURE_FAILED else None,
            "batch": batch, "prompt_width": width, "max_len": max_len, "block_size": bs,
            "prefill_seconds": t_prefill - t0, "capture_seconds": state.get("capture_seconds", 0.0),
            "decode_seconds": t_end - t_prefill, "kv_nbytes": int(cache.kv_nbytes())}
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                   response_mask=response_mask, sampler_logprobs=logq, seconds=t_end - t0, texts=texts, info=info)
