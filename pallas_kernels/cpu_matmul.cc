// x @ w for the CPU's decode-sized products: an XLA FFI custom call (see cpu_matmul.py).
//
// Dataflow:
//   0. Only the first `rows` rows of x are multiplied (a batch-invariant row tile's live
//      rows, else M); the output's other rows are zeros.
//   1. Work items are blocks of output columns, spread over XLA's intra-op thread pool
//      (cpu_simd.h `parallel_for`).
//   2. w stored [K, N] ("kn", a projection): every output element is one chain of fused
//      multiply-adds over k = 0 .. K-1, computed for up to kRows rows at a time.
//      float32 w: an item's columns (at most kSweepColumns / rows, about N / threads) are
//      swept kSweepRows rows of w at a time, each row segment read whole, so several
//      contiguous streams of w are in flight: about XLA's speed, RESULTS.md); the
//      accumulators wait in a buffer.
//      bfloat16 w: strips of 32-256 columns (narrower for more rows), each strip of w
//      streamed once per row block, the accumulators in registers.
//      w stored [N, K] ("nk", a tied embedding as the LM head): each group of 16 columns is
//      16 dot products per row: 16-lane partial sums over k, reduced by one fixed tree.
//   3. float32 or bfloat16 weights (read as they are stored, widened in registers);
//      float32 arithmetic; the output is float32.
//
// NOTE: an output element's arithmetic depends on its row of x and its column of w alone:
// the same instructions in the same order whatever the number of rows or the row's place
// among them. So the product is batch-invariant by construction, and a decode row's
// product is computed as a prefill row's (docs/design/batch-invariance.md).

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace arcjax_cpu;  // kLanes, vf, vi, reduce16, parallel_for

constexpr int kRows = 8;               // rows of x per pass over w's columns ("kn")
constexpr int kColumnsPerItem = 256;   // columns per work item (strips, "nk")
constexpr int kSweepColumns = 1024;    // accumulators (rows x columns) of one sweep's item
constexpr int kSweepRows = 8;          // rows of w a sweep reads at once
constexpr int64_t kSmallBytes = 1 << 20;  // a float32 "kn" product below this (w's bytes
                                          // times its rows, up to kRows) runs on one thread

typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint16_t vh_unaligned __attribute__((vector_size(32), aligned(2)));

enum class WeightKind : int32_t { kF32 = 0, kBF16 = 1 };

struct Call {
  const float* x;  // [M, K]
  const void* w;   // [K, N] or [N, K]
  float* out;      // [M, N]
  int64_t m, k, n;
  WeightKind kind;
  bool nk;
};

// 16 consecutive weights as float32.
template <WeightKind kind>
inline vf load_w(const void* w, int64_t index) {
  if constexpr (kind == WeightKind::kF32) {
    return load(static_cast<const float*>(w) + index);
  } else {
    const vh h = *reinterpret_cast<const vh_unaligned*>(static_cast<const uint16_t*>(w) + index);
    return (vf)(__builtin_convertvector(h, vi) << 16);
  }
}

