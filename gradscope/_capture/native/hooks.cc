// gradscope's saved-tensor hooks, compiled: the same rows as the Python pair in capture/saves.py, made
// without a Python frame per save (see NOTE [ compiled hooks ] in gradscope/_capture/native/__init__.py).
//
// Every tensor this file does not know how to read exactly (a subclass, a tensor without a plain
// storage, anything that throws) is handed to the Python pack hook, so the rows are the Python
// pair's rows by construction; tests/test_native.py compares the two pairs row by row.

#include <Python.h>
#include <frameobject.h>
#include <structmember.h>

#include <ATen/SequenceNumber.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include "native.h"

#include <algorithm>
#include <atomic>
#include <ctime>
#include <functional>
#include <memory>
#include <mutex>
#include <initializer_list>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

// ------------------------------------------------------------------ the hooks' state (native.h)
using gradscope_native::Ref;
using gradscope_native::State;
using gradscope_native::time_ns;

#define GRADSCOPE_OBJECT_MEMBER(name) {#name, T_OBJECT, offsetof(State, name), 0, nullptr},
#define GRADSCOPE_INT_MEMBER(name) {#name, T_LONGLONG, offsetof(State, name), 0, nullptr},
PyMemberDef state_members[] = {
    GRADSCOPE_STATE_FIELDS(GRADSCOPE_OBJECT_MEMBER, GRADSCOPE_INT_MEMBER){nullptr, 0, 0, 0, nullptr}};
#undef GRADSCOPE_OBJECT_MEMBER
#undef GRADSCOPE_INT_MEMBER

#define GRADSCOPE_NOTHING(name)
int state_traverse(State* self, visitproc visit, void* arg) {
#define GRADSCOPE_VISIT(name) Py_VISIT(self->name);
  GRADSCOPE_STATE_FIELDS(GRADSCOPE_VISIT, GRADSCOPE_NOTHING)
#undef GRADSCOPE_VISIT
  return 0;
}

int state_clear(State* self) {
#define GRADSCOPE_CLEAR(name) Py_CLEAR(self->name);
  GRADSCOPE_STATE_FIELDS(GRADSCOPE_CLEAR, GRADSCOPE_NOTHING)
#undef GRADSCOPE_CLEAR
  return 0;
}
#undef GRADSCOPE_NOTHING

