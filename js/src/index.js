// Entry point. As an anywidget module: `export default { render }`. In a page written by
// gradscope.html, the same bundle finds the inline data and mounts itself.

import { mount } from "./app.js";

/** A stand-in for anywidget's model in the standalone HTML page (no kernel). */
export class LocalModel {
  constructor(values) {
    this.values = { ...values };
    this.listeners = new Map();
  }
  get(k) {
    return this.values[k];
  }
  set(k, v) {
    this.values[k] = v;
    for (const fn of this.listeners.get(`change:${k}`) || []) fn();
  }
  save_changes() {}
  send() {}
  on(name, fn) {
    if (!this.listeners.has(name)) this.listeners.set(name, []);
    this.listeners.get(name).push(fn);
  }
  off(name, fn) {
    const l = this.listeners.get(name) || [];
    const i = l.indexOf(fn);
    if (i >= 0) l.splice(i, 1);
  }
}

function render({ model, el }) {
  return mount(el, model);
}

export default { render };

if (typeof document !== "undefined") {
  const data = document.getElementById("gradscope-data");
  const root = document.getElementById("gradscope-page");
  if (data && root && !root.dataset.mounted) {
    root.dataset.mounted = "1";
    const state = { data: data.textContent, selected_node: -1, step: -1, running: [], rerun_count: 0, rerun_error: "" };
    Object.assign(state, { position: -2, group: "line", selected_rank: -1, align: "normalized" });
    mount(root, new LocalModel(state), {
      standalone: true,
    });
  }
}
