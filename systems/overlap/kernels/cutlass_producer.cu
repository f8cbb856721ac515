// The producer as a CUTLASS 3.x Hopper grouped GEMM (sm_90a) whose epilogue releases the
// per-band readiness flags: the paper's own route (Flux and COMET built such epilogues).
//
// Operands (the remote-aligned layout of systems/overlap/plan.py, as for the Triton producer):
//   x       [P, K]     padded GEMM input X, row-major
//   weights [E, K, N]  this rank's expert weights, row-major
//   y       [P, N]     padded GEMM output Y, row-major
// Work, two groupings (CUTLASS's persistent group tile scheduler walks the groups in order):
//   per band   (grouping 0): group g is the band at schedule position s = order[g] (or g), the
//              (band_rows x N x K) GEMM of rows band_row.. of X with weights[band_expert]: the
//              bands finish in the producer's visiting order (the paper's remote-first order).
//   per expert (grouping 1): group g is one expert's whole row range (all its bands, padding
//              rows included), experts in the order of their first remote band (as
//              order="expert"): the structure of torch._grouped_mm, which lets a cluster of
//              two M tiles share each weight tile (TMA multicast of B).
// Kernel: KernelPtrArrayTmaWarpSpecializedCooperative, tile 128x256x64 (what torch._grouped_mm
// runs on sm90 for large problems), cluster CLUSTER_M x CLUSTER_N x 1, persistent grid of
// sm_count CTAs (SMs - cCTA). Band ids run in row order and, inside one expert's range, every
// band but the expert's last holds 128 rows (aligned and packed layouts: remote rows are padded
// to 128, the local rows come last; compact: no padding, only the expert's last band is
// short), so a tile's band is band0[group] + m (m: the tile's M index in its group) and
// its flag band_flag[band0[group] + m] (the band, or -1 where the band is not signalled).
//
// Readiness flag (the custom EVT node BandReady): the thread that issued a tile's TMA stores
// waits, after the tile's last store, until ALL its bulk stores have completed
// (cp.async.bulk.wait_group 0: the writes, not just the smem reads), fences the async proxy,
// then adds 1 with release semantics at gpu scope to ready[band] of a signalled band
// (schedule position < n_signal). A band is complete in run r when ready[band] reaches
// r * ceil(N / 256) (epoch values, never reset between runs, as for the Triton producer).
//
// Host ABI (C, for ctypes; systems/overlap/cutlass_producer.py): moe_cutlass_args_bytes,
// moe_cutlass_workspace_bytes, moe_cutlass_run. Plan arrays are int64. Return 0 on success, a
// negative code otherwise (moe_cutlass_error names it).
#include <cstdint>
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace moe_cutlass {
using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

// EVT node: passes its child's value (the accumulator) through; releases the band's flag.
struct BandReady {
  struct SharedStorage {};
  struct Arguments {
    int32_t* ready = nullptr;               // [B] per-band counters
    int32_t const* band0 = nullptr;      // [G] first band of group g
    int32_t const* band_flag = nullptr;  // [B] the band to signal, or -1 (not signalled)
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) {
    return a;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE BandReady() {}
  CUTLASS_HOST_DEVICE BandReady(Params const& params, SharedStorage const&) : params_ptr(&params) {}
  Params const* params_ptr = nullptr;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(fusion::detail::ProducerLoadArgs<Args...> const&) {
    return fusion::detail::EmptyProducerLoadCallbacks{};
  }

  struct ConsumerStoreCallbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    int32_t* flag;        // ready + band, or nullptr (a local band: no flag)
    bool issuer = false;  // this thread issued (and committed) TMA stores of the tile

    CUTLASS_DEVICE explicit ConsumerStoreCallbacks(int32_t* f) : flag(f) {}

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementInput, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&, int, int, int,
        cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      return frg_input;
    }

    CUTLASS_DEVICE void tma_store(int, int, int, bool issue_tma_store) {
      issuer = issuer || issue_tma_store;
    }

    CUTLASS_DEVICE void end() {
      if (issuer && flag != nullptr) {
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        asm volatile("fence.proxy.async.global;" ::: "memory");
        asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(flag) : "memory");
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    int const group = static_cast<int>(get<3>(args.tile_coord_mnkl));
    int const m = static_cast<int>(get<0>(args.tile_coord_mnkl));
    // a cluster of two M tiles may run past its group's rows: that tile stores nothing
    if (m * 128 >= static_cast<int>(get<0>(args.problem_shape_mnkl))) {
      return ConsumerStoreCallbacks(nullptr);
    }
    int32_t const band = params_ptr->band_flag[params_ptr->band0[group] + m];
    return ConsumerStoreCallbacks(band >= 0 ? params_ptr->ready + band : nullptr);
  }
};

template <class Element, int ClusterM, int ClusterN>
struct Producer {
  using Acc = float;
  using Layout = cutlass::layout::RowMajor;
  static constexpr int kAlign = 16 / sizeof(Element);
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<Int<ClusterM>, Int<ClusterN>, _1>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using Fusion = fusion::Sm90EVT<BandReady, fusion::Sm90AccFetch>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, Acc, Acc, void, Layout*, kAlign, Element,
      Layout*, kAlign, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      Fusion>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, Layout*, kAlign, Element,
      Layout*, kAlign, Acc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

// The per-group argument arrays, carved from one device buffer (16-byte aligned pieces).
template <class P>
struct ArgArrays {
  void const** a;
  void const** b;
  void** d;
  typename P::StrideA* sa;
  typename P::StrideB* sb;
  typename P::StrideD* sd;
  typename P::Shape3* shape;
  int32_t* band0;
  int32_t* band_flag;
  size_t bytes;

  static size_t round16(size_t n) { return (n + 15) / 16 * 16; }

  ArgArrays(void* base, int groups, int bands) {
    char* p = static_cast<char*>(base);
    size_t off = 0;
    auto take = [&](size_t n) {
      char* q = p ? p + off : nullptr;
      off += round16(n);
      return q;
    };
    a = reinterpret_cast<void const**>(take(groups * sizeof(void*)));
    b = reinterpret_cast<void const**>(take(groups * sizeof(void*)));
    d = reinterpret_cast<void**>(take(groups * sizeof(void*)));
    sa = reinterpret_cast<typename P::StrideA*>(take(groups * sizeof(typename P::StrideA)));
    sb = reinterpret_cast<typename P::StrideB*>(take(groups * sizeof(typename P::StrideB)));
    sd = reinterpret_cast<typename P::StrideD*>(take(groups * sizeof(typename P::StrideD)));
    shape = reinterpret_cast<typename P::Shape3*>(take(groups * sizeof(typename P::Shape3)));
    band0 = reinterpret_cast<int32_t*>(take(groups * sizeof(int32_t)));
    band_flag = reinterpret_cast<int32_t*>(take(bands * sizeof(int32_t)));
    bytes = off;
  }
};

struct PlanArrays {
  int64_t const* schedule;     // [B] band at each schedule position
  int64_t const* order;        // [B] visiting order of the schedule positions, or nullptr
  int64_t const* band_expert;  // [B]
  int64_t const* band_row;     // [B] first padded row (a multiple of 128)
  int64_t const* band_rows;    // [B] valid rows
  int64_t const* n_bands_dev;  // [1] bands in use (a DevicePlan), or nullptr: all B
  int64_t n_signal_host;       // schedule positions < n_signal are signalled ...
  int64_t const* n_signal_dev;  // ... or read from the device
};

constexpr int kMaxExperts = 1024;
constexpr int kPrepThreads = 1024;

// ONE block: the band flags, then the groups (per band or per expert). bands = B (schedule
// length; a DevicePlan's bound), groups = B (per band) or E (per expert).
template <class P, class Element>
__global__ void __launch_bounds__(kPrepThreads)
prepare_groups(ArgArrays<P> args, int groups, int grouping, int bands, Element const* x,
               Element const* w, Element* y, int n, int k, PlanArrays plan,
               typename P::StrideA sa, typename P::StrideB sb, typename P::StrideD sd) {
  __shared__ int64_t lo[kMaxExperts], hi[kMaxExperts], first[kMaxExperts], b0[kMaxExperts];
  int const tid = threadIdx.x;
  int64_t const n_bands = plan.n_bands_dev ? *plan.n_bands_dev : bands;
  int64_t const n_signal = plan.n_signal_dev ? *plan.n_signal_dev : plan.n_signal_host;
  int64_t const far = INT64_MAX / 4;
  for (int t = tid; t < bands; t += blockDim.x) args.band_flag[t] = -1;
  if (grouping == 1) {
    for (int e = tid; e < groups; e += blockDim.x) {
      lo[e] = far;
      hi[e] = 0;
      first[e] = far;
      b0[e] = far;
    }
  }
  __syncthreads();
  for (int64_t s = tid; s < n_bands; s += blockDim.x) {
    int64_t const band = plan.schedule[s];
    int64_t const row = plan.band_row[band];
    if (s < n_signal) args.band_flag[band] = static_cast<int32_t>(band);
    if (grouping == 1) {
      int64_t const e = plan.band_expert[band];
      atomicMin(reinterpret_cast<unsigned long long*>(&lo[e]), row);
      atomicMin(reinterpret_cast<unsigned long long*>(&b0[e]), band);
      atomicMax(reinterpret_cast<unsigned long long*>(&hi[e]), row + plan.band_rows[band]);
      // experts with remote bands first, by their first remote band; then by first local band
      atomicMin(reinterpret_cast<unsigned long long*>(&first[e]), s < n_signal ? s : n_bands + s);
    }
  }
  __syncthreads();
  for (int idx = tid; idx < groups; idx += blockDim.x) {
    int64_t row0 = 0, rows = 0, expert = 0, first_band = 0;
    int g = idx;
    if (grouping == 0) {
      if (g < n_bands) {
        int64_t const band = plan.schedule[plan.order ? plan.order[g] : g];
        expert = plan.band_expert[band];
        row0 = plan.band_row[band];
        rows = plan.band_rows[band];
        first_band = band;
      }
    } else {
      // expert idx goes to group g = its rank in the order of `first` (ties by expert index)
      expert = idx;
      g = 0;
      for (int f = 0; f < groups; ++f)
        g += first[f] < first[idx] || (first[f] == first[idx] && f < idx);
      if (lo[idx] < far) {
        row0 = lo[idx];
        rows = hi[idx] - lo[idx];
        first_band = b0[idx];
      }
    }
    args.a[g] = x + row0 * k;
    args.b[g] = w + expert * k * n;
    args.d[g] = y + row0 * n;
    args.sa[g] = sa;
    args.sb[g] = sb;
    args.sd[g] = sd;
    args.shape[g] = typename P::Shape3(static_cast<int>(rows), n, k);
    args.band0[g] = static_cast<int32_t>(first_band);
  }
}

template <class P>
typename P::Gemm::Arguments make_arguments(ArgArrays<P> const& args, int groups, int32_t* ready,
                                           int sm_count, int device) {
  typename P::Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, args.shape, nullptr},
      {reinterpret_cast<typename P::Kernel::ElementA const**>(args.a), args.sa,
       reinterpret_cast<typename P::Kernel::ElementB const**>(args.b), args.sb},
      {{}, nullptr, args.sd, reinterpret_cast<typename P::Kernel::ElementD**>(args.d), args.sd}};
  auto& band_ready = arguments.epilogue.thread.op_1;
  band_ready.ready = ready;
  band_ready.band0 = args.band0;
  band_ready.band_flag = args.band_flag;
  arguments.hw_info.device_id = device;
  arguments.hw_info.sm_count = sm_count;
  return arguments;
}

