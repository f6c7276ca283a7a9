// The memory timeline (Plotly, bundled). One recording: memory stacked by category over time,
// parameters and inputs (the baseline) as the bottom band, phases shaded, the peak marked inside
// the plot with its breakdown, hover naming the op or node running, a marker for the current
// backward step. Several recordings (a comparison): one line each, on a shared normalized time.
// Every byte figure, the axis ticks included, is in binary units (KiB, MiB).

import Plotly from "plotly.js-basic-dist-min";
import { binaryTicks, escapePlotly, formatBytes } from "./format.js";
import { argmax, CATEGORY_COLORS, hoverTexts, labelledRuns, PHASE_COLORS, phaseRuns, xValues } from "./series.js";

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4d7c0f", "#be185d"];
const CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["toImage", "lasso2d", "select2d"] };
const MARGIN = { l: 78, r: 24, t: 34, b: 40 };

function yAxis(ymax, title) {
  const ticks = binaryTicks(ymax * 1.12);
  const top = Math.max(ticks.vals[ticks.vals.length - 1], ymax * 1.2);
  return {
    title: { text: title, font: { size: 12 } },
    tickvals: ticks.vals,
    ticktext: ticks.text,
    range: [0, top],
    zeroline: false,
    fixedrange: false,
    automargin: true,
  };
}

// NOTE [ the axis says what it adds up ]: one recording's timeline may draw the parameters and
// inputs from before the block (the baseline) under the stack. Then every figure drawn on it
// (the axis, the peak label, the hover) is the value on the axis, baseline included, and says
// how much of it is in the block; the axis title says whether the baseline is included. A peak
// label of "9.5 MiB" drawn at 34 MiB read as a contradiction.
const Y_TITLES = {
  included: "memory: baseline included<br>(from before the block + in it)",
  excluded: "memory in the block<br>(baseline excluded)",
  none: "memory allocated in the block<br>(no baseline: nothing from before)",
};

/** An annotation for a peak that stays inside the plot: pointing from the side with room. */
function peakAnnotation(x, y, text, xFrac, color, k = 0) {
  const right = xFrac > 0.6;
  return {
    x,
    y,
    xref: "x",
    yref: "y",
    text,
    showarrow: true,
    arrowhead: 0,
    arrowcolor: color,
    ax: right ? -30 : 30,
    ay: -22 - 20 * k, // several peaks (a comparison): their labels stack instead of overlapping
    xanchor: right ? "right" : "left",
    yanchor: "bottom",
    bgcolor: "rgba(255,255,255,0.9)",
    bordercolor: color,
    borderpad: 2,
    font: { size: 11, color: "#1f2933" },
  };
}

function plotWidth(div) {
  const w = div.clientWidth || div.getBoundingClientRect().width || 700;
  return Math.max(100, w - MARGIN.l - MARGIN.r);
}

function stepLine(x) {
  return { type: "line", xref: "x", yref: "paper", x0: x, x1: x, y0: 0, y1: 1, line: { color: "#16a34a", width: 2 } };
}

function finish(div, traces, layout, opts) {
  const baseShapes = layout.shapes.slice();
  Plotly.newPlot(div, traces, layout, CONFIG).then(() => {
    div.dataset.ready = "1";
    // clicking a point of backward jumps the step-through to the step running then
    if (opts.onPickStep) {
      div.on("plotly_click", (ev) => {
        const p = ev && ev.points && ev.points[0];
        if (p && p.customdata !== null && p.customdata !== undefined) opts.onPickStep(p.customdata);
      });
    }
  });
  return {
    setStep(x) {
      const s = baseShapes.slice();
      if (x !== null && x !== undefined) s.push(stepLine(x));
      Plotly.relayout(div, { shapes: s });
    },
    destroy() {
      Plotly.purge(div);
    },
  };
}

/**
 * One recording's memory over time, stacked by category on top of the baseline. `rec` is a
 * decoded recording. Returns { setStep(xMs|null), destroy() }; x is milliseconds since the
 * first point.
 */
