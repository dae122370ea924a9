"""Rollouts through ``model.generate`` with a caller-supplied cache, and the learner's log-probabilities.

:func:`sample` draws responses at temperature 1 with no top-k/top-p and keeps the sampler's own
per-token log-probabilities, taken from the very scores ``generate`` sampled from
(``output_scores``); it checks that no logits processor changed them (``scores == logits``), so
the recorded ``q`` is the sampling distribution (KV4-RL Section 3: "the recorded softmax
probabilities match the sampling distribution"). The cache is ``cache_factory(batch)``: a
``DynamicCache`` today, ``kvlib.make_cache(fmt, model.config, batch_size=..., max_len=...)`` once
the packed decode path lands; this module does not care which.

:func:`learner_logprobs` scores the same tokens under a learner, teacher-forced, with the position ids
``generate`` used for left-padded prompts: one forward per micro-batch, or, when the prompts share a long
token prefix, that prefix once and each row's suffix on its expanded KV (same numbers up to rounding).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint


@dataclass
class Rollout:
    """A batch of sampled responses. Response tensors are ``[B, T]``; prompts are left-padded ``[B, P]``."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor  # 1 up to and including the first EOS
    sampler_logprobs: torch.Tensor  # float32, log q(y_ij | h_ij) as sampled; 0 where masked
    seconds: float
    texts: list[str] = field(default_factory=list)
    #: what the engine did (kvlib.rl.engine: cache format, kernel paths, graphed, prefill/decode seconds)
    info: dict = field(default_factory=dict)

    @property
    def lengths(self) -> torch.Tensor:
        return self.response_mask.sum(dim=1)


