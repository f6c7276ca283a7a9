// The view of a job (gs.gather / gs.load_ranks): every rank's figures side by side, the
// imbalance in words, the ranks' timelines overlaid (by time, by each rank's share of its time,
// or phase by phase) with communication spans under them, failed and missing ranks marked, and
// one rank's own recording (graph, step-through) below. All of it from gradscope.job.job_view.
// See NOTE [ text is data ] in dom.js.

import Plotly from "plotly.js-basic-dist-min";
import { h } from "./dom.js";
import { binaryTicks, escapePlotly, formatBytes, formatSeconds } from "./format.js";
import { alignSpan, alignTimelines, rankColor, statusText } from "./jobdata.js";

const CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["toImage", "lasso2d", "select2d"] };
const ALIGN = [
  ["normalized", "each rank 0–100 %"],
  ["phase", "by phase"],
  ["time", "milliseconds"],
];

export class JobView {
  constructor(parent, payload, opts = {}) {
    this.p = payload;
    this.opts = opts;
    this.align = ALIGN.some(([m]) => m === opts.align) ? opts.align : "normalized";
    this.root = h("div", { class: "gs-jobview" });
    parent.appendChild(this.root);
    this.render();
  }

  render() {
    const p = this.p;
    const root = this.root;
    while (root.firstChild) root.removeChild(root.firstChild);
    this.recView?.destroy();
    this.recView = null;
    const counts = Object.entries(p.counts || {})
      .map(([k, n]) => `${n} ${k}`)
      .join(", ");
    root.appendChild(h("h3", { class: "gs-title", text: `gradscope · job${p.label ? ` ${p.label}` : ""}: ${p.world_size} rank${p.world_size === 1 ? "" : "s"} (${counts})` }));
    const imb = p.imbalance;
    if (imb) root.appendChild(h("div", { class: "gs-job-imbalance", text: imb.sentence }));
    if (p.findings && p.findings.length) {
      const box = h("div", { class: "gs-snap-diagnosis gs-job-findings" }, [h("h4", { text: "Out of memory" })]);
      for (const f of p.findings) {
        box.appendChild(
          h("div", { class: "gs-finding", dataset: { rank: f.rank, pattern: f.pattern } }, [
            h("div", {}, [h("span", { class: "gs-finding-tag", text: f.pattern }), ` rank ${f.rank} ${f.message}`]),
            h("div", { class: "gs-finding-fix", text: `→ ${f.suggestion}` }),
          ]),
        );
      }
      root.appendChild(box);
    }
    root.appendChild(this._table());
    if (imb && (imb.sizes.length || imb.modules.length || imb.held.length)) root.appendChild(this._imbalanceDetails(imb));
    this._timelines();
    if (p.notes && p.notes.length) {
      const box = h("div", { class: "gs-muted gs-job-notes" });
      for (const n of p.notes) box.appendChild(h("div", { text: `note: ${n}` }));
      root.appendChild(box);
    }
    this._rankView();
    root.dataset.align = this.align;
  }

