// The views: a recording (graph, details, step-through, timeline) and a comparison (strategy
// toggles, side-by-side figures, overlaid timelines). Shared by the widget and the HTML page.
// See NOTE [ text is data ] in dom.js: no user text ever goes through innerHTML.

import { decodeRecording, findNodes, modulesBySavedBytes, nodeLabel } from "./data.js";
import { clear, h } from "./dom.js";
import { formatBytes, formatError, formatSeconds } from "./format.js";
import { GraphView } from "./graph.js";
import { clampStep, nodeReleaseSteps, stepState, stepTime } from "./stepper.js";
import { CSS } from "./style.js";
import { renderTimeline } from "./timeline.js";
import { COLORS } from "./color.js";
import { zoomAt } from "./viewport.js";

const ORDER_TEXT = ["forward (order 0)", "created by create_graph (order 1)", "created by a second create_graph (order 2)"];

function legend() {
  const sw = (style) => h("span", { class: "gs-swatch", style });
  return h("div", { class: "gs-legend" }, [
    h("span", {}, [sw("background: rgb(255,247,214)"), "few saved bytes"]),
    h("span", {}, [sw("background: rgb(190,30,45)"), "many"]),
    h("span", {}, [sw(`background: ${COLORS.leaf}`), "leaf (parameter)"]),
    h("span", {}, [sw(`border: 2px dashed ${COLORS.order1}`), "order 1 (create_graph)"]),
    h("span", {}, [sw(`border: 2px dotted ${COLORS.order2}`), "order 2"]),
    h("span", {}, [sw("border: 3px double #52606d; background:#fff"), "module (click to expand)"]),
  ]);
}

/** One recording: graph + side panel + stepper + timeline. */
export class RecordingView {
  constructor(parent, payload, hooks = {}) {
    this.rec = decodeRecording(payload);
    this.hooks = hooks;
    this.root = h("div", { class: "gs-recording" });
    parent.appendChild(this.root);
    const rec = this.rec;
    const s = rec.summary;
    const parts = [
      `${s.nodes} nodes`,
      `${s.saved} saved tensors (${formatBytes(s.saved_bytes)})`,
      `peak ${formatBytes(s.peak_bytes)} above a baseline of ${formatBytes(s.baseline_bytes)}`,
      `${s.steps} backward steps`,
      `device ${s.device}`,
    ];
    if (!s.complete) parts.push("incomplete");
    this.root.appendChild(h("h3", { class: "gs-title", text: `gradscope · ${rec.label || "recording"}` }));
    this.root.appendChild(h("div", { class: "gs-summary", text: parts.join(" · ") }));
    if (s.error) this.root.appendChild(h("div", { class: "gs-error", text: `error: ${s.error}` }));
    if (rec.peak) {
      const p = rec.peak;
      const where = [p.phase, p.label, p.module ? `module ${p.module}` : null].filter((x) => x).join(" · ");
      this.root.appendChild(h("div", { class: "gs-summary gs-peak", text: `peak ${formatBytes(p.bytes)}: ${where}` }));
    }
    const tb = h("div", { class: "gs-toolbar" });
    const body = h("div", { class: "gs-body" });
    this.root.appendChild(tb);
    this.root.appendChild(body);
    this.releaseStep = nodeReleaseSteps(rec);
    this.graph = new GraphView(body, rec, {
      onSelect: (id) => {
        this.showNode(id);
        this.hooks.onSelect?.(id);
      },
    });
    this.side = h("div", { class: "gs-side" });
    body.appendChild(this.side);
    const btn = (text, fn, cls) => h("button", { class: cls, text, on: { click: fn } });
    tb.appendChild(btn("Fit", () => this.graph.fit(), "gs-fit"));
    tb.appendChild(btn("Whole graph", () => this.graph.fitAll(), "gs-fit-all"));
    tb.appendChild(btn("+", () => this._zoom(1.4), "gs-zoom-in"));
    tb.appendChild(btn("−", () => this._zoom(1 / 1.4), "gs-zoom-out"));
    if (rec.graph.groups.key.length) {
      tb.appendChild(btn("Expand all modules", () => this.graph.expandAll(), "gs-expand-all"));
      tb.appendChild(btn("Collapse all", () => this.graph.collapseAll(), "gs-collapse-all"));
    }
    // find a node by class, parameter or module; Enter again goes to the next match
    const find = h("input", { type: "search", class: "gs-find", placeholder: "find node or module…", "aria-label": "find node or module" });
    const found = h("span", { class: "gs-found gs-muted" });
    let matches = [];
    let at = -1;
    let last = "";
    find.addEventListener("keydown", (e) => {
      if (e.key !== "Enter") return;
      if (find.value !== last) {
        last = find.value;
        matches = findNodes(this.rec.nodes, last);
        at = -1;
      }
      if (!matches.length) {
        found.textContent = "no match";
        return;
      }
      at = (at + 1) % matches.length;
      found.textContent = `${at + 1}/${matches.length}`;
      this.revealNode(matches[at]);
      this.hooks.onSelect?.(matches[at]);
    });
    tb.appendChild(find);
    tb.appendChild(found);
    tb.appendChild(legend());
    this.selected = -1;
    this.step = null;
    this.showOverview();
    this._buildStepper();
    this.timelineDiv = h("div", { class: "gs-timeline" });
    this.root.appendChild(h("div", { class: "gs-section" }, [this.timelineDiv]));
    if (rec.timeline.t.length) {
      // the graph paints first; the timeline follows in the next task
      this._timelineTimer = setTimeout(() => {
        this._timelineTimer = null;
        this.timeline = renderTimeline(this.timelineDiv, [{ name: rec.label || "live bytes", rec }], {
          onPickStep: (k) => this.setStep(k, true),
        });
        if (this.step) this.timeline.setStep(stepTime(rec, this.step.index));
      }, 0);
    } else {
      this.timelineDiv.appendChild(h("div", { class: "gs-muted", text: "No memory timeline (recorded with memory='off')." }));
    }
  }

