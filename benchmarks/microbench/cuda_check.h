// The microbenchmarks' runtime-call check: print the failing call with its error and return 1
// from main (every CHECK in them sits in main).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

#define CHECK(x)                                                                       \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::printf("%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      return 1;                                                                        \
    }                                                                                  \
  } while (0)