  _table() {
    const p = this.p;
    const imb = p.imbalance;
    const tbl = h("table", { class: "gs-table gs-job-table" });
    const th = (text, cls, title) => h("th", { class: cls, text, title });
    // column titles from the figure registry (gradscope.figures.FIGURES), as every view
    const fig = (name, label, definition) => (p.figures && p.figures[name]) || { label, definition };
    const figTh = (f) => th(f.label, "gs-num", f.definition);
    tbl.appendChild(
      h("tr", {}, [
        th("rank"),
        th("status"),
        figTh(fig("peak", "peak (at once)", "the most memory allocated in the rank's block alive at one moment")),
        figTh(fig("baseline_bytes", "baseline", "what existed before the block: parameters, buffers, inputs (CPU); allocated bytes (CUDA)")),
        figTh(fig("saved_bytes", "saved (all kinds)", "bytes of every tensor saved for backward in the block, each storage once")),
        th("time", "gs-num", "wall time of the rank's recorded block"),
        th("peak at"),
        th("inputs", undefined, "the largest inputs its graph saved"),
      ]),
    );
    for (const r of p.rows) {
      const st = statusText(r);
      const heavy = imb && imb.heaviest !== imb.lightest && r.rank === imb.heaviest;
      const light = imb && imb.heaviest !== imb.lightest && r.rank === imb.lightest;
      const where = [r.peak_phase, r.peak_module, r.peak_label].filter((x) => x).join(" · ");
      const nobytes = r.peak_bytes === null || r.peak_bytes === undefined;
      const tr = h(
        "tr",
        {
          class: ["gs-job-row", `gs-job-${r.status}`, heavy ? "gs-job-heaviest" : "", this.selected === r.rank ? "gs-job-selected" : ""].join(" ").trim(),
          dataset: { rank: r.rank, status: r.status },
          title: this._hasGraph(r.rank) ? "click to show this rank's graph and step-through below" : undefined,
        },
        [
          h("td", { class: "gs-job-rank" }, [h("span", { class: "gs-swatch", style: `background:${rankColor(r.rank)}` }), String(r.rank)]),
          h("td", { class: st.bad ? "gs-job-bad" : "gs-status-ok", text: st.text }),
          h("td", { class: "gs-num gs-job-peak", text: nobytes ? "—" : `${formatBytes(r.peak_bytes)}${heavy ? " ▲ heaviest" : light ? " ▽ lightest" : ""}` }),
          h("td", { class: "gs-num", text: nobytes ? "—" : formatBytes(r.baseline_bytes) }),
          h("td", { class: "gs-num gs-job-saved", text: r.saved_bytes === null || r.saved_bytes === undefined ? "—" : formatBytes(r.saved_bytes) }),
          h("td", { class: "gs-num gs-job-time", text: r.time_s === null || r.time_s === undefined || r.status === "missing" ? "—" : formatSeconds(r.time_s) }),
          h("td", { class: "gs-job-where", text: where }),
          h("td", { class: "gs-job-inputs", text: r.inputs.join(", ") }),
        ],
      );
      if (this._hasGraph(r.rank)) tr.addEventListener("click", () => this.selectRank(r.rank, true));
      tbl.appendChild(tr);
      if (r.message) {
        tbl.appendChild(h("tr", { class: `gs-job-message gs-job-${r.status}`, dataset: { rank: r.rank } }, [h("td", {}), h("td", { colspan: "7", class: st.bad ? "gs-job-bad" : "gs-muted", text: r.message })]));
      }
    }
    return h("div", { class: "gs-scroll" }, [tbl]);
  }

  _imbalanceDetails(imb) {
    const box = h("div", { class: "gs-job-details" });
    for (const s of imb.sizes) {
      box.appendChild(h("div", { class: "gs-muted", text: `input ${s.input}: ${s.what} ${s.heavy} on rank ${imb.heaviest}, ${s.light} on rank ${imb.lightest}` }));
    }
    const table = (title, rows) => {
      if (!rows.length) return;
      const tbl = h("table", { class: "gs-table gs-job-diff" });
      tbl.appendChild(h("tr", {}, [h("th", { text: title }), h("th", { class: "gs-num", text: `rank ${imb.heaviest}` }), h("th", { class: "gs-num", text: `rank ${imb.lightest}` }), h("th", { class: "gs-num", text: "difference" })]));
      for (const [name, a, b] of rows.slice(0, 5)) {
        tbl.appendChild(h("tr", {}, [h("td", { text: name }), h("td", { class: "gs-num", text: formatBytes(a) }), h("td", { class: "gs-num", text: formatBytes(b) }), h("td", { class: "gs-num", text: `${a >= b ? "+" : "−"}${formatBytes(Math.abs(a - b))}` })]));
      }
      box.appendChild(tbl);
    };
    table("saved bytes by module", imb.modules);
    table("held at the peak", imb.held);
    return box;
  }

