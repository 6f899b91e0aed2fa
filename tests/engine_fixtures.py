"""The engine tests' tiny model and helpers, shared by tests/engine/test_engine.py and
tests/kv_offload/test_offload.py: tests/hf_fixtures.py's llama-gqa (float32), an engine over it
with the block size, rows and max_model_len the engine tests use, and the pool check every run
ends with."""
from __future__ import annotations

import pytest
from hf_fixtures import make_hf_model, save_hf_model

from kvjax.config.engine import EngineConfig
from kvjax.core import kv_cache_manager as manager
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



def engine(tiny, num_blocks=64, **kw) -> Engine:
    config, model, params = tiny
    kw = {"block_size": Z, "max_num_seqs": 4, "max_model_len": MAX_LEN, **kw}
    return Engine(model, params, config.kv_spec(), EngineConfig(num_blocks=num_blocks, **kw))



def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)



def outputs(run):
    assert all(r.error is None for r in run.results), [r.error for r in run.results]
    return [r.output for r in run.results]



def assert_pool_empty(eng: Engine):
    state = eng.scheduler.state
    manager.check_invariants(state)
    assert int(state.pool.num_free) == eng.config.num_blocks - 1, "blocks leaked"
    assert not bool(state.reqs.active.any()), "request slots leaked"

