// gradscope's graph walk at a backward's start, compiled: the rows of capture/discover.py's Python walk
// (``record._discover``), made over the C++ nodes without a Python object per node (see NOTE
// [ compiled walk ] in gradscope/_capture/native/__init__.py).
//
// A node gets a Python object only where Python code must read it: the first node of a class
// (its name and saved attributes are learnt in Python), a custom Function's node (its Python
// object exists anyway), a node whose saves are named by reading them, a node to hook, an
// AccumulateGrad node (its leaf names it). Everything else (the key, the edges, the row, the saves'
// attribute names once a class's pack order is learnt) is read here from the node itself.

#include <Python.h>

#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <memory>
#include <vector>

#include "native.h"

namespace {

using torch::autograd::Node;
// std::shared_ptr<Node> on older PyTorch, c10::intrusive_ptr<Node> on newer.
using NodePtr = decltype(std::declval<torch::autograd::THPCppFunction&>().cdata);

constexpr uint64_t kAccSeq = UINT64_MAX;  // AccumulateGrad's sequence number (every leaf's node)

using gradscope_native::Ref;

template <class P>
NodePtr as_node(const P& p) {
  if constexpr (requires { p.lock(); }) {
    return p.lock();  // older PyTorch: a custom Function's object holds its node weakly
  } else {
    return p;
  }
}

// The node behind a Python node object; null for anything else.
NodePtr node_of(PyObject* obj) {
  if (torch::autograd::THPCppFunction_Check(obj)) {
    return reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata;
  }
  if (PyObject_TypeCheck(obj, &THPFunctionType)) {
    return as_node(reinterpret_cast<THPFunction*>(obj)->cdata);
  }
  return NodePtr();
}

// Per C++ node class: its Python class, when every node of the C++ class has that one Python class
// and capture.discover._TYPES holds its information (one class, one name); else every node of the class is
// read through its Python object (a custom Function's node: one C++ class for all of them).
struct ClassEntry {
  PyObject* pytype = nullptr;  // owned for the process's lifetime
  bool per_node = false;
};
// Keyed by the address of the class's type_info (no hashing of its name per node; a class seen
// under two addresses gets two entries, each right).
std::unordered_map<const std::type_info*, ClassEntry> g_classes;

// A weak reference to a node, of the kind its strong one has.
template <class P>
struct WeakOf;
template <class T>
struct WeakOf<std::shared_ptr<T>> {
  using type = std::weak_ptr<T>;
};
template <class T, class N>
struct WeakOf<c10::intrusive_ptr<T, N>> {
  using type = c10::weak_intrusive_ptr<T, N>;
};
using WeakNode = typename WeakOf<NodePtr>::type;

// ------------------------------------------------------------------ a create_graph pass's pre hooks
// NOTE [ compiled pass hooks ]: where a step's start needs nothing but its event (memory="off":
// no source reads live bytes at steps, frees are checked once a pass), the pre hooks that a
// create_graph pass needs on the nodes without a save of ours (record._hook_for_pass) are C++
// hooks added to the nodes themselves: no Python object per node, no Python call per step. They
// write what record._make_pre's hook writes: the event (EV_PRE, node index, time, sequence
// counter), and the state's prev_node and last_seq. PassHooks.remove() takes them off when the
// pass ends. A hook holds no Python object (a node may die on a thread without the GIL): it
// reaches the state and the event list through the PassHooks that added it, and does nothing once
// that is gone.
struct PassContext {
  bool alive = true;                  // read and written with the GIL held
  gradscope_native::State* state;     // borrowed from the PassHooks while alive
  PyObject* events;                   // borrowed from the PassHooks while alive
};

struct PassPre : torch::autograd::FunctionPreHook {
  std::shared_ptr<PassContext> ctx;
  long long index;
  PassPre(std::shared_ptr<PassContext> c, long long i) : ctx(std::move(c)), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    PyGILState_STATE gil = PyGILState_Ensure();
    PassContext& c = *ctx;
    if (c.alive && c.state->bw != nullptr && c.state->bw != Py_None) {
      PyObject* i = PyLong_FromLongLong(index);
      PyObject* ev = i == nullptr ? nullptr
                                  : gradscope_native::untracked(Py_BuildValue(
                                        "(iOLK)", gradscope_native::kEvPre, i, gradscope_native::time_ns(),
                                        static_cast<unsigned long long>(at::sequence_number::peek())));
      if (ev == nullptr || PyList_Append(c.events, ev) < 0) {
        PyErr_WriteUnraisable(nullptr);  // memory exhausted: the step goes unmarked, the pass runs on
      } else {
        Py_INCREF(i);
        Py_XSETREF(c.state->prev_node, i);
        c.state->last_seq = -2;  // the next unpack starts a new step (see record._make_pre)
      }
      Py_XDECREF(ev);
      Py_XDECREF(i);
    }
    PyGILState_Release(gil);
    return grads;
  }
};

struct PassHooks {
  PyObject_HEAD
  PyObject* state;
  PyObject* events;
  std::shared_ptr<PassContext>* ctx;
  std::vector<std::pair<WeakNode, PassPre*>>* added;
};

