// The autograd graph on a canvas: pan (drag), zoom (wheel, buttons), click a node to select it,
// click a module box to expand it and a module frame's header to collapse it. A canvas draws
// 20,000 boxes in a few tens of milliseconds where SVG needs seconds.

import { COLORS, bytesColor, orderStroke, textOn } from "./color.js";
import { boxCount, groupBytes, visibleLayout } from "./collapse.js";
import { nodeLabel } from "./data.js";
import { formatBytes, truncate, truncateStart } from "./format.js";
import { centerOn, fitView, hitTest, initialView, panBy, toScreen, toWorld, zoomAt } from "./viewport.js";
import { h } from "./dom.js";

function maxOf(values) {
  let m = 1;
  for (const v of values) if (v > m) m = v;
  return m;
}

export class GraphView {
  /**
   * @param {HTMLElement} parent where the canvas goes
   * @param {object} rec a decoded recording (data.js)
   * @param {{onSelect?: Function, onExpand?: Function}} hooks
   */
  constructor(parent, rec, hooks = {}) {
    this.rec = rec;
    this.hooks = hooks;
    this.expanded = new Set();
    this.selected = -1;
    this.current = -1;
    this.releaseStep = null;
    this.stepIndex = -1;
    this.nodeBytes = rec.nodes.map((n) => n.savedBytes);
    this.maxBytes = maxOf(this.nodeBytes);
    this.groupBytes = groupBytes(rec.graph, this.nodeBytes);
    this.maxGroupBytes = maxOf(this.groupBytes);
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
    this._relayout();
    this._bind();
    // Test and automation hooks: where a node is on screen, in client pixels.
    this.canvas.gsNodeCenter = (id) => this.nodeClientCenter(id);
    this.canvas.gsGroupCenter = (key) => this.groupClientCenter(key);
    this.resize();
  }

  _relayout() {
    this.vis = visibleLayout(this.rec.graph, this.rec.edges, this.expanded);
    const ds = this.wrap.dataset;
    ds.nodeCount = String(this.rec.nodes.length);
    ds.visibleCount = String(boxCount(this.vis.items));
    ds.groupCount = String(this.rec.graph.groups.key.length);
    ds.expandedCount = String(this.expanded.size);
  }

