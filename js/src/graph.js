// The autograd graph on a canvas: pan (drag), zoom (wheel, buttons), click a node to select it,
// click a module box to expand it and a module frame's header to collapse it. A canvas draws
// 20,000 boxes in a few tens of milliseconds where SVG needs seconds.
//
// Boxes carry their name and what they hold (bytes of saved activations, largest saved shape),
// drawn at a fixed size on screen whenever the box is big enough (see NOTE [ names at first
// paint ] in lod.js). Arrows point the way data flows; the colour is the memory a node's saved
// activations take (memory allocated in the block); parameters and inputs are drawn as leaves
// outside that scale, since they existed before the block.

import { COLORS, bytesColor, orderStroke, textOn } from "./color.js";
import { ancestors, autoOpen, boxCount, descendants, visibleLayout } from "./collapse.js";
import { nodeLabel } from "./data.js";
import { h } from "./dom.js";
import { formatBytes } from "./format.js";
import { boundsWithTop, chooseLevel, FONT_PX, fitPath, fitText, labelMode, topView, NAMES } from "./lod.js";

const MIN_SHRINK = 0.8; // a label is drawn at most this much smaller before it is cut
import { centerOn, fitView, hitTest, panBy, toScreen, toWorld, zoomAt } from "./viewport.js";

const ARROW_PX = 7; // arrowhead length on screen
const FONT_FAMILY = "system-ui, -apple-system, Segoe UI, sans-serif";
const EDGE_UP = "#b9a3e3"; // edges into create_graph nodes (drawn upwards)

function maxOf(values) {
  let m = 1;
  for (const v of values) if (v > m) m = v;
  return m;
}

/** "64 × 512" -> "64×512": shapes take less room inside a box. */
export function compactShape(shape) {
  return String(shape).replace(/ × /g, "×");
}

/** The second line of a node box: what it holds. */
export function nodeDetail(node) {
  if (node.leaf) {
    const what = node.leaf === "input" ? "input" : "parameter";
    return node.leafShape ? `${what} · ${compactShape(node.leafShape)}` : what;
  }
  if (node.actBytes > 0) return node.largest ? `${formatBytes(node.actBytes)} · ${compactShape(node.largest)}` : formatBytes(node.actBytes);
  if (node.savedCount > 0) return `0 B new · saves ${node.largestKind || "a tensor"}`;
  return "saves nothing";
}

/** Where an edge from box a to box b starts and ends: borders facing each other. */
export function edgeEnds(a, b) {
  if (b.y - b.h / 2 >= a.y + a.h / 2) return [a.x, a.y + a.h / 2, b.x, b.y - b.h / 2]; // downwards
  if (b.y + b.h / 2 <= a.y - a.h / 2) return [a.x, a.y - a.h / 2, b.x, b.y + b.h / 2]; // upwards
  return b.x >= a.x ? [a.x + a.w / 2, a.y, b.x - b.w / 2, b.y] : [a.x - a.w / 2, a.y, b.x + b.w / 2, b.y];
}

