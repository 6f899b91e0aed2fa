"""The pages in a real browser (headless Chromium over WebDriver, kvjax.testing.browser): the calculator,
as `kvjax plan --html` writes it (the arithmetic compiled into it) and as `kvjax serve` serves it (POST
/api/plan), set input by input to the table of tests/entrypoints/page_configs.py and read back against
`kvjax plan --json` to the byte (the plots' points too), the seed's groups A, B and C against the seed's
own numbers; the live pool page of a running `kvjax serve` through the seed's A/B example, and snapshots
of that server's pool taken from a thread of their own; the page of `kvjax replay --html`.
Screenshots go to tmp_path. Without Chromium these tests fail with one line saying how to install it
(docs/testing.md); CI installs it (.ci/run)."""
import asyncio
import json
import os
import re
import struct
import threading

import pytest
from page_configs import CONFIGS, FIELDS, SEED, SEED_C_WARNING, field, plan_json
from serving import serving

from kvjax.commands.main import main
from kvjax.testing.browser import Browser, BrowserMissing
from kvjax.testing.pages_demo import post_raw, read_events, shared_prefix_demo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = 64
SERVE = dict(model="small-gqa", block_size=BLOCK, num_gpu_blocks_override=80, max_num_seqs=4, max_model_len=2048,
             use_tqdm_on_load=False)

READ = """return {state: document.body.dataset.state, renders: document.body.dataset.renders,
  error: document.getElementById('error').textContent,
  command: document.getElementById('command').textContent,
  fields: Object.fromEntries([...document.querySelectorAll('#readout [data-field]')]
                             .map(e => [e.dataset.field, [e.dataset.value, e.textContent]])),
  warnings: [...document.querySelectorAll('#warnings li')].map(e => e.textContent)};"""
ACT = """const [kind, id, value] = arguments, el = document.getElementById(id);
if (kind === 'click') { el.click(); return; }
el.value = value;
el.dispatchEvent(new Event(kind === 'select' ? 'change' : 'input', {bubbles: true}));"""


@pytest.fixture(scope="module")
def browser():
    try:
        b = Browser(1280, 1500)
    except BrowserMissing as e:
        missing = str(e)  # failed outside the except clause: one line, no chained traceback
    else:
        missing = None
    if missing:
        pytest.fail(missing, pytrace=False)
    yield b
    b.close()


@pytest.fixture(scope="module")
def server():
    with serving(**SERVE) as served:
        yield served


def _settle(browser, renders_before=None) -> dict:
    """The page's readout once its last change is drawn."""
    return browser.wait(f"""const s = document.body.dataset;
        return (s.state === 'ready' || s.state === 'error') && s.renders !== {json.dumps(renders_before)}
               && (function() {{ {READ} }})();""", what="the readout")


def _configure(browser, url: str, actions) -> dict:
    browser.get(url)
    page = _settle(browser)
    for act in actions:
        browser.run(ACT, *act)
        page = _settle(browser, page["renders"])
    return page


def _check_against_plan(page: dict, argv: list[str]) -> dict:
    assert page["error"] == "" and page["state"] == "ready", page["error"]
    assert page["command"] == "kvjax plan " + " ".join(argv)
    want = plan_json(argv)
    _same_fields(page, want)
    return want


def _same_fields(page: dict, want: dict) -> None:
    for key in FIELDS:
        expected, (shown, _) = field(want, key), page["fields"][key]
        if expected is None:
            assert shown == "null", key
        elif isinstance(expected, float):
            assert float(shown) == expected, key
        else:
            assert int(shown) == expected, key  # to the byte
    assert page["warnings"] == want["warnings"]


# The two plots' points (concurrency against T and against the utilization) and the line on which term dominates.
PLOTS = """const r = window.kvjaxResult.sweeps, n = (v) => (v === null ? null : Number(v));
return {context: r.context.map((p) => p.map(n)), util: r.util.map((p) => p.map(n)),
  lines: document.querySelectorAll('#plot-context polyline, #plot-util polyline').length,
  dominant: document.getElementById('dominant').textContent};"""


def _check_plots(browser, argv: list[str]) -> str:
    """The plotted points against `kvjax plan --json` at each T and utilization; the dominant-term line."""
    got = browser.run(PLOTS)
    assert got["lines"] == 4  # two series in each plot: the budget's and the block pool's concurrency
    for flag, points in (("--max-model-len", got["context"]), ("--gpu-memory-utilization", got["util"])):
        assert len(points) > 10
        for x, conc, blocks in points:
            want = plan_json(argv + [flag, str(x)])
            assert (conc, blocks) == (want["concurrency"], want["concurrency_blocks"]), (flag, x)
    return got["dominant"]


