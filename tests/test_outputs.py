"""What kvjax writes: strict JSON (kvjax.utils.strict_json.dumps), outputs that stay inside --out (a planted
symlink is replaced, a symlinked folder refused), several files committed together
(kvjax.utils.output_folders.output_folder), and matplotlib's caches kept out of HOME
(kvjax.utils.plotting.pyplot)."""
from __future__ import annotations

import ast
import contextlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from kvjax.errors import OutputPathError
from kvjax.utils.output_files import write_json, write_text
from kvjax.utils.output_folders import output_folder
from kvjax.utils.strict_json import dumps

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAN, INF = float("nan"), float("inf")


def strict_loads(text: str):
    """json.loads refusing NaN, Infinity and -Infinity, as JavaScript's JSON.parse or jq would."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")
    return json.loads(text, parse_constant=refuse)


# --------------------------------------------------------------------------------------------
# Strict JSON
# --------------------------------------------------------------------------------------------
DUMPS_CASES = [  # (value, what it reads back as): every non-finite float is null
    (NAN, None),
    (-INF, None),
    ({"cumulative_logprob": NAN, "ok": 1.5}, {"cumulative_logprob": None, "ok": 1.5}),
    ([1, [INF, [-INF, "NaN"]]], [1, [None, [None, "NaN"]]]),  # the string "NaN" is text, kept
    ((NAN, 2), [None, 2]),
    (np.float32("nan"), None),
    (np.float64("-inf"), None),
    (np.float16(0.5), 0.5),
    ({"x": [np.int64(3), np.bool_(True), np.float32(np.inf)]}, {"x": [3, True, None]}),
    (np.array([[1.0, np.nan], [np.inf, 2.0]]), [[1.0, None], [None, 2.0]]),
    ({"rows": [{"kl": np.float32(np.nan), "n": np.int32(7)}]}, {"rows": [{"kl": None, "n": 7}]}),
    ({"big": 1e308, "tiny": 5e-324, "int": 2**63}, {"big": 1e308, "tiny": 5e-324, "int": 2**63}),
    (None, None),
    ("text ∞", "text ∞"),
]


@pytest.mark.parametrize("value, want", DUMPS_CASES, ids=[str(i) for i in range(len(DUMPS_CASES))])
@pytest.mark.parametrize("indent", [None, 2])
def test_dumps_is_strict_json_with_non_finite_floats_as_null(value, want, indent):
    assert strict_loads(dumps(value, indent=indent)) == want


def test_dumps_maps_what_default_returns_and_refuses_what_it_cannot_write():
    class Odd:
        def __str__(self):
            return "odd"

    assert strict_loads(dumps({"a": Odd()}, default=str)) == {"a": "odd"}
    assert strict_loads(dumps([np.float32(1.5), Odd()], default=lambda o: NAN)) == [1.5, None]  # default's NaN too
    with pytest.raises(TypeError, match="Odd"):
        dumps({"a": Odd()})
    assert dumps({"b": 1, "a": 2}, sort_keys=True) == '{"a": 2, "b": 1}'  # json.dumps's options pass through


def test_write_json_writes_strict_json(tmp_path):
    write_json(tmp_path / "r.json", {"results": [{"kl": NAN, "ppl": np.float32(2.5)}]}, "--out", default=str)
    text = (tmp_path / "r.json").read_text()
    assert text.endswith("\n") and strict_loads(text) == {"results": [{"kl": None, "ppl": 2.5}]}


def test_a_command_prints_strict_json(monkeypatch, capsys):
    from kvjax.accounting import spec_tables
    from kvjax.commands.main import main

    monkeypatch.setattr(spec_tables, "table1", lambda: [{"mha_ratio": NAN, "bytes": INF}])
    monkeypatch.setattr(spec_tables, "table2", lambda: [{"concurrency": -INF}])
    assert main(["tables", "--json"]) == 0
    assert strict_loads(capsys.readouterr().out) == {"table1": [{"mha_ratio": None, "bytes": None}],
                                                     "table2": [{"concurrency": None}]}


# The files that print or write JSON and results: every command, every experiment. same_outputs.py is a
# harness, not a writer: it re-serializes two checkouts' outputs to diff them and writes their input traces.
WRITERS = sorted(ROOT.glob("kvjax/commands/*.py")) + [p for p in sorted(ROOT.glob("experiments/*.py"))
                                                       if p.name != "same_outputs.py"]


def _calls(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node, node.func


def test_every_writer_goes_through_kvjax_utils():
    """No json.dump(s) (NaN literals), Path.write_text / write_bytes or fig.savefig (no temporary
    file, a planted symlink followed) and no matplotlib import (its caches into HOME) outside
    kvjax.utils: each has its one helper there (strict_json.dumps, output_files.write_json / write_text /
    save_figure, plotting.pyplot).
    And nothing else in kvjax/ writes a JSON file itself."""
    bad = []
    for path in WRITERS:
        for node, func in _calls(path):
            owner = func.value.id if isinstance(func.value, ast.Name) else None
            if (owner == "json" and func.attr in ("dump", "dumps")) or func.attr in ("write_text", "write_bytes",
                                                                                     "savefig"):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(func)}()")
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: import {n}" for n in names if n.startswith("matplotlib")]
    for path in sorted(ROOT.glob("kvjax/**/*.py")):
        if path.name != "strict_json.py":
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: json.dump()" for node, func in _calls(path)
                    if func.attr == "dump" and isinstance(func.value, ast.Name) and func.value.id == "json"]
    assert not bad, "write through kvjax.utils instead:\n" + "\n".join(bad)


# --------------------------------------------------------------------------------------------
# Outputs stay inside --out
# --------------------------------------------------------------------------------------------
def test_a_symlink_planted_in_out_is_replaced_not_followed(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("not kvjax's")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(outside, out / "REPORT.md")
    os.symlink(outside, out / "alone.md")
    with output_folder(out) as stage:
        write_text(os.path.join(stage, "REPORT.md"), "the report", "--out")
    write_text(out / "alone.md", "one file", "--out")  # a single write, outside any output_folder
    for name, text in (("REPORT.md", "the report"), ("alone.md", "one file")):
        assert not os.path.islink(out / name) and (out / name).read_text() == text
    assert outside.read_text() == "not kvjax's"
    assert sorted(os.listdir(out)) == ["REPORT.md", "alone.md"]  # no staging folder left


def test_a_symlinked_folder_inside_out_is_refused_naming_it(tmp_path):
    elsewhere, out = tmp_path / "elsewhere", tmp_path / "out"
    elsewhere.mkdir()
    out.mkdir()
    (out / "old.md").write_text("old")
    os.symlink(elsewhere, out / "plots")
    with pytest.raises(OutputPathError, match=r"--out '.*out': '.*out/plots' is a symlink"):
        with output_folder(out) as stage:
            write_text(os.path.join(stage, "new.md"), "new", "--out")
            os.mkdir(os.path.join(stage, "plots"))
            write_text(os.path.join(stage, "plots", "a.png"), "png", "--out")
    assert os.listdir(elsewhere) == [] and sorted(os.listdir(out)) == ["old.md", "plots"]  # nothing moved


def test_out_itself_may_be_a_symlink(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "out")
    with output_folder(tmp_path / "out") as stage:
        write_text(os.path.join(stage, "a.md"), "a", "--out")
    assert os.listdir(tmp_path / "real") == ["a.md"]


# --------------------------------------------------------------------------------------------
# Several files, committed together
# --------------------------------------------------------------------------------------------
def _files(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _disk_full_after(n: int, monkeypatch) -> None:
    """A disk that fills up: every write (write_text, write_json, save_figure) after the first n
    fails with ENOSPC, as kvjax.utils.output_files.write_file reports it."""
    from kvjax.utils import output_files

    real, calls = output_files.write_file, []

    @contextlib.contextmanager
    def write_file(path, flag, binary=False):
        calls.append(path)
        with real(path, flag, binary) as fh:
            if len(calls) > n:
                raise OSError(28, "No space left on device")
            yield fh

    monkeypatch.setattr(output_files, "write_file", write_file)


def test_output_folder_commits_together_or_leaves_the_old_files(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("REPORT.md", "report.json", "plot.png", "mine.txt"):
        (out / name).write_bytes(f"old {name}".encode())
    old = _files(out)
    _disk_full_after(1, monkeypatch)
    with pytest.raises(OutputPathError) as refused:
        with output_folder(out) as stage:
            write_text(os.path.join(stage, "plot.png"), "new plot", "--out")
            write_text(os.path.join(stage, "REPORT.md"), "new report", "--out")  # the disk is full
    assert str(refused.value) == f"--out '{out}/REPORT.md': writing failed: No space left on device"  # not its copy
    assert _files(out) == old  # byte for byte: no new plot beside the old report, no staging folder
    monkeypatch.undo()
    with output_folder(out) as stage:
        for name in ("REPORT.md", "report.json", "plot.png"):
            write_text(os.path.join(stage, name), f"new {name}", "--out")
    assert _files(out) == {**{n: f"new {n}".encode() for n in ("REPORT.md", "report.json", "plot.png")},
                           "mine.txt": b"old mine.txt"}  # a file the run did not write is left alone


def test_a_failed_run_into_a_new_folder_leaves_no_folder(tmp_path):
    with pytest.raises(RuntimeError):
        with output_folder(tmp_path / "new" / "out") as stage:
            write_text(os.path.join(stage, "a.md"), "a", "--out")
            raise RuntimeError("the work failed")
    assert os.listdir(tmp_path / "new") == []


def test_a_replaced_output_keeps_its_mode(tmp_path):
    (tmp_path / "a.md").write_text("old")
    os.chmod(tmp_path / "a.md", 0o640)
    with output_folder(tmp_path) as stage:
        write_text(os.path.join(stage, "a.md"), "new", "--out")
    assert os.stat(tmp_path / "a.md").st_mode & 0o777 == 0o640


def test_accuracy_outputs_are_committed_together(tmp_path, monkeypatch):
    import kvjax.commands.accuracy as acc

    res = {"model": "small-gqa", "outlier_channels": False}
    monkeypatch.setattr(acc, "markdown", lambda r: "the table")
    monkeypatch.setattr(acc, "plot", lambda r, path: write_text(path, "png", "--out"))
    paths = acc.write_outputs(res, str(tmp_path))
    assert paths == {k: str(tmp_path / f"accuracy_small-gqa.{k}") for k in ("json", "md", "png")}
    old = _files(tmp_path)

    def plot_fails(r, path):
        raise OSError(28, "No space left on device")  # after the .json and .md were written
    monkeypatch.setattr(acc, "plot", plot_fails)
    with pytest.raises(OSError):
        acc.write_outputs({**res, "new": True}, str(tmp_path))
    assert _files(tmp_path) == old


def test_report_fails_midway_and_keeps_the_previous_report(tmp_path, monkeypatch, capsys):
    """`kvjax report` with its first section only: a full disk at report.json (after the plot and
    REPORT.md) leaves the previous run's files byte for byte; the next run replaces them all."""
    from kvjax.commands.main import main

    out = tmp_path / "results"
    argv = ["report", "--skip", "decode,accuracy,memory,smollm", "--out", str(out), "--no-progress"]
    out.mkdir()
    old = {"REPORT.md": b"old report", "report.json": b"{}", "concurrency_vs_context.png": b"old plot"}
    for name, data in old.items():
        (out / name).write_bytes(data)
    _disk_full_after(2, monkeypatch)  # the plot, REPORT.md, then report.json finds the disk full
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"kvjax report: error: --out '{out}/report.json': writing failed: No space left on device\n"
    assert _files(out) == old
    monkeypatch.undo()
    assert main(argv) == 0
    new = _files(out)
    assert sorted(new) == sorted(old) and all(new[n] != old[n] for n in old)
    assert "Table 1" in new["REPORT.md"].decode() and strict_loads(new["report.json"].decode())["tables"]