void state_dealloc(State* self) {
  PyObject_GC_UnTrack(self);
  state_clear(self);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyTypeObject StateType = {PyVarObject_HEAD_INIT(nullptr, 0)};

bool is_true(PyObject* o) {
  if (o == nullptr || o == Py_None || o == Py_False) return false;
  if (o == Py_True) return true;
  return PyObject_IsTrue(o) == 1;
}

// ------------------------------------------------------------------ the user's lines
// See NOTE [ where lines come from ] in gradscope/_model/lines.py: whether each code object's frames are
// folded, and the line index of each (code object, instruction offset) met, so that a save made
// where one was made before walks a few frames and reads two tables, without calling Python.
// Every code object in ``folded`` holds a reference (keys of ``at`` are among them).
struct CodeAt {
  size_t operator()(const std::pair<PyObject*, int>& k) const {
    return std::hash<PyObject*>()(k.first) * 31u + std::hash<int>()(k.second);
  }
};

struct LineCache {
  std::unordered_map<PyObject*, bool> folded;
  std::unordered_map<std::pair<PyObject*, int>, long long, CodeAt> at;
  ~LineCache() {
    for (auto& kv : folded) Py_DECREF(kv.first);
  }
};

int frame_offset(PyFrameObject* f) {
#if PY_VERSION_HEX >= 0x030B0000
  return PyFrame_GetLasti(f);
#else
  return PyFrame_GetLineNumber(f);
#endif
}

// ------------------------------------------------------------------ the hooks
struct Hooks {
  PyObject_HEAD
  PyObject* saves;          // list of rows (see gradscope._base.trace)
  PyObject* versions;       // list: each save's version when packed
  PyObject* info;           // dict: id of the packed value -> save index
  PyObject* weak;           // list of weak handles, or None when frees are not checked by handle
  PyObject* events;         // list of step events
  PyObject* pending;        // list: saves unpacked since frees were last checked
  State* state;
  PyObject* fallback;       // the Python pack hook: packs every tensor this file would not read exactly
  PyObject* check_frees;    // callable, or None where frees are checked once a pass
  PyObject* inplace_error;  // callable(tensor, expected version) -> the exception to raise
  PyObject* watch;          // callable(packed alias), or None: a memory source that follows each alias
  PyObject* lines;          // list: each save's line index (gradscope._base.trace), or None: no lines
  PyObject* line_table;     // gradscope._model.lines.LineTable, or None
  PyObject* storages;       // dict: storage key -> (its first save, weak handle): NOTE [ a storage's identity in a block ]
  PyObject* storage_ids;    // list: each save's storage identity (the storage's first save)
  PyObject* sweep;          // callable: lets go of the entries of storages that died
  PyObject* again;          // the class of a tensor packed again (NOTE [ one object saved twice ])
  int need_ptr;
  int need_time;
  long long line_seq;       // the node of the last save given a line, and that line
  long long line_id;
  LineCache* line_cache;
  Py_ssize_t sweep_at;      // the size of storages at which its dead entries are let go of
  Py_ssize_t base;          // the block's saves before this piece of it (storage identities count them)
};

constexpr Py_ssize_t kStorageSweep = 4096;  // capture/saves.py's _STORAGE_SWEEP

using HooksRefs = gradscope_native::OwnedRefs<Hooks, 17, &Hooks::saves>;  // saves .. again
static_assert(offsetof(Hooks, again) == offsetof(Hooks, saves) + 16 * sizeof(PyObject*));

void hooks_dealloc(Hooks* self) {
  delete std::exchange(self->line_cache, nullptr);
  HooksRefs::dealloc(self);
}

// Whether frames of ``code`` are folded (asked of the line table once per code object); -1: error.
int code_folded(Hooks* self, PyObject* code) {
  auto& folded = self->line_cache->folded;
  auto it = folded.find(code);
  if (it != folded.end()) return it->second ? 1 : 0;
  Ref r(PyObject_CallMethod(self->line_table, "is_folded", "O", code));
  if (!r) return -1;
  int v = PyObject_IsTrue(r.get());
  if (v < 0) return -1;
  Py_INCREF(code);
  folded.emplace(code, v == 1);
  return v;
}

// The line index of the innermost frame that is not folded (-1: none); -2: error raised.
long long find_line(Hooks* self) {
  PyFrameObject* top = PyEval_GetFrame();  // borrowed
  Py_XINCREF(top);
  PyFrameObject* f = top;
  Py_XINCREF(f);
  long long found = -1;
  while (f != nullptr) {
    PyObject* code = reinterpret_cast<PyObject*>(PyFrame_GetCode(f));  // new reference
    int folded = code_folded(self, code);
    if (folded < 0) {
      found = -2;
    } else if (folded == 0) {
      auto key = std::make_pair(code, frame_offset(f));
      auto& at = self->line_cache->at;
      auto it = at.find(key);
      if (it != at.end()) {
        found = it->second;
      } else {
        Ref r(PyObject_CallMethod(self->line_table, "intern", "OO", f, top));
        found = r ? PyLong_AsLongLong(r.get()) : -2;
        if (found == -1 && PyErr_Occurred()) found = -2;
        if (found >= 0) at.emplace(key, found);
      }
    }
    Py_DECREF(code);
    if (folded != 1) break;
    PyFrameObject* back = PyFrame_GetBack(f);  // new reference
    Py_DECREF(f);
    f = back;
  }
  Py_XDECREF(f);
  Py_XDECREF(top);
  return found;
}

// The line of a save of node ``seq``: the last save's when it was the same node's (see NOTE [ where
// lines come from ]); -1 where none is known (a failure to find one is no failure to pack).
long long save_line(Hooks* self, long long seq) {
  if (seq == self->line_seq) return self->line_id;
  long long line = find_line(self);
  if (line == -2) {
    PyErr_Clear();
    line = -1;
  }
  self->line_seq = seq;
  self->line_id = line;
  return line;
}

int hooks_init(Hooks* self, PyObject* args, PyObject* kwds) {
  PyObject *saves, *versions, *info, *weak, *events, *pending, *state, *fallback, *check_frees, *inplace_error,
      *watch, *lines, *line_table, *storages, *storage_ids, *sweep, *again;
  int need_ptr, need_time;
  Py_ssize_t base;
  if (!PyArg_ParseTuple(args, "O!O!O!OO!O!O!OOOppOOOO!O!OO!n", &PyList_Type, &saves, &PyList_Type, &versions,
                        &PyDict_Type, &info, &weak, &PyList_Type, &events, &PyList_Type, &pending, &StateType, &state,
                        &fallback, &check_frees, &inplace_error, &need_ptr, &need_time, &watch, &lines, &line_table,
                        &PyDict_Type, &storages, &PyList_Type, &storage_ids, &sweep, &PyType_Type, &again, &base))
    return -1;
  if (weak != Py_None && !PyList_Check(weak)) {
    PyErr_SetString(PyExc_TypeError, "weak: a list or None");
    return -1;
  }
  if ((lines == Py_None) != (line_table == Py_None) || (lines != Py_None && !PyList_Check(lines))) {
    PyErr_SetString(PyExc_TypeError, "lines: a list and a line table, or None and None");
    return -1;
  }
  PyObject* olds[] = {self->saves, self->versions, self->info, self->weak, self->events,
                      self->pending, reinterpret_cast<PyObject*>(self->state), self->fallback,
                      self->check_frees, self->inplace_error, self->watch, self->lines, self->line_table,
                      self->storages, self->storage_ids, self->sweep, self->again};
  Py_INCREF(saves), Py_INCREF(versions), Py_INCREF(info), Py_INCREF(weak), Py_INCREF(events);
  Py_INCREF(pending), Py_INCREF(state), Py_INCREF(fallback), Py_INCREF(check_frees), Py_INCREF(inplace_error);
  Py_INCREF(watch), Py_INCREF(lines), Py_INCREF(line_table);
  Py_INCREF(storages), Py_INCREF(storage_ids), Py_INCREF(sweep), Py_INCREF(again);
  self->watch = watch, self->lines = lines, self->line_table = line_table;
  self->storages = storages, self->storage_ids = storage_ids, self->sweep = sweep, self->again = again;
  self->sweep_at = std::max(kStorageSweep, 2 * PyDict_GET_SIZE(storages));
  self->base = base;
  self->line_seq = -2;  // no node: -1 is a counter at 0 minus one
  self->line_id = -1;
  delete self->line_cache;
  self->line_cache = new LineCache();
  self->saves = saves, self->versions = versions, self->info = info, self->weak = weak, self->events = events;
  self->pending = pending, self->state = reinterpret_cast<State*>(state), self->fallback = fallback;
  self->check_frees = check_frees, self->inplace_error = inplace_error;
  self->need_ptr = need_ptr, self->need_time = need_time;
  for (PyObject* o : olds) Py_XDECREF(o);
  return 0;
}

// One device object per device for every row (rows compare devices by value; each would
// otherwise hold a new one), held for the process's lifetime.
PyObject* device_object(const c10::Device& device) {
  static std::unordered_map<c10::Device, PyObject*> made;
  auto it = made.find(device);
  if (it != made.end()) {
    Py_INCREF(it->second);
    return it->second;
  }
  PyObject* d = THPDevice_New(device);
  if (d == nullptr) return nullptr;
  Py_INCREF(d);
  made.emplace(device, d);
  return d;
}

// A tuple of new references, untracked (see NOTE [ rows the collector does not track ] in
// native.h); nullptr where one is (those made are released).
PyObject* untracked_tuple(std::initializer_list<PyObject*> items) {
  bool ok = true;
  for (PyObject* o : items) ok = ok && o != nullptr;
  PyObject* tuple = ok ? PyTuple_New(static_cast<Py_ssize_t>(items.size())) : nullptr;
  if (tuple == nullptr) {
    for (PyObject* o : items) Py_XDECREF(o);
    return nullptr;
  }
  Py_ssize_t k = 0;
  for (PyObject* o : items) PyTuple_SET_ITEM(tuple, k++, o);
  return gradscope_native::untracked(tuple);
}

// The identity of storage ``s`` (key ``key``) in the block, as a new reference: its first save's index,
// ``sid`` for a storage met first now (see NOTE [ a storage's identity in a block ] in capture/saves.py,
// which this makes exactly). nullptr: an error raised.
PyObject* storage_serial(Hooks* self, PyObject* key, c10::StorageImpl* s, Py_ssize_t sid) {
  PyObject* known = PyDict_GetItemWithError(self->storages, key);  // borrowed
  if (known != nullptr) {
    PyObject* first = PyTuple_GET_ITEM(known, 0);
    Py_INCREF(first);
    return first;
  }
  if (PyErr_Occurred()) return nullptr;
  if (PyDict_GET_SIZE(self->storages) >= self->sweep_at) {
    Ref r(PyObject_CallNoArgs(self->sweep));
    if (!r) return nullptr;
    self->sweep_at = std::max(kStorageSweep, 2 * PyDict_GET_SIZE(self->storages));
  }
  PyObject* first = PyLong_FromSsize_t(self->base + sid);
  if (first == nullptr) return nullptr;
  // the same handle as UntypedStorage._weak_ref(): the StorageImpl, one weak count more
  c10::StorageImpl* weak = c10::raw::intrusive_ptr::make_weak(s);
  PyObject* handle = PyLong_FromVoidPtr(weak);
  if (handle == nullptr) {
    c10::raw::weak_intrusive_ptr::decref(weak);
    Py_DECREF(first);
    return nullptr;
  }
  Ref entry(gradscope_native::untracked(PyTuple_Pack(2, first, handle)));
  Py_DECREF(handle);
  if (!entry || PyDict_SetItem(self->storages, key, entry.get()) < 0) {
    c10::raw::weak_intrusive_ptr::decref(weak);
    Py_DECREF(first);
    return nullptr;
  }
  return first;
}

PyObject* pack_plain(Hooks* self, PyObject* obj) {
  const at::Tensor& t = THPVariable_Unpack(obj);
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  Py_ssize_t sid = PyList_GET_SIZE(self->saves);
  long long seq = static_cast<long long>(at::sequence_number::peek()) - 1;
  auto sizes = t.sizes();
  PyObject* shape = PyTuple_New(static_cast<Py_ssize_t>(sizes.size()));
  if (shape == nullptr) return nullptr;
  for (size_t i = 0; i < sizes.size(); ++i) {
    PyObject* n = PyLong_FromLongLong(sizes[i]);
    if (n == nullptr) {
      Py_DECREF(shape);
      return nullptr;
    }
    PyTuple_SET_ITEM(shape, static_cast<Py_ssize_t>(i), n);
  }
  gradscope_native::untracked(shape);
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
  Py_XINCREF(dtype);
  PyObject* leaf = t.grad_fn() ? Py_False : Py_True;
  Py_INCREF(leaf);
  PyObject* row = untracked_tuple(
      {PyLong_FromLongLong(seq), PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(s))),
       PyLong_FromUnsignedLongLong(self->need_ptr ? static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(s->data())) : 0ULL),
       PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(s->nbytes())), shape, dtype,
       device_object(t.device()), PyLong_FromLongLong(self->need_time ? time_ns() : static_cast<long long>(sid)),
       leaf});
  if (row == nullptr) return nullptr;  // untracked_tuple released the items either way
  PyObject* version = PyLong_FromLongLong(static_cast<long long>(t._version()));
  PyObject* line = nullptr;
  if (self->lines != Py_None) {
    line = PyLong_FromLongLong(save_line(self, seq));
    if (line == nullptr) {
      Py_DECREF(row);
      Py_XDECREF(version);
      return nullptr;
    }
  }
  Ref serial(storage_serial(self, PyTuple_GET_ITEM(row, 1), s, sid));
  if (!serial) {
    Py_DECREF(row);
    Py_XDECREF(version);
    Py_XDECREF(line);
    return nullptr;
  }
  // NOTE [ a save that needs no detaching ] in capture/saves.py: the object itself, or where its id
  // names another save, the object in a _SavedAgain (NOTE [ one object saved twice ] there)
  PyObject* packed = nullptr;
  if (!t.requires_grad()) {
    PyObject* own = PyLong_FromVoidPtr(obj);
    PyObject* prev = own != nullptr ? PyDict_GetItemWithError(self->info, own) : nullptr;  // borrowed
    Py_XDECREF(own);
    if (own == nullptr || (prev == nullptr && PyErr_Occurred())) {
      Py_DECREF(row);
      Py_XDECREF(version);
      Py_XDECREF(line);
      return nullptr;
    }
    bool free_id = prev == nullptr;
    if (prev != nullptr && prev != Py_None) {
      Py_ssize_t p = PyLong_AsSsize_t(prev);
      if (p < 0 && PyErr_Occurred()) PyErr_Clear();
      free_id = p < 0 || p >= sid || p >= PyList_GET_SIZE(self->storage_ids) ||
                PyObject_RichCompareBool(PyList_GET_ITEM(self->storage_ids, p), serial.get(), Py_NE) == 1;
    }
    packed = free_id ? (Py_INCREF(obj), obj) : PyObject_CallOneArg(self->again, obj);
    if (packed == nullptr) {
      Py_DECREF(row);
      Py_XDECREF(version);
      Py_XDECREF(line);
      return nullptr;
    }
  }
  // The detached alias (same storage, sizes, strides and version counter; no autograd meta) made
  // from the TensorImpl itself: t.detach() is an operator, and a plain TensorImpl's copy asks the
  // innermost dispatch mode to detach while one is active, so that a dispatch mode of the
  // program's would see an op of ours at every save. With the Python key excluded, the copy is
  // the TensorImpl's own (a plain tensor: see plain_tensor).
  if (packed == nullptr) {
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    c10::intrusive_ptr<c10::TensorImpl> copy;
    {
      c10::impl::ExcludeDispatchKeyGuard no_modes(c10::DispatchKey::Python);
      copy = impl->shallow_copy_and_detach(impl->version_counter(), impl->allow_tensor_metadata_change());
    }
    packed = THPVariable_Wrap(at::Tensor(std::move(copy)));
    // the tracker sees no op making the alias: it is told, to follow its storage's last holder
    if (packed != nullptr && self->watch != Py_None) {
      PyObject* r = PyObject_CallOneArg(self->watch, packed);
      if (r == nullptr) {
        Py_DECREF(packed);
        Py_DECREF(row);
        Py_XDECREF(version);
        Py_XDECREF(line);
        return nullptr;
      }
      Py_DECREF(r);
    }
  }
  PyObject* id = packed != nullptr ? PyLong_FromVoidPtr(packed) : nullptr;
  PyObject* index = PyLong_FromSsize_t(sid);
  PyObject* handle = nullptr;
  bool ok = version != nullptr && packed != nullptr && id != nullptr && index != nullptr;
  if (ok && self->weak != Py_None) {
    // the same handle as UntypedStorage._weak_ref(): the StorageImpl, one weak count more
    handle = PyLong_FromVoidPtr(c10::raw::intrusive_ptr::make_weak(s));
    ok = handle != nullptr;
  }
  // nothing may fail once a list has grown: the lists are indexed by save
  ok = ok && PyDict_SetItem(self->info, id, index) == 0 && PyList_Append(self->saves, row) == 0 &&
       PyList_Append(self->versions, version) == 0 && PyList_Append(self->storage_ids, serial.get()) == 0 &&
       (handle == nullptr || PyList_Append(self->weak, handle) == 0) &&
       (line == nullptr || PyList_Append(self->lines, line) == 0);
  Py_DECREF(row);
  Py_XDECREF(version);
  Py_XDECREF(line);
  Py_XDECREF(id);
  Py_XDECREF(index);
  Py_XDECREF(handle);
  if (!ok) {
    Py_XDECREF(packed);
    return nullptr;
  }
  return packed;
}