export function renderMemory(div, rec, opts = {}) {
  const tl = rec.timeline;
  const before = rec.summary.baseline_bytes || 0;
  const base = opts.baseline === false ? 0 : before;
  const baseline = base ? "included" : before ? "excluded" : "none";
  div.dataset.baseline = baseline;
  const x = xValues(tl.t, "ms");
  const labels = rec.categoryLabels || {};
  const traces = [];
  const stack = (name, y, color, key) =>
    traces.push({
      type: "scatter",
      mode: "lines",
      name: escapePlotly(name),
      x,
      y,
      stackgroup: "memory",
      line: { width: 0, shape: "hv", color },
      fillcolor: color,
      hoverinfo: "skip",
      meta: key,
    });
  if (base > 0) stack(labels.baseline || "parameters and inputs (before the block)", x.map(() => base), CATEGORY_COLORS.baseline, "baseline");
  if (tl.categories.length) {
    tl.categories.forEach((c, k) => stack(labels[c] || c, tl.byCategory[k], CATEGORY_COLORS[c] || "#94a3b8", c));
  } else {
    stack("allocated in the block (by category: not known)", tl.live, CATEGORY_COLORS.other, "live");
  }
  const total = tl.live.map((v) => v + base);
  const hovers = hoverTexts(tl, labels, base);
  traces.push({
    type: "scatter",
    mode: "lines",
    name: "total",
    x,
    y: total,
    line: { color: "#1f2933", width: 1.2, shape: "hv" },
    hovertext: hovers,
    hoverinfo: "text",
    customdata: tl.step,
    showlegend: false,
    meta: "total",
  });
  if (tl.reserved) {
    traces.push({
      type: "scatter",
      mode: "lines",
      name: "reserved by the CUDA allocator",
      x,
      y: tl.reserved,
      line: { color: "#52606d", width: 1, dash: "dot", shape: "hv" },
      hoverinfo: "x+y+name",
    });
  }
  const i = argmax(tl.live);
  const annotations = [];
  if (i >= 0) {
    const xFrac = x.length > 1 ? x[i] / (x[x.length - 1] || 1) : 0.5;
    traces.push({
      type: "scatter",
      mode: "markers",
      x: [x[i]],
      y: [total[i]],
      marker: { color: "#b91c1c", size: 9, symbol: "diamond", line: { color: "#fff", width: 1 } },
      hovertext: [`peak · ${hovers[i]}`],
      hoverinfo: "text",
      customdata: [tl.step[i]],
      cliponaxis: false,
      showlegend: false,
      name: "peak",
      meta: "peak",
    });
    // see NOTE [ the axis says what it adds up ]: the label's first figure is where it points
    const text = base ? `peak ${formatBytes(total[i])}<br>(${formatBytes(tl.live[i])} in the block)` : `peak ${formatBytes(tl.live[i])}`;
    annotations.push(peakAnnotation(x[i], total[i], text, xFrac, "#b91c1c"));
  }
  const shapes = [];
  const runs = phaseRuns(x, tl.phase);
  const span = x.length ? x[x.length - 1] - x[0] : 0;
  const px = span > 0 ? plotWidth(div) / span : 0;
  const shown = new Set(labelledRuns(runs, px));
  runs.forEach(([phase, a, b], k) => {
    shapes.push({
      type: "rect",
      xref: "x",
      yref: "paper",
      x0: a,
      x1: b,
      y0: 0,
      y1: 1,
      fillcolor: PHASE_COLORS[phase] || PHASE_COLORS.other,
      opacity: 0.45,
      line: { width: 0 },
      layer: "below",
    });
    if (shown.has(k)) {
      annotations.push({ xref: "x", yref: "paper", x: (a + b) / 2, y: 0, yanchor: "bottom", text: phase, showarrow: false, font: { size: 11, color: "#52606d" } });
    }
  });
  div.dataset.phaseLabels = String(shown.size);
  div.dataset.phases = [...new Set(runs.map((r) => r[0]))].join(",");
  const layout = {
    height: opts.height || 280,
    margin: MARGIN,
    xaxis: { title: { text: "time (ms)" }, zeroline: false, exponentformat: "none" },
    yaxis: yAxis(Math.max(...total, 1), Y_TITLES[baseline]),
    shapes,
    annotations,
    showlegend: true,
    legend: { orientation: "h", y: -0.36, yanchor: "top", traceorder: "reversed" },
    hovermode: "closest",
    paper_bgcolor: "#ffffff",
    plot_bgcolor: "#ffffff",
  };
  return finish(div, traces, layout, opts);
}

/**
 * Several runs' memory allocated in the block, one line each, for a comparison. `series` is
 * [{ name, rec }]; `opts.x` is "normalized" (each run's time as 0-100 %, so phases line up
 * whatever each run's speed) or "ms". Returns { setStep, destroy }.
 */
export function renderOverlay(div, series, opts = {}) {
  const mode = opts.x === "ms" ? "ms" : "normalized";
  const traces = [];
  const annotations = [];
  let ymax = 1;
  series.forEach(({ name, rec }, k) => {
    const tl = rec.timeline;
    if (!tl.t.length) return;
    const color = PALETTE[k % PALETTE.length];
    const x = xValues(tl.t, mode);
    traces.push({
      type: "scatter",
      mode: "lines",
      name: escapePlotly(name),
      x,
      y: tl.live,
      line: { color, width: 1.6, shape: "hv" },
      hovertext: hoverTexts(tl),
      hoverinfo: "text",
      customdata: tl.step,
    });
    const i = argmax(tl.live);
    ymax = Math.max(ymax, tl.live[i]);
    traces.push({
      type: "scatter",
      mode: "markers",
      x: [x[i]],
      y: [tl.live[i]],
      marker: { color, size: 9, symbol: "diamond" },
      hovertext: [`${escapePlotly(name)} peak: ${escapePlotly(tl.label[i] || "")}<br>${formatBytes(tl.live[i])}`],
      hoverinfo: "text",
      cliponaxis: false,
      showlegend: false,
      name: "peak",
    });
    const xFrac = mode === "normalized" ? x[i] / 100 : x[i] / (x[x.length - 1] || 1);
    annotations.push(peakAnnotation(x[i], tl.live[i], `${escapePlotly(name)}: ${formatBytes(tl.live[i])}`, xFrac, color, k));
  });
  const layout = {
    height: opts.height || 280,
    margin: MARGIN,
    xaxis: mode === "normalized" ? { title: { text: "share of each run's time (%)" }, range: [0, 100], zeroline: false } : { title: { text: "time (ms)" }, zeroline: false },
    yaxis: yAxis(ymax, Y_TITLES.excluded),
    shapes: [],
    annotations,
    showlegend: true,
    legend: { orientation: "h", y: -0.36, yanchor: "top" },
    hovermode: "closest",
    paper_bgcolor: "#ffffff",
    plot_bgcolor: "#ffffff",
  };
  return finish(div, traces, layout, opts);
}
