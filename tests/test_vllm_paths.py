"""docs/vllm_paths.md: every vLLM module path it says kvjax provides imports, holds the names it lists,
and each name is the object the library defines (a re-export, not a second class); every module of
kvjax.v1 is in the table and is a re-export module (no logic: imports, a docstring and __all__)."""
from __future__ import annotations

import ast
import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "vllm_paths.md")


def _rows() -> list[tuple[str, str, list[str]]]:
    """(vLLM path, kvjax path, names) of each table row."""
    rows = []
    for line in open(DOC, encoding="utf-8"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`vllm"):
            rows.append((cells[0].strip("`"), cells[1].strip("`"), re.findall(r"`(\w+)`", cells[2])))
    return rows


def test_the_table_has_the_paths_vllms_examples_import():
    paths = {v: k for v, k, _ in _rows()}
    for path in ("vllm.v1.engine.async_llm", "vllm.v1.metrics.reader", "vllm.sampling_params", "vllm.v1.metrics.stats"):
        assert paths[path] == "kvjax" + path[len("vllm"):]


@pytest.mark.parametrize("vllm_path, kvjax_path, names", _rows())
def test_each_path_holds_its_names(vllm_path, kvjax_path, names):
    assert kvjax_path == "kvjax" + vllm_path[len("vllm"):]
    module = importlib.import_module(kvjax_path)
    for name in names:
        obj = getattr(module, name)
        home = importlib.import_module(obj.__module__)
        assert getattr(home, name) is obj and not home.__name__.startswith(("kvjax.v1", "kvjax.sampling_params",
                                                                            "kvjax.outputs", "kvjax.logprobs"))


def test_the_v1_modules_only_re_export():
    folder = os.path.join(ROOT, "kvjax", "v1")
    documented = {k for _, k, _ in _rows()}
    for dirpath, _, files in os.walk(folder):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            tree = ast.parse(open(path, encoding="utf-8").read())
            for node in tree.body:
                is_doc = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                is_all = isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__all__"]
                assert is_doc or is_all or isinstance(node, ast.ImportFrom), (module, ast.unparse(node))
            if f != "__init__.py":
                assert module in documented, module
