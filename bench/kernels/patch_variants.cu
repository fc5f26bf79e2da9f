// Micro-benchmark of ways to patch device-updatable kernel nodes from a head kernel
// (bench/patch_variants.py). Every launch changes the grid and one int64 parameter of
// each of `count` nodes, as a call at a new n does for grape's graphs.
#include <cuda_runtime.h>

extern "C" __global__ void work(long long n, float* out) {
  if (n < 0 && threadIdx.x == 0) out[blockIdx.x] = (float)n;  // never true: launch cost only
}

__device__ static unsigned int next_phase(unsigned int* state) { return ++state[0] & 1u; }

// A: one thread, one call per field.
extern "C" __global__ void patch_fields(const cudaGraphDeviceNode_t* nodes, unsigned int count,
                                        unsigned int* state) {
  if (threadIdx.x != 0) return;
  const unsigned int phase = next_phase(state);
  const long long n = 1 + phase;
  for (unsigned int i = 0; i < count; ++i) {
    cudaGraphKernelNodeSetGridDim(nodes[i], dim3(1 + phase, 1, 1));
    cudaGraphKernelNodeSetParam(nodes[i], 0, &n, sizeof(n));
  }
}

// B: one thread, every update in one batched call.
extern "C" __global__ void patch_batched(const cudaGraphDeviceNode_t* nodes, unsigned int count,
                                         unsigned int* state, cudaGraphKernelNodeUpdate* scratch,
                                         long long* values) {
  if (threadIdx.x != 0) return;
  const unsigned int phase = next_phase(state);
  for (unsigned int i = 0; i < count; ++i) {
    values[i] = 1 + phase;
    cudaGraphKernelNodeUpdate& g = scratch[2 * i];
    g.node = nodes[i];
    g.field = cudaGraphKernelNodeFieldGridDim;
    g.updateData.gridDim = dim3(1 + phase, 1, 1);
    cudaGraphKernelNodeUpdate& p = scratch[2 * i + 1];
    p.node = nodes[i];
    p.field = cudaGraphKernelNodeFieldParam;
    p.updateData.param.pValue = &values[i];
    p.updateData.param.offset = 0;
    p.updateData.param.size = sizeof(long long);
  }
  cudaGraphKernelNodeUpdatesApply(scratch, 2 * count);
}

// C: a thread per node, one call per field.
extern "C" __global__ void patch_parallel(const cudaGraphDeviceNode_t* nodes, unsigned int count,
                                          unsigned int* state) {
  __shared__ unsigned int phase;
  if (threadIdx.x == 0) phase = next_phase(state);
  __syncthreads();
  const long long n = 1 + phase;
  for (unsigned int i = threadIdx.x; i < count; i += blockDim.x) {
    cudaGraphKernelNodeSetGridDim(nodes[i], dim3(1 + phase, 1, 1));
    cudaGraphKernelNodeSetParam(nodes[i], 0, &n, sizeof(n));
  }
}

// D: a thread per node, its two updates in one batched call.
extern "C" __global__ void patch_parallel_batched(const cudaGraphDeviceNode_t* nodes,
                                                  unsigned int count, unsigned int* state,
                                                  cudaGraphKernelNodeUpdate* scratch,
                                                  long long* values) {
  __shared__ unsigned int phase;
  if (threadIdx.x == 0) phase = next_phase(state);
  __syncthreads();
  for (unsigned int i = threadIdx.x; i < count; i += blockDim.x) {
    values[i] = 1 + phase;
    cudaGraphKernelNodeUpdate* u = scratch + 2 * i;
    u[0].node = nodes[i];
    u[0].field = cudaGraphKernelNodeFieldGridDim;
    u[0].updateData.gridDim = dim3(1 + phase, 1, 1);
    u[1].node = nodes[i];
    u[1].field = cudaGraphKernelNodeFieldParam;
    u[1].updateData.param.pValue = &values[i];
    u[1].updateData.param.offset = 0;
    u[1].updateData.param.size = sizeof(long long);
    cudaGraphKernelNodeUpdatesApply(u, 2);
  }
}

// E: no patch at all (a do-nothing head node), for the plain-graph floor.
extern "C" __global__ void patch_none(const cudaGraphDeviceNode_t*, unsigned int, unsigned int*) {}
