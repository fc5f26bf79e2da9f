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
//   launch      = {u32 shape_row, u32 num_guards, u32 generation, u32 pad,
//                  u64 args[max(num_args, 1)], guards[num_guards] = {u64 address, u64 expect}}:
//                 the current call's row, the address of each region argument and the
//                 call's guards, written by the host in one stream-ordered copy, numbered
//                 (`generation`, never 0) each time it changes; or a record an earlier
//                 call kept (a slot of the host's `ready` buffer), generation included,
//                 which the host points this kernel's `launch` at. The host reserves
//                 max(num_args, 1) argument slots, so the guards start at byte
//                 16 + 8 * max(num_args, 1).
//   applied[a]  = the address of argument a the nodes point at now (this kernel's)
//   state       = {applied_row, nodes, applied_generation, pad} (this kernel's): the row
//                 applied last; whether the nodes are enabled (0), disabled (1) or unknown
//                 (anything else); the generation of the record applied last (0: none)
//
// A launch whose record is the one the launch before applied, with no guard to read and the
// nodes enabled, has nothing to do: the kernel reads the two generations and returns, one
// round trip to memory where the comparisons below take three or four (a region called again
// at the same shape and addresses; every region of a decode step whose shape did not move).
//
// Staging: the comparisons that decide what to patch read `args`, `applied` and a node's
// pointers once per pointer, one after the other in the thread that owns the node. From
// global memory each is a dependent load (the tables are cold after a step's weights went
// through L2): a launch that changed nothing cost 7.4 us on GPT-2's decode graph
// (bench/results/gpt2_step_ncu_topology.csv). So the block first copies them into dynamic
// shared memory together (`stage` 1: args and applied, 2: the pointers too, as much as
// the host found room for), and the threads compare there.
//
// Guards (predication): a guard is a 1-byte bool in device memory and the value it must
// hold (nonzero counts as 1), read here, when the graph runs: no host sync. If a guard fails
// the region is skipped: every node is disabled (device-side changes persist: they stay
// disabled until a launch whose guards hold enables them again) and nothing else changes,
// so `applied` and `applied_row` keep describing what the disabled nodes hold, and the
// next launch that runs patches relative to that. A data-dependent `if` launches both branches' graphs, each
// guarded by the condition; the branch not taken costs this kernel and nothing else.
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

struct Guard {
  unsigned long long address, expect;
};

struct Launch {
  unsigned int shape_row, num_guards, generation, pad;
  unsigned long long args[1];  // max(num_args, 1) of them, then num_guards Guards
};

struct State {
  unsigned int applied_row, nodes, applied_generation, pad;
};

#define GRAPE_NO_ROW 0xffffffffu
#define GRAPE_NODES_ENABLED 0u   // state.nodes; any value but these two: not known,
#define GRAPE_NODES_DISABLED 1u  // so the next launch sets every node either way