export class GraphView {
  /**
   * @param {HTMLElement} parent where the canvas goes
   * @param {object} rec a decoded recording (data.js)
   * @param {{onSelect?: Function, onExpand?: Function, onLevel?: Function}} hooks
   */
  constructor(parent, rec, hooks = {}) {
    this.rec = rec;
    this.hooks = hooks;
    this.levelIndex = rec.level;
    this.layout = rec.levels[this.levelIndex];
    this.expanded = this.layout ? autoOpen(this.layout) : new Set();
    this.selected = -1;
    this.current = -1;
    this.releaseStep = null;
    this.stepIndex = -1;
    this.maxBytes = maxOf(rec.nodes.map((n) => n.actBytes));
    this.wrap = h("div", { class: "gs-graph" });
    this.canvas = h("canvas", { class: "gs-canvas", tabindex: "0", "aria-label": "autograd graph" });
    this.wrap.appendChild(this.canvas);
    this.tip = h("div", { class: "gs-tip", role: "tooltip" });
    this.tip.style.display = "none";
    this.wrap.appendChild(this.tip);
    parent.appendChild(this.wrap);
    this.ctx = this.canvas.getContext("2d");
    this.view = { scale: 1, tx: 0, ty: 0 };
    this.width = 0;
    this.height = 0;
    this._frame = 0;
    this._pointer = null;
    this._widths = new Map();
    this._measure = document.createElement("canvas").getContext("2d");
    this._relayout();
    this._bind();
    // Test and automation hooks: where a node is on screen, in client pixels.
    this.canvas.gsNodeCenter = (id) => this.nodeClientCenter(id);
    this.canvas.gsGroupCenter = (key) => this.groupClientCenter(key);
    this.canvas.gsView = () => ({ ...this.view, level: this.levelIndex, width: this.width, height: this.height });
    // what the last frame drew for a node (its text lines and fill), for tests
    this.canvas.gsNodeDrawn = (id) => this._drawn.get(id) || null;
    this._drawn = new Map();
    this._drawnGroups = new Map();
    // every drawn box: kind, key, label, the text drawn, its rectangle in client pixels
    this.canvas.gsBoxes = () => this.drawnBoxes();
    this.resize();
  }

  _groupFigures() {
    const G = this.layout.groups;
    const n = G.key.length;
    this.groupAct = G.act || new Array(n).fill(0);
    this.groupAlive = G.alive || null;
    this.maxGroupBytes = maxOf(this.groupAct);
  }

  _relayout() {
    this._groupFigures();
    this.vis = visibleLayout(this.layout, this.rec.edges, this.expanded);
    const ds = this.wrap.dataset;
    ds.nodeCount = String(this.rec.nodes.length);
    ds.visibleCount = String(boxCount(this.vis.items));
    ds.groupCount = String(this.layout.groups.key.length);
    ds.expandedCount = String(this.expanded.size);
    ds.level = String(this.levelIndex);
    ds.depth = this.layout.depth === null || this.layout.depth === undefined ? "" : String(this.layout.depth);
  }

  /** Show level of detail `i` (0 = the finest) and fit it as at first paint. */
  setLevel(i, fit = true) {
    if (i < 0 || i >= this.rec.levels.length) return;
    this.levelIndex = i;
    this.layout = this.rec.levels[i];
    this._levelChosen = true;
    this._pinned = true; // the user's choice survives resizes
    this.expanded = autoOpen(this.layout);
    this._relayout();
    this.hooks.onLevel?.(i);
    if (fit) this.fit();
    else this.draw();
  }

  _bind() {
    const c = this.canvas;
    let drag = null;
    const onDown = (e) => {
      drag = { x: e.clientX, y: e.clientY, moved: 0 };
      c.setPointerCapture?.(e.pointerId);
    };
    const onMove = (e) => {
      this._pointer = { x: e.clientX, y: e.clientY };
      if (!drag) {
        this._hover();
        return;
      }
      const dx = e.clientX - drag.x;
      const dy = e.clientY - drag.y;
      drag.moved += Math.abs(dx) + Math.abs(dy);
      drag.x = e.clientX;
      drag.y = e.clientY;
      if (drag.moved > 3) {
        this.touched = true;
        this.view = panBy(this.view, dx, dy);
        this.draw();
      }
    };
    const onUp = (e) => {
      const d = drag;
      drag = null;
      if (d && d.moved <= 3) this._click(e);
    };
    const onWheel = (e) => {
      e.preventDefault();
      this.touched = true;
      const r = c.getBoundingClientRect();
      this.view = zoomAt(this.view, Math.exp(-e.deltaY * 0.0015), e.clientX - r.left, e.clientY - r.top);
      this.draw();
    };
    const onLeave = () => {
      this._pointer = null;
      this.tip.style.display = "none";
    };
    c.addEventListener("pointerleave", onLeave);
    c.addEventListener("pointerdown", onDown);
    c.addEventListener("pointermove", onMove);
    c.addEventListener("pointerup", onUp);
    c.addEventListener("wheel", onWheel, { passive: false });
    this._ro = typeof ResizeObserver !== "undefined" ? new ResizeObserver(() => this.resize()) : null;
    this._ro?.observe(this.wrap);
    this._unbind = () => {
      c.removeEventListener("pointerleave", onLeave);
      c.removeEventListener("pointerdown", onDown);
      c.removeEventListener("pointermove", onMove);
      c.removeEventListener("pointerup", onUp);
      c.removeEventListener("wheel", onWheel);
      this._ro?.disconnect();
    };
  }