void pass_remove_all(PassHooks* self) {
  if (self->added != nullptr) {
    for (auto& [weak, hook] : *self->added) {
      NodePtr node = weak.lock();
      if (!node) continue;
      auto& hooks = node->pre_hooks();
      for (auto it = hooks.begin(); it != hooks.end(); ++it) {
        if (it->get() == hook) {
          hooks.erase(it);
          break;
        }
      }
    }
    self->added->clear();
  }
  if (self->ctx != nullptr) (*self->ctx)->alive = false;
}

// How many of the hooks it added are on a live node still.
PyObject* pass_attached(PassHooks* self, PyObject*) {
  Py_ssize_t on = 0;
  if (self->added != nullptr) {
    for (auto& [weak, hook] : *self->added) {
      NodePtr node = weak.lock();
      if (!node) continue;
      for (const auto& h : node->pre_hooks()) on += h.get() == hook;
    }
  }
  return PyLong_FromSsize_t(on);
}

PyObject* pass_remove(PassHooks* self, PyObject*) {
  pass_remove_all(self);
  Py_RETURN_NONE;
}

int pass_traverse(PassHooks* self, visitproc visit, void* arg) {
  Py_VISIT(self->state);
  Py_VISIT(self->events);
  return 0;
}

int pass_clear(PassHooks* self) {
  pass_remove_all(self);
  Py_CLEAR(self->state);
  Py_CLEAR(self->events);
  return 0;
}

void pass_dealloc(PassHooks* self) {
  PyObject_GC_UnTrack(self);
  pass_clear(self);
  delete self->added;
  delete self->ctx;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyMethodDef pass_methods[] = {
    {"remove", reinterpret_cast<PyCFunction>(pass_remove), METH_NOARGS, "Take the pass's pre hooks off."},
    {"attached", reinterpret_cast<PyCFunction>(pass_attached), METH_NOARGS,
     "How many of its pre hooks are on a live node."},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject PassHooksType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// The compiled walk's tables and callbacks: fields.py's WALKER (see NOTE [ one definition of the
// shared state ] there), read by name from its one argument, a fields.WalkerTables.
struct Walker {
  PyObject_HEAD
#define GRADSCOPE_WALKER_FIELD(name, type) PyObject* name;
  GRADSCOPE_WALKER_FIELDS(GRADSCOPE_WALKER_FIELD)
#undef GRADSCOPE_WALKER_FIELD
  Py_ssize_t packed_upto;  // saves counted into ``packed`` so far
};

constexpr int kFields = GRADSCOPE_WALKER_NFIELDS;

using WalkerRefs = gradscope_native::OwnedRefs<Walker, kFields, &Walker::index>;
static_assert(offsetof(Walker, packed_upto) == offsetof(Walker, index) + kFields * sizeof(PyObject*));

PyObject** fields(Walker* self) { return WalkerRefs::refs(self); }

int walker_init(Walker* self, PyObject* args, PyObject* kwds) {
  PyObject* tables;
  if (!PyArg_ParseTuple(args, "O", &tables)) return -1;
  struct Field {
    const char* name;
    PyTypeObject* type;
  };
#define GRADSCOPE_WALKER_FIELD(name, type) {#name, type},
  static const Field spec[kFields] = {GRADSCOPE_WALKER_FIELDS(GRADSCOPE_WALKER_FIELD)};
#undef GRADSCOPE_WALKER_FIELD
  PyObject* in[kFields];
  for (int k = 0; k < kFields; ++k) {
    in[k] = PyObject_GetAttrString(tables, spec[k].name);
    if (in[k] != nullptr && spec[k].type != nullptr && !PyObject_TypeCheck(in[k], spec[k].type)) {
      PyErr_Format(PyExc_TypeError, "gradscope: Walker's %s must be a %s, got %s", spec[k].name,
                   spec[k].type->tp_name, Py_TYPE(in[k])->tp_name);
      Py_CLEAR(in[k]);
    }
    if (in[k] == nullptr) {
      for (int j = 0; j < k; ++j) Py_DECREF(in[j]);
      return -1;
    }
  }
  for (int k = 0; k < kFields; ++k) Py_XSETREF(fields(self)[k], in[k]);  // owned from GetAttr
  self->packed_upto = 0;
  return 0;
}

// Counts the saves made since the last call into ``packed`` by their node number (record._packed).
bool count_packed(Walker* self) {
  Py_ssize_t n = PyList_GET_SIZE(self->saves);
  for (; self->packed_upto < n; ++self->packed_upto) {
    PyObject* row = PyList_GET_ITEM(self->saves, self->packed_upto);
    if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) < 1) {
      PyErr_SetString(PyExc_TypeError, "gradscope: a save's row is a tuple");
      return false;
    }
    PyObject* seq = PyTuple_GET_ITEM(row, 0);  // gradscope._base.trace S_SEQ
    PyObject* had = PyDict_GetItemWithError(self->packed, seq);
    if (had == nullptr && PyErr_Occurred()) return false;
    long long was = had == nullptr ? 0 : PyLong_AsLongLong(had);
    if (was == -1 && PyErr_Occurred()) return false;
    Ref now(PyLong_FromLongLong(was + 1));
    if (!now || PyDict_SetItem(self->packed, seq, now.get()) < 0) return false;
  }
  return true;
}

