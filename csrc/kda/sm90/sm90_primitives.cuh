// Small Hopper building blocks used by every role of the KDA kernel: shared-memory addressing in
// the 128-byte-swizzled layout that TMA writes and WGMMA reads, WGMMA descriptors, ldmatrix,
// bf16 packing, fast exp2, and named barriers. The PTX wrappers for TMA, mbarriers, WGMMA and
// setmaxnreg themselves come from CUTLASS/CuTe (cute/arch, cutlass/arch).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

namespace cula::kda::sm90 {

// ------------------------------------------------------------------------------------------
// The 128B-swizzled tile layout.
//
// Every bf16 tile in shared memory is a stack of "boxes" of R rows x 64 columns (128 bytes per
// row), each box 1024-byte aligned, with the 16-byte chunk index of a row XOR-ed with (row % 8).
// This is what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B for a 64-column box, and it is the
// canonical SW128 layout of WGMMA: read row-wise it is a K-major operand (8-row core groups
// 1024 bytes apart), read column-wise an MN-major operand (8-row K groups 1024 bytes apart,
// 64-wide MN atoms one box apart).
// ------------------------------------------------------------------------------------------

// Byte offset of element (row, col) of a bf16 tile whose boxes hold `rows_per_box` rows.
__device__ __forceinline__ uint32_t sw128_offset(int row, int col, int rows_per_box) {
  const int box = col >> 6;
  const int c = col & 63;
  return uint32_t(box * rows_per_box * 128 + row * 128 + ((((c >> 3) ^ row) & 7) << 4) + ((c & 7) << 1));
}

// Byte offset of the 16-byte chunk `chunk` (0..7) of `row` inside one box.
__device__ __forceinline__ uint32_t sw128_chunk_offset(int row, int chunk) {
  return uint32_t(row * 128 + (((chunk ^ row) & 7) << 4));
}

// Byte offset of the bf16 pair (row, 8*n8 + 2*t4 .. +1) inside one box, for a thread whose rows
// are all congruent to g4 modulo 8 (the rows of a WGMMA accumulator fragment): the swizzle term
// is then (n8 ^ g4) and the rest folds into immediates.
__device__ __forceinline__ uint32_t sw128_fragment_offset(int row, int n8, int g4, int t4) {
  return uint32_t(row * 128 + (((n8 ^ g4) & 7) << 4) + t4 * 4);
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ------------------------------------------------------------------------------------------
// WGMMA shared-memory descriptors for the SW128 layout (see cute::GMMA::GmmaDescriptor).
//   K-major:  8-row groups SBO = 1024 bytes apart; LBO unused.
//   MN-major: 8-row K groups SBO = 1024 bytes apart; 64-element MN atoms LBO bytes apart.
// ------------------------------------------------------------------------------------------
__device__ __forceinline__ uint64_t make_desc_sw128(uint32_t smem_addr, uint32_t lbo_bytes) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>((smem_addr & 0x3FFFF) >> 4);
  d.bitfield.leading_byte_offset_ = static_cast<uint16_t>(lbo_bytes >> 4);
  d.bitfield.stride_byte_offset_ = static_cast<uint16_t>(1024 >> 4);
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = static_cast<uint8_t>(cute::SM90::GMMA::LayoutType::B128);
  return d.desc_;
}
__device__ __forceinline__ uint64_t desc_k_major(uint32_t smem_addr) { return make_desc_sw128(smem_addr, 16); }
// The descriptor of the same layout `offset_bytes` (a multiple of 16) further into shared memory:
// one add to the start-address field (bits 0-13, 16-byte units) instead of a new descriptor's
// masks, shifts and moves (~5 instructions per WGMMA). Exact because a CTA's shared memory lies
// below 2^18 bytes, so the field never carries into the next one.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t offset_bytes) {
  return (desc & 0xFFFFFFFF00000000ull) | uint32_t(uint32_t(desc) + (offset_bytes >> 4));
}
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t smem_addr, uint32_t atom_stride_bytes) {
  return make_desc_sw128(smem_addr, atom_stride_bytes);
}

// ------------------------------------------------------------------------------------------
// WGMMA wrappers: expand an accumulator array into the CuTe atom's argument list.
// ------------------------------------------------------------------------------------------
namespace detail {
template <class Atom, int N, size_t... I>
__device__ __forceinline__ void gmma_ss(uint64_t da, uint64_t db, float (&d)[N], cute::SM90::GMMA::ScaleOut s,
                                        std::index_sequence<I...>) {
  Atom::fma(da, db, d[I]..., s);
}
template <class Atom, int N, size_t... I>
__device__ __forceinline__ void gmma_rs(const uint32_t (&a)[4], uint64_t db, float (&d)[N],
                                        cute::SM90::GMMA::ScaleOut s, std::index_sequence<I...>) {
  Atom::fma(a[0], a[1], a[2], a[3], db, d[I]..., s);
}
}  // namespace detail

