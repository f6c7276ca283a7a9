// A loop's memory per iteration (see NOTE [ iterations ] in gradscope/_passes/iterations.py): each
// iteration's peak and the memory alive at its end, iteration by iteration. Drawn in SVG (no Plotly:
// while a cell runs it is redrawn on every update, about twice a second), at most a few thousand
// points (the data arrive thinned, peaks kept). Rows arrive as columns; -1 is "not measured".

import { clear, h } from "./dom.js";
import { formatBytes, formatSeconds } from "./format.js";

const SVG = "http://www.w3.org/2000/svg";
const W = 640;
const H = 170;
const PAD = { l: 70, r: 12, t: 10, b: 26 };
export const MAX_POINTS = 4000;

function s(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  return e;
}

/** Rows kept: a column store that grows by appended columns and thins itself past MAX_POINTS (pure). */
export class IterationRows {
  constructor(cols) {
    this.cols = { index: [], duration: [], peak: [], start: [], end: [], saved: [] };
    if (cols) this.append(cols);
  }
  get length() {
    return this.cols.index.length;
  }
  append(cols) {
    for (const k of Object.keys(this.cols)) for (const v of cols[k] || []) this.cols[k].push(v);
    if (this.length > MAX_POINTS) this.thin();
  }
  /** Every other row goes, the higher peak of each pair kept (the envelope stays), and the last row. */
  thin() {
    const c = this.cols;
    const n = c.index.length;
    const keep = [];
    for (let i = 0; i + 1 < n - 1; i += 2) keep.push(c.peak[i + 1] > c.peak[i] ? i + 1 : i);
    if (keep[keep.length - 1] !== n - 2 && n >= 2 && c.peak[n - 2] > c.peak[n - 1]) keep.push(n - 2);
    keep.push(n - 1);
    for (const k of Object.keys(c)) c[k] = keep.map((i) => c[k][i]);
  }
  /** [min, max] of the measured memory figures, or null when none is. */
  range() {
    let lo = Infinity;
    let hi = -Infinity;
    for (const k of ["peak", "end"]) for (const v of this.cols[k]) if (v >= 0) (lo = Math.min(lo, v)), (hi = Math.max(hi, v));
    return hi >= lo ? [lo, hi] : null;
  }
}

/** The chart: `update(rows, count, running)` redraws it. */
export class LoopChart {
  constructor(parent, opts = {}) {
    this.opts = opts;
    this.root = h("div", { class: "gs-loop" });
    this.title = h("div", { class: "gs-loop-title", title: opts.definition || null });
    this.svg = s("svg", { viewBox: `0 0 ${W} ${H}`, class: "gs-loop-chart", role: "img" });
    this.status = h("div", { class: "gs-loop-status" });
    this.root.appendChild(this.title);
    this.root.appendChild(this.svg);
    this.root.appendChild(this.status);
    parent.appendChild(this.root);
  }

