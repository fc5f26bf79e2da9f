// The last node of a device loop's body: counts the step and decides whether the WHILE
// node runs the body again. Built with `nvcc --cubin -arch=sm_XX` (no -rdc):
// cudaGraphSetConditional is a builtin of the CUDA device runtime.
//
//   stop        = the step's stop output: stop when any of its `stop_bytes` bytes is non-zero
//                 (a bool or integer tensor; compile_loop checks the dtype)
//   counter     = {steps (this kernel), max_steps (host, before each launch)}
#include <cuda_runtime.h>

extern "C" __global__ void grape_loop_continue(cudaGraphConditionalHandle handle,
                                               const unsigned char* __restrict__ stop,
                                               unsigned int stop_bytes,
                                               unsigned int* counter) {
  const unsigned int steps = counter[0] + 1;
  counter[0] = steps;
  bool done = steps >= counter[1];
  for (unsigned int i = 0; i < stop_bytes && !done; ++i) done = stop[i] != 0;
  cudaGraphSetConditional(handle, done ? 0u : 1u);
}
