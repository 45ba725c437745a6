"""What a model worker keeps for speed, by machine: MLX's freed buffers and
the hot KV tier, per process (workers/models/loading.py), and the KV arena's
default (environment/settings.py). The device dicts are what mx.device_info()
returns there (a double: only Metal and CUDA report these keys), so the rules
are checked for machines this one is not."""

from __future__ import annotations

from environment.settings import default_cache_memory
from workers.models.loading import (CPU_BUFFER_CACHE, CPU_HOT_KV, buffer_cache_bytes, hot_kv_bytes,
                                    unified_memory)

GiB = 1 << 30
MiB = 1 << 20
# Metal's recommended working set is about two thirds of RAM on a 16 GB Mac, three quarters on a large one.
MAC_16 = {"memory_size": 16 * GiB, "max_recommended_working_set_size": 11_453_251_584}
MAC_128 = {"memory_size": 128 * GiB, "max_recommended_working_set_size": 103_079_215_104}
H100 = {"total_memory": 85_520_809_984, "free_memory": 84_000_000_000, "device_name": "NVIDIA H100 80GB HBM3"}


def test_a_16_gb_mac_with_a_1_gb_model_keeps_little_besides_the_weights():
    """Split layout (2 model processes): before, 2.7 GB of freed buffers and
    0.7 GB of hot KV per worker (6.8 GB of a 16 GB machine's RAM on top of two
    copies of the weights); now 256 MiB and ~170 MiB each."""
    assert unified_memory(MAC_16)
    split = buffer_cache_bytes(False, MAC_16, 2) + hot_kv_bytes(False, MAC_16, 2)
    assert buffer_cache_bytes(False, MAC_16, 2) == 256 * MiB
    assert 150 * MiB < hot_kv_bytes(False, MAC_16, 2) < 200 * MiB
    assert 2 * split < 1 * GiB  # both workers together: under the weights of a 1 GB model
    colocated = buffer_cache_bytes(False, MAC_16, 1) + hot_kv_bytes(False, MAC_16, 1)
    assert colocated < 700 * MiB
    assert default_cache_memory(16 * GiB) == 16 * GiB // 10  # the arena: 1.6 GB


def test_a_128_gb_mac_scales_up_but_keeps_under_a_tenth_of_ram():
    buffers, hot = buffer_cache_bytes(False, MAC_128, 2), hot_kv_bytes(False, MAC_128, 2)
    assert 1 * GiB < buffers < 2 * GiB and 1 * GiB < hot < 2 * GiB
    assert 2 * (buffers + hot) < 128 * GiB // 10
    assert default_cache_memory(128 * GiB) == 8 * GiB  # capped


def test_a_discrete_gpu_keeps_the_hot_tier_in_its_own_memory():
    """The H100: the hot tier stays an eighth of the card per process (it cut
    a swarm from 60 to 34 s); the freed-buffer cache is a sixteenth, not half."""
    assert not unified_memory(H100)
    assert hot_kv_bytes(False, H100, 2) == H100["total_memory"] // 16
    assert buffer_cache_bytes(False, H100, 2) == H100["total_memory"] // 32
    small = {"total_memory": 8 * GiB}  # a small card: the 1 GiB floor, never over half per process
    assert buffer_cache_bytes(False, small, 2) == 1 * GiB
    assert buffer_cache_bytes(False, {"total_memory": 2 * GiB}, 4) == 2 * GiB // 8


def test_this_cpu_box():
    """MLX's CPU backend (24 GB, 2 cores): fixed small shares; the arena a tenth of RAM."""
    assert buffer_cache_bytes(True, {}, 2) == CPU_BUFFER_CACHE == 128 * MiB
    assert hot_kv_bytes(True, {}, 2) == CPU_HOT_KV == 64 * MiB
    assert default_cache_memory(24 * GiB) == 24 * GiB // 10
    assert default_cache_memory(1 * GiB) == 256 * MiB  # the floor


def test_unknown_devices_fall_back():
    assert buffer_cache_bytes(False, {"device_name": "?"}, 2) is None  # MLX's own default stays
    assert hot_kv_bytes(False, {}, 1) == CPU_HOT_KV


def test_the_arena_leaves_room_for_the_weights():
    """A tenth of RAM, but at most a quarter of what the model workers' weights
    leave, never under 256 MiB: a 16 GB Mac serving an 8 GB model split gets the
    floor; a small model changes nothing."""
    from environment.settings import MIN_CACHE_MEMORY, default_cache_memory
    GiB = 1 << 30
    assert default_cache_memory(ram=16 * GiB, weights=1 * GiB, copies=2) == 16 * GiB // 10
    assert default_cache_memory(ram=16 * GiB, weights=5 * GiB, copies=2) == (16 - 10) * GiB // 4
    assert default_cache_memory(ram=16 * GiB, weights=8 * GiB, copies=2) == MIN_CACHE_MEMORY
    assert default_cache_memory(ram=128 * GiB, weights=8 * GiB, copies=1) == 8 * GiB  # the cap
