// The view of a CUDA memory snapshot: memory over time stacked by allocating line (function,
// file) or by role (parameters, activations, gradients, optimizer state...), reserved bytes, the
// OOM and the peak marked; a slider (or a click on the plot) picks a moment, whose live memory by
// group and largest live blocks, with their roles and stack frames, show below.
// The diagnosis comes first: what ran out and why. There is no graph in a snapshot, so none is
// drawn. See NOTE [ text is data ] in dom.js.

import Plotly from "plotly.js-basic-dist-min";
import { clear, h } from "./dom.js";
import { binaryTicks, escapePlotly, formatBytes } from "./format.js";
import { decodeSnapshot, frameLabel, hasTimes, moment, momentText, nearestIndex, snapshotX, visibleFrames } from "./snapdata.js";

const GROUP_COLORS = ["#2563eb", "#f59e0b", "#16a34a", "#dc2626", "#9333ea", "#0891b2", "#ea580c", "#be185d", "#4d7c0f", "#6366f1"];
const OTHER_COLOR = "#cbd5e1";
const CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["toImage", "lasso2d", "select2d"] };
const GROUP_NAMES = { line: "source line", function: "function", file: "file", role: "role" };
// one color per role, whatever the moment or the file (names as gradscope.snapshot.Role.label)
const ROLE_COLORS = {
  "existed before the trace": "#94a3b8",
  "parameters and model state": "#475569",
  "optimizer state": "#9333ea",
  gradients: "#dc2626",
  activations: "#2563eb",
  "kept across steps": "#f59e0b",
  temporaries: "#16a34a",
  "role unknown": "#cbd5e1",
};