  /** Tooltip text for a visible item (text only, see NOTE [ text is data ]). */
  tipText(it) {
    const F = this.rec.figures;
    const def = (name) => (F[name] ? F[name].definition : "");
    if (it.kind === "node") {
      const n = this.rec.nodes[it.id];
      const lines = [`${n.name} #${n.id}`];
      if (n.leaf) lines.push(`${n.leaf === "input" ? "input" : "parameter"} ${n.leaf}${n.leafShape ? ` (${n.leafShape})` : ""}: existed before the block`);
      lines.push(`module ${n.module ?? "(none)"}`);
      if (n.line) lines.push(`line ${n.line.label}`);
      if (!n.leaf) {
        lines.push(`saved activations: ${formatBytes(n.actBytes)}${n.largest && n.actBytes > 0 ? `, largest ${n.largest}` : ""}`);
        const others = n.savedBytes - n.actBytes;
        if (n.savedCount) lines.push(`${n.savedCount} saved tensor${n.savedCount === 1 ? "" : "s"}${others > 0 ? ` (${formatBytes(others)} of them parameters or inputs: no new memory)` : ""}`);
        else lines.push("saved nothing");
      }
      if (n.alive !== null && n.alive > 0) lines.push(`alive at peak: ${formatBytes(n.alive)}`);
      if (!n.leaf) lines.push(`(saved activations: ${def("saved_activations")})`);
      return lines.join("\n");
    }
    const G = this.layout.groups;
    const g = it.id;
    const open = this.expanded.has(g);
    const rep = G.repeat ? G.repeat[g] : 1;
    const lines = [rep > 1 ? `${rep} blocks of one structure: ${G.key[g]}` : `module ${G.key[g]}`, `${G.count[g]} nodes`, `saved activations: ${formatBytes(this.groupAct[g])}`];
    if (this.groupAlive) lines.push(`alive at peak: ${formatBytes(this.groupAlive[g])}`);
    lines.push(open ? "open: click the header to fold it" : "folded: click to open");
    lines.push(`(saved activations: ${def("saved_activations")})`);
    if (this.groupAlive) lines.push(`(alive at peak: ${def("alive_at_peak")})`);
    return lines.join("\n");
  }

  /** A tooltip naming what is under the pointer; refreshed after a click changes the drawing. */
  _hover() {
    const p = this._pointer;
    if (!p) return;
    const r = this.canvas.getBoundingClientRect();
    const sx = p.x - r.left;
    const sy = p.y - r.top;
    const w = toWorld(this.view, sx, sy);
    const i = hitTest(this.vis.items, w.x, w.y);
    const it = i >= 0 ? this.vis.items[i] : null;
    if (!it) {
      this.tip.style.display = "none";
      return;
    }
    this.tip.textContent = this.tipText(it);
    this.tip.style.display = "block";
    this.tip.style.left = `${Math.min(sx + 14, Math.max(0, this.width - 340))}px`;
    this.tip.style.top = `${Math.min(sy + 14, Math.max(0, this.height - 120))}px`;
  }

