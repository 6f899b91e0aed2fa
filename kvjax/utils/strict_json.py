"""Strict JSON, read and written: the one JSON reader of kvjax's input files and the one JSON writer
of every command and experiment.

Reading (`loads`, `read_json`, `read_json_object`, `read_jsonl`): valid JSON, nested at most
`MAX_JSON_DEPTH` deep, finite numbers only, a refusal naming the file and line (kvjax.errors'
InputFileError); the file itself is read by kvjax.utils.input_files. Writing (`dumps`): JSON has no
NaN or Infinity, so every non-finite float is written as null (strict parsers such as jq or
JavaScript refuse Python's NaN literals); a JSON file is written by kvjax.utils.output_files.write_json.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Iterator

from kvjax.errors import InputFileError, KvjaxError
from kvjax.utils.checks import show_text
from kvjax.utils.input_files import read_text

MAX_JSON_DEPTH = 32  # the deepest any kvjax file nests is 3 (a scales file's per-layer lists)


def loads(text: str) -> Any:
    """One JSON value: valid JSON, nested at most MAX_JSON_DEPTH deep, finite numbers only
    (NaN, Infinity and 1e400 are refused rather than read as floats no rule can check).
    A KvjaxError says what is wrong; parse_json adds the file and line."""
    def bad_number(token: str):
        raise KvjaxError(f"the number {show_text(token)} is not finite (JSON numbers must be)")

    def parse_float(token: str) -> float:
        x = float(token)
        return x if math.isfinite(x) else bad_number(token)

    def parse_int(token: str) -> int:
        if len(token) > 19:  # beyond int64: no kvjax value is that large (and Python caps int() at 4300 digits)
            raise KvjaxError(f"the integer {show_text(token, 20)} has more than 64 bits")
        return int(token)

    try:
        obj = json.loads(text, parse_constant=bad_number, parse_float=parse_float, parse_int=parse_int)
    except RecursionError:
        raise KvjaxError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError as e:
        raise KvjaxError(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if _depth(obj) > MAX_JSON_DEPTH:
        raise KvjaxError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return obj


def dumps(obj: Any, indent: int | None = None, default=None, **kw) -> str:
    """`obj` as strict JSON, the one JSON writer of every command and experiment (--json, write_json).
    JSON has no NaN or Infinity (Python's json writes literals that jq or JavaScript refuse): every
    non-finite float, Python's or NumPy's, becomes null. NumPy scalars and arrays become numbers and
    lists; any other object goes through `default` (its result mapped the same way), else TypeError.
    kw go to json.dumps (sort_keys, ...), always with allow_nan=False, so nothing slips past."""
    return json.dumps(_finite(obj, default), indent=indent, allow_nan=False, **kw)


def _finite(value: Any, default=None) -> Any:
    """`value` with non-finite floats as None and NumPy values as Python ones (see dumps)."""
    if isinstance(value, (str, bool, int)) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v, default) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v, default) for v in value]
    if hasattr(value, "tolist") and type(value).__module__ == "numpy":  # a NumPy scalar or array
        return _finite(value.tolist(), default)
    if default is not None:
        return _finite(default(value), default)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def parse_json(text: str, path: str | os.PathLike, what: str, line: int | None = None) -> Any:
    """loads(text), its error an InputFileError naming the file (and line, for JSON lines)."""
    try:
        return loads(text)
    except KvjaxError as e:
        raise InputFileError(path, f"{what}: {e}", line) from None


def _depth(obj: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, d = stack.pop()
        if isinstance(value, (list, dict)):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def read_json(path: str | os.PathLike, what: str) -> Any:
    """A JSON file (see parse_json for what is refused)."""
    return parse_json(read_text(path, what), path, what)


def read_json_object(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """A JSON file that must hold an object."""
    obj = read_json(path, what)
    if not isinstance(obj, dict):
        raise InputFileError(path, f"{what} holds a JSON {json_type(obj)}, not an object")
    return obj


def read_jsonl(path: str | os.PathLike, what: str) -> Iterator[tuple[int, Any]]:
    """(line number, value) for each non-blank line of a JSON-lines file."""
    for n, line in enumerate(read_text(path, what).split("\n"), 1):  # not splitlines: U+2028 is no line end
        if line.strip():
            yield n, parse_json(line, path, what, n)


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages ("array", "null", ...)."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "number", float: "number"}.get(type(value), type(value).__name__)
