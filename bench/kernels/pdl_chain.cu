// Probe: what programmatic dependent launch (PDL) buys a decode step's chain of small kernels.
//
// A GPT-2-sized MLP layer at M = 1 (fp32): layer norm (one block) -> GEMV 768 -> 3072 -> GELU ->
// GEMV 3072 -> 768, twelve layers with weights of their own (226 MB, beyond L2), captured into
// one CUDA graph and replayed. Each variant runs the same arithmetic:
//   plain      kernels launched as usual: each starts when the one before has finished;
//   pdl        every kernel launched with programmatic stream serialization; each kernel lets
//              its dependents launch at once (griddepcontrol.launch_dependents) and waits for
//              the kernel before it (griddepcontrol.wait) before it reads anything;
//   prefetch   as pdl, and a GEMV asks L2 for its rows of weights before it waits;
//   registers  as pdl, and a GEMV loads its rows of weights into registers before it waits;
//   lines_l2   as pdl, and a GEMV's lanes prefetch its rows' 128-byte lines into L2 first;
//   lines_l1   the same into L1.
// Weights are never written, so reading them before the wait is safe; the activations are read
// after it. The chains: the layer above, its two GEMVs alone (4 warps a block, and 8), and,
// where GRAPE_KERNELS names grape's generated CUDA source, grape's m = 1 GEMV kernels for the
// MLP, alone and each beside the probe's (plain and pdl only: they choose their own loads).
// Prints one JSON object: us per layer for each variant, and each variant's largest difference
// from its chain's plain variant's output (bench/pdl_chain.py runs it and tabulates). Built
// with `nvcc -arch=sm_90 -O3` (bench/gpu/build_artifacts.py's pdl_chain step).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#ifdef GRAPE_KERNELS
#include GRAPE_KERNELS  // grape's generated CUDA source (see enqueue_grape)
#endif

enum Mode { PLAIN = 0, PDL = 1, PREFETCH = 2, REGISTERS = 3, LINES_L2 = 4, LINES_L1 = 5 };
// bench/pdl_chain.py reads these names
static const char* kModeNames[] = {"plain", "pdl", "prefetch", "registers", "lines_l2",
                                   "lines_l1"};
constexpr int kLastMode = LINES_L1;

constexpr int kWidth = 768, kHidden = 3072, kLayers = 12, kWarps = 4;

#define CHECK(call)                                                              \
  do {                                                                           \
    cudaError_t err_ = (call);                                                   \
    if (err_ != cudaSuccess) {                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,          \
                   cudaGetErrorString(err_));                                    \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)

__device__ __forceinline__ void launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void wait_for_primary() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int MODE>
__global__ void layer_norm(const float* __restrict__ x, const float* __restrict__ gamma,
                           float* __restrict__ y, int n) {
  if (MODE != PLAIN) {
    launch_dependents();
    wait_for_primary();
  }
  __shared__ float partial[32];
  float s = 0.f, ss = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float v = x[i];
    s += v;
    ss += v * v;
  }
  s = warp_sum(s);
  ss = warp_sum(ss);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) {
    partial[warp] = s;
    partial[16 + warp] = ss;
  }
  __syncthreads();
  s = lane < warps ? partial[lane] : 0.f;
  ss = lane < warps ? partial[16 + lane] : 0.f;
  s = warp_sum(s);
  ss = warp_sum(ss);
  const float mean = s / n, rstd = rsqrtf(ss / n - mean * mean + 1e-5f);
  for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = (x[i] - mean) * rstd * gamma[i];
}

template <int MODE>
__global__ void gelu(const float* __restrict__ x, float* __restrict__ y, int n) {
  if (MODE != PLAIN) {
    launch_dependents();
    wait_for_primary();
  }
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    float v = x[i];
    y[i] = 0.5f * v * (1.f + erff(v * 0.70710678f));
  }
}

