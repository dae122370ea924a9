"""RLVR with quantised rollouts: a compact GRPO loop whose rollouts decode through a caller's cache.

Issue 27 reproduces KV4-RL's training claims at 135M scale: GRPO with the paper's objective
(:mod:`~kvlib.rl.grpo`), rollouts by ``model.generate`` through a ``cache_factory`` (bf16, kv4 or
kv4rl: :mod:`~kvlib.rl.sampler`), a verifiable arithmetic task made on the fly
(:mod:`~kvlib.rl.task`), the iteration/run/evaluator (:mod:`~kvlib.rl.loop`), the static-pool rollout
engine with CUDA-graph decode (:mod:`~kvlib.rl.engine`), the runs of one GPU call (``dev/rlvr_runs.py``,
outside the package; dev/gpu/rlvr.sh), the chapter's tables and verdicts (:mod:`~kvlib.rl.report`), and a GPU smoke
(:mod:`~kvlib.rl.smoke`, run by dev/gpu/rlvr_smoke.sh).

Issue 39 adds the regime the paper measures: a continuous-batching engine over paged pools cut from a byte
budget (:mod:`~kvlib.rl.pool`, :mod:`~kvlib.rl.continuous`), quota-based partial collection and its synchronous
baseline on it (:mod:`~kvlib.rl.collect`, App. B), a device-memory plan (:mod:`~kvlib.rl.memory`) and a task with
long responses (:mod:`~kvlib.rl.longtask`). Defaults and where each comes from:
:data:`kvlib.rl.loop.DEFAULT_SOURCES` (Table A1's values are not in our text of the paper; only
the dual-clip constant 3.0 is stated in its prose).

Why not TRL's ``GRPOTrainer``
-----------------------------
Read at huggingface/trl f2cd577 (2026-07-24), ``trl/trainer/grpo_trainer.py`` and ``grpo_config.py``.

*The loss has every piece we need.* ``loss_type="dapo"`` is the token mean over the global number
of valid tokens (L3139-3141, ``num_items_in_batch`` L2427); ``epsilon``/``epsilon_high`` give
clip-higher (L921, L3084); ``delta`` clamps the ratio from above (L3086-3087), which for
``A < 0`` is exactly dual clipping with ``c = delta`` (for ``A > 0`` it is inert when
``delta > 1 + epsilon_high``); ``beta`` adds the k3 KL to a reference (L3069-3072, added after
the policy term, L3120-3121); ``vllm_importance_sampling_mode="token_truncate"`` with
``vllm_importance_sampling_clip_max=C`` is token-level TIS ``min(exp(old - sampling), C)``
multiplying the per-token loss (L2579-2601, L3117-3118). Group normalisation divides by
``std + 1e-4`` (L2705-2707). Temperature, ``top_k``, ``top_p`` are config fields (L743-745).

*The rollouts cannot go through our cache with the sampler's log-probs kept.*
(1) Outside vLLM, ``_generate_single_turn`` calls ``unwrapped_model.generate(**generate_inputs,
generation_config=self.generation_config)`` (L1861-1863): no ``past_key_values`` is passed; a
cache can only be named by string (``cache_implementation``, L1120), and kvlib's cache is an
object built per batch with the model config. (2) That path discards the sampler's
probabilities: ``logprobs = None  # not used in this case`` (L1877). (3) TIS is gated on
``self.use_vllm`` (L2563, L2579, L3117): with transformers rollouts ``importance_sampling_ratio``
never exists, and ``use_vllm=True`` brings up a vLLM engine (not our kernels). Getting all three
would mean overriding a private method (``_generate_single_turn``) and faking ``use_vllm`` past the
vLLM set-up, i.e. depending on TRL internals that change release to release.

So this package is a compact loop with TRL's loss composition (each piece cited against the lines
above and tested by hand-computed cases in tests/test_rl_grpo.py, and against TRL itself in
tests/test_rl_trl_peer.py: TRL 1.16's ``GRPOTrainer`` fed one toy batch through ``rollout_func`` computes the
same advantages, TIS weights, loss and gradient; the recipes differ in the group-std stabiliser, 1e-4 in TRL, and
in TRL's default ratio-weighted KL, ``use_bias_correction_kl``, both asserted there). It is synchronous (one rollout,
then ``updates_per_iteration`` steps), which keeps pi_old equal to the sampler's weights: the TIS
weight then measures only the cache's numerical mismatch.
"""

from kvlib.rl.collect import Group, PartialCollector, async_grpo_iteration, collect_frozen, groups_rollout
from kvlib.rl.continuous import ContinuousEngine, Request
from kvlib.rl.engine import sample_static
from kvlib.rl.grpo import (
    clipped_surrogate,
    group_advantages,
    grpo_loss,
    informative_groups,
    kl_k3,
    tis_weights,
    token_mean,
)
from kvlib.rl.loop import DEFAULT_SOURCES, GRPOConfig, evaluate, frozen_copy, grpo_iteration, run_grpo, sync_weights
from kvlib.rl.memory import MemoryPlan, memory_plan
from kvlib.rl.pool import PagedKV, PoolPlan, plan_pool
from kvlib.rl.sampler import Rollout, learner_logprobs, sample
from kvlib.rl.task import Problem, format_prompt, last_boxed, make_problems, parse_answer, reward, split_of

__all__ = [
    "ContinuousEngine", "Group", "MemoryPlan", "PagedKV", "PartialCollector", "PoolPlan", "Request",
    "async_grpo_iteration", "collect_frozen", "groups_rollout", "memory_plan", "plan_pool",
    "DEFAULT_SOURCES", "GRPOConfig", "Problem", "Rollout", "clipped_surrogate", "evaluate", "format_prompt",
    "frozen_copy", "group_advantages", "grpo_iteration", "grpo_loss", "informative_groups", "kl_k3",
    "last_boxed", "learner_logprobs", "make_problems", "parse_answer", "reward", "run_grpo", "sample", "sample_static",
    "split_of", "sync_weights", "tis_weights", "token_mean",
]
