"""kvjax.simulator.deployment: the scheduler a deployment gets is the one kvjax plan and the engine
size (plan's blocks; vLLM's hybrid groups for sliding-window models; plan's host tier)."""
from __future__ import annotations

import pytest

from kvjax.accounting import budget as bud
from kvjax.accounting import hybrid
from kvjax.config.presets import preset
from kvjax.config.scheduler import request_blocks
from kvjax.errors import KvjaxError
from kvjax.simulator.deployment import scheduler_config

GiB = 1 << 30


def sized(name, context, **kw):
    config = preset(name)
    spec = config.kv_spec("bfloat16")
    pl = bud.plan(spec, context=context, block_size=16, total_bytes=141 * GiB, util=0.9,
                  weights_bytes=bud.weight_bytes(config.num_params, kw.pop("weights", "bf16")), **kw)
    return config, pl


def test_full_attention_takes_plans_blocks_and_host_tier():
    config, pl = sized("llama-3-70b", 8192, tp=8, host_offload_bytes=64 * GiB)
    s = scheduler_config(pl, config.layer_windows, max_num_seqs=256, max_num_batched_tokens=8192)
    assert (s.num_blocks, s.windows, s.max_model_len) == (pl.num_blocks, (None,), 8192)
    assert s.num_host_blocks == pl.num_host_blocks > 0


@pytest.mark.parametrize("name", ["gemma-3-27b", "gpt-oss-120b"])
def test_sliding_window_models_get_vllms_hybrid_groups(name):
    config, pl = sized(name, 32768, weights="int4")
    s = scheduler_config(pl, config.layer_windows, max_num_seqs=64, max_num_batched_tokens=2048)
    gp = hybrid.plan_groups(pl.spec, config.layer_windows, pl.budget_bytes, block_size=16, max_model_len=32768,
                            max_num_batched_tokens=2048)
    assert s.windows == tuple(g.window for g in gp.groups) and len(s.windows) > 1
    assert s.num_blocks == gp.num_blocks > pl.num_blocks  # sliding groups hold fewer blocks: more of them fit
    assert s.max_model_len == 32768
    assert request_blocks(s.windows, 16, 2048, 32768) == sum(gp.blocks_per_request)


def test_a_budget_without_blocks_is_refused():
    config, pl = sized("llama-3-70b", 8192)  # 70B in bf16 on one H200: no room for KV
    with pytest.raises(KvjaxError, match="KV blocks: nothing to schedule"):
        scheduler_config(pl, config.layer_windows, max_num_seqs=8, max_num_batched_tokens=512)
