// The patch kernel: first node of every grape graph. It applies the current call's entries
// of the argument table to the graph's device-updatable kernel nodes, then the graph runs
// them. Built with `nvcc --cubin -arch=sm_XX` (no -rdc): the device-side graph update calls
// are builtins of the CUDA device runtime.
//
// Device-side updates persist from launch to launch and each costs about a microsecond when
// one thread makes them all (bench/results/patch_variants.json), so: a thread per node
// (one thread owns a node: no two threads update the same node), and only what changed
// since the launch before: the columns whose value in the current shape's row differs from
// the row applied last, and the pointers of the arguments whose address moved.
//
// Table layout (little endian, in device memory the executor owns):
//   columns[c]  = {node, kind, offset, size, value_offset, pad x3}, grouped by node
//                 kind 0: `size` bytes of kernel parameters at `offset`;
//                 kind 1: grid dims (3 x u32). The value sits at `value_offset` in a row.
//   rows        = num_rows rows of `row_bytes` bytes
//   pointers[p] = {node, offset, arg, pad, delta}, grouped by node: parameter at `offset`
//                 of `node` is the address of region argument `arg` plus `delta` bytes
//   spans[n]    = {first column, columns, first pointer, pointers} of node n
//   launch      = {shape_row, pad, args[num_args]}: the current call's row and the address
//                 of each region argument, written by the host in one stream-ordered copy
//   applied[a]  = the address of argument a the nodes point at now (this kernel's)
//   state       = {applied_row (this kernel), pad x3}
#include <cuda_runtime.h>

struct Column {
  unsigned int node, kind, offset, size, value_offset, pad0, pad1, pad2;
};

struct Pointer {
  unsigned int node, offset, arg, pad;
  unsigned long long delta;
};

struct Span {
  unsigned int first_column, columns, first_pointer, pointers;
};

struct Launch {
  unsigned int shape_row, pad;
  unsigned long long args[1];  // num_args of them
};

struct State {
  unsigned int applied_row, pad0, pad1, pad2;
};

#define GRAPE_NO_ROW 0xffffffffu

__device__ static bool same_value(const unsigned char* a, const unsigned char* b, unsigned int n) {
  for (unsigned int i = 0; i < n; ++i)
    if (a[i] != b[i]) return false;
  return true;
}

extern "C" __global__ void grape_patch(const Column* __restrict__ columns,
                                       const unsigned char* __restrict__ rows,
                                       unsigned int row_bytes,
                                       const Pointer* __restrict__ pointers,
                                       const Span* __restrict__ spans, unsigned int num_nodes,
                                       const Launch* __restrict__ launch,
                                       unsigned long long* applied, unsigned int num_args,
                                       State* state,
                                       const cudaGraphDeviceNode_t* __restrict__ nodes) {
  __shared__ unsigned int shape_row, applied_row;
  if (threadIdx.x == 0) {
    shape_row = launch->shape_row;
    applied_row = state->applied_row;
  }
  __syncthreads();
  const unsigned long long* args = launch->args;
  const bool new_row = shape_row != applied_row;
  const unsigned char* row = rows + (size_t)shape_row * row_bytes;
  const unsigned char* before =
      applied_row == GRAPE_NO_ROW ? nullptr : rows + (size_t)applied_row * row_bytes;
  for (unsigned int n = threadIdx.x; n < num_nodes; n += blockDim.x) {
    const Span span = spans[n];
    const cudaGraphDeviceNode_t node = nodes[n];
    for (unsigned int c = span.first_column; new_row && c < span.first_column + span.columns; ++c) {
      const Column col = columns[c];
      const unsigned int width = col.kind == 0 ? col.size : 12;
      const unsigned char* value = row + col.value_offset;
      if (before != nullptr && same_value(value, before + col.value_offset, width)) continue;
      if (col.kind == 0) {
        cudaGraphKernelNodeSetParam(node, col.offset, value, col.size);
      } else {
        const unsigned int* g = reinterpret_cast<const unsigned int*>(value);
        cudaGraphKernelNodeSetGridDim(node, dim3(g[0], g[1], g[2]));
      }
    }
    for (unsigned int p = span.first_pointer; p < span.first_pointer + span.pointers; ++p) {
      const Pointer ptr = pointers[p];
      if (args[ptr.arg] == applied[ptr.arg]) continue;
      const unsigned long long address = args[ptr.arg] + ptr.delta;
      cudaGraphKernelNodeSetParam(node, ptr.offset, &address, sizeof(address));
    }
  }
  __syncthreads();  // every thread compared against `applied` before it changes
  for (unsigned int a = threadIdx.x; a < num_args; a += blockDim.x) applied[a] = args[a];
  if (threadIdx.x == 0) state->applied_row = shape_row;
}
