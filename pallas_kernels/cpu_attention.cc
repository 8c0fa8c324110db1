// Ragged paged attention for the CPU: an XLA FFI custom call (see cpu_attention.py).
//
// Dataflow:
//   1. Work items are (sequence, block of kRowsPerItem query rows of its chunk, KV
//      head), spread over XLA's intra-op thread pool (cpu_simd.h `parallel_for`), so
//      every core works on one call.
//   2. Inside an item, each query vector (one row, one of the G = Hq / Hkv query heads of
//      the KV head) walks its visible keys in key groups: up to 16 consecutive keys of one
//      page, groups aligned to the page's start (so to absolute positions). Per group:
//      scores (16-lane partial sums over D, reduced by one fixed tree), one online-softmax
//      update (running max, sum), then the group's values weighted into the accumulator
//      in key order.
//   3. The accumulator is normalized (a sink logit joins the denominator when given) and
//      written; rows of no live sequence are zero.
// A second target, ArcjaxCpuWriteKV, copies this step's keys and values into their slots
// in place (XLA:CPU's scatter into 16-bit pages converted the whole cache every layer).
//
// NOTE: a query vector's arithmetic depends on it alone (its query, its position, the keys
// it sees, the page size): every vector runs the same code over the same groups in the
// same order whatever the batch, the chunk or the other rows. So the kernel is batch-
// and chunk-invariant by construction, and a decode row is computed exactly as a
// prefill row at the same position.
//
// NOTE: scores of keys a row may not see are computed (pages may hold anything there,
// NaN included) and masked before the softmax; their values are never read.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace arcjax_cpu;  // kLanes (also the most keys in a key group), vf, reduce16, ...

constexpr int kRowsPerItem = 16;  // query rows of one sequence per work item
constexpr int kMaxVectors = 16;   // head dims up to 256 (16 vectors of 16 floats)

