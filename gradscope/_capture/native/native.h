// What hooks.cc and walk.cc share.
#pragma once

#include <Python.h>

#include <ctime>
#include <utility>

#include "fields.h"

namespace gradscope_native {

// What the hooks read and change while a block runs; gradscope._capture.state's _State derives from it, so that
// the Python code reads and sets the same fields (see _State there for their meaning). Its fields
// are fields.py's STATE (see NOTE [ one definition of the shared state ] there).
#define GRADSCOPE_OBJECT_FIELD(name) PyObject* name;
#define GRADSCOPE_INT_FIELD(name) long long name;
struct State {
  PyObject_HEAD
  GRADSCOPE_STATE_FIELDS(GRADSCOPE_OBJECT_FIELD, GRADSCOPE_INT_FIELD)
};
#undef GRADSCOPE_OBJECT_FIELD
#undef GRADSCOPE_INT_FIELD

// An owned reference, released when it goes out of scope.
struct Ref {
  PyObject* p = nullptr;
  Ref() = default;
  explicit Ref(PyObject* o) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  Ref(Ref&& o) noexcept : p(std::exchange(o.p, nullptr)) {}
  Ref& operator=(Ref&& o) noexcept {
    std::swap(p, o.p);
    return *this;
  }
  ~Ref() { Py_XDECREF(p); }
  PyObject* get() const { return p; }
  PyObject* release() { return std::exchange(p, nullptr); }
  explicit operator bool() const { return p != nullptr; }
};

inline long long time_ns() {
  // time.time_ns()'s clock: rows are compared with times Python took
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

constexpr int kEvPre = 1;  // gradscope._base.trace.EV_PRE

// NOTE [ rows the collector does not track ]: a row made of ints, strings, dtypes and devices
// cannot be part of a cycle, but a new tuple is tracked by Python's cyclic collector, which scans
// every young tracked object at each collection (and would untrack the row itself only then): a
// block makes a row per save, node, step and free, so they are made untracked. Returns ``row``.
inline PyObject* untracked(PyObject* row) {
  if (row != nullptr && PyObject_GC_IsTracked(row)) PyObject_GC_UnTrack(row);
  return row;
}

// For a C type whose N fields from ``First`` on are owned references (PyObject*, or a pointer to a
// Python object's struct): the collector's traverse and clear, and dealloc.
template <class T, int N, auto First>
struct OwnedRefs {
  static PyObject** refs(T* self) { return reinterpret_cast<PyObject**>(&(self->*First)); }
  static int traverse(T* self, visitproc visit, void* arg) {
    for (int k = 0; k < N; ++k) Py_VISIT(refs(self)[k]);
    return 0;
  }
  static int clear(T* self) {
    for (int k = 0; k < N; ++k) Py_CLEAR(refs(self)[k]);
    return 0;
  }
  static void dealloc(T* self) {
    PyObject_GC_UnTrack(self);
    clear(self);
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
  }
};

// A collected type's slots, then PyType_Ready. ``init`` null: made from C only.
template <class T>
int ready_type(PyTypeObject& type, const char* name, unsigned long flags, PyMethodDef* methods,
               int (*traverse)(T*, visitproc, void*), int (*clear)(T*), void (*dealloc)(T*),
               int (*init)(T*, PyObject*, PyObject*) = nullptr) {
  type.tp_name = name;
  type.tp_basicsize = sizeof(T);
  type.tp_flags = flags | Py_TPFLAGS_HAVE_GC;
  type.tp_methods = methods;
  type.tp_traverse = reinterpret_cast<traverseproc>(traverse);
  type.tp_clear = reinterpret_cast<inquiry>(clear);
  type.tp_dealloc = reinterpret_cast<destructor>(dealloc);
  if (init != nullptr) {
    type.tp_init = reinterpret_cast<initproc>(init);
    type.tp_new = PyType_GenericNew;
  }
  return PyType_Ready(&type);
}

// The type as the module's attribute ``name``.
inline int add_type(PyObject* module, const char* name, PyTypeObject& type) {
  Py_INCREF(&type);
  if (PyModule_AddObject(module, name, reinterpret_cast<PyObject*>(&type)) < 0) {
    Py_DECREF(&type);
    return -1;
  }
  return 0;
}

// hooks.cc: the State type (for checks in walk.cc).
PyTypeObject* state_type();

// hooks.cc: a tensor whose storage and row both files read exactly: a torch.Tensor or nn.Parameter
// (no subclass: its methods may be overridden) whose TensorImpl is the plain class (not sparse,
// nested, batched, functional, quantized, ...) with a storage.
bool plain_tensor(PyObject* obj);

}  // namespace gradscope_native

// walk.cc: adds the Walker type to the module (called by its init in hooks.cc).
int gradscope_add_walker(PyObject* module);