PyObject* hooks_pack(Hooks* self, PyObject* obj) {
  if (gradscope_native::plain_tensor(obj)) {
    Py_ssize_t n = PyList_GET_SIZE(self->saves);
    try {
      PyObject* r = pack_plain(self, obj);
      if (r != nullptr) return r;
    } catch (...) {
    }
    // the lists did not grow (see pack_plain): the Python hook packs it instead
    if (PyList_GET_SIZE(self->saves) != n) {
      PyErr_SetString(PyExc_SystemError, "gradscope: a compiled pack hook left a row half made");
      return nullptr;
    }
    PyErr_Clear();
  }
  return PyObject_CallOneArg(self->fallback, obj);
}

PyObject* hooks_unpack(Hooks* self, PyObject* packed) {
  PyObject* id = PyLong_FromVoidPtr(packed);
  if (id == nullptr) return nullptr;
  PyObject* index = PyDict_GetItemWithError(self->info, id);  // borrowed
  Py_DECREF(id);
  if (index == nullptr && PyErr_Occurred()) return nullptr;
  Ref opened;  // see NOTE [ one object saved twice ] in capture/saves.py
  if (Py_TYPE(packed) == reinterpret_cast<PyTypeObject*>(self->again)) {
    opened = Ref(PyObject_GetAttrString(packed, "tensor"));
    if (!opened) return nullptr;
  }
  PyObject* t = opened ? opened.get() : packed;
  if (index == nullptr || index == Py_None) {  // packed while observing failed
    Py_INCREF(t);
    return t;
  }
  Py_ssize_t sid = PyLong_AsSsize_t(index);
  if (sid < 0 || sid >= PyList_GET_SIZE(self->versions)) {
    PyErr_SetString(PyExc_SystemError, "gradscope: an unpacked save has no row");
    return nullptr;
  }
  // NOTE [ in-place checks ] in capture/saves.py
  PyObject* expected = PyList_GET_ITEM(self->versions, sid);
  long long version;
  if (THPVariable_Check(t)) {
    version = static_cast<long long>(THPVariable_Unpack(t)._version());
  } else {
    PyObject* v = PyObject_GetAttrString(t, "_version");
    if (v == nullptr) return nullptr;
    version = PyLong_AsLongLong(v);
    Py_DECREF(v);
  }
  if (version != PyLong_AsLongLong(expected)) {
    PyObject* e = PyObject_CallFunctionObjArgs(self->inplace_error, t, expected, nullptr);
    if (e != nullptr) {
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(e)), e);
      Py_DECREF(e);
    }
    return nullptr;
  }
  State* st = self->state;
  if (st->bw != nullptr && st->bw != Py_None) {
    if (is_true(st->marks)) {
      // the save's node, as the graph walk may have moved it (see _reattribute)
      PyObject* row = PyList_GET_ITEM(self->saves, sid);
      long long node = PyLong_AsLongLong(PyTuple_GET_ITEM(row, 0));
      if (node != st->last_seq) {
        if (PyList_GET_SIZE(self->pending) && self->check_frees != Py_None) {
          PyObject* r = PyObject_CallNoArgs(self->check_frees);
          if (r == nullptr) return nullptr;
          Py_DECREF(r);
        }
        st->last_seq = node;
        // the counter as the node starts: see NOTE [ orders ] in gradscope._passes.steps
        PyObject* ev = gradscope_native::untracked(Py_BuildValue(
            "(inLK)", 0, sid, time_ns(), static_cast<unsigned long long>(at::sequence_number::peek())));
        if (ev == nullptr) return nullptr;
        int rc = PyList_Append(self->events, ev);
        Py_DECREF(ev);
        if (rc) return nullptr;
      }
    }
    if (self->weak != Py_None && PyList_Append(self->pending, index)) return nullptr;
  } else if (st->reading != nullptr && st->reading != Py_None) {
    if (PyList_Append(st->reading, index)) return nullptr;
  }
  Py_INCREF(t);
  return t;
}