// The largest lane (exact, whatever the order).
inline float lane_max(vf x) {
  vf y = ARCJAX_SHUFFLE(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x = x > y ? x : y;
  y = ARCJAX_SHUFFLE(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x = x > y ? x : y;
  y = ARCJAX_SHUFFLE(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x = x > y ? x : y;
  y = ARCJAX_SHUFFLE(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  x = x > y ? x : y;
  return x[0];
}

// The lanes' sum by the tree (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1).
inline float lane_sum(vf x) {
  x += ARCJAX_SHUFFLE(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += ARCJAX_SHUFFLE(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += ARCJAX_SHUFFLE(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += ARCJAX_SHUFFLE(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return x[0];
}

// exp(x) in float32 within 2 ulp, lane by lane; x below the float range (-inf included)
// gives a value < 1e-37, never NaN.
inline vf exp_approx(vf x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
  const float round = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to nearest
  const vf n = (x * 1.44269504088896341f + round) - round;
  vf r = x - n * 0.693359375f;  // ln 2 in two parts
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n
  return p * (vf)bits;
}

inline float exp_approx(float x) { return exp_approx(splat(x))[0]; }

// How the pages store a value: float32, bfloat16 (the upper half of a float32), 8 bits
// looked up in a 256-entry table (float8 pages: exact values, read from JAX), float16.
enum class PageKind : int32_t { kF32 = 0, kBF16 = 1, kByte = 2, kF16 = 3 };

// An IEEE half's exact float32 value.
inline float half_value(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
    const float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  const uint32_t bits = exponent == 31 ? sign | 0x7f800000u | (mantissa << 13)
                                       : sign | ((exponent + 112) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct Call {
  const float* q;          // [T, Hq, D]
  const void* k_pages;     // [NB, bs, Hkv, D]
  const void* v_pages;
  const int32_t* tables;   // [S, MB]
  const int32_t* kv_lens;  // [S]
  const int32_t* cu_q;     // [S + 1]
  const float* lut;        // [256] byte pages' values
  const float* sinks;      // [Hq] or null
  float* out;              // [T, Hq, D]
  int64_t t, hq, d, nb, bs, hkv, s, mb;
  int64_t dv;              // vectors per head: ceil(D / 16)
  int32_t num_seqs;
  int32_t window;          // 0: none
  float sm_scale, softcap, k_scale, v_scale;
  PageKind kind;
  bool staged;             // pages are copied to float32 rows of dv * 16 before use
};

inline float page_value(const Call& c, const void* pages, int64_t index) {
  switch (c.kind) {
    case PageKind::kF32:
      return static_cast<const float*>(pages)[index];
    case PageKind::kBF16: {
      uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(pages)[index]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return f;
    }
    case PageKind::kF16:
      return half_value(static_cast<const uint16_t*>(pages)[index]);
    default:
      return c.lut[static_cast<const uint8_t*>(pages)[index]];
  }
}

// Scratch of one thread.
struct Scratch {
  std::vector<float> q, acc, m, l, kbuf, vbuf;
  explicit Scratch(const Call& c)
      : q(kRowsPerItem * (c.hq / c.hkv) * c.dv * kLanes), acc(q.size()),
        m(kRowsPerItem * (c.hq / c.hkv)), l(m.size()), kbuf(c.bs * c.dv * kLanes),
        vbuf(kbuf.size()) {}
  // Whether it holds a call of `c`'s geometry (a thread keeps its scratch between calls).
  bool fits(const Call& c) const {
    return q.size() >= static_cast<size_t>(kRowsPerItem * (c.hq / c.hkv) * c.dv * kLanes) &&
           m.size() >= static_cast<size_t>(kRowsPerItem * (c.hq / c.hkv)) &&
           kbuf.size() >= static_cast<size_t>(c.bs * c.dv * kLanes);
  }
};

// Head `h`'s rows of `n` keys of a page from key `first`: `(pointer, stride)` in floats.
// Unscaled float32 pages with D a multiple of 16 are read in place; others are staged as
// float32 rows of dv * 16 (zero past D) in `buf`.
inline const float* head_rows(const Call& c, const void* pages, int64_t block, int64_t first,
                              int64_t n, int64_t h, float scale, float* buf, int64_t* stride) {
  const int64_t offset = ((block * c.bs + first) * c.hkv + h) * c.d;
  if (!c.staged) {
    *stride = c.hkv * c.d;
    return static_cast<const float*>(pages) + offset;
  }
  const int64_t width = c.dv * kLanes;
  for (int64_t j = 0; j < n; ++j) {
    float* dst = buf + j * width;
    for (int64_t i = 0; i < c.d; ++i)
      dst[i] = page_value(c, pages, offset + j * c.hkv * c.d + i) * scale;
    std::fill(dst + c.d, dst + width, 0.f);
  }
  *stride = width;
  return buf;
}

// One item: rows `row0 .. row0 + rows - 1` (flat indices, consecutive positions from
// `pos0`) of sequence `seq`, KV head `h`; DV vectors per head.
template <int DV>
void attend(const Call& c, int64_t seq, int64_t row0, int64_t rows, int64_t pos0, int64_t h,
            Scratch& w) {
  const int64_t g_count = c.hq / c.hkv, bs = c.bs, d = c.d, vecs = rows * g_count;
  int64_t lo[kRowsPerItem], hi[kRowsPerItem];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = pos0 + r;
    // Keys seen: [lo, hi], never past the table's pages.
    hi[r] = std::min<int64_t>({pos, c.kv_lens[seq] - 1, c.mb * bs - 1});
    lo[r] = c.window > 0 ? std::max<int64_t>(0, pos - c.window + 1) : 0;
    for (int64_t g = 0; g < g_count; ++g) {
      const int64_t v = r * g_count + g;
      const float* src = c.q + ((row0 + r) * c.hq + h * g_count + g) * d;
      float* q = w.q.data() + v * DV * kLanes;
      for (int64_t i = 0; i < d; ++i) q[i] = src[i] * c.sm_scale;
      std::fill(q + d, q + DV * kLanes, 0.f);
      std::fill_n(w.acc.data() + v * DV * kLanes, DV * kLanes, 0.f);
      w.m[v] = -std::numeric_limits<float>::infinity();
      w.l[v] = 0.f;
    }
  }
  const vf lane_index = vf{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int32_t* table = c.tables + seq * c.mb;
  // Positions grow with r: the item's keys span [lo[0], hi[rows - 1]].
  for (int64_t page = lo[0] / bs; page * bs <= hi[rows - 1]; ++page) {
    const int64_t block = std::clamp<int64_t>(table[page], 0, c.nb - 1);
    for (int64_t g0 = 0; g0 < bs; g0 += kLanes) {  // key groups of the page
      const int64_t first = page * bs + g0, n = std::min<int64_t>(kLanes, bs - g0);
      if (first > hi[rows - 1] || first + n - 1 < lo[0]) continue;
      int64_t ks, vs;
      const float* kp = head_rows(c, c.k_pages, block, g0, n, h, c.k_scale, w.kbuf.data(), &ks);
      const float* vp = head_rows(c, c.v_pages, block, g0, n, h, c.v_scale, w.vbuf.data(), &vs);
      for (int64_t v = 0; v < vecs; ++v) {
        const int64_t r = v / g_count;
        const int64_t f = std::max<int64_t>(lo[r] - first, 0);
        const int64_t e = std::min<int64_t>(hi[r] - first, n - 1);
        if (e < f) continue;  // no key of this group: the vector's state is untouched
        const float* q = w.q.data() + v * DV * kLanes;
        // part[j]: key j's 16 partial sums over D, vectors in order (one chain per key,
        // the 16 chains interleaved); keys past the group stay zero.
        vf part[kLanes] = {};
        if (n == kLanes) {
          for (int i = 0; i < DV; ++i) {
            const vf qi = load(q + i * kLanes);
            for (int j = 0; j < kLanes; ++j) part[j] += qi * load(kp + j * ks + i * kLanes);
          }
        } else {
          for (int i = 0; i < DV; ++i) {
            const vf qi = load(q + i * kLanes);
            for (int64_t j = 0; j < n; ++j) part[j] += qi * load(kp + j * ks + i * kLanes);
          }
        }
        vf s = reduce16(part);  // s[j]: key first + j
        if (c.softcap > 0.f)
          for (int j = 0; j < kLanes; ++j) s[j] = c.softcap * std::tanh(s[j] / c.softcap);
        const vi seen = (lane_index >= static_cast<float>(f)) &
                        (lane_index <= static_cast<float>(e));
        s = seen ? s : splat(-std::numeric_limits<float>::infinity());
        const float top = std::max(w.m[v], lane_max(s));
        const vf p = seen ? exp_approx(s - top) : vf{};
        const float psum = lane_sum(p);
        const float alpha = exp_approx(w.m[v] - top);  // ~0 on the vector's first group
        w.l[v] = w.l[v] * alpha + psum;
        w.m[v] = top;
        float* a = w.acc.data() + v * DV * kLanes;
        vf acc[DV];
        for (int i = 0; i < DV; ++i) acc[i] = load(a + i * kLanes) * alpha;
        for (int64_t j = f; j <= e; ++j)
          for (int i = 0; i < DV; ++i) acc[i] += p[j] * load(vp + j * vs + i * kLanes);
        for (int i = 0; i < DV; ++i) store(a + i * kLanes, acc[i]);
      }
    }
  }
  for (int64_t v = 0; v < vecs; ++v) {
    const int64_t r = v / g_count, head = h * g_count + v % g_count;
    const float m = w.m[v], l = w.l[v];
    float scale;
    if (c.sinks != nullptr) {
      const float top = std::max(m, c.sinks[head]);
      const float rescale = exp_approx(m - top);
      scale = rescale / (l * rescale + exp_approx(c.sinks[head] - top));
    } else {
      scale = 1.f / (l > 0.f ? l : 1.f);
    }
    const float* a = w.acc.data() + v * DV * kLanes;
    float* dst = c.out + ((row0 + r) * c.hq + head) * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = a[i] * scale;
  }
}

using AttendFn = void (*)(const Call&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&);

template <int... DVs>
AttendFn pick(int64_t dv, std::integer_sequence<int, DVs...>) {
  AttendFn fn = nullptr;
  ((fn = (dv == DVs + 1) ? &attend<DVs + 1> : fn), ...);
  return fn;
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                     ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> tables,
                     ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> cu_q,
                     ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> window,
                     ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> lut,
                     ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out,
                     float sm_scale, float softcap, int32_t page_kind, bool has_sinks) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), td = tables.dimensions();
  Call c;
  c.t = qd[0]; c.hq = qd[1]; c.d = qd[2];
  c.nb = kd[0]; c.bs = kd[1]; c.hkv = kd[2];
  c.s = td[0]; c.mb = td[1];
  c.dv = (c.d + kLanes - 1) / kLanes;
  if (c.hkv <= 0 || c.hq % c.hkv != 0)
    return ffi::Error::InvalidArgument("cpu attention: Hq is not a multiple of Hkv");
  if (c.dv > kMaxVectors)
    return ffi::Error::InvalidArgument("cpu attention: head dim above 256");
  c.q = q.typed_data();
  c.k_pages = k_pages.untyped_data();
  c.v_pages = v_pages.untyped_data();
  c.tables = tables.typed_data();
  c.kv_lens = kv_lens.typed_data();
  c.cu_q = cu_q.typed_data();
  c.lut = lut.typed_data();
  c.sinks = has_sinks ? sinks.typed_data() : nullptr;
  c.out = out->typed_data();
  c.num_seqs = std::clamp<int32_t>(num_seqs.typed_data()[0], 0, static_cast<int32_t>(c.s));
  c.window = window.typed_data()[0];
  c.k_scale = scales.typed_data()[0];
  c.v_scale = scales.typed_data()[1];
  c.sm_scale = sm_scale;
  c.softcap = softcap;
  c.kind = static_cast<PageKind>(page_kind);
  c.staged = c.kind != PageKind::kF32 || c.k_scale != 1.f || c.v_scale != 1.f ||
             c.d % kLanes != 0;

  std::memset(c.out, 0, sizeof(float) * c.t * c.hq * c.d);  // rows of no sequence stay zero
  const AttendFn fn = pick(c.dv, std::make_integer_sequence<int, kMaxVectors>{});
  // Work items: (block of up to kRowsPerItem rows of one live sequence) x KV head; rows
  // clipped to the buffer (lengths are the caller's data).
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (sequence, first row)
  for (int64_t seq = 0; seq < c.num_seqs; ++seq) {
    const int64_t start = std::clamp<int64_t>(c.cu_q[seq], 0, c.t);
    const int64_t end = std::clamp<int64_t>(c.cu_q[seq + 1], start, c.t);
    for (int64_t row = start; row < end; row += kRowsPerItem) blocks.emplace_back(seq, row);
  }
  const int64_t items = static_cast<int64_t>(blocks.size()) * c.hkv;
  parallel_for(pool, items, [c, fn, blocks = std::move(blocks)](int64_t item) {
    thread_local std::unique_ptr<Scratch> scratch;  // a pool thread's, kept between calls
    if (!scratch || !scratch->fits(c)) scratch = std::make_unique<Scratch>(c);
    const auto [seq, row0] = blocks[item / c.hkv];
    const int64_t start = c.cu_q[seq], end = std::min<int64_t>(c.cu_q[seq + 1], c.t);
    const int64_t first_pos = c.kv_lens[seq] - (c.cu_q[seq + 1] - start);
    fn(c, seq, row0, std::min<int64_t>(end - row0, kRowsPerItem), first_pos + (row0 - start),
       item % c.hkv, *scratch);
  });
  return ffi::Error::Success();
}

// `pages` with row j of `rows` in slot `slots[j]`, into `out` (the same buffer when XLA
// aliased them; a copy of `pages` first otherwise).
void write_rows(const ffi::AnyBuffer& pages, const ffi::AnyBuffer& rows, const int32_t* slots,
                int64_t t, int64_t num_slots, size_t row, void* out) {
  auto* dst = static_cast<char*>(out);
  if (out != pages.untyped_data()) std::memcpy(dst, pages.untyped_data(), pages.size_bytes());
  const auto* src = static_cast<const char*>(rows.untyped_data());
  for (int64_t j = 0; j < t; ++j)
    if (slots[j] >= 0 && slots[j] < num_slots) std::memcpy(dst + slots[j] * row, src + j * row, row);
}

// Writes row t of `k` / `v` (already in the pages' dtype) into slot `slots[t]` of the
// pages, in place when XLA aliases the results with the pages (it does in the step: the
// cache is donated); slots outside the pages are padding and write nothing.
ffi::Error WriteKV(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots,
                   ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  const auto kd = k_pages.dimensions();
  const int64_t num_slots = kd[0] * kd[1], t = slots.dimensions()[0];
  const size_t row = k_pages.size_bytes() / std::max<int64_t>(num_slots, 1);
  if (k.size_bytes() != t * row || v.size_bytes() != t * row)
    return ffi::Error::InvalidArgument("cpu write_kv: rows differ from the pages' rows");
  write_rows(k_pages, k, slots.typed_data(), t, num_slots, row, k_out->untyped_data());
  write_rows(v_pages, v, slots.typed_data(), t, num_slots, row, v_out->untyped_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ArcjaxCpuWriteKV, WriteKV,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // k_pages
                                  .Arg<ffi::AnyBuffer>()          // v_pages
                                  .Arg<ffi::AnyBuffer>()          // k rows
                                  .Arg<ffi::AnyBuffer>()          // v rows
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slot_mapping
                                  .Ret<ffi::AnyBuffer>()          // k_pages, aliased
                                  .Ret<ffi::AnyBuffer>());        // v_pages, aliased

XLA_FFI_DEFINE_HANDLER_SYMBOL(ArcjaxCpuAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::AnyBuffer>()          // k_pages
                                  .Arg<ffi::AnyBuffer>()          // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_seqlens_q
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()   // window (0: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_scale, v_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()   // byte pages' values
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("softcap")
                                  .Attr<int32_t>("page_kind")
                                  .Attr<bool>("has_sinks"));
