// Attention of a few query rows over many keys, softmax(q k^T * scale + bias) v, for fp32,
// fp16 or bf16 q, k, v (runtime/attention.py): a decode step's attention over its cache,
// optionally causal (query row i of S attends keys j <= i + (T - S) of T).
//
// One block of eight warps (sixteen: the _wide kernels) takes one query row of one (batch,
// head), or one split of its keys where the grid would be small (runtime/attention.py,
// decode_splits). Each warp walks its own
// tiles of 32 keys (tile w, w + 8, ...). It reads a tile's key and value rows coalesced, 16
// bytes a lane, D * sizeof(T) / 16 lanes a row, all of them in flight at once where registers
// allow; a lane's partial dot products over its head dims become one key's score per lane by
// a transposed sum (31 shuffles at most); the warp keeps a running max and per-lane sums
// (online softmax, as FlashAttention), and the probabilities, passed lane to lane, weight the
// value rows into fp32 accumulators. The warps' results are combined through shared memory;
// a split row's blocks leave theirs in a workspace, and the last to finish combines them.
// Nothing of size keys is written to memory: K and V are read once.
//
// The _append kernels also append a step's new keys and values to the cache (GPT-2's present
// = concat(past, new), which the attention reads): key j comes from the past cache below
// ``past`` and from the new rows (strided views, as q) from there. Blocks past the
// attention's along x copy the rows to the present caches, kCopyPasses rows of a block's
// threads each: the copy runs on other SMs while the attention's few blocks read. Written
// by the attention's blocks instead, it doubled their memory traffic: on the H200, 4.85
// against 3.40 us in fp32 at 2 keys, 25.7 against 8.0 in fp16 for 1024 keys in one block
// (bench/results/decode_attention.writes_in_attention.json).

// Layouts as runtime/kernels/attention.cu: q, k, v and out are strided views (elements): row
// r of head h of batch b starts at base + b * batch_stride + h * head_stride + r * row_stride;
// a row's D elements are contiguous. The caller guarantees q's, k's and v's bases and strides
// (and an _append kernel's new rows' and presents') are multiples of 16 bytes (each is read
// or written 16 bytes at a time). bias (optional, same dtype) is
// read at b * bias_batch + h * bias_head + r * bias_row + key: a stride of 0 broadcasts.
//
// tests/test_decode_attention_on_cpu.py compiles this file for the CPU (tests/cuda_on_cpu.h).

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif
#include <math.h>
#include <stdint.h>

namespace {

#ifndef GRAPE_DECODE_WARPS
#define GRAPE_DECODE_WARPS 8
#endif
constexpr int kWarps = GRAPE_DECODE_WARPS;  // a block's warps
// fp32 rows of more keys than one round of kWarps warps and no split: twice the warps
// (runtime/attention.py, WIDE_DECODE_DTYPES).
constexpr int kWideWarps = 2 * kWarps;
constexpr int kLanes = 32;
constexpr float kLog2e = 1.4426950408889634f;

struct DecodeLayout {
  long long batch_stride, head_stride, row_stride;
};

template <typename T>
__device__ __forceinline__ float as_float(T x) { return static_cast<float>(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x) { return static_cast<T>(x); }
#ifdef __CUDACC__
template <>
__device__ __forceinline__ float as_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ float as_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
#endif

// N elements read or written as one aligned access (16 bytes at most).
template <typename T, int N>
struct alignas(N * sizeof(T)) Pack {
  T x[N];
};

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load(const T* at) {
  return *reinterpret_cast<const Pack<T, N>*>(at);
}

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = kLanes / 2; offset > 0; offset /= 2)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset, kLanes));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = kLanes / 2; offset > 0; offset /= 2)
    x += __shfl_xor_sync(0xffffffffu, x, offset, kLanes);
  return x;
}

// exp(x - reference) for a reference that may be -inf (nothing seen yet): 0 then.
__device__ __forceinline__ float scaled_exp(float x, float reference) {
  return x == -INFINITY ? 0.f : exp2f((x - reference) * kLog2e);
}