export class SnapshotView {
  constructor(parent, payload, hooks = {}) {
    this.snap = decodeSnapshot(payload);
    this.hooks = hooks;
    this.group = hooks.group && this.snap.groupings[hooks.group] ? hooks.group : this.snap.group;
    this.xMode = hasTimes(this.snap) ? "time" : "events";
    this.k = this.snap.defaultIndex;
    this.open = new Set(); // rows whose frames are unfolded
    const s = this.snap.summary;
    const root = (this.root = h("div", { class: "gs-snapshot" }));
    parent.appendChild(root);
    root.appendChild(h("h3", { class: "gs-title", text: `gradscope · ${this.snap.label || "CUDA memory snapshot"}` }));
    const parts = [
      `CUDA memory snapshot of ${s.device}`,
      `${s.events.toLocaleString("en-US")} trace events${s.duration_s !== null && s.duration_s !== undefined ? ` over ${s.duration_s.toFixed(3)} s` : ""}`,
      `${s.allocations.toLocaleString("en-US")} allocations`,
      `peak ${formatBytes(s.peak_bytes)} allocated`,
    ];
    if (s.reserved_peak_bytes !== null && s.reserved_peak_bytes !== undefined) parts.push(`${formatBytes(s.reserved_peak_bytes)} reserved at most`);
    root.appendChild(h("div", { class: "gs-summary", text: parts.join(" · ") }));
    if (s.error) root.appendChild(h("div", { class: "gs-error gs-snap-error", text: s.error }));
    root.appendChild(h("div", { class: "gs-muted gs-snap-nograph", text: "A snapshot records allocations with the Python frames that made them, not the autograd graph: no graph to draw." }));
    this._diagnosis(root);
    const tb = h("div", { class: "gs-toolbar gs-snap-toolbar" });
    this.groupSel = h("select", { class: "gs-snap-group", "aria-label": "group memory by" });
    for (const g of Object.keys(this.snap.groupings)) {
      const o = h("option", { text: GROUP_NAMES[g] || g });
      o.value = g;
      this.groupSel.appendChild(o);
    }
    this.groupSel.value = this.group;
    this.groupSel.addEventListener("change", () => this.setGroup(this.groupSel.value, true));
    tb.appendChild(h("span", { class: "gs-muted", text: "memory by" }));
    tb.appendChild(this.groupSel);
    if (hasTimes(this.snap)) {
      tb.appendChild(h("span", { class: "gs-muted", text: "x:" }));
      this.xBtns = ["time", "events"].map((mode) =>
        h("button", {
          class: `gs-snap-x${this.xMode === mode ? " gs-on" : ""}`,
          text: mode === "time" ? "seconds" : "trace events",
          dataset: { mode },
          on: { click: () => this.setX(mode) },
        }),
      );
      this.xBtns.forEach((b) => tb.appendChild(b));
    }
    // reserved bytes far above the allocated ones would flatten the stack: then off at first
    const maxTotal = Math.max(1, ...this.snap.total);
    const maxReserved = Math.max(0, ...this.snap.reserved);
    this.showReserved = maxReserved <= 4 * maxTotal;
    const box = h("input", { type: "checkbox", class: "gs-snap-reserved" });
    box.checked = this.showReserved;
    box.addEventListener("change", () => {
      this.showReserved = box.checked;
      this._replot();
    });
    tb.appendChild(h("label", { class: "gs-muted", title: "bytes the caching allocator held from CUDA (segments)" }, [box, " reserved"]));
    tb.appendChild(h("span", { class: "gs-muted", text: "go to:" }));
    if (this.snap.peak && this.snap.peak.index !== null && this.snap.peak.index !== undefined) {
      tb.appendChild(h("button", { class: "gs-snap-peak", text: "peak", on: { click: () => this.setMoment(this.snap.peak.index, true) } }));
    }
    if (this.snap.oom && this.snap.oom.index !== null && this.snap.oom.index !== undefined) {
      tb.appendChild(h("button", { class: "gs-snap-oom", text: "OOM", on: { click: () => this.setMoment(this.snap.oom.index, true) } }));
    }
    root.appendChild(tb);
    if (!this.showReserved) {
      root.appendChild(h("div", { class: "gs-muted gs-snap-reserved-note", text: `Reserved memory peaks at ${formatBytes(maxReserved)}, ${(maxReserved / maxTotal).toFixed(0)}× the most ever allocated (${formatBytes(maxTotal)}): hidden so that the allocated bytes stay readable; tick "reserved" to draw it.` }));
    }
    this.plotDiv = h("div", { class: "gs-timeline gs-snap-timeline" });
    root.appendChild(this.plotDiv);
    const n = this.snap.positions.length;
    const step = h("div", { class: "gs-stepper gs-snap-stepper" });
    this.slider = h("input", { type: "range", min: "0", max: String(Math.max(n - 1, 0)), value: String(this.k), class: "gs-snap-slider", "aria-label": "moment of the trace" });
    this.slider.addEventListener("input", () => this.setMoment(Number(this.slider.value), true));
    step.appendChild(h("span", { text: "Moment:" }));
    step.appendChild(h("button", { class: "gs-snap-prev", text: "◀", title: "previous moment", on: { click: () => this.setMoment(this.k - 1, true) } }));
    step.appendChild(this.slider);
    step.appendChild(h("button", { class: "gs-snap-next", text: "▶", title: "next moment", on: { click: () => this.setMoment(this.k + 1, true) } }));
    this.momentLabel = h("span", { class: "gs-steplabel gs-snap-label" });
    step.appendChild(this.momentLabel);
    root.appendChild(step);
    root.appendChild(h("div", { class: "gs-muted gs-defs", text: `${n} moments sampled evenly over the trace, plus the peak and every OOM; exact at each. A click on the plot picks the nearest.` }));
    const body = h("div", { class: "gs-snap-body" });
    this.groupsBox = h("div", { class: "gs-snap-groups" });
    this.blocksBox = h("div", { class: "gs-snap-blocks" });
    body.appendChild(this.groupsBox);
    body.appendChild(this.blocksBox);
    root.appendChild(body);
    if (this.snap.notes.length) {
      const notes = h("details", { class: "gs-muted gs-snap-notes" }, [h("summary", { text: `notes (${this.snap.notes.length})` })]);
      for (const t of this.snap.notes) notes.appendChild(h("div", { text: t }));
      root.appendChild(notes);
    }
    this._drawPanels();
    const later = () => {
      this._timer = setTimeout(() => {
        this._timer = null;
        this._plot();
      }, 0);
    };
    if (typeof requestAnimationFrame !== "undefined") requestAnimationFrame(later);
    else later();
  }

