"""The seed's A/B example on a running `kvjax serve`, watched through its live pool page in a browser.

SPEC "Paging, sharing, eviction": requests A and B share their first two logical blocks (one
physical copy, ref_cnt 2); when A ends they drop to ref_cnt 1; when B ends they reach 0 and enter
the free queue at its tail (cached blocks are appended there, a request's blocks last first, so
B's first block is the very last). `shared_prefix_demo` makes that happen on the real engine and
waits, in the page (kvjax.entrypoints.static/pool.js, which draws GET /api/pool), for each of the
three states: it reads what the page shows, not the engine. A and B are streamed completions of a
two-block shared prefix; each ends when its connection closes (the server aborts it and frees its
blocks, as vLLM's does), so every state lasts until the demo has seen it.

Used by the browser tests (tests/entrypoints/test_pages_browser.py) and experiments/page_screenshots.py.
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from kvjax.testing.browser import Browser

# What the page shows: every drawn block's ref count and cached flag, the queue, each request's tables.
READ_PAGE = """return {frames: Number(document.body.dataset.frames || 0),
  refs: [...document.querySelectorAll('.block')].map(d => Number(d.dataset.ref)),
  cached: [...document.querySelectorAll('.block')].map(d => d.dataset.cached === '1'),
  queue: JSON.parse(document.getElementById('queue').dataset.queue || '[]'),
  tables: Object.fromEntries([...document.querySelectorAll('#reqs tr[data-name]')]
                             .map(t => [t.dataset.name, JSON.parse(t.dataset.tables)]))};"""


def post_raw(base: str, path: str, body: dict) -> socket.socket:
    """A JSON POST sent on a socket of its own, the reply left unread (the caller reads or closes it:
    closing a stream's socket ends its request, as a client that leaves does)."""
    url = urlsplit(base)
    sock = socket.create_connection((url.hostname, url.port), timeout=120)
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_events(sock: socket.socket, count: int) -> bytes:
    """Read a streamed reply until `count` server-sent events (`data: ...`) have come; what came."""
    got = b""
    while got.count(b"data: ") < count:
        more = sock.recv(65536)
        assert more, f"the server closed the stream after {got.count(b'data: ')} events: {got[-300:]!r}"
        got += more
    return got


def shared_prefix_demo(browser: Browser, base: str, out: str | None = None, *, block_size: int,
                       model: str = "small-gqa", max_tokens: int = 1800, timeout: float = 120.0) -> dict[str, Any]:
    """Run the A/B example against the server at `base` (a kvjax serve whose pool has room for two
    requests of 2 × block_size + 20 + max_tokens tokens) while `browser` shows its /pool page; save
    pool-shared.png, pool-one-left.png and pool-free-queue.png into `out` (None: none). → the page's
    three states and the two shared blocks."""
    def shot(name: str) -> None:
        if out is not None:
            browser.screenshot(os.path.join(out, name))

    def page_until(test, what: str) -> dict:
        end = time.time() + timeout
        while True:
            page = browser.run(READ_PAGE)
            if page["frames"] and test(page):
                return page
            if time.time() > end:
                raise TimeoutError(f"the pool page did not show {what} within {timeout:g} s")
            time.sleep(0.05)

    prefix = [10 + (i % 200) for i in range(2 * block_size)]  # two full blocks, the same in A and B
    browser.get(base + "/pool")
    common = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    a = post_raw(base, "/v1/completions", dict(common, prompt=prefix + list(range(1, 11)), request_id="A"))
    b = None
    try:
        read_events(a, 2)
        b = post_raw(base, "/v1/completions", dict(common, prompt=prefix + list(range(100, 120)), request_id="B"))
        read_events(b, 2)
        names: dict[str, str] = {}

        def both_share(page) -> bool:
            found = {n[5]: n for n in page["tables"] if n.startswith("cmpl-") and n[5] in "AB"}
            if set(found) != {"A", "B"}:
                return False
            names.update(found)
            ta, tb = page["tables"][found["A"]][0], page["tables"][found["B"]][0]
            return len(ta) > 2 and len(tb) > 2 and ta[:2] == tb[:2] and all(page["refs"][x] == 2 for x in tb[:2])

        shared_page = page_until(both_share, "two requests sharing two blocks with ref count 2")
        shared = shared_page["tables"][names["B"]][0][:2]
        shot("pool-shared.png")
        a.close()  # A ends: the server aborts it and frees its blocks
        one_left = page_until(lambda p: names["A"] not in p["tables"] and names["B"] in p["tables"]
                              and all(p["refs"][x] == 1 for x in shared), "ref count 1 once A has ended")
        shot("pool-one-left.png")
        b.close()
        b = None
        freed = page_until(lambda p: not p["tables"] and all(p["refs"][x] == 0 and p["cached"][x] for x in shared)
                           and p["queue"][-2:] == [shared[1], shared[0]],
                           "ref count 0 and the shared blocks at the free queue's tail once B has ended")
        shot("pool-free-queue.png")
    finally:
        a.close()
        if b is not None:
            b.close()
    return {"shared": shared, "shared_page": shared_page, "one_left": one_left, "freed": freed, "names": names}