  _bind() {
    const c = this.canvas;
    let drag = null;
    const onDown = (e) => {
      drag = { x: e.clientX, y: e.clientY, moved: 0 };
      c.setPointerCapture?.(e.pointerId);
    };
    const onMove = (e) => {
      if (!drag) {
        this._hover(e);
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

  /** A tooltip naming what is under the pointer (text only, see NOTE [ text is data ]). */
  _hover(e) {
    const r = this.canvas.getBoundingClientRect();
    const sx = e.clientX - r.left;
    const sy = e.clientY - r.top;
    const w = toWorld(this.view, sx, sy);
    const i = hitTest(this.vis.items, w.x, w.y);
    const it = i >= 0 ? this.vis.items[i] : null;
    if (!it) {
      this.tip.style.display = "none";
      return;
    }
    let text;
    if (it.kind === "node") {
      const n = this.rec.nodes[it.id];
      text = `${n.name} #${n.id}${n.leaf ? `\nparameter ${n.leaf}` : ""}\nmodule ${n.module ?? "(none)"}\n${n.savedCount} saved, ${formatBytes(n.savedBytes)}`;
    } else {
      const G = this.rec.graph.groups;
      const verb = it.kind === "group" ? "click to expand" : "click the header to collapse";
      text = `module ${G.key[it.id]}\n${G.count[it.id]} nodes, ${formatBytes(this.groupBytes[it.id])} saved\n${verb}`;
    }
    this.tip.textContent = text;
    this.tip.style.display = "block";
    this.tip.style.left = `${Math.min(sx + 14, Math.max(0, this.width - 260))}px`;
    this.tip.style.top = `${sy + 14}px`;
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
  }

  /** Expand (open=true) or collapse a module group, keeping it where it is on screen. */
  toggleGroup(g, open) {
    this.touched = true;
    const before = this.vis.items[this._itemOfGroup(g)];
    if (open) this.expanded.add(g);
    else this.expanded.delete(g);
    this._relayout();
    const after = this.vis.items[this._itemOfGroup(g)];
    if (open && after) {
      // show the opened module: all of it when it fits legibly, else its top at a legible scale
      const b = { minX: after.x - after.w / 2, minY: after.y - after.h / 2, maxX: after.x + after.w / 2, maxY: after.y + after.h / 2 };
      this.view = initialView(b, this.width, this.height);
    } else if (before && after) {
      const topBefore = before.y - before.h / 2;
      const topAfter = after.y - after.h / 2;
      this.view = panBy(this.view, (before.x - after.x) * this.view.scale, (topBefore - topAfter) * this.view.scale);
    }
    this.hooks.onExpand?.([...this.expanded]);
    this.draw();
  }

  expandAll() {
    for (let g = 0; g < this.rec.graph.groups.key.length; g++) this.expanded.add(g);
    this._relayout();
    this.fit();
  }

  collapseAll() {
    this.expanded.clear();
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

  /** Centre the view on a node at a legible scale. */
  focusNode(id) {
    const it = this.vis.items[this.vis.itemOfNode[id]];
    if (!it) return;
    const scale = Math.max(this.view.scale, 0.9);
    this.view = centerOn({ scale, tx: 0, ty: 0 }, it.x, it.y, this.width, this.height);
    this.touched = true;
    this.draw();
  }

  nodeClientCenter(id) {
    const it = this.vis.items[this.vis.itemOfNode[id]];
    if (!it) return null;
    return this._client(it);
  }

  groupClientCenter(key) {
    const g = this.rec.graph.groups.key.indexOf(key);
    const i = g < 0 ? -1 : this._itemOfGroup(g);
    if (i < 0) return null;
    const it = this.vis.items[i];
    return it.kind === "frame" ? this._client({ x: it.x, y: it.y - it.h / 2 + 8 }) : this._client(it);
  }

  _client(it) {
    const r = this.canvas.getBoundingClientRect();
    const s = toScreen(this.view, it.x, it.y);
    return { x: r.left + s.x, y: r.top + s.y, visible: s.x >= 0 && s.y >= 0 && s.x <= this.width && s.y <= this.height };
  }

  /** Show the whole graph, or its top at a legible scale when it is too big for that. */
  fit() {
    this.view = initialView(this.vis.bounds, this.width, this.height);
    this.draw();
  }

  /** Show the whole graph however small. */
  fitAll() {
    this.view = fitView(this.vis.bounds, this.width, this.height, 20, 1.2);
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
    // until the user pans or zooms, keep the whole first view in sight as the panel settles
    if (first || !this.touched) this.fit();
    else this.draw();
  }

  draw() {
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

    // Edges: one path, from the bottom of the producer to the top of the consumer.
    ctx.beginPath();
    const E = this.vis.edges;
    for (let k = 0; k < E.length; k += 2) {
      const a = items[E[k]];
      const b = items[E[k + 1]];
      const ax = a.x;
      const ay = a.y + a.h / 2;
      const bx = b.x;
      const by = b.y - b.h / 2;
      if ((ax < w0.x && bx < w0.x) || (ax > w1.x && bx > w1.x) || (ay < w0.y && by < w0.y) || (ay > w1.y && by > w1.y)) continue;
      ctx.moveTo(ax, ay);
      ctx.lineTo(bx, by);
    }
    ctx.strokeStyle = COLORS.edge;
    ctx.lineWidth = Math.max(px, 1);
    ctx.stroke();

    const labels = scale >= 0.6; // 12px text is at least 7px on screen
    ctx.font = "12px system-ui, -apple-system, Segoe UI, sans-serif";
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    const keys = this.rec.graph.groups.key;
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
        ctx.fillRect(left, top, it.w, 22);
        if (labels) {
          ctx.fillStyle = COLORS.text;
          ctx.textAlign = "left";
          ctx.fillText(`▾ ${truncate(keys[it.id], Math.floor(it.w / 7) - 4)}`, left + 6, top + 11);
          ctx.textAlign = "center";
        }
        continue;
      }
      if (it.kind === "group") {
        const active = this.current >= 0 && this.rec.graph.group[this.current] === it.id && !this.expanded.has(it.id);
        const fill = bytesColor(this.groupBytes[it.id], this.maxGroupBytes);
        ctx.fillStyle = fill;
        ctx.fillRect(left, top, it.w, it.h);
        ctx.strokeStyle = active ? COLORS.current : COLORS.border;
        ctx.lineWidth = active ? 4 * Math.max(px, 1) : Math.max(px, 1.5);
        ctx.strokeRect(left, top, it.w, it.h);
        ctx.strokeRect(left + 3, top + 3, it.w - 6, it.h - 6);
        if (labels) {
          ctx.fillStyle = textOn(fill);
          ctx.fillText(`▸ ${truncate(keys[it.id], 24)}`, it.x, it.y - 7);
          ctx.fillText(`${this.rec.graph.groups.count[it.id]} nodes · ${formatBytes(this.groupBytes[it.id])}`, it.x, it.y + 9);
        }
        continue;
      }
      const node = nodes[it.id];
      const released = this.releaseStep && this.stepIndex >= 0 && this.releaseStep[it.id] >= 0 && this.releaseStep[it.id] <= this.stepIndex;
      ctx.globalAlpha = released ? 0.35 : 1;
      const fill = node.leaf ? COLORS.leaf : bytesColor(node.savedBytes, this.maxBytes);
      ctx.fillStyle = fill;
      ctx.fillRect(left, top, it.w, it.h);
      const st = orderStroke(node.order);
      ctx.setLineDash(st.dash);
      ctx.strokeStyle = st.color;
      ctx.lineWidth = Math.max(px, st.width);
      ctx.strokeRect(left, top, it.w, it.h);
      ctx.setLineDash([]);
      if (labels) {
        ctx.fillStyle = textOn(fill);
        ctx.font = node.leaf ? "italic 12px system-ui, sans-serif" : "12px system-ui, sans-serif";
        // parameter names keep their end (the module path is what the frame already says)
        ctx.fillText(node.leaf ? truncateStart(node.leaf, 21) : truncate(nodeLabel(node), 21), it.x, it.y);
      }
      ctx.globalAlpha = 1;
      if (it.id === this.current || it.id === this.selected) {
        ctx.strokeStyle = it.id === this.current ? COLORS.current : COLORS.selected;
        ctx.lineWidth = 3 * Math.max(px, 1);
        ctx.strokeRect(left - 4 * px - 2, top - 4 * px - 2, it.w + 8 * px + 4, it.h + 8 * px + 4);
      }
    }
    this.wrap.dataset.drawn = String(++this._frame);
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
