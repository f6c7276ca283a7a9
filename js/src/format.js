// Formatting helpers shared by the widget and the HTML page. Pure functions, no DOM.

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

/** 1536 -> "1.5 KiB"; exact bytes under 1 KiB; null -> "n/a". Matches gradscope.recording.format_bytes. */
export function formatBytes(n) {
  if (n === null || n === undefined || Number.isNaN(n)) return "n/a";
  const sign = n < 0 ? "-" : "";
  let v = Math.abs(n);
  for (const unit of UNITS) {
    if (v < 1024 || unit === "TiB") {
      return unit === "B" ? `${sign}${Math.trunc(v)} B` : `${sign}${v.toFixed(1)} ${unit}`;
    }
    v /= 1024;
  }
  return "n/a";
}

/** Seconds as a short human figure: 0.0000123 -> "12.3 µs", 0.0123 -> "12.3 ms", 2.5 -> "2.50 s". */
export function formatSeconds(s) {
  if (s === null || s === undefined || Number.isNaN(s)) return "n/a";
  const a = Math.abs(s);
  if (a < 1e-3) return `${(s * 1e6).toFixed(1)} µs`;
  if (a < 1) return `${(s * 1e3).toFixed(1)} ms`;
  return `${s.toFixed(2)} s`;
}

/** A maximum absolute error: exact zero stays "0", others in short scientific notation. */
export function formatError(e) {
  if (e === null || e === undefined) return "n/a";
  if (e === 0) return "0";
  return e.toExponential(2);
}

/**
 * Plotly reads a few HTML-like tags in hover text and labels; user text must reach it as
 * entities so that it shows literally (see NOTE [ text is data ] in app.js).
 */
export function escapePlotly(text) {
  return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

/** Shorten text to at most `max` characters with an ellipsis. */
export function truncate(text, max) {
  const s = String(text);
  if (max <= 1) return s.length > 0 ? "…" : "";
  return s.length > max ? `${s.slice(0, max - 1)}…` : s;
}

/** Shorten text to at most `max` characters keeping its end: "layers.0.self_attn.in_proj_weight" -> "…in_proj_weight". */
export function truncateStart(text, max) {
  const s = String(text);
  if (max <= 1) return s.length > 0 ? "…" : "";
  return s.length > max ? `…${s.slice(s.length - max + 1)}` : s;
}

/** How every view numbers a backward step: from 1 (the data counts from 0), like gradscope.figures.step_number. */
export function stepNumber(index) {
  return index + 1;
}

/** "step 53" for the step at index 52: one numbering for hover, click, slider and text. */
export function stepText(index) {
  return `step ${stepNumber(index)}`;
}

/** A ratio to the reference: 0.1712 -> "0.17×"; null -> "n/a". */
export function formatRatio(r) {
  if (r === null || r === undefined || !Number.isFinite(r)) return "n/a";
  return `${r.toFixed(2)}×`;
}

/** Bytes with at most the decimals needed, for axis ticks: 2097152 -> "2 MiB", 2621440 -> "2.5 MiB". */
export function formatBytesShort(n) {
  if (n === 0) return "0 B";
  let v = Math.abs(n);
  let k = 0;
  while (v >= 1024 && k < UNITS.length - 1) {
    v /= 1024;
    k++;
  }
  const text = Number.isInteger(v) ? String(v) : String(Number(v.toFixed(2)));
  return `${n < 0 ? "-" : ""}${text} ${UNITS[k]}`;
}

/**
 * Axis ticks in binary units from 0 to at least `max`: about `target` ticks at a step of 1, 2 or 5
 * times a power of ten of KiB, MiB or GiB (so "10 MiB" never sits beside an SI "10MB").
 * Returns { vals, text }.
 */
export function binaryTicks(max, target = 5) {
  if (!(max > 0)) return { vals: [0], text: ["0 B"] };
  let unit = 1;
  while (max / unit >= 1024 && unit < 1024 ** 4) unit *= 1024;
  const raw = max / unit / target;
  const mag = 10 ** Math.floor(Math.log10(raw));
  let step = mag;
  for (const m of [1, 2, 2.5, 5, 10]) {
    step = m * mag;
    if (step >= raw) break;
  }
  // a binary unit reads best in steps that divide 1024 when the step is below one unit
  if (unit > 1 && step < 1) {
    const parts = [0.5, 0.25, 0.125, 0.0625];
    step = parts.reverse().find((p) => p >= raw) ?? 0.5;
    if (step < raw) step = 1;
  }
  // every tick in the unit of the largest one: "0.25 MiB … 1.25 MiB", never "768 KiB" beside "1 MiB"
  const name = UNITS[Math.round(Math.log(unit) / Math.log(1024))];
  const label = (k) => (k === 0 ? "0" : `${Number((k * step).toFixed(4))} ${name}`);
  const vals = [];
  const text = [];
  for (let k = 0; k * step * unit <= max * 1.0000001 || vals.length < 2; k++) {
    vals.push(k * step * unit);
    text.push(label(k));
    if (vals.length > 50) break;
  }
  if (vals[vals.length - 1] < max) {
    vals.push(vals.length * step * unit);
    text.push(label(vals.length - 1));
  }
  return { vals, text };
}

/** A time range with one unit when both ends share it: (0.2956, 0.5396) -> "295.6–539.6 ms". */
export function formatSecondsRange(a, b) {
  if (a === null || a === undefined || b === null || b === undefined) return "n/a";
  const fa = formatSeconds(a).split(" ");
  const fb = formatSeconds(b).split(" ");
  return fa[1] === fb[1] ? `${fa[0]}–${fb[0]} ${fb[1]}` : `${fa.join(" ")}–${fb.join(" ")}`;
}
