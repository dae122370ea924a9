"""The device-memory plan (kvlib.rl.memory): the bf16 arm with 512+ responses in flight on one H200."""

import pytest
from transformers import LlamaConfig

from kvlib.rl.memory import GIB, H200_BYTES, memory_plan

#: SmolLM2-135M's shapes (the shipped GGUF's config) and parameter count (tied embeddings)
SMOL = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)
N_PARAMS = 134_515_008


def test_bf16_arm_holds_512_long_responses_on_an_h200():
    plan = memory_plan("bf16", SMOL, N_PARAMS, slots=512, prompt_tokens=1024, max_new_tokens=2048, micro_batch=8)
    assert plan.pool.kappa == 30 * 3 * 64 * 2 * 2  # 23,040 B per position: the 23 KB
    assert plan.in_flight == 512 and plan.pool.requests_at(plan.context) >= 512
    used = plan.reserved + plan.pool.allocated_bytes
    assert used <= H200_BYTES < used + plan.pool.page_bytes  # every byte planned, the rest cut into whole pages
    text = plan.describe()
    assert "bf16" in text and "512 responses of 3,072 positions in flight" in text


def test_lower_bits_hold_more_and_small_devices_are_refused():
    kw = dict(slots=1024, prompt_tokens=1024, max_new_tokens=4096, micro_batch=2, device_bytes=40 * GIB)
    bf16 = memory_plan("bf16", SMOL, N_PARAMS, **kw)
    kv4rl = memory_plan("kv4rl", SMOL, N_PARAMS, **kw)
    assert bf16.in_flight < kv4rl.in_flight  # at 40 GiB the bf16 pool is page-limited, KV4-RL's is not as much
    assert bf16.reserved == kv4rl.reserved  # the same model state and peaks: only the pages differ
    with pytest.raises(ValueError, match="nothing for KV pages"):
        memory_plan("bf16", SMOL, N_PARAMS, slots=8, prompt_tokens=512, max_new_tokens=512, micro_batch=64,
                    device_bytes=8 * GIB)
    with pytest.raises(ValueError, match="slots"):
        memory_plan("bf16", SMOL, N_PARAMS, slots=0, prompt_tokens=512, max_new_tokens=512, micro_batch=8)
