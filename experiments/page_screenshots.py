"""Screenshots of kvjax's pages in headless Chromium (PNG + a markdown index + JSON), for docs/pages.md.

1. calculator.png: the calculator as `kvjax plan --group A --html` writes it (the seed's first group: the
   readout, the bar of which term dominates, concurrency against T and against the utilization);
2. pool-shared.png, pool-one-left.png, pool-free-queue.png: the live pool page of a running `kvjax serve`
   (small-gqa, blocks of 64 tokens) through the seed's A/B example (kvjax.testing.pages_demo): two
   requests sharing two blocks at ref count 2, then 1 once A has ended, then 0 with the blocks at the
   free queue's tail;
3. replay.png: `kvjax replay docs/seed_ab_example.jsonl --html` at the op that adds B.

    python experiments/page_screenshots.py --out docs/screenshots    # needs chromium + chromium-driver

docs/calculator.png and docs/pool.png are 1. and pool-shared.png of a run on 2026-12-04.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from kvjax.commands.main import main as kvjax_main  # noqa: E402
from kvjax.testing.browser import Browser  # noqa: E402
from kvjax.testing.pages_demo import shared_prefix_demo  # noqa: E402
from kvjax.utils.output_files import write_json, write_text  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 64
SERVE = dict(model="small-gqa", block_size=BLOCK, num_gpu_blocks_override=80, max_num_seqs=4, max_model_len=2048)


def served(**engine_args):
    """(AsyncLLM, its uvicorn server, the base URL) of `kvjax serve` on a free loopback port, in a thread."""
    import uvicorn

    from kvjax import AsyncEngineArgs, AsyncLLM
    from kvjax.entrypoints.openai.api_server import build_app

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args, use_tqdm_on_load=False))
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return engine, server, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def calculator(browser: Browser, out: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        page = os.path.join(tmp, "calculator.html")
        with contextlib.redirect_stdout(io.StringIO()):  # the command's own readout: not this script's
            kvjax_main(["plan", "--group", "A", "--html", page])
        browser.resize(1280, 1320)  # the whole page, its plots included
        browser.get("file://" + page)
        browser.wait("return document.body.dataset.state === 'ready'", what="the readout")
        browser.screenshot(os.path.join(out, "calculator.png"))
        browser.resize(1280, 1000)
        return browser.run("return {command: document.getElementById('command').textContent, "
                           "warnings: [...document.querySelectorAll('#warnings li')].map(e => e.textContent)}")


def replay(browser: Browser, out: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        page = os.path.join(tmp, "ab.html")
        with contextlib.redirect_stdout(io.StringIO()):
            kvjax_main(["replay", os.path.join(ROOT, "docs", "seed_ab_example.jsonl"), "--html", page])
        browser.get("file://" + page)
        browser.wait("return document.body.dataset.frames")
        browser.run("const f = document.getElementById('frame'); f.value = 3; f.dispatchEvent(new Event('input'))")
        browser.screenshot(os.path.join(out, "replay.png"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the PNGs, screenshots.md and screenshots.json")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    engine, server, url = served(**SERVE)
    try:
        with Browser(1280, 1100) as browser:
            shown = calculator(browser, args.out)
            replay(browser, args.out)
            seen = shared_prefix_demo(browser, url, args.out, block_size=BLOCK)
    finally:
        server.should_exit = True
        engine.shutdown()
    files = ["calculator.png", "replay.png", "pool-shared.png", "pool-one-left.png", "pool-free-queue.png"]
    write_json(os.path.join(args.out, "screenshots.json"), {"calculator": shown, "shared_blocks": seen["shared"],
                                                           "free_queue_tail": seen["freed"]["queue"][-2:],
                                                           "files": files}, "--out")
    write_text(os.path.join(args.out, "screenshots.md"),
               "# kvjax's pages\n\n" + "".join(f"![{f}]({f})\n\n" for f in files)
               + f"Shared blocks {seen['shared']}; the free queue ends {seen['freed']['queue'][-2:]}.\n", "--out")
    print(f"wrote {len(files)} screenshots to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
