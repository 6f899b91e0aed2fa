"use strict";
// The calculator's glue: inputs → kvjax plan's figures → the readout, the bar and the plots.
// No figure is computed here. A served page asks POST api/plan, which runs `kvjax plan`'s own
// code; a static file (kvjax plan --html) calls kvjaxFormulas, kvjax/accounting/formulas.py
// compiled to JavaScript (kvjax.utils.pyjs). This file only reads inputs and draws answers.
(() => {
  const DATA = JSON.parse(document.getElementById("kvjax-data").textContent);
  const STATIC = DATA.mode === "static";
  const F = STATIC ? kvjaxFormulas : null;  // eslint-disable-line no-undef
  const byId = (id) => document.getElementById(id);
  const SHAPE = ["layers", "heads", "kv_heads", "head_dim", "kv_lora_rank", "qk_rope_head_dim"];
  const INTS = new Set([...SHAPE, "context", "block_size", "tp", "batched_tokens"]);
  const BYTES = ["bytes_per_token", "bytes_per_block", "kv_bytes_per_request", "total_bytes", "requested_bytes",
                 "weights_bytes", "activations_bytes", "cudagraph_bytes", "budget_bytes",
                 "prefill_attention.tiled_bytes", "prefill_attention.reference_scores_bytes"];
  const ROWS = [
    ["bytes_per_token", "KV bytes / token", "bytes"], ["bytes_per_block", "KV bytes / block", "bytes"],
    ["kv_bytes_per_request", "KV bytes / request", "bytes"], ["total_bytes", "GPU memory", "bytes"],
    ["requested_bytes", "requested = ceil(GPU × util)", "bytes"], ["weights_bytes", "weights (one rank)", "bytes"],
    ["activations_bytes", "activations", "bytes"], ["cudagraph_bytes", "CUDA graphs", "bytes"],
    ["budget_bytes", "KV budget", "bytes"], ["num_blocks", "blocks = budget // block (block 0 is null)", "count"],
    ["usable_blocks", "usable blocks", "count"], ["token_slots", "token slots", "count"],
    ["blocks_per_request", "blocks / request = cdiv(T, block size)", "count"],
    ["tail_waste_tokens", "tail waste (slots)", "count"],
    ["concurrency", "concurrency = budget // KV per request", "count"],
    ["concurrency_exact", "unrounded", "float"],
    ["concurrency_blocks", "block-pool concurrency = usable // blocks per request", "count"],
    ["prefill_attention.tiled_bytes", "prefill attention, tiled: one layer (estimate)", "bytes"],
    ["prefill_attention.reference_scores_bytes", "untiled f32 scores: one layer (estimate)", "bytes"]];
  let state = Object.assign({}, DATA.initial);
  let seq = 0;

  const get = (obj, path) => path.split(".").reduce((o, k) => (o === null || o === undefined ? null : o[k]), obj);
  const group3 = (s) => s.replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  const show = (v) => (v === null || v === undefined ? "null" : String(v));

  // ---- what the inputs describe
  function model() {
    if (state.source === "custom") return null;
    return state.source === "hf" ? state.hf : DATA.presets[state.preset];
  }
  function shape() {
    const m = model();
    if (!m) return {kind: state.kind, layers: state.layers, heads: state.heads, kv_heads: state.kv_heads,
                    head_dim: state.head_dim, kv_lora_rank: state.kv_lora_rank, qk_rope_head_dim: state.qk_rope_head_dim};
    return {kind: m.kind, layers: m.num_layers, heads: m.num_heads, kv_heads: m.num_kv_heads, head_dim: m.head_dim,
            kv_lora_rank: m.kv_lora_rank, qk_rope_head_dim: m.qk_rope_head_dim};
  }
  // The attention kind plan's --kind must be for these heads (kvjax.core.kv_cache_interface.attention_kind).
  const kindOf = (mla, heads, kv) => (mla ? "mla" : kv === heads ? "mha" : kv === 1 ? "mqa" : "gqa");
  function defaults() {  // what plan assumes for a flag not given, for this source
    const g = state.source === "group" ? DATA.groups[state.group] : null;
    return {kv_dtype: g ? g.kv_dtype : "auto", context: g ? g.context : DATA.default_context,
            gpu_gib: g ? g.gpu_gib : "", util: g ? g.util : DATA.default_util, weights_gib: g ? g.weights_gib : "",
            tp: g ? g.tp : 1, block_size: DATA.default_block_size, activations_gib: "0", cudagraph_gib: "0",
            batched_tokens: DATA.default_batched_tokens};
  }
  const eff = (key) => (state[key] === "" || state[key] === null ? defaults()[key] : state[key]);

  // The `kvjax plan` flags of these inputs (forServer: without --hf-config, whose file the server does not read).
  function argv(forServer) {
    const a = [], d = defaults(), s = shape();
    if (state.source === "group") {
      a.push("--group", state.group);
      if (state.preset !== DATA.groups[state.group].preset) a.push("--preset", state.preset);
    } else if (state.source === "preset") {
      a.push("--preset", state.preset);
    } else if (state.source === "hf") {
      if (!forServer) a.push("--hf-config", state.hf.path || "config.json");
    } else {
      a.push("--kind", s.kind, "--layers", s.layers, "--heads", s.heads);
      if (s.kind === "mla") a.push("--kv-lora-rank", s.kv_lora_rank, "--qk-rope-head-dim", s.qk_rope_head_dim);
      else a.push("--kv-heads", s.kv_heads, "--head-dim", s.head_dim);
    }
    const flags = [["kv_dtype", "--kv-cache-dtype"], ["context", "--max-model-len"], ["block_size", "--block-size"],
                   ["gpu_gib", "--device-memory-gib"], ["util", "--gpu-memory-utilization"],
                   ["weights_gib", "--weights-gib"], ["activations_gib", "--activations-gib"],
                   ["cudagraph_gib", "--cudagraph-gib"], ["tp", "--tensor-parallel-size"],
                   ["batched_tokens", "--max-num-batched-tokens"]];
    for (const [key, flag] of flags) if (String(eff(key)) !== String(d[key])) a.push(flag, eff(key));
    return a.map(String);
  }

  // ---- the two ways to the figures
  function decimal(text, what) {  // an exact decimal as [numerator, denominator], as plan reads it
    const m = /^\s*(\d*)(?:\.(\d*))?\s*$/.exec(String(text));
    if (!m || m[1] + (m[2] || "") === "") throw new Error(`${what}: ${JSON.stringify(String(text))} is not a number`);
    const frac = m[2] || "";
    return [BigInt((m[1] || "0") + frac), 10n ** BigInt(frac.length)];
  }
  function formulaInputs() {
    const s = shape(), m = model(), mla = s.kind === "mla";
    const kv = state.kv_dtype === "auto" ? (m ? m.dtype : "bf16") : state.kv_dtype;
    const f = DATA.formats[kv], big = (x) => (x === null || x === undefined ? null : BigInt(x));
    return {kind: s.kind, num_layers: big(s.layers), num_heads: big(s.heads), num_kv_heads: big(mla ? 1 : s.kv_heads),
            head_dim: big(mla ? s.kv_lora_rank + s.qk_rope_head_dim : s.head_dim), kv_lora_rank: mla ? big(s.kv_lora_rank) : null,
            fmt: {bits: big(f.bits), group: big(f.group), group_scale_bytes: big(f.group_scale_bytes),
                  vector_scale_bytes: big(f.vector_scale_bytes)},
            context: big(eff("context")), block_size: big(eff("block_size")), tp: big(eff("tp")),
            batched_tokens: big(eff("batched_tokens")),
            total_gib: eff("gpu_gib") === "" ? null : decimal(eff("gpu_gib"), "GPU memory"),
            util: decimal(eff("util"), "gpu_memory_utilization"),
            weights_gib: eff("weights_gib") === "" ? null : decimal(eff("weights_gib"), "weights"),
            params: m ? big(m.params) : null, weight_bytes: DATA.bf16_bytes.map(BigInt),
            activations_gib: decimal(eff("activations_gib"), "activations"),
            cudagraph_gib: decimal(eff("cudagraph_gib"), "CUDA graphs")};
  }
  function staticCompute() {
    const p = formulaInputs(), plan = F.page_plan(p), human = {};
    for (const key of BYTES) { const v = get(plan, key); human[key] = v === null ? null : F.human_bytes(v); }
    const point = (over) => { const q = F.page_plan(Object.assign({}, p, over)); return [q.concurrency, q.concurrency_blocks]; };
    return {plan, human, argv: argv(false),
            sweeps: {context: F.CONTEXT_POINTS.map((t) => [t, ...point({context: t})]),
                     util: F.UTIL_POINTS.map((u) => [Number(u[0]) / Number(u[1]), ...point({util: u})])}};
  }
  async function serverCompute() {
    const body = {argv: argv(true)};
    if (state.source === "hf") body.hf_config = state.hf.config;
    const r = await fetch("api/plan", {method: "POST", headers: {"Content-Type": "application/json"},
                                       body: JSON.stringify(body)});
    const j = await r.json();
    if (!r.ok) throw new Error(j.error ? j.error.message : r.statusText);
    j.argv = argv(false);
    return j;
  }

  // ---- drawing
  function render(res) {
    const plan = res.plan, tbody = byId("readout").tBodies[0];
    tbody.innerHTML = "";
    for (const [key, label, kind] of ROWS) {
      const v = get(plan, key), tr = tbody.insertRow();
      tr.insertCell().outerHTML = `<th>${label}</th>`;
      const cell = tr.insertCell(), exact = tr.insertCell();
      cell.className = "v";
      cell.dataset.field = key;
      cell.dataset.value = show(v);
      exact.className = "x";
      if (v === null || v === undefined) { cell.textContent = "—"; continue; }
      if (kind === "bytes") { cell.textContent = res.human[key]; exact.textContent = group3(String(v)) + " B"; }
      else if (kind === "float") cell.textContent = Number(v).toFixed(4);
      else cell.textContent = group3(String(v));
    }
    const warnings = byId("warnings");
    warnings.innerHTML = "";
    for (const w of plan.warnings) { const li = document.createElement("li"); li.textContent = w; warnings.appendChild(li); }
    const s = plan.spec, f = s.kind === "mla" ? 1 : 2, vectors = f * Number(s.num_layers) * Number(s.num_kv_heads) * Number(s.head_dim);
    byId("formula").textContent = `f × L × Hkv × D × b = ${f} × ${s.num_layers} × ${s.num_kv_heads} × ${s.head_dim} × `
      + `${(Number(plan.bytes_per_token) / vectors).toFixed(4).replace(/\.?0+$/, "")} B = ${res.human.bytes_per_token} per token`
      + (Number(plan.tp) > 1 ? ` (one of ${plan.tp} ranks)` : "");
    byId("title").textContent = plan.model || (model() ? model().title : `custom ${shape().kind.toUpperCase()}`);
    byId("command").textContent = "kvjax plan " + res.argv.join(" ");
    renderHybrid(plan);
    renderBar(plan, res.human);
    renderPlots(res.sweeps, plan);
  }
  function renderHybrid(plan) {
    const box = byId("hybrid"), m = model();
    if (plan.hybrid) {
      const h = plan.hybrid.hybrid, a = plan.hybrid.all_full, sum = (x) => x.blocks_per_request.reduce((p, q) => p + q, 0);
      box.innerHTML = "<h3>Hybrid KV cache groups</h3><table><tr><th></th><th>hybrid</th><th>every layer full</th></tr>"
        + [["groups", h.groups.length, a.groups.length], ["bytes / block", h.bytes_per_block, a.bytes_per_block],
           ["blocks", h.num_blocks, a.num_blocks], ["blocks / request", sum(h), sum(a)],
           ["KV cache size (tokens)", h.kv_cache_tokens, a.kv_cache_tokens],
           ["max concurrency", h.max_concurrency.toFixed(2) + "x", a.max_concurrency.toFixed(2) + "x"],
           ["block-pool concurrency", h.block_pool_concurrency, a.block_pool_concurrency]]
          .map((r) => `<tr><th>${r[0]}</th><td data-field="hybrid.${r[0]}">${group3(String(r[1]))}</td><td>${group3(String(r[2]))}</td></tr>`).join("")
        + "</table>";
    } else if (STATIC && m && m.hybrid) {
      box.innerHTML = '<p class="note">This model has sliding-window layers: its hybrid KV cache groups are '
        + "computed by kvjax serve's page and by kvjax plan, not in this file.</p>";
    } else box.innerHTML = "";
  }
  function renderBar(plan, human) {
    const bar = byId("bar"), text = byId("dominant"), n = (k) => Number(plan[k] || 0);
    bar.innerHTML = "";
    const whole = plan.requested_bytes !== null ? n("requested_bytes") : n("budget_bytes");
    if (plan.budget_bytes === null || whole <= 0) { text.textContent = "no budget: give the GPU memory"; return; }
    const used = Math.max(0, n("concurrency") * n("kv_bytes_per_request"));
    const parts = [["weights", n("weights_bytes")], ["activations", n("activations_bytes")],
                   ["CUDA graphs", n("cudagraph_bytes")], ["KV in use", Math.min(used, Math.max(0, n("budget_bytes")))],
                   ["KV left over", Math.max(0, n("budget_bytes") - used)]];
    for (const [name, v] of parts) {
      if (v <= 0) continue;
      const d = document.createElement("div");
      d.className = "seg " + name.replace(/ /g, "-");
      d.style.width = `${(100 * v) / Math.max(whole, parts.reduce((p, q) => p + q[1], 0))}%`;
      d.title = `${name}: ${(100 * v / whole).toFixed(1)}%`;
      d.textContent = name;
      bar.appendChild(d);
    }
    const terms = [["the weights", n("weights_bytes"), human.weights_bytes], ["the activations", n("activations_bytes"), human.activations_bytes],
                   ["the CUDA graphs", n("cudagraph_bytes"), human.cudagraph_bytes], ["the KV budget", Math.max(0, n("budget_bytes")), human.budget_bytes]];
    const top = terms.reduce((a, b) => (b[1] > a[1] ? b : a));
    text.textContent = `${top[0]} dominate${top[0].endsWith("s") ? "" : "s"}: ${top[2]} of the ${plan.requested_bytes !== null ? human.requested_bytes + " requested" : "budget"} `
      + `(${(100 * top[1] / whole).toFixed(1)}%). The KV budget holds ${show(plan.concurrency)} requests of ${human.kv_bytes_per_request}`
      + ` (${Number(plan.concurrency_exact).toFixed(2)} unrounded); halving b, Hkv or T doubles that, more GPU memory adds to it only after the weights.`;
  }
  function renderPlots(sweeps, plan) {
    const K = (t) => (t >= 1048576 ? `${t / 1048576}M` : `${t / 1024}K`), num = (v) => (v === null ? null : Number(v));
    const ctx = sweeps.context.map((r) => r.map(Number));
    linePlot(byId("plot-context"), {xs: ctx.map((r) => r[0]), log2: true, xlabel: "T (tokens per request)", ylabel: "requests",  // eslint-disable-line no-undef
      series: [{name: "budget // KV per request", ys: sweeps.context.map((r) => num(r[1])), cls: "a"},
               {name: "block pool", ys: sweeps.context.map((r) => num(r[2])), cls: "b"}],
      marker: Number(plan.context), label: K, tick: (x, i) => i % 2 === 0});
    linePlot(byId("plot-util"), {xs: sweeps.util.map((r) => Number(r[0])), xlabel: "gpu_memory_utilization", ylabel: "requests",  // eslint-disable-line no-undef
      series: [{name: "budget // KV per request", ys: sweeps.util.map((r) => num(r[1])), cls: "a"},
               {name: "block pool", ys: sweeps.util.map((r) => num(r[2])), cls: "b"}],
      marker: plan.util === null ? null : Number(plan.util), label: (u) => u.toFixed(2), tick: (x, i) => i % 2 === 0,
      legendLeft: true});
  }

  // ---- inputs
  function writeInputs() {
    const s = shape();
    for (const key of SHAPE) setPair(key, s[key] === null || s[key] === undefined ? "" : s[key]);
    for (const key of ["context", "gpu_gib", "util", "weights_gib", "activations_gib", "cudagraph_gib"]) setPair(key, state[key]);
    byId("batched_tokens").value = state.batched_tokens;
    byId("kv_dtype").value = state.kv_dtype;
    byId("block_size").value = String(state.block_size);
    byId("tp").value = String(state.tp);
    byId("preset").value = state.source === "preset" ? state.preset : "";
    byId(s.kind === "mla" ? "f1" : "f2").checked = true;
    document.body.classList.toggle("mla", s.kind === "mla");
    for (const b of byId("groups").children) b.classList.toggle("on", state.source === "group" && b.dataset.group === state.group);
    byId("source").textContent = state.source === "custom" ? `custom ${s.kind.toUpperCase()}: every factor is yours`
      : state.source === "group" ? `SPEC group ${state.group}: ${DATA.groups[state.group].title}` : `preset ${model().title}`;
  }
  function setPair(key, value) {
    const box = byId(key), range = byId(key + "-range");
    box.value = value;
    if (range) range.value = range.dataset.log2 ? Math.log2(Number(value) || 1) : value;
  }
  function toCustom() {  // a moved shape slider: the model becomes the sliders' own
    if (state.source === "custom") return;
    const s = shape();
    Object.assign(state, s, {source: "custom"});
  }
  function changed(key, raw) {
    const value = INTS.has(key) ? parseInt(raw, 10) : String(raw).trim();
    if (INTS.has(key) && !(value >= 1)) return;  // a half-typed number: wait for the rest
    if (SHAPE.includes(key)) {
      toCustom();
      state[key] = value;
      state.kind = kindOf(state.kind === "mla", state.heads, state.kv_heads);
    } else state[key] = value;
    update();
  }
  function setF(mla) {
    toCustom();
    if (mla) Object.assign(state, {kind: "mla", kv_lora_rank: state.kv_lora_rank || 512, qk_rope_head_dim: state.qk_rope_head_dim || 64});
    else Object.assign(state, {kind: kindOf(false, state.heads, state.kv_heads || 8), kv_heads: state.kv_heads || 8,
                               head_dim: state.head_dim || 128});
    update();
  }
  function build() {
    for (const div of document.querySelectorAll(".slider")) {
      const key = div.dataset.key, label = div.innerHTML;
      div.innerHTML = `<label for="${key}">${label}</label><input type="range" id="${key}-range" min="${div.dataset.min}" `
        + `max="${div.dataset.max}" step="${div.dataset.step}"${div.dataset.log2 ? ' data-log2="1"' : ""}>`
        + `<input type="${INTS.has(key) ? "number" : "text"}" id="${key}" inputmode="decimal">`;
      const range = byId(key + "-range");
      range.addEventListener("input", () => {
        const v = range.dataset.log2 ? String(2 ** Number(range.value)) : range.value;
        byId(key).value = v;
        changed(key, v);
      });
      byId(key).addEventListener("input", () => changed(key, byId(key).value));
    }
    for (const [g, v] of Object.entries(DATA.groups)) {
      const b = document.createElement("button");
      b.type = "button"; b.dataset.group = g; b.id = `group-${g}`; b.textContent = `${g}: ${v.label}`;
      b.addEventListener("click", () => {
        state = Object.assign({}, state, {source: "group", group: g, preset: v.preset, kv_dtype: v.kv_dtype, context: v.context,
          gpu_gib: v.gpu_gib, util: v.util, weights_gib: v.weights_gib, tp: v.tp, block_size: DATA.default_block_size,
          activations_gib: "0", cudagraph_gib: "0"});
        update();
      });
      byId("groups").appendChild(b);
    }
    const options = (id, values, labels) => { byId(id).innerHTML = values.map((v, i) => `<option value="${v}">${labels ? labels[i] : v}</option>`).join(""); };
    options("preset", ["", ...Object.keys(DATA.presets)], ["—", ...Object.entries(DATA.presets).map(([k, p]) => `${k} (${p.title})`)]);
    options("kv_dtype", DATA.kv_dtypes);
    options("block_size", [16, 32, 64, 128, 256]);
    options("tp", [1, 2, 4, 8, 16]);
    byId("preset").addEventListener("change", () => {
      if (!byId("preset").value) return;
      Object.assign(state, {source: "preset", preset: byId("preset").value, kv_dtype: "auto", weights_gib: "", tp: 1});
      update();
    });
    for (const id of ["kv_dtype", "block_size", "tp"]) byId(id).addEventListener("change", () => changed(id, byId(id).value));
    byId("batched_tokens").addEventListener("input", () => changed("batched_tokens", byId("batched_tokens").value));
    byId("f1").addEventListener("change", () => setF(true));
    byId("f2").addEventListener("change", () => setF(false));
    byId("hf-use").addEventListener("click", () => {
      try { state = Object.assign({}, state, {source: "hf", hf: {path: "config.json", config: JSON.parse(byId("hf-text").value), title: "config.json"}, tp: 1, kv_dtype: "auto", weights_gib: ""}); }
      catch (e) { showError(`config.json: ${e.message}`); return; }
      update();
    });
    byId("hf-box").hidden = STATIC;
    byId("pool-link").hidden = STATIC;
    byId("mode-note").textContent = STATIC ? "kvjax/accounting/formulas.py, compiled into this file: it works offline"
                                           : "every change asks this server's POST /api/plan (kvjax plan --json)";
  }
  function showError(message) {
    byId("error").hidden = !message;
    byId("error").textContent = message || "";
  }
  async function update() {
    const mine = ++seq;
    writeInputs();
    document.body.dataset.state = "busy";
    let res;
    try { res = STATIC ? staticCompute() : await serverCompute(); }
    catch (e) { if (mine === seq) { showError(e.message); document.body.dataset.state = "error"; } return; }
    if (mine !== seq) return;  // a newer change is on its way
    if (state.source === "hf" && res.plan.spec) {  // the sliders show what the server parsed
      const s = res.plan.spec;
      Object.assign(state.hf, {kind: s.kind, num_layers: s.num_layers, num_heads: s.num_heads, num_kv_heads: s.num_kv_heads,
                               head_dim: s.head_dim, kv_lora_rank: s.kv_lora_rank, qk_rope_head_dim: s.qk_rope_head_dim});
      writeInputs();
    }
    showError(null);
    render(res);
    window.kvjaxResult = res;
    document.body.dataset.renders = String(mine);
    document.body.dataset.state = "ready";
  }
  build();
  update();
})();