// A lane's kLoads rows of a tile, kRowsAtOnce rows apart: those inside the keys (the lane
// has rows_left of them from its first), zeros after them.
template <typename T, int kVec, int kLoads, int kRowsAtOnce>
__device__ __forceinline__ void load_rows(Pack<T, kVec>* values, const T* at, long long stride,
                                            int rows_left) {
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    if (i * kRowsAtOnce < rows_left) {
      values[i] = load<T, kVec>(at + i * kRowsAtOnce * stride);
    } else {
      for (int e = 0; e < kVec; ++e) values[i].x[e] = from_float<T>(0.f);
    }
  }
}

// A (batch, head)'s key or value rows of an _append kernel: row j from ``past`` below
// ``past_rows``, from ``fresh`` (the step's new rows) after.
template <typename T>
struct AppendedRows {
  const T* past;
  long long past_stride;
  const T* fresh;
  long long fresh_stride;
  int past_rows;

  __device__ __forceinline__ const T* row(int j) const {
    return j < past_rows ? past + j * past_stride : fresh + (j - past_rows) * fresh_stride;
  }
};

// load_rows over AppendedRows: the lane's rows first, first + kRowsAtOnce, ..., at head
// dims from ``dim``.
template <typename T, int kVec, int kLoads, int kRowsAtOnce>
__device__ __forceinline__ void load_appended_rows(Pack<T, kVec>* values,
                                                   const AppendedRows<T>& rows, int first,
                                                   int dim, int rows_left) {
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    if (i * kRowsAtOnce < rows_left) {
      values[i] = load<T, kVec>(rows.row(first + i * kRowsAtOnce) + dim);
    } else {
      for (int e = 0; e < kVec; ++e) values[i].x[e] = from_float<T>(0.f);
    }
  }
}

// The rows a load_rows or load_appended_rows of the same arguments read (those inside the
// keys), written at ``at``, ``stride`` apart.
template <typename T, int kVec, int kLoads, int kRowsAtOnce>
__device__ __forceinline__ void store_rows(const Pack<T, kVec>* values, T* at, long long stride,
                                           int rows_left) {
#pragma unroll
  for (int i = 0; i < kLoads; ++i)
    if (i * kRowsAtOnce < rows_left)
      *reinterpret_cast<Pack<T, kVec>*>(at + i * kRowsAtOnce * stride) = values[i];
}

// A tile's key or value rows: from ``at`` (load_rows), or from ``rows`` in an _append kernel.
template <typename T, int kVec, int kLoads, int kRowsAtOnce, bool kAppend>
__device__ __forceinline__ void load_tile_rows(Pack<T, kVec>* values, const T* at,
                                               long long stride, const AppendedRows<T>& rows,
                                               int first, int dim, int rows_left) {
  if constexpr (kAppend)
    load_appended_rows<T, kVec, kLoads, kRowsAtOnce>(values, rows, first, dim, rows_left);
  else
    load_rows<T, kVec, kLoads, kRowsAtOnce>(values, at, stride, rows_left);
}

// What an _append kernel reads and writes besides the attention's operands: k and v are the
// past caches, ``past`` rows of them.
template <typename T>
struct CacheAppend {
  const T* k_new;
  const T* v_new;
  T* k_present;
  T* v_present;
  int past;
  DecodeLayout k_new_layout, v_new_layout, k_present_layout, v_present_layout;

  // A (batch, head)'s keys (``values`` false) or values: the past cache (``cache``, laid
  // out as ``layout``) below ``past``, the new rows after.
  __device__ __forceinline__ AppendedRows<T> rows(const T* cache, const DecodeLayout& layout,
                                                  bool values, int batch, int head) const {
    const T* fresh = values ? v_new : k_new;
    const DecodeLayout& fresh_layout = values ? v_new_layout : k_new_layout;
    return {cache + batch * layout.batch_stride + head * layout.head_stride, layout.row_stride,
            fresh + batch * fresh_layout.batch_stride + head * fresh_layout.head_stride,
            fresh_layout.row_stride, past};
  }
};

// Rows a thread of a copy block of an _append kernel copies, of keys and of values
// (runtime/attention.py: COPY_PASSES).
constexpr int kCopyPasses = 4;

