"""The pages without a browser: the arithmetic compiled into the static calculator (kvjax.accounting.
formulas.page_plan) against `kvjax plan --json` on the table of configs; POST /api/plan's answer; the
compiler's refusals; `--html`'s refusals; the replay page's states against `kvjax replay`'s own JSON;
GET /api/pool. (The snapshot taken by a thread of its own while the engine steps is in test_pages_browser.py,
on the server the live page watches: one engine compiled for both.)"""
import json
import os

import pytest
from page_configs import CONFIGS, FIELDS, field, plan_json

from kvjax.accounting import formulas
from kvjax.commands.main import build_parser, main
from kvjax.entrypoints import pages
from kvjax.entrypoints.page_routes import plan_answer
from kvjax.errors import UsageError
from kvjax.utils.pyjs import PyJsError, compile_module, compile_source
from kvjax.utils.strict_json import dumps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACE = os.path.join(ROOT, "docs", "seed_ab_example.jsonl")


def _decimal(text):
    whole, _, frac = str(text).partition(".")
    return [int((whole or "0") + frac), 10 ** len(frac)]


def _formula_inputs(argv) -> dict:
    """page_plan's inputs for these flags, as the page's script builds them from its inputs."""
    state = pages.calculator_state(build_parser("plan").parse_args(["plan", *argv]))
    data = pages.page_data()
    m = data["presets"].get(state["preset"]) if state["source"] != "custom" else None
    mla = (m["kind"] if m else state["kind"]) == "mla"
    shape = ({k: m[k] for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "kv_lora_rank")} if m else
             {"num_layers": state["layers"], "num_heads": state["heads"], "num_kv_heads": 1 if mla else state["kv_heads"],
              "head_dim": state["kv_lora_rank"] + state["qk_rope_head_dim"] if mla else state["head_dim"],
              "kv_lora_rank": state["kv_lora_rank"]})
    kv = state["kv_dtype"] if state["kv_dtype"] != "auto" else (m["dtype"] if m else "bf16")
    gib = lambda key: None if state[key] == "" else _decimal(state[key])  # noqa: E731
    return dict(shape, kind="mla" if mla else "gqa", fmt=data["formats"][kv], context=state["context"],
                block_size=state["block_size"], tp=state["tp"], batched_tokens=state["batched_tokens"],
                total_gib=gib("gpu_gib"), util=_decimal(state["util"]), weights_gib=gib("weights_gib"),
                params=m["params"] if m else None, weight_bytes=[2, 1], activations_gib=gib("activations_gib"),
                cudagraph_gib=gib("cudagraph_gib"))