__device__ static bool same_value(const unsigned char* a, const unsigned char* b, unsigned int n) {
  for (unsigned int i = 0; i < n; ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// Whether every guard's byte equals its expected value (nonzero counts as 1).
__device__ static bool guards_hold(const Launch* launch, unsigned int num_args) {
  const Guard* guards =
      reinterpret_cast<const Guard*>(launch->args + (num_args > 0 ? num_args : 1));
  for (unsigned int g = 0; g < launch->num_guards; ++g) {
    const unsigned char value = *reinterpret_cast<const unsigned char*>(guards[g].address);
    if ((value != 0) != (guards[g].expect != 0)) return false;
  }
  return true;
}

#define GRAPE_STAGE_ARGS 1u
#define GRAPE_STAGE_POINTERS 2u

extern "C" __global__ void grape_patch(const Column* __restrict__ columns,
                                       const unsigned char* __restrict__ rows,
                                       unsigned int row_bytes,
                                       const Pointer* __restrict__ pointers,
                                       const Span* __restrict__ spans, unsigned int num_nodes,
                                       const Launch* __restrict__ launch,
                                       unsigned long long* applied, unsigned int num_args,
                                       State* state,
                                       const cudaGraphDeviceNode_t* __restrict__ nodes,
                                       unsigned int num_pointers, unsigned int stage) {
  {  // the record applied already, nothing guarded, nodes enabled: done (all four in flight)
    const unsigned int generation = launch->generation, num_guards = launch->num_guards;
    const unsigned int applied_generation = state->applied_generation, nodes = state->nodes;
    if ((num_guards == 0) & (generation == applied_generation) & (nodes == GRAPE_NODES_ENABLED))
      return;
  }
  __shared__ unsigned int shape_row, applied_row, nodes_were;
  __shared__ bool run;
  extern __shared__ unsigned long long staged[];  // args, applied, pointers (stage)
  const unsigned long long* args = launch->args;
  const unsigned long long* was = applied;
  const Pointer* ptrs = pointers;
  if (stage >= GRAPE_STAGE_ARGS) {
    unsigned long long* staged_args = staged;
    unsigned long long* staged_applied = staged + num_args;
    for (unsigned int a = threadIdx.x; a < num_args; a += blockDim.x) {
      staged_args[a] = launch->args[a];
      staged_applied[a] = applied[a];
    }
    args = staged_args;
    was = staged_applied;
    if (stage >= GRAPE_STAGE_POINTERS) {
      Pointer* staged_pointers = reinterpret_cast<Pointer*>(staged + 2 * num_args);
      for (unsigned int p = threadIdx.x; p < num_pointers; p += blockDim.x)
        staged_pointers[p] = pointers[p];
      ptrs = staged_pointers;
    }
  }
  if (threadIdx.x == 0) {
    shape_row = launch->shape_row;
    applied_row = state->applied_row;
    nodes_were = state->nodes;
    run = guards_hold(launch, num_args);
  }
  __syncthreads();  // thread 0's reads and the staged copies are seen by every thread
  // Enable or disable the nodes only when that changes them (or when it is not known: the
  // host re-encoded the table, see TopologyGraph._encode_table). Same node-to-thread mapping
  // as the patching below: one thread owns a node.
  const unsigned int nodes_now = run ? GRAPE_NODES_ENABLED : GRAPE_NODES_DISABLED;
  if (nodes_were != nodes_now)
    for (unsigned int n = threadIdx.x; n < num_nodes; n += blockDim.x)
      cudaGraphKernelNodeSetEnabled(nodes[n], run);
  if (threadIdx.x == 0) state->nodes = nodes_now;
  if (!run) return;  // skipped: nothing patched, `applied` and `applied_row` as they were
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
      const Pointer ptr = ptrs[p];
      if (args[ptr.arg] == was[ptr.arg]) continue;
      const unsigned long long address = args[ptr.arg] + ptr.delta;
      cudaGraphKernelNodeSetParam(node, ptr.offset, &address, sizeof(address));
    }
  }
  __syncthreads();  // every thread compared against `applied` before it changes
  for (unsigned int a = threadIdx.x; a < num_args; a += blockDim.x) applied[a] = args[a];
  if (threadIdx.x == 0) {
    state->applied_row = shape_row;
    state->applied_generation = launch->generation;
  }
}

// A memset node a library captured (cuBLASLt's split-K zeroes counters in its workspace, at
// an address and over a size that follow M), as a kernel node: a memset node's address and
// size are fixed in the graph, a kernel's parameters and grid are rewritten per shape by
// grape_patch like any other's, so two shapes whose memsets differ share one graph. Writes
// `value` (its low `element_size` bytes: 1, 2 or 4) to `width` elements of `height` rows,
// `pitch` bytes apart, as cuMemsetD2D* would.
extern "C" __global__ void grape_fill(unsigned char* dst, unsigned long long pitch,
                                      unsigned long long width, unsigned long long height,
                                      unsigned int value, unsigned int element_size) {
  const unsigned long long total = width * height;
  const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
       i < total; i += step) {
    unsigned char* at = dst + (i / width) * pitch + (i % width) * element_size;
    if (element_size == 4)
      *reinterpret_cast<unsigned int*>(at) = value;
    else if (element_size == 2)
      *reinterpret_cast<unsigned short*>(at) = (unsigned short)value;
    else
      *at = (unsigned char)value;
  }
}