// A copy block of an _append kernel: kCopyPasses rounds of its threads' rows of its (batch,
// head)'s present caches, every load in flight before any store.
template <int D, typename T, int kThreads>
__device__ __forceinline__ void append_to_cache(const T* k, const T* v, DecodeLayout kl,
                                                DecodeLayout vl, int keys,
                                                const CacheAppend<T>& a, int copy_block) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kRowLanes = D / kVec;
  constexpr int kRowsAtOnce = kThreads / kRowLanes;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int part = threadIdx.x % kRowLanes;
  const int first = copy_block * kCopyPasses * kRowsAtOnce + threadIdx.x / kRowLanes;
  const int rows_left = keys - first;
  const AppendedRows<T> keys_of = a.rows(k, kl, false, batch, head);
  const AppendedRows<T> values_of = a.rows(v, vl, true, batch, head);
  Pack<T, kVec> key_rows[kCopyPasses], value_rows[kCopyPasses];
  load_appended_rows<T, kVec, kCopyPasses, kRowsAtOnce>(key_rows, keys_of, first, part * kVec,
                                                        rows_left);
  load_appended_rows<T, kVec, kCopyPasses, kRowsAtOnce>(value_rows, values_of, first,
                                                        part * kVec, rows_left);
  const DecodeLayout& kp = a.k_present_layout;
  const DecodeLayout& vp = a.v_present_layout;
  store_rows<T, kVec, kCopyPasses, kRowsAtOnce>(
      key_rows,
      a.k_present + batch * kp.batch_stride + head * kp.head_stride + first * kp.row_stride +
          part * kVec,
      kp.row_stride, rows_left);
  store_rows<T, kVec, kCopyPasses, kRowsAtOnce>(
      value_rows,
      a.v_present + batch * vp.batch_stride + head * vp.head_stride + first * vp.row_stride +
          part * kVec,
      vp.row_stride, rows_left);
}

// Sums v[i] over the kN lanes of a group (lanes whose indices differ in their low log2(kN)
// bits): afterwards v[0] of the lane at ``part`` in its group holds the sum of index part.
// Half the values move at each of log2(kN) steps: kN - 1 shuffles for kN sums.
template <int kN, int kHalf = kN / 2>
__device__ __forceinline__ float transposed_sum(float (&v)[kN], int part) {
  if constexpr (kHalf >= 1) {
    const bool upper = part & kHalf;
#pragma unroll
    for (int j = 0; j < kHalf; ++j) {
      const float send = upper ? v[j] : v[j + kHalf];
      const float keep = upper ? v[j + kHalf] : v[j];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, kHalf, kLanes);
    }
    return transposed_sum<kN, kHalf / 2>(v, part);
  }
  return v[0];
}