PyObject* walker_count_packed(Walker* self, PyObject*) {
  if (!count_packed(self)) return nullptr;
  Py_RETURN_NONE;
}

// Leaves that died since the last walk: their AccumulateGrad keys (the leaf's id) may name a new
// leaf now, so they leave the index (record._discover).
bool drop_dead_leaves(Walker* self) {
  if (PyDict_GET_SIZE(self->acc_vars) == 0) return true;
  Ref dead(PyList_New(0));
  if (!dead) return false;
  Py_ssize_t pos = 0;
  PyObject *i, *ref;
  while (PyDict_Next(self->acc_vars, &pos, &i, &ref)) {
    if (!PyWeakref_Check(ref)) {
      PyErr_SetString(PyExc_TypeError, "gradscope: a leaf is held by a weak reference");
      return false;
    }
    if (PyWeakref_GetObject(ref) == Py_None && PyList_Append(dead.get(), i) < 0) return false;
  }
  for (Py_ssize_t k = 0; k < PyList_GET_SIZE(dead.get()); ++k) {
    PyObject* at = PyList_GET_ITEM(dead.get(), k);
    Py_ssize_t row_at = PyLong_AsSsize_t(at);
    if (row_at < 0 || row_at >= PyList_GET_SIZE(self->nodes)) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "gradscope: a leaf's node has no row");
      return false;
    }
    PyObject* row = PyList_GET_ITEM(self->nodes, row_at);
    if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) < 1) {
      PyErr_SetString(PyExc_TypeError, "gradscope: a node's row is a tuple");
      return false;
    }
    Ref gone(PyObject_CallMethod(self->index, "pop", "OO", PyTuple_GET_ITEM(row, 0), Py_None));
    if (!gone || PyDict_DelItem(self->acc_vars, at) < 0) return false;
  }
  return true;
}

// One walk's working set: the nodes it reached (held until it ends, as the Python walk holds their
// objects: see NOTE [ node identity ] in gradscope/_capture/walk.py), the Python objects it made, and the
// keys of the AccumulateGrad nodes it met.
struct Walk {
  Walker* w;
  PyObject* types = nullptr;  // capture.discover._TYPES (read at each walk: tests replace the tables)
  std::vector<std::pair<NodePtr, PyObject*>> stack;  // (node, owned key)
  std::vector<NodePtr> held;
  Ref objects{PyList_New(0)};
  std::unordered_map<Node*, PyObject*> acc_keys;  // borrowed from objects

  explicit Walk(Walker* walker) : w(walker) {}
  ~Walk() {
    for (auto& f : stack) Py_DECREF(f.second);
  }

  // The node's Python object (borrowed; held until the walk ends).
  PyObject* object(const NodePtr& n) {
    Ref o(torch::autograd::functionToPyObject(n));
    if (!o || PyList_Append(objects.get(), o.get()) < 0) return nullptr;
    return o.get();
  }

  // A node's key (new reference): see node_key in gradscope/_capture/walk.py.
  PyObject* key(const NodePtr& n) {
    uint64_t seq = n->sequence_nr();
    if (seq != kAccSeq) return PyLong_FromUnsignedLongLong(seq);
    auto it = acc_keys.find(n.get());
    if (it != acc_keys.end()) {
      Py_INCREF(it->second);
      return it->second;
    }
    PyObject* fn = object(n);
    if (fn == nullptr) return nullptr;
    Ref k(PyObject_CallOneArg(w->node_key, fn));
    if (!k || PyList_Append(objects.get(), k.get()) < 0) return nullptr;
    acc_keys.emplace(n.get(), k.get());
    return k.release();
  }

  // The node's class information (borrowed) and Python class; ``fn`` is set when the node's
  // Python object had to be made.
  PyObject* info(const NodePtr& n, PyObject** fn, PyObject** pytype) {
    Node& node = *n;
    const std::type_info* cls = &typeid(node);
    auto it = g_classes.find(cls);
    if (it != g_classes.end() && !it->second.per_node) {
      PyObject* got = PyDict_GetItemWithError(types, it->second.pytype);
      if (got != nullptr) {
        *pytype = it->second.pytype;
        return got;
      }
      if (PyErr_Occurred()) return nullptr;
    }
    if (*fn == nullptr && (*fn = object(n)) == nullptr) return nullptr;
    *pytype = reinterpret_cast<PyObject*>(Py_TYPE(*fn));
    PyObject* got = PyDict_GetItemWithError(types, *pytype);
    if (got == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      Ref made(PyObject_CallOneArg(w->type_info, *fn));
      if (!made || !PyTuple_Check(made.get()) || PyTuple_GET_SIZE(made.get()) != 4) {
        if (made) PyErr_SetString(PyExc_TypeError, "gradscope: a node class's information is a 4-tuple");
        return nullptr;
      }
      if (PyList_Append(objects.get(), made.get()) < 0) return nullptr;
      got = made.get();
    }
    if (it == g_classes.end()) {
      int known = PyDict_Contains(types, *pytype);
      if (known < 0) return nullptr;
      ClassEntry e;
      e.per_node = !known || !torch::autograd::THPCppFunction_Check(*fn);
      if (!e.per_node) {
        Py_INCREF(*pytype);
        e.pytype = *pytype;
      }
      g_classes.emplace(cls, e);
    }
    return got;
  }

