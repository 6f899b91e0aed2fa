"use strict";
// A line plot drawn as SVG, for the calculator (no charting library: the page must work offline).
// linePlot(svg, {xs, series: [{name, ys, cls}], xlabel, ylabel, log2, marker, tick, label, legendLeft}) draws ys
// (numbers or null, one per x) against xs; marker: an x to mark with a vertical line.
function linePlot(svg, o) {
  const W = 420, H = 260, L = 52, R = 12, T = 12, B = 42, NS = "http://www.w3.org/2000/svg";
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const el = (name, attrs, text) => {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    svg.appendChild(e);
    return e;
  };
  const fx = (x) => (o.log2 ? Math.log2(x) : x);
  const xs = o.xs.map(fx), x0 = Math.min(...xs), x1 = Math.max(...xs);
  const all = o.series.flatMap((s) => s.ys).filter((y) => y !== null);
  const y1 = Math.max(1, ...all);
  const px = (x) => L + ((fx(x) - x0) / (x1 - x0 || 1)) * (W - L - R);
  const py = (y) => H - B - (y / y1) * (H - T - B);
  el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"});
  el("line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"});
  for (let k = 0; k <= 4; k++) {
    const y = (y1 * k) / 4;
    el("line", {x1: L, y1: py(y), x2: W - R, y2: py(y), class: "grid"});
    el("text", {x: L - 6, y: py(y) + 4, class: "tick", "text-anchor": "end"}, y1 >= 8 ? String(Math.round(y)) : y.toFixed(1));
  }
  o.xs.forEach((x, i) => {
    if (o.tick && !o.tick(x, i)) return;
    el("text", {x: px(x), y: H - B + 16, class: "tick", "text-anchor": "middle"}, o.label ? o.label(x) : String(x));
  });
  el("text", {x: (L + W - R) / 2, y: H - 6, class: "label", "text-anchor": "middle"}, o.xlabel);
  el("text", {x: 12, y: (T + H - B) / 2, class: "label", "text-anchor": "middle",
              transform: `rotate(-90 12 ${(T + H - B) / 2})`}, o.ylabel);
  if (o.marker !== undefined && o.marker !== null && fx(o.marker) >= x0 && fx(o.marker) <= x1) {
    el("line", {x1: px(o.marker), y1: T, x2: px(o.marker), y2: H - B, class: "marker"});
  }
  o.series.forEach((s, j) => {
    const pts = o.xs.map((x, i) => [x, s.ys[i]]).filter((p) => p[1] !== null);
    if (pts.length) el("polyline", {points: pts.map((p) => `${px(p[0])},${py(p[1])}`).join(" "), class: `line ${s.cls}`});
    pts.forEach((p) => el("circle", {cx: px(p[0]), cy: py(p[1]), r: 2.5, class: `dot ${s.cls}`}));
    el("text", {x: o.legendLeft ? L + 6 : W - R - 4, y: T + 12 + 14 * j, class: `legend ${s.cls}`,
                "text-anchor": o.legendLeft ? "start" : "end"}, s.name);
  });
}
