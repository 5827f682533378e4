// The torch headers the bindings (*.cpp) need: at::Tensor and TORCH_CHECK, and torch's pybind11 casters
// for PYBIND11_MODULE. Not <torch/extension.h>: it brings all of libtorch's C++ API and compiles about
// three times as long, the critical path of an extension's first-call build.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