def _check_seed(name: str, page: dict) -> None:
    for key, text in SEED.get(name, {}).items():
        value, shown = page["fields"][key]
        if isinstance(text, float):  # the seed's unrounded concurrency, to its two decimals
            assert round(float(value), 2) == text, (name, key, value)
        else:
            assert text in (shown, value), (name, key, value, shown)
    if name == "C":
        assert SEED_C_WARNING in page["warnings"]


def test_static_calculator_equals_kvjax_plan(browser, tmp_path):
    """kvjax plan --html: the page, set as a user sets it, shows `kvjax plan --json`'s numbers for every
    config of the table (its arithmetic is kvjax.accounting.formulas compiled into it), offline."""
    html = tmp_path / "calculator.html"
    assert main(["plan", "--group", "A", "--html", str(html)]) == 0
    text = html.read_text()
    # nothing to fetch: no remote script, style, image or import (the SVG namespace is a name, not a fetch)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|url\(|@import|fetch\(["'`]https?""", text)
    for name, actions, argv in CONFIGS:
        page = _configure(browser, html.as_uri(), actions)
        _check_against_plan(page, argv)
        _check_seed(name, page)
        if name == "A":  # the seed's "which term dominates": 130 GiB of weights in the 147.2 GiB requested
            assert _check_plots(browser, argv).startswith("the weights dominate: 130 GiB of the 147.2 GiB requested")
        if name == "C":
            browser.screenshot(tmp_path / "calculator-C.png")
    assert _png_size(tmp_path / "calculator-C.png")[0] == 1280


def test_html_flag_sets_the_page_to_the_plan(browser, tmp_path):
    html = tmp_path / "b.html"
    assert main(["plan", "--preset", "deepseek-v3", "-tp", "8", "--device-memory-gib", "141", "--weights-gib", "625",
                 "--max-model-len", "32768", "--html", str(html)]) == 0
    browser.get(html.as_uri())
    page = _settle(browser)
    _check_against_plan(page, ["--preset", "deepseek-v3", "--max-model-len", "32768", "--device-memory-gib", "141",
                               "--weights-gib", "625", "--tensor-parallel-size", "8"])
    assert page["fields"]["concurrency"][0] == "24"


# The served page runs the same script as the static one (test_static_calculator_equals_kvjax_plan takes
# the whole table), its figures from POST /api/plan: the seed's groups, a hybrid model (drawn only here),
# MLA, a model without weights.
SERVED = ("A", "B", "C", "Gemma-3-27B (hybrid)", "f = 1: MLA", "a custom model without weights")


def test_served_calculator_equals_kvjax_plan(browser, server, tmp_path):
    """kvjax serve's /: configs of the table through POST /api/plan, a pasted config.json too."""
    _, url = server
    assert set(SERVED) <= {name for name, _, _ in CONFIGS}
    for name, actions, argv in (c for c in CONFIGS if c[0] in SERVED):
        page = _configure(browser, url + "/", actions)
        want = _check_against_plan(page, argv)
        _check_seed(name, page)
        if name == "B":  # the server's sweeps
            _check_plots(browser, argv)
        if want.get("hybrid"):  # the served page draws the hybrid groups too
            hybrid = browser.run("return document.querySelector('[data-field=\"hybrid.blocks\"]').textContent")
            assert hybrid == f"{want['hybrid']['hybrid']['num_blocks']:,}"
    config = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
              "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    browser.get(url + "/")
    page = _settle(browser)
    browser.run("document.getElementById('hf-box').open = true; document.getElementById('hf-text').value = arguments[0];"
                "document.getElementById('hf-use').click();", json.dumps(config))
    page = _settle(browser, page["renders"])
    assert page["error"] == "" and page["command"] == "kvjax plan --hf-config config.json --device-memory-gib 160"
    _same_fields(page, plan_json(["--hf-config", str(tmp_path / "config.json"), "--device-memory-gib", "160"]))
    browser.screenshot(tmp_path / "calculator-served.png")