// UntypedStorage._expired and _free_weak_ref, on the handles pack_plain and _weak_ref make
bool expired(PyObject* handle) {
  auto* s = static_cast<c10::StorageImpl*>(PyLong_AsVoidPtr(handle));
  return c10::raw::weak_intrusive_ptr::use_count(s) == 0;
}

void free_handle(PyObject* handle) {
  c10::raw::weak_intrusive_ptr::decref(static_cast<c10::StorageImpl*>(PyLong_AsVoidPtr(handle)));
}

int append_freed(PyObject* events, Py_ssize_t ident, Py_ssize_t value) {
  PyObject* ev = gradscope_native::untracked(Py_BuildValue("(innn)", 3, ident, 0, value));  // EV_FREED
  if (ev == nullptr) return -1;
  int rc = PyList_Append(events, ev);
  Py_DECREF(ev);
  return rc;
}

// check_frees_at_end of capture/saves.py (see NOTE [ frees checked once a pass ] there), the same events in
// the same order
PyObject* hooks_frees_at_end(Hooks* self, PyObject* /*unused*/) {
  PyObject* pending = self->pending;
  if (self->weak == Py_None) return PyErr_Format(PyExc_SystemError, "gradscope: frees without handles");
  Py_ssize_t n = PyList_GET_SIZE(pending);
  std::vector<Py_ssize_t> qs(n);
  std::vector<unsigned long long> keys(n);
  std::unordered_set<unsigned long long> distinct;
  for (Py_ssize_t j = 0; j < n; ++j) {
    qs[j] = PyLong_AsSsize_t(PyList_GET_ITEM(pending, j));
    if (qs[j] < 0 || qs[j] >= PyList_GET_SIZE(self->saves) || qs[j] >= PyList_GET_SIZE(self->weak))
      return PyErr_Format(PyExc_SystemError, "gradscope: a pending save has no row");
    keys[j] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(PyList_GET_ITEM(self->saves, qs[j]), 1));
    distinct.insert(keys[j]);
  }
  if (PyErr_Occurred()) return nullptr;
  PyObject* weak = self->weak;
  if (static_cast<Py_ssize_t>(distinct.size()) == n) {  // each storage unpacked once
    for (Py_ssize_t j = 0; j < n; ++j) {
      PyObject* ref = PyList_GET_ITEM(weak, qs[j]);
      if (ref != Py_None && expired(ref)) {
        if (append_freed(self->events, qs[j], qs[j])) return nullptr;
        Py_INCREF(ref);
        Py_INCREF(Py_None);
        PyList_SetItem(weak, qs[j], Py_None);
        free_handle(ref);
        Py_DECREF(ref);
      }
    }
  } else {
    struct Last {
      Py_ssize_t q_last, q_new;
      bool dead;
    };
    std::unordered_map<unsigned long long, size_t> at;
    std::vector<Last> order;
    for (Py_ssize_t j = n - 1; j >= 0; --j) {
      auto it = at.find(keys[j]);
      if (it == at.end()) {
        PyObject* ref = PyList_GET_ITEM(weak, qs[j]);
        at.emplace(keys[j], order.size());
        order.push_back({qs[j], qs[j], ref != Py_None && expired(ref)});
      } else if (qs[j] > order[it->second].q_new) {
        order[it->second].q_new = qs[j];
      }
    }
    for (const Last& e : order)
      if (e.dead && append_freed(self->events, e.q_new, e.q_last)) return nullptr;
    for (Py_ssize_t j = 0; j < n; ++j) {
      PyObject* ref = PyList_GET_ITEM(weak, qs[j]);
      if (ref != Py_None && order[at[keys[j]]].dead) {
        Py_INCREF(ref);
        Py_INCREF(Py_None);
        PyList_SetItem(weak, qs[j], Py_None);
        free_handle(ref);
        Py_DECREF(ref);
      }
    }
  }
  if (PyList_SetSlice(pending, 0, n, nullptr)) return nullptr;
  Py_RETURN_NONE;
}