  _click(e) {
    const r = this.canvas.getBoundingClientRect();
    const w = toWorld(this.view, e.clientX - r.left, e.clientY - r.top);
    const i = hitTest(this.vis.items, w.x, w.y);
    if (i < 0) return;
    const it = this.vis.items[i];
    if (it.kind === "node") {
      this.select(it.id);
      this.hooks.onSelect?.(it.id);
    } else if (it.kind === "group") {
      this.toggleGroup(it.id, true);
    } else if (it.kind === "frame") {
      this.toggleGroup(it.id, false);
    }
    this._hover();
  }

  /** Expand (open=true) or collapse a module group, keeping it where it is on screen. */
  toggleGroup(g, open) {
    this.touched = true;
    this._userOpened = true;
    const before = this.vis.items[this._itemOfGroup(g)];
    if (open) for (const a of ancestors(this.layout, g)) this.expanded.add(a);
    else for (const d of descendants(this.layout, g)) this.expanded.delete(d);
    this._relayout();
    const after = this.vis.items[this._itemOfGroup(g)];
    if (open && after) {
      // show the opened module: all of it when names fit, else its top with names
      const b = { minX: after.x - after.w / 2, minY: after.y - after.h / 2, maxX: after.x + after.w / 2, maxY: after.y + after.h / 2 };
      this.view = chooseLevel([b], this.width, this.height).view;
    } else if (before && after) {
      const topBefore = before.y - before.h / 2;
      const topAfter = after.y - after.h / 2;
      this.view = panBy(this.view, (before.x - after.x) * this.view.scale, (topBefore - topAfter) * this.view.scale);
    }
    this.hooks.onExpand?.([...this.expanded]);
    this.draw();
  }

  expandAll() {
    this._userOpened = true;
    for (let g = 0; g < this.layout.groups.key.length; g++) this.expanded.add(g);
    this._relayout();
    this.fit();
  }

  collapseAll() {
    this._userOpened = true;
    this.expanded = new Set();
    this._relayout();
    this.fit();
  }

  _itemOfGroup(g) {
    const items = this.vis.items;
    for (let i = 0; i < items.length; i++) if (items[i].kind !== "node" && items[i].id === g) return i;
    return -1;
  }

  select(id) {
    this.selected = id;
    this.draw();
  }

  /** Show backward step state: the node running and which saves are released. */
  setStep(state, releaseStep) {
    this.current = state ? state.node : -1;
    this.stepIndex = state ? state.index : -1;
    this.releaseStep = releaseStep;
    this.draw();
  }

  /** Centre the view on a node (expanding nothing): used when stepping. */
  reveal(id) {
    const it = this.vis.items[this.vis.itemOfNode[id]];
    if (!it) return;
    const s = toScreen(this.view, it.x, it.y);
    if (s.x < 0 || s.y < 0 || s.x > this.width || s.y > this.height) {
      this.view = centerOn(this.view, it.x, it.y, this.width, this.height);
      this.touched = true;
    }
  }

  /** Centre the view on a node at a scale where its name shows. */
  focusNode(id) {
    const it = this.vis.items[this.vis.itemOfNode[id]];
    if (!it) return;
    const scale = Math.max(this.view.scale, 0.9);
    this.view = centerOn({ scale, tx: 0, ty: 0 }, it.x, it.y, this.width, this.height);
    this.touched = true;
    this.draw();
  }

  /** The selected (or running) node's centre in world coordinates, when it is drawn. */
  focusPoint() {
    const id = this.selected >= 0 ? this.selected : this.current;
    if (id < 0) return null;
    const it = this.vis.items[this.vis.itemOfNode[id]];
    return it ? { x: it.x, y: it.y } : null;
  }

  nodeClientCenter(id) {
    const it = this.vis.items[this.vis.itemOfNode[id]];
    if (!it) return null;
    return this._client(it);
  }

  groupClientCenter(key) {
    const g = this.layout.groups.key.indexOf(key);
    const i = g < 0 ? -1 : this._itemOfGroup(g);
    if (i < 0) return null;
    const it = this.vis.items[i];
    return it.kind === "frame" ? this._client({ x: it.x, y: it.y - it.h / 2 + 8 }) : this._client(it);
  }