template <int D, typename T, int kDecodeWarps, bool kAppend = false>
__device__ __forceinline__ void decode_attention(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ bias, T* __restrict__ out, int query_rows, int keys, int causal,
    DecodeLayout ql, DecodeLayout kl, DecodeLayout vl, DecodeLayout ol, DecodeLayout bl,
    float scale, float* __restrict__ partials, unsigned* __restrict__ counters, int splits,
    CacheAppend<T> append = {}) {
  // A warp reads a tile's key and value rows kRowsAtOnce at a time, kRowLanes lanes a row,
  // 16 bytes a lane: lane (slot, part) reads head dims part * kVec.. of rows slot,
  // slot + kRowsAtOnce, ... (kLoads of them), coalesced.
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kRowLanes = D / kVec;
  constexpr int kRowsAtOnce = kLanes / kRowLanes;
  constexpr int kLoads = kRowLanes;  // rows of a tile a lane reads, of keys and of values
  static_assert(D % kVec == 0 && kLanes % kRowLanes == 0, "head_dim: 32, 64 or 128");
  // A tile's value rows loaded with its key rows where registers allow (a head_dim of 64):
  // one round trip to memory a tile instead of two. Not in the wide _append kernels, whose
  // past and new rows' pointers leave too few of a thread's 128 registers: holding both,
  // ptxas spilled 196 bytes, and they ran 1.07x to 1.15x the time of loading the values
  // after the keys, all at once (bench/results/decode_attention.values_after.json).
  constexpr bool kValuesWithKeys = D <= 64 && !(kAppend && kDecodeWarps == kWideWarps);
  constexpr int kValueBatch = D <= 64 ? kLoads : kLoads / 2;  // value rows in flight
  __shared__ float partial_max[kDecodeWarps], partial_sum[kDecodeWarps];
  __shared__ float partial_acc[kDecodeWarps][D];
  __shared__ int last_split;

  if constexpr (kAppend) {  // the blocks past the attention's copy the caches
    if (blockIdx.x >= query_rows * splits) {
      append_to_cache<D, T, kDecodeWarps * kLanes>(k, v, kl, vl, keys, append,
                                                   blockIdx.x - query_rows * splits);
      return;
    }
  }
  const int row = blockIdx.x / splits, split = blockIdx.x % splits;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const int part = lane % kRowLanes, slot = lane / kRowLanes;
  float q_part[kVec];  // the lane's head dims of q, scaled
  {
    const Pack<T, kVec> loaded = load<T, kVec>(
        q + batch * ql.batch_stride + head * ql.head_stride + row * ql.row_stride + part * kVec);
    for (int e = 0; e < kVec; ++e) q_part[e] = as_float(loaded.x[e]) * scale;
  }

  // This block's keys: its split's whole tiles, up to the last key the row attends (causal).
  const int visible = causal ? min(keys, row + 1 + keys - query_rows) : keys;
  const int span = ((keys + splits - 1) / splits + kLanes - 1) / kLanes * kLanes;
  const int begin = split * span, end = min(visible, begin + span);
  // _append: the keys and values as past and new rows.
  AppendedRows<T> key_source{}, value_source{};
  if constexpr (kAppend) {
    key_source = append.rows(k, kl, false, batch, head);
    value_source = append.rows(v, vl, true, batch, head);
  }
  k += batch * kl.batch_stride + head * kl.head_stride;
  v += batch * vl.batch_stride + head * vl.head_stride;
  const T* bias_at =
      bias ? bias + batch * bl.batch_stride + head * bl.head_stride + row * bl.row_stride : nullptr;

  float running_max = -INFINITY, lane_sum = 0.f;
  float acc[kVec];
  for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
  for (int first = begin + warp * kLanes; first < end; first += kDecodeWarps * kLanes) {
    // Every load of the tile in flight before any is used. After the transposed sum the
    // lane holds the score of key ``own``: tile row part * kRowsAtOnce + slot.
    const int rows_left = end - first - slot;  // the lane's rows i inside: i * kRowsAtOnce <
    const int own = first + part * kRowsAtOnce + slot;
    Pack<T, kVec> key_rows[kLoads];
    load_tile_rows<T, kVec, kLoads, kRowsAtOnce, kAppend>(
        key_rows, k + (first + slot) * kl.row_stride + part * kVec, kl.row_stride, key_source,
        first + slot, part * kVec, rows_left);
    const float own_bias = bias_at && own < end ? as_float(bias_at[own]) : 0.f;
    Pack<T, kVec> values[kValueBatch];
    const T* v_at = v + (first + slot) * vl.row_stride + part * kVec;
    if (kValuesWithKeys)
      load_tile_rows<T, kVec, kValueBatch, kRowsAtOnce, kAppend>(
          values, v_at, vl.row_stride, value_source, first + slot, part * kVec, rows_left);
    float dots[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      dots[i] = 0.f;
#pragma unroll
      for (int e = 0; e < kVec; ++e) dots[i] += q_part[e] * as_float(key_rows[i].x[e]);
    }
    const float dot = transposed_sum<kLoads>(dots, part);  // every lane: it shuffles
    const float score = own < end ? dot + own_bias : -INFINITY;
    const float tile_max = fmaxf(running_max, warp_max(score));
    if (tile_max == -INFINITY) continue;  // every key so far masked out (the whole warp)
    const float correction = scaled_exp(running_max, tile_max);
    const float p = scaled_exp(score, tile_max);  // 0 past the end
    lane_sum = lane_sum * correction + p;
    running_max = tile_max;
    for (int e = 0; e < kVec; ++e) acc[e] *= correction;
#pragma unroll
    for (int batch_first = 0; batch_first < kLoads; batch_first += kValueBatch) {
      const int rows_before = batch_first * kRowsAtOnce;
      if (!kValuesWithKeys)
        load_tile_rows<T, kVec, kValueBatch, kRowsAtOnce, kAppend>(
            values, v_at + rows_before * vl.row_stride, vl.row_stride, value_source,
            first + slot + rows_before, part * kVec, rows_left - rows_before);
#pragma unroll
      for (int i = 0; i < kValueBatch; ++i) {  // row batch_first + i's weight: that lane's p
        const float weight =
            __shfl_sync(0xffffffffu, p, slot * kRowLanes + batch_first + i, kLanes);
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] += weight * as_float(values[i].x[e]);
      }
    }
  }
  // The slots' sums of each head dim, into the lanes of slot 0.
  for (int offset = kRowLanes; offset < kLanes; offset *= 2)
    for (int e = 0; e < kVec; ++e) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], offset, kLanes);

  // The warps' partial results, rescaled to the block's max.
  const float warp_total = warp_sum(lane_sum);
  if (lane == 0) {
    partial_max[warp] = running_max;
    partial_sum[warp] = warp_total;
  }
  if (slot == 0)
    for (int e = 0; e < kVec; ++e) partial_acc[warp][part * kVec + e] = acc[e];
  __syncthreads();
  float block_max = -INFINITY, block_sum = 0.f;
  for (int w = 0; w < kDecodeWarps; ++w) block_max = fmaxf(block_max, partial_max[w]);
  for (int w = 0; w < kDecodeWarps; ++w)
    block_sum += partial_sum[w] * scaled_exp(partial_max[w], block_max);
  T* out_at = out + batch * ol.batch_stride + head * ol.head_stride + row * ol.row_stride;
  if (splits == 1) {
    for (int d = threadIdx.x; d < D; d += kDecodeWarps * kLanes) {
      float total = 0.f;
      for (int w = 0; w < kDecodeWarps; ++w)
        total += partial_acc[w][d] * scaled_exp(partial_max[w], block_max);
      out_at[d] = from_float<T>(total / block_sum);  // 0 / 0 where every score is -inf
    }
    return;
  }

  // Split keys: each block leaves (acc, max, sum) in partials; the last of the row's blocks
  // to finish (counted in counters, which it sets back to 0) combines them (as the
  // threadFenceReduction sample of the CUDA samples).
  const int index = (batch * gridDim.y + head) * query_rows + row;
  float* mine = partials + ((long long)index * splits + split) * (D + 2);
  for (int d = threadIdx.x; d < D; d += kDecodeWarps * kLanes) {
    float total = 0.f;
    for (int w = 0; w < kDecodeWarps; ++w)
      total += partial_acc[w][d] * scaled_exp(partial_max[w], block_max);
    mine[d] = total;
  }
  if (threadIdx.x == 0) {
    mine[D] = block_max;
    mine[D + 1] = block_sum;
  }
  __threadfence();  // this block's partials visible to the block that combines
  __syncthreads();
  if (threadIdx.x == 0) last_split = atomicAdd(&counters[index], 1u) == (unsigned)splits - 1;
  __syncthreads();
  if (!last_split) return;
  __threadfence();
  const float* row_partials = partials + (long long)index * splits * (D + 2);
  float row_max = -INFINITY, row_sum = 0.f;
  for (int s = 0; s < splits; ++s) row_max = fmaxf(row_max, __ldcg(row_partials + s * (D + 2) + D));
  for (int s = 0; s < splits; ++s) {
    const float* at = row_partials + s * (D + 2);
    row_sum += __ldcg(at + D + 1) * scaled_exp(__ldcg(at + D), row_max);
  }
  for (int d = threadIdx.x; d < D; d += kDecodeWarps * kLanes) {
    float total = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float* at = row_partials + s * (D + 2);
      total += __ldcg(at + d) * scaled_exp(__ldcg(at + D), row_max);
    }
    out_at[d] = from_float<T>(total / row_sum);
  }
  if (threadIdx.x == 0) counters[index] = 0;  // ready for the next launch
}

}  // namespace