  _diagnosis(root) {
    const d = this.snap.diagnosis;
    if (!d || !d.findings) return;
    const box = h("div", { class: "gs-snap-diagnosis" });
    box.appendChild(h("h4", { text: d.moment === "oom" ? "Why it ran out of memory" : "What the trace shows" }));
    if (d.steps) box.appendChild(h("div", { class: "gs-muted gs-snap-steps", text: `Steps: ${d.steps}.` }));
    if (!d.findings.length) box.appendChild(h("div", { class: "gs-muted gs-snap-none", text: d.none ? `No finding: ${d.none}` : "No known pattern; the largest live blocks below are where the memory is." }));
    d.findings.forEach((f, i) => {
      const item = h("div", { class: "gs-finding", dataset: { pattern: f.pattern } }, [
        h("div", {}, [h("span", { class: "gs-finding-tag", text: f.pattern }), ` ${i + 1}. ${f.message}`]),
        h("div", { class: "gs-finding-fix", text: `→ ${f.suggestion}` }),
      ]);
      box.appendChild(item);
    });
    const full = h("details", { class: "gs-snap-fulltext" }, [h("summary", { text: "the whole diagnosis as text (gs.diagnose)" }), h("pre", { text: d.text })]);
    box.appendChild(full);
    root.appendChild(box);
  }

  _x() {
    return snapshotX(this.snap, this.xMode);
  }

  _plot() {
    const snap = this.snap;
    const x = this._x();
    const g = snap.groupings[this.group];
    const traces = [];
    const step = x.length > 1 ? "hv" : "linear";
    g.names.forEach((name, j) => {
      const other = name === "(other)";
      const color = other ? OTHER_COLOR : (this.group === "role" && ROLE_COLORS[name]) || GROUP_COLORS[j % GROUP_COLORS.length];
      traces.push({
        type: "scatter",
        mode: "lines",
        name: escapePlotly(name),
        x,
        y: g.bytes[j],
        stackgroup: "memory",
        line: { width: 0, shape: step, color },
        fillcolor: color,
        hovertext: g.bytes[j].map((b) => `${escapePlotly(name)}: ${formatBytes(b)}`),
        hoverinfo: "text",
        meta: "group",
      });
    });
    const hovers = snap.positions.map((p, i) => `${p < 0 ? "before the trace" : `trace event ${p}`}${snap.t ? ` · ${snap.t[i].toFixed(4)} s` : ""}<br>allocated ${formatBytes(snap.total[i])} · reserved ${formatBytes(snap.reserved[i])}`);
    traces.push({ type: "scatter", mode: "lines", name: "allocated", x, y: snap.total, line: { color: "#1f2933", width: 1.1, shape: step }, hovertext: hovers, hoverinfo: "text", showlegend: false, meta: "total" });
    if (this.showReserved) traces.push({ type: "scatter", mode: "lines", name: "reserved by the CUDA allocator", x, y: snap.reserved, line: { color: "#52606d", width: 1.2, dash: "dot", shape: step }, hoverinfo: "skip", meta: "reserved" });
    const ymax = Math.max(1, ...(this.showReserved ? snap.reserved : []), ...snap.total);
    const annotations = [];
    const shapes = [];
    const xEnd = x.length ? x[x.length - 1] : 1;
    const xStart = x.length ? x[0] : 0;
    const side = (xi) => ((xi - xStart) / ((xEnd - xStart) || 1) > 0.6 ? "right" : "left");
    if (snap.peak && snap.peak.index !== null && snap.peak.index !== undefined) {
      const i = snap.peak.index;
      traces.push({ type: "scatter", mode: "markers", x: [x[i]], y: [snap.total[i]], marker: { color: "#b91c1c", size: 9, symbol: "diamond", line: { color: "#fff", width: 1 } }, hoverinfo: "text", hovertext: [`peak ${formatBytes(snap.peak.bytes)} · ${hovers[i]}`], showlegend: false, cliponaxis: false, meta: "peak" });
      const r = side(x[i]) === "right";
      annotations.push({ x: x[i], y: snap.total[i], text: `peak ${formatBytes(snap.peak.bytes)}`, showarrow: true, arrowhead: 0, ax: r ? -30 : 30, ay: -24, xanchor: r ? "right" : "left", bgcolor: "rgba(255,255,255,0.9)", bordercolor: "#b91c1c", font: { size: 11 } });
    }
    for (const i of snap.ooms) {
      if (i === null || i === undefined) continue;
      shapes.push({ type: "line", xref: "x", yref: "paper", x0: x[i], x1: x[i], y0: 0, y1: 1, line: { color: "#b91c1c", width: 2, dash: "dash" } });
    }
    if (snap.oom && snap.oom.index !== null && snap.oom.index !== undefined) {
      const i = snap.oom.index;
      const r = side(x[i]) === "right";
      // above the plot, so that it never covers the peak's label
      annotations.push({ x: x[i], y: 1, yref: "paper", xref: "x", text: `OOM: tried to allocate ${formatBytes(snap.oom.requested)}`, showarrow: false, xanchor: r ? "right" : "left", yanchor: "bottom", bgcolor: "rgba(254,226,226,0.95)", bordercolor: "#b91c1c", font: { size: 11, color: "#7f1d1d" } });
    }
    this.baseShapes = shapes;
    const ticks = binaryTicks(ymax * 1.08);
    const layout = {
      height: 360,
      margin: { l: 78, r: 24, t: 28, b: 44 },
      xaxis: { title: { text: this.xMode === "time" && snap.t ? "seconds since the trace's first event" : "trace event" }, zeroline: false, exponentformat: "none" },
      yaxis: { title: { text: this.showReserved ? "allocated; reserved dotted" : "allocated" }, tickvals: ticks.vals, ticktext: ticks.text, range: [0, Math.max(ticks.vals[ticks.vals.length - 1], ymax * 1.1)], zeroline: false },
      shapes: shapes.concat([this._cursor(x)]),
      annotations,
      showlegend: true,
      // under the axis title, however many rows the names take
      legend: { orientation: "h", y: -0.3, yanchor: "top", traceorder: "normal", font: { size: 11 } },
      hovermode: "closest",
      paper_bgcolor: "#ffffff",
      plot_bgcolor: "#ffffff",
    };
    Plotly.newPlot(this.plotDiv, traces, layout, CONFIG).then(() => {
      this.plotDiv.dataset.ready = "1";
      this.plotDiv.dataset.groups = String(g.names.length);
      this.plotDiv.on("plotly_click", (ev) => {
        const p = ev && ev.points && ev.points[0];
        if (!p) return;
        this.setMoment(nearestIndex(this._x(), p.x), true);
      });
    });
  }