template <class Element, int ClusterM, int ClusterN>
int workspace_bytes(int groups, int sm_count, size_t* out) {
  using P = Producer<Element, ClusterM, ClusterN>;
  ArgArrays<P> args(nullptr, groups, 1);
  int device = 0;
  cudaGetDevice(&device);
  auto arguments = make_arguments<P>(args, groups, nullptr, sm_count, device);
  *out = P::Gemm::get_workspace_size(arguments);
  return 0;
}

template <class Element, int ClusterM, int ClusterN>
int run(void const* x, void const* w, void* y, int bands, int n, int k, int groups,
        int grouping, PlanArrays const& plan, int32_t* ready, void* args_buf, void* workspace,
        int sm_count, cudaStream_t stream) {
  using P = Producer<Element, ClusterM, ClusterN>;
  if (grouping == 1 && groups > kMaxExperts) return -6;
  ArgArrays<P> args(args_buf, groups, bands);
  auto sa = cutlass::make_cute_packed_stride(typename P::StrideA{}, make_shape(1, k, 1));
  auto sb = cutlass::make_cute_packed_stride(typename P::StrideB{}, make_shape(n, k, 1));
  auto sd = cutlass::make_cute_packed_stride(typename P::StrideD{}, make_shape(1, n, 1));
  prepare_groups<P, Element><<<1, kPrepThreads, 0, stream>>>(
      args, groups, grouping, bands, static_cast<Element const*>(x),
      static_cast<Element const*>(w), static_cast<Element*>(y), n, k, plan, sa, sb, sd);
  if (cudaPeekAtLastError() != cudaSuccess) return -5;
  int device = 0;
  cudaGetDevice(&device);
  auto arguments = make_arguments<P>(args, groups, ready, sm_count, device);
  typename P::Gemm gemm;
  if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) return -2;
  if (gemm.initialize(arguments, workspace, stream) != cutlass::Status::kSuccess) return -3;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return -4;
  return 0;
}

}  // namespace moe_cutlass