// record._free_weak_refs: every weak handle the pack hook made is let go of, the list emptied.
PyObject* hooks_free_handles(Hooks* self, PyObject* /*unused*/) {
  PyObject* weak = self->weak;
  if (weak == Py_None) Py_RETURN_NONE;
  Ref handles(PyList_GetSlice(weak, 0, PyList_GET_SIZE(weak)));
  if (!handles || PyList_SetSlice(weak, 0, PyList_GET_SIZE(weak), nullptr) < 0) return nullptr;
  for (Py_ssize_t j = 0; j < PyList_GET_SIZE(handles.get()); ++j) {
    PyObject* ref = PyList_GET_ITEM(handles.get(), j);
    if (ref != Py_None) free_handle(ref);
  }
  Py_RETURN_NONE;
}

PyMethodDef hooks_methods[] = {
    {"frees_at_end", reinterpret_cast<PyCFunction>(hooks_frees_at_end), METH_NOARGS,
     "Frees of the saves a pass unpacked, checked when it ends."},
    {"free_handles", reinterpret_cast<PyCFunction>(hooks_free_handles), METH_NOARGS,
     "Let go of every weak handle the pack hook made (record._free_weak_refs)."},
    {"pack", reinterpret_cast<PyCFunction>(hooks_pack), METH_O, "The pack hook."},
    {"unpack", reinterpret_cast<PyCFunction>(hooks_unpack), METH_O, "The unpack hook."},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject HooksType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// ------------------------------------------------------------------ module hooks
// NOTE [ compiled module hooks ]: record._mod_pre and record._mod_post, for a block whose memory
// source does not mark module calls (memory="off", or a source that reads no call): a call's row
// and the module stack in the hooks' state, the graph roots a module's output gives, as the Python
// pair makes them. A module seen first as the stack's bottom is handed to the recorder's _root_of
// (Python: it names the module's parameters). An error in either is handed to the recorder's
// _internal, as the Python pair does. A call from another thread is not the block's; a compiler
// tracing a module never gets here (record._outside_compilers tests that in Python, where the
// compiler reads the test).
struct ModHooks {
  PyObject_HEAD
  State* state;
  PyObject* calls;         // list of call rows (gradscope._base.trace)
  PyObject* module_paths;  // list, per root module: dict id(module) -> its path
  PyObject* root_of;       // callable(module) -> the root's index
  PyObject* roots;         // list of weak references to results that may root a graph
  PyObject* internal;      // callable(exception)
  unsigned long tid;
};

using ModRefs = gradscope_native::OwnedRefs<ModHooks, 6, &ModHooks::state>;  // state .. internal
static_assert(offsetof(ModHooks, internal) == offsetof(ModHooks, state) + 5 * sizeof(PyObject*));

int mod_init(ModHooks* self, PyObject* args, PyObject*) {
  PyObject *state, *calls, *paths, *root_of, *roots, *internal;
  unsigned long tid;
  if (!PyArg_ParseTuple(args, "O!O!O!OO!Ok", &StateType, &state, &PyList_Type, &calls, &PyList_Type, &paths,
                        &root_of, &PyList_Type, &roots, &internal, &tid))
    return -1;
  PyObject* in[] = {state, calls, paths, root_of, roots, internal};
  for (PyObject* o : in) Py_INCREF(o);
  ModRefs::clear(self);
  self->state = reinterpret_cast<State*>(state);
  self->calls = calls, self->module_paths = paths, self->root_of = root_of, self->roots = roots;
  self->internal = internal, self->tid = tid;
  return 0;
}

// An error inside a hook: to the recorder's _internal (it re-raises a budget's error).
PyObject* mod_failed(ModHooks* self) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb != nullptr) PyException_SetTraceback(value, tb);
  PyObject* r = PyObject_CallOneArg(self->internal, value != nullptr ? value : Py_None);
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  if (r == nullptr) return nullptr;
  Py_DECREF(r);
  Py_RETURN_NONE;
}