  _cursor(x) {
    const xi = x[this.k];
    return { type: "line", xref: "x", yref: "paper", x0: xi, x1: xi, y0: 0, y1: 1, line: { color: "#16a34a", width: 2 } };
  }

  setX(mode) {
    if (mode === this.xMode) return;
    this.xMode = mode;
    (this.xBtns || []).forEach((b) => b.classList.toggle("gs-on", b.dataset.mode === mode));
    this._replot();
  }

  setGroup(g, notify) {
    if (!this.snap.groupings[g] || g === this.group) return;
    this.group = g;
    this.groupSel.value = g;
    this._replot();
    this._drawPanels();
    if (notify) this.hooks.onGroup?.(g);
  }

  _replot() {
    if (this._timer) return; // the first plot is still to come, with the new settings
    Plotly.purge(this.plotDiv);
    delete this.plotDiv.dataset.ready;
    this._plot();
  }

  /** Show moment k (clamped); `notify` tells the host (Python) its trace position. */
  setMoment(k, notify) {
    const n = this.snap.positions.length;
    if (!n) return;
    this.k = Math.min(Math.max(Math.round(k), 0), n - 1);
    this.slider.value = String(this.k);
    this._drawPanels();
    if (this.plotDiv.dataset.ready) Plotly.relayout(this.plotDiv, { shapes: this.baseShapes.concat([this._cursor(this._x())]) });
    if (notify) this.hooks.onPosition?.(this.snap.positions[this.k]);
  }

  /** Show the sampled moment nearest to trace position p (from Python). */
  showPosition(p) {
    const k = nearestIndex(this.snap.positions, p);
    if (k >= 0 && k !== this.k) this.setMoment(k, false);
  }