  bool push_roots(PyObject* roots, PyObject* keys) {
    Py_ssize_t n = PyList_GET_SIZE(roots);
    for (Py_ssize_t k = 0; k < n; ++k) {
      NodePtr p = node_of(PyList_GET_ITEM(roots, k));
      if (!p) return false;
      PyObject* key = PyList_GET_ITEM(keys, k);
      Py_INCREF(key);
      stack.emplace_back(std::move(p), key);
    }
    return true;
  }
};

// Bits of the inputs without a gradient edge, as record._absent computes them.
PyObject* absent_bits(const NodePtr& n) {
  const auto& edges = n->next_edges();
  if (edges.size() < 64) {
    unsigned long long bits = 0;
    for (size_t k = 0; k < edges.size(); ++k) {
      if (!edges[k].function) bits |= 1ULL << k;
    }
    return PyLong_FromUnsignedLongLong(bits);
  }
  Ref bits(PyLong_FromLong(0));
  for (size_t k = 0; k < edges.size() && bits; ++k) {
    if (edges[k].function) continue;
    Ref one(PyLong_FromLong(1)), at(PyLong_FromSize_t(k));
    if (!one || !at) return nullptr;
    Ref shifted(PyNumber_Lshift(one.get(), at.get()));
    if (!shifted) return nullptr;
    bits = Ref(PyNumber_Or(bits.get(), shifted.get()));
  }
  return bits.release();
}

bool roots_args(PyObject* roots, PyObject* keys) {
  if (!PyList_Check(roots) || !PyList_Check(keys) || PyList_GET_SIZE(roots) != PyList_GET_SIZE(keys)) {
    PyErr_SetString(PyExc_TypeError, "gradscope: roots and their keys are two lists of one length");
    return false;
  }
  return true;
}

