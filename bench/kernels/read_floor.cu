// The yardstick for a kernel that must read a buffer once (a GEMV at M = 1 reads its weights):
// a plain read of the same bytes, nothing computed but an xor that keeps the loads live.
// `bench/read_floor.py` launches it over a sweep of grids and loads in flight per thread
// (U: the 16-byte loads a thread issues before it uses any) and keeps the fastest.
// Built with `nvcc --cubin -arch=sm_90`.

template <int U>
__device__ static void read_all(const uint4* __restrict__ src, unsigned long long n,
                                unsigned int* out) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned int acc = 0;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = __ldg(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = __ldg(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) out[0] = acc;  // a store the loads feed: the compiler keeps them
}

#define GRAPE_READ_FLOOR(U)                                                            \
  extern "C" __global__ void read_floor_u##U(const uint4* __restrict__ src,            \
                                              unsigned long long n, unsigned int* out) { \
    read_all<U>(src, n, out);                                                          \
  }

GRAPE_READ_FLOOR(1)
GRAPE_READ_FLOOR(2)
GRAPE_READ_FLOOR(4)
GRAPE_READ_FLOOR(8)

// Launched before each measured item: where one item's kernels end in a profiler's list.
extern "C" __global__ void read_floor_mark() {}