template <WeightKind kind>
inline float scalar_w(const void* w, int64_t index) {
  if constexpr (kind == WeightKind::kF32) {
    return static_cast<const float*>(w)[index];
  } else {
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(w)[index]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
}

// "kn": column `col` of row r as one scalar chain: the same fused multiply-adds in the same
// order as a vector lane's (a fused multiply-add is exact: a column's bits are the same
// either way). The columns past the last whole vector take it.
template <WeightKind kind>
inline float column_chain(const Call& c, int64_t r, int64_t col) {
  float acc = 0.f;
  for (int64_t k = 0; k < c.k; ++k)
    acc = __builtin_fmaf(c.x[r * c.k + k], scalar_w<kind>(c.w, k * c.n + col), acc);
  return acc;
}

// Vectors of columns per strip for a block of R rows: about 16 accumulators, so few rows
// stream wide strips of w (a whole 1 KiB row segment for one row) and many rows narrow ones.
constexpr int strip_vectors(int rows) { return rows == 1 ? 16 : rows == 2 ? 8 : rows <= 4 ? 4 : 2; }

// "kn": rows [r0, r0 + R) x columns [c0, c0 + 16 V) (all inside the matrix).
template <WeightKind kind, int R>
void strip_kn(const Call& c, int64_t r0, int64_t c0) {
  constexpr int V = strip_vectors(R);
  vf acc[R][V] = {};
  const float* x = c.x + r0 * c.k;
  for (int64_t k = 0; k < c.k; ++k) {
    vf w[V];
    for (int v = 0; v < V; ++v) w[v] = load_w<kind>(c.w, k * c.n + c0 + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * c.k + k];
      for (int v = 0; v < V; ++v) acc[r][v] += xr * w[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      *reinterpret_cast<vf_unaligned*>(c.out + (r0 + r) * c.n + c0 + v * kLanes) = acc[r][v];
}

// "kn", columns [c0, c1) of rows [r0, r0 + R): whole strips, then the last columns one
// chain each.
template <WeightKind kind, int R>
void block_kn(const Call& c, int64_t r0, int64_t c0, int64_t c1) {
  constexpr int width = strip_vectors(R) * kLanes;
  const int64_t full = c0 + (c1 - c0) / width * width;
  for (int64_t col = c0; col < full; col += width) strip_kn<kind, R>(c, r0, col);
  for (int64_t r = r0; r < r0 + R; ++r)
    for (int64_t col = full; col < c1; ++col) c.out[r * c.n + col] = column_chain<kind>(c, r, col);
}

// "kn", rows [r0, r0 + R) x columns [c0, c1) (at most kSweepColumns / R): w's rows swept
// kSweepRows at a time, each column vector's chains carried over those rows in order (so
// kSweepRows streams of w are in flight, each read along its row), the accumulators in a
// buffer between sweeps. The same chain per element as `strip_kn`:
// acc += x[r, k] * w[k, col], k = 0 .. K-1.
template <WeightKind kind, int R>
void sweep_kn(const Call& c, int64_t r0, int64_t c0, int64_t c1) {
  constexpr int kVectors = kSweepColumns / kLanes / R;
  alignas(64) vf acc[R][kVectors] = {};
  const int64_t vectors = (c1 - c0) / kLanes;
  const float* x = c.x + r0 * c.k;
  const int64_t kt = c.k / kSweepRows * kSweepRows;
  for (int64_t k = 0; k < kt; k += kSweepRows) {
    float xr[R][kSweepRows];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < kSweepRows; ++t) xr[r][t] = x[r * c.k + k + t];
    for (int64_t v = 0; v < vectors; ++v) {
      vf a[R];
      for (int r = 0; r < R; ++r) a[r] = acc[r][v];
      for (int t = 0; t < kSweepRows; ++t) {
        const vf w = load_w<kind>(c.w, (k + t) * c.n + c0 + v * kLanes);
        for (int r = 0; r < R; ++r) a[r] += xr[r][t] * w;
      }
      for (int r = 0; r < R; ++r) acc[r][v] = a[r];
    }
  }
  for (int64_t k = kt; k < c.k; ++k)
    for (int64_t v = 0; v < vectors; ++v) {
      const vf w = load_w<kind>(c.w, k * c.n + c0 + v * kLanes);
      for (int r = 0; r < R; ++r) acc[r][v] += x[r * c.k + k] * w;
    }
  for (int r = 0; r < R; ++r) {
    for (int64_t v = 0; v < vectors; ++v)
      *reinterpret_cast<vf_unaligned*>(c.out + (r0 + r) * c.n + c0 + v * kLanes) = acc[r][v];
    for (int64_t col = c0 + vectors * kLanes; col < c1; ++col)
      c.out[(r0 + r) * c.n + col] = column_chain<kind>(c, r0 + r, col);
  }
}

template <WeightKind kind>
using BlockFn = void (*)(const Call&, int64_t, int64_t, int64_t);

// The row blocks of one "kn" method: blocks[R - 1] computes R rows.
template <WeightKind kind, bool sweep, int... Rs>
constexpr std::array<BlockFn<kind>, kRows> row_blocks(std::integer_sequence<int, Rs...>) {
  if constexpr (sweep) {
    return {&sweep_kn<kind, Rs + 1>...};
  } else {
    return {&block_kn<kind, Rs + 1>...};
  }
}

// "kn", columns [c0, c1) of every row, kRows rows at a time, by sweeps or by strips.
template <WeightKind kind, bool sweep>
void columns_kn(const Call& c, int64_t c0, int64_t c1) {
  static constexpr auto blocks =
      row_blocks<kind, sweep>(std::make_integer_sequence<int, kRows>{});
  for (int64_t r0 = 0; r0 < c.m; r0 += kRows)
    blocks[std::min<int64_t>(kRows, c.m - r0) - 1](c, r0, c0, c1);
}

// "nk", columns [c0, c1) of every row: groups of 16 columns, each a dot product over k
// (16-lane partials, the fixed tree, then the last k % 16 terms in order).
template <WeightKind kind>
void columns_nk(const Call& c, int64_t c0, int64_t c1) {
  const int64_t kv = c.k / kLanes * kLanes;
  for (int64_t g = c0; g < c1; g += kLanes) {
    const int64_t cols = std::min<int64_t>(kLanes, c1 - g);
    for (int64_t r = 0; r < c.m; ++r) {
      const float* x = c.x + r * c.k;
      vf part[kLanes] = {};
      for (int64_t k = 0; k < kv; k += kLanes) {
        const vf xk = *reinterpret_cast<const vf_unaligned*>(x + k);
        if (cols == kLanes) {  // the same products, the 16 chains kept in registers
          for (int j = 0; j < kLanes; ++j) part[j] += xk * load_w<kind>(c.w, (g + j) * c.k + k);
        } else {
          for (int64_t j = 0; j < cols; ++j)
            part[j] += xk * load_w<kind>(c.w, (g + j) * c.k + k);
        }
      }
      const vf s = reduce16(part);
      for (int64_t j = 0; j < cols; ++j) {
        float acc = s[j];
        for (int64_t k = kv; k < c.k; ++k)
          acc = __builtin_fmaf(x[k], scalar_w<kind>(c.w, (g + j) * c.k + k), acc);
        c.out[r * c.n + g + j] = acc;
      }
    }
  }
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                  ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> out,
                  int32_t weight_kind, bool nk) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  Call c;
  const int64_t m = xd[0];
  c.k = xd[1];
  c.n = nk ? wd[0] : wd[1];
  if ((nk ? wd[1] : wd[0]) != c.k)
    return ffi::Error::InvalidArgument("cpu matmul: x's columns differ from w's inner dim");
  // the first `rows` rows are computed (clipped to [0, M]); the others are zeros
  c.m = std::clamp<int64_t>(rows.typed_data()[0], 0, m);
  c.x = x.typed_data();
  c.w = w.untyped_data();
  c.out = out->typed_data();
  c.kind = static_cast<WeightKind>(weight_kind);
  c.nk = nk;
  std::fill(c.out + c.m * c.n, c.out + m * c.n, 0.f);
  if (c.m == 0 || c.n == 0) return ffi::Error::Success();
  const bool bf16 = c.kind == WeightKind::kBF16;
  void (*columns)(const Call&, int64_t, int64_t) =
      nk ? (bf16 ? &columns_nk<WeightKind::kBF16> : &columns_nk<WeightKind::kF32>)
         : (bf16 ? &columns_kn<WeightKind::kBF16, false> : &columns_kn<WeightKind::kF32, true>);
  int64_t per = kColumnsPerItem;  // columns per work item
  int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (!nk && !bf16) {  // float32 "kn": each item sweeps its columns' rows of w
    // a small product runs on the calling thread: waking a helper costs more than it saves
    if (c.k * c.n * 4 * std::min<int64_t>(c.m, kRows) < kSmallBytes) threads = 1;
    const int64_t most = kSweepColumns / std::min<int64_t>(c.m, kRows) / kLanes * kLanes;
    per = std::clamp<int64_t>((c.n + threads * kLanes - 1) / (threads * kLanes) * kLanes,
                              kLanes, most);
  }
  auto item = [c, per, columns](int64_t i) {
    const int64_t c0 = i * per;
    columns(c, c0, std::min<int64_t>(c0 + per, c.n));
  };
  const int64_t items = (c.n + per - 1) / per;
  if (threads == 1) {
    for (int64_t i = 0; i < items; ++i) item(i);
  } else {
    parallel_for(pool, items, item);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ArcjaxCpuMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // w [K, N] or [N, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows [] computed
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, N]
                                  .Attr<int32_t>("weight_kind")
                                  .Attr<bool>("nk"));