// discover(roots, keys, hooking, hook_all, seq0, types, orders) -> acc_known: record._discover
// whole (the saves counted, dead leaves dropped, the walk, its AccumulateGrad edges resolved), but
// for the AccumulateGrad nodes walked before (key -> a parent node), which Python hooks again; or
// NotImplemented when a root is not a node this file can read (the Python walk runs instead; the
// walk changed nothing). ``types`` and ``orders`` are capture.discover._TYPES and capture.discover._ORDERS.
PyObject* discover(Walker* self, PyObject* roots, PyObject* keys, int hooking, int hook_all, PyObject* seq0,
                   PyObject* types, PyObject* orders) {
  if (!roots_args(roots, keys)) return nullptr;
  if (!count_packed(self) || !drop_dead_leaves(self)) return nullptr;
  Walk walk(self);
  walk.types = types;
  if (!walk.objects) return nullptr;
  if (!walk.push_roots(roots, keys)) Py_RETURN_NOTIMPLEMENTED;
  Ref acc_edges(PyList_New(0)), acc_known(PyDict_New());
  if (!acc_edges || !acc_known) return nullptr;
  PyObject* const index = self->index;
  while (!walk.stack.empty()) {
    NodePtr node = std::move(walk.stack.back().first);
    Ref key(walk.stack.back().second);
    walk.stack.pop_back();
    int seen = PyDict_Contains(index, key.get());
    if (seen < 0) return nullptr;
    if (seen) continue;
    walk.held.push_back(node);
    Ref i(PyLong_FromSsize_t(PyList_GET_SIZE(self->nodes)));
    if (!i || PyDict_SetItem(index, key.get(), i.get()) < 0) return nullptr;
    PyObject* fn = nullptr;
    PyObject* pytype = nullptr;
    PyObject* info = walk.info(node, &fn, &pytype);
    if (info == nullptr) return nullptr;
    PyObject* name = PyTuple_GET_ITEM(info, 0);
    PyObject* attrs = PyTuple_GET_ITEM(info, 1);
    PyObject* custom = PyTuple_GET_ITEM(info, 2);
    PyObject* single = PyTuple_GET_ITEM(info, 3);
    int is_custom = PyObject_IsTrue(custom);
    if (is_custom < 0) return nullptr;
    for (const auto& e : node->next_edges()) {
      if (!e.function) continue;
      Ref k(walk.key(e.function));
      if (!k) return nullptr;
      if (e.function->sequence_nr() == kAccSeq) {
        if (hooking) {
          int in_index = PyDict_Contains(index, k.get());
          if (in_index < 0) return nullptr;
          int known = in_index ? PyDict_Contains(acc_known.get(), k.get()) : 1;
          if (known < 0) return nullptr;
          if (!known) {
            if (fn == nullptr && (fn = walk.object(node)) == nullptr) return nullptr;
            if (PyDict_SetItem(acc_known.get(), k.get(), fn) < 0) return nullptr;
          }
        }
        Ref at(PyLong_FromSsize_t(PyList_GET_SIZE(self->edge_keys)));
        if (!at || PyList_Append(acc_edges.get(), at.get()) < 0) return nullptr;
      }
      if (PyList_Append(self->edge_keys, k.get()) < 0 || PyList_Append(self->edge_dst, i.get()) < 0) return nullptr;
      int in_index = PyDict_Contains(index, k.get());
      if (in_index < 0) return nullptr;
      if (!in_index) walk.stack.emplace_back(e.function, k.release());
    }
    if (PyLong_CheckExact(key.get())) {
      Ref row(gradscope_native::untracked(PyTuple_Pack(6, key.get(), key.get(), name, Py_None, Py_None, custom)));
      if (!row || PyList_Append(self->nodes, row.get()) < 0) return nullptr;
      int has_attrs = PyObject_IsTrue(attrs);
      if (has_attrs < 0) return nullptr;
      if (has_attrs) {
        PyObject* count = PyDict_GetItemWithError(self->packed, key.get());  // borrowed
        if (count == nullptr && PyErr_Occurred()) return nullptr;
        bool done = false;
        if (count != nullptr && single != Py_None) {
          if (PyDict_SetItem(self->seq_attr, key.get(), single) < 0) return nullptr;
          done = true;
        } else if (count != nullptr) {
          PyObject* rule = PyDict_GetItemWithError(orders, pytype);
          if (rule == nullptr && PyErr_Occurred()) return nullptr;
          if (rule != nullptr) {
            PyObject* attrs_in_order = PyTuple_GET_ITEM(rule, 0);
            if (PyLong_AsSsize_t(count) == PyTuple_GET_SIZE(attrs_in_order)) {
              if (PyDict_SetItem(self->seq_order, key.get(), attrs_in_order) < 0) return nullptr;
              done = true;
            }
          }
        }
        Ref bits;
        if (!done && count != nullptr) {  // a learnt order for this pattern of saves, that moves none
          bits = Ref(absent_bits(node));
          Ref okey(bits ? PyTuple_Pack(3, pytype, count, bits.get()) : nullptr);
          if (!okey) return nullptr;
          PyObject* rule = PyDict_GetItemWithError(orders, okey.get());
          if (rule == nullptr && PyErr_Occurred()) return nullptr;
          if (rule != nullptr && PyTuple_GET_SIZE(PyTuple_GET_ITEM(rule, 1)) == 0) {
            if (PyDict_SetItem(self->seq_order, key.get(), PyTuple_GET_ITEM(rule, 0)) < 0) return nullptr;
            done = true;
          }
        }
        if (!done) {
          int later = count != nullptr ? 1 : PyObject_RichCompareBool(key.get(), seq0, Py_GE);
          if (later < 0) return nullptr;
          if (later) {
            if (fn == nullptr && (fn = walk.object(node)) == nullptr) return nullptr;
            if (!bits && !(bits = Ref(absent_bits(node)))) return nullptr;
            Ref r(PyObject_CallFunctionObjArgs(self->name_node, fn, key.get(), attrs, bits.get(),
                                               count != nullptr ? Py_True : Py_False, nullptr));
            if (!r) return nullptr;
          }
        }
      }
      if (hooking && (hook_all || is_custom)) {
        if (fn == nullptr && (fn = walk.object(node)) == nullptr) return nullptr;
        Ref r(PyObject_CallFunctionObjArgs(self->hook, fn, i.get(), name, hook_all ? Py_True : Py_False,
                                           nullptr));
        if (!r) return nullptr;
      }
    } else {  // AccumulateGrad: the leaf names it
      if (fn == nullptr && (fn = walk.object(node)) == nullptr) return nullptr;
      Ref r(PyObject_CallFunctionObjArgs(self->leaf_row, fn, i.get(), key.get(), name, custom,
                                         hooking ? Py_True : Py_False, hook_all ? Py_True : Py_False,
                                         nullptr));
      if (!r) return nullptr;
    }
  }
  // every key of this walk is indexed now; a leaf's key may name another leaf later
  PyObject* const edge_keys = self->edge_keys;
  for (Py_ssize_t k = 0; k < PyList_GET_SIZE(acc_edges.get()); ++k) {
    Py_ssize_t p = PyLong_AsSsize_t(PyList_GET_ITEM(acc_edges.get(), k));
    if (p < 0) return nullptr;
    PyObject* j = PyDict_GetItemWithError(index, PyList_GET_ITEM(edge_keys, p));
    if (j == nullptr && PyErr_Occurred()) return nullptr;
    PyObject* resolved = Py_None;
    if (j != nullptr) {  // -1 - j: an edge to an AccumulateGrad node, resolved (record._discover)
      long long at = PyLong_AsLongLong(j);
      if (at == -1 && PyErr_Occurred()) return nullptr;
      resolved = PyLong_FromLongLong(-1 - at);
      if (resolved == nullptr) return nullptr;
    } else {
      Py_INCREF(resolved);
    }
    if (PyList_SetItem(edge_keys, p, resolved) < 0) return nullptr;  // steals
  }
  return acc_known.release();
}

