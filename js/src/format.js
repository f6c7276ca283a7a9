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

/**
 * Natural order for names with numbers: "G.2" before "G.10" (digit runs compare as numbers,
 * the rest as text). For sorting tied rows the way people count.
 */
export function naturalCompare(a, b) {
  const x = String(a).match(/\d+|\D+/g) || [];
  const y = String(b).match(/\d+|\D+/g) || [];
  for (let i = 0; i < Math.min(x.length, y.length); i++) {
    const p = x[i];
    const q = y[i];
    if (p === q) continue;
    const dp = /^\d/.test(p);
    const dq = /^\d/.test(q);
    if (dp && dq) {
      const d = Number(p) - Number(q);
      if (d !== 0) return d < 0 ? -1 : 1;
      if (p.length !== q.length) return p.length < q.length ? -1 : 1; // "01" after "1"
    }
    return p < q ? -1 : 1;
  }
  return x.length - y.length;
}

/**
 * NOTE [ names wrap at their joints ]: a narrow panel wraps names where they join ("G.0." |
 * "weight", "_saved_" | "mat2", "parameter " | "(G.0.weight)"), never inside a word. Returns the
 * pieces of `text` to put on one line each at most: split after ".", "_", "/", ":", ",", "-"
 * and spaces (a run of separators stays with the word before it; leading ones with the first). A piece longer than `max`
 * characters (a 300-character name with no joint) is cut into `max`-character pieces: it could
 * not fit on one line anyway.
 */
export function wrapPieces(text, max = 24) {
  const s = String(text);
  const out = [];
  // a piece: leading separators ("_saved"), a word, the separators after it ("_saved_", "G.")
  for (const piece of s.match(/[._/:,\s-]*[^._/:,\s-]*[._/:,\s-]*/g) || []) {
    if (!piece) continue;
    const chars = Array.from(piece); // an emoji is one character
    for (let i = 0; i < chars.length; i += max) out.push(chars.slice(i, i + max).join(""));
  }
  return out.length ? out : [s];
}

/**
 * What a comparison shows, in two sentences for its first screen (pure; `p` is the comparison
 * payload of gradscope.widget.comparison_payload):
 *   winner: the ok, current candidate with the lowest peak, against the reference, with its
 *     error and time; then the candidates that are wrong or raised;
 *   holder: what memory was made of at the peak of the reference (else of the highest peak),
 *     largest first.
 * Either is null when the data cannot say it.
 */
export function comparisonHeadline(p) {
  const rows = p.rows || [];
  const ref = rows.find((r) => r.name === p.reference) || null;
  const ok = rows.filter((r) => r.status === "ok" && !r.stale && typeof r.peak_bytes === "number");
  let winner = null;
  if (ok.length) {
    const best = ok.reduce((a, b) => (b.peak_bytes < a.peak_bytes ? b : a));
    if (ref && best.name !== ref.name && typeof ref.peak_bytes === "number") {
      const same = best.max_abs_error === 0 ? "same result (max abs error 0)" : `same result within tolerance (max abs error ${formatError(best.max_abs_error)})`;
      const time = best.time_ratio === null || best.time_ratio === undefined ? "" : `, time ${formatRatio(best.time_ratio)}`;
      winner = `Lowest peak: ${best.name}, ${formatBytes(best.peak_bytes)} at once instead of ${ref.name}'s ${formatBytes(ref.peak_bytes)} (${formatRatio(best.peak_ratio)}), ${same}${time}.`;
    } else {
      winner = `Lowest peak: ${best.name}${ref && best.name === ref.name ? " (the reference)" : ""}, ${formatBytes(best.peak_bytes)} at once.`;
    }
  }
  const bad = rows.filter((r) => r.status !== "ok");
  if (bad.length) {
    const text = bad.map((r) => `${r.name} is ${r.status}${r.message ? ` (${r.message})` : ""}`).join("; ");
    winner = `${winner ? `${winner} ` : ""}Not usable: ${text}.`;
  }
  let holder = null;
  const recs = p.recordings || [];
  let k = ref ? rows.indexOf(ref) : -1;
  if (k < 0 || !recs[k] || !recs[k].peak) {
    k = -1;
    rows.forEach((r, i) => {
      if (recs[i] && recs[i].peak && (k < 0 || recs[i].peak.bytes > recs[k].peak.bytes)) k = i;
    });
  }
  if (k >= 0) {
    const peak = recs[k].peak;
    const labels = recs[k].category_labels || {};
    const parts = Object.entries(peak.breakdown || {})
      .filter(([, b]) => b > 0)
      .sort((a, b) => b[1] - a[1])
      .map(([c, b]) => `${labels[c] || c} ${formatBytes(b)}`);
    const base = (recs[k].summary || {}).baseline_bytes || 0;
    const before = base ? `, on top of ${formatBytes(base)} of parameters and inputs from before` : "";
    holder = parts.length
      ? `What holds memory at ${rows[k].name}'s peak (${formatBytes(peak.bytes)} in the block${before}): ${parts.join(" · ")}.`
      : `${rows[k].name}'s peak: ${formatBytes(peak.bytes)} in the block${before}.`;
  }
  return { winner, holder };
}