// Strides as scalar parameters, each at most 8 bytes: the patch kernel rewrites a topology
// graph's parameters that change with the shape (runtime/topology_graph.py, MAX_PARAM_BYTES).
#define GRAPE_LAYOUT(X) long long X##_batch, long long X##_head, long long X##_row
#define GRAPE_DECODE_ATTENTION(NAME, D, T, WARPS)                                              \
  extern "C" __global__ void __launch_bounds__(WARPS * kLanes)                                \
      NAME(const T* q, const T* k, const T* v, const T* bias, T* out, int query_rows,         \
           int keys, int causal, GRAPE_LAYOUT(q), GRAPE_LAYOUT(k), GRAPE_LAYOUT(v),           \
           GRAPE_LAYOUT(o), GRAPE_LAYOUT(b), float scale, float* partials,                   \
           unsigned* counters, int splits) {                                                  \
    decode_attention<D, T, WARPS>(q, k, v, bias, out, query_rows, keys, causal,               \
                           DecodeLayout{q_batch, q_head, q_row},                              \
                           DecodeLayout{k_batch, k_head, k_row},                              \
                           DecodeLayout{v_batch, v_head, v_row},                              \
                           DecodeLayout{o_batch, o_head, o_row},                              \
                           DecodeLayout{b_batch, b_head, b_row}, scale, partials, counters,   \
                           splits);                                                           \
  }