// The nodes a create_graph pass may run (the walk stops at ``stop`` keys) that have an index, no
// hook yet and no save of ours (see record._hook_for_pass), each handed to ``visit(walk, node,
// index)`` (false: a Python error is set). False when a root is not a node this file reads.
template <class Visit>
bool walk_pass(Walker* self, Walk& walk, PyObject* stop, Visit&& visit) {
  Ref seen(PySet_New(nullptr));
  if (!seen) return false;
  while (!walk.stack.empty()) {
    NodePtr node = std::move(walk.stack.back().first);
    Ref key(walk.stack.back().second);
    walk.stack.pop_back();
    int skip = PySet_Contains(seen.get(), key.get());
    if (skip == 0) skip = PySet_Contains(stop, key.get());
    if (skip < 0) return false;
    if (skip) continue;
    if (PySet_Add(seen.get(), key.get()) < 0) return false;
    walk.held.push_back(node);
    PyObject* i = PyDict_GetItemWithError(self->index, key.get());
    if (i == nullptr && PyErr_Occurred()) return false;
    if (i != nullptr) {
      int has = PySet_Contains(self->hooked, i);
      if (has == 0) has = PyDict_Contains(self->leaf_hooks, i);
      if (has == 0) has = PyDict_Contains(self->packed, key.get());
      if (has < 0) return false;
      if (!has && !visit(walk, node, i)) return false;
    }
    for (const auto& e : node->next_edges()) {
      if (!e.function) continue;
      Ref k(walk.key(e.function));
      if (!k) return false;
      int in_seen = PySet_Contains(seen.get(), k.get());
      if (in_seen < 0) return false;
      if (!in_seen) walk.stack.emplace_back(e.function, k.release());
    }
  }
  return true;
}

// unhooked(roots, keys, stop) -> [(fn, index)]: those nodes, for Python pre hooks; or
// NotImplemented as discover.
PyObject* walker_unhooked(Walker* self, PyObject* args) {
  PyObject *roots, *keys, *stop;
  if (!PyArg_ParseTuple(args, "OOO!", &roots, &keys, &PySet_Type, &stop)) return nullptr;
  if (!roots_args(roots, keys)) return nullptr;
  Walk walk(self);
  if (!walk.objects) return nullptr;
  if (!walk.push_roots(roots, keys)) Py_RETURN_NOTIMPLEMENTED;
  Ref out(PyList_New(0));
  if (!out) return nullptr;
  bool ok = walk_pass(self, walk, stop, [&](Walk& w, const NodePtr& node, PyObject* i) {
    PyObject* fn = w.object(node);
    if (fn == nullptr) return false;
    Ref pair(PyTuple_Pack(2, fn, i));
    return pair && PyList_Append(out.get(), pair.get()) == 0;
  });
  return ok ? out.release() : nullptr;
}

// hook_pass(roots, keys, stop, state, events) -> PassHooks: those nodes get the compiled pre hook
// (see NOTE [ compiled pass hooks ]); or NotImplemented as discover.
PyObject* hook_pass(Walker* self, PyObject* roots, PyObject* keys, PyObject* stop, PyObject* state,
                    PyObject* events) {
  if (!roots_args(roots, keys)) return nullptr;
  if (!PyObject_TypeCheck(state, gradscope_native::state_type())) {
    PyErr_SetString(PyExc_TypeError, "gradscope: hook_pass needs the hooks' State");
    return nullptr;
  }
  Walk walk(self);
  if (!walk.objects) return nullptr;
  if (!walk.push_roots(roots, keys)) Py_RETURN_NOTIMPLEMENTED;
  Ref made(PyType_GenericNew(&PassHooksType, nullptr, nullptr));
  if (!made) return nullptr;
  auto* hooks = reinterpret_cast<PassHooks*>(made.get());
  Py_INCREF(state);
  Py_INCREF(events);
  hooks->state = state;
  hooks->events = events;
  hooks->ctx = new std::shared_ptr<PassContext>(std::make_shared<PassContext>());
  (*hooks->ctx)->state = reinterpret_cast<gradscope_native::State*>(state);
  (*hooks->ctx)->events = events;
  hooks->added = new std::vector<std::pair<WeakNode, PassPre*>>();
  bool ok = walk_pass(self, walk, stop, [&](Walk&, const NodePtr& node, PyObject* i) {
    long long index = PyLong_AsLongLong(i);
    if (index == -1 && PyErr_Occurred()) return false;
    auto hook = std::make_unique<PassPre>(*hooks->ctx, index);
    PassPre* raw = hook.get();
    hooks->added->emplace_back(WeakNode(node), raw);
    node->add_pre_hook(std::move(hook));
    return true;
  });
  return ok ? made.release() : nullptr;
}

// roots(values, make) -> (roots, keys): record._walk's roots_of(values) and their node_keys
// (``make``), or keys_of(values) (not ``make``: roots is None, a leaf's node is not made); or
// NotImplemented for a value this file does not read (a GradientEdge, a tensor subclass: Python
// reads them).
PyObject* roots_keys(Walker* self, PyObject* values, int make) {
  Ref seq(PySequence_Fast(values, "gradscope: roots of a sequence"));
  if (!seq) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.get());
  PyObject** items = PySequence_Fast_ITEMS(seq.get());
  for (Py_ssize_t k = 0; k < n; ++k) {
    if (items[k] != Py_None && !THPVariable_CheckExact(items[k])) Py_RETURN_NOTIMPLEMENTED;
  }
  Ref roots(make ? PyList_New(0) : (Py_INCREF(Py_None), Py_None)), keys(PyList_New(0));
  if (!roots || !keys) return nullptr;
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* obj = items[k];
    if (obj == Py_None) continue;
    const at::Tensor& t = THPVariable_Unpack(obj);
    NodePtr fn;
    bool leaf = false;
    try {
      fn = NodePtr(t.grad_fn());
      leaf = !fn && t.requires_grad();
      if (leaf && make) fn = NodePtr(torch::autograd::impl::grad_accumulator(t));
    } catch (...) {
      Py_RETURN_NOTIMPLEMENTED;  // Python reads it (and skips what fails there)
    }
    if (!fn && !leaf) continue;  // no graph behind it
    Ref root(fn ? torch::autograd::functionToPyObject(fn) : (Py_INCREF(Py_None), Py_None));
    if (!root) return nullptr;
    Ref key;
    if (leaf) {
      key = Ref(PyObject_CallOneArg(self->leaf_key, obj));
    } else if (fn->sequence_nr() == kAccSeq) {  // a node without a number of its own (NotImplemented)
      key = Ref(PyObject_CallOneArg(self->node_key, root.get()));
    } else {
      key = Ref(PyLong_FromUnsignedLongLong(fn->sequence_nr()));
    }
    if (!key || PyList_Append(keys.get(), key.get()) < 0) return nullptr;
    if (make && PyList_Append(roots.get(), root.get()) < 0) return nullptr;
  }
  return PyTuple_Pack(2, roots.get(), keys.get());
}