  _zoom(f) {
    const g = this.graph;
    g.touched = true;
    g.view = zoomAt(g.view, f, g.width / 2, g.height / 2);
    g.draw();
  }

  _buildStepper() {
    const n = this.rec.steps.length;
    const wrap = h("div", { class: "gs-stepper" });
    this.root.appendChild(wrap);
    if (n === 0) {
      wrap.appendChild(h("span", { class: "gs-muted", text: "No backward steps recorded." }));
      return;
    }
    const go = (i) => this.setStep(i, true);
    this.slider = h("input", { type: "range", min: "0", max: String(n - 1), value: "0", class: "gs-slider", "aria-label": "backward step" });
    this.slider.addEventListener("input", () => go(Number(this.slider.value)));
    wrap.appendChild(h("span", { text: "Backward:" }));
    wrap.appendChild(h("button", { class: "gs-first", text: "«", title: "first step", on: { click: () => go(0) } }));
    wrap.appendChild(h("button", { class: "gs-prev", text: "◀", title: "previous step", on: { click: () => go((this.step?.index ?? 0) - 1) } }));
    wrap.appendChild(this.slider);
    wrap.appendChild(h("button", { class: "gs-next", text: "▶", title: "next step", on: { click: () => go(this.step ? this.step.index + 1 : 0) } }));
    wrap.appendChild(h("button", { class: "gs-last", text: "»", title: "last step", on: { click: () => go(n - 1) } }));
    this.stepLabel = h("span", { class: "gs-steplabel gs-muted", text: `${n} steps; press ▶ (or → on the graph) to step through backward` });
    wrap.appendChild(this.stepLabel);
    // arrow keys step while the graph has the focus
    this.graph.canvas.addEventListener("keydown", (e) => {
      if (e.key === "ArrowRight" || e.key === "ArrowLeft") {
        e.preventDefault();
        const cur = this.step ? this.step.index : -1;
        go(e.key === "ArrowRight" ? cur + 1 : Math.max(0, cur - 1));
      }
    });
  }

  /** Go to backward step i (clamped); `notify` tells the host (Python) about it. */
  setStep(i, notify) {
    const n = this.rec.steps.length;
    if (n === 0) return;
    const k = clampStep(i, n);
    this.step = stepState(this.rec, k);
    const st = this.step;
    if (this.slider) this.slider.value = String(k);
    const node = this.rec.nodes[st.node];
    this.stepLabel.className = "gs-steplabel";
    this.stepLabel.dataset.step = String(k);
    this.stepLabel.textContent = `step ${k + 1}/${n} · ${node ? nodeLabel(node) : "?"} · live ${formatBytes(st.liveAfter)} · freed ${formatBytes(st.freedBytes)}`;
    this.graph.setStep(st, this.releaseStep);
    this.graph.reveal(st.node);
    this.graph.draw();
    this.timeline?.setStep(stepTime(this.rec, k));
    this.showNode(st.node);
    if (notify) this.hooks.onStep?.(k);
  }