using cute::SM90::GMMA::Major;
using cute::SM90::GMMA::ScaleOut;

// D[64 x N] (+)= A[64 x 16] * B[16 x N], both from shared memory.
template <int N, Major MajorA, Major MajorB>
__device__ __forceinline__ void wgmma_ss(uint64_t desc_a, uint64_t desc_b, float (&d)[N / 2], bool accumulate) {
  using namespace cute::SM90::GMMA;
  using Atom = std::conditional_t<N == 64, MMA_64x64x16_F32BF16BF16_SS<MajorA, MajorB>,
               std::conditional_t<N == 128, MMA_64x128x16_F32BF16BF16_SS<MajorA, MajorB>,
                                  MMA_64x16x16_F32BF16BF16_SS<MajorA, MajorB>>>;
  static_assert(N == 16 || N == 64 || N == 128, "unsupported WGMMA N");
  detail::gmma_ss<Atom>(desc_a, desc_b, d, accumulate ? ScaleOut::One : ScaleOut::Zero,
                        std::make_index_sequence<N / 2>{});
}

// D[64 x 64] (+)= A[64 x 16] * B[16 x 64], fp16 operands, both from shared memory.
template <Major MajorA, Major MajorB>
__device__ __forceinline__ void wgmma_ss_f16_n64(uint64_t desc_a, uint64_t desc_b, float (&d)[32], bool accumulate) {
  using Atom = cute::SM90::GMMA::MMA_64x64x16_F32F16F16_SS<MajorA, MajorB>;
  detail::gmma_ss<Atom>(desc_a, desc_b, d, accumulate ? ScaleOut::One : ScaleOut::Zero, std::make_index_sequence<32>{});
}

// D[64 x N] (+)= A[64 x 16] (registers, bf16 K-major fragment) * B[16 x N] (shared memory).
template <int N, Major MajorB>
__device__ __forceinline__ void wgmma_rs(const uint32_t (&a)[4], uint64_t desc_b, float (&d)[N / 2], bool accumulate) {
  using namespace cute::SM90::GMMA;
  using Atom = std::conditional_t<N == 16, MMA_64x16x16_F32BF16BF16_RS<Major::K, MajorB>,
               std::conditional_t<N == 64, MMA_64x64x16_F32BF16BF16_RS<Major::K, MajorB>,
                                  MMA_64x128x16_F32BF16BF16_RS<Major::K, MajorB>>>;
  static_assert(N == 16 || N == 64 || N == 128, "unsupported WGMMA N");
  detail::gmma_rs<Atom>(a, desc_b, d, accumulate ? ScaleOut::One : ScaleOut::Zero, std::make_index_sequence<N / 2>{});
}
// D[64 x N] (+)= A[64 x 16] (registers, fp16 K-major fragment) * B[16 x N] (shared memory, fp16).
template <int N, Major MajorB>
__device__ __forceinline__ void wgmma_rs_f16(const uint32_t (&a)[4], uint64_t desc_b, float (&d)[N / 2], bool accumulate) {
  using namespace cute::SM90::GMMA;
  using Atom = std::conditional_t<N == 16, MMA_64x16x16_F32F16F16_RS<Major::K, MajorB>,
               std::conditional_t<N == 64, MMA_64x64x16_F32F16F16_RS<Major::K, MajorB>,
                                  MMA_64x128x16_F32F16F16_RS<Major::K, MajorB>>>;
  static_assert(N == 16 || N == 64 || N == 128, "unsupported WGMMA N");
  detail::gmma_rs<Atom>(a, desc_b, d, accumulate ? ScaleOut::One : ScaleOut::Zero, std::make_index_sequence<N / 2>{});
}
__device__ __forceinline__ void wgmma_rs_n16(const uint32_t (&a)[4], uint64_t desc_b, float (&d)[8], bool accumulate) {
  wgmma_rs<16, Major::K>(a, desc_b, d, accumulate);
}