  _timelines() {
    const p = this.p;
    const section = h("div", { class: "gs-section" });
    const head = h("div", { class: "gs-toolbar" }, [h("h4", { text: "Memory allocated in each rank's block, overlaid" }), h("span", { class: "gs-muted", text: "align:" })]);
    for (const [mode, text] of ALIGN) {
      head.appendChild(
        h("button", {
          class: `gs-job-align${this.align === mode ? " gs-on" : ""}`,
          text,
          dataset: { mode },
          on: { click: () => this.setAlign(mode, true) },
        }),
      );
    }
    section.appendChild(head);
    this.tlDiv = h("div", { class: "gs-timeline gs-job-timeline" });
    section.appendChild(this.tlDiv);
    this.root.appendChild(section);
    const missing = p.rows.filter((r) => !p.timelines.some((tl) => tl.rank === r.rank));
    if (missing.length) section.appendChild(h("div", { class: "gs-muted gs-job-notdrawn", text: `Not drawn (no timeline): ${missing.map((r) => `rank ${r.rank} (${r.status})`).join(", ")}.` }));
    if (!p.timelines.length) {
      this.tlDiv.appendChild(h("div", { class: "gs-muted", text: "No rank has a memory timeline." }));
      return;
    }
    const a = alignTimelines(p.timelines, this.align);
    if (a.note) section.appendChild(h("div", { class: "gs-muted gs-job-align-note", text: a.note }));
    const traces = [];
    let ymax = 1;
    const ranks = p.timelines.map((tl) => tl.rank);
    p.timelines.forEach((tl, k) => {
      const color = rankColor(tl.rank);
      const row = p.rows[tl.rank];
      const failed = row && row.status !== "complete";
      traces.push({
        type: "scatter",
        mode: "lines",
        name: `rank ${tl.rank}${failed ? ` (${row.status})` : ""}`,
        x: a.xs[k],
        y: tl.live,
        line: { color, width: 1.6, shape: "hv", dash: failed ? "dash" : "solid" },
        hovertext: tl.live.map((v, i) => `rank ${tl.rank}: ${formatBytes(v)}${tl.phase ? ` · ${p.phases[tl.phase[i]] ?? ""}` : ""} · ${formatSeconds(tl.t[i])}`),
        hoverinfo: "text",
        meta: `rank${tl.rank}`,
      });
      let i = 0;
      tl.live.forEach((v, j) => {
        if (v > tl.live[i]) i = j;
      });
      ymax = Math.max(ymax, tl.live[i] || 0);
      traces.push({ type: "scatter", mode: "markers", x: [a.xs[k][i]], y: [tl.live[i]], marker: { color, size: 9, symbol: "diamond" }, hoverinfo: "text", hovertext: [`rank ${tl.rank} peak ${formatBytes(tl.live[i])}`], showlegend: false, cliponaxis: false, meta: "peak" });
    });
    // communication: one row per rank under the plot, a segment per span
    const spans = p.collectives.filter((c) => ranks.includes(c.rank));
    const byRank = new Map();
    for (const c of spans) {
      const k = ranks.indexOf(c.rank);
      const [x0, x1] = alignSpan(p.timelines[k], a.xs[k], c.t0, c.t1, this.align);
      if (!byRank.has(c.rank)) byRank.set(c.rank, { x: [], y: [], text: [] });
      const s = byRank.get(c.rank);
      const label = `rank ${c.rank}: ${escapePlotly(c.op)}${c.bytes ? ` · ${formatBytes(c.bytes)} ${c.source === "captured" ? "moved" : "allocated"}` : ""}`;
      s.x.push(x0, x1 > x0 ? x1 : x0, null);
      s.y.push(k, k, null);
      s.text.push(label, label, "");
    }
    for (const [rank, s] of byRank) {
      traces.push({ type: "scatter", mode: "lines+markers", x: s.x, y: s.y, yaxis: "y2", line: { color: rankColor(rank), width: 6 }, marker: { size: 5, color: rankColor(rank) }, hovertext: s.text, hoverinfo: "text", showlegend: false, meta: "comm" });
    }
    const ticks = binaryTicks(ymax * 1.1);
    const hasComm = byRank.size > 0;
    const layout = {
      height: hasComm ? 340 + 14 * ranks.length : 300,
      margin: { l: 78, r: 24, t: 16, b: 44 },
      // with a communication strip, the x axis (ticks and title) sits under the strip, shared by both
      xaxis: { title: { text: a.title }, zeroline: false, ...(hasComm ? { anchor: "y2" } : {}), ...(a.ticks ? { tickvals: a.ticks.vals, ticktext: a.ticks.text } : {}), ...(this.align === "normalized" ? { range: [0, 100] } : {}) },
      yaxis: { title: { text: "allocated in the block" }, tickvals: ticks.vals, ticktext: ticks.text, range: [0, Math.max(ticks.vals[ticks.vals.length - 1], ymax * 1.15)], domain: hasComm ? [0.3, 1] : [0, 1], zeroline: false },
      ...(hasComm
        ? { yaxis2: { domain: [0, 0.24], anchor: "x", range: [-0.7, ranks.length - 0.3], tickvals: ranks.map((_, k) => k), ticktext: ranks.map((r) => `rank ${r}`), title: { text: "communication", font: { size: 11 } }, fixedrange: true, zeroline: false } }
        : {}),
      shapes: [],
      annotations: [],
      showlegend: true,
      legend: { orientation: "h", y: hasComm ? -0.16 : -0.2 },
      hovermode: "closest",
      paper_bgcolor: "#ffffff",
      plot_bgcolor: "#ffffff",
    };
    this.tlDiv.dataset.spans = String(spans.length);
    this.tlDiv.dataset.lines = String(p.timelines.length);
    Plotly.newPlot(this.tlDiv, traces, layout, CONFIG).then(() => {
      this.tlDiv.dataset.ready = "1";
    });
    if (!hasComm) section.appendChild(h("div", { class: "gs-muted gs-job-nocomm", text: "No communication seen in these timelines (collectives show where they allocate, or when the recorder captured them)." }));
  }