def _encode(tokenizer: Any, prompts: Sequence[str] | Sequence[Sequence[int]], pad_id: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if len(prompts) == 0:
        raise ValueError("prompts must be a non-empty sequence")
    if all(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise ValueError("tokenizer is required when prompts are strings")
        seqs = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    elif all(isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p) for p in prompts):
        seqs = [list(p) for p in prompts]
    else:
        raise TypeError("prompts must be all str or all sequences of int token ids")
    if any(len(s) == 0 for s in seqs):
        raise ValueError("every prompt must have at least one token")
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):  # left padding, as generate expects for decoder-only models
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def _seed_from(generator: torch.Generator | None) -> int | None:
    if generator is None:
        return None
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def sample(model: Any, tokenizer: Any, prompts: Sequence[str] | Sequence[Sequence[int]], *,
           cache_factory: Callable[[int], Any], max_new_tokens: int, generator: torch.Generator | None,
           eos_token_id: int | None = None, pad_token_id: int | None = None) -> Rollout:
    """Sample one response per prompt at temperature 1 (no top-k, no top-p) through ``cache_factory(B)``.

    ``generate`` draws from the global torch RNG, so ``generator`` seeds it inside
    ``torch.random.fork_rng`` (the caller's RNG state is left as it was): the same generator state
    gives the same rollout. Raises RuntimeError if a logits processor altered the scores (then the
    recorded log-probs would not be the sampling distribution).
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not callable(cache_factory):
        raise TypeError("cache_factory must be callable: batch_size -> transformers Cache")
    eos = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("eos_token_id is needed (pass it, or a tokenizer that has one)")
    pad = pad_token_id if pad_token_id is not None else (getattr(tokenizer, "pad_token_id", None) or eos)
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = _encode(tokenizer, prompts, pad, device)
    batch, width = prompt_ids.shape
    cache = cache_factory(batch)
    from transformers import GenerationConfig

    gen_cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                               eos_token_id=eos, pad_token_id=pad, output_scores=True, output_logits=True,
                               return_dict_in_generate=True)
    seed = _seed_from(generator)
    devices = [device] if device.type == "cuda" else []
    t0 = time.perf_counter()
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed)
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, past_key_values=cache,
                             generation_config=gen_cfg)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    response_ids = out.sequences[:, width:]
    steps = response_ids.shape[1]
    scores = torch.stack(out.scores, dim=1)[:, :steps]
    logits = torch.stack(out.logits, dim=1)[:, :steps]
    # EOS positions: valid up to and including the first EOS; later tokens are generate's padding
    is_eos = response_ids == eos
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), torch.full_like(is_eos[:, 0], steps,
                                                                                        dtype=torch.long))
    response_mask = (torch.arange(steps, device=device)[None, :] <= first[:, None]).long()
    valid = response_mask.bool()
    if not torch.equal(scores[valid], logits[valid]):
        raise RuntimeError("a logits processor changed the scores; the recorded log-probs would not be the "
                           f"temperature-1 distribution (generation config: {gen_cfg.to_diff_dict()})")
    logq = torch.log_softmax(scores.float(), dim=-1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    logq = logq.masked_fill(~valid, 0.0)
    texts = []
    if tokenizer is not None and hasattr(tokenizer, "decode"):
        texts = [tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True)
                 for r, m in zip(response_ids.cpu(), response_mask.cpu(), strict=True)]
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                   response_mask=response_mask, sampler_logprobs=logq, seconds=seconds, texts=texts)


def _token_logprobs(lm_head: Any, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    logits = lm_head(hidden).float()
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def shared_prefix_length(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """Token-level longest common prefix of the rows' (left-padded) prompts, capped at the shortest prompt
    minus one so that every row keeps at least one prompt token in its suffix (that token's hidden state
    predicts the first response token)."""
    if prompt_ids.ndim != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(f"prompt_ids and prompt_mask must be equal [B, P] tensors, got {tuple(prompt_ids.shape)} "
                         f"and {tuple(prompt_mask.shape)}")
    lens = prompt_mask.sum(dim=1)
    width = prompt_ids.shape[1]
    cap = int(lens.min()) - 1
    if cap <= 0 or prompt_ids.shape[0] == 1:
        return max(cap, 0)
    # align every row at its first real token: column j of `aligned` is token j of each prompt
    idx = (width - lens)[:, None] + torch.arange(cap, device=prompt_ids.device)[None, :]
    aligned = prompt_ids.gather(1, idx)
    same = (aligned == aligned[:1]).all(dim=0)
    return cap if bool(same.all()) else int(same.int().argmin())


def _lm_head_logprobs(lm_head: Any, h: torch.Tensor, tok: torch.Tensor, chunk_tokens: int, grad: bool) -> torch.Tensor:
    per = max(1, chunk_tokens // h.shape[0])  # positions per chunk, over all rows of the micro-batch
    parts = []
    for c in range(0, h.shape[1], per):
        if grad:
            parts.append(torch.utils.checkpoint.checkpoint(_token_logprobs, lm_head, h[:, c:c + per],
                                                           tok[:, c:c + per], use_reentrant=False))
        else:
            parts.append(_token_logprobs(lm_head, h[:, c:c + per], tok[:, c:c + per]))
    return torch.cat(parts, dim=1)


def _shared_prefix_hidden(model: Any, decoder: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                          response_ids: torch.Tensor, L: int) -> tuple[torch.Tensor, int]:
    """Hidden states predicting each response token, with the common prefix run once (batch 1).

    The prefix's KV (a ``DynamicCache``) is expanded to the rows with the cache's own
    ``batch_repeat_interleave`` (a differentiable ``repeat_interleave``: gradients from every row flow
    back into the one prefix forward); each row's suffix (rest of its prompt + its response) is
    right-padded, attends to prefix + its own suffix, at positions ``L + j`` (the positions generate
    used: its prompt starts at 0). Returns ``([rows, T, hidden], tokens forwarded)``.
    """
    from transformers import DynamicCache

    rows, width = prompt_ids.shape
    steps = response_ids.shape[1]
    dev = prompt_ids.device
    lens = prompt_mask.sum(dim=1)
    full = torch.cat([prompt_ids, response_ids], dim=1)
    first = int(width - lens[0])
    prefix = full[:1, first:first + L]
    cache = DynamicCache(config=model.config)
    decoder(input_ids=prefix, position_ids=torch.arange(L, device=dev)[None], past_key_values=cache, use_cache=True)
    cache.batch_repeat_interleave(rows)
    start = width - lens + L  # [rows] where each row's suffix begins in `full`
    sfx_len = lens - L + steps
    S = int(sfx_len.max())
    j = torch.arange(S, device=dev)[None, :]
    idx = (start[:, None] + j).clamp(max=full.shape[1] - 1)
    suffix = full.gather(1, idx)
    smask = (j < sfx_len[:, None]).long()
    attn = torch.cat([torch.ones(rows, L, dtype=smask.dtype, device=dev), smask], dim=1)
    pos = (L + j).expand(rows, S)
    hidden = decoder(input_ids=suffix, attention_mask=attn, position_ids=pos, past_key_values=cache,
                     use_cache=True).last_hidden_state
    # suffix position (lens - L - 1) + t predicts response token t
    at = (lens - L - 1)[:, None] + torch.arange(steps, device=dev)[None, :]
    h = hidden.gather(1, at[:, :, None].expand(rows, steps, hidden.shape[-1]))
    return h, L + rows * S


def learner_logprobs(model: Any, rollout: Rollout, *, micro_batch: int | None = None,
                     chunk_tokens: int = 2048, shared_prefix: bool | None = None, min_prefix: int = 32,
                     info: dict | None = None) -> torch.Tensor:
    """``[B, T]`` float32 log-probs of ``rollout``'s response tokens under ``model``, teacher-forced.

    Two paths, equal up to rounding (tests/test_rl_prefix.py):

    * *full*: one forward over ``prompt + response`` per micro-batch (all of ``B`` by default), no
      cache. The attention mask is the prompt's padding mask followed by ones (generate attends to
      every generated position too) and the position ids are ``cumsum(mask) - 1``, which is what
      ``generate`` uses for left-padded prompts.
    * *shared prefix*: when the micro-batch's prompts share a token-level prefix of at least
      ``min_prefix`` tokens (:func:`shared_prefix_length`; RL prompts repeat the same instructions and
      worked examples), that prefix runs once at batch 1 and only each row's suffix at batch ``rows``
      (:func:`_shared_prefix_hidden`). ``shared_prefix=None`` picks it when the prefix is long enough,
      True/False force it on/off (True with no usable prefix raises). Under gradient checkpointing with
      gradients on, transformers drops the cache inside checkpointed layers, so the full path is used.

    Gradients flow when called outside ``no_grad``. Masked positions are 0. ``info`` (a dict, if
    given) receives the path taken per micro-batch, why, the prefix lengths and the tokens forwarded.

    Memory: the decoder's hidden states are sliced to the response positions before the LM head, and
    the head + log-softmax run over at most ``chunk_tokens`` (row x position) entries at a time, each
    chunk under activation checkpointing when gradients flow, so the fp32 ``[rows, T, vocab]`` logits
    (49k vocab: 0.2 MB per position) never exist for the whole micro-batch, neither in the forward nor
    saved for the backward.
    """
    ids = torch.cat([rollout.prompt_ids, rollout.response_ids], dim=1)
    attn = torch.cat([rollout.prompt_mask, torch.ones_like(rollout.response_ids)], dim=1)
    pos = (attn.cumsum(dim=1) - 1).clamp(min=0)
    steps = rollout.response_ids.shape[1]
    mb = ids.shape[0] if micro_batch is None else micro_batch
    if not isinstance(mb, int) or mb < 1:
        raise ValueError(f"micro_batch must be an int >= 1, got {micro_batch!r}")
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if shared_prefix not in (None, True, False):
        raise TypeError(f"shared_prefix must be None, True or False, got {shared_prefix!r}")
    if not isinstance(min_prefix, int) or min_prefix < 1:
        raise ValueError(f"min_prefix must be an int >= 1, got {min_prefix!r}")
    decoder = getattr(model, "model", None)
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or lm_head is None:
        raise TypeError(f"learner_logprobs needs a *ForCausalLM with .model and an output embedding, got "
                        f"{type(model).__name__}")
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError("final_logit_softcapping is not applied by the chunked LM head")
    scale = getattr(model.config, "logits_scaling", None) or 1.0
    if scale != 1.0:
        raise ValueError("logits_scaling is not applied by the chunked LM head")
    grad = torch.is_grad_enabled()
    ckpt = grad and bool(getattr(model, "is_gradient_checkpointing", False)) and model.training
    rec = {"paths": [], "reasons": [], "prefix_tokens": [], "tokens": 0, "full_tokens": 0}
    rows = []
    for s in range(0, ids.shape[0], mb):
        pm, pmask = rollout.prompt_ids[s:s + mb], rollout.prompt_mask[s:s + mb]
        n = pm.shape[0]
        rec["full_tokens"] += n * ids.shape[1]  # what the full path forwards (padded)
        L = shared_prefix_length(pm, pmask) if shared_prefix is not False else 0
        if shared_prefix is False:
            why = "shared_prefix=False"
        elif ckpt:
            why = "gradient checkpointing drops the cache: full path"
        elif L < min_prefix:
            why = f"common prefix {L} < min_prefix {min_prefix} tokens: full path"
        else:
            why = None
        if why is not None and shared_prefix is True:
            raise ValueError(f"shared_prefix=True but {why}")
        tok = rollout.response_ids[s:s + mb]
        if why is None:
            h, used = _shared_prefix_hidden(model, decoder, pm, pmask, tok, L)
            rec["paths"].append("shared-prefix")
            rec["prefix_tokens"].append(L)
        else:
            hidden = decoder(input_ids=ids[s:s + mb], attention_mask=attn[s:s + mb], position_ids=pos[s:s + mb],
                             use_cache=False).last_hidden_state
            h = hidden[:, -(steps + 1):-1]  # position t predicts response token t
            used = n * ids.shape[1]
            rec["paths"].append("full")
            rec["prefix_tokens"].append(0)
        rec["reasons"].append(why or f"common prefix {L} tokens run once")
        rec["tokens"] += used
        rows.append(_lm_head_logprobs(lm_head, h, tok, chunk_tokens, grad))
    if info is not None:
        info.update(rec)
    return torch.cat(rows, dim=0).masked_fill(~rollout.response_mask.bool(), 0.0)
