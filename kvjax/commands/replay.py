"""`kvjax replay TRACE.jsonl`: drive the jitted block pool with a trace, print its state.

The trace format and what each op does are kvjax/core/replay.py's (`iter_trace`, `Replay`):
each op prints one JSON line, the state after it. `--show` draws the pool as text after each
JSON line (`draw`); with `--json` every output line stays one JSON object, and the drawing is
its "drawing" field. `--html FILE` also writes the trace as a page to step through, the pool drawn
block by block after each op (kvjax.core.pool_view, the state the live page of `kvjax serve` draws
too). Bad input stops the replay with one error line naming the file and line number.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

from kvjax.core import block_pool, pool_view
from kvjax.core import kv_cache_manager as manager
from kvjax.core.replay import Replay, ReplayError, bounded_lines, host_lists, iter_trace
from kvjax.utils.input_files import check_input_file
from kvjax.utils.output_files import check_output_file, write_text
from kvjax.utils.strict_json import dumps


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `replay` subcommand to a `kvjax` subparsers object."""
    p = subparsers.add_parser("replay", help="replay a JSONL trace through the jitted block pool",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("trace", metavar="TRACE", help="JSONL file, one op per line ('-' = stdin)")
    p.add_argument("--show", action="store_true",
                   help="after each JSON line, draw the pool as text (with --json: as each line's \"drawing\")")
    p.add_argument("--json", action="store_true",
                   help="every output line is one JSON object (the default output; with --show the drawing "
                        "joins each object instead of following it as text)")
    p.add_argument("--html", metavar="FILE",
                   help="also write the trace as a page to step through: the pool block by block after each op "
                        "(kvjax.entrypoints.pages)")
    return p


def draw(replay: Replay) -> str:
    """The pool as text: per physical block its ref count, whether it is cached, and
    which logical block of each request maps to it."""
    s = jax.device_get(replay.state)
    p = s.pool
    ids = range(1, p.num_blocks)
    w = max(3, len(str(p.num_blocks - 1)) + 1)
    names = sorted(replay.slots, key=replay.slots.get)
    lw = max([5] + [len(n) for n in names])

    def row(label, cells):
        return f"{label:<{lw}} |" + "".join(f"{c:>{w}}" for c in cells)

    lines = [f"pool: {p.num_blocks} blocks x {s.reqs.block_size} tokens (block 0 = null), "
             f"prefix caching {'on' if s.prefix_caching else 'off'}, "
             f"{int(p.num_free)} free, usage {1.0 - int(p.num_free) / (p.num_blocks - 1):.3f}",
             row("block", ids),
             row("ref", [int(p.ref_cnt[b]) or "." for b in ids]),
             row("hash", ["#" if p.has_hash[b] else "." for b in ids])]
    groups = s.reqs.num_groups if replay.grouped else 1
    for g in range(groups):
        if replay.grouped:
            window = s.windows[g]
            lines.append(f"group {g}: " + ("full attention" if window is None else f"sliding window {window}")
                         + " (request rows: each block's logical index in this group's table)")
        for n in names:
            where = {b: j for j, b in enumerate(manager.request_blocks(s, replay.slots[n], g)) if b}
            lines.append(row(n, [where.get(b, ".") for b in ids]))
    lines.append("free queue (head -> tail): " + (" ".join(map(str, block_pool.free_queue(p))) or "empty"))
    if replay.host is not None:
        lists = " | ".join(f"{k}: {(' '.join(map(str, v)) or '-') if isinstance(v, list) else v}"
                           for k, v in host_lists(replay.host).items())
        lines.append(f"host tier ({replay.host.num_slots} slots, {replay.host.policy}, LRU end first) {lists}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print one JSON line per op; bad input raises ReplayError naming the file and line (the
    CLI prints it as one line, exit status 2). Lines are read as bytes and decoded one at a time,
    so `kvjax replay -` streams."""
    name = "<stdin>" if args.trace == "-" else args.trace
    if args.trace != "-":
        check_input_file(args.trace, "trace")  # a FIFO or a device is refused, never opened
        try:
            f = open(args.trace, "rb")
        except IsADirectoryError:
            raise ReplayError(f"trace {args.trace!r} is a folder, not a file") from None
        except OSError as e:
            raise ReplayError(f"cannot read trace {args.trace!r}: {e.strerror}") from None
    else:
        f = sys.stdin.buffer
    text_drawing = args.show and not args.json
    if args.html:
        check_output_file(args.html, "--html")
    steps, line = [], [b""]  # the page's steps; the trace line last read (iter_trace yields after reading it)

    def lines():
        for text in bounded_lines(f):
            line[0] = text
            yield text

    with f:
        try:
            for out, replay in iter_trace(lines()):
                if args.html:
                    steps.append(_page_step(line[0], out, replay))
                if args.show and args.json:
                    out = dict(out, drawing=draw(replay))
                print(dumps(out), flush=not text_drawing)
                if text_drawing:
                    print(draw(replay), flush=True)
        except ReplayError as e:
            sys.stdout.flush()
            raise ReplayError(f"{name}: {e}") from None
    if args.html:
        from kvjax.entrypoints.pages import pool_page

        write_text(args.html, pool_page({"mode": "replay", "title": name, "steps": steps}), "--html")
    return 0


def _page_step(text, out: dict, replay: Replay) -> dict:
    """One op for the replay page: its trace line, its JSON line, and the pool after it (kvjax.core.pool_view)."""
    s = replay.state
    names = sorted(replay.slots, key=replay.slots.get)
    pool = pool_view.view(pool_view.host_arrays(s), block_size=s.reqs.block_size, windows=s.windows,
                          prefix_caching=s.prefix_caching, requests=[{"name": n, "slot": replay.slots[n]} for n in names])
    return {"op": json.loads(text), "out": out, "pool": pool}


if __name__ == "__main__":
    from kvjax.commands.main import main

    sys.exit(main(["replay", *sys.argv[1:]]))
