"""The field readers of a Hugging Face config.json (kvjax.config.hf's and kvjax.config.hf_mamba's): each reads one
field by its config.json name, checks its type and range, and raises the given error (ModelConfigError, or
RopeError for the rotary parameters) naming the field and its value; `rope_from_hf` reads the rotary parameters
into a `RopeConfig`. Plain Python, no JAX.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from kvjax.config.model import ModelConfigError, RopeConfig, RopeError
from kvjax.utils.checks import INT32_MAX, check_int, is_int


# --------------------------------------------------------------------------------------------
# RoPE parameters
# --------------------------------------------------------------------------------------------
def rope_from_hf(cfg: Mapping[str, Any], layout: str = "half", default_theta: float = 10000.0,
                 default: Mapping[str, Any] | None = None) -> RopeConfig:
    """RopeConfig from a config.json dict: `rope_parameters` (transformers 5) or the older
    `rope_scaling` + `rope_theta`, else `default` (the config class's own rope parameters), with
    rope_theta `default_theta` where none is given. Every key that changes the rotation is kept;
    each is type-checked (RopeError naming the key)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or default or {}
    if not isinstance(params, Mapping):
        raise RopeError(f"rope_parameters / rope_scaling must be an object, got {_show(params)}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str):
        raise RopeError(f"rope_type must be a string, got {_show(rope_type)}")
    num = lambda key, **kw: _number(params, key, RopeError, **kw)  # noqa: E731
    theta = _number(params, "rope_theta", RopeError,
                    default=_number(cfg, "rope_theta", RopeError, default=default_theta))
    partial = num("partial_rotary_factor", default=_number(cfg, "partial_rotary_factor", RopeError, default=1.0))
    original = None
    if rope_type in ("llama3", "yarn"):
        original = params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings")
        if original is not None:
            check_int(original, "original_max_position_embeddings", 1, INT32_MAX, RopeError)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise RopeError(f"truncate must be true or false, got {_show(truncate)}")
    return RopeConfig(
        rope_type=rope_type, theta=theta, layout=layout, factor=num("factor"),
        original_max_position_embeddings=original, low_freq_factor=num("low_freq_factor"),
        high_freq_factor=num("high_freq_factor"), beta_fast=num("beta_fast", positive=False),
        beta_slow=num("beta_slow", positive=False), mscale=num("mscale", positive=False),
        mscale_all_dim=num("mscale_all_dim", positive=False), attention_factor=num("attention_factor"),
        truncate=truncate, partial_rotary_factor=partial)


def _number(cfg: Mapping[str, Any], key: str, error: type[Exception], default: Any = None,
            positive: bool = True) -> float | None:
    """A finite number field (> 0 unless positive=False); absent or null takes `default`."""
    value = cfg.get(key)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (positive and value <= 0):
        raise error(f"{key} must be a finite{' positive' if positive else ''} number, got {_show(value)}")
    return float(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------------------------
# Fields
# --------------------------------------------------------------------------------------------
def _int(cfg: Mapping[str, Any], key: str, default: Any = ..., lo: int = 1, hi: int = INT32_MAX) -> Any:
    """An integer field in [lo, hi] by its config.json name; absent or null takes `default`."""
    value = cfg.get(key)
    if value is None:
        if default is ...:
            raise ModelConfigError(f"config is missing the field {key!r} (model_type {cfg.get('model_type')!r})")
        return default
    if not is_int(value) or not lo <= value <= hi:
        rule = "a positive integer" if lo == 1 else f"an integer ≥ {lo}"
        raise ModelConfigError(f"config field {key!r} must be {rule} (at most {hi:,}), got {_show(value)}")
    return int(value)


def _bool(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    """A true/false field; absent takes `default`, null is false (transformers keeps the None, which
    its models test for truth). Only a JSON boolean is one: the string "false" is truthy in
    Python, and reading it as true would silently drop a tied lm_head."""
    if key not in cfg:
        return default
    value = cfg[key]
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ModelConfigError(f"config field {key!r} must be true or false, got {_show(value)}")
    return value


def _int_list(cfg: Mapping[str, Any], key: str) -> list[int]:
    value = cfg.get(key) or []
    if not isinstance(value, list):
        raise ModelConfigError(f"config field {key!r} must be a list of integers, got {_show(value)}")
    return [check_int(v, f"config field {key!r}[{i}]", 0, None, ModelConfigError) for i, v in enumerate(value)]