// D[64 x 64] += (+/-) A[64 x 8] (registers, tf32 fragment) * B[8 x 64] (shared memory, K-major tf32).
using cute::SM90::GMMA::ScaleIn;
template <ScaleIn kScaleA>
__device__ __forceinline__ void wgmma_rs_tf32_n64(const uint32_t (&a)[4], uint64_t desc_b, float (&d)[32]) {
  detail::gmma_rs<cute::SM90::GMMA::MMA_64x64x8_F32TF32TF32_RS_TN<kScaleA, ScaleIn::One>>(
      a, desc_b, d, ScaleOut::One, std::make_index_sequence<32>{});
}

__device__ __forceinline__ void wgmma_fence() { cute::warpgroup_arrive(); }
__device__ __forceinline__ void wgmma_commit() { cute::warpgroup_commit_batch(); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { cute::warpgroup_wait<N>(); }

template <int N>
__device__ __forceinline__ void fence_accumulators(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(d[i]);
}
__device__ __forceinline__ void fence_fragment(uint32_t (&a)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) cute::warpgroup_fence_operand(a[i]);
}

// ------------------------------------------------------------------------------------------
// Loads, conversions, math.
// ------------------------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Warp-level tensor-core product D += A B (m16n8k16, bf16 operands, fp32 accumulators). A: the
// ldmatrix_x4 fragment of a 16x16 row-major tile; B: two registers of an ldmatrix fragment of an
// [n = 8][k = 16] tile (k contiguous). Lane (g4, t4) holds D rows g4 (d[0], d[1]) and g4 + 8
// (d[2], d[3]), columns 2 t4 and 2 t4 + 1.
__device__ __forceinline__ void mma_m16n8k16_bf16(const uint32_t (&a)[4], uint32_t b0, uint32_t b1, float (&d)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same four 8x8 matrices, transposed: lane (g4, t4) gets elements (2 t4, g4) and (2 t4 + 1, g4)
// of each matrix as stored, i.e. the accumulator-layout pair (g4, 2 t4 .. +1) of its transpose.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// Stores four 8x8 matrices given in accumulator layout (lane (g4, t4) holds row g4, columns
// 2 t4 .. +1 of each), as they are: row j of matrix m lands at the address lane 8 m + j gives.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
// Stores four 8x8 matrices given in accumulator layout (lane (g4, t4) holds row g4, columns
// 2 t4 .. +1 of each), transposed: row j of what lands in memory is column j of the matrix. Lanes
// 8 m .. 8 m + 7 give the addresses of the rows of matrix m.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

__device__ __forceinline__ float2 bf16x2_to_float2(uint32_t v) {
  __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&v);
  return __bfloat1622float2(h);
}
__device__ __forceinline__ uint32_t float2_to_bf16x2(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ float2 half2_to_float2(uint32_t v) {
  __half2 h = *reinterpret_cast<__half2*>(&v);
  return __half22float2(h);
}
__device__ __forceinline__ uint32_t float2_to_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// max(a, b) that returns NaN if either is NaN (one FMNMX.NAN; fmaxf would drop the NaN).
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Packed bf16x2 product, rounded to nearest (one HMUL2.BF16 instruction).
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 x = *reinterpret_cast<__nv_bfloat162*>(&a), y = *reinterpret_cast<__nv_bfloat162*>(&b);
  __nv_bfloat162 z = __hmul2(x, y);
  return *reinterpret_cast<uint32_t*>(&z);
}

// Packed fp16x2 product, rounded to nearest (one HMUL2 instruction).
__device__ __forceinline__ uint32_t half2_mul(uint32_t a, uint32_t b) {
  __half2 x = *reinterpret_cast<__half2*>(&a), y = *reinterpret_cast<__half2*>(&b);
  __half2 z = __hmul2(x, y);
  return *reinterpret_cast<uint32_t*>(&z);
}

// fp32 -> tf32 (round to nearest, ties away), as the 32-bit pattern a tf32 WGMMA operand takes.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t y;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ------------------------------------------------------------------------------------------
// Named barriers (ids 0 is __syncthreads; we start at 1).
// ------------------------------------------------------------------------------------------
// kHelperIntra1: the second intra-chunk warpgroup of a cooperative helper (chunk_workspace.cuh).
enum class NamedBarrierId : uint32_t { kIntra = 1, kState0 = 2, kState1 = 3, kScheduleSort = 4, kHelperIntra1 = 5,
                                    kStatePrep = 6 };  // both state warpgroups, prep ahead (chunk_prep.cuh)

__device__ __forceinline__ void named_barrier_sync(NamedBarrierId id, uint32_t num_threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(static_cast<uint32_t>(id)), "r"(num_threads) : "memory");
}

