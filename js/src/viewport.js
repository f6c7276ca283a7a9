// Pan and zoom maths: a view is { scale, tx, ty } with screen = world * scale + t. Pure.

export const MIN_SCALE = 0.002;
export const MAX_SCALE = 4;

const clamp = (v, lo, hi) => Math.min(hi, Math.max(lo, v));

/** The view that shows `bounds` inside a width x height screen with `pad` pixels around. */
export function fitView(bounds, width, height, pad = 20, maxScale = 1.5) {
  const bw = Math.max(1, bounds.maxX - bounds.minX);
  const bh = Math.max(1, bounds.maxY - bounds.minY);
  const sx = (width - 2 * pad) / bw;
  const sy = (height - 2 * pad) / bh;
  const scale = clamp(Math.min(sx, sy), MIN_SCALE, maxScale);
  const tx = (width - bw * scale) / 2 - bounds.minX * scale;
  const ty = (height - bh * scale) / 2 - bounds.minY * scale;
  return { scale, tx, ty };
}

/**
 * A readable first view: fit the whole drawing when that keeps labels legible (scale >= `legible`);
 * otherwise fit the width (up to `readable` scale) and show the top, so a long thin graph opens
 * legible, not as a speck.
 */
export function initialView(bounds, width, height, pad = 20, readable = 0.9, legible = 0.6) {
  const fit = fitView(bounds, width, height, pad, 1.2);
  if (fit.scale >= legible) return fit;
  const bw = Math.max(1, bounds.maxX - bounds.minX);
  const scale = clamp(Math.min(readable, (width - 2 * pad) / bw), MIN_SCALE, MAX_SCALE);
  if (scale <= fit.scale) return fit;
  return { scale, tx: (width - bw * scale) / 2 - bounds.minX * scale, ty: pad - bounds.minY * scale };
}

/** Zoom by `factor` keeping the screen point (sx, sy) fixed. */
export function zoomAt(view, factor, sx, sy) {
  const scale = clamp(view.scale * factor, MIN_SCALE, MAX_SCALE);
  const k = scale / view.scale;
  return { scale, tx: sx - (sx - view.tx) * k, ty: sy - (sy - view.ty) * k };
}

/** Move the view by (dx, dy) screen pixels. */
export function panBy(view, dx, dy) {
  return { scale: view.scale, tx: view.tx + dx, ty: view.ty + dy };
}

export function toWorld(view, sx, sy) {
  return { x: (sx - view.tx) / view.scale, y: (sy - view.ty) / view.scale };
}

export function toScreen(view, wx, wy) {
  return { x: wx * view.scale + view.tx, y: wy * view.scale + view.ty };
}

/** Centre `(wx, wy)` in a width x height screen, keeping the scale. */
export function centerOn(view, wx, wy, width, height) {
  return { scale: view.scale, tx: width / 2 - wx * view.scale, ty: height / 2 - wy * view.scale };
}

/**
 * The item under world point (wx, wy): nodes and collapsed groups anywhere in their box,
 * frames only on their header band (`header` pixels tall). Later items win. -1 when none.
 */
export function hitTest(items, wx, wy, header = 22) {
  for (let i = items.length - 1; i >= 0; i--) {
    const it = items[i];
    const left = it.x - it.w / 2;
    const top = it.y - it.h / 2;
    if (wx < left || wx > left + it.w || wy < top) continue;
    const limit = it.kind === "frame" ? top + header : top + it.h;
    if (wy <= limit) return i;
  }
  return -1;
}
