"""The engine tests' tiny model and helpers, shared by tests/engine/test_engine.py and
tests/kv_offload/test_offload.py: tests/hf_fixtures.py's llama-gqa (float32), an engine over it
with the block size, rows and max_model_len the engine tests use, and the pool check every run
ends with."""
from __future__ import annotations

import pytest
from hf_fixtures import make_hf_model, save_hf_model

from kvjax.core import kv_cache_manager as manager
from kvjax.engine.arg_utils import EngineArgs
from kvjax.engine.core import Engine
from kvjax.engine.sampling import SamplingParams
from kvjax.models import build_model
from kvjax.models.loader import load_checkpoint

Z = 4
MAX_LEN = 40  # max_model_len


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_hf_model(make_hf_model("llama-gqa"), str(tmp_path_factory.getbasetemp() / "engine" / "llama-gqa"))
    config, params = load_checkpoint(folder, dtype="float32")
    return config, build_model(config), params



def engine(tiny, num_blocks=64, eos_token_ids=(), **kw) -> Engine:
    config, model, params = tiny
    kw = {"block_size": Z, "max_num_seqs": 4, "max_model_len": MAX_LEN, **kw}
    return Engine(model, params, engine_config(config, num_blocks, **kw), eos_token_ids=eos_token_ids)


def engine_config(config, num_blocks=64, kv_offload_blocks=0, kv_offload_policy=None, **engine_args):
    """The resolved config (EngineArgs.create_engine_config) of a test model's engine with a pool of
    num_blocks and, with kv_offload_blocks, a host tier of that many blocks (its
    kv_offloading_size in GiB, exactly) with kv_offload_policy's eviction."""
    if kv_offload_blocks:
        per_block = config.kv_spec(engine_args.get("kv_cache_dtype")).bytes_per_block(engine_args["block_size"])
        engine_args["kv_offloading_size"] = kv_offload_blocks * per_block / 2**30
    if kv_offload_blocks and kv_offload_policy is not None:
        engine_args["kv_transfer_config"] = {"kv_connector_extra_config": {"eviction_policy": kv_offload_policy}}
    args = EngineArgs(model=config.name or config.model_type, num_gpu_blocks_override=num_blocks, **engine_args)
    return args.create_engine_config(config)


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)



def outputs(run):
    assert all(r.finish_reason in ("stop", "length") for r in run.results), [r.finish_reason for r in run.results]
    return [r.output for r in run.results]



def assert_pool_empty(eng: Engine):
    state = eng.scheduler.state
    manager.check_invariants(state)
    assert int(state.pool.num_free) == eng.config.num_blocks - 1, "blocks leaked"
    assert not bool(state.reqs.active.any()), "request slots leaked"

