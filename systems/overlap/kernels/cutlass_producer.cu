// The producer as a CUTLASS 3.x Hopper grouped GEMM (sm_90a) whose epilogue releases the
// per-band readiness flags: the paper's own route (Flux and COMET built such epilogues).
//
// Operands (the remote-aligned layout of systems/overlap/plan.py, as for the Triton producer):
//   x       [P, K]     padded GEMM input X, row-major
//   weights [E, K, N]  this rank's expert weights, row-major
//   y       [P, N]     padded GEMM output Y, row-major
// Work: ONE GROUP PER BAND, in the producer's visiting order: group g is the band at schedule
// position s = order[g] (or g), i.e. the (band_rows[band] x N x K) GEMM of rows band_row[band]..
// of X with weights[band_expert[band]]. CUTLASS's persistent group tile scheduler walks the
// groups in order (tiles of one group along N), so the bands finish in the visiting order.
// Kernel: KernelPtrArrayTmaWarpSpecializedCooperative, tile 128x256x64 (what torch._grouped_mm
// runs on sm90 for large problems), cluster 1 x CLUSTER_N x 1 (a band holds a single M tile, so
// a cluster pairs N tiles that share the A tile), persistent grid of sm_count CTAs (SMs - cCTA).
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
    int32_t* ready = nullptr;             // [B] per-band counters
    int32_t const* group_flag = nullptr;  // [G] band to signal for group g, or -1
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
    int32_t const band = params_ptr->group_flag[group];
    return ConsumerStoreCallbacks(band >= 0 ? params_ptr->ready + band : nullptr);
  }
};

template <class Element, int ClusterN>
struct Producer {
  using Acc = float;
  using Layout = cutlass::layout::RowMajor;
  static constexpr int kAlign = 16 / sizeof(Element);
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_1, Int<ClusterN>, _1>;
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
  int32_t* flag;
  size_t bytes;

  static size_t round16(size_t n) { return (n + 15) / 16 * 16; }

  ArgArrays(void* base, int groups) {
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
    flag = reinterpret_cast<int32_t*>(take(groups * sizeof(int32_t)));
    bytes = off;
  }
};

// One thread per group: the group's pointers, shape, strides and flag from the plan arrays.
template <class P, class Element>
__global__ void prepare_groups(ArgArrays<P> args, int groups, Element const* x, Element const* w,
                               Element* y, int n, int k, int64_t const* schedule,
                               int64_t const* order, int64_t const* band_expert,
                               int64_t const* band_row, int64_t const* band_rows,
                               int64_t const* n_bands_dev, int64_t n_signal_host,
                               int64_t const* n_signal_dev, typename P::StrideA sa,
                               typename P::StrideB sb, typename P::StrideD sd) {
  int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  int64_t const n_bands = n_bands_dev ? *n_bands_dev : groups;
  int64_t const n_signal = n_signal_dev ? *n_signal_dev : n_signal_host;
  int rows = 0;
  int64_t row0 = 0, expert = 0, band = -1, s = g;
  if (g < n_bands) {
    s = order ? order[g] : g;
    band = schedule[s];
    expert = band_expert[band];
    row0 = band_row[band];
    rows = static_cast<int>(band_rows[band]);
  }
  args.a[g] = x + row0 * k;
  args.b[g] = w + expert * k * n;
  args.d[g] = y + row0 * n;
  args.sa[g] = sa;
  args.sb[g] = sb;
  args.sd[g] = sd;
  args.shape[g] = typename P::Shape3(rows, n, k);
  args.flag[g] = (band >= 0 && s < n_signal) ? static_cast<int32_t>(band) : -1;
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
  band_ready.group_flag = args.flag;
  arguments.hw_info.device_id = device;
  arguments.hw_info.sm_count = sm_count;
  return arguments;
}

template <class Element, int ClusterN>
int workspace_bytes(int groups, int sm_count, size_t* out) {
  using P = Producer<Element, ClusterN>;
  ArgArrays<P> args(nullptr, groups);
  int device = 0;
  cudaGetDevice(&device);
  auto arguments = make_arguments<P>(args, groups, nullptr, sm_count, device);
  *out = P::Gemm::get_workspace_size(arguments);
  return 0;
}