  /** Every drawn box (nodes, folded boxes, frames) with its text and client rectangle (tests). */
  drawnBoxes() {
    const r = this.canvas.getBoundingClientRect();
    const G = this.layout.groups;
    return this.vis.items.map((it) => {
      const a = toScreen(this.view, it.x - it.w / 2, it.y - it.h / 2);
      const b = toScreen(this.view, it.x + it.w / 2, it.y + it.h / 2);
      const group = it.kind !== "node";
      const drawn = group ? this._drawnGroups.get(it.id) : this._drawn.get(it.id);
      return {
        kind: it.kind,
        id: it.id,
        key: group ? G.key[it.id] : null,
        label: group ? (G.label || G.key)[it.id] : null,
        parent: group && G.parent ? G.parent[it.id] : -1,
        repeat: group && G.repeat ? G.repeat[it.id] : 1,
        lines: drawn ? drawn.lines : [],
        left: r.left + a.x,
        top: r.top + a.y,
        right: r.left + b.x,
        bottom: r.top + b.y,
      };
    });
  }

  _client(it) {
    const r = this.canvas.getBoundingClientRect();
    const s = toScreen(this.view, it.x, it.y);
    return { x: r.left + s.x, y: r.top + s.y, visible: s.x >= 0 && s.y >= 0 && s.x <= this.width && s.y <= this.height };
  }

  /** The first view: the finest level of detail whose names fit (see NOTE [ names at first paint ]). */
  firstView() {
    if (!this._userOpened && !this._levelChosen) {
      this._levelChosen = true;
      const bounds = this.rec.levels.map((lv, i) => {
        const vis = i === this.levelIndex ? this.vis : visibleLayout(lv, this.rec.edges, autoOpen(lv));
        return boundsWithTop(vis.bounds, vis.items);
      });
      const pick = chooseLevel(bounds, this.width, this.height);
      if (pick.level !== this.levelIndex) {
        this.levelIndex = pick.level;
        this.layout = this.rec.levels[pick.level];
        this.expanded = autoOpen(this.layout);
        this._relayout();
        this.hooks.onLevel?.(pick.level);
      }
      this.view = pick.view;
      return;
    }
    this.view = chooseLevel([boundsWithTop(this.vis.bounds, this.vis.items)], this.width, this.height).view;
  }

  /** Show the whole graph when names fit, else its top with names. */
  fit() {
    this.view = chooseLevel([boundsWithTop(this.vis.bounds, this.vis.items)], this.width, this.height).view;
    this.draw();
  }

  /**
   * Show the whole graph, at the largest scale that shows all of it. Where that is too small for
   * names, say so and why over the picture (NOTE [ names at first paint ] in lod.js), with what
   * would show names; the note goes with the next change of view.
   */
  fitAll() {
    this.view = fitView(this.vis.bounds, this.width, this.height, 20, 1.2);
    const b = this.vis.bounds;
    const legible = this.view.scale >= NAMES;
    this.wrap.dataset.whole = legible ? "names" : "too-small";
    this._wholeView = this.view;
    if (this.note) this.note.style.display = "none";
    if (!legible) {
      const boxes = boxCount(this.vis.items);
      const smaller =
        this.layout.groups.key.length > 0 && this.expanded.size > 0
          ? "; Fold all makes it smaller"
          : this.levelIndex < this.rec.levels.length - 1
            ? "; show: modules folded makes it smaller"
            : "";
      this._showNote(
        `Whole graph: ${boxes} boxes, ${Math.round(b.maxX - b.minX)} × ${Math.round(b.maxY - b.minY)} px, shown at ` +
          `${Math.max(1, Math.round(this.view.scale * 100))}% of their size: too small for names (they need ` +
          `${Math.round(NAMES * 100)}%). Fit shows it from the top with names${smaller}.`,
      );
    }
    this.draw();
  }