// (index, storage key, data address, t1) appended to ``out`` for each tensor, as record._gradient_keys
// appends them (for pass_end); NotImplemented, with nothing appended, when one is not a plain tensor.
PyObject* storage_keys(PyObject* tensors, PyObject* index, PyObject* t1, PyObject* out) {
  Py_ssize_t n = PyList_GET_SIZE(tensors);
  for (Py_ssize_t k = 0; k < n; ++k) {
    if (!gradscope_native::plain_tensor(PyList_GET_ITEM(tensors, k))) Py_RETURN_NOTIMPLEMENTED;
  }
  for (Py_ssize_t k = 0; k < n; ++k) {
    const at::Tensor& t = THPVariable_Unpack(PyList_GET_ITEM(tensors, k));
    c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    Ref row(gradscope_native::untracked(Py_BuildValue("(OKKO)", index, static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(s)),
                          static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(s->data())), t1)));
    if (!row || PyList_Append(out, row.get()) < 0) return nullptr;
  }
  Py_RETURN_TRUE;
}

PyObject* walker_discover(Walker* self, PyObject* args) {
  PyObject *roots, *keys, *seq0, *types, *orders;
  int hooking, hook_all;
  if (!PyArg_ParseTuple(args, "OOppOO!O!", &roots, &keys, &hooking, &hook_all, &seq0, &PyDict_Type, &types,
                        &PyDict_Type, &orders))
    return nullptr;
  return discover(self, roots, keys, hooking, hook_all, seq0, types, orders);
}

PyObject* walker_hook_pass(Walker* self, PyObject* args) {
  PyObject *roots, *keys, *stop, *state, *events;
  if (!PyArg_ParseTuple(args, "OOO!OO!", &roots, &keys, &PySet_Type, &stop, &state, &PyList_Type, &events))
    return nullptr;
  return hook_pass(self, roots, keys, stop, state, events);
}

PyObject* walker_roots(Walker* self, PyObject* args) {
  PyObject* values;
  int make;
  if (!PyArg_ParseTuple(args, "Op", &values, &make)) return nullptr;
  return roots_keys(self, values, make);
}


// The node indices of ``keys`` that have one (a BackwardRow's roots and inputs).
PyObject* indices_of(Walker* self, PyObject* keys) {
  Ref out(PyList_New(0));
  if (!out) return nullptr;
  for (Py_ssize_t k = 0; k < PyList_GET_SIZE(keys); ++k) {
    PyObject* i = PyDict_GetItemWithError(self->index, PyList_GET_ITEM(keys, k));
    if (i == nullptr && PyErr_Occurred()) return nullptr;
    if (i != nullptr && PyList_Append(out.get(), i) < 0) return nullptr;
  }
  return out.release();
}

