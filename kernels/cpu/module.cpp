// Python bindings of the compiled CPU kernels (loaded by louver_kernels/cpu_ops.py).

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grid_sparse_attend", &grid_sparse_attend, "Louver grid filter + sparse attention (CPU)");
  m.def("certified_threshold", &certified_threshold, "Louver certified threshold from the int8 token bounds (CPU)");
  m.def("exact_part", &exact_part, "Louver exact scores of the dense part and sample, ref and masses (CPU)");
  m.def("merge_chunks", &merge_chunks, "Louver merge of the dense part with the attend kernel's chunks (CPU)");
  m.def("chunk_totals", &chunk_totals, "Louver per-request totals of the attend kernel's chunk outputs (CPU)");
  m.def("step_stats", &step_stats, "Louver step statistics from the compiled step's totals (CPU)");
  m.def("exp_ps16_error", &exp_ps16_error, "Largest relative error of the kernels' fp32 exp over a range (check)");
  m.def("fused_step", &fused_step, "Louver decode step of the sample-threshold policies in one call (CPU)");
  pybind11::class_<StepPlan>(m, "StepPlan", pybind11::module_local(), "The plan side of the one-call step (see ops.h)")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>>());
  pybind11::class_<LayerStep>(m, "LayerStep", pybind11::module_local(), "The layer side of the one-call step (see ops.h)")
      .def(pybind11::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                          double, double, double, bool, int64_t, int64_t, double, double, double>())
      .def("run", &LayerStep::run, "fused_step, statistics and output of one layer's step");
}