PyObject* class_name(PyObject* obj) { return PyObject_GetAttrString(reinterpret_cast<PyObject*>(Py_TYPE(obj)), "__name__"); }

PyObject* seq_now() { return PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(at::sequence_number::peek())); }

PyObject* mod_pre(ModHooks* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "gradscope: a module pre hook takes (module, args)");
    return nullptr;
  }
  if (PyThread_get_thread_ident() != self->tid) Py_RETURN_NONE;
  PyObject* module = args[0];
  PyObject* stack = self->state->stack;
  if (stack == nullptr || !PyList_Check(stack)) {
    PyErr_SetString(PyExc_TypeError, "gradscope: the module stack is a list");
    return mod_failed(self);
  }
  PyObject *root = nullptr, *parent_rel = nullptr;  // new references
  Py_ssize_t depth = PyList_GET_SIZE(stack);
  if (depth > 0) {
    PyObject* parent = PySequence_GetItem(PyList_GET_ITEM(stack, depth - 1), 1);
    if (parent == nullptr) return mod_failed(self);
    root = PySequence_GetItem(parent, 0);
    parent_rel = root == nullptr ? nullptr : PySequence_GetItem(parent, 1);
    Py_DECREF(parent);
    if (parent_rel == nullptr) {
      Py_XDECREF(root);
      return mod_failed(self);
    }
  } else {
    root = PyObject_CallOneArg(self->root_of, module);
    if (root == nullptr) return mod_failed(self);
    Py_INCREF(Py_None);
    parent_rel = Py_None;
  }
  PyObject *paths = nullptr, *ident = nullptr, *rel = nullptr, *cls = nullptr, *call = nullptr, *entry = nullptr;
  bool ok = false;
  do {
    paths = PyObject_GetItem(self->module_paths, root);
    if (paths == nullptr) break;
    ident = PyLong_FromVoidPtr(module);
    if (ident == nullptr) break;
    rel = PyObject_GetItem(paths, ident);
    if (rel == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_KeyError)) break;
      PyErr_Clear();
    } else if (rel == Py_None) {
      Py_CLEAR(rel);
    }
    cls = class_name(module);
    if (cls == nullptr) break;
    if (rel == nullptr) {
      int plain = parent_rel == Py_None;
      if (!plain) {
        plain = PyUnicode_Check(parent_rel) && PyUnicode_GET_LENGTH(parent_rel) == 0;
      }
      if (plain) {
        Py_INCREF(cls);
        rel = cls;
      } else {
        rel = PyUnicode_FromFormat("%S.%U", parent_rel, cls);
        if (rel == nullptr) break;
      }
    }
    Py_ssize_t idx = PyList_GET_SIZE(self->calls);
    call = Py_BuildValue("[OONiLiNO]", root, rel, seq_now(), -1, time_ns(), 0, PyLong_FromSsize_t(idx), cls);
    if (call == nullptr || PyList_Append(self->calls, call) < 0) break;
    entry = PyTuple_Pack(3, module, call, Py_None);
    if (entry == nullptr || PyList_Append(stack, entry) < 0) break;
    ok = true;
  } while (false);
  Py_XDECREF(root);
  Py_XDECREF(parent_rel);
  Py_XDECREF(paths);
  Py_XDECREF(ident);
  Py_XDECREF(rel);
  Py_XDECREF(cls);
  Py_XDECREF(call);
  Py_XDECREF(entry);
  if (!ok) return mod_failed(self);
  Py_RETURN_NONE;
}