def test_live_pool_shows_the_seeds_shared_blocks(browser, server, tmp_path):
    """SPEC's A/B example on the real engine, read off the live page: two requests share two blocks
    (ref count 2), A ends (1), B ends (0, the blocks at the free queue's tail, B's first block last)."""
    engine, url = server
    seen = shared_prefix_demo(browser, url, str(tmp_path), block_size=BLOCK, max_tokens=1800)
    s0, s1 = seen["shared"]
    assert seen["shared_page"]["refs"][s0] == seen["shared_page"]["refs"][s1] == 2
    tables = seen["shared_page"]["tables"]
    assert tables[seen["names"]["A"]][0][:2] == tables[seen["names"]["B"]][0][:2] == [s0, s1]
    assert seen["one_left"]["refs"][s0] == 1 and seen["freed"]["refs"][s0] == 0
    assert seen["freed"]["queue"][-2:] == [s1, s0]
    for name in ("pool-shared.png", "pool-one-left.png", "pool-free-queue.png"):
        assert _png_size(tmp_path / name)[0] == 1280
    # what the page drew is the engine's own pool now
    pool = engine.llm_engine.engine.scheduler.state.pool
    from kvjax.core.block_pool import free_queue
    assert free_queue(pool)[-2:] == [s1, s0]


def test_snapshot_from_another_thread_while_the_server_steps(server):
    """pool_snapshot from a thread of its own (not the engine thread: no browser here) while the server
    steps two requests that share a prefix: it takes the engine's lock, so it never reads an array a
    step has donated, and every snapshot is one whole state (the free queue as long as the free count,
    no block both free and held). On the live page's server, so one engine is compiled for both."""
    from kvjax.core.block_pool import free_queue
    from kvjax.engine.pool_snapshot import pool_snapshot

    engine, url = server
    core, snaps, errors, done = engine.llm_engine.engine, [], [], threading.Event()

    def watch():
        while not done.is_set():
            try:
                snaps.append(pool_snapshot(core))
            except Exception as e:  # noqa: BLE001 (the test reports it)
                errors.append(e)

    thread = threading.Thread(target=watch)
    thread.start()
    try:  # the live demo's shapes (a 2-block prefix, then 10 and 20 tokens of its own), another prefix
        prefix = [20 + (7 * i) % 200 for i in range(2 * BLOCK)]  # token ids < 256, the vocabulary
        common = {"model": "small-gqa", "stream": True, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        a = post_raw(url, "/v1/completions", dict(common, prompt=prefix + list(range(1, 11))))
        got = {a: read_events(a, 2)}
        b = post_raw(url, "/v1/completions", dict(common, prompt=prefix + list(range(100, 120))))
        got[b] = b""
        for sock, text in got.items():  # each to its end
            with sock:
                while b"data: [DONE]" not in text:
                    more = sock.recv(65536)
                    assert more, text[-300:]
                    text += more
    finally:
        done.set()
        thread.join()
    assert errors == [] and len(snaps) > 1
    for s in snaps:
        assert len(s["free_queue"]) == s["num_free"]
        assert all(s["ref_cnt"][b] == 0 for b in s["free_queue"])
        assert s["metrics"]["num_gpu_blocks"] == SERVE["num_gpu_blocks_override"]
    assert any(s["num_shared"] for s in snaps)  # the shared prefix was seen shared
    last, queue = asyncio.run(engine.call_between_steps(lambda: (pool_snapshot(core),
                                                                   free_queue(core.scheduler.state.pool))))
    assert last["free_queue"] == queue and last["requests"] == []


def test_replay_page_steps_through_the_seed_example(browser, tmp_path):
    """kvjax replay --html of docs/seed_ab_example.jsonl: the seed's exact blocks (1-2 shared, A's 3-8, B's 10-13)."""
    html = tmp_path / "ab.html"
    assert main(["replay", os.path.join(ROOT, "docs", "seed_ab_example.jsonl"), "--html", str(html)]) in (0,)
    browser.get(html.as_uri())
    browser.wait("return document.body.dataset.frames === '7'")
    states = []
    for _ in range(7):
        states.append(browser.run("""return {refs: [...document.querySelectorAll('.block')].map(d => Number(d.dataset.ref)),
            queue: JSON.parse(document.getElementById('queue').dataset.queue),
            tables: Object.fromEntries([...document.querySelectorAll('#reqs tr[data-name]')]
                                       .map(t => [t.dataset.name, JSON.parse(t.dataset.tables)[0]]))};"""))
        browser.run("document.getElementById('next').click()")
    after_b = states[3]
    assert after_b["tables"] == {"A": [1, 2, 3, 4, 5, 6, 7, 8], "C": [9], "B": [1, 2, 10, 11, 12, 13]}
    assert after_b["refs"][1:3] == [2, 2]
    assert states[5]["refs"][1:3] == [1, 1] and "A" not in states[5]["tables"]
    assert states[6]["refs"][1:3] == [0, 0] and states[6]["queue"][-2:] == [2, 1]


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])