  _drawPanels() {
    const m = moment(this.snap, this.k, this.group);
    const tags = [m.isOom ? "the OOM" : null, m.isPeak ? "the peak" : null].filter((x) => x);
    this.momentLabel.textContent = `${momentText(m)}${tags.length ? ` · ${tags.join(", ")}` : ""} · ${formatBytes(m.allocated)} allocated, ${formatBytes(m.reserved)} reserved`;
    this.momentLabel.dataset.position = String(m.position);
    this.root.dataset.position = String(m.position);
    const gb = this.groupsBox;
    clear(gb);
    gb.appendChild(h("h4", { text: `Live by ${GROUP_NAMES[this.group] || this.group}` }));
    if (!m.byGroup.length) gb.appendChild(h("div", { class: "gs-muted", text: "Nothing allocated at this moment." }));
    else {
      const tbl = h("table", { class: "gs-table gs-snap-bygroup" });
      tbl.appendChild(h("tr", {}, [h("th", { text: GROUP_NAMES[this.group] || this.group }), h("th", { class: "gs-num", text: "bytes" }), h("th", { class: "gs-num", text: "share" })]));
      for (const [name, b] of m.byGroup) {
        tbl.appendChild(h("tr", { dataset: { group: name } }, [h("td", { text: name }), h("td", { class: "gs-num", text: formatBytes(b) }), h("td", { class: "gs-num", text: m.allocated ? `${((100 * b) / m.allocated).toFixed(1)} %` : "" })]));
      }
      gb.appendChild(tbl);
    }
    const bb = this.blocksBox;
    clear(bb);
    bb.appendChild(h("h4", { text: `Largest live blocks: ${m.blocks.length} of ${m.count.toLocaleString("en-US")}` }));
    if (!m.blocks.length) {
      bb.appendChild(h("div", { class: "gs-muted", text: "No block was live at this moment." }));
      return;
    }
    const tbl = h("table", { class: "gs-table gs-snap-blocklist" });
    tbl.appendChild(h("tr", {}, [h("th", { class: "gs-num", text: "size" }), h("th", { text: "allocated at" }), h("th", { text: "role", title: "what the block was for, from its frames and lifetime" }), h("th", { class: "gs-num", text: "made at", title: "the trace event that allocated it" }), h("th", { class: "gs-num", text: "freed at", title: "the trace event that freed it (never: alive at the end)" }), h("th", { class: "gs-num", text: "stream" })]));
    for (const b of m.blocks) {
      const isOpen = this.open.has(b.row);
      const tr = h("tr", { class: `gs-snap-block${isOpen ? " gs-open" : ""}`, title: "click for its stack frames", dataset: { row: b.row } }, [
        h("td", { class: "gs-num", text: formatBytes(b.size) }),
        h("td", { class: "gs-snap-line", text: `${isOpen ? "▾" : "▸"} ${b.line}` }),
        h("td", { class: "gs-snap-role", text: b.role }),
        h("td", { class: "gs-num", text: b.allocAt < 0 ? "before" : `#${b.allocAt}` }),
        h("td", { class: "gs-num", text: b.freeAt === null ? "never" : `#${b.freeAt}` }),
        h("td", { class: "gs-num", text: String(b.stream) }),
      ]);
      tr.addEventListener("click", () => {
        if (this.open.has(b.row)) this.open.delete(b.row);
        else this.open.add(b.row);
        this._drawPanels();
      });
      tbl.appendChild(tr);
      if (isOpen) {
        const list = h("ol", { class: "gs-snap-frames" });
        for (const f of visibleFrames(b.frames)) {
          if (f.hidden) list.appendChild(h("li", { class: "gs-muted gs-snap-folded", text: `… ${f.hidden} frame${f.hidden === 1 ? "" : "s"} of PyTorch, libraries or C++` }));
          else list.appendChild(h("li", { class: "gs-snap-frame", text: frameLabel(f), title: f.file }));
        }
        if (b.depth > b.frames.length) list.appendChild(h("li", { class: "gs-muted", text: `… ${b.depth - b.frames.length} outer frames not kept` }));
        if (!b.frames.length) list.appendChild(h("li", { class: "gs-muted", text: "no stack recorded" }));
        tbl.appendChild(h("tr", { class: "gs-snap-stack" }, [h("td", { colspan: "6" }, [list])]));
      }
    }
    bb.appendChild(tbl);
    if (m.restCount) bb.appendChild(h("div", { class: "gs-muted gs-snap-rest", text: `and ${m.restCount.toLocaleString("en-US")} smaller blocks, ${formatBytes(m.restBytes)} together.` }));
  }

  destroy() {
    if (this._timer) clearTimeout(this._timer);
    Plotly.purge(this.plotDiv);
    this.root.remove();
  }
}
