"""A CPU engine's KV cache: the setting when given, else 256 sequences per device of the engine's TP, each the
job's longest in 128-token blocks, plus vLLM's null block (by hand below), at most 1 GiB."""

from rldock.config.rollout import RolloutSpec
from rldock.runtime.planning.cpu_kv_cache import CPU_KV_CACHE_CAP_BYTES, cpu_kv_cache_bytes
from rldock.runtime.planning.shapes import PRESETS, shape_from_hf_config

MIB = 1024**2

# The demo's tiny model (models/tiny_qwen2.py): 2 layers, 2 KV heads of 32 dims.
TINY = shape_from_hf_config(
    {
        "model_type": "qwen2",
        "vocab_size": 64,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 256,
    },
    name="tiny",
)


def test_unset_it_holds_256_sequences_in_whole_blocks():
    # a key and a value per layer and KV head in float32: 2 * 2 * 2 * 32 * 4 = 1024 bytes a token; the demo's
    # 14-token sequences take one 128-token block each, and vLLM keeps one block back: (256 + 1) * 128 tokens
    size = cpu_kv_cache_bytes(RolloutSpec(), TINY, dtype_bytes=4, generation_tp=1, max_model_len=14)
    assert size == (256 + 1) * 128 * 1024
    # 129 tokens take two blocks
    size = cpu_kv_cache_bytes(RolloutSpec(), TINY, dtype_bytes=4, generation_tp=1, max_model_len=129)
    assert size == (2 * 256 + 1) * 128 * 1024


def test_generation_tp_runs_256_sequences_per_device_over_its_share_of_the_kv_heads():
    # vLLM runs 256 x TP sequences at once on a CPU; each device holds one of the 2 KV heads: 512 bytes a token
    size = cpu_kv_cache_bytes(RolloutSpec(), TINY, dtype_bytes=4, generation_tp=2, max_model_len=14)
    assert size == (2 * 256 + 1) * 128 * 512
    # TP 4 over 2 KV heads: each device still keeps one head, for 1024 sequences
    size = cpu_kv_cache_bytes(RolloutSpec(), TINY, dtype_bytes=4, generation_tp=4, max_model_len=14)
    assert size == (4 * 256 + 1) * 128 * 512


def test_a_larger_model_gets_the_cap():
    # Qwen2.5-7B: 2 * 28 * 4 * 128 * 4 = 114,688 bytes a token; (256 * 8 + 1) * 128 tokens would be 28 GiB
    size = cpu_kv_cache_bytes(RolloutSpec(), PRESETS["qwen2.5-7b"], dtype_bytes=4, generation_tp=1, max_model_len=1024)
    assert size == CPU_KV_CACHE_CAP_BYTES == 1024 * MIB


def test_the_setting_wins_and_an_unread_shape_gets_the_cap():
    rollout = RolloutSpec(cpu_kv_cache_gib=0.25)
    assert cpu_kv_cache_bytes(rollout, TINY, dtype_bytes=4, generation_tp=1, max_model_len=14) == 256 * MIB
    assert cpu_kv_cache_bytes(RolloutSpec(), None, dtype_bytes=4, generation_tp=1, max_model_len=14) == 1024 * MIB
