// Named arguments at the Python boundary, and the threshold edges as data.
//
// Every op and class of the module takes its arguments by keyword (``ops.LayerStep(k_cache=...,
// sigma=...)``): a missing, misspelt or mistyped argument fails naming it, instead of a long
// positional list that shifts silently when one parameter is added.
#pragma once

#include <torch/extension.h>

#include <set>
#include <string>

namespace louver_cpu {

class Named {
 public:
  Named(const pybind11::kwargs& kwargs, const char* op) : kwargs_(kwargs), op_(op) {}

  torch::Tensor tensor(const char* name) { return cast<torch::Tensor>(name, "a tensor"); }
  double real(const char* name) { return cast<double>(name, "a number"); }
  int64_t integer(const char* name) { return cast<int64_t>(name, "an int"); }
  bool flag(const char* name) { return cast<bool>(name, "a bool"); }

  // Every keyword must have been read: a misspelt one would otherwise be ignored.
  void done() const {
    for (const auto& item : kwargs_) {
      const std::string key = pybind11::str(item.first);
      TORCH_CHECK_VALUE(read_.count(key), op_, ": unknown argument '", key, "'");
    }
  }

 private:
  template <typename T>
  T cast(const char* name, const char* what) {
    TORCH_CHECK_VALUE(kwargs_.contains(name), op_, ": missing argument '", name, "'");
    read_.insert(name);
    try {
      return kwargs_[name].template cast<T>();
    } catch (const pybind11::cast_error&) {
      TORCH_CHECK_VALUE(false, op_, ": argument '", name, "' must be ", what);
    }
    return T();
  }

  const pybind11::kwargs& kwargs_;
  const char* op_;
  std::set<std::string> read_;
};

// The certified threshold's levels (louver_sgl/decode/contract.py, ThresholdEdges, is their one
// definition; the values come from there): edge j = low + step·j for j < count, in units of
// σ·(T − ref); T sits ``margin`` under its edge.
struct Edges {
  double low = 0.0, step = 1.0, margin = 0.0;
  int64_t count = 0;

  int64_t width() const { return count + 2; }  // histogram bins

  // The number of edges <= x (NaN: past the last edge).
  int64_t bin(double x) const {
    if (std::isnan(x)) return count;
    if (x < low) return 0;
    const double j = std::floor((x - low) / step);
    return j >= count - 1 ? count : static_cast<int64_t>(j) + 1;
  }

  static Edges read(Named& a) {
    Edges e{a.real("edge_low"), a.real("edge_step"), a.real("edge_margin"), a.integer("edge_count")};
    TORCH_CHECK_VALUE(e.step > 0 && e.count > 0, "threshold edges need a positive step and count");
    return e;
  }
};

}  // namespace louver_cpu