// NOTE [ a pass in two calls ]: where everything a backward's start needs is read here (the outputs
// and inputs are plain tensors or None), record._run_backward makes one call before the engine runs
// and one after, instead of one per piece (a graph of small ops runs a backward every few
// milliseconds: Python's calls between the pieces cost as much as a tenth of a pass's recording).
//
// pass_start(outputs, inputs, hook_pass, hooking, hook_all, seq0, types, orders, state, events) ->
// (acc_known, roots' indices, inputs' indices, PassHooks or None, roots, keys, input keys): roots and
// keys as roots(outputs, True), input keys as roots(inputs, False), then discover(roots, keys, ...),
// and where ``hook_pass``, hook_pass(roots, keys, set(input keys), state, events). NotImplemented,
// with nothing changed, where roots() would say so.
PyObject* walker_pass_start(Walker* self, PyObject* args) {
  PyObject *outputs, *inputs, *seq0, *types, *orders, *state, *events;
  int with_hooks, hooking, hook_all;
  if (!PyArg_ParseTuple(args, "OOpppOO!O!OO!", &outputs, &inputs, &with_hooks, &hooking, &hook_all, &seq0,
                        &PyDict_Type, &types, &PyDict_Type, &orders, &state, &PyList_Type, &events))
    return nullptr;
  Ref out_roots(roots_keys(self, outputs, 1));
  if (!out_roots || out_roots.get() == Py_NotImplemented) return out_roots.release();
  Ref in_roots(roots_keys(self, inputs, 0));
  if (!in_roots || in_roots.get() == Py_NotImplemented) return in_roots.release();
  PyObject* roots = PyTuple_GET_ITEM(out_roots.get(), 0);
  PyObject* keys = PyTuple_GET_ITEM(out_roots.get(), 1);
  PyObject* input_keys = PyTuple_GET_ITEM(in_roots.get(), 1);
  Ref acc_known(discover(self, roots, keys, hooking, hook_all, seq0, types, orders));
  if (!acc_known) return nullptr;
  if (acc_known.get() == Py_NotImplemented) {  // cannot be: the roots are nodes made here
    PyErr_SetString(PyExc_SystemError, "gradscope: a root the compiled walk made it cannot read");
    return nullptr;
  }
  Ref root_at(indices_of(self, keys)), input_at(indices_of(self, input_keys));
  if (!root_at || !input_at) return nullptr;
  Ref hooks(Py_None);
  Py_INCREF(Py_None);
  if (with_hooks) {
    Ref stop(PySet_New(input_keys));
    if (!stop) return nullptr;
    hooks = Ref(hook_pass(self, roots, keys, stop.get(), state, events));
    if (!hooks) return nullptr;
    if (hooks.get() == Py_NotImplemented) {  // cannot be (as above): Python hooks the pass instead
      Py_INCREF(Py_None);
      hooks = Ref(Py_None);
    }
  }
  return PyTuple_Pack(7, acc_known.get(), root_at.get(), input_at.get(), hooks.get(), roots, keys, input_keys);
}

// pass_end(tensors, index, t1, out, walk, hooking, hook_all, seq0, types, orders) -> acc_known, or
// None where ``walk`` is false: storage_keys(tensors, index, t1, out), then (``walk``: after a
// create_graph pass) discover from the tensors' nodes. NotImplemented, with nothing changed, where
// storage_keys or roots would say so (see NOTE [ a pass in two calls ]).
PyObject* walker_pass_end(Walker* self, PyObject* args) {
  PyObject *tensors, *index, *t1, *out, *seq0, *types, *orders;
  int walk, hooking, hook_all;
  if (!PyArg_ParseTuple(args, "O!OOO!pppOO!O!", &PyList_Type, &tensors, &index, &t1, &PyList_Type, &out, &walk,
                        &hooking, &hook_all, &seq0, &PyDict_Type, &types, &PyDict_Type, &orders))
    return nullptr;
  Ref found;
  if (walk) {  // read first: NotImplemented must leave the rows as they were
    found = Ref(roots_keys(self, tensors, 1));
    if (!found || found.get() == Py_NotImplemented) return found.release();
  }
  Ref stored(storage_keys(tensors, index, t1, out));
  if (!stored || stored.get() == Py_NotImplemented) return stored.release();
  if (!walk) Py_RETURN_NONE;
  return discover(self, PyTuple_GET_ITEM(found.get(), 0), PyTuple_GET_ITEM(found.get(), 1), hooking, hook_all, seq0,
                  types, orders);
}

PyMethodDef walker_methods[] = {
    {"pass_start", reinterpret_cast<PyCFunction>(walker_pass_start), METH_VARARGS,
     "What a backward's start needs, in one call (see NOTE [ a pass in two calls ])."},
    {"pass_end", reinterpret_cast<PyCFunction>(walker_pass_end), METH_VARARGS,
     "What a backward's end needs, in one call (see NOTE [ a pass in two calls ])."},
    {"roots", reinterpret_cast<PyCFunction>(walker_roots), METH_VARARGS,
     "The graph nodes behind values and their keys (gradscope._capture.walk's roots_of and keys_of)."},
    {"count_packed", reinterpret_cast<PyCFunction>(walker_count_packed), METH_NOARGS,
     "Count the saves made since the last count by their node number (record._packed)."},
    {"discover", reinterpret_cast<PyCFunction>(walker_discover), METH_VARARGS,
     "Walk from roots through nodes not walked before, appending their rows (record._discover)."},
    {"unhooked", reinterpret_cast<PyCFunction>(walker_unhooked), METH_VARARGS,
     "The nodes a create_graph pass may run that need a pre hook for it (record._hook_for_pass)."},
    {"hook_pass", reinterpret_cast<PyCFunction>(walker_hook_pass), METH_VARARGS,
     "Those nodes, given the compiled pre hook until the result's remove()."},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject WalkerType = {PyVarObject_HEAD_INIT(nullptr, 0)};

}  // namespace

int gradscope_add_walker(PyObject* module) {
  using gradscope_native::ready_type;
  if (ready_type(WalkerType, "gradscope._capture.native._hooks.Walker", Py_TPFLAGS_DEFAULT, walker_methods,
                 WalkerRefs::traverse, WalkerRefs::clear, WalkerRefs::dealloc, walker_init) < 0 ||
      ready_type(PassHooksType, "gradscope._capture.native._hooks.PassHooks", Py_TPFLAGS_DEFAULT, pass_methods,
                 pass_traverse, pass_clear, pass_dealloc) < 0)
    return -1;
  return gradscope_native::add_type(module, "Walker", WalkerType);
}
