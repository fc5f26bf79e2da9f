// Fused attention, softmax(q k^T * scale + bias) v, for 16-bit q, k, v (runtime/attention.py),
// optionally causal: query row i of S attends keys j <= i + (T - S) of T, without a bias.
//
// One block of four warps takes 64 query rows of one (batch, head); each warp 16 of them. The
// block walks the keys 64 at a time: K and V tiles in shared memory (cp.async, the next tile's
// copy in flight during this one's work where two stages fit), the scores of a warp's
// rows in registers (mma.sync m16n8k16, fp32 accumulation), an online softmax (running max
// and sum per row, as FlashAttention-2), the probabilities rounded to 16 bits and multiplied
// by V into fp32 accumulators. Nothing of size seq x seq is written to memory.
//
// Layouts: q, k, v and out are strided views (elements): row r of head h of batch b starts at
// base + b * batch_stride + h * head_stride + r * row_stride; a row's D elements are
// contiguous. The caller guarantees every stride and base offset is a multiple of 8 elements
// (16-byte loads). bias (optional, same dtype) is read at b * bias_batch + h * bias_head +
// r * bias_row + key: a stride of 0 broadcasts.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .f16/.bf16 inputs, f32 accumulators), for
// lane = 4 * g + t: A (16 x 16, row-major) a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1],
// a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9]; B (16 x 8, "col") b0 = B[2t, 2t+1][g],
// b1 = B[2t+8, 2t+9][g]; C (16 x 8) c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1].
// A score tile's C fragments are, two n-tiles at a time, the A fragments of P for P v.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

#ifndef GRAPE_ATTENTION_WARPS
#define GRAPE_ATTENTION_WARPS 4
#endif
#ifndef GRAPE_ATTENTION_STAGES
#define GRAPE_ATTENTION_STAGES 2
#endif
constexpr int kWarps = GRAPE_ATTENTION_WARPS;
constexpr int kRows = 16 * kWarps;  // query rows per block: 16 per warp
constexpr int kKeys = 64;           // keys per tile
// K and V tiles in flight: the next tile is copied (cp.async) while this one is computed.
// Static shared memory stays under 48 KiB: two stages for a head_dim of 64, one for 128.
constexpr int kStages = GRAPE_ATTENTION_STAGES;
template <int D>
__host__ __device__ constexpr int stages() { return D <= 64 ? kStages : 1; }
constexpr int kPad = 8;      // halves of padding per shared row: no bank conflicts on b0 loads

struct Layout {
  long long batch_stride, head_stride, row_stride;
};

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma<__half>(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float* c, const uint32_t* a, uint32_t b0,
                                                   uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8 x 8 matrices of 16-bit elements from shared memory; lane l gives the address of row
// l % 8 of matrix l / 8 and receives, of matrix i, in r[i] the elements (l / 4, 2 (l % 4) + 0, 1)
// or, transposed, (2 (l % 4) + 0, 1; l / 4): the B fragments of mma.m16n8k16.
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* row) {
  uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* row) {
  uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// Rows [row0, row0 + kKeys) of a view into a shared tile of kKeys x (D + kPad), zeros past
// `rows`: asynchronous 16-byte copies (cp.async; a source size of 0 writes zeros), in the
// group the caller commits.
template <int D, typename T>
__device__ __forceinline__ void load_tile(T* tile, const T* base, long long row_stride,
                                          int row0, int rows) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < kKeys * kChunks; i += kWarps * 32) {
    int r = i / kChunks, c = (i % kChunks) * 8;
    bool in = row0 + r < rows;
    const T* source = in ? base + (long long)(row0 + r) * row_stride + c : base;
    uint32_t target = static_cast<uint32_t>(__cvta_generic_to_shared(tile + r * (D + kPad) + c));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(target), "l"(source), "r"(in ? 16 : 0));
  }
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n"); }

template <int Pending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(Pending));
}