@pytest.mark.parametrize("name, argv", [(n, a) for n, _, a in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_page_plan_equals_kvjax_plan(name, argv):
    want, got = plan_json(argv), formulas.page_plan(_formula_inputs(argv))
    for key in FIELDS + ("util", "tail_waste_bytes", "budget_per_request", "warnings", "tp", "context", "block_size"):
        assert field(got, key) == field(want, key), key
        assert type(field(got, key)) is type(field(want, key)), key


def test_the_formulas_compile_and_refusals_name_the_line():
    js = compile_module(formulas)
    for name in ("page_plan", "kv_budget", "human_bytes", "prefill", "CONTEXT_POINTS", "FormulaError"):
        assert name in js.rsplit("return {", 1)[1]
    for source, what in (("def f(x):\n    return g(x, y=1)\n", "keyword arguments"),
                         ("def f(x):\n    return x.bit_length()\n", "calling x.bit_length"),
                         ("def f(x):\n    return [y for y in x]\n", "ListComp"),
                         ("def f(x):\n    while x:\n        x -= 1\n", "While"),
                         ("def f(x):\n    return f'{x!r}'\n", "conversion"),
                         ("def f(x=1):\n    return x\n", "defaults")):
        with pytest.raises(PyJsError, match=f"line [12]: .*{what}"):
            compile_source(source, "m")


def test_plan_answer_is_kvjax_plan_and_its_sweeps(tmp_path):
    argv = ["--preset", "llama-3-8b", "--device-memory-gib", "80", "--kv-cache-dtype", "fp8"]
    got = json.loads(dumps(plan_answer({"argv": argv})))  # as the server sends it
    assert got["plan"] == plan_json(argv)
    assert got["human"]["budget_bytes"] == formulas.human_bytes(got["plan"]["budget_bytes"])
    assert [t for t, *_ in got["sweeps"]["context"]] == formulas.CONTEXT_POINTS
    for t, conc, blocks in got["sweeps"]["context"]:
        p = plan_json(argv + ["--max-model-len", str(t)])
        assert (conc, blocks) == (p["concurrency"], p["concurrency_blocks"])
    for u, conc, _ in got["sweeps"]["util"]:
        assert conc == plan_json(argv + ["--gpu-memory-utilization", str(u)])["concurrency"]
    # beside --kv-cache-memory-bytes the utilization is refused: those points are null, not an error
    fixed = plan_answer({"argv": ["--preset", "llama-3-8b", "--kv-cache-memory-bytes", "4G"]})
    assert all(c is None for _, c, _ in fixed["sweeps"]["util"]) and fixed["plan"]["budget_bytes"] == 4 * 1024**3
    config = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    pasted = json.loads(dumps(plan_answer({"argv": ["--device-memory-gib", "8"], "hf_config": config})["plan"]))
    on_file = plan_json(["--hf-config", str(tmp_path / "config.json"), "--device-memory-gib", "8"])
    assert {k: v for k, v in pasted.items() if k not in ("model", "spec")} == \
           {k: v for k, v in on_file.items() if k not in ("model", "spec")}


@pytest.mark.parametrize("body, message", [
    ({"argv": ["--group", "A", "--plot", "x.png"]}, "--plot: not a flag"),
    ({"argv": ["--group", "A", "--html=x.html"]}, "--html: not a flag"),
    ({"argv": ["--hf-config", "/etc/passwd"]}, "--hf-config: not a flag"),
    ({"argv": "--group A"}, "a list"),
    ({"argv": ["--group", "A"], "extra": 1}, "the body must be"),
    ({"argv": ["--group", "Z"]}, "invalid choice"),
    ({"argv": ["--device-memory-gib", "8"], "hf_config": [1]}, "config.json object"),
])
def test_plan_answer_refuses(body, message):
    with pytest.raises(UsageError, match=message):
        plan_answer(body)


def test_html_refuses_what_the_page_cannot_show(tmp_path, capsys):
    out = tmp_path / "page.html"
    assert main(["plan", "--group", "B", "--pooled", "--html", str(out)]) == 2
    assert "--html: the calculator page has no input for --pooled" in capsys.readouterr().err
    assert not out.exists()
    assert main(["plan", "--group", "A", "--html", str(tmp_path / "missing" / "page.html")]) == 2
    assert main(["plan", "--kind", "mla", "--layers", "4", "--kv-lora-rank", "32", "--qk-rope-head-dim", "16",
                 "--device-memory-gib", "2", "--html", str(out)]) == 0
    data = json.loads(out.read_text().split('<script id="kvjax-data" type="application/json">')[1].split("</script>")[0])
    assert data["mode"] == "static" and data["initial"]["kind"] == "mla" and data["initial"]["layers"] == 4
    capsys.readouterr()
    assert main(["plan", "--html", str(out), "--json"]) == 0  # no model: the page at the seed's group A
    data = json.loads(out.read_text().split('<script id="kvjax-data" type="application/json">')[1].split("</script>")[0])
    assert (data["initial"]["group"], data["initial"]["preset"]) == ("A", "llama-3-70b")
    assert json.loads(capsys.readouterr().out) == plan_json(["--group", "A"])
    assert main(["plan", "--layers", "4", "--html", str(out)]) == 2  # a shape without --kind is no model, not group A
    assert "describes a custom model (--kind); no --kind" in capsys.readouterr().err


def test_replay_page_states_are_replays_own(tmp_path, capsys):
    out = tmp_path / "ab.html"
    assert main(["replay", TRACE, "--html", str(out)]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    text = out.read_text()
    data = json.loads(text.split('<script id="kvjax-data" type="application/json">')[1].split("</script>")[0])
    assert data["mode"] == "replay" and len(data["steps"]) == len(printed) == 7
    for step, line in zip(data["steps"], printed):
        pool = step["pool"]
        assert step["out"] == line
        assert pool["free_queue"] == line["free_queue"] and pool["num_free"] == line["num_free"]
        assert {str(b): r for b, r in enumerate(pool["ref_cnt"]) if r} == line["ref_cnt"]
        assert [b for b, c in enumerate(pool["cached"]) if c] == line["cached"]
        if line["req"] in {r["name"] for r in pool["requests"]}:
            assert next(r for r in pool["requests"] if r["name"] == line["req"])["tables"] == [line["blocks"]]


def test_api_pool_is_taken_by_the_engine_thread():
    """GET /api/pool through AsyncLLM.call_between_steps; an error in the call is the caller's, and the
    engine lives on."""
    import asyncio

    from serving import http, serving

    with serving(model="small-gqa", block_size=16, num_gpu_blocks_override=32, max_num_seqs=2,
                 use_tqdm_on_load=False) as (engine, url):
        status, _, text = http(url + "/api/pool")
        pool = json.loads(text)
        assert status == 200 and pool["num_blocks"] == 32 and pool["free_queue"] == list(range(1, 32))
        assert pool["metrics"]["num_gpu_blocks"] == 32 and pool["metrics"]["vllm:num_preemptions"] == 0
        assert (pool["replica"], pool["num_replicas"]) == (0, 1)
        status, _, text = http(url + "/api/pool?replica=1")
        assert status == 400 and "replica 1: this server has 1" in json.loads(text)["error"]["message"]
        with pytest.raises(ZeroDivisionError):
            asyncio.run(engine.call_between_steps(lambda: 1 / 0))
        assert engine.is_running and asyncio.run(engine.call_between_steps(lambda: 7)) == 7
        status, _, page = http(url + "/pool")
        assert status == 200 and '"mode": "live"' in page
        status, _, page = http(url + "/")
        assert status == 200 and '"mode": "server"' in page and "const kvjaxFormulas" not in page
        status, _, text = http(url + "/api/plan", {"argv": ["--group", "C"]})
        assert status == 200 and json.loads(text)["plan"] == plan_json(["--group", "C"])
        status, _, text = http(url + "/api/plan", {"argv": ["--plot", "/tmp/x.png"]})
        assert status == 400 and "--plot: not a flag" in json.loads(text)["error"]["message"]


def test_without_chromium_the_browser_tests_say_how_to_install_it(monkeypatch, tmp_path):
    from kvjax.testing.browser import Browser, BrowserMissing

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("KVJAX_CHROMIUM", raising=False)
    monkeypatch.delenv("KVJAX_CHROMEDRIVER", raising=False)
    with pytest.raises(BrowserMissing) as e:
        Browser()
    assert "\n" not in str(e.value) and "apt-get install -y chromium chromium-driver" in str(e.value)


def test_the_install_step_runs_apt_get_only_where_the_browser_is_missing(monkeypatch, tmp_path, capsys):
    import subprocess

    from kvjax.testing import browser

    monkeypatch.delenv("KVJAX_CHROMIUM", raising=False)
    monkeypatch.delenv("KVJAX_CHROMEDRIVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no browser, no apt-get: a warning, the browser tests fail later
    assert browser.install() == 0 and "warning: " in capsys.readouterr().out
    for name in ("apt-get", "sudo"):
        (tmp_path / name).write_text("#!/bin/sh\nexit 0\n")
        (tmp_path / name).chmod(0o755)
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, env: ran.append(cmd) or subprocess.CompletedProcess(cmd, 100))
    assert browser.install() == 1  # apt-get ran and failed: the error names the command
    assert ran[0][-3:] == ["apt-get", "update", "-qq"] and "failed" in capsys.readouterr().out
