// Python bindings of the compiled CPU kernels (loaded by louver_kernels/cpu_ops.py). Every op and
// constructor takes its arguments by keyword (named.h).

#include "ops.h"

namespace {

using louver_cpu::Named;

// An op of the module: ``fn`` applied to the call's keyword arguments.
template <typename Fn>
auto by_name(const char* op, Fn fn) {
  return [op, fn](const pybind11::kwargs& kwargs) {
    Named args(kwargs, op);
    return fn(args);
  };
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("certified_threshold", by_name("certified_threshold", certified_threshold),
        "Louver certified threshold from the int8 token bounds (CPU)");
  m.def("exact_part", by_name("exact_part", exact_part),
        "Louver exact scores of the dense part and sample, ref and masses (CPU)");
  m.def("merge_chunks", by_name("merge_chunks", merge_chunks),
        "Louver merge of the dense part with the attend pass's chunks (CPU)");
  m.def("chunk_totals", by_name("chunk_totals", chunk_totals),
        "Louver per-request totals of the attend pass's chunk outputs (CPU)");
  m.def("step_stats", by_name("step_stats", step_stats), "Louver step statistics from the compiled step's totals (CPU)");
  m.def("fused_step", by_name("fused_step", fused_step),
        "Louver decode step of the sample-threshold policies in one call (CPU)");
  m.def("int8_weight_rule", &weight_rule_of_build,
        "The int8 weights' rule of this build's token bounds for codes of ``bits`` bits: (largest |weight|, "
        "lane groups' limit, 0 for none)", pybind11::arg("bits"));
  m.def("exp_ps16_error", &exp_ps16_error, "Largest relative error of the kernels' fp32 exp over a range (check)",
        pybind11::arg("lo"), pybind11::arg("hi"));
  m.def("exp_up_ratio", &exp_up_ratio, "Smallest and largest ratio of the dropped masses' exp to e^x over a range (check)",
        pybind11::arg("lo"), pybind11::arg("hi"));
  m.def("page_setup_mismatches", &page_setup_mismatches,
        "Pages where the one-pass page setup differs from the codebook load, page terms and int8 weights "
        "(check; -1: not used by this build)",
        pybind11::arg("q"), pybind11::arg("lo"), pybind11::arg("scale"), pybind11::arg("radius"), pybind11::arg("bits"));
  pybind11::class_<StepPlan>(m, "StepPlan", pybind11::module_local(), "The plan side of the one-call step (see ops.h)")
      .def(pybind11::init([](const pybind11::kwargs& kwargs) {
        Named args(kwargs, "StepPlan");
        return StepPlan(args);
      }));
  pybind11::class_<LayerStep>(m, "LayerStep", pybind11::module_local(), "The layer side of the one-call step (see ops.h)")
      .def(pybind11::init([](const pybind11::kwargs& kwargs) {
        Named args(kwargs, "LayerStep");
        return LayerStep(args);
      }))
      .def("run", &LayerStep::run, "fused_step, statistics and output of one layer's step", pybind11::arg("q"),
           pybind11::arg("plan"), pybind11::arg("out") = pybind11::none(),
           pybind11::arg("attended") = pybind11::none(), pybind11::arg("share") = pybind11::none());
}