template <class Element, int ClusterN>
int run(void const* x, void const* w, void* y, int n, int k, int groups,
        int64_t const* schedule, int64_t const* order, int64_t const* band_expert,
        int64_t const* band_row, int64_t const* band_rows, int64_t const* n_bands_dev,
        int64_t n_signal_host, int64_t const* n_signal_dev, int32_t* ready, void* args_buf,
        void* workspace, int sm_count, cudaStream_t stream) {
  using P = Producer<Element, ClusterN>;
  ArgArrays<P> args(args_buf, groups);
  auto sa = cutlass::make_cute_packed_stride(typename P::StrideA{}, make_shape(1, k, 1));
  auto sb = cutlass::make_cute_packed_stride(typename P::StrideB{}, make_shape(n, k, 1));
  auto sd = cutlass::make_cute_packed_stride(typename P::StrideD{}, make_shape(1, n, 1));
  int threads = 128;
  prepare_groups<P, Element><<<(groups + threads - 1) / threads, threads, 0, stream>>>(
      args, groups, static_cast<Element const*>(x), static_cast<Element const*>(w),
      static_cast<Element*>(y), n, k, schedule, order, band_expert, band_row, band_rows,
      n_bands_dev, n_signal_host, n_signal_dev, sa, sb, sd);
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

// dtype: 0 = bfloat16, 1 = float16; cluster_n: 1 or 2.
#define MOE_DISPATCH(dtype, cluster_n, CALL)                                          \
  if (dtype == 0 && cluster_n == 1) return CALL(cutlass::bfloat16_t, 1);            \
  if (dtype == 0 && cluster_n == 2) return CALL(cutlass::bfloat16_t, 2);            \
  if (dtype == 1 && cluster_n == 1) return CALL(cutlass::half_t, 1);                \
  if (dtype == 1 && cluster_n == 2) return CALL(cutlass::half_t, 2);                \
  return -1;

extern "C" {

size_t moe_cutlass_args_bytes(int dtype, int cluster_n, int groups) {
  (void)dtype;
  (void)cluster_n;
  using P = moe_cutlass::Producer<cutlass::bfloat16_t, 1>;  // same layout for every instance
  return moe_cutlass::ArgArrays<P>(nullptr, groups).bytes;
}

int moe_cutlass_workspace_bytes(int dtype, int cluster_n, int groups, int sm_count,
                                size_t* out) {
#define MOE_WS(E, C) moe_cutlass::workspace_bytes<E, C>(groups, sm_count, out)
  MOE_DISPATCH(dtype, cluster_n, MOE_WS)
#undef MOE_WS
}

int moe_cutlass_run(int dtype, int cluster_n, void const* x, void const* w, void* y, int n, int k,
                    int groups, int64_t const* schedule, int64_t const* order,
                    int64_t const* band_expert, int64_t const* band_row,
                    int64_t const* band_rows, int64_t const* n_bands_dev, int64_t n_signal_host,
                    int64_t const* n_signal_dev, int32_t* ready, void* args_buf, void* workspace,
                    int sm_count, void* stream) {
#define MOE_RUN(E, C)                                                                         \
  moe_cutlass::run<E, C>(x, w, y, n, k, groups, schedule, order, band_expert, band_row,       \
                         band_rows, n_bands_dev, n_signal_host, n_signal_dev, ready, args_buf, \
                         workspace, sm_count, static_cast<cudaStream_t>(stream))
  MOE_DISPATCH(dtype, cluster_n, MOE_RUN)
#undef MOE_RUN
}

char const* moe_cutlass_error(int code) {
  switch (code) {
    case 0: return "ok";
    case -1: return "unsupported dtype or cluster (bfloat16/float16, cluster_n 1 or 2)";
    case -2: return "CUTLASS cannot implement this problem (alignment: K and N % 8)";
    case -3: return "CUTLASS initialize failed";
    case -4: return "CUTLASS launch failed";
    case -5: return "the group-preparation kernel failed to launch";
    default: return "unknown error";
  }
}

}  // extern "C"
