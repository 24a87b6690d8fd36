// cooperative_groups.h for the sim: thread_block, thread_block_tile<1..32> and cg::reduce with the
// semantics of the CUDA Programming Guide ("Cooperative Groups") and of NVIDIA's header, on the
// engine's exact barriers and warp collectives. NVIDIA's header does not compile as host code; this
// one is found first (the sim's include directory comes before NVIDIA's); NVRTC builds use NVIDIA's.
// Not provided: grid and cluster groups, coalesced groups, tiles above 32 threads, memcpy_async.
#pragma once

namespace cooperative_groups {
namespace sim_detail {
// A call site as a barrier identity (see CUPAGED_SIM_SITE): the file name's address with the line
// in bits 48..63, never a real address, so it cannot match a __syncthreads() site by accident.
inline const void* site(const char* file, int line) {
  return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(file) ^ (uintptr_t(line & 0xFFFF) << 48));
}
}  // namespace sim_detail

class thread_block {
 public:
  // bar.sync 0 like __syncthreads(); each call site its own, so a divergent one is reported.
  static void sync(int line = __builtin_LINE(), const char* file = __builtin_FILE()) {
    ::cupaged_sim::barrier(0, 0, line, sim_detail::site(file, line));
  }
  static unsigned thread_rank() { return unsigned(::cupaged_sim::g.cur->linear); }
  static unsigned num_threads() { return blockDim.x * blockDim.y * blockDim.z; }
  static unsigned size() { return num_threads(); }
  static dim3 group_index() { return dim3(blockIdx.x, blockIdx.y, blockIdx.z); }
  static dim3 thread_index() { return dim3(threadIdx.x, threadIdx.y, threadIdx.z); }
  static dim3 group_dim() { return blockDim; }
  static dim3 dim_threads() { return blockDim; }
};

inline thread_block this_thread_block() { return thread_block(); }

// A tile of Size threads: consecutive thread ranks of the parent, Size-aligned, so within one warp.
// Its collectives are the warp intrinsics with the tile's lanes as the mask and Size as the width,
// as in NVIDIA's header.
template <unsigned Size, class ParentT = void>
class thread_block_tile {
  static_assert(Size == 1 || Size == 2 || Size == 4 || Size == 8 || Size == 16 || Size == 32,
                "the sim's cooperative groups support tiles of 1/2/4/8/16/32 threads");
  template <unsigned, class> friend class thread_block_tile;
  template <unsigned N, class P> friend thread_block_tile<N, P> tiled_partition(const P&);
  unsigned meta_rank_, meta_size_;
  thread_block_tile(unsigned rank, unsigned count) : meta_rank_(rank), meta_size_(count) {}