  _showNote(text) {
    if (!this.note) {
      this.note = h("div", { class: "gs-graph-note", role: "status" });
      this.wrap.appendChild(this.note);
    }
    this.note.textContent = text;
    this.note.style.display = "";
  }

  /** The top of the drawing at a scale where names show. */
  top() {
    this.view = topView(this.vis.bounds, this.width, this.height, Math.max(NAMES, Math.min(1, this.view.scale)));
    this.draw();
  }

  resize() {
    const r = this.wrap.getBoundingClientRect();
    if (r.width < 2 || r.height < 2) return; // not attached or hidden yet: the observer calls again
    const w = Math.round(r.width);
    const hgt = Math.round(r.height);
    if (w === this.width && hgt === this.height) return;
    const first = this.width === 0;
    this.width = w;
    this.height = hgt;
    const dpr = window.devicePixelRatio || 1;
    this.canvas.width = Math.round(w * dpr);
    this.canvas.height = Math.round(hgt * dpr);
    this.canvas.style.width = `${w}px`;
    this.canvas.style.height = `${hgt}px`;
    // until the user pans or zooms, keep a readable first view as the panel settles
    if (first || !this.touched) {
      if (!this.touched && !this._pinned) this._levelChosen = false;
      this.firstView();
      this.draw();
    } else this.draw();
  }

  _drawEdges(ctx, w0, w1, scale) {
    const items = this.vis.items;
    const nodes = this.rec.nodes;
    const E = this.vis.edges;
    const head = ARROW_PX / scale;
    const half = head * 0.45;
    const showHeads = ARROW_PX / scale < 40; // arrowheads vanish only when boxes are specks
    const paths = [new Path2D(), new Path2D()];
    const heads = [new Path2D(), new Path2D()];
    let arrows = 0;
    for (let k = 0; k < E.length; k += 2) {
      const a = items[E[k]];
      const b = items[E[k + 1]];
      const [ax, ay, bx, by] = edgeEnds(a, b);
      if ((ax < w0.x && bx < w0.x) || (ax > w1.x && bx > w1.x) || (ay < w0.y && by < w0.y) || (ay > w1.y && by > w1.y)) continue;
      const up = b.kind === "node" && nodes[b.id].order % 2 === 1 ? 1 : 0;
      paths[up].moveTo(ax, ay);
      paths[up].lineTo(bx, by);
      if (showHeads) {
        const dx = bx - ax;
        const dy = by - ay;
        const len = Math.hypot(dx, dy) || 1;
        const ux = dx / len;
        const uy = dy / len;
        const hx = bx - ux * head;
        const hy = by - uy * head;
        heads[up].moveTo(bx, by);
        heads[up].lineTo(hx - uy * half, hy + ux * half);
        heads[up].lineTo(hx + uy * half, hy - ux * half);
        heads[up].closePath();
        arrows++;
      }
    }
    ctx.lineWidth = 1.2 / scale;
    [COLORS.edge, EDGE_UP].forEach((color, i) => {
      ctx.strokeStyle = color;
      ctx.stroke(paths[i]);
      ctx.fillStyle = color === COLORS.edge ? "#7b8794" : "#8b6cc9";
      ctx.fill(heads[i]);
    });
    this.wrap.dataset.arrows = String(arrows);
  }

  /** Width in screen pixels of `text` at the label size (measured once per text and style). */
  _width(text, style) {
    const key = `${style}\u0000${text}`;
    let w = this._widths.get(key);
    if (w === undefined) {
      const m = this._measure;
      m.font = `${style}${FONT_PX}px ${FONT_FAMILY}`;
      w = m.measureText(text).width;
      this._widths.set(key, w);
    }
    return w;
  }