  showOverview() {
    const side = this.side;
    clear(side);
    side.appendChild(h("h4", { text: "Saved bytes by module" }));
    const mods = modulesBySavedBytes(this.rec.saved).slice(0, 15);
    if (!mods.length) side.appendChild(h("div", { class: "gs-muted", text: "No saved tensors." }));
    const ol = h("ol", { class: "gs-modlist" });
    for (const [m, b] of mods) {
      const li = h("li", { class: "gs-module", text: `${m}: ${formatBytes(b)}`, title: "show in the graph" });
      li.addEventListener("click", () => this.showModule(m));
      ol.appendChild(li);
    }
    side.appendChild(ol);
    side.appendChild(h("div", { class: "gs-muted", text: "Click a node to see its saved tensors; click a module box to expand it." }));
  }

  /** Show a module's largest saver in the graph (expanding its folded box) and its details. */
  showModule(m) {
    let best = -1;
    for (const n of this.rec.nodes) {
      if (n.module === m && (best < 0 || n.savedBytes > this.rec.nodes[best].savedBytes)) best = n.id;
    }
    if (best < 0) return;
    this.revealNode(best);
    this.hooks.onSelect?.(best);
  }

  /** Open the node's module if it is folded, centre the node and show its details. */
  revealNode(id) {
    if (!this.rec.nodes[id]) return;
    const g = this.rec.graph.group[id];
    if (g >= 0 && !this.graph.expanded.has(g)) this.graph.toggleGroup(g, true);
    this.graph.focusNode(id);
    this.showNode(id);
  }

  /** The side panel for node `id`: what it is, its module, its saved tensors. */
  showNode(id) {
    const node = this.rec.nodes[id];
    if (!node) return;
    this.selected = id;
    this.graph.select(id);
    const side = this.side;
    clear(side);
    side.dataset.node = String(id);
    side.appendChild(h("h4", { class: "gs-node-title", text: `${node.name} #${id}` }));
    const kv = h("div", { class: "gs-kv" });
    const row = (k, v, cls) => {
      kv.appendChild(h("span", { text: k }));
      kv.appendChild(h("span", { class: cls, text: v }));
    };
    row("module", node.module ?? "(none)", "gs-node-module");
    if (node.leaf) row("parameter", `${node.leaf}${node.leafShape ? ` ${node.leafShape}` : ""}`, "gs-node-leaf");
    row("order", ORDER_TEXT[Math.min(node.order, 2)] ?? String(node.order));
    row("executed", `${node.executed}×`);
    row("saved", `${node.savedCount} tensors, ${formatBytes(node.savedBytes)}`);
    side.appendChild(kv);
    const idx = this.rec.savedByNode[id];
    if (!idx.length) {
      side.appendChild(h("div", { class: "gs-muted", text: "This node saved no tensors." }));
    } else {
      const tbl = h("table", { class: "gs-table gs-saved" });
      tbl.appendChild(
        h("tr", {}, [
          h("th", { text: "attribute" }),
          h("th", { text: "shape, dtype" }),
          h("th", { class: "gs-num", text: "bytes" }),
          h("th", { text: "kind" }),
          h("th", { class: "gs-num", text: "freed" }),
        ]),
      );
      for (const j of idx) {
        const t = this.rec.saved[j];
        const freed = this.step && this.step.freed.has(j);
        const now = this.step && t.freedAt === this.step.index;
        const cls = [freed ? "gs-freed" : "", now ? "gs-freed-now" : ""].join(" ").trim();
        tbl.appendChild(
          h("tr", { class: cls || undefined, dataset: { saved: j } }, [
            h("td", { text: t.attribute }),
            h("td", { text: `${t.shape} ${t.dtype}` }),
            h("td", { class: "gs-num", text: formatBytes(t.bytes) }),
            h("td", { text: t.name && t.kind !== "activation" ? `${t.kind} (${t.name})` : t.kind }),
            h("td", { class: "gs-num", text: t.freedAt === null || t.freedAt === undefined ? "—" : `step ${t.freedAt + 1}` }),
          ]),
        );
      }
      side.appendChild(tbl);
    }
    if (this.step && this.step.node === id) this._releasedList(side);
    side.appendChild(h("button", { class: "gs-overview", text: "Back to modules", on: { click: () => this.showOverview() } }));
  }