// y[N] = W[N, K] x[K] + b: one warp a row, KV float4 a lane (K = 128 KV).
template <int MODE, int KV>
__global__ void gemv(const float* __restrict__ x, const float4* __restrict__ w,
                     const float* __restrict__ b, float* __restrict__ y, int n) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const float4* wrow = w + static_cast<size_t>(row) * KV * 32;
  float4 wv[KV];
  if (MODE != PLAIN) launch_dependents();
  if (MODE == PREFETCH && lane == 0 && row < n) prefetch_l2(wrow, KV * 32 * sizeof(float4));
  if ((MODE == LINES_L2 || MODE == LINES_L1) && row < n) {
    // the row's 128-byte lines, one per lane in turn
    const char* bytes = reinterpret_cast<const char*>(wrow);
    for (int line = lane; line < KV * 32 * 16 / 128; line += 32) {
      if (MODE == LINES_L2)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(bytes + line * 128) : "memory");
      else
        asm volatile("prefetch.global.L1 [%0];" ::"l"(bytes + line * 128) : "memory");
    }
  }
  if (MODE == REGISTERS && row < n) {
#pragma unroll
    for (int u = 0; u < KV; ++u) wv[u] = __ldg(wrow + u * 32 + lane);
  }
  if (MODE != PLAIN) wait_for_primary();
  if (row >= n) return;
  if (MODE != REGISTERS) {
#pragma unroll
    for (int u = 0; u < KV; ++u) wv[u] = __ldg(wrow + u * 32 + lane);
  }
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float acc = 0.f;
#pragma unroll
  for (int u = 0; u < KV; ++u) {
    const float4 xv = x4[u * 32 + lane];
    acc += wv[u].x * xv.x + wv[u].y * xv.y + wv[u].z * xv.z + wv[u].w * xv.w;
  }
  acc = warp_sum(acc);
  if (lane == 0) y[row] = acc + b[row];
}

struct Layer {
  float *gamma, *w_up, *b_up, *w_down, *b_down;
};

struct Buffers {
  float *h, *normed, *up, *act;
};

template <typename... Args>
static void launch_grid(void (*kernel)(Args...), dim3 grid, dim3 block, bool pdl,
                        cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  CHECK(cudaLaunchKernelEx(&config, kernel, args...));
}

template <typename... Args>
static void launch(void (*kernel)(Args...), int grid, int block, bool pdl, cudaStream_t stream,
                   Args... args) {
  launch_grid(kernel, dim3(grid), dim3(block), pdl, stream, args...);
}

template <int MODE>
static void enqueue_step(const std::vector<Layer>& layers, const Buffers& buf, bool gemv_only,
                         int warps, cudaStream_t stream) {
  const bool pdl = MODE != PLAIN;
  const int threads = warps * 32;
  for (const Layer& l : layers) {
    const float* in = buf.h;
    if (!gemv_only) {
      launch(layer_norm<MODE>, 1, 256, pdl, stream, (const float*)buf.h, (const float*)l.gamma,
             buf.normed, kWidth);
      in = buf.normed;
    }
    launch(gemv<MODE, kWidth / 128>, kHidden / warps, threads, pdl, stream, in,
           (const float4*)l.w_up, (const float*)l.b_up, buf.up, kHidden);
    const float* mid = buf.up;
    if (!gemv_only) {
      launch(gelu<MODE>, kHidden / 256, 256, pdl, stream, (const float*)buf.up, buf.act, kHidden);
      mid = buf.act;
    }
    launch(gemv<MODE, kHidden / 128>, kWidth / warps, threads, pdl, stream, mid,
           (const float4*)l.w_down, (const float*)l.b_down, buf.h, kWidth);
  }
}