template <int D, typename T>
__device__ void attention(const T* __restrict__ q, const T* __restrict__ k,
                          const T* __restrict__ v, const T* __restrict__ bias,
                          T* __restrict__ out, int query_rows, int keys, int causal, Layout ql,
                          Layout kl, Layout vl, Layout ol, Layout bl, float scale) {
  constexpr int kTile = kKeys * (D + kPad);
  constexpr int kStaged = stages<D>();
  __shared__ __align__(16) T k_tiles[kStaged * kTile];
  __shared__ __align__(16) T v_tiles[kStaged * kTile];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int batch = blockIdx.z, head = blockIdx.y;
  // Causal: the block's rows attend keys up to row + offset (the keys before the queries, a
  // cache, are all attended). Blocks with the most keys first, for the balance of the tail.
  const int offset = keys - query_rows;
  const int block = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int row0 = block * kRows + warp * 16;  // this warp's first query row
  const int key_end = causal ? min(keys, block * kRows + kRows + offset) : keys;
  q += batch * ql.batch_stride + head * ql.head_stride;
  k += batch * kl.batch_stride + head * kl.head_stride;
  v += batch * vl.batch_stride + head * vl.head_stride;
  if (bias != nullptr) bias += batch * bl.batch_stride + head * bl.head_stride;
  const float log2e = 1.4426950408889634f;
  const float scale_log2 = scale * log2e;

  // The warp's q rows as A fragments, D / 16 of them, kept for the whole key loop.
  uint32_t qa[D / 16][4];
  const uint16_t* q16 = reinterpret_cast<const uint16_t*>(q);
  for (int kc = 0; kc < D / 16; ++kc) {
    for (int half = 0; half < 2; ++half) {  // rows g and g + 8
      int row = row0 + g + 8 * half;
      bool in = row < query_rows;
      const uint16_t* p = q16 + (long long)row * ql.row_stride + kc * 16 + 2 * t;
      qa[kc][half] = in ? *reinterpret_cast<const uint32_t*>(p) : 0u;
      qa[kc][2 + half] = in ? *reinterpret_cast<const uint32_t*>(p + 8) : 0u;
    }
  }

  float acc[D / 8][4];  // out rows g and g + 8, columns 8 n + 2t, 2t + 1
  for (int n = 0; n < D / 8; ++n)
    for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

  if (kStaged > 1) {  // the first tile, before the loop
    load_tile<D>(k_tiles, k, kl.row_stride, 0, keys);
    load_tile<D>(v_tiles, v, vl.row_stride, 0, keys);
    commit_copies();
  }
  for (int key0 = 0, tile = 0; key0 < key_end; key0 += kKeys, ++tile) {
    const T* k_tile = k_tiles + (tile % kStaged) * kTile;
    const T* v_tile = v_tiles + (tile % kStaged) * kTile;
    if (kStaged == 1) {
      load_tile<D>(k_tiles, k, kl.row_stride, key0, keys);
      load_tile<D>(v_tiles, v, vl.row_stride, key0, keys);
      commit_copies();
      wait_copies<0>();
    } else if (key0 + kKeys < key_end) {  // the next tile's copy overlaps this one's work
      int next = (tile + 1) % kStaged;
      load_tile<D>(k_tiles + next * kTile, k, kl.row_stride, key0 + kKeys, keys);
      load_tile<D>(v_tiles + next * kTile, v, vl.row_stride, key0 + kKeys, keys);
      commit_copies();
      wait_copies<1>();  // this tile's group is complete, the next one's may be pending
    } else {
      wait_copies<0>();
    }
    __syncthreads();  // every thread's copies of this tile are visible

    float s[kKeys / 8][4];
    for (int n = 0; n < kKeys / 8; ++n) {
      for (int i = 0; i < 4; ++i) s[n][i] = 0.f;
      // Keys 8 n.. of the tile, head dims 16 kc.. 16 kc + 31: B fragments of two k-chunks.
      const T* krow = k_tile + (n * 8 + lane % 8) * (D + kPad) + (lane / 8) * 8;
      for (int kc = 0; kc < D / 16; kc += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, krow + kc * 16);
        mma<T>(s[n], qa[kc], b[0], b[1]);
        mma<T>(s[n], qa[kc + 1], b[2], b[3]);
      }
    }

    // Scale, bias, keys past the end; the running max and sum of rows g and g + 8.
    float tile_max[2] = {-INFINITY, -INFINITY};
    for (int n = 0; n < kKeys / 8; ++n) {
      for (int i = 0; i < 4; ++i) {
        int half = i / 2, key = key0 + n * 8 + 2 * t + (i % 2), row = row0 + g + 8 * half;
        float x = s[n][i] * scale_log2;
        if (key >= keys || (causal && key > row + offset)) {
          x = -INFINITY;
        } else if (bias != nullptr && row < query_rows) {
          x += to_float(bias[(long long)row * bl.row_stride + key]) * log2e;
        }
        s[n][i] = x;
        tile_max[half] = fmaxf(tile_max[half], x);
      }
    }
    float correction[2], reference[2];
    for (int half = 0; half < 2; ++half) {
      float m = tile_max[half];
      m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 2));
      float new_max = fmaxf(row_max[half], m);
      // Exponents are taken against the max, or 0 while a row is all -inf (a bias of
      // -inf): no inf - inf.
      reference[half] = new_max == -INFINITY ? 0.f : new_max;
      correction[half] = exp2f(row_max[half] - reference[half]);  // 0 on the first tile
      row_max[half] = new_max;
      row_sum[half] *= correction[half];
    }
    for (int n = 0; n < D / 8; ++n) {
      acc[n][0] *= correction[0];
      acc[n][1] *= correction[0];
      acc[n][2] *= correction[1];
      acc[n][3] *= correction[1];
    }
    // P = exp2(s - max), in 16 bits as the A fragments of P v (two score n-tiles each).
    uint32_t pa[kKeys / 16][4];
    for (int n = 0; n < kKeys / 8; ++n) {
      float p0 = exp2f(s[n][0] - reference[0]), p1 = exp2f(s[n][1] - reference[0]);
      float p2 = exp2f(s[n][2] - reference[1]), p3 = exp2f(s[n][3] - reference[1]);
      row_sum[0] += p0 + p1;
      row_sum[1] += p2 + p3;
      pa[n / 2][(n % 2) * 2 + 0] = pack2<T>(p0, p1);
      pa[n / 2][(n % 2) * 2 + 1] = pack2<T>(p2, p3);
    }
    for (int kc = 0; kc < kKeys / 16; ++kc) {
      // Keys 16 kc.. 16 kc + 15, head dims 8 n.. 8 n + 15: B fragments of two n-tiles.
      const T* vrow = v_tile + (kc * 16 + (lane / 8) % 2 * 8 + lane % 8) * (D + kPad) +
                      (lane / 16) * 8;
      for (int n = 0; n < D / 8; n += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, vrow + n * 8);
        mma<T>(acc[n], pa[kc], b[0], b[1]);
        mma<T>(acc[n + 1], pa[kc], b[2], b[3]);
      }
    }
    __syncthreads();  // this stage is read: the next iteration's copy may overwrite it
  }

  // Each row's sum over its four lanes, then out = acc / sum.
  for (int half = 0; half < 2; ++half) {
    row_sum[half] += __shfl_xor_sync(0xffffffff, row_sum[half], 1);
    row_sum[half] += __shfl_xor_sync(0xffffffff, row_sum[half], 2);
  }
  out += batch * ol.batch_stride + head * ol.head_stride;
  for (int half = 0; half < 2; ++half) {
    int row = row0 + g + 8 * half;
    if (row >= query_rows) continue;
    float inv = 1.f / row_sum[half];
    uint32_t* dst = reinterpret_cast<uint32_t*>(out + (long long)row * ol.row_stride + 2 * t);
    for (int n = 0; n < D / 8; ++n)
      dst[n * 4] = pack2<T>(acc[n][2 * half] * inv, acc[n][2 * half + 1] * inv);
  }
}

}  // namespace

