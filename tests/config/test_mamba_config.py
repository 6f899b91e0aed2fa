"""The hybrids' configs (kvjax.config.hf_mamba, kvjax.config.mamba): each family's config.json read as transformers
5's config class reads it (its layer kinds and Mamba shapes compared with that class's own, on the vendored
published configs), the parameter count equal to `num_parameters()` of tiny transformers models of every family,
and what kvjax refuses named."""
import math

import pytest
import transformers as tf

from kvjax.config.hf import from_hf_config
from kvjax.config.mamba import MambaConfig, MambaConfigError
from kvjax.config.mamba_presets import MAMBA_CONFIGS
from kvjax.config.model import ModelConfigError
from kvjax.config.presets import preset
from mamba_fixtures import NAMES, hybrid_config

KINDS = {"linear_attention": ("mamba",), "mamba": ("mamba",), "full_attention": ("attention",),
         "attention": ("attention",), "hybrid": ("attention", "mamba"), "mlp": ()}


@pytest.mark.parametrize("name", NAMES)
def test_parameters_are_transformers_count(name):
    import torch

    cfg, cls = hybrid_config(name)
    torch.manual_seed(0)
    model = cls(cfg)
    assert from_hf_config(cfg.to_dict()).num_params == model.num_parameters()


@pytest.mark.parametrize("name", list(MAMBA_CONFIGS))
def test_the_published_configs_parse_as_transformers_reads_them(name):
    cfg = MAMBA_CONFIGS[name]
    hf = tf.CONFIG_MAPPING[cfg["model_type"]](**{k: v for k, v in cfg.items() if k != "model_type"})
    theirs = getattr(hf, "layers_block_type", None) or hf.layer_types
    mine = preset(name)
    assert [tuple(t.split("_")) if t == "attention_mamba" else (t,) if t != "mlp" else () for t in mine.layer_types] \
        == [KINDS[t] for t in theirs]
    assert mine.num_kv_heads == hf.num_key_value_heads and mine.num_layers == hf.num_hidden_layers
    m = mine.mamba
    if m.version == 2:
        heads = getattr(hf, "mamba_n_heads", None) or hf.mamba_num_heads
        head = getattr(hf, "mamba_d_head", None) or hf.mamba_head_dim
        state = getattr(hf, "mamba_d_state", None) or hf.ssm_state_size
        groups = getattr(hf, "mamba_n_groups", None) or hf.n_groups
        assert (m.num_heads, m.head_dim, m.state_size, m.n_groups) == (heads, head, state, groups)
    else:  # Jamba's Mamba1: d_inner = expand × hidden, dt_rank
        assert (m.intermediate_size, m.state_size, m.dt_rank) == (hf.mamba_expand * hf.hidden_size, hf.mamba_d_state,
                                                                  hf.mamba_dt_rank)


def test_family_defaults():
    # Nemotron-H's SSM state is float32 unless its config says (vLLM's NemotronH rule); the others follow the model
    assert preset("nemotron-h-8b").mamba.ssm_cache_dtype == "float32"
    assert preset("bamba-9b").mamba.ssm_cache_dtype == "auto"
    assert not preset("granite-4.0-h-tiny").use_rope and not preset("nemotron-h-8b").use_rope
    assert preset("bamba-9b").rope.partial_rotary_factor == 0.5  # BambaConfig hard-codes it
    assert preset("granite-4.0-h-small").moe.scoring_func == "topk_softmax"  # top-k logits, then their softmax
    assert preset("jamba-v0.1").moe_layers == tuple(range(1, 32, 2))
    assert preset("jamba-v0.1").mamba.time_step_limit == (0.0, math.inf)


def test_what_kvjax_refuses_is_named():
    nemotron = MAMBA_CONFIGS["nemotron-h-8b"]
    with pytest.raises(ModelConfigError, match=r"mixture-of-experts layers \(E\) are not supported"):
        from_hf_config({**nemotron, "hybrid_override_pattern": "ME*-"})
    with pytest.raises(ModelConfigError, match="must be a string of M, \\*, - and E"):
        from_hf_config({**nemotron, "hybrid_override_pattern": "MX"})
    granite = MAMBA_CONFIGS["granite-4.0-h-tiny"]
    with pytest.raises(ModelConfigError, match="attention-free"):
        from_hf_config({**granite, "layer_types": ["mamba"] * 40})
    with pytest.raises(ModelConfigError, match="'mamba' or 'attention' for each of the 40 layers"):
        from_hf_config({**granite, "layer_types": ["mamba"] * 39})
    with pytest.raises(ModelConfigError, match="kv_cache_dtype_skip_layers beside Mamba layers"):
        preset("bamba-9b").kv_spec("fp8", skip_layers=(0,))
    with pytest.raises(MambaConfigError, match=r"heads × head_dim \(8 × 16\) must be the intermediate size 100"):
        MambaConfig(2, 100, 16, 4, num_heads=8, head_dim=16)
    with pytest.raises(MambaConfigError, match="n_groups 3 does not divide the 8 heads"):
        MambaConfig(2, 128, 16, 4, num_heads=8, head_dim=16, n_groups=3)
    # a hybrid's KV is its attention layers': Jamba-v0.1's 4 of 32
    spec = preset("jamba-v0.1").kv_spec()
    assert spec.num_layers == 4 and spec.bytes_per_token == 4 * 2 * 8 * 128 * 2