  /** The saved tensors released at the current step (any node's), greyed out. */
  _releasedList(side) {
    const st = this.step;
    side.appendChild(h("h4", { text: `Released at step ${st.index + 1}: ${formatBytes(st.freedBytes)}` }));
    if (!st.freedNow.length) {
      side.appendChild(h("div", { class: "gs-muted", text: "No saved tensor was released at this step." }));
      return;
    }
    const tbl = h("table", { class: "gs-table gs-released" });
    for (const j of st.freedNow) {
      const t = this.rec.saved[j];
      const owner = this.rec.nodes[t.node];
      tbl.appendChild(
        h("tr", { class: "gs-freed", dataset: { saved: j } }, [
          h("td", { text: `${owner ? owner.name : "?"} #${t.node}` }),
          h("td", { text: t.attribute }),
          h("td", { text: `${t.shape} ${t.dtype}` }),
          h("td", { class: "gs-num", text: formatBytes(t.bytes) }),
        ]),
      );
    }
    side.appendChild(tbl);
  }

  destroy() {
    if (this._timelineTimer) clearTimeout(this._timelineTimer);
    this.timeline?.destroy();
    this.graph.destroy();
    this.root.remove();
  }
}

/** A comparison: strategy toggles and figures side by side, overlaid timelines, one candidate's view. */
export class ComparisonView {
  constructor(parent, model, opts = {}) {
    this.model = model;
    this.opts = opts;
    this.root = h("div", { class: "gs-comparison" });
    parent.appendChild(this.root);
    this.current = null;
    this.unchecked = new Set(); // candidates the user switched off survive redraws
    this._pending = false;
    this.render();
  }

  /** Redraw once for a burst of state changes (data, running, count and error arrive together). */
  scheduleRender() {
    if (this._pending) return;
    this._pending = true;
    const run = () => {
      this._pending = false;
      this.render();
    };
    if (typeof requestAnimationFrame !== "undefined") requestAnimationFrame(run);
    else setTimeout(run, 0);
  }

  payload() {
    return JSON.parse(this.model.get("data"));
  }

  render() {
    const p = this.payload();
    this.p = p;
    clear(this.root);
    this.recView?.destroy();
    this.recView = null;
    this.tl?.destroy();
    this.tl = null;
    this.root.appendChild(h("h3", { text: `gradscope · comparison (reference: ${p.reference ?? "none"})` }));
    const tbl = h("table", { class: "gs-table gs-cmp-table" });
    tbl.appendChild(
      h("tr", {}, [
        h("th", { text: "run" }),
        h("th", { text: "candidate" }),
        h("th", { text: "status" }),
        h("th", { class: "gs-num", text: "peak" }),
        h("th", { class: "gs-num", text: "saved" }),
        h("th", { class: "gs-num", text: "time" }),
        h("th", { class: "gs-num", text: "max abs error" }),
        h("th", { text: "message" }),
      ]),
    );
    const running = new Set(this.model.get("running") || []);
    this.boxes = [];
    p.rows.forEach((r) => {
      const box = h("input", { type: "checkbox", class: "gs-toggle", "aria-label": `run ${r.name}` });
      box.checked = !this.unchecked.has(r.name);
      box.dataset.name = r.name;
      box.addEventListener("change", () => {
        if (box.checked) this.unchecked.delete(r.name);
        else this.unchecked.add(r.name);
      });
      this.boxes.push(box);
      tbl.appendChild(
        h("tr", { class: "gs-cmp-row", dataset: { name: r.name, status: r.status } }, [
          h("td", {}, [box]),
          h("td", { class: "gs-cmp-name", text: r.name }),
          h("td", { class: `gs-status-${r.status}`, text: running.has(r.name) ? "running…" : r.status }),
          h("td", { class: "gs-num", text: formatBytes(r.peak_bytes) }),
          h("td", { class: "gs-num", text: formatBytes(r.saved_bytes) }),
          h("td", { class: "gs-num", text: formatSeconds(r.time_s) }),
          h("td", { class: "gs-num", text: formatError(r.max_abs_error) }),
          h("td", { class: "gs-cmp-message", text: r.message || "" }),
        ]),
      );
    });
    this.root.appendChild(tbl);
    const bar = h("div", { class: "gs-toolbar" });
    this.rerunBtn = h("button", { class: "gs-rerun", text: "Re-run selected", on: { click: () => this.rerun() } });
    if (this.opts.standalone) {
      this.rerunBtn.disabled = true;
      this.rerunBtn.title = "Re-running needs the live widget in a notebook.";
    } else if (running.size) this.rerunBtn.disabled = true;
    bar.appendChild(this.rerunBtn);
    const count = this.model.get("rerun_count") || 0;
    const err = this.model.get("rerun_error") || "";
    this.status = h("span", {
      class: "gs-cmp-status",
      dataset: { rerunCount: count, running: running.size },
      text: running.size ? `running: ${[...running].join(", ")}…` : `re-runs: ${count}`,
    });
    bar.appendChild(this.status);
    if (this.opts.standalone) {
      bar.appendChild(h("span", { class: "gs-muted", text: "(a saved page: re-running needs the live widget in a notebook)" }));
    }
    this.root.appendChild(bar);
    if (err) this.root.appendChild(h("div", { class: "gs-error", text: err }));

    const series = [];
    const decoded = p.recordings.map((r) => (r ? decodeRecording(r) : null));
    p.rows.forEach((r, i) => decoded[i] && series.push({ name: r.name, rec: decoded[i] }));
    const tlDiv = h("div", { class: "gs-timeline gs-cmp-timeline" });
    this.root.appendChild(h("div", { class: "gs-section" }, [h("h4", { text: "Live bytes, overlaid" }), tlDiv]));
    if (series.length) this.tl = renderTimeline(tlDiv, series, { height: 260 });

    const names = p.rows.map((r) => r.name).filter((_, i) => p.recordings[i]);
    if (!names.length) return;
    if (!names.includes(this.current)) this.current = names.includes(p.reference) ? p.reference : names[0];
    const sel = h("select", { class: "gs-candidate" });
    for (const n of names) {
      const o = h("option", { text: n });
      o.value = n;
      sel.appendChild(o);
    }
    sel.value = this.current;
    sel.addEventListener("change", () => {
      this.current = sel.value;
      this.showCandidate();
    });
    this.root.appendChild(h("div", { class: "gs-toolbar gs-section" }, [h("span", { text: "Graph and step-through of:" }), sel]));
    this.candDiv = h("div", { class: "gs-candidate-view" });
    this.root.appendChild(this.candDiv);
    this.showCandidate();
  }

