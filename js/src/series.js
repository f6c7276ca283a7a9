// Pure helpers for the memory timeline (no Plotly, no DOM).

import { escapePlotly, formatBytes } from "./format.js";

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

/** Index of the largest value (first one on ties); -1 when empty (pure). */
export function argmax(values) {
  let best = -1;
  for (let i = 0; i < values.length; i++) if (best < 0 || values[i] > values[best]) best = i;
  return best;
}

/** Hover text for each timeline point (escaped for Plotly). */
export function hoverTexts(tl) {
  const out = new Array(tl.t.length);
  for (let i = 0; i < tl.t.length; i++) {
    const mod = tl.module[i] ? ` · ${escapePlotly(tl.module[i])}` : "";
    const step = tl.step[i] === null || tl.step[i] === undefined ? "" : ` · step ${tl.step[i]}`;
    out[i] = `${escapePlotly(tl.label[i] || "")}${mod}<br>${formatBytes(tl.live[i])} live · ${tl.phase[i]}${step}`;
  }
  return out;
}