// Strides as scalar parameters, each at most 8 bytes: the patch kernel rewrites a topology
// graph's parameters that change with the shape (runtime/topology_graph.py, MAX_PARAM_BYTES).
#define GRAPE_LAYOUT(X) long long X##_batch, long long X##_head, long long X##_row
#define GRAPE_ATTENTION(NAME, D, T)                                                          \
  extern "C" __global__ void __launch_bounds__(kWarps * 32)                                 \
      NAME(const T* q, const T* k, const T* v, const T* bias, T* out, int query_rows,       \
           int keys, int causal, GRAPE_LAYOUT(q), GRAPE_LAYOUT(k), GRAPE_LAYOUT(v),         \
           GRAPE_LAYOUT(o), GRAPE_LAYOUT(b), float scale) {                                 \
    attention<D, T>(q, k, v, bias, out, query_rows, keys, causal,                           \
                    Layout{q_batch, q_head, q_row},                                         \
                    Layout{k_batch, k_head, k_row}, Layout{v_batch, v_head, v_row},         \
                    Layout{o_batch, o_head, o_row}, Layout{b_batch, b_head, b_row}, scale); \
  }

GRAPE_ATTENTION(grape_attention_f16_d64, 64, __half)
GRAPE_ATTENTION(grape_attention_f16_d128, 128, __half)
GRAPE_ATTENTION(grape_attention_bf16_d64, 64, __nv_bfloat16)
GRAPE_ATTENTION(grape_attention_bf16_d128, 128, __nv_bfloat16)