  update(rows, count, running) {
    const c = rows.cols;
    const n = rows.length;
    this.root.dataset.points = String(n);
    this.root.dataset.count = String(count);
    this.title.textContent = `${this.opts.label || "peak in the iteration"} (blue) and memory at its end (grey), per iteration`;
    while (this.svg.firstChild) this.svg.removeChild(this.svg.firstChild);
    const range = rows.range();
    const last = n ? n - 1 : -1;
    const lastPeak = last >= 0 && c.peak[last] >= 0 ? formatBytes(c.peak[last]) : null;
    const bits = [running ? `running: ${count} iteration${count === 1 ? "" : "s"} ended` : `${count} iterations`];
    if (last >= 0) {
      bits.push(`iteration ${c.index[last]}: ${formatSeconds(c.duration[last])}`);
      if (lastPeak) bits.push(`peak ${lastPeak}, ${formatBytes(c.end[last])} at its end`);
    }
    if (running && count > n && !range) bits.push("memory is read when the first iterations end");
    this.status.textContent = bits.join(" · ");
    if (!n || !range) return;
    const x0 = c.index[0];
    const x1 = Math.max(c.index[last], x0 + 1);
    const top = range[1] * 1.1 || 1;
    const px = (i) => PAD.l + ((i - x0) / (x1 - x0)) * (W - PAD.l - PAD.r);
    const py = (v) => H - PAD.b - (v / top) * (H - PAD.t - PAD.b);
    this.svg.appendChild(s("line", { x1: PAD.l, y1: H - PAD.b, x2: W - PAD.r, y2: H - PAD.b, stroke: "#9aa4b1" }));
    this.svg.appendChild(s("line", { x1: PAD.l, y1: PAD.t, x2: PAD.l, y2: H - PAD.b, stroke: "#9aa4b1" }));
    for (const v of [0, top / 2, top]) {
      const t = s("text", { x: PAD.l - 6, y: py(v) + 4, "text-anchor": "end", "font-size": 10, fill: "#52606d" });
      t.textContent = formatBytes(Math.round(v));
      this.svg.appendChild(t);
    }
    for (const i of [x0, x1]) {
      const t = s("text", { x: px(i), y: H - 8, "text-anchor": "middle", "font-size": 10, fill: "#52606d" });
      t.textContent = String(i);
      this.svg.appendChild(t);
    }
    for (const [key, color, cls] of [["end", "#9aa4b1", "gs-loop-end"], ["peak", "#2563eb", "gs-loop-peak"]]) {
      const pts = [];
      for (let k = 0; k < n; k++) if (c[key][k] >= 0) pts.push(`${px(c.index[k]).toFixed(1)},${py(c[key][k]).toFixed(1)}`);
      if (pts.length === 1) pts.push(pts[0]);
      this.svg.appendChild(s("polyline", { points: pts.join(" "), fill: "none", stroke: color, "stroke-width": 1.5, class: cls }));
    }
  }
}

/** The loop section of a finished recording: the chart, what grows, which iterations the detail is. */
export function loopSection(parent, loop) {
  const chart = new LoopChart(parent, { label: loop.peak_label, definition: loop.peak_definition });
  chart.update(new IterationRows(loop.iterations), loop.count, false);
  const lines = [];
  if (loop.steady === true) lines.push("memory at each iteration's end: steady");
  for (const g of loop.growth || []) {
    const what = g.site === "" ? "memory at each iteration's end" : g.site;
    lines.push(`${loop.growth_label}: ${what}: +${formatBytes(Math.round(g.per_iteration))} per iteration (iterations ${g.first}-${g.last})`);
  }
  const [a, b] = loop.detail;
  let detail = `detail below: iteration ${a}${b > a ? `-${b}` : ""}`;
  if (loop.kept) detail += `; kept: ${loop.kept.length} of ${loop.count} iterations`;
  lines.push(detail);
  const box = h("div", { class: "gs-loop-notes", title: loop.growth_definition || null });
  for (const l of lines) box.appendChild(h("div", { class: l.startsWith(loop.growth_label) ? "gs-loop-grows" : null, text: l }));
  chart.root.appendChild(box);
  return chart;
}

/** A running cell's view: the chart grows with each message (`{type: "iterations", from, rows, count}`). */
export class LiveView {
  constructor(parent, payload) {
    this.root = h("div", { class: "gs-recording gs-live" });
    parent.appendChild(this.root);
    this.root.appendChild(h("h3", { class: "gs-title", text: `gradscope · ${payload.label || "recording"} (running)` }));
    this.chart = new LoopChart(this.root, {});
    this.rows = new IterationRows(payload.iterations);
    this.count = payload.count || 0;
    this.chart.update(this.rows, this.count, true);
  }
  message(msg) {
    if (!msg || msg.type !== "iterations") return;
    if (msg.rows) this.rows.append(msg.rows);
    this.count = Math.max(this.count, msg.count || 0);
    this.chart.update(this.rows, this.count, true);
  }
  destroy() {
    clear(this.root);
    this.root.remove();
  }
}
