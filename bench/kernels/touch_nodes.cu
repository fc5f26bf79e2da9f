// bench/device_updatable.py's head node: device-side updates that change nothing. Each
// thread sets one device-updatable node's grid to the grid it already has; `once`: only on
// the first launch (a flag in device memory), as grape's patch kernel updates a node only
// when its values change.
#include <cuda_runtime.h>

extern "C" __global__ void touch_nodes(const cudaGraphDeviceNode_t* nodes,
                                       const unsigned int* grids, unsigned int num_nodes,
                                       unsigned int* done, unsigned int once) {
  if (once && *done) return;
  for (unsigned int n = threadIdx.x; n < num_nodes; n += blockDim.x)
    cudaGraphKernelNodeSetGridDim(nodes[n], dim3(grids[3 * n], grids[3 * n + 1], grids[3 * n + 2]));
  __syncthreads();
  if (threadIdx.x == 0) *done = 1;
}
