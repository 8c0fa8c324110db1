// What the CPU kernels share (cpu_attention.cc, cpu_matmul.cc): 16-float vectors (GCC /
// Clang vector extensions: the compiler picks the machine's instructions), the one
// reduction tree of 16 dot products, and a loop over work items spread over XLA's
// intra-op thread pool.
#ifndef ARCJAX_CPU_SIMD_H_
#define ARCJAX_CPU_SIMD_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace arcjax_cpu {

constexpr int kLanes = 16;  // floats per vector

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef float vf_unaligned __attribute__((vector_size(64), aligned(4)));

inline vf load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vf_unaligned*>(p) = v; }
inline vf splat(float x) { return vf{} + x; }

#if defined(__clang__)
#define ARCJAX_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define ARCJAX_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif

// out[j] = the lanes of p[j] summed by the tree (l, l + 8), (l, l + 4), (l, l + 2),
// (l, l + 1): the same tree for every dot product of every row.
inline vf reduce16(const vf* p) {
  vf a[8], b[4], c[2];
  for (int k = 0; k < 8; ++k)
    a[k] = ARCJAX_SHUFFLE(p[2 * k], p[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                          21, 22, 23) +
           ARCJAX_SHUFFLE(p[2 * k], p[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                          28, 29, 30, 31);
  for (int k = 0; k < 4; ++k)
    b[k] = ARCJAX_SHUFFLE(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24,
                          25, 26, 27) +
           ARCJAX_SHUFFLE(a[2 * k], a[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                          29, 30, 31);
  for (int k = 0; k < 2; ++k)
    c[k] = ARCJAX_SHUFFLE(b[2 * k], b[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24,
                          25, 28, 29) +
           ARCJAX_SHUFFLE(b[2 * k], b[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26,
                          27, 30, 31);
  return ARCJAX_SHUFFLE(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         ARCJAX_SHUFFLE(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// body(item) for every item in [0, n), claimed from one counter by the calling thread and
// by tasks on the pool; returns when all have run.
// NOTE: `body` is moved into state that outlives the call: a task may start after the
// call returned (it then finds nothing left), so body must not be run by it, only kept.
template <class Body>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, Body body) {
  struct State {
    Body body;
    int64_t n;
    std::atomic<int64_t> next{0}, done{0};
    State(Body b, int64_t count) : body(std::move(b)), n(count) {}
    void run() {
      for (int64_t item; (item = next.fetch_add(1)) < n; done.fetch_add(1)) body(item);
    }
  };
  if (n <= 0) return;
  auto state = std::make_shared<State>(std::move(body), n);
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([state] { state->run(); });
  state->run();
  while (state->done.load() < n) std::this_thread::yield();
}

}  // namespace arcjax_cpu

#endif  // ARCJAX_CPU_SIMD_H_
