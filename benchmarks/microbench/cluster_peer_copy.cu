// Two facts the 2-CTA cluster form needs before any kernel code (docs/perf-notes.md, "Where it
// stands (1cf332c)", its last subsection), on the GPU this runs on:
//
//   1. how many clusters of 1, 2 and 4 CTAs of the fused kernel's shape (512 threads, one CTA per
//      SM for its shared memory: kSharedBytes from csrc/kda/sm90/shared_storage.cuh) are resident
//      at once (cudaOccupancyMaxActiveClusters), and whether a launch of that many clusters of two
//      actually runs them all at once (every CTA waits at a grid-wide counter, with a timeout);
//   2. the latency of an 8 KB shared-to-peer-shared bulk copy (cp.async.bulk.shared::cluster,
//      completing on the receiver's mbarrier), the size of the per-chunk hand-off (A_qk or M - I
//      in bf16), by ping-pong between the two CTAs of a cluster. The one-way figure is half a
//      round trip: the copy plus the receiver noticing it (its mbarrier wait) and issuing the
//      reply, which is what a hand-off on a chain costs. Cycles are SM clocks (clock64); the us
//      figure divides by the maximum clock (cudaDevAttrClockRate), exact only at that clock.
//      Co-residency: all clusters ran at once only if no CTA timed out.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -I csrc/kda/sm90 \
//        -o cluster_peer_copy benchmarks/microbench/cluster_peer_copy.cu && ./cluster_peer_copy
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "shared_storage.cuh"  // kSharedBytes: the fused kernel's dynamic shared memory

#include "cuda_check.h"  // CHECK

constexpr int kThreads = 512;
constexpr int kCopyBytes = 8192;  // one 64 x 64 bf16 tile

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint32_t peer_addr(uint32_t local, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(local), "r"(rank));
  return r;
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.aligned;\nbarrier.cluster.wait.aligned;" ::: "memory");
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Copies `bytes` of this CTA's shared memory at `src` to the peer's `dst_peer`, completing on the
// peer's mbarrier `bar_peer` (both shared::cluster addresses from mapa).
__device__ __forceinline__ void copy_to_peer(uint32_t dst_peer, uint32_t src, uint32_t bytes, uint32_t bar_peer) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst_peer),
      "r"(src), "r"(bytes), "r"(bar_peer)
      : "memory");
}

// Every CTA counts itself in and waits (up to ~20 ms) until all of the grid has: true residency of
// the whole grid at once. out[0]: CTAs that saw everyone; out[1]: CTAs that timed out.
__global__ void __launch_bounds__(kThreads, 1) all_resident(int* counter, int* out) {
  extern __shared__ uint8_t smem[];
  if (threadIdx.x == 0) {
    smem[0] = 1;
    atomicAdd(counter, 1);
    uint64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    bool ok = false;
    do {
      ok = atomicAdd(counter, 0) >= int(gridDim.x);
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (!ok && t - t0 < 20000000ull);
    atomicAdd(ok ? &out[0] : &out[1], 1);
  }
}

// Ping-pong of kCopyBytes between the two CTAs of a cluster, `iters` round trips; rank 0's thread 0
// writes the cycles per round trip.
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kThreads, 1) peer_ping_pong(int iters, long long* cycles) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* in = smem;                  // kCopyBytes, written by the peer
  uint8_t* out = smem + kCopyBytes;    // kCopyBytes, sent to the peer
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + 2 * kCopyBytes);
  const uint32_t rank = cluster_rank(), peer = rank ^ 1u;
  for (int i = threadIdx.x; i < kCopyBytes; i += blockDim.x) out[i] = uint8_t(i + rank);
  if (threadIdx.x == 0) {
    mbar_init(smem_addr(bar), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // out[] visible to the bulk copy
  __syncwarp();  // the .aligned cluster barrier after thread 0's branch
  cluster_sync();
  if (threadIdx.x == 0) {
    const uint32_t my_bar = smem_addr(bar);
    const uint32_t peer_in = peer_addr(smem_addr(in), peer), peer_bar = peer_addr(my_bar, peer);
    long long t0 = 0;
    for (int it = 0; it < iters; ++it) {
      if (it == 1) t0 = clock64();  // the first round trip warms up
      mbar_expect_tx(my_bar, kCopyBytes);
      if (rank == 0) {
        copy_to_peer(peer_in, smem_addr(out), kCopyBytes, peer_bar);
        mbar_wait(my_bar, it & 1);
      } else {
        mbar_wait(my_bar, it & 1);
        copy_to_peer(peer_in, smem_addr(out), kCopyBytes, peer_bar);
      }
    }
    if (rank == 0) *cycles = (clock64() - t0) / (iters - 1);
  }
  __syncwarp();
  cluster_sync();  // neither CTA leaves while the other may still copy into it
}

int main() {
  int dev = 0, sms = 0, clock_khz = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  const int smem = cula::kda::sm90::kSharedBytes;
  std::printf("SMs %d, fused kernel's dynamic shared memory %d bytes, %d threads per CTA\n", sms, smem, kThreads);

  CHECK(cudaFuncSetAttribute(all_resident, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(all_resident, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  int* d = nullptr;
  CHECK(cudaMalloc(&d, 3 * sizeof(int)));
  for (int cluster : {1, 2, 4}) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cfg.gridDim = dim3(cluster);
    int clusters = 0;
    CHECK(cudaOccupancyMaxActiveClusters(&clusters, all_resident, &cfg));
    // A launch of exactly that many clusters: do they all run at once?
    CHECK(cudaMemset(d, 0, 3 * sizeof(int)));
    cfg.gridDim = dim3(clusters * cluster);
    CHECK(cudaLaunchKernelEx(&cfg, all_resident, d, d + 1));
    CHECK(cudaDeviceSynchronize());
    int r[2];
    CHECK(cudaMemcpy(r, d + 1, 2 * sizeof(int), cudaMemcpyDeviceToHost));
    std::printf("clusters of %d: at most %d resident (%d CTAs); a launch of %d clusters: %d CTAs saw all, %d timed out\n",
                cluster, clusters, clusters * cluster, clusters, r[0], r[1]);
  }

  const int copy_smem = 2 * kCopyBytes + 16;
  CHECK(cudaFuncSetAttribute(peer_ping_pong, cudaFuncAttributeMaxDynamicSharedMemorySize, copy_smem));
  long long* cyc = nullptr;
  CHECK(cudaMalloc(&cyc, sizeof(long long)));
  for (int rep = 0; rep < 3; ++rep) {
    peer_ping_pong<<<2, kThreads, copy_smem>>>(1001, cyc);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    long long c = 0;
    CHECK(cudaMemcpy(&c, cyc, sizeof(c), cudaMemcpyDeviceToHost));
    std::printf("8 KB shared -> peer shared bulk copy: round trip %lld cycles, one way ~%lld cycles (~%.2f us at %d MHz)\n",
                c, c / 2, double(c) / 2 / (clock_khz / 1000.0), clock_khz / 1000);
  }
  CHECK(cudaFree(cyc));
  CHECK(cudaFree(d));
  return 0;
}
