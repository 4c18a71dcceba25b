// Issue rates of the instructions the general-gate prep leans on, per SM and clock, on the GPU it
// runs on (docs/perf-notes.md, "Where it stands (tenth session)"): the exp2 unit (MUFU.EX2), the
// fp32 -> 16-bit pair conversions (F2FP.*.PACK_AB) and FMUL for scale.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -o pipe_throughput pipe_throughput.cu && ./pipe_throughput
//
// Each thread runs eight independent dependency chains of one instruction (132 CTAs x 1024
// threads, so every SM is full and the unit, not the chains' latency, sets the pace); the count is
// checked in the SASS (cuobjdump -sass: eight of the instruction per iteration of the inner loop;
// ex2.approx.f16x2 becomes two MUFU.EX2.F16, so its line counts pairs).
#include <cstdint>
#include <cstdio>

template <int OP>
__global__ void chains(float* out, int iters, long long* cycles) {
  float f[8];
  for (int i = 0; i < 8; ++i) f[i] = 1.0f + threadIdx.x * 1e-3f + i;
  uint32_t u[8];
  for (int i = 0; i < 8; ++i) u[i] = 0x3c003c00u + i + threadIdx.x;
  __syncthreads();
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (OP == 0) {
        uint32_t r;
        asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(f[i]), "f"(f[i]));
        f[i] = __uint_as_float(r);
      } else if (OP == 1) {
        uint32_t r;
        asm volatile("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(f[i]), "f"(f[i]));
        f[i] = __uint_as_float(r);
      } else if (OP == 2) {
        asm volatile("mul.f32 %0, %0, %1;" : "+f"(f[i]) : "f"(1.0001f));
      } else if (OP == 3) {
        asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(f[i]));
      } else {
        asm volatile("ex2.approx.f16x2 %0, %0;" : "+r"(u[i]));
      }
    }
  }
  const long long t1 = clock64();
  uint32_t s = 0;
  for (int i = 0; i < 8; ++i) s ^= __float_as_uint(f[i]) ^ u[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = __uint_as_float(s);
  if (threadIdx.x == 0 && blockIdx.x == 0) *cycles = t1 - t0;
}

template <int OP>
static long long run(float* out, long long* cycles, int iters, int threads, int blocks) {
  for (int rep = 0; rep < 2; ++rep) chains<OP><<<blocks, threads>>>(out, iters, cycles);  // the first warms up
  cudaDeviceSynchronize();
  long long c = 0;
  cudaMemcpy(&c, cycles, sizeof c, cudaMemcpyDeviceToHost);
  return c;
}

int main() {
  const int iters = 4096, threads = 1024, blocks = 132;
  float* out;
  long long* cycles;
  cudaMalloc(&out, sizeof(float) * blocks * threads);
  cudaMalloc(&cycles, sizeof(long long));
  const char* names[] = {"F2FP.BF16.F32.PACK_AB", "F2FP.F16.F32.PACK_AB", "FMUL", "MUFU.EX2",
                         "ex2.approx.f16x2 (pairs)"};
  const long long c[] = {run<0>(out, cycles, iters, threads, blocks), run<1>(out, cycles, iters, threads, blocks),
                         run<2>(out, cycles, iters, threads, blocks), run<3>(out, cycles, iters, threads, blocks),
                         run<4>(out, cycles, iters, threads, blocks)};
  for (int op = 0; op < 5; ++op)
    printf("%-26s %6.1f per clock per SM (%lld cycles)\n", names[op], double(threads) * iters * 8 / double(c[op]), c[op]);
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