PyObject* mod_post(ModHooks* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 3) {
    PyErr_SetString(PyExc_TypeError, "gradscope: a module hook takes (module, args, output)");
    return nullptr;
  }
  if (PyThread_get_thread_ident() != self->tid) Py_RETURN_NONE;
  PyObject* module = args[0];
  PyObject* output = args[2];
  PyObject* stack = self->state->stack;
  if (stack == nullptr || !PyList_Check(stack)) {
    PyErr_SetString(PyExc_TypeError, "gradscope: the module stack is a list");
    return mod_failed(self);
  }
  while (PyList_GET_SIZE(stack) > 0) {
    Py_ssize_t last = PyList_GET_SIZE(stack) - 1;
    PyObject* entry = PyList_GET_ITEM(stack, last);
    Py_INCREF(entry);
    if (PyList_SetSlice(stack, last, last + 1, nullptr) < 0) {
      Py_DECREF(entry);
      return mod_failed(self);
    }
    PyObject* m = PySequence_GetItem(entry, 0);
    PyObject* call = m == nullptr ? nullptr : PySequence_GetItem(entry, 1);
    Py_DECREF(entry);
    if (call == nullptr) {
      Py_XDECREF(m);
      return mod_failed(self);
    }
    // the row's seq1 and t1 (gradscope._base.trace C_SEQ1, C_T1)
    bool failed = !PyList_Check(call) || PyList_GET_SIZE(call) < 6;
    if (failed) PyErr_SetString(PyExc_TypeError, "gradscope: a module call's row is a list");
    PyObject* seq = failed ? nullptr : seq_now();
    PyObject* t1 = seq == nullptr ? nullptr : PyLong_FromLongLong(time_ns());
    if (t1 == nullptr) {
      Py_XDECREF(seq);
      failed = true;
    } else {
      PyList_SetItem(call, 3, seq);  // steals
      PyList_SetItem(call, 5, t1);
    }
    Py_DECREF(call);
    bool done = m == module;
    Py_DECREF(m);
    if (failed) return mod_failed(self);
    if (done) break;
  }
  // plain tensors only: a compiler tracing the module (fake tensors) makes no graph of ours
  if (THPVariable_CheckExact(output) && THPVariable_Unpack(output).grad_fn()) {
    PyObject* ref = PyWeakref_NewRef(output, nullptr);
    if (ref == nullptr || PyList_Append(self->roots, ref) < 0) {
      Py_XDECREF(ref);
      return mod_failed(self);
    }
    Py_DECREF(ref);
  }
  Py_RETURN_NONE;
}

PyMethodDef mod_methods[] = {
    {"pre", reinterpret_cast<PyCFunction>(mod_pre), METH_FASTCALL, "The global module forward pre hook."},
    {"post", reinterpret_cast<PyCFunction>(mod_post), METH_FASTCALL, "The global module forward hook."},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject ModHooksType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// ------------------------------------------------------------------ the CPU allocator's counter
// NOTE [ the allocator's counter ]: PyTorch's CPU allocator reports every allocation and free (with
// its size and address) to the memory reporter of the thread's profiler state, while that state says
// memory profiling is on; the profiler keeps every report until it stops (about 6 KB a step of a small
// MLP), which a long loop cannot afford. This state takes the profiler's place while a loop's later
// iterations record (see NOTE [ a long loop's memory ] in gradscope/memory.py): it keeps the reports
// since the recorder last drained them (the time, the bytes, the address and the autograd sequence
// counter, four numbers) and the live total, and says to the rest of PyTorch that no profiler runs
// (its configuration is the disabled one, so a profiler the program starts inside the block works as
// without it, on top of it). Reports come without the GIL, from any thread the state was propagated to.
//
// The same counter measures the diagnosis's runs of a step on CPU copies (see NOTE [ the CPU allocator
// counts a run ] in gradscope/_analyses/diagnose/counts.py), made as ``Counter(True)``: a run's counter keeps no
// reports, only the sizes of the allocations it counted, and counts the free of those alone (a free of
// what existed before, a parameter's old gradient, is not the run's), as a budget counts only what a block
// allocates; ``restart`` begins the next run (live and peak from zero, what came before not counted).
using torch::profiler::impl::ActiveProfilerType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;
using torch::profiler::impl::ProfilerStateBase;

struct CounterState : ProfilerStateBase {
  explicit CounterState(bool run) : ProfilerStateBase(ProfilerConfig(ProfilerState::Disabled)), run(run) {}
  void reportMemoryUsage(void* ptr, int64_t alloc_size, size_t /*total_allocated*/, size_t /*total_reserved*/,
                         c10::Device device) override {
    if (device.type() != c10::DeviceType::CPU || alloc_size == 0 || !on.load(std::memory_order_relaxed)) return;
    if (run) {  // a run's count: its own allocations only, no reports kept
      std::lock_guard<std::mutex> guard(mu);
      if (alloc_size > 0) {
        mine[ptr] = alloc_size;
        live += alloc_size;
        if (live > peak) peak = live;
      } else if (auto it = mine.find(ptr); it != mine.end()) {
        live -= it->second;
        mine.erase(it);
      }
      return;
    }
    long long seq = static_cast<long long>(at::sequence_number::peek());
    long long t = time_ns();
    std::lock_guard<std::mutex> guard(mu);
    live += alloc_size;
    if (live > peak) peak = live;
    events.push_back(t);
    events.push_back(alloc_size);
    events.push_back(static_cast<long long>(reinterpret_cast<uintptr_t>(ptr)));
    events.push_back(seq);
  }
  bool memoryProfilingEnabled() const override { return on.load(std::memory_order_relaxed); }
  ActiveProfilerType profilerType() override { return ActiveProfilerType::NONE; }

  const bool run;  // a run's count (see the NOTE above)
  std::mutex mu;
  std::vector<long long> events;  // (t_ns, bytes, address, sequence counter) per report
  std::unordered_map<void*, long long> mine;  // a run's count: its allocations alive, by address
  long long live = 0;
  long long peak = 0;  // the most live bytes since the last drain
  std::atomic<bool> on{true};
};

struct Counter {
  PyObject_HEAD
  std::shared_ptr<CounterState>* state;  // held while the object lives
  int pushed;
};

void counter_dealloc(Counter* self) {
  delete std::exchange(self->state, nullptr);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

int counter_init(Counter* self, PyObject* args, PyObject* kwds) {
  int run = 0;
  if (!PyArg_ParseTuple(args, "|p", &run)) return -1;
  delete self->state;
  self->state = new std::shared_ptr<CounterState>(std::make_shared<CounterState>(run != 0));
  self->pushed = 0;
  return 0;
}

// Put the counter in this thread's profiler slot (the threads the autograd engine runs the thread's
// backward passes on inherit it).
PyObject* counter_start(Counter* self, PyObject* /*unused*/) {
  if (self->state == nullptr || self->pushed) return PyErr_Format(PyExc_RuntimeError, "gradscope: the counter runs already");
  try {
    c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE, *self->state);
  } catch (const std::exception& e) {
    return PyErr_Format(PyExc_RuntimeError, "gradscope: the allocator's counter could not start: %s", e.what());
  }
  self->pushed = 1;
  Py_RETURN_NONE;
}

// Take it out again; False where another state was put on top of it and is still there (the counter
// then only stops counting).
PyObject* counter_stop(Counter* self, PyObject* /*unused*/) {
  if (self->state == nullptr || !self->pushed) Py_RETURN_TRUE;
  (*self->state)->on.store(false);
  self->pushed = 0;
  if (c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE) != self->state->get()) Py_RETURN_FALSE;
  try {
    c10::ThreadLocalDebugInfo::_pop(c10::DebugInfoKind::PROFILER_STATE);
  } catch (const std::exception& e) {
    return PyErr_Format(PyExc_RuntimeError, "gradscope: the allocator's counter could not stop: %s", e.what());
  }
  Py_RETURN_TRUE;
}

