// The memory timeline: live bytes over forward and backward (Plotly, bundled), phases shaded,
// the peak marked, hover naming the op or node running, a marker for the current backward step.

import Plotly from "plotly.js-basic-dist-min";
import { escapePlotly } from "./format.js";
import { formatBytes } from "./format.js";
import { argmax, hoverTexts, phaseRuns } from "./series.js";

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4d7c0f", "#be185d"];

function seriesTrace(name, tl, color, withHover) {
  const t0 = tl.t.length ? tl.t[0] : 0;
  return {
    type: "scatter",
    mode: "lines",
    name: escapePlotly(name),
    x: tl.t.map((v) => (v - t0) * 1e3),
    y: tl.live,
    line: { color, width: 1.6, shape: "hv" },
    hovertext: withHover ? hoverTexts(tl) : undefined,
    customdata: tl.step,
    hoverinfo: withHover ? "text" : "x+y+name",
  };
}

/**
 * Draw timelines into `div`. `series` is [{ name, rec }] (decoded recordings); the first one's
 * phases are shaded and each series' peak is marked. Returns { setStep(xSeconds|null), destroy() }.
 */
export function renderTimeline(div, series, opts = {}) {
  const traces = [];
  const shapes = [];
  const annotations = [];
  series.forEach(({ name, rec }, k) => {
    const tl = rec.timeline;
    if (!tl.t.length) return;
    const color = PALETTE[k % PALETTE.length];
    traces.push(seriesTrace(name, tl, color, true));
    if (tl.reserved) {
      const t0r = tl.t[0];
      traces.push({
        type: "scatter",
        mode: "lines",
        name: `${escapePlotly(name)} reserved`,
        x: tl.t.map((v) => (v - t0r) * 1e3),
        y: tl.reserved,
        line: { color, width: 1, dash: "dot", shape: "hv" },
        hoverinfo: "x+y+name",
        showlegend: true,
      });
    }
    const i = argmax(tl.live);
    const t0 = tl.t[0];
    traces.push({
      type: "scatter",
      mode: "markers+text",
      x: [(tl.t[i] - t0) * 1e3],
      y: [tl.live[i]],
      marker: { color, size: 10, symbol: "diamond" },
      text: [`peak ${formatBytes(tl.live[i])}`],
      textposition: "top center",
      hovertext: [`peak: ${escapePlotly(tl.label[i] || "")}<br>${formatBytes(tl.live[i])}`],
      hoverinfo: "text",
      showlegend: false,
      name: "peak",
    });
    if (k === 0 && series.length === 1) {
      // phases are shaded for a single timeline; overlaid ones have phases of their own
      for (const [phase, a, b] of phaseRuns(tl.t, tl.phase)) {
        shapes.push({
          type: "rect",
          xref: "x",
          yref: "paper",
          x0: (a - t0) * 1e3,
          x1: (b - t0) * 1e3,
          y0: 0,
          y1: 1,
          fillcolor: phase === "backward" ? "#fde68a" : "#bfdbfe",
          opacity: 0.35,
          line: { width: 0 },
          layer: "below",
        });
        annotations.push({
          xref: "x",
          yref: "paper",
          x: ((a + b) / 2 - t0) * 1e3,
          y: 0,
          yanchor: "bottom",
          text: phase,
          showarrow: false,
          font: { size: 11, color: "#52606d" },
        });
      }
    }
  });
  const layout = {
    height: opts.height || 240,
    margin: { l: 70, r: 20, t: 24, b: 40 },
    xaxis: { title: { text: "time (ms)" }, zeroline: false, exponentformat: "none" },
    yaxis: { title: { text: "live bytes" }, tickformat: "~s", ticksuffix: "B", rangemode: "tozero" },
    shapes,
    annotations,
    showlegend: series.length > 1 || traces.some((t) => t.showlegend === true),
    legend: { orientation: "h", y: -0.25 },
    hovermode: "closest",
    paper_bgcolor: "#ffffff",
    plot_bgcolor: "#ffffff",
  };
  const config = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["toImage", "lasso2d", "select2d"] };
  Plotly.newPlot(div, traces, layout, config).then(() => {
    div.dataset.ready = "1";
    // clicking a point of backward jumps the step-through to the step running then
    if (opts.onPickStep) {
      div.on("plotly_click", (ev) => {
        const p = ev && ev.points && ev.points[0];
        if (p && p.customdata !== null && p.customdata !== undefined) opts.onPickStep(p.customdata);
      });
    }
  });
  const baseShapes = shapes.slice();
  return {
    setStep(xSeconds) {
      const s = baseShapes.slice();
      if (xSeconds !== null && xSeconds !== undefined) {
        s.push({ type: "line", xref: "x", yref: "paper", x0: xSeconds * 1e3, x1: xSeconds * 1e3, y0: 0, y1: 1, line: { color: "#16a34a", width: 2 } });
      }
      Plotly.relayout(div, { shapes: s });
    },
    destroy() {
      Plotly.purge(div);
    },
  };
}
