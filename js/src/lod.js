// Level of detail: which layout to show first, at which scale, how much text a box gets, and
// where "+" zooms. Pure functions, no DOM.
//
// NOTE [ names at first paint ]: text is drawn at a fixed size on screen (11 px), so whether a
// box can carry its name depends only on its size on screen. A node box (150 x 40 world px) holds
// its name and what it holds from scale FULL, its name alone from scale NAMES. The first view
// uses the finest level of detail (every node, then folded by module) at which the whole graph,
// or failing that its full width, shows at FULL (preferring a level at most TALL screens high,
// so a long graph opens as its modules rather than as its first six nodes); then at NAMES; else
// the coarsest level from its top. A level chosen by its width opens whole where that still
// shows names (so a model's loss, at the bottom, is in sight), else from its top. So a graph
// opens with names, folded only when they would not fit.

import { fitView, MAX_SCALE, MIN_SCALE, toScreen, toWorld } from "./viewport.js";

export const FULL = 0.75; // two lines of 11 px text, a 14-character bold name in a 160 px box
export const NAMES = 0.5; // one line: about 11 characters in a 160 px box
export const MAX_FIRST = 1.0; // the first view never magnifies beyond 1:1
export const CHAR_PX = 6.3; // average width of an 11 px system-ui character
export const FONT_PX = 11;
export const TALL = 4; // a first view taller than this many screens prefers a folded level

const clamp = (v, lo, hi) => Math.min(hi, Math.max(lo, v));

/**
 * The view showing the top of `bounds` at `scale`: centred horizontally when it fits; else
 * centred on the topmost box (`bounds.topX`, when known; a wide layered graph often starts in its
 * middle), kept within the drawing; else from the left.
 */
export function topView(bounds, width, height, scale, pad = 20) {
  const bw = Math.max(1, bounds.maxX - bounds.minX);
  let tx;
  if (bw * scale <= width - 2 * pad) tx = (width - bw * scale) / 2 - bounds.minX * scale;
  else if (bounds.topX !== undefined && bounds.topX !== null) {
    tx = width / 2 - bounds.topX * scale;
    tx = Math.min(pad - bounds.minX * scale, Math.max(width - pad - bounds.maxX * scale, tx));
  } else tx = pad - bounds.minX * scale;
  return { scale, tx, ty: pad - bounds.minY * scale };
}

/** Bounds of drawn items with `topX`: the x of the topmost box (leftmost among equals). */
export function boundsWithTop(bounds, items) {
  let best = null;
  for (const it of items) {
    const top = it.y - it.h / 2;
    if (!best || top < best.top - 1e-6 || (Math.abs(top - best.top) <= 1e-6 && it.x < best.x)) best = { top, x: it.x };
  }
  return { ...bounds, topX: best ? best.x : undefined };
}

/**
 * Pick the level of detail and the first view. `levels` are bounds ({minX, minY, maxX, maxY}),
 * finest first. Returns { level, view, labels } where labels is "full" or "names".
 */
export function chooseLevel(levels, width, height, pad = 20) {
  if (!levels.length) return { level: 0, view: { scale: 1, tx: 0, ty: 0 }, labels: "full" };
  for (let i = 0; i < levels.length; i++) {
    const fit = fitView(levels[i], width, height, pad, MAX_FIRST);
    if (fit.scale >= FULL) return { level: i, view: fit, labels: "full" };
  }
  const widthScale = (b) => Math.min(MAX_FIRST, (width - 2 * pad) / Math.max(1, b.maxX - b.minX));
  const screens = (b, s) => ((b.maxY - b.minY) * s) / Math.max(1, height);
  for (const [want, labels] of [
    [FULL, "full"],
    [NAMES, "names"],
  ]) {
    const fits = [];
    for (let i = 0; i < levels.length; i++) if (widthScale(levels[i]) >= want) fits.push(i);
    if (!fits.length) continue;
    // the finest level that is at most TALL screens high; else the finest that fits at all
    const i = fits.find((k) => screens(levels[k], widthScale(levels[k])) <= TALL) ?? fits[0];
    // all of it where names can still be read (the loss at the bottom in sight), else its top
    const whole = fitView(levels[i], width, height, pad, MAX_FIRST);
    if (whole.scale >= NAMES) return { level: i, view: whole, labels: whole.scale >= FULL ? "full" : "names" };
    return { level: i, view: topView(levels[i], width, height, widthScale(levels[i]), pad), labels };
  }
  const last = levels.length - 1;
  return { level: last, view: topView(levels[last], width, height, NAMES, pad), labels: "names" };
}

/**
 * What text a box of world size w x h gets at `scale`: "full" (name and a second line), "name",
 * or "none"; with the number of characters that fit on one line.
 */
export function labelMode(w, h, scale) {
  const sw = w * scale;
  const sh = h * scale;
  const chars = Math.floor((sw - 8) / CHAR_PX);
  if (sh >= 2 * FONT_PX + 4 && chars >= 8) return { mode: "full", chars };
  if (sh >= FONT_PX + 1 && chars >= 5) return { mode: "name", chars };
  return { mode: "none", chars: 0 };
}

/**
 * Where "+" and "−" zoom about, in screen pixels: the selected node when it is on screen,
 * otherwise the point of the drawing nearest the screen's centre (so zooming in never heads for
 * empty space beside a narrow graph).
 */
export function zoomAnchor(view, bounds, width, height, focus = null) {
  if (focus) {
    const s = toScreen(view, focus.x, focus.y);
    if (s.x >= 0 && s.y >= 0 && s.x <= width && s.y <= height) return s;
  }
  const c = toWorld(view, width / 2, height / 2);
  const p = { x: clamp(c.x, bounds.minX, bounds.maxX), y: clamp(c.y, bounds.minY, bounds.maxY) };
  return toScreen(view, p.x, p.y);
}

/** Shorten `text` to `chars` characters with an ellipsis (keeping the end for parameter names). */
export function fitText(text, chars, keepEnd = false) {
  const s = String(text);
  if (chars <= 1) return s.length ? "…" : "";
  if (s.length <= chars) return s;
  return keepEnd ? `…${s.slice(s.length - chars + 1)}` : `${s.slice(0, chars - 1)}…`;
}

/**
 * Shorten a dotted path (a module or parameter name) by dropping leading components until
 * `fits(text)`: "transformer.h.1.ln_2.weight" -> "ln_2.weight", never a word cut in the middle
 * (the frame around a box names what was dropped); a list index goes with its name ("h.1"). A leading "▸ " or "▾ " stays. Texts with
 * spaces (a repeat's "h.0 – h.11 (×12)") are not paths and come back whole.
 */
export function fitPath(text, fits) {
  const s = String(text);
  const mark = /^[▸▾] /.test(s) ? s.slice(0, 2) : "";
  let rest = s.slice(mark.length);
  if (/\s/.test(rest)) return s;
  // a number belongs to the name before it: "h.1" goes as a whole
  const parts = rest.split(".");
  let k = 0;
  while (k < parts.length - 1 && !fits(mark + parts.slice(k).join("."))) {
    k++;
    while (k < parts.length - 1 && /^\d+$/.test(parts[k])) k++;
  }
  return mark + parts.slice(k).join(".");
}

export { MAX_SCALE, MIN_SCALE };
