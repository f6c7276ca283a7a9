// Tiny DOM helper. NOTE [ text is data ]: every string from a recording (module names, parameter
// names, labels, messages) reaches the page through textContent / createTextNode, canvas
// fillText, or Plotly with entities escaped; never through innerHTML.

/** Create an element: h("div", { class: "x", text: "hello", title: "t", on: { click } }, children). */
export function h(tag, opts = {}, children = []) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(opts)) {
    if (v === undefined || v === null) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = String(v);
    else if (k === "on") for (const [ev, fn] of Object.entries(v)) e.addEventListener(ev, fn);
    else if (k === "dataset") for (const [dk, dv] of Object.entries(v)) e.dataset[dk] = String(dv);
    else if (k === "style") e.style.cssText = v;
    else e.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    e.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
  }
  return e;
}

/** Remove all children of `e`. */
export function clear(e) {
  while (e.firstChild) e.removeChild(e.firstChild);
}
