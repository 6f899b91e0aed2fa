"use strict";
// The block pool page: draws kvjax.core.pool_view's state (what `kvjax replay --show` prints) block by
// block. Live (kvjax serve's /pool): polls api/pool and keeps every state that differs from the last
// as a frame; replay (kvjax replay --html): the trace's ops, one frame each. What changed between two
// frames (ref counts, evictions, requests arriving, finishing, preempted, prefix hits) is read off
// the two states; nothing here computes the pool.
(() => {
  const DATA = JSON.parse(document.getElementById("kvjax-data").textContent);
  const LIVE = DATA.mode === "live";
  const byId = (id) => document.getElementById(id);
  const MAX_FRAMES = 1000, POLL_MS = 150;
  const frames = [];
  let shown = -1, follow = true, lastText = null;

  function blockClass(p, b) {
    if (b === 0) return "null";
    const r = p.ref_cnt[b];
    return r > 1 ? "shared" : r === 1 ? "used" : p.cached[b] ? "cached" : "free";
  }
  function owners(p) {  // block -> ["A[0]", "B[0]", ...]: who points at it (group g as A/g[j] when grouped)
    const out = {};
    for (const r of p.requests) r.tables.forEach((t, g) => t.forEach((b, j) => {
      if (b === 0) return;
      (out[b] = out[b] || []).push(p.windows.length > 1 ? `${r.name}/${g}[${j}]` : `${r.name}[${j}]`);
    }));
    return out;
  }
  function changes(a, b) {  // what happened between states a and b
    if (!a) return ["(first state)"];
    const ev = [], n = Math.min(a.ref_cnt.length, b.ref_cnt.length);
    const ra = Object.fromEntries(a.requests.map((r) => [r.name, r])), rb = Object.fromEntries(b.requests.map((r) => [r.name, r]));
    for (const name in rb) {
      if (!(name in ra)) ev.push(`${name} arrived (${rb[name].status || "added"}), blocks ${JSON.stringify(rb[name].tables.length > 1 ? rb[name].tables : rb[name].tables[0])}`);
      else if ((rb[name].preemptions || 0) > (ra[name].preemptions || 0)) ev.push(`${name} preempted: all its blocks freed, it recomputes when admitted again`);
    }
    for (const name in ra) if (!(name in rb)) ev.push(`${name} ended: its blocks returned to the free queue (cached ones at its tail)`);
    for (let x = 1; x < n; x++) {
      const parts = [];
      if (a.ref_cnt[x] !== b.ref_cnt[x]) parts.push(`ref ${a.ref_cnt[x]} → ${b.ref_cnt[x]}`);
      if (a.cached[x] && (!b.cached[x] || a.hash[x] !== b.hash[x])) parts.push("evicted: its hash cleared as it was taken");
      if (b.cached[x] && (!a.cached[x] || a.hash[x] !== b.hash[x])) parts.push("cached (full, hashed)");
      if (parts.length) ev.push(`block ${x}: ${parts.join(", ")}`);
    }
    if (a.metrics && b.metrics) {
      const hits = b.metrics["vllm:prefix_cache_hits"] - a.metrics["vllm:prefix_cache_hits"];
      const pre = b.metrics["vllm:num_preemptions"] - a.metrics["vllm:num_preemptions"];
      if (hits > 0) ev.push(`prefix cache: +${hits} tokens hit`);
      if (pre > 0) ev.push(`+${pre} preemption${pre > 1 ? "s" : ""}`);
    }
    return ev.length ? ev : ["(no change in the pool)"];
  }
  function metric(name, value, note) {
    return `<div class="metric"><b>${value}</b><span>${name}</span>${note ? `<br><span>${note}</span>` : ""}</div>`;
  }
  function draw(i) {
    shown = i;
    const f = frames[i], p = f.pool, prev = i > 0 ? frames[i - 1].pool : null;
    byId("frame").max = String(frames.length - 1);
    byId("frame").value = String(i);
    byId("frame-label").textContent = `${f.label} (${i + 1} of ${frames.length})`;
    byId("op").textContent = f.op || "";
    const m = p.metrics, pct = (x) => (x === null || x === undefined ? "—" : `${(100 * x).toFixed(1)}%`);
    byId("headline").innerHTML = m
      ? metric("num_gpu_blocks", m.num_gpu_blocks, "block 0 is the null block")
        + metric("vllm:kv_cache_usage_perc", pct(m["vllm:kv_cache_usage_perc"]))
        + metric("prefix cache hit rate", pct(m.prefix_cache_hit_rate), `${m["vllm:prefix_cache_hits"]} of ${m["vllm:prefix_cache_queries"]} tokens`)
        + metric("vllm:num_preemptions", m["vllm:num_preemptions"])
        + metric("running / waiting", `${m["vllm:num_requests_running"]} / ${m["vllm:num_requests_waiting"]}`)
      : metric("blocks", p.num_blocks, "block 0 is the null block") + metric("usage", pct(p.usage))
        + metric("free", p.num_free) + metric("cached", p.num_cached) + metric("shared", p.num_shared);
    const own = owners(p), q = p.free_queue, head = q[0], tail = q[q.length - 1], box = byId("blocks");
    box.innerHTML = "";
    for (let b = 0; b < p.drawn_blocks; b++) {
      const d = document.createElement("div");
      d.className = `block ${blockClass(p, b)}${b === head ? " head" : ""}${b === tail ? " tail" : ""}`;
      Object.assign(d.dataset, {block: b, ref: p.ref_cnt[b], cached: p.cached[b] ? "1" : "0"});
      d.title = `block ${b}: ref ${p.ref_cnt[b]}${p.cached[b] ? ", cached" : ""}${own[b] ? ", in " + own[b].join(", ") : ""}`;
      d.innerHTML = `<span class="id">${b}</span>${p.cached[b] ? '<span class="hash">#</span>' : ""}`
        + `${p.ref_cnt[b] ? `<span class="ref">${p.ref_cnt[b]}</span>` : ""}`;
      box.appendChild(d);
    }
    if (p.drawn_blocks < p.num_blocks) box.insertAdjacentHTML("beforeend", `<span class="note">… ${p.num_blocks - p.drawn_blocks} more blocks</span>`);
    const queue = byId("queue");
    queue.dataset.queue = JSON.stringify(q);
    const cut = p.free_queue_elided ? ` … ${p.free_queue_elided} more … ` : " ";
    queue.textContent = !q.length ? "empty: every block is in use" : p.free_queue_elided
      ? `head ${q.slice(0, q.length / 2).join(" ")}${cut}${q.slice(q.length / 2).join(" ")} tail` : `head ${q.join(" ")} tail`;
    const rows = byId("reqs").tBodies[0];
    rows.innerHTML = "<tr><th>request</th><th>status</th><th>tokens (computed)</th><th>block table" + (p.windows.length > 1 ? "s, per group" : "") + "</th></tr>";
    for (const r of p.requests) {
      const tr = rows.insertRow();
      tr.dataset.name = r.name;
      tr.dataset.tables = JSON.stringify(r.tables);
      const tables = r.tables.map((t) => "[" + t.map((b) => (p.ref_cnt[b] > 1 ? `<b>${b}</b>` : String(b))).join(" ") + "]").join(" ");
      tr.innerHTML = `<td>${r.name}</td><td>${r.status || ""}${r.preemptions ? ` (preempted ${r.preemptions}×)` : ""}</td>`
        + `<td>${r.num_tokens === null ? "—" : `${r.num_tokens} (${r.num_computed})`}</td><td class="table">${tables}</td>`;
    }
    byId("events").innerHTML = changes(prev, p).slice(0, 60).map((e) => `<div>${e}</div>`).join("");
    document.body.dataset.frames = String(frames.length);
    document.body.dataset.shown = String(i);
  }
  function add(frame) {
    frames.push(frame);
    if (frames.length > MAX_FRAMES) frames.shift();
    if (follow) draw(frames.length - 1);
    else { byId("frame").max = String(frames.length - 1); byId("frame-label").textContent += " ·"; }
  }
  async function poll() {
    try {
      const r = await fetch("api/pool" + location.search);  // ?replica=N: one data parallel replica's pool
      if (r.ok) {
        const p = await r.json(), text = JSON.stringify(Object.assign({}, p, {time: 0}));
        if (text !== lastText) {
          lastText = text;
          add({pool: p, label: new Date(p.time * 1000).toLocaleTimeString()});
        }
        const which = p.num_replicas > 1 ? `replica ${p.replica} of ${p.num_replicas} (/pool?replica=N)` : "this server's engine";
        byId("sub").textContent = `live from ${which}, polled every ${POLL_MS} ms; ${frames.length} states kept`;
      } else byId("sub").textContent = `api/pool answered ${r.status}`;
    } catch (e) { byId("sub").textContent = `api/pool: ${e.message}`; }
    setTimeout(poll, POLL_MS);
  }
  const go = (i) => { if (frames.length) { follow = LIVE && i >= frames.length - 1; byId("follow").hidden = !LIVE || follow; draw(Math.max(0, Math.min(frames.length - 1, i))); } };
  byId("prev").addEventListener("click", () => go(shown - 1));
  byId("next").addEventListener("click", () => go(shown + 1));
  byId("frame").addEventListener("input", () => go(Number(byId("frame").value)));
  byId("follow").addEventListener("click", () => go(frames.length - 1));
  if (LIVE) {
    byId("title").textContent = "Block pool · live";
    poll();
  } else {
    byId("title").textContent = `Block pool · ${DATA.title}`;
    byId("sub").textContent = "a trace through the jitted block pool (kvjax replay --html): one state after each op";
    follow = false;
    DATA.steps.forEach((s, i) => frames.push({pool: s.pool, label: `op ${i + 1}: ${s.out.op}${s.out.req ? " " + s.out.req : ""}`,
                                             op: JSON.stringify(s.op) + (!s.out.ok ? "  → refused" : s.op.op === "add"
                                               ? `  → hit ${JSON.stringify(s.out.hit_blocks)}, new ${JSON.stringify(s.out.new_blocks)}` : "")}));
    if (frames.length) draw(0);
  }
})();
