"""Reading `kvjax replay`'s trace input (kvjax/core/replay.py runs it): bounded lines, UTF-8,
JSON, each field's checks, and init's "groups". Every bad value raises a ReplayError naming it;
iter_trace adds the line number.
"""
from __future__ import annotations

import json
from typing import Iterator

from kvjax.core import single_type_kv_cache_manager as groups_rules
from kvjax.core.kv_cache_groups import MAMBA
from kvjax.errors import KvjaxError
from kvjax.utils.checks import is_int
from kvjax.utils.strict_json import loads


class ReplayError(KvjaxError):
    """Bad trace input; `kvjax replay` prints it with the file and line number."""


MAX_BLOCKS = 2**16  # replay is for reading pools, not for sizing them: small limits keep its tables small
MAX_REQUEST_TOKENS = 2**20
MAX_HOST_BLOCKS = 2**12  # the host index compares every hash with every slot: O(A × E) per op


def int_field(v, what: str, lo: int, hi: int) -> int:
    if not is_int(v) or v < lo:
        raise ReplayError(f"{what} must be an int >= {lo}, got {json.dumps(v)}")
    if v > hi:
        raise ReplayError(f"{what} must be at most {hi:,}, got {v:,}")
    return v


def utf8(line: bytes) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ReplayError(f"not UTF-8 text (byte 0x{line[e.start]:02x} at column {e.start + 1})") from None


def encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_json(line: str):
    """One op's JSON (kvjax.utils.strict_json.loads: nesting limit, finite numbers), as a ReplayError."""
    try:
        return loads(line)
    except KvjaxError as e:
        raise ReplayError(str(e)) from None


def tokens_field(op: dict) -> list[int]:
    toks = op.get("tokens")
    if not isinstance(toks, list) or not toks:
        raise ReplayError(f"'tokens' must be a non-empty list of ints, got {json.dumps(toks)}")
    for i, t in enumerate(toks):
        if not is_int(t) or not 0 <= t < 2**31:
            raise ReplayError(f"token {i} is {json.dumps(t)}: tokens must be ints in [0, 2**31)")
    return toks


def req_field(op: dict) -> str:
    name = op.get("req")
    if not isinstance(name, str):
        raise ReplayError(f"'req' must be a string, got {json.dumps(name)}")
    return name


MAX_GROUPS = 64  # Gemma 3's 5:1 pattern gives 7; a trace is for reading the rules, not for sizing


def groups_field(groups, prefix_caching: bool = False) -> tuple[int | str | None, ...]:
    """init's "groups": [{"type": "full_attention"} | {"type": "sliding_window", "sliding_window": W} |
    {"type": "mamba"}, ...] -> each group's window (None: full attention, MAMBA: a Mamba group), in the
    order given (a Mamba group refuses prefix caching: vLLM's mamba_cache_mode "none")."""
    if not isinstance(groups, list) or not 1 <= len(groups) <= MAX_GROUPS:
        raise ReplayError(f"'groups' must be a list of 1 to {MAX_GROUPS} groups, got {json.dumps(groups)[:60]}")
    windows = []
    for i, g in enumerate(groups):
        kind = g.get("type") if isinstance(g, dict) else None
        if kind == "full_attention" and set(g) == {"type"}:
            windows.append(None)
        elif kind == "sliding_window" and set(g) == {"type", "sliding_window"}:
            windows.append(int_field(g["sliding_window"], f"group {i}'s sliding_window", 1, MAX_REQUEST_TOKENS))
        elif kind == MAMBA and set(g) == {"type"}:
            windows.append(MAMBA)
        else:
            raise ReplayError(f"group {i} must be {{\"type\": \"full_attention\"}}, {{\"type\": \"sliding_window\", "
                              f"\"sliding_window\": W}} or {{\"type\": \"mamba\"}}, got {json.dumps(g)[:60]}")
    try:
        return groups_rules.check_windows(windows, prefix_caching)
    except KvjaxError as e:
        raise ReplayError(str(e)) from None


MAX_LINE_BYTES = 1 << 20  # no op comes near 1 MiB; stdin (or a huge file) is read a bounded line at a time


def bounded_lines(f) -> Iterator[bytes]:
    """f's lines, refusing one longer than MAX_LINE_BYTES instead of reading it to its end."""
    lineno = 0
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        lineno += 1
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            raise ReplayError(f"line {lineno}: longer than {MAX_LINE_BYTES // 2**20} MiB")
        yield line