  showCandidate() {
    this.recView?.destroy();
    const i = this.p.rows.findIndex((r) => r.name === this.current);
    if (i < 0 || !this.p.recordings[i]) return;
    this.recView = new RecordingView(this.candDiv, this.p.recordings[i], {
      onSelect: (id) => setModel(this.model, { selected_node: id }),
      onStep: (k) => setModel(this.model, { step: k }),
    });
    setModel(this.model, { selected: this.current });
  }

  rerun() {
    const names = this.boxes.filter((b) => b.checked).map((b) => b.dataset.name);
    if (!names.length) return;
    this.rerunBtn.disabled = true;
    this.status.textContent = `running: ${names.join(", ")}…`;
    this.model.send({ type: "rerun", names });
  }

  destroy() {
    this.recView?.destroy();
    this.tl?.destroy();
    this.root.remove();
  }
}

function setModel(model, values) {
  for (const [k, v] of Object.entries(values)) model.set(k, v);
  model.save_changes();
}

/** Render a widget model (anywidget's, or the page's stand-in) into `el`; returns a cleanup. */
export function mount(el, model, opts = {}) {
  const root = h("div", { class: "gs-root" });
  root.appendChild(h("style", { text: CSS }));
  el.appendChild(root);
  let view = null;
  let payload;
  try {
    payload = JSON.parse(model.get("data"));
  } catch (e) {
    root.appendChild(h("div", { class: "gs-error", text: `gradscope: the widget's data could not be read (${e}).` }));
    return () => root.remove();
  }
  const handlers = [];
  const on = (name, fn) => {
    model.on(name, fn);
    handlers.push([name, fn]);
  };
  if (payload.kind === "comparison") {
    view = new ComparisonView(root, model, opts);
    const rerender = () => view.scheduleRender();
    on("change:data", rerender);
    on("change:running", rerender);
    on("change:rerun_count", rerender);
    on("change:rerun_error", rerender);
  } else {
    const build = () => {
      view?.destroy();
      view = new RecordingView(root, JSON.parse(model.get("data")), {
        onSelect: (id) => setModel(model, { selected_node: id }),
        onStep: (k) => setModel(model, { step: k }),
      });
      root.dataset.kind = "recording";
    };
    build();
    // state set from Python before this view existed (or kept from an earlier view)
    if (model.get("step") >= 0) view.setStep(model.get("step"), false);
    if (model.get("selected_node") >= 0) view.revealNode(model.get("selected_node"));
    on("change:data", build);
    on("change:selected_node", () => {
      const id = model.get("selected_node");
      if (id >= 0 && id !== view.selected) view.revealNode(id);
    });
    on("change:step", () => {
      const k = model.get("step");
      if (k >= 0 && (!view.step || view.step.index !== k)) view.setStep(k, false);
    });
  }
  root.dataset.kind = payload.kind;
  root.dataset.ready = "1";
  return () => {
    for (const [name, fn] of handlers) model.off(name, fn);
    view?.destroy();
    root.remove();
  };
}
