// The patch kernel: first node of every grape graph. It applies the current call's entries
// of the argument table to the graph's device-updatable kernel nodes, then the graph runs
// them. Built with `nvcc --cubin -arch=sm_XX` (no -rdc): the device-side graph update calls
// are builtins of the CUDA device runtime.
//
// Device-side updates persist from launch to launch and cost about a microsecond each, so
// the kernel applies only what changed since the launch before: the columns whose value in
// the current shape's row differs from the row applied last, and the argument addresses
// only when the host marked them dirty.
//
// Table layout (little endian, in device memory the executor owns):
//   columns[c] = {node, kind, offset, size, value_offset, pad x3}
//                kind 0: `size` bytes of kernel parameters at `offset`;
//                kind 1: grid dims (3 x u32). The value sits at `value_offset` in a row.
//   rows       = num_rows rows of `row_bytes` bytes
//   pointers[p] = {node, offset, arg, pad, delta}: parameter at `offset` of `node` is the
//                address of region argument `arg` plus `delta` bytes
//   args[a]    = the current call's address of region argument a (written by the host)
//   state      = {shape_row (host), applied_row (this kernel), args_dirty (host sets,
//                this kernel clears), pad}
#include <cuda_runtime.h>

struct Column {
  unsigned int node, kind, offset, size, value_offset, pad0, pad1, pad2;
};

struct Pointer {
  unsigned int node, offset, arg, pad;
  unsigned long long delta;
};

struct State {
  unsigned int shape_row, applied_row, args_dirty, pad;
};

#define GRAPE_NO_ROW 0xffffffffu

__device__ static bool same_value(const unsigned char* a, const unsigned char* b, unsigned int n) {
  for (unsigned int i = 0; i < n; ++i)
    if (a[i] != b[i]) return false;
  return true;
}

extern "C" __global__ void grape_patch(const Column* __restrict__ columns, unsigned int num_columns,
                                       const unsigned char* __restrict__ rows,
                                       unsigned int row_bytes,
                                       const Pointer* __restrict__ pointers,
                                       unsigned int num_pointers,
                                       const unsigned long long* __restrict__ args,
                                       State* state,
                                       const cudaGraphDeviceNode_t* __restrict__ nodes) {
  // One thread: the update calls of one launch must not race on a node.
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const unsigned int current = state->shape_row;
  const unsigned int applied = state->applied_row;
  if (current != applied) {
    const unsigned char* row = rows + (size_t)current * row_bytes;
    const unsigned char* before = applied == GRAPE_NO_ROW ? nullptr : rows + (size_t)applied * row_bytes;
    for (unsigned int c = 0; c < num_columns; ++c) {
      const Column col = columns[c];
      const unsigned int width = col.kind == 0 ? col.size : 12;
      const unsigned char* value = row + col.value_offset;
      if (before != nullptr && same_value(value, before + col.value_offset, width)) continue;
      if (col.kind == 0) {
        cudaGraphKernelNodeSetParam(nodes[col.node], col.offset, value, col.size);
      } else {
        const unsigned int* g = reinterpret_cast<const unsigned int*>(value);
        cudaGraphKernelNodeSetGridDim(nodes[col.node], dim3(g[0], g[1], g[2]));
      }
    }
    state->applied_row = current;
  }
  if (state->args_dirty) {
    for (unsigned int p = 0; p < num_pointers; ++p) {
      const Pointer ptr = pointers[p];
      const unsigned long long address = args[ptr.arg] + ptr.delta;
      cudaGraphKernelNodeSetParam(nodes[ptr.node], ptr.offset, &address, sizeof(address));
    }
    state->args_dirty = 0;
  }
}