// The _append kernels' parameters: the above (k and v the past caches), then the new rows'
// and the present caches' pointers, the past's rows and their four layouts.
#define GRAPE_DECODE_ATTENTION_APPEND(NAME, D, T, WARPS)                                       \
  extern "C" __global__ void __launch_bounds__(WARPS * kLanes)                                \
      NAME(const T* q, const T* k, const T* v, const T* bias, T* out, int query_rows,         \
           int keys, int causal, GRAPE_LAYOUT(q), GRAPE_LAYOUT(k), GRAPE_LAYOUT(v),           \
           GRAPE_LAYOUT(o), GRAPE_LAYOUT(b), float scale, float* partials,                   \
           unsigned* counters, int splits, const T* k_new, const T* v_new, T* k_present,     \
           T* v_present, int past, GRAPE_LAYOUT(kn), GRAPE_LAYOUT(vn), GRAPE_LAYOUT(kp),      \
           GRAPE_LAYOUT(vp)) {                                                                \
    decode_attention<D, T, WARPS, true>(                                                      \
        q, k, v, bias, out, query_rows, keys, causal, DecodeLayout{q_batch, q_head, q_row},   \
        DecodeLayout{k_batch, k_head, k_row}, DecodeLayout{v_batch, v_head, v_row},           \
        DecodeLayout{o_batch, o_head, o_row}, DecodeLayout{b_batch, b_head, b_row}, scale,    \
        partials, counters, splits,                                                           \
        CacheAppend<T>{k_new, v_new, k_present, v_present, past,                              \
                       DecodeLayout{kn_batch, kn_head, kn_row},                               \
                       DecodeLayout{vn_batch, vn_head, vn_row},                               \
                       DecodeLayout{kp_batch, kp_head, kp_row},                               \
                       DecodeLayout{vp_batch, vp_head, vp_row}});                             \
  }
#define GRAPE_DECODE_ATTENTION_BOTH(NAME, D, T, WARPS) \
  GRAPE_DECODE_ATTENTION(NAME, D, T, WARPS)            \
  GRAPE_DECODE_ATTENTION_APPEND(NAME##_append, D, T, WARPS)

GRAPE_DECODE_ATTENTION_BOTH(grape_decode_attention_f32_d64, 64, float, kWarps)
GRAPE_DECODE_ATTENTION_BOTH(grape_decode_attention_f32_d128, 128, float, kWarps)
GRAPE_DECODE_ATTENTION_BOTH(grape_decode_attention_f32_d64_wide, 64, float, kWideWarps)
GRAPE_DECODE_ATTENTION_BOTH(grape_decode_attention_f32_d128_wide, 128, float, kWideWarps)
#if defined(__CUDACC__) || defined(GRAPE_CPU_HALF)
GRAPE_DECODE_ATTENTION_BOTH(grape_decode_attention_f16_d64, 64, __half, kWarps)
GRAPE_DECODE_ATTENTION_BOTH(grape_decode_attention_f16_d128, 128, __half, kWarps)
#endif
#if defined(__CUDACC__) || defined(GRAPE_CPU_BF16)
GRAPE_DECODE_ATTENTION_BOTH(grape_decode_attention_bf16_d64, 64, __nv_bfloat16, kWarps)
GRAPE_DECODE_ATTENTION_BOTH(grape_decode_attention_bf16_d128, 128, __nv_bfloat16, kWarps)
#endif
