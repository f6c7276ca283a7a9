// Pure helpers for the memory timeline (no Plotly, no DOM).

import { escapePlotly, formatBytes, stepText } from "./format.js";

export const PHASE_COLORS = { forward: "#bfdbfe", backward: "#fde68a", optimizer: "#bbf7d0", other: "#e5e7eb" };

// Bands of memory by category, bottom to top, with their colours.
export const CATEGORY_COLORS = {
  baseline: "#cbd5e1",
  activation: "#f59e0b",
  create_graph: "#8b5cf6",
  gradient: "#10b981",
  optimizer: "#0ea5e9",
  backward_temp: "#f43f5e",
  other: "#94a3b8",
};

/** Contiguous runs of one phase as [phase, x0, x1], each up to the next run's start (pure). */
export function phaseRuns(t, phase) {
  const runs = [];
  if (!t.length) return runs;
  let start = 0;
  for (let i = 1; i <= t.length; i++) {
    if (i === t.length || phase[i] !== phase[start]) {
      // a run lasts until the next one starts, so the shading has no gaps
      runs.push([phase[start], t[start], i < t.length ? t[i] : t[i - 1]]);
      start = i;
    }
  }
  return runs;
}

/**
 * Which phase runs get a label: those at least as wide on screen as their text (about
 * `charPx` per character plus padding), so labels never run into each other. `pxPerUnit`
 * converts the runs' x units to pixels. Returns indexes into `runs`.
 */
export function labelledRuns(runs, pxPerUnit, charPx = 6.5) {
  const out = [];
  let lastRight = -Infinity;
  runs.forEach(([phase, a, b], i) => {
    const w = (b - a) * pxPerUnit;
    const need = phase.length * charPx + 8;
    const mid = ((a + b) / 2) * pxPerUnit;
    if (w >= need && mid - need / 2 >= lastRight) {
      out.push(i);
      lastRight = mid + need / 2;
    }
  });
  return out;
}

/** Index of the largest value (first one on ties); -1 when empty (pure). */
export function argmax(values) {
  let best = -1;
  for (let i = 0; i < values.length; i++) if (best < 0 || values[i] > values[best]) best = i;
  return best;
}

/** x of each point: milliseconds since the first point, or its share of the run (0-100 %). */
export function xValues(t, mode) {
  if (!t.length) return [];
  const t0 = t[0];
  const span = t[t.length - 1] - t0;
  if (mode === "normalized") return t.map((v) => (span > 0 ? ((v - t0) / span) * 100 : 0));
  return t.map((v) => (v - t0) * 1e3);
}

/** The non-zero categories at point i, as [category, bytes] in stacking order. */
export function breakdownAt(tl, i) {
  const out = [];
  tl.categories.forEach((c, k) => {
    const v = tl.byCategory[k][i];
    if (v) out.push([c, v]);
  });
  return out;
}

/**
 * Hover text for each timeline point (escaped for Plotly): what ran, the live bytes, the phase,
 * the step (numbered like the slider, see stepText), and the split by category when known.
 * With `base` (the baseline drawn under the stack) the text starts with the value on the axis
 * and how it adds up, so a hover never names a figure that disagrees with where it is drawn.
 */
export function hoverTexts(tl, labels = {}, base = 0) {
  const out = new Array(tl.t.length);
  const cats = tl.categories && tl.categories.length > 1;
  for (let i = 0; i < tl.t.length; i++) {
    const mod = tl.module[i] ? ` · ${escapePlotly(tl.module[i])}` : "";
    const step = tl.step[i] === null || tl.step[i] === undefined ? "" : ` · ${stepText(tl.step[i])}`;
    const live = base ? `${axisText(tl.live[i], base)}<br>` : `${formatBytes(tl.live[i])} live · `;
    const line = tl.line && tl.line[i] ? `<br>at ${escapePlotly(tl.line[i].label)}` : "";
    let text = `${escapePlotly(tl.label[i] || "")}${mod}${line}<br>${live}${tl.phase[i]}${step}`;
    if (cats) {
      for (const [c, v] of breakdownAt(tl, i)) text += `<br>  ${escapePlotly(labels[c] || c)}: ${formatBytes(v)}`;
    }
    out[i] = text;
  }
  return out;
}

/**
 * A value drawn on top of the baseline, as it reads on the axis: "33.8 MiB on the axis: 9.5 MiB
 * live in the block + 24.2 MiB from before it".
 */
export function axisText(live, base) {
  return `${formatBytes(live + base)} on the axis: ${formatBytes(live)} live in the block + ${formatBytes(base)} from before it`;
}
