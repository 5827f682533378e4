// The fp16 instantiation of the decode kernels (decode_sm90.cuh), a translation unit of its own so that
// nvcc builds the element types in parallel.
#include "decode_sm90.cuh"

namespace sk90d {
template cudaError_t launch_g<__half>(const Params&, int, int, bool, cudaStream_t);
}  // namespace sk90d
