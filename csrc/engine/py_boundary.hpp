// Python-boundary functions of deepinfer_npu._core: array validation (dtype kind, ndim, shape, value range, with
// TypeError/ValueError naming the function and the argument), read-only numpy views over C++ buffers, and
// small converters. Included by bindings.cpp only (everything is internal linkage).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>

#include "block_manager.hpp"
#include "schedule_output.hpp"
#include "scheduler.hpp"
#include "scheduler_config.hpp"
#include "sequence.hpp"
#include "varlen_allocator.hpp"
#include "zos_remap.hpp"

namespace py = pybind11;
using namespace deepinfer;

namespace {

// ------------------------------------------------------------------ array validation

std::string where(const char* fn, const char* name) { return std::string(fn) + ": " + name; }

py::array as_numpy(const py::handle& obj, const char* fn, const char* name) {
  py::array a = py::array::ensure(obj);
  if (!a)
    throw py::type_error(where(fn, name) + " must be array-like (a numpy array or a sequence of numbers)");
  return a;
}

void check_ndim(const py::array& a, int ndim, const char* fn, const char* name) {
  if (a.ndim() != ndim) {
    throw py::value_error(where(fn, name) + " must be " + std::to_string(ndim) + "-D (got " +
                          std::to_string(a.ndim()) + "-D)");
  }
}

// Integer array (any integer dtype; an empty array of any dtype) converted to T with a range check.
template <typename T>
py::array_t<T, py::array::c_style> int_array(const py::handle& obj, int ndim, const char* fn,
                                             const char* name, int64_t lo = std::numeric_limits<T>::min(),
                                             int64_t hi = std::numeric_limits<T>::max()) {
  py::array a = as_numpy(obj, fn, name);
  const char kind = a.dtype().kind();
  if (a.size() > 0 && kind != 'i' && kind != 'u') {
    throw py::type_error(where(fn, name) + " must have an integer dtype (got " +
                         std::string(py::str(a.dtype())) + ")");
  }
  check_ndim(a, ndim, fn, name);
  auto wide = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
  if (kind == 'u' && a.dtype().itemsize() == 8) {  // uint64 above int64 max wraps in the cast
    auto u = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(a);
    const uint64_t* p = u.data();
    for (py::ssize_t i = 0; i < u.size(); ++i)
      if (p[i] > static_cast<uint64_t>(hi))
        throw py::value_error(where(fn, name) + " has a value out of range");
  }
  const int64_t* p = wide.data();
  for (py::ssize_t i = 0; i < wide.size(); ++i) {
    if (p[i] < lo || p[i] > hi) {
      throw py::value_error(where(fn, name) + "[" + std::to_string(i) + "] = " + std::to_string(p[i]) +
                            " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
  }
  return py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(wide);
}

template <typename T>
py::array_t<T, py::array::c_style> float_array(const py::handle& obj, int ndim, const char* fn,
                                               const char* name, double lo, double hi) {
  py::array a = as_numpy(obj, fn, name);
  const char kind = a.dtype().kind();
  if (a.size() > 0 && kind != 'f' && kind != 'i' && kind != 'u') {
    throw py::type_error(where(fn, name) + " must have a floating dtype (got " +
                         std::string(py::str(a.dtype())) + ")");
  }
  check_ndim(a, ndim, fn, name);
  auto out = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(a);
  const T* p = out.data();
  for (py::ssize_t i = 0; i < out.size(); ++i) {
    if (!(std::isfinite(static_cast<double>(p[i])) && p[i] >= lo && p[i] <= hi)) {
      std::ostringstream os;
      os << where(fn, name) << " must be finite and in [" << lo << ", " << hi << "] (flat index " << i
         << " is " << p[i] << ")";
      throw py::value_error(os.str());
    }
  }
  return out;
}

constexpr int64_t kMaxToken = std::numeric_limits<int32_t>::max();

// ------------------------------------------------------------------ ScheduleOutput wrapper

struct PyScheduleOutput {
  ScheduleOutput out;
  const Scheduler* sched = nullptr;
  py::object owner;  // keeps the scheduler (and its buffers) alive

  void check_fresh(const char* field) const {
    if (sched->generation() != out.generation) {
      throw py::value_error(
          std::string("ScheduleOutput.") + field +
          ": this output is stale; its arrays are views over scheduler buffers that the next "
          "schedule() overwrote (copy what you need before calling schedule() again)");
    }
  }
};

template <typename T>
py::array view(py::object self, const T* data, std::initializer_list<py::ssize_t> shape) {
  py::array_t<T> a(std::vector<py::ssize_t>(shape), data, self);
  py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return std::move(a);
}

#define OUT_VIEW(field, T, ...)                                       \
  [](py::object self) {                                               \
    const PyScheduleOutput& w = self.cast<const PyScheduleOutput&>(); \
    w.check_fresh(#field);                                            \
    const ScheduleOutput& o = w.out;                                  \
    (void)o;                                                          \
    return view<T>(self, o.field, {__VA_ARGS__});                     \
  }

// ------------------------------------------------------------------ read-only manager view

struct BlockManagerView {
  const BlockManager* m;
  py::object owner;
};

py::dict seq_info_dict(const SeqInfo& i) {
  py::dict d;
  d["seq_id"] = i.seq_id;
  d["tokens"] = i.tokens;
  d["num_prompt_tokens"] = i.num_prompt_tokens;
  d["max_new_tokens"] = i.max_new_tokens;
  d["num_computed_tokens"] = i.num_computed_tokens;
  d["block_table"] = i.block_table;
  d["state_slot"] = i.state_slot;
  d["status"] = i.status;
  d["finish_reason"] = i.finish_reason;
  d["num_inflight"] = i.num_inflight;
  d["needs_cow"] = i.needs_cow;
  return d;
}

VarlenCurve make_curve(const py::handle& graph_sizes, const py::handle& step_ms, const char* fn) {
  auto g = int_array<int32_t>(graph_sizes, 1, fn, "graph_sizes", 1, std::numeric_limits<int32_t>::max());
  auto t = float_array<double>(step_ms, 1, fn, "step_ms", 0.0, std::numeric_limits<double>::max());
  VarlenCurve c;
  c.graph_sizes.assign(g.data(), g.data() + g.size());
  c.step_ms.assign(t.data(), t.data() + t.size());
  const std::string problem = c.validate();
  if (!problem.empty()) throw py::value_error(std::string(fn) + ": " + problem);
  return c;
}

}  // namespace