  static unsigned lane() { return unsigned(::cupaged_sim::g.cur->lane); }
  static unsigned mask() { return Size == 32 ? 0xFFFFFFFFu : ((1u << Size) - 1u) << (lane() & ~(Size - 1)); }
  // Shuffles move 8 bytes per collective; a larger (trivially copyable) value goes in slices.
  template <class T>
  static T shuffle(int kind, T v, int arg, int line) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 32, "shuffled types: trivially copyable, <= 32 bytes");
    unsigned long long s[(sizeof(T) + 7) / 8] = {};
    memcpy(s, &v, sizeof(T));
    for (auto& x : s) x = ::cupaged_sim::collective(kind, mask(), x, arg, int(Size), line);
    memcpy(&v, s, sizeof(T));
    return v;
  }
  static unsigned ballot_bits(int pred, int line) { return ::cupaged_sim::vote(::cupaged_sim::BALLOT, mask(), pred, line); }

 public:
  // Conversion to thread_block_tile<Size> (the parent forgotten; the meta group kept).
  template <class P>
  thread_block_tile(const thread_block_tile<Size, P>& t) : meta_rank_(t.meta_rank_), meta_size_(t.meta_size_) {}

  static void sync(int line = __builtin_LINE()) {
    ::cupaged_sim::collective(::cupaged_sim::SYNCWARP, mask(), 0, 0, 32, line);
  }
  static unsigned thread_rank() { return thread_block::thread_rank() & (Size - 1); }
  static constexpr unsigned num_threads() { return Size; }
  static constexpr unsigned size() { return Size; }
  unsigned meta_group_rank() const { return meta_rank_; }
  unsigned meta_group_size() const { return meta_size_; }

  template <class T> T shfl(T v, int src_rank, int line = __builtin_LINE()) const {
    return shuffle(::cupaged_sim::SHFL_IDX, v, src_rank, line);
  }
  template <class T> T shfl_up(T v, unsigned delta, int line = __builtin_LINE()) const {
    return shuffle(::cupaged_sim::SHFL_UP, v, int(delta), line);
  }
  template <class T> T shfl_down(T v, unsigned delta, int line = __builtin_LINE()) const {
    return shuffle(::cupaged_sim::SHFL_DOWN, v, int(delta), line);
  }
  template <class T> T shfl_xor(T v, unsigned lane_mask, int line = __builtin_LINE()) const {
    return shuffle(::cupaged_sim::SHFL_XOR, v, int(lane_mask), line);
  }
  // Votes over the tile's lanes; ballot's bit i is the tile's thread rank i.
  int any(int pred, int line = __builtin_LINE()) const { return ballot_bits(pred, line) != 0; }
  int all(int pred, int line = __builtin_LINE()) const { return ballot_bits(pred, line) == mask(); }
  unsigned ballot(int pred, int line = __builtin_LINE()) const {
    return ballot_bits(pred, line) >> (lane() & ~(Size - 1));
  }
};

// tiled_partition<Size>(parent): parent a thread_block or a larger tile; the meta group is the
// parent's tiles (rank = parent rank / Size, count = ceil(parent size / Size)).
template <unsigned Size, class ParentT>
thread_block_tile<Size, ParentT> tiled_partition(const ParentT& parent) {
  static_assert(std::is_same_v<ParentT, thread_block> || ParentT::size() > Size,
                "tiled_partition<Size>: the parent must be a thread_block or a larger tile");
  return thread_block_tile<Size, ParentT>(parent.thread_rank() / Size, (parent.size() + Size - 1) / Size);
}

template <class G> void sync(const G& g, int line = __builtin_LINE(), const char* file = __builtin_FILE()) {
  if constexpr (std::is_same_v<G, thread_block>) g.sync(line, file);
  else g.sync(line);
}
template <class G> auto thread_rank(const G& g) { return g.thread_rank(); }
template <class G> auto group_size(const G& g) { return g.num_threads(); }

// ---- <cooperative_groups/reduce.h>: cg::reduce over a tile and its operators
// NVIDIA's reduce.h does not compile as host code and the sim cannot ship its own yet (the sim's
// include directory holds files only), so they are here and NVIDIA's is kept out by its guard.
#define _COOPERATIVE_GROUPS_REDUCE_H
template <class T> struct plus { T operator()(T a, T b) const { return a + b; } };
template <class T> struct less { T operator()(T a, T b) const { return b < a ? b : a; } };
template <class T> struct greater { T operator()(T a, T b) const { return a < b ? b : a; } };
template <class T> struct bit_and { T operator()(T a, T b) const { return a & b; } };
template <class T> struct bit_or { T operator()(T a, T b) const { return a | b; } };
template <class T> struct bit_xor { T operator()(T a, T b) const { return a ^ b; } };

// NVIDIA's butterfly (details/coalesced_reduce.h), so floating-point sums round as on the GPU. For
// 32-bit integers with plus/less/greater/bit ops on sm_80 the GPU uses redux.sync instead: the
// same result, the operations being associative there.
template <unsigned Size, class P, class T, class Op>
auto reduce(const thread_block_tile<Size, P>& g, T&& val, Op&& op, int line = __builtin_LINE()) -> decltype(op(val, val)) {
  auto out = val;
  for (unsigned m = Size >> 1; m > 0; m >>= 1) out = op(out, g.shfl_xor(out, m, line));
  return out;
}
}  // namespace cooperative_groups
