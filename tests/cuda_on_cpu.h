// The part of CUDA that TVM's generated kernels and runtime/kernels/decode_attention.cu use,
// on the CPU (tests/test_gemv_on_cpu.py, tests/test_decode_attention_on_cpu.py):
// each CUDA thread of a block is an OS thread; __syncthreads is a barrier of the block's
// threads, __shfl_*_sync an exchange among a warp's 32 lanes (a barrier of the warp on either
// side); blocks run one after another, all in one order or all in the reverse order.
// __shared__ arrays are statics: one copy, used by one block at a time.
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __shared__ static
#define uint unsigned int

using std::max;
using std::min;
static inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }

// Programmatic dependent launch (TVM's helpers for griddepcontrol): kernels here run one
// after another, so a kernel's wait has nothing to wait for, and no kernel launches early.
static inline void tvm_builtin_ptx_griddepcontrol_wait() {}
static inline void tvm_builtin_ptx_griddepcontrol_launch_dependents() {}

typedef _Float16 half;
typedef _Float16 __half;
struct dim3_ { unsigned x, y, z; };
thread_local dim3_ threadIdx, blockIdx;
static dim3_ blockDim, gridDim;

struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct int2 { int x, y; };
struct int4 { int x, y, z, w; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct longlong2 { long long x, y; };
struct longlong4 { long long x, y, z, w; };
struct half2 { half x, y; };
struct half4 { half x, y, z, w; };
static inline float2 make_float2(float a, float b) { return {a, b}; }
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static inline int2 make_int2(int a, int b) { return {a, b}; }
static inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }
static inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
static inline longlong2 make_longlong2(long long a, long long b) { return {a, b}; }
static inline longlong4 make_longlong4(long long a, long long b, long long c, long long d) {
  return {a, b, c, d};
}
static inline half2 make_half2(half a, half b) { return {a, b}; }
static inline half4 make_half4(half a, half b, half c, half d) { return {a, b, c, d}; }
static inline half __float2half_rn(float f) { return (half)f; }
static inline half __float2half(float f) { return (half)f; }
static inline float __half2float(half h) { return (float)h; }
// bfloat16 as CUDA's cuda_bf16.h has it for the kernels here: stored as its 16 bits,
// converted to and from float (round to nearest even, as __float2bfloat16_rn).
struct __nv_bfloat16 {
  unsigned short bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    bits = (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    unsigned u = (unsigned)bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
static inline float __bfloat162float(__nv_bfloat16 h) { return (float)h; }
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
static inline unsigned __pack_half2(const half x, const half y) {
  unsigned short a, b;
  std::memcpy(&a, &x, 2);
  std::memcpy(&b, &y, 2);
  return ((unsigned)b << 16) | a;
}

extern "C" int reverse_blocks = 0;
static std::barrier<>* block_barrier;
struct Warp {
  std::unique_ptr<std::barrier<>> bar;
  alignas(8) unsigned char lanes[32][8];
};
static std::vector<Warp>* warps;
thread_local int lane_id, warp_id;

static inline void __syncthreads() { block_barrier->arrive_and_wait(); }
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline unsigned atomicAdd(unsigned* at, unsigned value) {
  return __atomic_fetch_add(at, value, __ATOMIC_SEQ_CST);
}
template <class T> static inline T __ldcg(const T* at) { return *at; }
static inline unsigned __activemask() { return 0xffffffffu; }

template <class T> static inline T exchange(T v, int src) {
  Warp& w = (*warps)[warp_id];
  std::memcpy(w.lanes[lane_id], &v, sizeof(T));
  w.bar->arrive_and_wait();
  T out;
  std::memcpy(&out, w.lanes[src], sizeof(T));
  w.bar->arrive_and_wait();
  return out;
}
// CUDA: a source lane beyond the caller's width-segment leaves the caller's value.
template <class T> static inline T __shfl_down_sync(unsigned, T v, int delta, int width) {
  int src = (lane_id & (width - 1)) + delta >= width ? lane_id : lane_id + delta;
  return exchange(v, src);
}
template <class T> static inline T __shfl_sync(unsigned, T v, long lane, int width) {
  return exchange(v, (lane_id & ~(width - 1)) | ((int)lane & (width - 1)));
}
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int lane_mask, int width) {
  return exchange(v, (lane_id & ~(width - 1)) | ((lane_id ^ lane_mask) & (width - 1)));
}

template <class K>
static void launch(K kernel, unsigned gx, unsigned gy, unsigned bx, unsigned by, unsigned gz = 1) {
  unsigned threads = bx * by, blocks = gx * gy * gz;
  gridDim = {gx, gy, gz};
  blockDim = {bx, by, 1};
  std::barrier<> bar(threads);
  block_barrier = &bar;
  std::vector<Warp> ws((threads + 31) / 32);
  for (unsigned w = 0; w < ws.size(); ++w)
    ws[w].bar = std::make_unique<std::barrier<>>(std::min(32u, threads - 32 * w));
  warps = &ws;
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([=, &bar]() {
      threadIdx = {t % bx, t / bx, 0};
      lane_id = t % 32;
      warp_id = t / 32;
      for (unsigned i = 0; i < blocks; ++i) {
        unsigned b = reverse_blocks ? blocks - 1 - i : i;
        blockIdx = {b % gx, b / gx % gy, b / (gx * gy)};
        kernel();
        bar.arrive_and_wait();  // the next block reuses the shared arrays
      }
    });
  }
  for (auto& th : pool) th.join();
}