// The reports since the last drain, as bytes of native 8-byte integers (t_ns, bytes, address, counter)
// per report, and the most live bytes in that time; the next period's peak starts from the live total.
PyObject* counter_drain(Counter* self, PyObject* /*unused*/) {
  if (self->state == nullptr) return PyErr_Format(PyExc_RuntimeError, "gradscope: no counter");
  std::vector<long long> taken;
  long long peak;
  {
    CounterState& st = **self->state;
    std::lock_guard<std::mutex> guard(st.mu);
    taken.swap(st.events);
    peak = st.peak;
    st.peak = st.live;
  }
  PyObject* data = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(taken.data()),
                                             static_cast<Py_ssize_t>(taken.size() * sizeof(long long)));
  if (data == nullptr) return nullptr;
  return Py_BuildValue("(NL)", data, peak);
}

PyObject* counter_live(Counter* self, PyObject* /*unused*/) {
  if (self->state == nullptr) return PyErr_Format(PyExc_RuntimeError, "gradscope: no counter");
  CounterState& st = **self->state;
  std::lock_guard<std::mutex> guard(st.mu);
  return PyLong_FromLongLong(st.live);
}

// A run's count begins again: live and peak from zero, what was counted before (and its free) no more.
PyObject* counter_restart(Counter* self, PyObject* /*unused*/) {
  if (self->state == nullptr) return PyErr_Format(PyExc_RuntimeError, "gradscope: no counter");
  CounterState& st = **self->state;
  std::lock_guard<std::mutex> guard(st.mu);
  st.events.clear();
  st.mine.clear();
  st.live = st.peak = 0;
  Py_RETURN_NONE;
}

// (live, peak) bytes since the start or the last restart or drain, leaving the peak as it is.
PyObject* counter_read(Counter* self, PyObject* /*unused*/) {
  if (self->state == nullptr) return PyErr_Format(PyExc_RuntimeError, "gradscope: no counter");
  CounterState& st = **self->state;
  std::lock_guard<std::mutex> guard(st.mu);
  return Py_BuildValue("(LL)", st.live, st.peak);
}

PyMethodDef counter_methods[] = {
    {"start", reinterpret_cast<PyCFunction>(counter_start), METH_NOARGS, "Count this thread's allocations."},
    {"stop", reinterpret_cast<PyCFunction>(counter_stop), METH_NOARGS, "Stop counting; False: not on top."},
    {"drain", reinterpret_cast<PyCFunction>(counter_drain), METH_NOARGS, "(reports as bytes, peak) since the last."},
    {"live", reinterpret_cast<PyCFunction>(counter_live), METH_NOARGS, "Live bytes counted since the start."},
    {"restart", reinterpret_cast<PyCFunction>(counter_restart), METH_NOARGS, "Count from zero again."},
    {"read", reinterpret_cast<PyCFunction>(counter_read), METH_NOARGS, "(live, peak) bytes, the peak kept."},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject CounterType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_hooks", "gradscope's compiled saved-tensor hooks.", -1,
                          nullptr};

}  // namespace

PyTypeObject* gradscope_native::state_type() { return &StateType; }

// See native.h: the tensors whose rows this file makes exactly as the Python pack hook would.
bool gradscope_native::plain_tensor(PyObject* obj) {
  if (!THPVariable_CheckExact(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return typeid(*impl) == typeid(c10::TensorImpl) && impl->has_storage() && !impl->is_python_dispatch() &&
         t.layout() == c10::kStrided;
}


PyMODINIT_FUNC PyInit__hooks(void) {
  using gradscope_native::add_type;
  using gradscope_native::ready_type;
  StateType.tp_members = state_members;
  StateType.tp_new = PyType_GenericNew;
  if (ready_type(StateType, "gradscope._capture.native._hooks.State", Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, nullptr,
                 state_traverse, state_clear, state_dealloc) < 0 ||
      ready_type(HooksType, "gradscope._capture.native._hooks.Hooks", Py_TPFLAGS_DEFAULT, hooks_methods,
                 HooksRefs::traverse, HooksRefs::clear, hooks_dealloc, hooks_init) < 0 ||
      ready_type(ModHooksType, "gradscope._capture.native._hooks.ModHooks", Py_TPFLAGS_DEFAULT, mod_methods,
                 ModRefs::traverse, ModRefs::clear, ModRefs::dealloc, mod_init) < 0)
    return nullptr;
  CounterType.tp_name = "gradscope._capture.native._hooks.Counter";
  CounterType.tp_basicsize = sizeof(Counter);
  CounterType.tp_flags = Py_TPFLAGS_DEFAULT;
  CounterType.tp_methods = counter_methods;
  CounterType.tp_new = PyType_GenericNew;
  CounterType.tp_init = reinterpret_cast<initproc>(counter_init);
  CounterType.tp_dealloc = reinterpret_cast<destructor>(counter_dealloc);
  if (PyType_Ready(&CounterType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  if (add_type(m, "State", StateType) < 0 || add_type(m, "Hooks", HooksType) < 0 ||
      add_type(m, "ModHooks", ModHooksType) < 0 || add_type(m, "Counter", CounterType) < 0 ||
      gradscope_add_walker(m) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