  /** Draw `text` centred at (x, y) within `availPx` screen pixels: a name a little too wide is
   * drawn up to a fifth smaller rather than cut ("TanhBackwardBackward0" whole); a longer one is cut
   * with an ellipsis. */
  _text(ctx, text, x, y, scale, availPx, opts = {}) {
    const style = `${opts.italic ? "italic " : ""}${opts.bold ? "600 " : ""}`;
    let t = String(text);
    let w = this._width(t, style);
    let shrink = 1;
    if (w > availPx && !opts.path && w * MIN_SHRINK <= availPx) {
      shrink = availPx / w;
      w = availPx;
    }
    if (w > availPx && opts.path) {
      // a dotted path loses its leading components, never a cut word (the frame names them)
      t = fitPath(String(text), (s) => this._width(s, style) <= availPx);
      w = this._width(t, style);
    }
    if (w > availPx) {
      const base = t;
      let n = Math.max(1, Math.floor((t.length * availPx) / w));
      do {
        t = fitText(base, n, !!opts.keepEnd);
        w = this._width(t, style);
        n--;
      } while (w > availPx && n > 1);
    }
    ctx.font = `${style}${(FONT_PX * shrink) / scale}px ${FONT_FAMILY}`;
    ctx.fillText(t, x, y);
    return t;
  }

  draw() {
    if (this._wholeView && this._wholeView !== this.view) {
      // what Whole graph said was about its view: gone with any other
      if (this.note) this.note.style.display = "none";
      this._wholeView = null;
      delete this.wrap.dataset.whole;
    }
    const ctx = this.ctx;
    const dpr = window.devicePixelRatio || 1;
    const { scale, tx, ty } = this.view;
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, this.canvas.width, this.canvas.height);
    ctx.setTransform(dpr * scale, 0, 0, dpr * scale, dpr * tx, dpr * ty);
    const w0 = toWorld(this.view, 0, 0);
    const w1 = toWorld(this.view, this.width, this.height);
    const inView = (it) =>
      it.x + it.w / 2 >= w0.x && it.x - it.w / 2 <= w1.x && it.y + it.h / 2 >= w0.y && it.y - it.h / 2 <= w1.y;
    const items = this.vis.items;
    const nodes = this.rec.nodes;
    const px = 1 / scale;
    const line = FONT_PX / scale; // one line of text, in world units
    this._drawn.clear();
    this._drawnGroups.clear();