// dtype: 0 = bfloat16, 1 = float16; cluster: 11 (1x1), 12 (1x2: pairs of N tiles share A),
// 21 (2x1: pairs of M tiles share B, for the per-expert grouping).
#define MOE_DISPATCH(dtype, cluster, CALL)                                       \
  if (dtype == 0 && cluster == 11) return CALL(cutlass::bfloat16_t, 1, 1);     \
  if (dtype == 0 && cluster == 12) return CALL(cutlass::bfloat16_t, 1, 2);     \
  if (dtype == 0 && cluster == 21) return CALL(cutlass::bfloat16_t, 2, 1);     \
  if (dtype == 1 && cluster == 11) return CALL(cutlass::half_t, 1, 1);         \
  if (dtype == 1 && cluster == 12) return CALL(cutlass::half_t, 1, 2);         \
  if (dtype == 1 && cluster == 21) return CALL(cutlass::half_t, 2, 1);         \
  return -1;

extern "C" {

size_t moe_cutlass_args_bytes(int groups, int bands) {
  using P = moe_cutlass::Producer<cutlass::bfloat16_t, 1, 1>;  // same layout for every instance
  return moe_cutlass::ArgArrays<P>(nullptr, groups, bands).bytes;
}

int moe_cutlass_workspace_bytes(int dtype, int cluster, int groups, int sm_count, size_t* out) {
#define MOE_WS(E, CM, CN) moe_cutlass::workspace_bytes<E, CM, CN>(groups, sm_count, out)
  MOE_DISPATCH(dtype, cluster, MOE_WS)
#undef MOE_WS
}

int moe_cutlass_run(int dtype, int cluster, void const* x, void const* w, void* y, int bands,
                    int n, int k, int groups, int grouping, int64_t const* schedule,
                    int64_t const* order, int64_t const* band_expert, int64_t const* band_row,
                    int64_t const* band_rows, int64_t const* n_bands_dev, int64_t n_signal_host,
                    int64_t const* n_signal_dev, int32_t* ready, void* args_buf, void* workspace,
                    int sm_count, void* stream) {
  moe_cutlass::PlanArrays plan{schedule, order,         band_expert,  band_row,
                               band_rows, n_bands_dev, n_signal_host, n_signal_dev};
#define MOE_RUN(E, CM, CN)                                                                    \
  moe_cutlass::run<E, CM, CN>(x, w, y, bands, n, k, groups, grouping, plan, ready,      \
                              args_buf, workspace, sm_count, static_cast<cudaStream_t>(stream))
  MOE_DISPATCH(dtype, cluster, MOE_RUN)
#undef MOE_RUN
}

char const* moe_cutlass_error(int code) {
  switch (code) {
    case 0: return "ok";
    case -1: return "unsupported dtype or cluster (bfloat16/float16; cluster 11, 12 or 21)";
    case -2: return "CUTLASS cannot implement this problem (alignment: K and N % 8)";
    case -3: return "CUTLASS initialize failed";
    case -4: return "CUTLASS launch failed";
    case -5: return "the group-preparation kernel failed to launch";
    case -6: return "more than 1024 experts per rank";
    default: return "unknown error";
  }
}

}  // extern "C"
