// The views: a recording (graph, details, step-through, timeline) and a comparison (strategy
// toggles, side-by-side figures, overlaid timelines). Shared by the widget and the HTML page.
// See NOTE [ text is data ] in dom.js: no user text ever goes through innerHTML.
// Every figure shown comes with its definition (gradscope.figures, in the payload).

import { decodeRecording, figureOf, findNodes, nodeLabel } from "./data.js";
import { clear, h } from "./dom.js";
import { comparisonHeadline, formatBytes, formatError, formatRatio, formatSeconds, formatSecondsRange, naturalCompare, stepText, wrapPieces } from "./format.js";
import { GraphView } from "./graph.js";
import { legendItems } from "./legend.js";
import { zoomAnchor } from "./lod.js";
import { breakdownAt, argmax } from "./series.js";
import { clampStep, nodeReleaseSteps, stepState, stepTime, whyNothingFreed } from "./stepper.js";
import { JobView } from "./jobview.js";
import { LiveView, loopSection } from "./loopchart.js";
import { SnapshotView } from "./snapview.js";
import { CSS } from "./style.js";
import { renderMemory, renderOverlay } from "./timeline.js";
import { zoomAt } from "./viewport.js";

const GRAPH_MIN_PX = 520; // the graph's height: see NOTE [ the graph takes the window's height ]
const GRAPH_MAX_PX = 900;
const ORDER_TEXT = ["forward (order 0)", "created by create_graph (order 1)", "created by a second create_graph (order 2)"];

/** A name as text pieces with line-break chances between them (see NOTE [ names wrap at their joints ] in format.js). */
function wrapped(text) {
  const out = [];
  for (const piece of wrapPieces(text)) {
    if (out.length) out.push(h("wbr"));
    out.push(piece);
  }
  return out;
}

/** A table cell whose text wraps only at its joints; `title` (the full text) when it is long. */
function td(text, cls, title) {
  return h("td", { class: cls, title }, wrapped(text));
}

function legend(rec, level) {
  const box = h("div", { class: "gs-legend" });
  for (const it of legendItems(rec, level)) {
    box.appendChild(
      h("span", { class: `gs-legend-item gs-legend-${it.key}`, dataset: { key: it.key } }, [
        it.arrow ? h("span", { class: "gs-arrow", text: "→" }) : h("span", { class: "gs-swatch", style: it.style }),
        it.text,
      ]),
    );
  }
  return box;
}

function levelName(level, i) {
  if (level.depth === null || level.depth === undefined) return "every node";
  return `modules folded (depth ${level.depth})`;
}

