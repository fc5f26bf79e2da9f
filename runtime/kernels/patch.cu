// The patch kernel: first node of every grape graph. It applies the current call's entries
// of the argument table to the graph's device-updatable kernel nodes, then the graph runs
// them. Built with `nvcc --cubin -arch=sm_XX` (no -rdc): the device-side graph update calls
// are builtins of the CUDA device runtime.
//
// Table layout (all little endian, in device memory the executor owns):
//   columns[c]  = {node, kind, offset, size}   kind 0: `size` bytes of kernel parameters at
//                                              `offset`; kind 1: grid dims (3 x u32)
//   rows        = num_rows x num_columns slots of 16 bytes, the values of the columns
//   pointers[p] = {node, offset, arg, pad, delta}: parameter at `offset` of `node` is
//                 address of region argument `arg` plus `delta` bytes
//   args[a]     = the current call's address of region argument a (written by the host)
//   shape_row   = the row of the current call's shape (written by the host)
#include <cuda_runtime.h>

struct Column {
  unsigned int node, kind, offset, size;
};

struct Pointer {
  unsigned int node, offset, arg, pad;
  unsigned long long delta;
};

extern "C" __global__ void grape_patch(const Column* __restrict__ columns, unsigned int num_columns,
                                       const unsigned char* __restrict__ rows,
                                       const Pointer* __restrict__ pointers,
                                       unsigned int num_pointers,
                                       const unsigned long long* __restrict__ args,
                                       const unsigned int* __restrict__ shape_row,
                                       const cudaGraphDeviceNode_t* __restrict__ nodes) {
  // One thread: the update calls of one launch must not race on a node.
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const unsigned char* row = rows + (size_t)(*shape_row) * num_columns * 16;
  for (unsigned int c = 0; c < num_columns; ++c) {
    const Column col = columns[c];
    const unsigned char* value = row + (size_t)c * 16;
    if (col.kind == 0) {
      cudaGraphKernelNodeSetParam(nodes[col.node], col.offset, value, col.size);
    } else {
      const unsigned int* g = reinterpret_cast<const unsigned int*>(value);
      cudaGraphKernelNodeSetGridDim(nodes[col.node], dim3(g[0], g[1], g[2]));
    }
  }
  for (unsigned int p = 0; p < num_pointers; ++p) {
    const Pointer ptr = pointers[p];
    const unsigned long long address = args[ptr.arg] + ptr.delta;
    cudaGraphKernelNodeSetParam(nodes[ptr.node], ptr.offset, &address, sizeof(address));
  }
}
