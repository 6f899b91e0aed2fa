"""Do the commands print what they printed at another commit?  The restructuring's check.

    python -m kvjax.experiments.same_outputs --base REV

Checks REV out into a temporary git worktree, runs the same `kvjax` command lines there and in this
tree (plan, tables, memory, replay, greedy decode, errors), and diffs each one's stdout and exit status
(stderr too where a command draws no progress bar). Prints one line per command and exits 1 on any
difference. The base runs from its own source (`kvjax.cli:main` before the layout moved,
`kvjax.commands.main:main` after) with the same interpreter, so both see the same libraries.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# A trace through prefix hits, eviction, a refusal and the reset (replay's every op).
TRACE = [
    {"op": "init", "num_blocks": 6, "block_size": 4, "prefix_caching": True},
    {"op": "add", "req": "a", "tokens": list(range(10))},
    {"op": "add", "req": "b", "tokens": list(range(8)) + [50, 51]},
    {"op": "append", "req": "a", "tokens": [99, 98, 97]},
    {"op": "free", "req": "a"},
    {"op": "add", "req": "c", "tokens": list(range(100, 116))},
    {"op": "add", "req": "d", "tokens": list(range(8))},
    {"op": "free", "req": "b"},
    {"op": "reset_prefix_cache"},
]
HOST_TRACE = [
    {"op": "init", "num_blocks": 4, "block_size": 2, "prefix_caching": True, "host_blocks": 4, "host_policy": "arc"},
    {"op": "add", "req": "a", "tokens": [1, 2, 3, 4, 5]},
    {"op": "free", "req": "a"},
    {"op": "add", "req": "b", "tokens": [7, 8, 9, 10, 11]},
    {"op": "free", "req": "b"},
    {"op": "add", "req": "c", "tokens": [1, 2, 3, 4, 6]},
]

# (argv after `kvjax`, whether stderr is compared: not where a progress bar or timing is drawn)
COMMANDS = [
    (["tables"], True),
    (["plan", "--group", "A"], True),
    (["plan", "--group", "B"], True),
    (["plan", "--group", "C"], True),
    (["plan", "--group", "A", "--json"], True),
    (["plan", "--preset", "llama-3-70b", "--kv-cache-dtype", "fp8", "--max-model-len", "8192"], True),
    (["plan", "--preset", "deepseek-v3", "--tensor-parallel-size", "8", "--max-model-len", "32768"], True),
    (["plan", "--kind", "mla", "--layers", "61", "--heads", "128", "--kv-lora-rank", "512",
      "--qk-rope-head-dim", "64", "--kv-cache-dtype", "fp8_e4m3"], True),
    (["plan", "--group", "A", "--kv-cache-dtype", "int8_per_token_head"], True),
    (["plan", "--group", "A", "--kv-cache-dtype", "nvfp4", "--json"], True),
    (["plan", "--group", "A", "--kv-offloading-size", "64"], True),
    (["plan", "--group", "A", "--kv-cache-memory-bytes", "10G"], True),
    (["plan", "--group", "Z"], True),
    (["plan", "--kv-cache-dtype", "fp7", "--group", "A"], True),
    (["replay", "{trace}"], True),
    (["replay", "{trace}", "--show"], True),
    (["replay", "{host_trace}"], True),
    (["memory", "--model", "small-gqa", "--device-memory-gib", "0.046875", "--max-num-batched-tokens", "512"], False),
    (["decode", "--model", "small-gqa", "--synthetic", "6", "--shared-prefix", "16", "--max-tokens", "12", "--greedy",
      "--seed", "3", "--json", "--no-progress"], False),
    (["decode", "--model", "small-mla", "--synthetic", "4", "--max-tokens", "8", "--greedy", "--steps-per-call", "4",
      "--kv-cache-dtype", "fp8", "--json", "--no-progress"], False),
    (["decode", "--model", "small-gqa", "--synthetic", "8", "--max-tokens", "16", "--greedy",
      "--num-gpu-blocks-override", "12", "--block-size", "8", "--json", "--no-progress"], False),
    (["decode", "--model", "small-gqa", "--synthetic", "6", "--shared-prefix", "32", "--max-tokens", "8", "--greedy",
      "--num-gpu-blocks-override", "10", "--block-size", "8", "--kv-offloading-size", "0.001", "--json",
      "--no-progress"], False),
    (["decode", "--model", "small-gqa", "--synthetic", "5", "--max-tokens", "10", "--temperature", "0.8",
      "--top-p", "0.9", "--seed", "7", "--n", "2", "--logprobs", "2", "--scheduling-policy", "priority",
      "--json", "--no-progress"], False),
]

# Keys of decode's JSON that are timings, not outputs.
# Modules the restructuring renamed: the base's output is read with these names replaced (the memory command's
# legend names the module that holds the formula).
RENAMES = {"(kvjax.spec,": "(kvjax.core.kv_cache_interface,"}


def _is_timing(key: str) -> bool:
    return key.endswith(("_s", "_ms", "_ts", "latency", "seconds", "per_s", "throughput", "time"))


def _launcher(tree: Path) -> list[str]:
    entry = "kvjax.commands.main" if (tree / "kvjax" / "commands" / "main.py").exists() else "kvjax.cli"
    code = (f"import sys; sys.path.insert(0, {str(tree)!r}); "
            f"from {entry} import main; sys.exit(main())")
    return [sys.executable, "-c", code]


def _strip_timings(text: str) -> str:
    try:
        obj = json.loads(text)
    except ValueError:
        return text

    def clean(o):
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items() if not _is_timing(k)}
        if isinstance(o, list):
            return [clean(v) for v in o]
        return o
    return json.dumps(clean(obj), indent=1, sort_keys=True)


def _run(tree: Path, argv: list[str], cwd: Path) -> tuple[int, str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", PYTHONPATH=str(tree))
    p = subprocess.run(_launcher(tree) + argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    return p.returncode, p.stdout, p.stderr


def _link_packages(tree: Path) -> None:
    """An installed kvjax maps models/ and experiments/ to kvjax.models / kvjax.experiments; a bare tree
    gets the same by links inside its kvjax/ folder."""
    for name in ("models", "experiments"):
        link = tree / "kvjax" / name
        if not link.exists():
            link.symlink_to(tree / name, target_is_directory=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare with (a git revision)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="kvjax-same-"))
    base = tmp / "base"
    head = tmp / "head"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(base), args.base], check=True)
    try:
        shutil.copytree(REPO / "kvjax", head / "kvjax", symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "models", "experiments"))
        for name in ("models", "experiments"):
            shutil.copytree(REPO / name, head / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
        for tree in (base, head):
            _link_packages(tree)
        work = tmp / "work"
        work.mkdir()
        (work / "trace.jsonl").write_text("".join(json.dumps(op) + "\n" for op in TRACE))
        (work / "host.jsonl").write_text("".join(json.dumps(op) + "\n" for op in HOST_TRACE))
        failed = 0
        for cmd, with_stderr in COMMANDS:
            cmd = [a.format(trace="trace.jsonl", host_trace="host.jsonl") for a in cmd]
            outs = [_run(tree, cmd, work) for tree in (base, head)]
            (rc0, out0, err0), (rc1, out1, err1) = outs
            for old, new in RENAMES.items():
                out0, err0 = out0.replace(old, new), err0.replace(old, new)
            if cmd[0] == "decode":
                out0, out1 = _strip_timings(out0), _strip_timings(out1)
            same = rc0 == rc1 and out0 == out1 and (not with_stderr or err0 == err1)
            print(f"{'same' if same else 'DIFFERENT':9} rc {rc1}  kvjax {' '.join(cmd)}", flush=True)
            if not same:
                failed += 1
                for a, b, what in ((out0, out1, "stdout"), (err0 if with_stderr else "", err1 if with_stderr else "",
                                                                      "stderr")):
                    sys.stdout.writelines(difflib.unified_diff(a.splitlines(True), b.splitlines(True),
                                                               f"{args.base}:{what}", f"HEAD:{what}", n=1))
                if rc0 != rc1:
                    print(f"  exit status {rc0} -> {rc1}")
        print(f"{len(COMMANDS) - failed} of {len(COMMANDS)} command lines print the same as {args.base}")
        return 1 if failed else 0
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
