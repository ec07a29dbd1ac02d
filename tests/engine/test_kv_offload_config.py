"""The KV-tier flags (--kv-offload-memory, --kv-offload-dir, --kv-offload-disk-bytes,
--preemption-mode): defaults, checks naming the problem, and the CLI's one-line error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda.config import DEFAULT_KV_OFFLOAD_DISK_BYTES, EngineConfig
from pagoda.engine.core.kv_cache_groups import KVCacheManager
from pagoda.engine.core.kv_offload_index import KVOffloadIndex


def test_defaults_are_off_and_recompute() -> None:
    config = EngineConfig()
    assert config.cache.kv_offload_memory == 0
    assert config.cache.kv_offload_dir is None
    assert config.cache.kv_offload_disk_bytes == DEFAULT_KV_OFFLOAD_DISK_BYTES
    assert not config.cache.kv_offload_enabled
    assert config.scheduler.preemption_mode == "recompute"


def test_tiers_are_on_with_memory_or_a_folder(tmp_path) -> None:
    assert EngineConfig.from_kwargs(kv_offload_memory=1 << 20).cache.kv_offload_enabled
    config = EngineConfig.from_kwargs(kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=4096)
    assert config.cache.kv_offload_enabled and config.cache.kv_offload_disk_bytes == 4096


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"preemption_mode": "swap"}, "--kv-offload-memory"),
    ({"preemption_mode": "page"}, "preemption_mode must be one of auto, recompute, swap"),
    ({"kv_offload_memory": -1}, "kv_offload_memory must be an int >= 0"),
    ({"kv_offload_disk_bytes": 0}, "kv_offload_disk_bytes must be an int >= 1"),
    ({"kv_offload_dir": " "}, "kv_offload_dir must name a folder"),
    ({"kv_offload_memory": 1 << 20, "tensor_parallel_size": 2}, "tensor_parallel_size 1"),
])
def test_bad_settings_are_refused_by_name(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_swap_with_host_memory_is_accepted() -> None:
    config = EngineConfig.from_kwargs(kv_offload_memory=1 << 20, preemption_mode="swap")
    assert config.scheduler.preemption_mode == "swap"


def test_auto_swaps_where_there_is_a_host_tier_and_recompute_stays_on_request(tmp_path) -> None:
    """auto (the default): swap with --kv-offload-memory, which measured faster than
    recompute (BENCHMARKS.md section 34); recompute with a disk tier alone or no tiers."""
    assert EngineConfig.from_kwargs(kv_offload_memory=1 << 20).scheduler.preemption_mode == "swap"
    assert EngineConfig.from_kwargs(kv_offload_dir=str(tmp_path)).scheduler.preemption_mode == (
        "recompute")
    assert EngineConfig.from_kwargs(kv_offload_memory=1 << 20, preemption_mode="recompute"
                                    ).scheduler.preemption_mode == "recompute"


def test_sliding_window_groups_refuse_the_tiers_by_name() -> None:
    manager = KVCacheManager([8, 8], 4, [None, 16])
    with pytest.raises(ValueError, match="sliding-window layers"):
        manager.attach_kv_offload(KVOffloadIndex(1 << 20, 64))
    KVCacheManager([8], 4, [None]).attach_kv_offload(KVOffloadIndex(1 << 20, 64))  # one full group: fine


def test_swap_without_host_memory_is_a_one_line_cli_error() -> None:
    result = subprocess.run([sys.executable, "-m", "pagoda", "generate", "--preemption-mode",
                             "swap", "hello"], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "--kv-offload-memory" in result.stderr