/** The sentence under the timeline: what memory was made of at the peak. */
function peakBreakdownText(rec) {
  const p = rec.peak;
  const tl = rec.timeline;
  if (!p) return null;
  const base = rec.summary.baseline_bytes || 0;
  const where = [p.step !== null && p.step !== undefined ? stepText(p.step) : null, p.label || null, p.module ? `in ${p.module}` : null].filter((x) => x);
  let text = `At the peak (${p.phase}${where.length ? `, ${where.join(", ")}` : ""}): ${formatBytes(p.bytes)} allocated in the block`;
  const labels = rec.categoryLabels || {};
  if (p.breakdown && Object.keys(p.breakdown).length > 1) {
    text += ": " + Object.entries(p.breakdown).map(([c, b]) => `${labels[c] || c} ${formatBytes(b)}`).join(" · ");
  } else if (tl.categories.length > 1) {
    const i = argmax(tl.live);
    if (i >= 0) text += ": " + breakdownAt(tl, i).map(([c, b]) => `${labels[c] || c} ${formatBytes(b)}`).join(" · ");
  }
  if (base) text += `; on top of ${formatBytes(base)} of parameters and inputs that existed before it`;
  return `${text}.`;
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
    const F = (name) => figureOf(rec, name);
    // a long loop's recording holds some iterations' detail (gradscope.recording.Loop): the title says whose
    const loop = payload.loop;
    const detailOf = loop && loop.kept ? ` · detail of iteration ${loop.detail[0]}${loop.detail[1] > loop.detail[0] ? `-${loop.detail[1]}` : ""}` : "";
    this.root.appendChild(h("h3", { class: "gs-title", text: `gradscope · ${rec.label || "recording"}${detailOf}` }));
    const parts = [`${s.nodes} nodes`];
    if (s.memory !== false) parts.push(`peak ${formatBytes(s.peak_bytes)} at once, above ${formatBytes(s.baseline_bytes)} of parameters and inputs`);
    parts.push(`${F("saved_activations").label} ${formatBytes(s.saved_activations ?? s.saved_bytes)} in total`);
    if (s.parameters_saved) parts.push(`parameters and inputs saved ${formatBytes(s.parameters_saved)} (no new memory)`);
    parts.push(`${s.steps} backward steps`, `device ${s.device}`);
    if (!s.complete) parts.push("incomplete");
    this.root.appendChild(
      h("div", {
        class: "gs-summary",
        text: parts.join(" · "),
        title: `${F("peak").label}: ${F("peak").definition}\n${F("saved_total").label}: ${F("saved_total").definition}`,
      }),
    );
    if (s.error) this.root.appendChild(h("div", { class: "gs-error", text: `error: ${s.error}` }));
    if (rec.peak) {
      const p = rec.peak;
      const where = [p.phase, p.step !== null && p.step !== undefined ? stepText(p.step) : null, p.label, p.module ? `module ${p.module}` : null]
        .filter((x) => x)
        .join(" · ");
      this.root.appendChild(h("div", { class: "gs-summary gs-peak", text: `peak ${formatBytes(p.bytes)}: ${where}` }));
    }
    if (payload.loop) this.loop = loopSection(this.root, payload.loop); // a loop's iterations (loopchart.js)
    const tb = h("div", { class: "gs-toolbar" });
    this.legendBox = h("div", { class: "gs-legend-wrap" });
    const body = h("div", { class: "gs-body" });
    this.root.appendChild(tb);
    this.root.appendChild(this.legendBox);
    this.root.appendChild(body);
    this.releaseStep = nodeReleaseSteps(rec);
    // the graph and its step controls form one column, so the controls stay next to the graph
    // in every width (the details go beside it, or below both when narrow); the side panel is in
    // place before the graph measures its width for the first view
    const graphCol = h("div", { class: "gs-graph-col" });
    this.side = h("div", { class: "gs-side" });
    body.appendChild(graphCol);
    body.appendChild(this.side);
    this.graph = new GraphView(graphCol, rec, {
      onSelect: (id) => {
        this.showNode(id);
        this.hooks.onSelect?.(id);
      },
      onLevel: () => this._levelChanged(),
    });
    const btn = (text, fn, cls, title) => h("button", { class: cls, text, title, on: { click: fn } });
    tb.appendChild(btn("Fit", () => this.graph.fit(), "gs-fit", "the whole graph where its names can be read, else its top with names"));
    tb.appendChild(btn("Whole graph", () => this.graph.fitAll(), "gs-fit-all", "the whole graph, however small (it says when names cannot be read)"));
    tb.appendChild(btn("+", () => this._zoom(1.4), "gs-zoom-in", "zoom in (towards the selected node or the drawing)"));
    tb.appendChild(btn("−", () => this._zoom(1 / 1.4), "gs-zoom-out", "zoom out"));
    if (rec.levels.length > 1) {
      this.levelSel = h("select", { class: "gs-level", "aria-label": "level of detail", title: "level of detail" });
      rec.levels.forEach((lv, i) => {
        const o = h("option", { text: levelName(lv, i) });
        o.value = String(i);
        this.levelSel.appendChild(o);
      });
      this.levelSel.addEventListener("change", () => this.graph.setLevel(Number(this.levelSel.value)));
      tb.appendChild(h("span", { class: "gs-muted", text: "show:" }));
      tb.appendChild(this.levelSel);
    }
    this.expandBtns = h("span", { class: "gs-expand-btns" }, [
      btn("Open all modules", () => this.graph.expandAll(), "gs-expand-all"),
      btn("Fold all", () => this.graph.collapseAll(), "gs-collapse-all"),
    ]);
    tb.appendChild(this.expandBtns);
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
    this._levelChanged();
    this.selected = -1;
    this.step = null;
    this.showOverview();
    this._buildStepper(graphCol);
    this.timelineDiv = h("div", { class: "gs-timeline" });
    const section = h("div", { class: "gs-section" }, [this.timelineDiv]);
    this.root.appendChild(section);
    if (rec.timeline.t.length) {
      const text = peakBreakdownText(rec);
      if (text) section.appendChild(h("div", { class: "gs-peak-breakdown", text }));
      if (rec.timeline.categoryNote) section.appendChild(h("div", { class: "gs-muted gs-category-note", text: `Memory by category: ${rec.timeline.categoryNote}.` }));
      this.showBaseline = true;
      const draw = () => {
        this.timeline?.destroy();
        this.timeline = renderMemory(this.timelineDiv, rec, { onPickStep: (k) => this.setStep(k, true), baseline: this.showBaseline });
        if (this.step) this.timeline.setStep(this._stepX(this.step.index));
      };
      if (s.baseline_bytes) {
        const box = h("input", { type: "checkbox", class: "gs-baseline-toggle" });
        box.checked = true;
        box.addEventListener("change", () => {
          this.showBaseline = box.checked;
          draw();
        });
        section.insertBefore(
          h("label", { class: "gs-muted gs-baseline" }, [box, ` include the ${formatBytes(s.baseline_bytes)} of parameters and inputs from before the block (bottom band)`]),
          this.timelineDiv,
        );
      }
      // the graph paints first; the timeline follows once that frame is on screen
      const later = () => {
        this._timelineTimer = setTimeout(() => {
          this._timelineTimer = null;
          draw();
        }, 0);
      };
      if (typeof requestAnimationFrame !== "undefined") requestAnimationFrame(later);
      else later();
    } else {
      this.timelineDiv.appendChild(h("div", { class: "gs-muted", text: "No memory timeline (recorded with memory='off')." }));
    }
    // the graph takes the height the window has for it (see _sizeGraph), now and as it changes
    this._sized = () => this._sizeGraph();
    if (typeof window !== "undefined") window.addEventListener("resize", this._sized);
    this._rootObserver = typeof ResizeObserver !== "undefined" ? new ResizeObserver(this._sized) : null;
    this._rootObserver?.observe(this.root);
    this._sizeGraph();
  }

  /**
   * NOTE [ the graph takes the window's height ]: a fixed 520 px canvas left a model's lm_head and
   * loss below the first screen of a 1000 x 800 page. The graph is as tall as the window allows
   * with the view's title, toolbar and legend above it and the step controls below it in sight
   * (between GRAPH_MIN_PX and GRAPH_MAX_PX), so that a page's first screen, or the view scrolled to
   * its title, shows the graph whole where its names can be read (lod.js). The side panel follows.
   */
  _sizeGraph() {
    if (!this.root.isConnected || typeof window === "undefined") return;
    const root = this.root.getBoundingClientRect();
    const wrap = this.graph.wrap.getBoundingClientRect();
    if (!root.height) return; // not shown yet: the observer calls again
    const lead = Math.max(0, Math.min(root.top + window.scrollY, 24)); // the page's margin above a view at its top
    const above = wrap.top - root.top;
    const below = (this.stepBar ? this.stepBar.getBoundingClientRect().height : 0) + 16;
    const want = Math.round(Math.min(GRAPH_MAX_PX, Math.max(GRAPH_MIN_PX, window.innerHeight - lead - above - below)));
    if (Math.abs(want - wrap.height) < 2) return;
    this.graph.wrap.style.height = `${want}px`;
    this.side.style.height = `${want}px`;
  }

  _stepX(k) {
    const t = stepTime(this.rec, k);
    return t === null ? null : t * 1e3;
  }

  _levelChanged() {
    if (!this.graph || !this.legendBox || !this.expandBtns) return; // during construction: called again after
    const lv = this.graph.layout;
    clear(this.legendBox);
    this.legendBox.appendChild(legend(this.rec, lv));
    if (this.levelSel) this.levelSel.value = String(this.graph.levelIndex);
    this.expandBtns.style.display = lv.groups.key.length ? "" : "none";
  }

  _zoom(f) {
    const g = this.graph;
    g.touched = true;
    const a = zoomAnchor(g.view, g.vis.bounds, g.width, g.height, g.focusPoint());
    g.view = zoomAt(g.view, f, a.x, a.y);
    g.draw();
  }

  /** The step controls, under the graph in `parent`, sticking to the window's bottom edge while the graph is on screen. */
  _buildStepper(parent) {
    const n = this.rec.steps.length;
    const bar = h("div", { class: "gs-stepbar" });
    this.stepBar = bar;
    const wrap = h("div", { class: "gs-stepper" });
    bar.appendChild(wrap);
    parent.appendChild(bar);
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
    this.stepWhy = h("div", { class: "gs-step-why" });
    this.stepWhy.style.display = "none";
    bar.appendChild(this.stepWhy);
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
    const where = node && node.module ? ` in ${node.module}` : "";
    this.stepLabel.textContent = `${stepText(k)}/${n} · ${node ? nodeLabel(node) : "?"} #${st.node}${where} · live ${formatBytes(st.liveAfter)} · freed ${formatBytes(st.freedBytes)}`;
    const why = whyNothingFreed(this.rec, k);
    this.stepWhy.textContent = why || "";
    this.stepWhy.style.display = why ? "" : "none";
    this.graph.setStep(st, this.releaseStep);
    this.graph.reveal(st.node);
    this.graph.draw();
    this.timeline?.setStep(this._stepX(k));
    this.showNode(st.node);
    if (notify) this.hooks.onStep?.(k);
  }

  showOverview() {
    const side = this.side;
    clear(side);
    delete side.dataset.node;
    const rec = this.rec;
    const alive = figureOf(rec, "alive_at_peak");
    const act = figureOf(rec, "saved_activations");
    const measured = rec.modules.some((m) => m.alive !== null);
    side.appendChild(h("h4", { text: "Memory by module" }));
    // largest first; ties in natural order (G.2 before G.10)
    const mods = rec.modules
      .filter((m) => (m.alive || 0) > 0 || m.act > 0)
      .sort((a, b) => (b.alive || 0) - (a.alive || 0) || b.act - a.act || naturalCompare(a.name, b.name))
      .slice(0, 15);
    if (!mods.length) {
      side.appendChild(h("div", { class: "gs-muted", text: "No module made or saved memory in the block." }));
    } else {
      const tbl = h("table", { class: "gs-table gs-modtable" });
      tbl.appendChild(
        h("tr", {}, [
          h("th", { text: "module" }),
          measured ? h("th", { class: "gs-num", text: alive.label, title: alive.definition }) : null,
          h("th", { class: "gs-num", text: act.label, title: act.definition }),
        ]),
      );
      for (const m of mods) {
        const tr = h("tr", { class: "gs-module", title: "show in the graph", dataset: { module: m.name } }, [
          td(m.name, "gs-module-name", m.name),
          measured ? h("td", { class: "gs-num gs-module-alive", text: formatBytes(m.alive) }) : null,
          h("td", { class: "gs-num gs-module-act", text: formatBytes(m.act) }),
        ]);
        tr.addEventListener("click", () => this.showModule(m.name));
        tbl.appendChild(tr);
      }
      side.appendChild(tbl);
      const defs = h("div", { class: "gs-muted gs-defs" });
      if (measured) defs.appendChild(h("div", { text: `${alive.label}: ${alive.definition}.` }));
      defs.appendChild(h("div", { text: `${act.label}: ${act.definition}.` }));
      side.appendChild(defs);
    }
    this._lineTable(side, measured);
    side.appendChild(h("div", { class: "gs-muted", text: "Click a node to see its saved tensors; click a module box to open it." }));
  }

  /** "Memory by line": the same figures by the user's source line (beside "by module"). */
  _lineTable(side, measured) {
    const rec = this.rec;
    const rows = rec.byLine.filter((r) => (r.alive || 0) > 0 || r.saved > 0).slice(0, 15);
    if (!rows.length) return;
    const defs = rec.lineDefinitions;
    side.appendChild(h("h4", { text: "Memory by line" }));
    const alive = measured && rows.some((r) => r.alive !== null);
    const tbl = h("table", { class: "gs-table gs-linetable" });
    tbl.appendChild(
      h("tr", {}, [
        h("th", { text: "line" }),
        // the registry's labels, wrapped between words in the narrow side panel
        alive ? h("th", { class: "gs-num gs-wrap", text: defs.aliveLabel, title: defs.alive }) : null,
        h("th", { class: "gs-num gs-wrap", text: defs.savedLabel, title: defs.saved }),
      ]),
    );
    for (const r of rows) {
      const tr = h("tr", { class: "gs-line", title: `show in the graph\n${r.line.stack || ""}`, dataset: { line: r.line.index } }, [
        td(r.line.label, "gs-line-name"),
        alive ? h("td", { class: "gs-num gs-line-alive", text: formatBytes(r.alive || 0) }) : null,
        h("td", { class: "gs-num gs-line-saved", text: formatBytes(r.saved) }),
      ]);
      tr.addEventListener("click", () => this.showLine(r.line.index));
      tbl.appendChild(tr);
    }
    side.appendChild(tbl);
  }

  /** Show the largest saver made at line `k` in the graph and its details. */
  showLine(k) {
    let best = -1;
    const nodes = this.rec.nodes;
    for (const n of nodes) {
      if (!n.line || n.line.index !== k) continue;
      if (best < 0 || n.actBytes > nodes[best].actBytes || (n.actBytes === nodes[best].actBytes && n.savedBytes > nodes[best].savedBytes)) best = n.id;
    }
    if (best < 0) return;
    this.revealNode(best);
    this.hooks.onSelect?.(best);
  }

  /** Show a module's largest saver in the graph (expanding its folded box) and its details. */
  showModule(m) {
    let best = -1;
    const nodes = this.rec.nodes;
    for (const n of nodes) {
      if (n.module !== m) continue;
      if (best < 0 || n.actBytes > nodes[best].actBytes || (n.actBytes === nodes[best].actBytes && n.savedBytes > nodes[best].savedBytes)) best = n.id;
    }
    if (best < 0) return;
    this.revealNode(best);
    this.hooks.onSelect?.(best);
  }

  /** Open the node's module if it is folded, centre the node and show its details. */
  revealNode(id) {
    if (!this.rec.nodes[id]) return;
    const g = this.graph.layout.group[id];
    if (g >= 0 && !this.graph.expanded.has(g)) this.graph.toggleGroup(g, true);
    this.graph.focusNode(id);
    this.showNode(id);
  }

  /** The side panel for node `id`: what it is, its module, what it holds, its saved tensors. */
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
    const row = (k, v, cls, title) => {
      kv.appendChild(h("span", { text: k, title }));
      kv.appendChild(h("span", { class: cls, title }, wrapped(v)));
    };
    const act = figureOf(this.rec, "saved_activations");
    row("module", node.module ?? "(none)", "gs-node-module");
    if (node.line) row("line", node.line.label, "gs-node-line", node.line.stack ? `the whole stack:\n${node.line.stack}` : undefined);
    if (node.leaf) row(node.leaf === "input" ? "input" : "parameter", `${node.leaf}${node.leafShape ? ` ${node.leafShape}` : ""} (existed before the block)`, "gs-node-leaf");
    row("order", ORDER_TEXT[Math.min(node.order, 2)] ?? String(node.order));
    row("executed", `${node.executed}×`);
    if (!node.leaf) row(act.label, `${formatBytes(node.actBytes)}${node.largest && node.actBytes > 0 ? ` (largest ${node.largest})` : ""}`, "gs-node-act", act.definition);
    row("saved", `${node.savedCount} tensor${node.savedCount === 1 ? "" : "s"}, ${formatBytes(node.savedBytes)} with parameters and inputs`);
    if (node.alive !== null) row("alive at peak", formatBytes(node.alive), "gs-node-alive", figureOf(this.rec, "alive_at_peak").definition);
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
            td(t.attribute),
            td(`${t.shape} ${t.dtype}`),
            h("td", { class: "gs-num", text: formatBytes(t.bytes) }),
            td(t.name && t.kind !== "activation" ? `${t.kind} (${t.name})` : t.kind),
            h("td", { class: "gs-num gs-freed-at", text: t.freedAt === null || t.freedAt === undefined ? "—" : stepText(t.freedAt) }),
          ]),
        );
      }
      side.appendChild(tbl);
    }
    if (this.step && this.step.node === id) this._releasedList(side);
    side.appendChild(h("button", { class: "gs-overview", text: "Back to modules", on: { click: () => this.showOverview() } }));
  }

  /** The saved tensors released at the current step (any node's), greyed out; or why none. */
  _releasedList(side) {
    const st = this.step;
    side.appendChild(h("h4", { text: `Released at ${stepText(st.index)}: ${formatBytes(st.freedBytes)}` }));
    if (!st.freedNow.length) {
      side.appendChild(h("div", { class: "gs-muted gs-released-none", text: whyNothingFreed(this.rec, st.index) || "No saved tensor was released at this step." }));
      return;
    }
    const tbl = h("table", { class: "gs-table gs-released" });
    for (const j of st.freedNow) {
      const t = this.rec.saved[j];
      const owner = this.rec.nodes[t.node];
      tbl.appendChild(
        h("tr", { class: "gs-freed", dataset: { saved: j } }, [
          td(`${owner ? owner.name : "?"} #${t.node}`),
          td(t.attribute),
          td(`${t.shape} ${t.dtype}`),
          h("td", { class: "gs-num", text: formatBytes(t.bytes) }),
        ]),
      );
    }
    side.appendChild(tbl);
  }

  destroy() {
    if (this._timelineTimer) clearTimeout(this._timelineTimer);
    this._rootObserver?.disconnect();
    if (typeof window !== "undefined" && this._sized) window.removeEventListener("resize", this._sized);
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
    this.xMode = "normalized";
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
    const figs = p.figures || {};
    const fig = (k, fallback) => figs[k] || { label: fallback, definition: "" };
    const peakF = fig("peak", "peak");
    const savedF = fig("saved_total", "saved");
    this.root.appendChild(h("h3", { text: `gradscope · comparison (reference: ${p.reference ?? "none"})` }));
    // the first screen says what the page shows: the problem, the winner, what holds memory
    const headline = comparisonHeadline(p);
    const lines = [
      p.problem ? h("div", { class: "gs-cmp-problem", text: p.problem }) : null,
      headline.winner ? h("div", { class: "gs-cmp-winner", text: headline.winner }) : null,
      headline.holder ? h("div", { class: "gs-cmp-holder", text: headline.holder }) : null,
    ].filter((x) => x);
    if (lines.length) this.root.appendChild(h("div", { class: "gs-cmp-headline" }, lines));
    const best = p.best || {};
    const isBest = (col, name) => (best[col] || []).includes(name);
    const threads = [...new Set(p.rows.map((r) => r.threads).filter((t) => t !== null && t !== undefined))];
    const tbl = h("table", { class: "gs-table gs-cmp-table" });
    const th = (text, cls, title) => h("th", { class: cls, text, title });
    tbl.appendChild(
      h("tr", {}, [
        th("run"),
        th("candidate"),
        th("status"),
        th(peakF.label, "gs-num", peakF.definition),
        th("vs ref", "gs-num", "peak divided by the reference's peak"),
        th(savedF.label, "gs-num", savedF.definition),
        th("time (median)", "gs-num", `median of ${p.repeat ?? "the"} timed runs after a warm-up (the recorded run is not timed)`),
        th("min–max", "gs-num", "fastest and slowest timed run"),
        th("vs ref", "gs-num", "median time divided by the reference's"),
        th("max abs error", "gs-num", "largest absolute difference from the reference over outputs and gradients"),
        th("message"),
      ]),
    );
    const running = new Set(this.model.get("running") || []);
    this.boxes = [];
    const cell = (text, cls, best, title) => h("td", { class: [cls, best ? "gs-best" : ""].join(" ").trim(), text, title });
    p.rows.forEach((r) => {
      const box = h("input", { type: "checkbox", class: "gs-toggle", "aria-label": `run ${r.name}` });
      box.checked = !this.unchecked.has(r.name);
      box.dataset.name = r.name;
      box.addEventListener("change", () => {
        if (box.checked) this.unchecked.delete(r.name);
        else this.unchecked.add(r.name);
      });
      this.boxes.push(box);
      const isRef = r.name === p.reference;
      const spread = r.time_min_s === null || r.time_min_s === undefined ? "—" : formatSecondsRange(r.time_min_s, r.time_max_s);
      const msg = [r.stale ? `stale: measured in round ${r.run}, the others in round ${p.round}; re-run all to compare` : "", r.message || ""].filter((x) => x).join(" · ");
      tbl.appendChild(
        h(
          "tr",
          {
            class: ["gs-cmp-row", r.stale ? "gs-stale" : "", isRef ? "gs-ref" : ""].join(" ").trim(),
            dataset: { name: r.name, status: r.status, stale: r.stale ? "1" : "0", run: r.run },
          },
          [
            h("td", {}, [box]),
            h("td", { class: "gs-cmp-name", text: r.name }),
            h("td", { class: `gs-status-${r.status}`, text: running.has(r.name) ? "running…" : r.status }),
            cell(formatBytes(r.peak_bytes), "gs-num gs-cmp-peak", isBest("peak", r.name)),
            cell(isRef ? "ref" : formatRatio(r.peak_ratio), "gs-num gs-cmp-peak-ratio"),
            cell(formatBytes(r.saved_total), "gs-num gs-cmp-saved", isBest("saved", r.name)),
            cell(formatSeconds(r.time_s), "gs-num gs-cmp-time", isBest("time", r.name)),
            cell(spread + (r.spread_too_wide ? " ⚠" : ""), `gs-num gs-cmp-spread${r.spread_too_wide ? " gs-warn" : ""}`, false, r.spread_too_wide ? `slowest / fastest above ${p.spread_limit}: too wide to trust (a busy machine?)` : undefined),
            cell(isRef ? "ref" : formatRatio(r.time_ratio), "gs-num gs-cmp-time-ratio"),
            cell(formatError(r.max_abs_error), "gs-num"),
            h("td", { class: "gs-cmp-message", text: msg }),
          ],
        ),
      );
    });
    // a narrow notebook scrolls the table sideways rather than squeezing its columns
    this.root.appendChild(h("div", { class: "gs-scroll" }, [tbl]));
    const notes = h("div", { class: "gs-muted gs-cmp-notes" });
    if (Object.values(best).some((v) => v && v.length)) notes.appendChild(h("div", { text: "Highlighted: the best value per column among the candidates that are ok (and not stale)." }));
    notes.appendChild(h("div", { text: `${peakF.label}: ${peakF.definition}.` }));
    notes.appendChild(h("div", { text: `${savedF.label}: ${savedF.definition}.` }));
    if (threads.length) notes.appendChild(h("div", { class: "gs-cmp-threads", text: `Timed with ${threads.join("/")} torch thread(s); time = median of ${p.repeat ?? "?"} runs after a warm-up.` }));
    this.root.appendChild(notes);
    const bar = h("div", { class: "gs-toolbar" });
    this.rerunBtn = h("button", { class: "gs-rerun", text: "Re-run selected", on: { click: () => this.rerun(false) } });
    this.rerunAllBtn = h("button", { class: "gs-rerun-all", text: "Re-run all", title: "measure every candidate again, as one set", on: { click: () => this.rerun(true) } });
    for (const b of [this.rerunBtn, this.rerunAllBtn]) {
      if (this.opts.standalone) {
        b.disabled = true;
        b.title = "Re-running needs the live widget in a notebook.";
      } else if (running.size) b.disabled = true;
      bar.appendChild(b);
    }
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

    // the overlay compares one round only: stale rows are left out, and said so
    const series = [];
    const decoded = p.recordings.map((r) => (r ? decodeRecording(r) : null));
    const left = [];
    p.rows.forEach((r, i) => {
      if (!decoded[i]) return;
      if (r.stale) left.push(r.name);
      else series.push({ name: r.name, rec: decoded[i] });
    });
    const tlDiv = h("div", { class: "gs-timeline gs-cmp-timeline" });
    const modeBtn = (mode, text) =>
      h("button", {
        class: `gs-xmode${this.xMode === mode ? " gs-on" : ""}`,
        text,
        dataset: { mode },
        on: {
          click: () => {
            this.xMode = mode;
            this.render();
          },
        },
      });
    const head = h("div", { class: "gs-toolbar" }, [
      h("h4", { text: "Memory allocated in the block, overlaid" }),
      h("span", { class: "gs-muted", text: "time axis:" }),
      modeBtn("normalized", "each run 0–100 %"),
      modeBtn("ms", "milliseconds"),
    ]);
    const section = h("div", { class: "gs-section" }, [head, tlDiv]);
    if (left.length) section.appendChild(h("div", { class: "gs-muted gs-cmp-left-out", text: `Not drawn (stale, from an earlier round): ${left.join(", ")}. Re-run all to compare them.` }));
    this.root.appendChild(section);
    if (series.length) this.tl = renderOverlay(tlDiv, series, { height: 280, x: this.xMode });

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

  rerun(all) {
    const names = all ? this.p.rows.map((r) => r.name) : this.boxes.filter((b) => b.checked).map((b) => b.dataset.name);
    if (!names.length) return;
    this.rerunBtn.disabled = true;
    this.rerunAllBtn.disabled = true;
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
  let inner = null; // a running cell's view, once the recording replaced it
  if (payload.kind === "live") {
    // a cell that records: its iterations as they end (messages), then the recording (data)
    view = new LiveView(root, payload);
    on("msg:custom", (msg) => view?.message(msg));
    on("change:data", () => {
      for (const [name, fn] of handlers) model.off(name, fn);
      handlers.length = 0;
      view?.destroy();
      view = null;
      root.remove();
      inner = mount(el, model, opts);
    });
  } else if (payload.kind === "snapshot") {
    const build = () => {
      view?.destroy();
      view = new SnapshotView(root, JSON.parse(model.get("data")), {
        group: model.get("group"),
        onPosition: (p) => setModel(model, { position: p }),
        onGroup: (g) => setModel(model, { group: g }),
      });
      const p = model.get("position");
      if (p !== undefined && p !== null && p >= -1) view.showPosition(p);
    };
    build();
    on("change:data", build);
    on("change:position", () => {
      const p = model.get("position");
      if (p !== undefined && p !== null && p >= -1) view.showPosition(p);
    });
    on("change:group", () => view.setGroup(model.get("group"), false));
  } else if (payload.kind === "job") {
    const build = () => {
      view?.destroy();
      view = new JobView(root, JSON.parse(model.get("data")), {
        align: model.get("align"),
        RecordingView,
        recordingHooks: {
          onSelect: (id) => setModel(model, { selected_node: id }),
          onStep: (k) => setModel(model, { step: k }),
        },
        onRank: (r) => setModel(model, { selected_rank: r }),
        onAlign: (m) => setModel(model, { align: m }),
      });
      const r = model.get("selected_rank");
      if (r !== undefined && r !== null && r >= 0) view.selectRank(r, false);
      else if (view.selected !== undefined) setModel(model, { selected_rank: view.selected });
    };
    build();
    on("change:data", build);
    on("change:selected_rank", () => {
      const r = model.get("selected_rank");
      if (r >= 0) view.selectRank(r, false);
    });
    on("change:align", () => view.setAlign(model.get("align"), false));
  } else if (payload.kind === "comparison") {
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
    inner?.();
  };
}
