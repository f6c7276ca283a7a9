// gradscope's counter of the bytes PyTorch's CPU allocator hands out, for the diagnosis's runs of a step on
// copies (see NOTE [ the CPU allocator counts a run ] in gradscope/diagnose/measure.py).
//
// NOTE [ a counting CPU allocator ]: while it is installed (``start``), PyTorch's CPU allocator is a
// wrapper of the one it replaced: each allocation is made by that one, its size remembered by its
// context pointer, and its deleter swapped for one that counts the free before calling the original.
// A DataPtr keeps its data as its context (a "simple" pointer, as copy-on-write and ``raw_allocate``
// require). ``live`` and ``peak`` count only the allocations of the current run (``next_run`` starts
// one: earlier allocations no longer count, their frees neither), as a budget counts only what a block
// allocates. Allocations of every thread count (kernels' worker threads included), as they are all
// the process's memory. ``stop`` puts the replaced allocator back; storages made meanwhile keep the
// wrapper as their allocator (a resize goes through it), so it is never destroyed, and it keeps
// forwarding to the allocator it wrapped. Where another allocator was installed on top of it, or the
// wrapper could not be installed (an allocator of higher priority), ``start``/``stop`` return False
// and the caller measures another way.
//
// This file is its own Python module (``PyInit__counting``) in the same shared library as the hooks,
// loaded from it under the name gradscope._native._counting (see counting() in __init__.py).

#include <Python.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <mutex>
#include <unordered_map>

namespace {

struct Entry {
  size_t bytes;
  unsigned long long run;  // the run it was allocated in: only the current run's count
  c10::DeleterFnPtr deleter;  // the replaced allocator's
};

std::mutex mu;  // guards everything below
// never destroyed: frees can come at interpreter exit, after static destructors would have run
auto* table = new std::unordered_map<void*, Entry>();
unsigned long long run = 0;  // 0: counting is off
unsigned long long runs = 0;  // runs started so far
long long live = 0;
long long peak = 0;
c10::DeleterFnPtr fallback = nullptr;  // the replaced allocator's raw deleter, for a pointer it made itself

void counted_delete(void* ctx) {
  c10::DeleterFnPtr d = fallback;
  {
    std::lock_guard<std::mutex> guard(mu);
    auto it = table->find(ctx);
    if (it != table->end()) {
      d = it->second.deleter;
      if (run != 0 && it->second.run == run) live -= static_cast<long long>(it->second.bytes);
      table->erase(it);
    }
  }
  if (d != nullptr) d(ctx);
}

struct Counting final : c10::Allocator {
  c10::Allocator* base = nullptr;

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr dp = base->allocate(n);
    void* ctx = dp.get_context();
    c10::DeleterFnPtr d = dp.get_deleter();
    if (n == 0 || ctx == nullptr || d == nullptr) return dp;
    {
      std::lock_guard<std::mutex> guard(mu);
      (*table)[ctx] = Entry{n, run, d};  // (may throw: dp still has its own deleter then)
      if (run != 0) {
        live += static_cast<long long>(n);
        if (live > peak) peak = live;
      }
    }
    if (!dp.compare_exchange_deleter(d, &counted_delete)) {
      std::lock_guard<std::mutex> guard(mu);
      auto it = table->find(ctx);
      if (it != table->end()) {
        if (run != 0 && it->second.run == run) live -= static_cast<long long>(n);
        table->erase(it);
      }
    }
    return dp;
  }

  c10::DeleterFnPtr raw_deleter() const override { return base->raw_deleter() != nullptr ? &counted_delete : nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { base->copy_data(dest, src, count); }
};

Counting* counting = new Counting();  // never destroyed (see the NOTE above)

PyObject* count_start(PyObject*, PyObject*) {
  c10::Allocator* now = c10::GetCPUAllocator();
  if (now == counting) Py_RETURN_FALSE;  // counting already (another measurement in progress)
  {
    std::lock_guard<std::mutex> guard(mu);
    counting->base = now;
    fallback = now->raw_deleter();
    run = ++runs;
    live = peak = 0;
  }
  c10::SetCPUAllocator(counting, 0);
  if (c10::GetCPUAllocator() != counting) {  // an allocator of higher priority stays
    std::lock_guard<std::mutex> guard(mu);
    run = 0;
    Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

PyObject* count_next_run(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> guard(mu);
  if (run != 0) {
    run = ++runs;
    live = peak = 0;
  }
  Py_RETURN_NONE;
}

PyObject* count_read(PyObject*, PyObject*) {
  long long l, p;
  {
    std::lock_guard<std::mutex> guard(mu);
    l = live;
    p = peak;
  }
  return Py_BuildValue("(LL)", l, p);
}

PyObject* count_stop(PyObject*, PyObject*) {
  {
    std::lock_guard<std::mutex> guard(mu);
    run = 0;
    live = peak = 0;
  }
  if (c10::GetCPUAllocator() != counting) Py_RETURN_FALSE;  // another allocator was put on top of it
  c10::SetCPUAllocator(counting->base, 0);
  Py_RETURN_TRUE;
}

PyObject* count_installed(PyObject*, PyObject*) {
  if (c10::GetCPUAllocator() == counting) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

PyMethodDef methods[] = {
    {"start", count_start, METH_NOARGS,
     "Install the counting CPU allocator and start a run; False where it could not be installed."},
    {"next_run", count_next_run, METH_NOARGS, "Start a new run: live and peak from zero, earlier allocations not counted."},
    {"read", count_read, METH_NOARGS, "(live, peak) bytes of the current run's allocations."},
    {"stop", count_stop, METH_NOARGS, "Put the replaced allocator back; False where another one is on top."},
    {"installed", count_installed, METH_NOARGS, "Whether the counting allocator is PyTorch's CPU allocator now."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_counting", "gradscope's counting CPU allocator.", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__counting(void) { return PyModule_Create(&module_def); }
