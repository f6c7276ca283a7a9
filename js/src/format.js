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