// named_barrier_sync that also tells every participating thread whether `pred` held in any of
// them (bar.red.or: the same wait and memory ordering as bar.sync, plus a one-bit reduction).
__device__ __forceinline__ bool named_barrier_sync_any(NamedBarrierId id, uint32_t num_threads, bool pred) {
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(pred)), "r"(static_cast<uint32_t>(id)), "r"(num_threads)
      : "memory");
  return any != 0;
}

// fp16 copies of v_new (state_math.cuh, owner_state_math.cuh: A_qk v_new in fp16 where l2norm
// bounds A_qk). fp16 has 3 more mantissa bits than bf16 but overflows at 65504 and goes subnormal
// below 2^-14, and nothing bounds v_new, so each thread checks its own max |v_new| (zero rows past
// a sequence's end do not count) against [2^-10, 2^15), and only when some thread is outside it
// (rare) do its neighbours take the exact max and a power-of-two shift: the fused state
// warpgroups decide per warpgroup, the owners per warp (a warp's rows of v_new^T feed only its
// own rows of the products there).
__device__ __forceinline__ bool fp16_out_of_range(float m) { return m >= 32768.f || (m > 0.f && m < 0x1p-10f); }

// The shift for a max |v_new| of mx once fp16_out_of_range held for some thread that mx covers:
// the copies are to be scaled by 2^-shift (0: none). mx in [2^e, 2^(e+1)): at or above 2^15 scale
// down by 2^(e - 14), so that the max lands in [2^14, 2^15) (e is at most 128, inf: at most
// 2^114); below 2^-10, where v_new would reach fp16's subnormals and lose digits, scale up by 2^24
// (e - 14 <= -25 there, so the cap always applies: the operands scaled alike stay far from bf16's
// range).
__device__ __forceinline__ int fp16_shift_for_max(float mx) {
  const int e = int((__float_as_uint(mx) >> 23) & 0xffu) - 127;
  return (e > 14 || e < -10) ? max(e - 14, -24) : 0;
}

// Make generic-proxy shared-memory writes visible to the async proxy (WGMMA, TMA).
__device__ __forceinline__ void fence_smem_to_async_proxy() { cutlass::arch::fence_view_async_shared(); }

// ------------------------------------------------------------------------------------------
// Clusters of two CTAs (the pair form: pair_intra_math.cuh). A CTA reaches its peer's shared
// memory through shared::cluster addresses (mapa of its own address for the same variable).
// ------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// The shared::cluster address of the variable at `local` (this CTA's shared::cta address) in the
// shared memory of the cluster's CTA `rank` (the same layout in every CTA of the kernel).
__device__ __forceinline__ uint32_t cluster_smem_addr(uint32_t local, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(local), "r"(rank));
  return r;
}
// One arrival on the mbarrier at shared::cluster address `bar` (this CTA's or the peer's), release
// at cluster scope: this thread's earlier accesses happen before the phase it completes.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Bulk copy of `bytes` (a multiple of 16) of this CTA's shared memory at `src` into the peer's at
// `dst` (shared::cluster), completing as transaction bytes on the peer's mbarrier `bar`
// (shared::cluster): the peer's wait on that barrier sees the data.
__device__ __forceinline__ void bulk_copy_to_peer(uint32_t dst, uint32_t src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "r"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// Every thread of both CTAs (warp-converged: the .aligned forms).
__device__ __forceinline__ void cluster_barrier_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// ------------------------------------------------------------------------------------------
// Optional per-phase cycle counters (build with -DCULA_KDA_PROFILE): thread 0 of a role sums the
// clock64() deltas between marks and CTA 0 prints them at the end. No-ops otherwise.
// ------------------------------------------------------------------------------------------
struct PhaseTimer {
#ifdef CULA_KDA_PROFILE
  long long t0 = 0;
  long long acc[10] = {};
  int chunks = 0;  // calls of mark(0): one per chunk in every role
  __device__ void start() { t0 = clock64(); }
  __device__ void mark(int i) {
    const long long t = clock64();
    acc[i] += t - t0;
    t0 = t;
    chunks += i == 0;
  }
  __device__ void report(const char* role, int tid) const {
    // CTAs 0 and 1 (the pair form: both ranks of the first cluster)
    if (blockIdx.x < 2 && tid == 0)
      printf("[%s] cta %d chunks %d: %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld\n", role, int(blockIdx.x), chunks,
             acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7], acc[8], acc[9]);
  }
#else
  __device__ void start() {}
  __device__ void mark(int) {}
  __device__ void report(const char*, int) const {}
#endif
};

}  // namespace cula::kda::sm90