# --------------------------------------------------------------------------------------------
# Caches out of HOME
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["XDG_CACHE_HOME", "KVJAX_CACHE"])
def test_a_plot_writes_nothing_into_home(where, tmp_path):
    """A fresh HOME stays empty: matplotlib's config and font cache go into kvjax's cache folder."""
    home, cache, work = tmp_path / "home", tmp_path / "cache", tmp_path / "work"
    for folder in (home, cache, work):
        folder.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME",
                                                             "KVJAX_CACHE")}
    env.update(HOME=str(home), JAX_PLATFORMS="cpu", **{where: str(cache)})
    proc = subprocess.run([sys.executable, "-m", "kvjax.commands.main", "plan", "--group", "A", "--plot", "c.png"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(home) == [] and (work / "c.png").read_bytes()[:4] == b"\x89PNG"
    mpl = cache / "kvjax" / "matplotlib" if where == "XDG_CACHE_HOME" else cache / "matplotlib"
    assert mpl.is_dir()


def test_a_users_mplconfigdir_wins(tmp_path, monkeypatch):
    from kvjax.utils.cache_folder import cache_dir
    from kvjax.utils.plotting import pyplot

    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mine"))
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "kv"))
    pyplot()
    assert os.environ["MPLCONFIGDIR"] == str(tmp_path / "mine")
    monkeypatch.delenv("MPLCONFIGDIR")
    pyplot()
    assert os.environ["MPLCONFIGDIR"] == str(tmp_path / "kv" / "matplotlib")
    monkeypatch.delenv("KVJAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == str(tmp_path / "xdg" / "kvjax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "kvjax")
