// A small payload shaped like gradscope.widget.recording_payload's output.
export function tinyPayload() {
  // nodes: 0 Sum, 1 Mm (module "b"), 2 Relu (module "a"), 3 Mm (module "a"), 4 leaf a.weight (module "a")
  return {
    version: 1,
    kind: "recording",
    label: "tiny",
    summary: { nodes: 5, edges: 4, saved: 3, saved_bytes: 832, peak_bytes: 1600, baseline_bytes: 0, steps: 3, device: "cpu", complete: true, error: null },
    peak: { bytes: 1600, phase: "backward", t: 0.011, label: "MmBackward0", node: 1, module: "b", step: 1 },
    strings: ["SumBackward0", "MmBackward0", "b", "ReluBackward0", "a", "AccumulateGrad", "a.weight", "4 × 8", "self", "16 × 8", "float32", "cpu", "activation", "result", "aten::mm"],
    nodes: {
      name: [0, 1, 3, 1, 5],
      order: [0, 1, 0, 0, 0],
      module: [-1, 2, 4, 4, 4],
      leaf: [-1, -1, -1, -1, 6],
      leaf_shape: [-1, -1, -1, -1, 7],
      executed: [1, 1, 1, 1, 1],
      saved_bytes: [0, 512, 512, 256, 0],
      saved_count: [0, 1, 1, 1, 0],
    },
    edges: [1, 0, 2, 1, 3, 2, 4, 3],
    saved: {
      node: [1, 2, 3],
      attribute: [8, 13, 8],
      shape: [9, 9, 9],
      dtype: [10, 10, 10],
      device: [11, 11, 11],
      bytes: [512, 512, 256],
      storage: [1, 1, 2],
      kind: [12, 12, 12],
      module: [2, 4, 4],
      name: [-1, -1, -1],
      freed: [0, 1, null],
    },
    steps: { node: [0, 1, 2], backward: [0, 0, 0], start: [0.01, 0.011, 0.012], duration: [0.001, 0.001, 0.001], live_before: [1000, 1000, 1600], live_after: [1000, 1600, 1100], freed: [0, 512, 512] },
    timeline: { t: [0, 0.002, 0.01, 0.011, 0.012], live: [256, 768, 1000, 1600, 1100], phase: [0, 0, 1, 1, 1], label: [14, 14, 0, 1, 3], module: [4, 4, -1, 2, 4], step: [null, null, 0, 1, 2], dropped: 0 },
    graph: {
      engine: "sugiyama",
      node_w: 150,
      node_h: 30,
      width: 400,
      height: 400,
      depth: 1,
      // node 0 and 1 loose... node 1 is in group "b"? Only "a" is a group (3 members).
      x: [100, 100, 100, 100, 100],
      y: [300, 200, 30, 90, 150],
      group: [-1, -1, 0, 0, 0],
      groups: { key: ["a"], count: [3], x: [100], y: [100], w: [190], h: [44], iw: [200], ih: [200] },
    },
  };
}