#ifdef GRAPE_KERNELS
// grape's own m = 1 GEMV kernels for GPT-2's MLP, as its build generates them (the header is
// written by bench/gpu/build_artifacts.py's pdl_chain step): up with bias and GELU, grid 384
// of (32, 8); down with bias and the residual, grid 192 of (64, 4). They load their weights
// before griddepcontrol.wait themselves; plain launches them without the attribute (the
// instructions are then no-ops), pdl with it. ``grape_up`` / ``grape_down``: grape's kernel
// for that GEMV, else the probe's (its registers mode under pdl). The grids, blocks and
// argument orders are those of the generated kernels' signatures (a change there must be
// made here too). The down projection adds the residual in place, as grape's in-place
// fusion does: its output and residual are one buffer (bench/results/pdl_chain.nc_loads.json
// was run on kernels whose parameters were __restrict__, which that breaks).
static void enqueue_grape(const std::vector<Layer>& layers, const Buffers& buf, bool pdl,
                          bool grape_up, bool grape_down, cudaStream_t stream) {
  const int64_t m = 1;
  const int threads = kWarps * 32;
  for (const Layer& l : layers) {
    if (grape_up)
      launch_grid(matmul_bias_gelu_nt_gemv_kernel, dim3(384), dim3(32, 8), pdl, stream, l.b_up,
                  buf.up, l.w_up, buf.h, m);
    else
      launch(pdl ? gemv<REGISTERS, kWidth / 128> : gemv<PLAIN, kWidth / 128>, kHidden / kWarps,
             threads, pdl, stream, (const float*)buf.h, (const float4*)l.w_up,
             (const float*)l.b_up, buf.up, kHidden);
    if (grape_down)
      launch_grid(matmul_bias_residual_nt_gemv_kernel, dim3(192), dim3(64, 4), pdl, stream,
                  l.b_down, buf.h, buf.h, l.w_down, buf.up, m);
    else
      launch(pdl ? gemv<REGISTERS, kHidden / 128> : gemv<PLAIN, kHidden / 128>, kWidth / kWarps,
             threads, pdl, stream, (const float*)buf.up, (const float4*)l.w_down,
             (const float*)l.b_down, buf.h, kWidth);
  }
}
#endif

// The chains timed: GEMVs of 4 warps (the probe's), of 8 warps, and grape's own kernels.
enum Chain { NORM_GEMV_GELU_GEMV, GEMV_GEMV, GEMV_GEMV_8_WARPS, GRAPE_MLP, GRAPE_UP, GRAPE_DOWN };
static const char* kChainNames[] = {"norm_gemv_gelu_gemv", "gemv_gemv", "gemv_gemv_8_warps",
                                    "grape_mlp", "grape_up", "grape_down"};

template <int MODE>
static void enqueue_chain(int chain, const std::vector<Layer>& layers, const Buffers& buf,
                          cudaStream_t stream) {
#ifdef GRAPE_KERNELS
  if (chain >= GRAPE_MLP)
    return enqueue_grape(layers, buf, MODE != PLAIN, chain != GRAPE_DOWN, chain != GRAPE_UP,
                         stream);
#endif
  enqueue_step<MODE>(layers, buf, chain != NORM_GEMV_GELU_GEMV,
                     chain == GEMV_GEMV_8_WARPS ? 8 : kWarps, stream);
}

static void enqueue(int mode, int chain, const std::vector<Layer>& layers, const Buffers& buf,
                    cudaStream_t stream) {
  switch (mode) {
    case PLAIN: enqueue_chain<PLAIN>(chain, layers, buf, stream); break;
    case PDL: enqueue_chain<PDL>(chain, layers, buf, stream); break;
    case PREFETCH: enqueue_chain<PREFETCH>(chain, layers, buf, stream); break;
    case REGISTERS: enqueue_chain<REGISTERS>(chain, layers, buf, stream); break;
    case LINES_L2: enqueue_chain<LINES_L2>(chain, layers, buf, stream); break;
    default: enqueue_chain<LINES_L1>(chain, layers, buf, stream); break;
  }
}

