// What hooks.cc and walk.cc share.
#pragma once

#include <Python.h>

#include <ctime>

namespace gradscope_native {

// What the hooks read and change while a block runs; record.py's _State derives from it, so that
// the Python code reads and sets the same fields (see _State there for their meaning).
struct State {
  PyObject_HEAD
  PyObject* bw;
  PyObject* marks;
  long long last_seq;
  PyObject* pending;
  PyObject* prev_node;
  PyObject* reading;
  PyObject* stack;
  long long func_depth;
};

inline long long time_ns() {
  // time.time_ns()'s clock: rows are compared with times Python took
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

constexpr int kEvPre = 1;  // gradscope._trace.EV_PRE

// hooks.cc: the State type (for checks in walk.cc).
PyTypeObject* state_type();

}  // namespace gradscope_native

// walk.cc: adds the Walker type to the module (called by its init in hooks.cc).
int gradscope_add_walker(PyObject* module);