    this._drawEdges(ctx, w0, w1, scale);

    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    const keys = this.layout.groups.label || this.layout.groups.key;
    const counts = this.layout.groups.count;
    let labelled = 0;
    for (let i = 0; i < items.length; i++) {
      const it = items[i];
      if (!inView(it)) continue;
      const left = it.x - it.w / 2;
      const top = it.y - it.h / 2;
      if (it.kind === "frame") {
        ctx.setLineDash([6, 4]);
        ctx.strokeStyle = "#7b8794";
        ctx.lineWidth = Math.max(px, 1.5);
        ctx.fillStyle = "rgba(240,244,248,0.55)";
        ctx.fillRect(left, top, it.w, it.h);
        ctx.strokeRect(left, top, it.w, it.h);
        ctx.setLineDash([]);
        ctx.fillStyle = "#e4e7eb";
        const band = Math.max(22, line + 8 * px);
        ctx.fillRect(left, top, it.w, band);
        const lm = labelMode(it.w, 22, scale);
        if (lm.mode !== "none" || it.w * scale > 60) {
          ctx.fillStyle = COLORS.text;
          ctx.textAlign = "left";
          const head = this._text(ctx, `▾ ${keys[it.id]} · ${counts[it.id]} nodes`, left + 6 * px, top + band / 2, scale, it.w * scale - 12, { bold: true });
          this._drawnGroups.set(it.id, { lines: [head], kind: "frame" });
          ctx.textAlign = "center";
        }
        continue;
      }
      if (it.kind === "group") {
        const active = this.current >= 0 && this.layout.group[this.current] === it.id && !this.expanded.has(it.id);
        const fill = bytesColor(this.groupAct[it.id], this.maxGroupBytes);
        ctx.fillStyle = fill;
        ctx.fillRect(left, top, it.w, it.h);
        ctx.strokeStyle = active ? COLORS.current : COLORS.border;
        ctx.lineWidth = active ? 4 * Math.max(px, 1) : Math.max(px, 1.5);
        ctx.strokeRect(left, top, it.w, it.h);
        ctx.strokeRect(left + 3, top + 3, it.w - 6, it.h - 6);
        const lm = labelMode(it.w, it.h, scale);
        if (lm.mode !== "none") {
          labelled++;
          ctx.fillStyle = textOn(fill);
          const avail = it.w * scale - 10;
          const name = `▸ ${keys[it.id]}`;
          if (lm.mode === "full") {
            const a = this._text(ctx, name, it.x, it.y - line * 0.6, scale, avail, { bold: true, path: true });
            const b = this._text(ctx, `${counts[it.id]} nodes · ${formatBytes(this.groupAct[it.id])} saved`, it.x, it.y + line * 0.6, scale, avail);
            this._drawnGroups.set(it.id, { lines: [a, b], kind: "group" });
          } else {
            this._drawnGroups.set(it.id, { lines: [this._text(ctx, name, it.x, it.y, scale, avail, { bold: true, path: true })], kind: "group" });
          }
        }
        continue;
      }
      const node = nodes[it.id];
      const released = this.releaseStep && this.stepIndex >= 0 && this.releaseStep[it.id] >= 0 && this.releaseStep[it.id] <= this.stepIndex;
      ctx.globalAlpha = released ? 0.35 : 1;
      const fill = node.leaf ? COLORS.leaf : bytesColor(node.actBytes, this.maxBytes);
      ctx.fillStyle = fill;
      ctx.fillRect(left, top, it.w, it.h);
      const st = orderStroke(node.order);
      ctx.setLineDash(st.dash.map((d) => d * Math.max(1, px)));
      ctx.strokeStyle = st.color;
      ctx.lineWidth = Math.max(px, st.width);
      ctx.strokeRect(left, top, it.w, it.h);
      ctx.setLineDash([]);
      const lm = labelMode(it.w, it.h, scale);
      if (lm.mode !== "none") {
        labelled++;
        ctx.fillStyle = textOn(fill);
        // parameter names keep their end (the module path is what the frame already says)
        const avail = it.w * scale - 8;
        const style = { italic: !!node.leaf, bold: !node.leaf, path: !!node.leaf, keepEnd: !!node.leaf };
        const label = (this.layout.labels && this.layout.labels[it.id]) || nodeLabel(node);
        if (lm.mode === "full") {
          const a = this._text(ctx, label, it.x, it.y - line * 0.6, scale, avail, style);
          const b = this._text(ctx, nodeDetail(node), it.x, it.y + line * 0.6, scale, avail);
          this._drawn.set(it.id, { lines: [a, b], fill });
        } else {
          this._drawn.set(it.id, { lines: [this._text(ctx, label, it.x, it.y, scale, avail, style)], fill });
        }
      } else {
        this._drawn.set(it.id, { lines: [], fill });
      }
      ctx.globalAlpha = 1;
      if (it.id === this.current || it.id === this.selected) {
        ctx.strokeStyle = it.id === this.current ? COLORS.current : COLORS.selected;
        ctx.lineWidth = 3 * Math.max(px, 1);
        ctx.strokeRect(left - 4 * px - 2, top - 4 * px - 2, it.w + 8 * px + 4, it.h + 8 * px + 4);
      }
    }
    this.wrap.dataset.drawn = String(++this._frame);
    this.wrap.dataset.labelled = String(labelled);
    this.wrap.dataset.scale = scale.toFixed(3);
    if (this._frame === 1 && typeof requestAnimationFrame !== "undefined") {
      // when the first frame with the graph has been painted (benchmarks read it)
      requestAnimationFrame(() =>
        requestAnimationFrame(() => {
          this.wrap.dataset.firstPaintMs = performance.now().toFixed(1);
        }),
      );
    }
  }

  destroy() {
    this._unbind?.();
    this.wrap.remove();
  }
}