  _hasGraph(rank) {
    return !!(this.p.recordings && this.p.recordings[rank]);
  }

  _rankView() {
    const p = this.p;
    if (!p.recordings) return;
    const ranks = p.rows.filter((r) => this._hasGraph(r.rank)).map((r) => r.rank);
    if (!ranks.length) return;
    if (!ranks.includes(this.selected)) {
      this.selected = p.imbalance ? p.imbalance.heaviest : ranks[0];
      if (!ranks.includes(this.selected)) this.selected = ranks[0];
    }
    const sel = h("select", { class: "gs-job-rank-select", "aria-label": "rank to show" });
    for (const r of ranks) {
      const o = h("option", { text: `rank ${r} (${p.rows[r].status})` });
      o.value = String(r);
      sel.appendChild(o);
    }
    sel.value = String(this.selected);
    sel.addEventListener("change", () => this.selectRank(Number(sel.value), true));
    this.rankSel = sel;
    this.root.appendChild(h("div", { class: "gs-toolbar gs-section" }, [h("span", { text: "Graph and step-through of:" }), sel]));
    this.rankDiv = h("div", { class: "gs-job-rankview" });
    this.root.appendChild(this.rankDiv);
    this._showRank();
  }

  _showRank() {
    this.recView?.destroy();
    this.recView = null;
    const RecordingView = this.opts.RecordingView;
    const payload = this.p.recordings && this.p.recordings[this.selected];
    if (!RecordingView || !payload) return;
    this.recView = new RecordingView(this.rankDiv, payload, this.opts.recordingHooks || {});
    this.rankDiv.dataset.rank = String(this.selected);
    for (const tr of this.root.querySelectorAll(".gs-job-row")) tr.classList.toggle("gs-job-selected", Number(tr.dataset.rank) === this.selected);
  }

  selectRank(rank, notify) {
    if (!this._hasGraph(rank) || rank === this.selected) return;
    this.selected = rank;
    if (this.rankSel) this.rankSel.value = String(rank);
    this._showRank();
    if (notify) this.opts.onRank?.(rank);
  }

  setAlign(mode, notify) {
    if (mode === this.align) return;
    this.align = mode;
    Plotly.purge(this.tlDiv);
    const keep = this.selected;
    this.render();
    this.selected = keep;
    if (notify) this.opts.onAlign?.(mode);
  }

  destroy() {
    this.recView?.destroy();
    if (this.tlDiv) Plotly.purge(this.tlDiv);
    this.root.remove();
  }
}
