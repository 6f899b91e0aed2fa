"""KV cache groups on the device side: page tensors shared by the groups (vLLM's hybrid layout),
metadata with one block table per group, and the engine's grouping of a model's layers."""
from __future__ import annotations

import numpy as np
import pytest

from kvjax.attention.metadata import MetadataError, build_metadata
from kvjax.config.engine import EngineError, KVCacheGroups, resolve_kv_cache_groups
from kvjax.config.hf import from_hf_config
from kvjax.config.scheduler import SchedulerConfig, request_blocks
from kvjax.core.kv_cache_interface import KVSpec
from kvjax.worker.paged_cache import CacheError, PagedCache

ON = dict(hybrid=True, kv_layout="paged", host_tier=False, tensor_parallel_size=1)
GEMMA3 = {"model_type": "gemma3_text", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "max_position_embeddings": 512, "sliding_window": 6, "sliding_window_pattern": 4, "torch_dtype": "float32"}


def test_groups_share_page_tensors():
    """8 layers, 3 sliding : 1 full: buckets of 6 sliding and 2 full layers, groups of 2 layers
    (6 < 1.5 × 2 fails, so the smaller bucket's size): 3 sliding groups and 1 full, layers[i::n];
    the j-th layer of every group shares tensor j, so the cache is 2 layers' pages, not 8."""
    config = from_hf_config(GEMMA3)
    groups = resolve_kv_cache_groups(config, config.kv_spec(), 4, **ON)
    windows, layer_groups, layer_slots = groups.windows, groups.layer_groups, groups.layer_slots
    assert windows == (6, 6, 6, None)
    assert layer_groups == (0, 1, 2, 3, 0, 1, 2, 3) and layer_slots == (0, 0, 0, 0, 1, 1, 1, 1)
    spec = config.kv_spec()
    shared = PagedCache.create(spec, 9, 4, layer_slots=layer_slots)
    own = PagedCache.create(spec, 9, 4)
    assert len(shared.layers) == 2 and shared.num_layers == 8 and shared.slot_of(5) == 1
    assert shared.kv_nbytes * 4 == own.kv_nbytes == 9 * spec.bytes_per_block(4)
    # off: one group, every layer its own tensor, the window left to the attention mask
    assert resolve_kv_cache_groups(config, spec, 4, **dict(ON, hybrid=False)) == KVCacheGroups((None,), (), ())
    with pytest.raises(EngineError, match="tensor parallelism with KV cache groups"):
        resolve_kv_cache_groups(config, spec, 4, **dict(ON, tensor_parallel_size=2))


def test_shared_tensors_refuse_what_cannot_be_shared():
    spec = KVSpec("gqa", 2, 4, 2, 16, kv_dtype="fp8", skip_layers=(0,))
    with pytest.raises(CacheError, match="per-layer kv dtypes"):
        PagedCache.create(spec, 9, 4, layer_slots=(0, 0))
    with pytest.raises(CacheError, match="must give each of the 2 layers"):
        PagedCache.create(KVSpec("gqa", 2, 4, 2, 16), 9, 4, layer_slots=(0, 2))


def test_metadata_per_group_allows_nulls_only_before_the_window():
    """Z = 4, window 6: a sequence with 14 computed tokens scheduling 1 more; its first query (at 14)
    sees positions 9..14, blocks 2 and 3, so entries 0 and 1 of its sliding table may be null."""
    tables = [[[1, 2, 3, 4], [0, 0, 7, 8]]]
    md = build_metadata([14], [1], tables, block_size=4, max_tokens=1, max_seqs=1, max_blocks_per_seq=4,
                        windows=(None, 6), layer_groups=(0, 1, 0))
    np.testing.assert_array_equal(np.asarray(md.group_tables)[:, 0], [[1, 2, 3, 4], [0, 0, 7, 8]])
    assert int(md.for_layer(1).slot_mapping[0]) == 8 * 4 + 2 and int(md.for_layer(2).slot_mapping[0]) == 4 * 4 + 2
    with pytest.raises(MetadataError, match="at or after block 2, which its window of 6 still sees"):
        build_metadata([14], [1], [[[1, 2, 3, 4], [0, 0, 0, 8]]], block_size=4, max_tokens=1, max_seqs=1,
                       max_blocks_per_seq=4, windows=(None, 6), layer_groups=(0, 1))
    with pytest.raises(MetadataError, match="uses the null block"):  # a full group never has nulls
        build_metadata([14], [1], [[[0, 2, 3, 4], [0, 0, 7, 8]]], block_size=4, max_tokens=1, max_seqs=1,
                       max_blocks_per_seq=4, windows=(None, 6), layer_groups=(0, 1))


def test_request_blocks_over_the_groups():
    # full: cdiv(100, 4) = 25; sliding 6 with 8-token chunks: cdiv(5 + 8, 4) + 1 = 5 (under 25)
    assert request_blocks((None, 6, 6), 4, 8, 100) == 25 + 5 + 5
    assert request_blocks((6,), 4, 8, 7) == 2  # short: all of its blocks
    cfg = SchedulerConfig(num_blocks=36, block_size=4, max_num_batched_tokens=8, max_model_len=100,
                          windows=(None, 6, 6))
    assert cfg.blocks_per_request == 35
    with pytest.raises(Exception, match="needs 35 blocks but the pool has only 34 usable"):
        SchedulerConfig(num_blocks=35, block_size=4, max_num_batched_tokens=8, max_model_len=100, windows=(None, 6, 6))