// The modes each chain runs: every mode on the probe's chains; plain, pdl and registers on
// the 8-warp one; plain and pdl on grape's (its kernels choose what they load before waiting).
static bool runs(int chain, int mode) {
  if (chain == GEMV_GEMV_8_WARPS) return mode == PLAIN || mode == PDL || mode == REGISTERS;
  if (chain >= GRAPE_MLP) return mode == PLAIN || mode == PDL;
  return true;
}

static float* device_random(size_t n, float scale, unsigned seed) {
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    host[i] = scale * (static_cast<float>(seed >> 8) / 16777216.f - 0.5f);
  }
  float* d;
  CHECK(cudaMalloc(&d, n * sizeof(float)));
  CHECK(cudaMemcpy(d, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 200;
  std::vector<Layer> layers(kLayers);
  unsigned seed = 1;
  for (Layer& l : layers) {
    l.gamma = device_random(kWidth, 2.f, seed++);
    l.w_up = device_random(static_cast<size_t>(kHidden) * kWidth, 0.07f, seed++);
    l.b_up = device_random(kHidden, 0.1f, seed++);
    l.w_down = device_random(static_cast<size_t>(kWidth) * kHidden, 0.035f, seed++);
    l.b_down = device_random(kWidth, 0.1f, seed++);
  }
  Buffers buf;
  float* input = device_random(kWidth, 2.f, 12345);
  buf.h = device_random(kWidth, 0.f, 0);
  buf.normed = device_random(kWidth, 0.f, 0);
  buf.up = device_random(kHidden, 0.f, 0);
  buf.act = device_random(kHidden, 0.f, 0);
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));

  std::printf("{\"reps\": %d, \"layers\": %d, \"weight_bytes_per_layer\": %zu, \"chains\": {",
              reps, kLayers, 2 * sizeof(float) * kHidden * kWidth);
#ifdef GRAPE_KERNELS
  const int chains = GRAPE_DOWN + 1;
#else
  const int chains = GRAPE_MLP;
#endif
  for (int chain = 0; chain < chains; ++chain) {
    std::printf("%s\"%s\": {", chain ? ", " : "", kChainNames[chain]);
    std::vector<float> reference(kWidth), result(kWidth);
    for (int mode = PLAIN; mode <= kLastMode; ++mode) {
      if (!runs(chain, mode)) continue;
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      enqueue(mode, chain, layers, buf, stream);
      CHECK(cudaStreamEndCapture(stream, &graph));
      CHECK(cudaGraphInstantiate(&exec, graph, 0));
      // One step from the same input: the output of every variant must match the plain one's.
      CHECK(cudaMemcpyAsync(buf.h, input, kWidth * sizeof(float), cudaMemcpyDeviceToDevice,
                            stream));
      CHECK(cudaGraphLaunch(exec, stream));
      CHECK(cudaMemcpyAsync(result.data(), buf.h, kWidth * sizeof(float),
                            cudaMemcpyDeviceToHost, stream));
      CHECK(cudaStreamSynchronize(stream));
      if (mode == PLAIN) reference = result;
      float diff = 0.f;
      for (int i = 0; i < kWidth; ++i) diff = std::fmax(diff, std::fabs(result[i] - reference[i]));
      for (int i = 0; i < 20; ++i) CHECK(cudaGraphLaunch(exec, stream));
      CHECK(cudaEventRecord(start, stream));
      for (int i = 0; i < reps; ++i) CHECK(cudaGraphLaunch(exec, stream));
      CHECK(cudaEventRecord(stop, stream));
      CHECK(cudaEventSynchronize(stop));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, start, stop));
      std::printf("%s\"%s\": {\"us_per_layer\": %.3f, \"max_abs_diff\": %.3g}",
                  mode ? ", " : "", kModeNames[mode], 1000.f * ms / reps / kLayers, diff);
      CHECK(cudaGraphExecDestroy(exec));
      CHECK(cudaGraphDestroy(graph));
    }
    std::printf("}");
  }
  std::printf("}}\n");
  return 0;
}
