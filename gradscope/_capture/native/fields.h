// Generated from gradscope/_capture/native/fields.py (python -m gradscope._capture.native.fields): do not edit.
// See NOTE [ one definition of the shared state ] there.
#pragma once

// The hooks' State: OBJECT(name) for an owned object, INT(name) for a long long.
#define GRADSCOPE_STATE_FIELDS(OBJECT, INT) \
  OBJECT(bw) \
  OBJECT(marks) \
  INT(last_seq) \
  OBJECT(pending) \
  OBJECT(prev_node) \
  OBJECT(reading) \
  OBJECT(stack) \
  INT(func_depth) \


// The Walker's tables: FIELD(name, the type it must be or nullptr), all owned objects.
#define GRADSCOPE_WALKER_FIELDS(FIELD) \
  FIELD(index, &PyDict_Type) /* node key -> node index (gradscope._base.trace) */ \
  FIELD(nodes, &PyList_Type) /* list of node rows */ \
  FIELD(edge_keys, &PyList_Type) /* the edges' source keys */ \
  FIELD(edge_dst, &PyList_Type) /* the edges' destination indices */ \
  FIELD(packed, &PyDict_Type) /* Counter: node number -> saves the pack hook made under it */ \
  FIELD(seq_attr, &PyDict_Type) /* node number -> the attribute of its one saved tensor */ \
  FIELD(seq_order, &PyDict_Type) /* node number -> its saves' attributes in pack order */ \
  FIELD(hooked, &PySet_Type) /* node indices with a pre hook for the whole block */ \
  FIELD(leaf_hooks, &PyDict_Type) /* node index -> a leaf's pre hook */ \
  FIELD(type_info, nullptr) /* callable(fn) -> (name, attributes, custom, single) */ \
  FIELD(node_key, nullptr) /* callable(fn) -> an AccumulateGrad node's key */ \
  FIELD(name_node, nullptr) /* callable(fn, key, attributes, absent bits, ours): the saves read in Python */ \
  FIELD(hook, nullptr) /* callable(fn, index, name, post) */ \
  FIELD(leaf_row, nullptr) /* callable(fn, index, key, name, custom, hooking, hook_all) */ \
  FIELD(saves, &PyList_Type) /* save rows (gradscope._base.trace): ``packed`` counts them */ \
  FIELD(acc_vars, &PyDict_Type) /* AccumulateGrad node index -> weak reference to its leaf */ \
  FIELD(leaf_key, nullptr) /* callable(leaf tensor) -> its AccumulateGrad node's key */ \


#define GRADSCOPE_WALKER_NFIELDS 17
