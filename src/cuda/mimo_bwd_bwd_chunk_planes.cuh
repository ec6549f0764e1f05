// K3 of mamba3_mimo_bwd_bwd on the planes kernel: the chunk pass of mimo_bwd_bwd_kernels.cuh
// (chunk_body: same formulas, same outputs and workspace partials for K4) for bf16 q, k, v
// (power-of-two N, P, R, C: see make_plan), with every chunk operand in shared memory as bf16
// hi/lo planes split once per chunk (why: chunk_body keeps them in fp32 global scratch and
// splits every operand at every load; see docs/PERF.md, "Design of that chunk kernel").
// Products: mimo::warp_mma_16x16 (three bf16 mma.m16n8k16 per tile, fp32 accumulation, ~2^-17
// relative error per product).
//
// The element loops (most of the instructions: the products are a few per cent of them) index
// with shifts and masks (Args::lgN, lgP, lgR, lgC), not runtime divisions, hoist the 64-bit
// stride products out of the inner loops, and load q, k, v, dout and states with compile-time
// types (runtime dtypes dispatched once per loop, not per element as ld() does), two
// consecutive elements per load where the layout allows (Args::vec_*; four for q, k in K3's
// rotation and the dq, dk stores). The few-element loops (segsum, qk_dot, dv) keep runtime-dtype
// accesses: a copy per dtype there only adds code, and K3 is large for the instruction cache.
//
// One CTA of kPlanesThreads (16 warps) per SM, grid-stride over the (b, h, chunk) items (the
// next item's inputs are prefetched to L2 during this one's phase 3, and its per-step inputs,
// biases and (sin, cos) table staged in shared memory after this one's DQ / DK loop:
// stage_chunk); T = C R rows (zero past the sequence).
//   phase 0  planes qh, kh [T][N] (biased, rotated), x, g = dPhiO [T][P], st = states[c]
//            [N][P]; the chunk's DD partial (sum g x, from the fp32 values); per-step decays
//   phase 1  KQ = kh qh^T, XG = x g^T (fp32 [T][T])
//   phase 2  by tile ownership (the warp that computes an inter-chunk tile in registers goes on
//            accumulating the intra-chunk product into it, so SG, SX and kh dS are never
//            stored), with the masked coefficient matrices built one at a time in mc:
//              dqh = E (g St^T) + M1 kh     (then st is overwritten by dS_c)
//              dkh = F (x dS^T) + M2 qh
//              dx  = F ts (kh dS) + M3 g
//            DDA_CS, DDA_CS_REV and DFACTOR are row sums over those tiles (per-row partials in
//            shared memory, summed per step in a fixed order); DSSDA, DGAMMA from KQ, XG.
//   phase 3  dqh, dkh to shared memory (fp32, over the dead qh / kh planes), dx over x: rotation
//            undone, diagonal terms, DQ, DK, DANGLES, DV and the DMIMO_V partial. The exact fp32
//            q / k rows these need are reloaded from global memory (L2) instead of kept.
// Deterministic: fixed tile owners, fixed-order sums, no atomics.
#pragma once


#include <initializer_list>
#include <iterator>
#include <type_traits>

#include "cuda/bf16_split_mma.cuh"
#include "cuda/mimo_bwd_bwd_kernels.cuh"

namespace mamba3::cuda::bb {

// ------------------------------------------------------------------ typed loads

template <class T>
struct DTag {
  using type = T;
};

// f(DTag<T>{}) for the C++ type T of dtype code dt (0 f16, 1 bf16, 2 f32): a runtime dtype
// dispatched once per loop, not once per element as ld() does.
template <class F>
BB_DEV void with_dtype(int dt, F f) {
  if (dt == 2)
    f(DTag<float>{});
  else if (dt == 1)
    f(DTag<__nv_bfloat16>{});
  else
    f(DTag<__half>{});
}

// dout of the planes path: bf16 or fp32 (make_plan).
template <class F>
BB_DEV void with_dout_dtype(int dt, F f) {
  if (dt == 2)
    f(DTag<float>{});
  else
    f(DTag<__nv_bfloat16>{});
}

// (bf16 widened by a shift: the same bits as __bfloat162float, without its conversion.)
BB_DEV float f_of_bits(unsigned short u, DTag<__nv_bfloat16>) {
  return mimo::mb_u2f(static_cast<uint32_t>(u) << 16);
}
BB_DEV float f_of_bits(unsigned short u, DTag<__half>) { return __half2float(__ushort_as_half(u)); }

// f(std::integral_constant<int, 1 << lg>{}) for lg in 0..3 (R and its halves on the planes
// path: R is a power of two <= kMaxR = 8): rank loops with compile-time trip counts, one small
// copy per rank count, instead of kMaxR-long loops with a runtime test per rank.
template <class F>
BB_DEV void with_pow2(int lg, F f) {
  if (lg == 3)
    f(std::integral_constant<int, 8>{});
  else if (lg == 2)
    f(std::integral_constant<int, 4>{});
  else if (lg == 1)
    f(std::integral_constant<int, 2>{});
  else
    f(std::integral_constant<int, 1>{});
}
template <int K>
constexpr int lg_of = K == 8 ? 3 : K == 4 ? 2 : K == 2 ? 1 : 0;

// Element off of a tensor of dtype T, as float.
template <class T, class V>
BB_DEV float ld_t(const V& v, int64_t off) {
  if constexpr (sizeof(T) == 4)
    return mimo::mb_ldg(reinterpret_cast<const float*>(v.p) + off);
  else
    return f_of_bits(mimo::mb_ldg(reinterpret_cast<const unsigned short*>(v.p) + off), DTag<T>{});
}

// Elements off and off + st (st: the last dim's stride): one load of the pair when vec (unit
// last stride, off even, aligned: Args::vec_*), else two loads of the same elements. Callers on
// hot paths pass vec as a compile-time constant (a fast-path loop and a fallback loop): with a
// runtime vec the compiler predicates both paths and issues all three loads. bf16 pairs are
// widened by a shift and a mask (the same bits as the conversions, fewer instructions).
template <class T, class V>
BB_DEV float2 ld2_t(const V& v, int64_t off, int64_t st, bool vec) {
  if constexpr (sizeof(T) == 4) {
    const float* p = reinterpret_cast<const float*>(v.p) + off;
    if (vec) return mimo::mb_ldg(reinterpret_cast<const float2*>(p));
    return make_float2(mimo::mb_ldg(p), mimo::mb_ldg(p + st));
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const unsigned short* p = reinterpret_cast<const unsigned short*>(v.p) + off;
    const uint32_t u = vec ? mimo::mb_ldg(reinterpret_cast<const unsigned int*>(p))
                           : mimo::mb_ldg(p) | (static_cast<uint32_t>(mimo::mb_ldg(p + st)) << 16);
    return mimo::bf2_f(u);
  } else {
    const unsigned short* p = reinterpret_cast<const unsigned short*>(v.p) + off;
    unsigned short u0, u1;
    if (vec) {
      const unsigned int u = mimo::mb_ldg(reinterpret_cast<const unsigned int*>(p));
      u0 = static_cast<unsigned short>(u & 0xffffu), u1 = static_cast<unsigned short>(u >> 16);
    } else {
      u0 = mimo::mb_ldg(p), u1 = mimo::mb_ldg(p + st);
    }
    return make_float2(f_of_bits(u0, DTag<T>{}), f_of_bits(u1, DTag<T>{}));
  }
}

// x[0 .. K) = p[0 .. K) from shared memory, K a power of two, p aligned to min(K, 4) floats:
// as float4 / float2 loads (one LDS.128 per 4 floats), the same values as K scalar loads.
template <int K>
BB_DEV void ld_smem_row(const float* p, float (&x)[K]) {
  if constexpr (K >= 4) {
    BB_UNROLL
    for (int j = 0; j < K / 4; ++j) {
      const float4 v = reinterpret_cast<const float4*>(p)[j];
      x[4 * j] = v.x, x[4 * j + 1] = v.y, x[4 * j + 2] = v.z, x[4 * j + 3] = v.w;
    }
  } else if constexpr (K == 2) {
    const float2 v = *reinterpret_cast<const float2*>(p);
    x[0] = v.x, x[1] = v.y;
  } else {
    x[0] = p[0];
  }
}

BB_DEV unsigned short bits_of(float x, DTag<__nv_bfloat16>) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
BB_DEV unsigned short bits_of(float x, DTag<__half>) {
  return __half_as_ushort(__float2half_rn(x));
}

// Stores x.x, x.y (rounded to nearest as rt_st) as elements off and off + st of a tensor of
// dtype T: one store of the pair when vec (as ld2_t), else two.
template <class T, class V>
BB_DEV void st2_t(const V& v, int64_t off, int64_t st, bool vec, float2 x) {
  if constexpr (sizeof(T) == 4) {
    float* p = reinterpret_cast<float*>(v.p) + off;
    if (vec) {
      *reinterpret_cast<float2*>(p) = x;
    } else {
      p[0] = x.x;
      p[st] = x.y;
    }
  } else {
    unsigned short* p = reinterpret_cast<unsigned short*>(v.p) + off;
    const unsigned short u0 = bits_of(x.x, DTag<T>{}), u1 = bits_of(x.y, DTag<T>{});
    if (vec) {
      *reinterpret_cast<unsigned int*>(p) = u0 | (static_cast<unsigned int>(u1) << 16);
    } else {
      p[0] = u0;
      p[st] = u1;
    }
  }
}

// Stores x.x .. x.w (rounded to nearest as rt_st) as elements off, off + st, off + 2 st,
// off + 3 st of a tensor of dtype T: one store of the quad when vec = 2 (Args::vec_dq: st = 1,
// off a multiple of 4, aligned), two pair stores when 1, else four.
template <class T, class V>
BB_DEV void st4_t(const V& v, int64_t off, int64_t st, int vec, float4 x) {
  if (vec == 2) {
    if constexpr (sizeof(T) == 4) {
      *reinterpret_cast<float4*>(reinterpret_cast<float*>(v.p) + off) = x;
    } else {
      const uint32_t u0 = bits_of(x.x, DTag<T>{}), u1 = bits_of(x.y, DTag<T>{});
      const uint32_t u2 = bits_of(x.z, DTag<T>{}), u3 = bits_of(x.w, DTag<T>{});
      *reinterpret_cast<uint2*>(reinterpret_cast<unsigned short*>(v.p) + off) =
          make_uint2(u0 | (u1 << 16), u2 | (u3 << 16));
    }
  } else {
    st2_t<T>(v, off, st, vec != 0, make_float2(x.x, x.y));
    st2_t<T>(v, off + 2 * st, st, vec != 0, make_float2(x.z, x.w));
  }
}

// Stores x, rounded to nearest as rt_st, at p (a compile-time dtype).
BB_DEV void st_t(float* p, float x) { *p = x; }
BB_DEV void st_t(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
BB_DEV void st_t(__half* p, float x) { *p = __float2half_rn(x); }

using bf16_t = __nv_bfloat16;

// dPhiO row (t, r) of dout starts at base + t st + r sr, stride sp along p (dphio_row and
// dphio_pstride, with the layout switch and the products of b and h done once per chunk).
struct DoutRows {
  int64_t base, st, sr, sp;
};
template <class AT>
BB_DEV DoutRows dout_rows(const AT& a, int b, int h) {
  const auto& d = a.dout;
  if (a.layout == 0) return {b * d.s[0] + h * d.s[2], d.s[1], 0, d.s[3]};
  if (a.layout == 1) return {b * d.s[0] + h * d.s[3], d.s[1], d.s[2], d.s[4]};
  return {b * d.s[0] + h * d.s[1], a.R * d.s[2], d.s[2], d.s[3]};
}

// ------------------------------------------------------------------ planes helpers

// K3's products unroll their k loops 4 times (mimo::warp_mma_16x16's UNROLL): nvcc's own choice
// for a runtime trip count is a ladder of ~30 k steps of code per call site (~450 instructions,
// a fifth of K3's code for the instruction cache), of which K3's 2-8 steps per call run a few.
constexpr int kMmaUnroll = 4;


// Stores (x.x, x.y) as split pairs (hi = bf16(x), lo = bf16(x - hi)) at elements e, e + 1
// (e even) of a planes tile: one 4-byte store per plane. (mimo::st_split2's values, with the hi
// pair widened back to fp32 by a shift and a mask: __bfloat1622float2 costs two byte permutes.)
BB_DEV void st_split_pair(const mimo::SplitTile& t, int e, float2 x) {
  uint32_t hi, lo;
  mimo::split2f(x.x, x.y, hi, lo);
  *reinterpret_cast<uint32_t*>(t.h + e) = hi;
  *reinterpret_cast<uint32_t*>(t.h + t.plane + e) = lo;
}

// hi + lo of elements e, e + 1 (e even; the operand as the products see it): one 4-byte load
// per plane.
// (Widened by a shift / mask: the same bits as __bfloat1622float2, without its byte permutes.)
BB_DEV float2 plane_val2(const mimo::SplitTile& t, int e) {
  const uint32_t hi = *reinterpret_cast<const uint32_t*>(t.h + e);
  const uint32_t lo = *reinterpret_cast<const uint32_t*>(t.h + t.plane + e);
  return make_float2(mimo::mb_u2f(hi << 16) + mimo::mb_u2f(lo << 16),
                     mimo::mb_u2f(hi & 0xffff0000u) + mimo::mb_u2f(lo & 0xffff0000u));
}

// For a warp's 16 x 16 accumulator tile (rows m0.., columns n0..), the row sums of
// V[row][col] * acc[row][col] over the tile's 16 columns into
// part[(row * ncol_tiles + n0 / 16) * 3 + Which] (the three partial sums of a row and tile
// interleaved: one address per row for all three, the others at immediate offsets; three
// separate arrays kept six more hoisted addresses live across phase 2, which spilled).
// Every lane of the warp calls it.
template <int Which>
BB_DEV void tile_row_dots(const mimo::SplitTile& V, int m0, int n0, const float (&acc)[2][4],
                          float* part, int ncol_tiles) {
  const int lane = bb_tid() & 31, g = lane >> 2, q = lane & 3;
  const int e0 = (m0 + g) * V.ld + n0 + 2 * q, e1 = e0 + 8 * V.ld;
  float v0 = 0.f, v1 = 0.f;
  BB_UNROLL
  for (int j = 0; j < 2; ++j) {
    const float2 p0 = plane_val2(V, e0 + 8 * j), p1 = plane_val2(V, e1 + 8 * j);
    v0 += p0.x * acc[j][0] + p0.y * acc[j][1];
    v1 += p1.x * acc[j][2] + p1.y * acc[j][3];
  }
  v0 += mimo::mb_shfl_xor(v0, 1);
  v1 += mimo::mb_shfl_xor(v1, 1);
  v0 += mimo::mb_shfl_xor(v0, 2);
  v1 += mimo::mb_shfl_xor(v1, 2);
  if (q == 0) {
    // The row index made opaque here so that the compiler forms the store address at the
    // store: hoisted to the kernel's start it stayed live across phase 2 and spilled.
    const int gr = mimo::mb_opaque(m0 + g);
    part[(gr * ncol_tiles + (n0 >> 4)) * 3 + Which] = v0;
    part[((gr + 8) * ncol_tiles + (n0 >> 4)) * 3 + Which] = v1;
  }
}

// acc rows scaled by f[row >> lgR] (rows m0 + g and m0 + g + 8 of the fragment).
BB_DEV void scale_rows(float (&acc)[2][4], int m0, int lgR, const float* f) {
  const int g = (bb_tid() & 31) >> 2;
  const float s0 = f[(m0 + g) >> lgR], s1 = f[(m0 + g + 8) >> lgR];
  BB_UNROLL
  for (int j = 0; j < 2; ++j) {
    acc[j][0] *= s0;
    acc[j][1] *= s0;
    acc[j][2] *= s1;
    acc[j][3] *= s1;
  }
}

// The inter-chunk term of a fused dqh / dkh tile (rows m0.., columns n0..): acc = A Sp^T over
// the P columns (SG = dPhiO St^T or SX = x dS^T), its row dots with V into partial sum Which
// (DDA_CS or DDA_CS_REV), then its rows scaled by f[row >> lgR] (E or F). The owning warp goes on
// accumulating the intra-chunk product into acc. Every lane of the warp calls it.
template <int Which, bool INC = false>
BB_DEV void inter_chunk_tile(float (&acc)[2][4], const mimo::SplitTile& A, const mimo::SplitTile& Sp,
                             const mimo::SplitTile& V, int m0, int n0, int P, int lgR,
                             const float* f, float* part, int ncol_tiles) {
  mimo::warp_mma_16x16<false, false, kMmaUnroll, INC>(acc, A, m0, Sp, n0, 0, P);
  tile_row_dots<Which>(V, m0, n0, acc, part, ncol_tiles);
  scale_rows(acc, m0, lgR, f);
}

// inter_chunk_tile for a warp's two tiles of one column block (PairTiles: rows ma.., mb..):
// both zeroed, the products paired (Sp's fragments loaded once per k step), then each tile's
// row dots and row scaling in inter_chunk_tile's order.
template <int Which, bool INC>
BB_DEV void inter_chunk_pair(float (&acc)[2][2][4], const mimo::SplitTile& A,
                             const mimo::SplitTile& Sp, const mimo::SplitTile& V, int ma, int mb,
                             int n0, int P, int lgR, const float* f, float* part, int ncol_tiles) {
  mimo::zero_acc(acc[0]);
  mimo::zero_acc(acc[1]);
  mimo::warp_mma_16x16_pair<false, false, kMmaUnroll, INC>(acc[0], ma, 0, P, acc[1], mb, 0, P,
                                                           A, Sp, n0);
  tile_row_dots<Which>(V, ma, n0, acc[0], part, ncol_tiles);
  scale_rows(acc[0], ma, lgR, f);
  tile_row_dots<Which>(V, mb, n0, acc[1], part, ncol_tiles);
  scale_rows(acc[1], mb, lgR, f);
}

// Two sums over the block of NT threads (NT a multiple of 32, NT / 32 a power of two <= 32),
// returned to every thread; deterministic (fixed order, no atomics): each warp adds its lanes'
// values in a butterfly (xor 16, 8, 4, 2, 1), lane 0 stores the warp's pair in red[w] and
// red[NW + w] (red: 2 NW floats, NW = NT / 32), one barrier, then every warp adds the NW warp
// pairs in a butterfly (xor NW / 2, ..., 1; lane l holds warp l mod NW's): the same order, so
// the same bits, in every lane of every warp (a butterfly's partners add the same two values).
// Why not a shared-memory tree: one barrier instead of 2 + log2 NT (11 at 512 threads), where
// the planes K3 spent ~8% of its stall samples. Does not end with a barrier: red must not be
// rewritten before the caller's next one.
template <int NT>
BB_DEV float2 block_sum2(float v0, float v1, float* red) {
  constexpr int NW = NT / 32;
  static_assert(NT % 32 == 0 && NW <= 32 && (NW & (NW - 1)) == 0, "NT / 32: a power of two <= 32");
  const int tid = bb_tid(), lane = tid & 31;
  BB_UNROLL
  for (int m = 16; m > 0; m >>= 1) v0 += mimo::mb_shfl_xor(v0, m), v1 += mimo::mb_shfl_xor(v1, m);
  if (lane == 0) red[tid >> 5] = v0, red[NW + (tid >> 5)] = v1;
  bb_sync();
  float t0 = red[lane & (NW - 1)], t1 = red[NW + (lane & (NW - 1))];
  BB_UNROLL
  for (int m = NW / 2; m > 0; m >>= 1) t0 += mimo::mb_shfl_xor(t0, m), t1 += mimo::mb_shfl_xor(t1, m);
  return make_float2(t0, t1);
}

// Stores a 16 x 16 accumulator tile into the fp32 matrix out (row stride ld, even; out 8-byte
// aligned): a lane's column pairs by 8-byte stores (half the store instructions of scalar ones:
// the planes K3's tile stores were 4% of its stall samples, mio throttle). Bank conflicts: none
// where ld = 8 (mod 32) (a half warp's 16 pairs then cover the 32 banks once: the fp32 rows of
// the planes, kPlanesPad); 4-way where ld is a multiple of 32 (KQ, XG; 8-way with scalar stores).
BB_DEV void store_tile(const float (&acc)[2][4], int m0, int n0, float* out, int ld) {
  const int lane = bb_tid() & 31, g = lane >> 2, q = lane & 3;
  BB_UNROLL
  for (int j = 0; j < 2; ++j) {
    float* o = out + (m0 + g) * ld + n0 + 8 * j + 2 * q;
    *reinterpret_cast<float2*>(o) = make_float2(acc[j][0], acc[j][1]);
    *reinterpret_cast<float2*>(o + 8 * ld) = make_float2(acc[j][2], acc[j][3]);
  }
}

// The [nrows][P] element loops: thread tid keeps the column pair (pc, pc + 1),
// pc = 2 (tid mod P/2), and strides over the rows from tid / (P/2) by NT / (P/2) (no division
// per element; P is a power of two with P/2 <= NT: make_plan). The loads of U rows are all
// issued before their stores (why: with one CTA per SM, a load-then-store chain per row would
// keep one global load in flight per thread).
template <int U, int NT, class Load, class Store>
BB_DEV void pair_rows(int nrows, int lgP, Load load, Store store) {
  const int lgH = lgP - 1, tid = bb_tid();
  const int pc = (tid & ((1 << lgH) - 1)) * 2, rs = NT >> lgH;
  for (int r0 = tid >> lgH; r0 < nrows; r0 += U * rs) {
    decltype(load(0, 0)) v[U] = {};
    BB_UNROLL
    for (int u = 0; u < U; ++u)
      if (r0 + u * rs < nrows) v[u] = load(r0 + u * rs, pc);
    BB_UNROLL
    for (int u = 0; u < U; ++u)
      if (r0 + u * rs < nrows) store(r0 + u * rs, pc, v[u]);
  }
}

// pair_rows over a tensor whose row offset is linear in the row: load(row, off, pc) and
// store(row, off, pc, v) get off = row * stride (elements) formed by one 64-bit add per row,
// not a 64-bit multiply per row (the compiler does not strength-reduce row * stride there).
template <int U, int NT, class Load, class Store>
BB_DEV void pair_rows_lin(int nrows, int lgP, int64_t stride, Load load, Store store) {
  const int lgH = lgP - 1, tid = bb_tid();
  const int pc = (tid & ((1 << lgH) - 1)) * 2, rs = NT >> lgH;
  const int64_t step = rs * stride;
  int64_t off0 = (tid >> lgH) * stride;
  for (int r0 = tid >> lgH; r0 < nrows; r0 += U * rs, off0 += U * step) {
    decltype(load(0, off0, 0)) v[U] = {};
    int64_t off = off0;
    BB_UNROLL
    for (int u = 0; u < U; ++u, off += step)
      if (r0 + u * rs < nrows) v[u] = load(r0 + u * rs, off, pc);
    off = off0;
    BB_UNROLL
    for (int u = 0; u < U; ++u, off += step)
      if (r0 + u * rs < nrows) store(r0 + u * rs, off, pc, v[u]);
  }
}

// pair_rows over [T][P] rows (row = i R + r) whose source offsets are linear in the step i:
// load(row, oa, ob, pc) gets oa = i sa and ob = i sb, advanced by one 64-bit add per row, not
// formed by 64-bit multiplies per row. Needs NT / (P / 2) to be a multiple of R (a thread's
// rows then all have its rank and step by a constant number of steps: K3, make_plan).
template <int U, int NT, class Load, class Store>
BB_DEV void pair_rows_steps(int nrows, int lgP, int lgR, int64_t sa, int64_t sb, Load load,
                            Store store) {
  const int lgH = lgP - 1, tid = bb_tid();
  const int pc = (tid & ((1 << lgH) - 1)) * 2, rs = NT >> lgH;
  const int64_t da = (rs >> lgR) * sa, db = (rs >> lgR) * sb;
  int64_t oa0 = ((tid >> lgH) >> lgR) * sa, ob0 = ((tid >> lgH) >> lgR) * sb;
  for (int r0 = tid >> lgH; r0 < nrows; r0 += U * rs, oa0 += U * da, ob0 += U * db) {
    decltype(load(0, oa0, ob0, 0)) v[U] = {};
    int64_t oa = oa0, ob = ob0;
    BB_UNROLL
    for (int u = 0; u < U; ++u, oa += da, ob += db)
      if (r0 + u * rs < nrows) v[u] = load(r0 + u * rs, oa, ob, pc);
    BB_UNROLL
    for (int u = 0; u < U; ++u)
      if (r0 + u * rs < nrows) store(r0 + u * rs, pc, v[u]);
  }
}

// (w[h][r][pc], w[h][r][pc + 1]) of an [H][R][P] weight (mimo_v, mimo_o).
template <class V>
BB_DEV float2 rank_weights(const V& w, int h, int r, int pc) {
  const int64_t o = o3(w, h, r, pc);
  return make_float2(ld(w, o), ld(w, o + w.s[2]));
}

// The Z gate silu(z mz) of a pair of columns, given their z and mimo_z values.
BB_DEV float2 z_gate_of(float2 z, float2 mz) {
  return make_float2(silu_f(z.x * mz.x), silu_f(z.y * mz.y));
}

// z_gate of columns (pc, pc + 1) of step t, given their mimo_z pair mz (the row's rank).
template <class AT>
BB_DEV float2 z_gate2(const AT& a, int b, int t, int h, int pc, float2 mz) {
  const int64_t o = o4(a.z, b, t, h, pc);  // (32-bit with a CView z: ArgsCT<.., kCtCombined>)
  const float2 z = a.bf16_z_pairs ? ld2_t<bf16_t>(a.z, o, 1, true)
                                  : make_float2(ld(a.z, o), ld(a.z, o + a.z.s[3]));
  return z_gate_of(z, mz);
}

// The rank weights of a pair_rows<U, NT> loop over [T][P] rows (row = i R + r): a thread's rows
// step by NT / (P / 2), so when that is a multiple of R they all have the thread's rank and its
// weight pair is loaded once per loop, not once per row (K1 at P 128, R 8 is the exception;
// K3 always is: make_plan keeps 2 kPlanesThreads / P >= kMaxR).
struct RankWeights {
  bool fixed;  // every row of this thread has rank r_thread
  float2 w;    // its pair (fixed only)
  template <class V>
  BB_DEV float2 at(const V& wv, int h, int r, int pc) const {
    return fixed ? w : rank_weights(wv, h, r, pc);
  }
};
template <int NT, class V>
BB_DEV RankWeights thread_rank_weights(const V& w, int h, int R, int lgP, bool present) {
  const int lgH = lgP - 1, tid = bb_tid();
  RankWeights rw{((NT >> lgH) & (R - 1)) == 0, make_float2(1.f, 1.f)};
  if (rw.fixed && present)
    rw.w = rank_weights(w, h, (tid >> lgH) & (R - 1), (tid & ((1 << lgH) - 1)) * 2);
  return rw;
}

using mimo::mb_prefetch_l2;  // (bf16_split_mma.cuh, shared with the first pass)
using mimo::mb_prefetch_row;

// Asks L2 for the inputs of chunk `item` (q, k rows, v, dPhiO rows, states[c], dS_c, segsum and
// angle rows, per-step scalars), one request per 128-byte line of each row. Called by a CTA for
// its next chunk during the current one's phase 3 (why: one CTA per SM, so nothing else overlaps
// its load phases with DRAM latency; served from L2 they should be ~2x shorter: not measured).
template <class AT>
BB_DEV void prefetch_item(const AT& a, int64_t item) {
  // 32-bit (B H nch < 2^31: make_plan) divisions by multiply-high (Args::div_*).
  const int it = static_cast<int>(item), bh = a.div_nch.div(it), c = it - bh * a.nch;
  const int b = a.div_H.div(bh), h = bh - b * a.H, grp = a.div_HG.div(h);
  const int R = a.R, lgR = a.lgR, N = a.N, P = a.P, s0 = c * a.C, L = bb_min(a.C, a.S - s0);
  const bool partial = L < a.C;
  const int LR = L * R, nd = a.layout == 0 ? L : LR;
  const int64_t NP = static_cast<int64_t>(N) * P;
  // Row groups, in order: q, k (L R rows of N), v (L of P), dPhiO (nd of P), z (L of P, with
  // the gate), states (N of P), segsum (L of C, whole chunks only), angles (L of A), da_cs / dt /
  // trap (one row of L each), dS_c (NP / 32 lines of fp32).
  const int g_q = LR, g_k = g_q + LR, g_v = g_k + L, g_d = g_v + nd,
            g_z = g_d + (a.gate ? L : 0), g_s = g_z + N,
            g_w = g_s + (partial ? 0 : L), g_a = g_w + L, g_t = g_a + 3;
  const int total = g_t + static_cast<int>((NP + 31) / 32);
  for (int e = bb_tid(); e < total; e += kPlanesThreads) {
    if (e >= g_t) {
      mb_prefetch_l2(a.ws_ds + item * NP + static_cast<int64_t>(e - g_t) * 32);
      continue;
    }
    if constexpr (std::is_same_v<std::decay_t<decltype(a.q)>, View>) {
      const View* v;
      int64_t off, stride;
      int cnt;
      if (e < g_k) {
        const int row = e < g_q ? e : e - g_q, i = row >> lgR, r = row & (R - 1);
        v = e < g_q ? &a.q : &a.k;
        off = int64_t{b} * v->s[0] + (s0 + i) * v->s[1] + r * v->s[2] + int64_t{grp} * v->s[3];
        stride = v->s[4], cnt = N;
      } else if (e < g_v) {
        v = &a.v, off = o3(a.v, b, s0 + e - g_k, h), stride = a.v.s[3], cnt = P;
      } else if (e < g_d) {
        const int row = e - g_v, i = a.layout == 0 ? row : row >> lgR,
                  r = a.layout == 0 ? 0 : row & (R - 1);
        v = &a.dout, off = dphio_row(a, b, s0 + i, r, h), stride = dphio_pstride(a), cnt = P;
      } else if (e < g_z) {
        v = &a.z, off = o3(a.z, b, s0 + e - g_d, h), stride = a.z.s[3], cnt = P;
      } else if (e < g_s) {
        v = &a.states, off = o4(a.states, b, h, c, e - g_z), stride = a.states.s[4], cnt = P;
      } else if (e < g_w) {
        v = &a.segsum, off = o5(a.segsum, b, h, c, e - g_s, 0), stride = a.segsum.s[4], cnt = a.C;
      } else if (e < g_a) {
        v = &a.angles, off = o4(a.angles, b, s0 + e - g_w, h, 0), stride = a.angles.s[3], cnt = a.A;
      } else {
        v = e == g_a ? &a.da_cs : e == g_a + 1 ? &a.dt : &a.trap;
        off = o3(*v, b, h, s0), stride = v->s[2], cnt = L;
      }
      mb_prefetch_row(v->p, v->dt == 2 ? 4 : 2, off, stride, cnt);
    } else {
      // (The row's pointer and element size per branch, not a View pointer: the views may be of
      // different types, the contiguous-layout ArgsCT's CViews.)
      const unsigned char* vp;
      int es;
      int64_t off, stride;
      int cnt;
      auto at = [&](const auto& w) { vp = w.p, es = w.dt == 2 ? 4 : 2; };
      if (e < g_k) {
        const int row = e < g_q ? e : e - g_q, i = row >> lgR, r = row & (R - 1);
        const auto& v = e < g_q ? a.q : a.k;
        at(v);
        off = int64_t{b} * v.s[0] + (s0 + i) * v.s[1] + r * v.s[2] + int64_t{grp} * v.s[3];
        stride = v.s[4], cnt = N;
      } else if (e < g_v) {
        at(a.v), off = o3(a.v, b, s0 + e - g_k, h), stride = a.v.s[3], cnt = P;
      } else if (e < g_d) {
        const int row = e - g_v, i = a.layout == 0 ? row : row >> lgR,
                  r = a.layout == 0 ? 0 : row & (R - 1);
        at(a.dout), off = dphio_row(a, b, s0 + i, r, h), stride = dphio_pstride(a), cnt = P;
      } else if (e < g_z) {
        at(a.z), off = o3(a.z, b, s0 + e - g_d, h), stride = a.z.s[3], cnt = P;
      } else if (e < g_s) {
        at(a.states), off = o4(a.states, b, h, c, e - g_z), stride = a.states.s[4], cnt = P;
      } else if (e < g_w) {
        at(a.segsum), off = o5(a.segsum, b, h, c, e - g_s, 0), stride = a.segsum.s[4], cnt = a.C;
      } else if (e < g_a) {
        at(a.angles), off = o4(a.angles, b, s0 + e - g_w, h, 0), stride = a.angles.s[3],
                      cnt = a.A;
      } else {
        // da_cs, dt, trap (one row each)
        const int w = e - g_a;
        if (w == 0)
          at(a.da_cs), off = o3(a.da_cs, b, h, s0), stride = a.da_cs.s[2];
        else if (w == 1)
          at(a.dt), off = o3(a.dt, b, h, s0), stride = a.dt.s[2];
        else
          at(a.trap), off = o3(a.trap, b, h, s0), stride = a.trap.s[2];
        cnt = L;
      }
      mb_prefetch_row(vp, es, off, stride, cnt);
    }
  }
}

// One source of rotated_pair_rows / rotated_quad_rows: q or k (bf16: make_plan), its load
// layout (Args::vec_q / vec_k: pair loads when nonzero, quad loads when 2), its output planes.
template <class V = View>
struct RotSrc {
  const V* x;
  int vec;
  mimo::SplitTile out;
};

// The rotated, biased rows of NX sources (q; or q and k) of one step i as split planes, scaled
// by scale[i] (nullptr: unscaled), one task per step and column pair (n, n + 1), n even < half,
// with its rotation partners (half + n, half + n + 1), over the R ranks: rows i R + r of each
// source's planes (zero past the sequence). The sources of a task share its sin / cos (K1: q
// only; K3 uses rotated_quad_rows). bias(k, r, n): (b[n], b[n + 1], b[half + n], b[half + n + 1]) of source k, rank r.
// Each thread keeps its column pair (NT is a multiple of half / 2), steps strided. Loads of RG
// ranks are issued before their stores (more loads in flight per thread). Same arithmetic per
// element as the scalar (n, half + n) tasks they replace.
template <int NT, int RG, int NX, class Bias, class AT, class V>
BB_DEV void rotated_pair_rows(const AT& a, const RotSrc<V> (&src)[NX], Bias bias, int b, int h,
                              int grp, int s0, int L, const float* scale) {
  const int R = a.R, A = a.A, half = a.half, lgQ = a.lgN - 2, lgR = a.lgR;
  const int tid = bb_tid(), n = (tid & ((1 << lgQ) - 1)) * 2;
  const int64_t as1 = a.angles.s[1], as3 = a.angles.s[3];
  const int64_t ang0 = int64_t{b} * a.angles.s[0] + int64_t{h} * a.angles.s[2] + n * as3;
  bool vec = true;
  BB_UNROLL
  for (int k = 0; k < NX; ++k) vec = vec && src[k].vec != 0;
  for (int i = tid >> lgQ; i < a.C; i += NT >> lgQ) {
    float2 sn = make_float2(0.f, 0.f), cs = make_float2(1.f, 1.f);
    if (i < L) {
      const int64_t ao = ang0 + (s0 + i) * as1;
      if (n < A) bb_sincos(ld(a.angles, ao), &sn.x, &cs.x);
      if (n + 1 < A) bb_sincos(ld(a.angles, ao + as3), &sn.y, &cs.y);
    }
    const float E = scale != nullptr ? (i < L ? scale[i] : 0.f) : 1.f;
    // The pair-load choice compile-time per step task (a uniform branch; the sincos above stays
    // one copy): the pair body (every source with vec) issues only its 4-byte loads (with a
    // runtime choice both paths were predicated and issued); the fallback (layouts without pair
    // loads, rare) takes the ranks one at a time (G 1: less code). Same values and arithmetic.
    auto rows = [&](auto vec_tag) {
      constexpr bool kVec = decltype(vec_tag)::value;
      constexpr int G = kVec ? RG : 1;
      BB_UNROLL
      for (int k = 0; k < NX; ++k) {
        const V& x = *src[k].x;
        const int64_t sx = x.s[4], sr = x.s[2], hs = half * sx;
        // Rank r's row offset: xrow + r sr, stepped by one add per rank.
        int64_t o = int64_t{b} * x.s[0] + int64_t{grp} * x.s[3] + (s0 + i) * x.s[1] + n * sx;
        // (Rolled: with R compile-time, the specialised K1 at R = 8 unrolled it and spilled.)
        BB_NO_UNROLL
        for (int r0 = 0; r0 < R; r0 += G) {
          float2 x1[G] = {}, x2[G] = {};  // loads first
          BB_UNROLL
          for (int u = 0; u < G; ++u, o += sr) {
            const int r = r0 + u;
            if (r < R && i < L) {
              const float2 lo = ld2_t<bf16_t>(x, o, sx, kVec);
              const float2 hi = ld2_t<bf16_t>(x, o + hs, sx, kVec);
              const float4 bv = bias(k, r, n);
              x1[u] = make_float2(lo.x + bv.x, lo.y + bv.y);
              x2[u] = make_float2(hi.x + bv.z, hi.y + bv.w);
            }
          }
          const mimo::SplitTile& out = src[k].out;
          BB_UNROLL
          for (int u = 0; u < G; ++u) {
            const int r = r0 + u;
            if (r < R) {
              const int row = (i << lgR) + r;
              float2 y1 = x1[u], y2 = x2[u];
              // Which product is fused is fixed (mb_fma_rn): nvcc chose differently in the
              // R = 1 contiguous-layout copies, whose bits then differed from the generic K1's.
              if (n < A)
                y1.x = mimo::mb_fma_rn(x1[u].x, cs.x, -mimo::mb_fmul_rn(x2[u].x, sn.x)),
                y2.x = mimo::mb_fma_rn(x1[u].x, sn.x, mimo::mb_fmul_rn(x2[u].x, cs.x));
              if (n + 1 < A)
                y1.y = mimo::mb_fma_rn(x1[u].y, cs.y, -mimo::mb_fmul_rn(x2[u].y, sn.y)),
                y2.y = mimo::mb_fma_rn(x1[u].y, sn.y, mimo::mb_fmul_rn(x2[u].y, cs.y));
              if (scale != nullptr) y1.x *= E, y1.y *= E, y2.x *= E, y2.y *= E;
              st_split_pair(out, row * out.ld + n, y1);
              st_split_pair(out, row * out.ld + half + n, y2);
            }
          }
        }
      }
    };
    if (vec)
      rows(std::true_type{});
    else
      rows(std::false_type{});
  }
}

// Stores the split quad x (hi = bf16(x), lo = bf16(x - hi), as st_split_pair) at elements
// e .. e + 3 (e a multiple of 4) of a planes tile: one 8-byte store per plane. The hi pair
// widened back to fp32 by a shift / mask (exact; __bfloat1622float2 costs byte permutes).
BB_DEV void st_split4(const mimo::SplitTile& t, int e, float4 x) {
  uint2 hi, lo;
  mimo::split2f(x.x, x.y, hi.x, lo.x);
  mimo::split2f(x.z, x.w, hi.y, lo.y);
  *reinterpret_cast<uint2*>(t.h + e) = hi;
  *reinterpret_cast<uint2*>(t.h + t.plane + e) = lo;
}

// Elements p[0], p[st], p[2 st], p[3 st] of a bf16 tensor as fp32 (exact): one 8-byte load when
// kQuad (Args::vec_* = 2: st = 1, p 8-byte aligned), else four 2-byte loads (the same values; no
// third variant for pair layouts: code the instruction cache would hold for rare layouts).
// kQuad is a compile-time choice: with a runtime one both paths were predicated and issued.
template <bool kQuad>
BB_DEV float4 ld4_bf16(const unsigned short* p, int64_t st) {
  uint2 u;
  if constexpr (kQuad) {
    u = mimo::mb_ldg(reinterpret_cast<const uint2*>(p));
  } else {
    u.x = mimo::mb_ldg(p) | (static_cast<uint32_t>(mimo::mb_ldg(p + st)) << 16);
    u.y = mimo::mb_ldg(p + 2 * st) | (static_cast<uint32_t>(mimo::mb_ldg(p + 3 * st)) << 16);
  }
  return mimo::bf4_f(u);
}

// rotated_pair_rows for K3 (q and k, unscaled) with four columns per task: columns n .. n + 3
// (n a multiple of 4 < half) and their partners half + n .., over the R ranks: 8-byte bf16
// loads (vec 2), float4 bias reads from shared memory (bias(k, r, n): source k's fp32 biases
// at columns n .. n + 3 of rank r), 8-byte split stores. Same arithmetic per element as
// rotated_pair_rows. Needs half % 4 == 0 (N >= 16 on the planes path: make_plan).
// The (sin, cos) of the angles: with a table (tab, filled for this chunk beforehand: see
// stage_chunk) read from it, and a task is one source's (k, i, n): twice the tasks of both
// sources together, so that all warps share them (at N128 C16, 256 two-source tasks left half
// of K3's 16 warps without any, waiting at the next barrier for the other half). Without a
// table (tab == nullptr: N128 R1 C64) read from the workspace's table of the whole sequence
// (GT: gtab = Args::ws_cs at the chunk's first step; else computed here, one rolled sincosf per
// angle, as the kernels whose layout always has the table keep compiled: their code is then
// unchanged), and a task takes both sources (one read for both).
template <int NT, int RG, bool GT, class Bias, class AT, class V>
BB_DEV void rotated_quad_rows(const AT& a, const RotSrc<V> (&src)[2], Bias bias, int b, int h,
                              int grp, int s0, int L, const float2* tab, const float2* gtab) {
  const int R = a.R, A = a.A, half = a.half, lgQ = a.lgN - 3, lgR = a.lgR, lgC = a.lgC;
  const int64_t as1 = a.angles.s[1], as3 = a.angles.s[3];
  const int64_t ang0 = int64_t{b} * a.angles.s[0] + int64_t{h} * a.angles.s[2];
  const bool quad = src[0].vec == 2 && src[1].vec == 2;
  // Tasks: source k0 = e / (C N / 8) (0 without a table), step i, quad n; nk sources each.
  const int nk = tab != nullptr ? 1 : 2;
  for (int e = bb_tid(); e < ((2 / nk) << (lgC + lgQ)); e += NT) {
    const int k0 = e >> (lgC + lgQ), i = (e >> lgQ) & (a.C - 1), n = (e & ((1 << lgQ) - 1)) * 4;
    float sn[4] = {0.f, 0.f, 0.f, 0.f}, cs[4] = {1.f, 1.f, 1.f, 1.f};
    if (i < L && n < A) {
      if (tab != nullptr) {
        BB_UNROLL
        for (int j = 0; j < 4; ++j)
          if (n + j < A) {
            const float2 t = tab[i * A + n + j];
            sn[j] = t.x, cs[j] = t.y;
          }
      } else if constexpr (GT) {
        // 16-byte loads where all four are angles (A even: gtab + i A + n is 16-byte aligned;
        // four 8-byte loads 32 bytes apart read each sector four times: N128 R1 C64's excess
        // global sectors); the same values.
        if (n + 3 < A && (A & 1) == 0) {
          const float4 t01 = *reinterpret_cast<const float4*>(gtab + i * A + n);
          const float4 t23 = *reinterpret_cast<const float4*>(gtab + i * A + n + 2);
          sn[0] = t01.x, cs[0] = t01.y, sn[1] = t01.z, cs[1] = t01.w;
          sn[2] = t23.x, cs[2] = t23.y, sn[3] = t23.z, cs[3] = t23.w;
        } else {
          BB_UNROLL
          for (int j = 0; j < 4; ++j)
            if (n + j < A) {
              const float2 t = gtab[i * A + n + j];
              sn[j] = t.x, cs[j] = t.y;
            }
        }
      } else {
        const int64_t ao = ang0 + (s0 + i) * as1 + n * as3;
        BB_NO_UNROLL
        for (int j = 0; j < 4; ++j) {
          float sv = 0.f, cv = 1.f;
          if (n + j < A) bb_sincos(ld(a.angles, ao + j * as3), &sv, &cv);
          // (Selects, not an indexed array: that would go to local memory.)
          sn[0] = j == 0 ? sv : sn[0], cs[0] = j == 0 ? cv : cs[0];
          sn[1] = j == 1 ? sv : sn[1], cs[1] = j == 1 ? cv : cs[1];
          sn[2] = j == 2 ? sv : sn[2], cs[2] = j == 2 ? cv : cs[2];
          sn[3] = j == 3 ? sv : sn[3], cs[3] = j == 3 ? cv : cs[3];
        }
      }
    }
    // The loads' layout chosen per task (a uniform branch; the sincos above stays one copy):
    // the quad-load body (both sources with vec 2) issues only its 8-byte loads; the
    // fallback (other layouts, rare) takes the ranks one at a time (G 1: less code) with
    // 2-byte loads. Same values and arithmetic per element either way. The quad body's group
    // G = min(RG, R) is compile-time (one copy per G: R = 1, 2 and R >= RG), so that G divides
    // the rank count: no per-rank r < R tests, and the step's i < L test is one branch per
    // group, not one per rank (with their zero-initialisations).
    auto rows = [&](auto quad_tag, auto g_tag) {
      constexpr bool kQuad = decltype(quad_tag)::value;
      constexpr int G = decltype(g_tag)::value;
      // Ranks: G itself where the quad body's G < RG (R = G), else the runtime R (a multiple
      // of G).
      const int nr = kQuad && G < RG ? G : R;
      BB_NO_UNROLL  // (nk = 1 or 2 sources: one copy)
      for (int k = k0; k < k0 + nk; ++k) {
        const V& x = k == 0 ? *src[0].x : *src[1].x;
        const unsigned short* xp = reinterpret_cast<const unsigned short*>(x.p);
        const int64_t sx = x.s[4], sr = x.s[2], hs = half * sx;
        // Rank r's row offset: xrow + r sr, stepped by one add per rank.
        int64_t o = int64_t{b} * x.s[0] + int64_t{grp} * x.s[3] + (s0 + i) * x.s[1] + n * sx;
        BB_NO_UNROLL  // (R = 8: two groups of RG, one copy)
        for (int r0 = 0; r0 < nr; r0 += G) {
          float4 x1[G], x2[G];  // loads first
          if (i < L) {
            BB_UNROLL
            for (int u = 0; u < G; ++u, o += sr) {
              const int r = r0 + u;
              const float4 lo = ld4_bf16<kQuad>(xp + o, sx);
              const float4 hi = ld4_bf16<kQuad>(xp + o + hs, sx);
              const float4 b1 = bias(k, r, n), b2 = bias(k, r, half + n);
              x1[u] = make_float4(lo.x + b1.x, lo.y + b1.y, lo.z + b1.z, lo.w + b1.w);
              x2[u] = make_float4(hi.x + b2.x, hi.y + b2.y, hi.z + b2.z, hi.w + b2.w);
            }
          } else {
            BB_UNROLL
            for (int u = 0; u < G; ++u) x1[u] = x2[u] = make_float4(0.f, 0.f, 0.f, 0.f);
          }
          const mimo::SplitTile out = k == 0 ? src[0].out : src[1].out;
          BB_UNROLL
          for (int u = 0; u < G; ++u) {
            const int row = (i << lgR) + r0 + u;
            float v1[4] = {x1[u].x, x1[u].y, x1[u].z, x1[u].w};
            float v2[4] = {x2[u].x, x2[u].y, x2[u].z, x2[u].w};
            float y1[4], y2[4];
            BB_UNROLL
            for (int j = 0; j < 4; ++j) {
              y1[j] = v1[j], y2[j] = v2[j];
              if (n + j < A)
                y1[j] = v1[j] * cs[j] - v2[j] * sn[j], y2[j] = v1[j] * sn[j] + v2[j] * cs[j];
            }
            st_split4(out, row * out.ld + n, make_float4(y1[0], y1[1], y1[2], y1[3]));
            st_split4(out, row * out.ld + half + n, make_float4(y2[0], y2[1], y2[2], y2[3]));
          }
        }
      }
    };
    using One = std::integral_constant<int, 1>;
    if (!quad)
      rows(std::false_type{}, One{});
    else if (R >= RG)
      rows(std::true_type{}, std::integral_constant<int, RG>{});
    else if (R == 2)
      rows(std::true_type{}, std::integral_constant<int, 2>{});
    else
      rows(std::true_type{}, One{});
  }
}

// The shared-memory layout the planes bodies index with: in the specialised kernels (ArgsCT) a
// compile-time constant, so that every region's offset and row stride folds into the
// instructions (the kernel parameter a.ply, the generic kernels' source, cost a constant-bank
// load or a register and a multiply per use); the same values (planes_layout of the same shape,
// as the host's plan), hence the same addresses and bits.
template <class AT>
struct LayoutOf {
  static BB_DEV const PlanesLayout& get(const AT& a) { return a.ply; }
};

// K1 on planes: U_c = sum over the chunk's rows of (E_i qh_i^r) (x) dPhiO_i^r (as increment_body),
// one CTA of kIncPlanesThreads per (b, h, c), c >= 1; E qh and dPhiO split into planes once, U in
// 16 x 16 mma tiles (E qh read transposed: the contraction runs along its rows).
// smem: PlanesLayout::inc_bytes.
template <class AT>
BB_DEV void increment_planes_body(const AT& a, unsigned char* smem) {
  constexpr int NT = kIncPlanesThreads;
  const int64_t item = bb_bid();  // = bh * nch + c
  const int it = static_cast<int>(item), c = it % a.nch;  // 32-bit: B H nch < 2^31
  if (c == 0) return;  // U_0 would only feed the state entering chunk 0, which nothing reads
  const auto& Ly = LayoutOf<AT>::get(a);
  const int tid = bb_tid(), warp = tid >> 5;
  const int bh = it / a.nch;
  const int b = bh / a.H, h = bh % a.H, grp = h / a.HG;
  const int N = a.N, P = a.P, R = a.R, C = a.C, T = C * R, lgR = a.lgR, lgP = a.lgP;
  const int s0 = c * C, L = bb_min(C, a.S - s0), TL = L * R;
  const int ldN = Ly.ldN, ldP = Ly.ldP;
  const mimo::SplitTile EQ{reinterpret_cast<__nv_bfloat16*>(smem), Ly.plT_N, ldN};
  const mimo::SplitTile Gp{reinterpret_cast<__nv_bfloat16*>(smem + Ly.inc_g), Ly.plT_P, ldP};
  float* s_E = reinterpret_cast<float*>(smem + Ly.inc_E);
  for (int i = tid; i < L; i += NT) s_E[i] = expf(ld(a.da_cs, o3(a.da_cs, b, h, s0 + i)));
  const DoutRows dr = dout_rows(a, b, h);
  const RankWeights wo = thread_rank_weights<NT>(a.mimo_o, h, R, lgP, a.layout == 0);
  const RankWeights wz = thread_rank_weights<NT>(a.mimo_z, h, R, lgP, a.gate != 0);
  // The pair-load choice compile-time (a runtime one predicated both paths and issued all
  // three loads): pair loads by dtype, four rows in flight; the fallback (layouts without pair
  // loads, rare) a row at a time (less code). The same rows, values and arithmetic either way.
  auto g_rows = [&](auto rows_tag, auto ld_pair) {
    pair_rows<decltype(rows_tag)::value, NT>(
        T, lgP,
        [&](int row, int pc) {
          float2 g = make_float2(0.f, 0.f);
          if (row < TL) {
            const int i = row >> lgR, r = row & (R - 1);
            g = ld_pair(dr.base + (s0 + i) * dr.st + r * dr.sr + pc * dr.sp);
            if (a.layout == 0) {
              const float2 mo = wo.at(a.mimo_o, h, r, pc);
              g.x *= mo.x, g.y *= mo.y;
            }
            if (a.gate) {
              const float2 gz = z_gate2(a, b, s0 + i, h, pc, wz.at(a.mimo_z, h, r, pc));
              g.x *= gz.x, g.y *= gz.y;
            }
          }
          return g;
        },
        [&](int row, int pc, float2 g) { st_split_pair(Gp, row * ldP + pc, g); });
  };
  if (a.vec_dout)
    with_dout_dtype(a.dout.dt, [&](auto dtag) {
      using TD = typename decltype(dtag)::type;
      g_rows(std::integral_constant<int, 4>{},
             [&](int64_t o) { return ld2_t<TD>(a.dout, o, dr.sp, true); });
    });
  else  // (one runtime-dtype copy: ld's values are ld2_t's)
    g_rows(std::integral_constant<int, 1>{},
           [&](int64_t o) { return make_float2(ld(a.dout, o), ld(a.dout, o + dr.sp)); });
  bb_sync();  // s_E
  // Two ranks per load group: with four, ptxas spills at K1's 64 registers.
  // q_bias with its dtype dispatched once (K1 has no shared memory to spare for staging it).
  with_dtype(a.q_bias.dt, [&](auto btag) {
    using TB = typename decltype(btag)::type;
    const auto& qb = a.q_bias;
    const int64_t sb = qb.s[2], b0 = int64_t{h} * qb.s[0], hs = a.half * sb;
    const RotSrc<std::decay_t<decltype(a.q)>> src[1] = {{&a.q, a.vec_q, EQ}};
    rotated_pair_rows<NT, 2>(
        a, src,
        [&](int, int r, int n) {
          const int64_t ob = b0 + r * qb.s[1] + n * sb;
          return make_float4(ld_t<TB>(qb, ob), ld_t<TB>(qb, ob + sb), ld_t<TB>(qb, ob + hs),
                             ld_t<TB>(qb, ob + hs + sb));
        },
        b, h, grp, s0, L, s_E);
  });
  bb_sync();
  float* U = a.ws_ds + item * static_cast<int64_t>(N) * P;
  const int lgnP = a.lgtP;  // 16-wide tiles along P
  for (int tile = warp; tile < (N * P) >> 8; tile += NT / 32) {
    const int m0 = (tile >> lgnP) * 16, n0 = (tile & ((1 << lgnP) - 1)) * 16;
    float acc[2][4];
    mimo::zero_acc(acc);
    // INC: incremental fragment addresses (measured faster here: warp_mma_16x16).
    mimo::warp_mma_16x16<true, true, 0, true>(acc, EQ, m0, Gp, n0, 0, T);
    store_tile(acc, m0, n0, U, P);
  }
}

// ------------------------------------------------------------------ specialised shapes

// The planes K1 and K3 specialised to one shape (mimo_bwd_bwd.cu's *_ct kernels; the host-
// emulated tests run them too). The bodies read the shape through `a.N`, `a.lgP`, ... of their
// argument type (a template parameter): ArgsCT is Args with those fields hidden by compile-time
// constants, so index arithmetic, masks and loop bounds fold (static SASS of K3 at N128 P64 R4
// C16: ~15.9K -> ~12.0K instructions, no spills). Same expressions and summation orders as the
// generic kernels: the same bits (CUDA test MimoBwdBwdCuda.SpecializedKernelGivesIdenticalBits,
// emulated test MimoBwdBwdEmulated.PlanesKernelSpecialisedGivesIdenticalBits).
constexpr int ct_lg2(int x) { return x <= 1 ? 0 : 1 + ct_lg2(x / 2); }

template <int N_, int P_, int R_, int C_>
struct ArgsShapeCT : Args {
  static constexpr int N = N_, P = P_, R = R_, C = C_, A = N_ / 4, half = N_ / 2;
  static constexpr int lgN = ct_lg2(N_), lgP = ct_lg2(P_), lgR = ct_lg2(R_), lgC = ct_lg2(C_);
  static constexpr int lgT = ct_lg2(C_ * R_);
  static constexpr int lgtN = ct_lg2(N_ / 16), lgtP = ct_lg2(P_ / 16),
                       lgtT = ct_lg2(C_ * R_ / 16);
};

// CL: also the layouts and dtypes of one caller's operands, every tensor K3 (and so K1, which
// reads a subset) reads or writes contiguous, of at most 2^30 elements, in the dtypes of the
// set; reduce-O dout, the pair / quad loads and stores on (aligned). The sets (CtSet,
// ct_layout_ok):
//   kCtBwdBwd    the benchmark's second pass (bench/bench_mimo_bwd.py's bwd_bwd op): bf16
//                states, qk_dot, dq, dk; no gate.
//   kCtCombined  the combined backward's (mimo_bwd_combined.cu with z, no norm: its bench op):
//                fp32 states and qk_dot (its first pass's), fp32 per-head dq, dk (its
//                workspace), and the Z gate on a bf16 z (pair loads) with fp32 mimo_z.
// The views are CViews (compile-time dtypes, unit last strides, the strides of compile-time
// dims folded, 32-bit offsets) and those flags constants: the dtype branches and 64-bit stride
// products of the runtime views fold away. Same offsets, loads and arithmetic as the runtime
// views: the same bits. (The base Args' views stay filled: helpers that take an Args read
// those, with the same values.)
enum CtSet : int { kCtShape = 0, kCtBwdBwd = 1, kCtCombined = 2 };

// Whether the kCtCombined K3 of state size N does the combined backward's q / k group sums
// (kQkGroup). Not below N64: at N32 (rows of 128 bytes, one bulk copy each) K3 took 0.848 ->
// 0.964 ms and the combined kernels' sum 1.740 -> 1.757 (H100, session 30, one call; N64: 2.097
// -> 2.000, N128: 2.809 -> 2.629); N16's rows are shorter still (not measured).
constexpr bool ct_qk_group(int N) { return N >= 64; }

template <int N_, int P_, int R_, int C_, int CL = kCtShape>
struct ArgsCT : ArgsShapeCT<N_, P_, R_, C_> {};

// rt_dtype.cuh's codes.
constexpr int kCtF16 = 0, kCtBF16 = 1, kCtF32 = 2;

// The contiguous-layout views of one set: DS the dtype of states and qk_dot, DQ that of dq and
// dk, GATE the Z gate (z, mimo_z CViews; without it they stay the base's runtime Views, unread).
template <int N_, int P_, int R_, int C_, int DS, int DQ, int GATE>
struct ArgsLayoutCT : ArgsShapeCT<N_, P_, R_, C_> {
  static constexpr int kBF16 = kCtBF16, kF32 = kCtF32;
  static constexpr int A_ = N_ / 4;
  CView<kBF16, 0, 0, P_, 1> dout, v, dv;                        // [B,S,H,P]
  CView<kBF16, 0, 0, 0, N_, 1> q, k;                            // [B,S,R,G,N]
  CView<kF32, R_ * N_, N_, 1> q_bias, k_bias;                   // [H,R,N]
  CView<kF32, R_ * P_, P_, 1> mimo_v, mimo_o;                   // [H,R,P]
  CView<DS, 0, 0, N_ * P_, P_, 1> states;                       // [B,H,nch,N,P]
  CView<DS, 0, 0, R_ * R_, R_, 1> qk_dot;                       // [B,H,S,R,R]
  CView<kF32, 0, 0, 1> da_cs, da_cs_rev, dt;                    // [B,H,S]
  CView<kBF16, 0, 0, 1> trap;                                   // [B,H,S]
  CView<kF32, 0, 0, C_ * C_, C_, 1> segsum, dssda;              // [B,H,nch,C,C]
  CView<kF32, 0, 0, A_, 1> angles, dangles;                     // [B,S,H,A]
  CView<kF32, 1> d;                                             // [H]
  CView<DQ, 0, 0, N_, 1> dq, dk;                                // [B,S R,H,N]
  CView<kF32, 0, 0, 1> dfactor, dgamma, dda, dda_cs_rev, dda_cs;  // [B,H,S]
  std::conditional_t<GATE != 0, CView<kBF16, 0, 0, P_, 1>, View> z;       // [B,S,H,P]
  std::conditional_t<GATE != 0, CView<kF32, R_ * P_, P_, 1>, View> mimo_z;  // [H,R,P]
  static constexpr int layout = 0, gate = GATE, bf16_z_pairs = GATE;
  // The combined backward's copy sums dq / dk over the q / k groups itself (Args::qk_group):
  // chunk_planes_body's QkGroup schedule and stores (ct_qk_group).
  static constexpr int kQkGroup = GATE && ct_qk_group(N_);
  static constexpr int vec_q = 2, vec_k = 2, vec_v = 1, vec_dout = 1, vec_states = 1,
                       vec_dq = 2, vec_dk = 2;

  // Host: the CViews from the runtime views of a (ct_layout_ok(a, the set) must hold).
  void set(const Args& a) {
    static_cast<Args&>(*this) = a;
    auto cv = [](auto& c, const View& w) {
      c.p = w.p;
      for (int i = 0; i < std::decay_t<decltype(c)>::kRank; ++i)
        c.s.v[i] = static_cast<int>(w.s[i]);
    };
    cv(dout, a.dout), cv(v, a.v), cv(dv, a.dv), cv(q, a.q), cv(k, a.k);
    cv(q_bias, a.q_bias), cv(k_bias, a.k_bias), cv(mimo_v, a.mimo_v), cv(mimo_o, a.mimo_o);
    cv(states, a.states), cv(qk_dot, a.qk_dot), cv(da_cs, a.da_cs), cv(da_cs_rev, a.da_cs_rev);
    cv(dt, a.dt), cv(trap, a.trap), cv(segsum, a.segsum), cv(dssda, a.dssda);
    cv(angles, a.angles), cv(dangles, a.dangles), cv(d, a.d), cv(dq, a.dq), cv(dk, a.dk);
    cv(dfactor, a.dfactor), cv(dgamma, a.dgamma), cv(dda, a.dda);
    cv(dda_cs_rev, a.dda_cs_rev), cv(dda_cs, a.dda_cs);
    if constexpr (GATE != 0)
      cv(z, a.z), cv(mimo_z, a.mimo_z);
    else
      z = a.z, mimo_z = a.mimo_z;
  }
};

template <int N_, int P_, int R_, int C_>
struct ArgsCT<N_, P_, R_, C_, kCtBwdBwd> : ArgsLayoutCT<N_, P_, R_, C_, kCtBF16, kCtBF16, 0> {};
template <int N_, int P_, int R_, int C_>
struct ArgsCT<N_, P_, R_, C_, kCtCombined>
    : ArgsLayoutCT<N_, P_, R_, C_, kCtF32, kCtF32, 1> {};

// SPEC.md section 4's grid (N, P, R, C), rotary_dim_divisor 4 (A = N / 4): the shapes that have
// specialised planes kernels (mimo_bwd_bwd_ct_{shape,bb,cb}.cu instantiate them from this list).
#define MAMBA3_BB_CT_SHAPES(X) \
  X(16, 64, 4, 8)              \
  X(32, 64, 4, 16)             \
  X(64, 64, 4, 16)             \
  X(128, 64, 4, 16)            \
  X(256, 64, 4, 8)             \
  X(64, 128, 4, 16)            \
  X(128, 32, 4, 16)            \
  X(128, 128, 4, 8)            \
  X(128, 64, 8, 8)             \
  X(128, 64, 2, 32)            \
  X(128, 64, 1, 64)

inline bool ct_layout_ok(const Args& a, CtSet set);

// Which planes K3 runs for a (on the planes path): the generic kernel (kGeneric), the one
// specialised to its shape (kShape: ArgsCT<N, P, R, C>) or to its shape and the contiguous
// layouts of one operand set (kShapeLayout: ArgsCT<N, P, R, C, kCtBwdBwd>, kShapeLayoutCombined:
// ArgsCT<N, P, R, C, kCtCombined>, when ct_layout_ok for that set). MAMBA3_BB_SPECIALIZED=0: the
// generic one; MAMBA3_BB_CT_LAYOUT=0: never a contiguous-layout copy. Host; mimo_bwd_bwd.cu
// launches by it.
enum class K3Kind { kGeneric, kShape, kShapeLayout, kShapeLayoutCombined };
inline K3Kind k3_kind(const Args& a) {
  if (!specialized_allowed_by_env()) return K3Kind::kGeneric;
  bool listed = false;
#define MAMBA3_BB_CT_LISTED(n, p, r, c) \
  listed = listed || (a.N == n && a.P == p && a.R == r && a.C == c && a.A == n / 4);
  MAMBA3_BB_CT_SHAPES(MAMBA3_BB_CT_LISTED)
#undef MAMBA3_BB_CT_LISTED
  if (!listed) return K3Kind::kGeneric;
  if (!ct_layout_allowed_by_env()) return K3Kind::kShape;
  if (ct_layout_ok(a, kCtBwdBwd)) return K3Kind::kShapeLayout;
  if (ct_layout_ok(a, kCtCombined)) return K3Kind::kShapeLayoutCombined;
  return K3Kind::kShape;
}

// Whether a (of a plan on the planes kernels) meets ArgsCT<.., set>'s conditions: the set's
// dtypes, contiguous tensors (strides those of the shapes above) of at most 2^30 elements (its
// 32-bit offsets: the headroom covers the offsets formed a chunk's rows past the end, never
// dereferenced), reduce-O dout, the gate exactly when the set has it, the pair / quad flags it
// fixes. Host; the shape's own match (N, P, R, C, A) is the caller's.
inline bool ct_layout_ok(const Args& a, CtSet set) {
  if (set != kCtBwdBwd && set != kCtCombined) return false;
  const bool gate = set == kCtCombined;
  if (a.layout != 0 || (a.gate != 0) != gate || a.vec_q != 2 || a.vec_k != 2 || a.vec_v < 1 ||
      a.vec_dout < 1 || a.vec_states < 1 || a.vec_dq != 2 || a.vec_dk != 2)
    return false;
  if (gate && !a.bf16_z_pairs) return false;
  const int64_t B = a.B, S = a.S, H = a.H, G = a.G, N = a.N, P = a.P, R = a.R, C = a.C,
                A = a.A, nch = a.nch;
  constexpr auto is = &rt_contiguous_of<View>;  // (rt_dtype.cuh)
  const int F32 = kCtF32, BF16 = kCtBF16;
  const int DS = gate ? F32 : BF16, DQ = gate ? F32 : BF16;  // (as ArgsCT<.., set>)
  return is(a.dout, BF16, {B, S, H, P}) && is(a.v, BF16, {B, S, H, P}) &&
         is(a.dv, BF16, {B, S, H, P}) && is(a.q, BF16, {B, S, R, G, N}) &&
         is(a.k, BF16, {B, S, R, G, N}) && is(a.q_bias, F32, {H, R, N}) &&
         is(a.k_bias, F32, {H, R, N}) && is(a.mimo_v, F32, {H, R, P}) &&
         is(a.mimo_o, F32, {H, R, P}) && is(a.states, DS, {B, H, nch, N, P}) &&
         is(a.qk_dot, DS, {B, H, S, R, R}) && is(a.da_cs, F32, {B, H, S}) &&
         is(a.da_cs_rev, F32, {B, H, S}) && is(a.dt, F32, {B, H, S}) &&
         is(a.trap, BF16, {B, H, S}) && is(a.segsum, F32, {B, H, nch, C, C}) &&
         is(a.dssda, F32, {B, H, nch, C, C}) && is(a.angles, F32, {B, S, H, A}) &&
         is(a.dangles, F32, {B, S, H, A}) && (!a.has_d || is(a.d, F32, {H})) &&
         is(a.dq, DQ, {B, S * R, H, N}) && is(a.dk, DQ, {B, S * R, H, N}) &&
         is(a.dfactor, F32, {B, H, S}) && is(a.dgamma, F32, {B, H, S}) &&
         is(a.dda, F32, {B, H, S}) && is(a.dda_cs_rev, F32, {B, H, S}) &&
         is(a.dda_cs, F32, {B, H, S}) &&
         (!gate || (is(a.z, BF16, {B, S, H, P}) && is(a.mimo_z, F32, {H, R, P})));
}
// K3's phase-0 rows loaded a chunk ahead (chunk_planes_body: RawRows): per thread, kx rows of
// the [T][P] x / dPhiO loop (on: every specialised kernel) and, where st, ks rows of the [N][P]
// states loop (their pair_rows mappings); compile-time only in the specialised kernels, the
// generic kernel loads them in phase 0. The states rows only at the shapes where they measured
// faster (H200, session 12: planes K3 N128 P64 R4 C16 1.843 -> 1.79 ms, R2 C32 1.000 -> 0.967);
// at N256 C8 and N128 P128 C8 they spilled (+13%, +20%). The x / dPhiO rows alone (a few per
// thread: 2 to 8) everywhere since session 20 but at N128 R1 C64 (planes K3 +3% there; the
// states rows too, +7%: session 21, PERF.md). The combined backward's copy (kCtCombined: the
// Z gate, fp32 states) takes the x / dPhiO rows with the gate's z rows and its rank's mimo_z
// pair (`gate`), never the fp32 states rows (at N128 R4 C16 and R2 C32 they spilled 100 / 136
// bytes), and only at the C16 shapes with P <= 64 and at N256 C8, where they measured faster
// (H100, session 31, combined K3 against loading them in phase 0: N32 -3.6%, N64 -3.9%, N128 P64
// -2.1%, N128 P32 -0.3%, N256 C8 -2.7%; the other C8 shapes +1.4 to +2.9%, R2 C32 and N64 P128
// spilled 20 / 16 bytes and lost 1.4 / 2.1%).
template <class AT>
struct RawCounts {
  static constexpr bool on = false, st = false, gate = false;
  static constexpr int kx = 1, ks = 1;
};
template <int N, int P, int R, int C, int CL>
struct RawCounts<ArgsCT<N, P, R, C, CL>> {
  static constexpr bool gate = CL == kCtCombined;
  static constexpr bool on =
      gate ? (C == 16 && P <= 64) || (N == 256 && C == 8) : !(R == 1 && C == 64);
  static constexpr bool st =
      !gate && N == 128 && P == 64 && ((R == 4 && C == 16) || (R == 2 && C == 32));
  static constexpr int kx = (C * R * (P / 2) + kPlanesThreads - 1) / kPlanesThreads;
  static constexpr int ks = st ? (N * (P / 2) + kPlanesThreads - 1) / kPlanesThreads : 1;
};

// K3's dqh / dkh tiles owned in pairs of the same columns (chunk_planes_body: acc_tile), so
// that each pair's products load B once (mimo::warp_mma_16x16_pair): where the tiles are
// exactly two per warp (nT nN = 32) and there are two row blocks or more to pair (first and
// last, second and next-to-last: the same balance of intra-chunk k steps as tiles w and
// 2 W - 1 - w). Specialised kernels only; the generic kernel keeps the single-tile products.
template <class AT>
struct PairTiles {
  static constexpr bool on = false;
};
template <int N, int P, int R, int C, int CL>
struct PairTiles<ArgsCT<N, P, R, C, CL>> {
  static constexpr int nT = C * R / 16, nN = N / 16;
  static constexpr bool on = nT >= 2 && nT * nN == 2 * kPlanesWarps;
};

// K3's phase 1 in pairs of tiles of one column block (rows a and a + nT / 2 of KQ or XG), so that
// each pair loads B (qh or dPhiO) once per k step (mimo::warp_mma_16x16_pair: 6 ldmatrix per 12
// mma, against 8): where there are at least as many pairs as warps (T >= 64), the KQ pairs on the
// first warps and the XG pairs on the rest (at T = 64 each scheduler gets two of each, the same
// mma per scheduler as the single tiles). Per tile the same fragments and mma order: the same
// bits. Specialised kernels only, as PairTiles. Measured (H100, session 27, against single
// tiles, two calls): K3 -1.0 to -2.3% at each of the eight T = 64 grid shapes.
template <class AT>
struct PairKQ {
  static constexpr bool on = false;
};
template <int N, int P, int R, int C, int CL>
struct PairKQ<ArgsCT<N, P, R, C, CL>> {
  static constexpr int nT = C * R / 16;
  static constexpr bool on = nT * nT >= kPlanesWarps;
};

// K3's dx tiles in pairs of one column block (rows a and nT - 1 - a: the same balance of M3's k
// steps as PairTiles), B (dS, then dPhiO) loaded once per k step for both: where there are at
// least two tiles per warp (T P >= 8192 at T >= 64: N64 P128 R4 C16 in the grid). Same fragments
// and mma order per tile: the same bits. Specialised kernels only, not with PairTiles (its dqh /
// dkh accumulators are live here: the pairs spilled 4-80 bytes at four N128 shapes). Measured
// (H100, session 27, on top of PairKQ): K3 -0.9% at N64 P128 (the same code at other shapes
// differed by up to 0.6% between libraries in that call); with one pair per two warps (T P =
// 4096: half of the warps idle, a quarter fewer ldmatrix) -0.3% at N64 P64 and +1.3% at N32.
template <class AT>
struct PairDx {
  static constexpr bool on = false;
};
template <int N, int P, int R, int C, int CL>
struct PairDx<ArgsCT<N, P, R, C, CL>> {
  static constexpr int nT = C * R / 16, nP = P / 16;
  static constexpr bool on =
      nT >= 4 && nT * nP >= 2 * kPlanesWarps && !PairTiles<ArgsCT<N, P, R, C, CL>>::on;
};

// K3's products with incremental fragment addresses (warp_mma_16x16's INC) where that measured
// faster (H200, session 14: planes K3 at N256 P64 R4 C8 -2.8%; at N128 P64 R4 C16 +1.2%, at the
// other grid shapes within +-1%). The same bits either way.
template <class AT>
struct IncAddr {
  static constexpr bool on = false;
};
template <int N, int P, int R, int C, int CL>
struct IncAddr<ArgsCT<N, P, R, C, CL>> {
  static constexpr bool on = N == 256 && P == 64 && R == 4 && C == 8;
};

// stage_chunk's loops with compile-time per-thread counts (specialised kernels): their raw
// loads all issued first, held in registers, then converted and stored. Why: each loop consumed
// its loads before the next loop issued its own (biases, per-step scalars, segsum, qk_dot,
// angles: four or five L2 round trips in series); session 19's profiles put stage_chunk at 11%
// and 15% of K3's warp time at N256 P64 R4 C8 and N128 P64 R2 C32, half of it long scoreboard.
// kb, kw, kq, ka: a thread's elements of the bias, segsum, qk_dot and angle loops (the scalars'
// loop has one step per thread: C + 1 <= kPlanesThreads). Same loads, values and stores.
template <class AT>
struct StageCounts {
  static constexpr bool on = false;
  static constexpr int kb = 1, kw = 1, kq = 1, ka = 1;
};
template <int N, int P, int R, int C, int CL>
struct StageCounts<ArgsCT<N, P, R, C, CL>> {
  static constexpr int NT = kPlanesThreads;
  static constexpr bool on = true;
  static constexpr int kb = (R * N + NT - 1) / NT, kw = (C * C + NT - 1) / NT,
                       kq = (C * R * R + NT - 1) / NT, ka = (C * (N / 4) + NT - 1) / NT;
  static_assert(C + 1 <= NT, "the scalars' loop: one step per thread");
};

// K3's states rows (phase 0, without RawRows) in flight per thread: all of a thread's rows
// where they are 16 (N256 P64, N128 P128: one memory latency, not two), else eight.
template <class AT>
struct StatesInFlight {
  static constexpr int u = 8;
};
template <int N, int P, int R, int C, int CL>
struct StatesInFlight<ArgsCT<N, P, R, C, CL>> {
  static constexpr int u = N * (P / 2) / kPlanesThreads == 16 ? 16 : 8;
};

// K3's dS rows (phase 2, dkh: the dS planes from the workspace) in flight per thread. The loop
// starts right after a barrier, so its L2 round trips in series are waited out by every warp:
// four rows per trip made that four trips at N256 P64 and N128 P128 (16 rows per thread), two
// at N128 P64 and N64 P128 (8). All of a thread's rows where that does not spill (ptxas: N256
// C8, N128 P128 C8, R1 C64 and N64 P128 0 bytes in the bwd_bwd and combined copies; N128 P64
// R4 C16, R2 C32 and R8 C8 spilled 20-36 bytes with eight in session 28, so they keep four).
// Same loads, values and order: the same bits. Measured (H100, session 29, K3 bwd_bwd /
// combined): N128 P128 C8 -2.1 / -2.6%, N256 C8 -0.7 / -1.0%, N64 P128 -0.4 / -0.7%, R1 C64
// -0.3 / -0.2%.
template <class AT>
struct DsInFlight {
  static constexpr int u = 4;
};
template <int N, int P, int R, int C, int CL>
struct DsInFlight<ArgsCT<N, P, R, C, CL>> {
  static constexpr int rows = N * (P / 2) / kPlanesThreads;
  static constexpr bool all = (N == 256 && P == 64 && C == 8) || (N == 128 && P == 128 && C == 8) ||
                              (N == 128 && P == 64 && R == 1 && C == 64) || (N == 64 && P == 128);
  static constexpr int u = all && rows > 4 ? rows : 4;
};

// K3's DMIMO_V partial with its v loads in batches of u in whole chunks (specialised kernels,
// where C is a compile-time constant; 0: the predicated batches of eight only). R P threads
// run it, each a chain of C steps of one v element: the rolled loop (four steps per trip)
// waited out C / 4 L2 round trips in series while the other warps waited at the chunk's last
// barrier (R1 C64: 16, on two warps).
// Measured (H100, session 28): K3 -11.4% / -14.1% at R1 C64 (bwd_bwd / combined), -4.0 /
// -5.4% at R2 C32, -0.5 to -3.3% at the C16 shapes, 0 to -2.2% at C8.
template <class AT>
struct DmvBatch {
  static constexpr int u = 0;
};
template <int N, int P, int R, int C, int CL>
struct DmvBatch<ArgsCT<N, P, R, C, CL>> {
  static constexpr int u = C < 16 ? C : 16;
};

// K3's DQ / DK / DANGLES tasks (phase 3) with the next task's q / k pairs loaded a task ahead
// (QkPre): where a thread has several tasks per chunk (tasks > 0: C (N / 4) a multiple of
// 2 kPlanesThreads, i.e. N128 R2 C32 and R1 C64 in the grid), R <= 2 (the pair path, KR 4 u32
// registers per rank) and the q / k layouts have pair loads at compile time (the contiguous
// sets). Each task's loads waited on one L2 round trip in series with the task before.
// Measured (H100, session 28, on top of DmvBatch): K3 -1.1% / -0.5% at R2 C32 (bwd_bwd /
// combined), +0.3% / 0.0% at R1 C64 (presumably hidden there by the other warps already).
template <int KR>
struct QkPre {
  uint32_t v[KR][4];  // per rank: q (n, n + 1), q (half + n, ...), k (n, ...), k (half + n, ...)
};
// p->v[r][j] (an overload, not p->v: nvcc instantiates the discarded if-constexpr branch of the
// nested generic lambda that reads it, with p a nullptr_t or another rank count's QkPre).
template <int KR>
BB_DEV uint32_t qk_pre(const QkPre<KR>* p, int r, int j) {
  return p->v[r][j];
}
template <int KR, class Other>
BB_DEV uint32_t qk_pre(Other, int, int) {
  return 0;
}
template <class AT>
struct Pf3 {
  static constexpr int tasks = 0;
};
template <int N, int P, int R, int C, int CL>
struct Pf3<ArgsCT<N, P, R, C, CL>> {
  static constexpr int per = C * (N / 4);
  static constexpr int tasks =
      CL != kCtShape && R <= 2 && per % kPlanesThreads == 0 && per >= 2 * kPlanesThreads
          ? per / kPlanesThreads
          : 0;
};

// LayoutOf of the specialised kernels (the primary: at increment_planes_body).
template <int N, int P, int R, int C, int CL>
struct LayoutOf<ArgsCT<N, P, R, C, CL>> {
  static constexpr PlanesLayout layout() { return planes_layout(N, P, R, C, N / 4); }
  static BB_DEV PlanesLayout get(const ArgsCT<N, P, R, C, CL>&) {
    constexpr PlanesLayout L = layout();
    return L;
  }
};

// Whether K3 may read the workspace's (sin, cos) table (Args::ws_cs: where its layout has no
// room for the chunk's own, PlanesLayout::cs < 0): known at compile time in the specialised
// kernels, so that those with a table do not compile that path (its pointer, live across the
// DQ / DK loop, added 8 bytes of spills at N128 P64 R4 C16).
template <class AT>
struct GlobalAngleTable {
  static constexpr bool on = true;
};
template <int N, int P, int R, int C, int CL>
struct GlobalAngleTable<ArgsCT<N, P, R, C, CL>> {
  static constexpr bool on = LayoutOf<ArgsCT<N, P, R, C, CL>>::layout().cs < 0;
};

// (x, dPhiO) pair of a [T][P] row: x = v mimo_v, g = dPhiO.
struct XGPair {
  float2 x, g;
};

// The warp tasks of the planes K3's coefficient builds (M1, M2, M3: [T][T], T = 16 nT, nT in
// {1, 2, 4}: make_plan). Each product reads its coefficient matrix only on one side of the
// block diagonal: M1 (dqh, k up to dqh_ke = m0 + 16) the 16 x 16 blocks (a, b) with b <= a, M2
// and M3 (dkh and dx from dkh_kb = m0) those with b >= a. So the builds form only those:
// nT (nT + 1) / 2 blocks of nT^2 (10 of 16 at T = 64: 37.5% fewer tasks, at most 3 per warp
// instead of 4; 3 of 4 at T = 32), four warp tasks per block, the blocks listed 4 bits each
// (a | b << 2) in one 64-bit constant. The unbuilt blocks keep the previous matrix's values,
// which no product reads: the same operands, the same bits.
constexpr uint64_t coef_blocks_pack(int nT, bool lower) {
  uint64_t t = 0;
  int k = 0;
  for (int a = 0; a < nT; ++a)
    for (int b = 0; b <= a; ++b, ++k)
      t |= static_cast<uint64_t>(lower ? a | b << 2 : b | a << 2) << (4 * k);
  return t;
}
struct CoefBlocks {
  static constexpr uint64_t kLower4 = coef_blocks_pack(4, true);
  static constexpr uint64_t kUpper4 = coef_blocks_pack(4, false);
  static constexpr uint64_t kLower2 = coef_blocks_pack(2, true);
  static constexpr uint64_t kUpper2 = coef_blocks_pack(2, false);
  static constexpr uint64_t kOne = coef_blocks_pack(1, true);
  uint64_t list;
  int tasks;  // warp tasks: 4 per block
  BB_DEV CoefBlocks(int nT, bool lower)
      : list(nT == 4 ? (lower ? kLower4 : kUpper4) : nT == 2 ? (lower ? kLower2 : kUpper2) : kOne),
        tasks(2 * nT * (nT + 1)) {}
  BB_DEV int entry(int wt) const { return static_cast<int>(list >> (4 * (wt >> 2))) & 15; }
  // First row / column of warp task wt's block.
  BB_DEV int a16(int wt) const { return (entry(wt) & 3) * 16; }
  BB_DEV int b16(int wt) const { return (entry(wt) >> 2) * 16; }
  // M2 / M3 (row-major reads of XG / KQ): lane l of warp task wt takes column pair l & 7 of the
  // block and row a16 + 2 (l >> 3) (+ 1, + 8, + 9 for wt & 3 = 1, 2, 3). Rows 2 apart are
  // 2 (T + kPlanesPad) floats of XG / KQ (16 banks: a half-warp's float2 loads conflict-free)
  // and T + kPlanesPad words of mc (the four rows' 8-word pair stores at 8, 16, 24 banks
  // apart: conflict-free), as the 32 pairs of one row per warp were.
  BB_DEV int row_rm(int wt, int l) const {
    return a16(wt) + (wt & 1) + 8 * ((wt >> 1) & 1) + 2 * (l >> 3);
  }
};

// smem: PlanesLayout::bytes of dynamic shared memory (16-byte aligned); kPlanesThreads threads.
// The first thread of K3's QkGroup bulk copies (2 C R threads from it issue and wait for them):
// from warp 4 on where the CTA has the threads, so that warps 0-3 (the stage_chunk loads) and
// the DMIMO_V partial's warps (from the last thread down) do not also issue them, one lane at
// a time. 0 without QkGroup (unused).
template <class AT, int NT>
constexpr int qk_bulk_t0() {
  if constexpr (AT::kQkGroup != 0)
    return NT >= 2 * AT::C * AT::R + 128 ? 128 : 0;
  else
    return 0;
}

template <class AT>
BB_DEV void chunk_planes_body(const AT& a, unsigned char* smem) {
  using mimo::SplitTile;
  using mimo::warp_mma_16x16;
  constexpr bool kInc = IncAddr<AT>::on;
  constexpr bool kGlobTab = GlobalAngleTable<AT>::on;
  constexpr int NT = kPlanesThreads;
  const auto& Ly = LayoutOf<AT>::get(a);
  const int tid = bb_tid(), warp = tid >> 5, lane = tid & 31;
  const int N = a.N, P = a.P, R = a.R, C = a.C, A = a.A, half = a.half, T = C * R;
  const int lgN = a.lgN, lgP = a.lgP, lgR = a.lgR, lgC = a.lgC, lgT = a.lgT;
  const int ldN = Ly.ldN, ldP = Ly.ldP, ldT = Ly.ldT;
  const int nN = N / 16, nT = T / 16;  // 16-wide tiles along N, T
  const int lgnN = a.lgtN, lgnP = a.lgtP, lgnT = a.lgtT;
  auto bfp = [&](int off) { return reinterpret_cast<__nv_bfloat16*>(smem + off); };
  auto flp = [&](int off) { return reinterpret_cast<float*>(smem + off); };
  const SplitTile Qh{bfp(Ly.qh), Ly.plT_N, ldN}, Kh{bfp(Ly.kh), Ly.plT_N, ldN};
  const SplitTile X{bfp(Ly.x), Ly.plT_P, ldP}, Gp{bfp(Ly.g), Ly.plT_P, ldP};
  const SplitTile Sp{bfp(Ly.st), Ly.plN_P, ldP}, Mc{bfp(Ly.mc), Ly.plT_T, ldT};
  float* KQ = flp(Ly.kq);  // [T][ldk] kh_a . qh_b
  float* XG = flp(Ly.xg);  // [T][ldk] x_a . dPhiO_b
  // Their row stride (floats), padded: phase 1's tile stores conflict-free (4-way at T).
  const int ldk = T + kPlanesPad;
  float* dqh = flp(Ly.qh);  // phase 3: [T][ldq]
  float* dkh = flp(Ly.kh);  // phase 3: [T][ldq] dL/dkh / ts
  float* dx = flp(Ly.x);    // from the dx products on: [T][ldx]
  // Their row strides (floats): Ly.ldN, Ly.ldP (a plane pair's bytes per row), as compile-time
  // constants in the specialised kernels; padded so that store_tile is conflict-free.
  const int ldq = N + kPlanesPad, ldx = P + kPlanesPad;
  float *s_dacs = flp(Ly.dacs), *s_dt = flp(Ly.dt), *s_lam = flp(Ly.lam), *s_E = flp(Ly.E),
        *s_F = flp(Ly.F), *s_ts = flp(Ly.ts), *s_gam = flp(Ly.gam), *s_qk = flp(Ly.qk),
        *red = flp(Ly.red), *s_W = flp(Ly.W);
  // exp(segsum)'s element e = i C + j of [C][C] (j < C) at s_W[w_idx(e)]: rows of C + 1 floats.
  // Why: the coefficient builds read W down a column across a warp's lanes (M2, M3; M1 at
  // R = 1, 2), 16- to 32-way bank conflicts with rows of C floats at C >= 32.
  auto w_idx = [&](int e) { return e + (e >> lgC); };
  // [T][nN][3]: per row and 16-column tile, qh . SG (DDA_CS), kh . SX (DDA_CS_REV),
  // kh . dkh (DFACTOR).
  float* part = flp(Ly.part);
  constexpr int kPartCs = 0, kPartRev = 1, kPartFac = 2;
  // q_bias, k_bias [R][N] fp32 of the chunk's head; the (sin, cos) of the chunk's angles [C][A]
  // where the layout has room (else nullptr: phase 3 calls sincos again). Formed where used,
  // from the layout (kept live across phase 2 they spilled; mb_opaque keeps nvcc from hoisting
  // the specialised kernels' constant offsets into registers for that long).
  auto qbias = [&] { return flp(mimo::mb_opaque(Ly.qb)); };
  auto kbias = [&] { return flp(mimo::mb_opaque(Ly.qb)) + (R << lgN); };
  auto cs_tab = [&] {
    const int o = mimo::mb_opaque(Ly.cs);
    return o >= 0 ? reinterpret_cast<float2*>(smem + o) : nullptr;
  };
  // Without that table: the workspace's (sin, cos) of step s0 of (b, h) on (Args::ws_cs).
  auto cs_glob = [&](int b, int h, int s0) -> const float2* {
    return kGlobTab && a.ws_cs != nullptr ? a.ws_cs + (int64_t{b * a.H + h} * a.S + s0) * A
                                          : nullptr;
  };

  // The per-chunk inputs of shared memory that only the chunk's item decides: q_bias, k_bias as
  // fp32 (read per element of qh, kh and of phase 3), the per-step scalars, the raw segsum and
  // qk_dot, and the (sin, cos) table of the angles (where it fits). Staged for chunk `item` by
  // the previous chunk's last phase (after the DQ / DK loop, their last reader; the barrier that
  // ends the chunk makes them visible), or for a CTA's first chunk in a pass of its own. Why:
  // loaded at the top of phase 0 they needed a barrier of their own before the q / k rotation,
  // where all 16 warps waited on their global-memory latency (2.8% of K3's stall samples), and
  // the sincos of phase 0 ran on the rotation tasks (half of the warps at N128 C16).
  // (Raw loads first, conversions after: one memory latency per loop, not one per tensor.)
  // Same loads and values as when they were loaded in phase 0.
  using SC = StageCounts<AT>;
  // stage_chunk's raw loads (SC::on): issued by stage_load, converted and stored by stage_store.
  struct StageRaw {
    uint32_t qb[SC::kb], kb[SC::kb];  // q_bias, k_bias
    uint32_t da, F, dt, tr;           // the thread's step's da_cs, da_cs_rev, dt, trap
    uint32_t w[SC::kw], qk[SC::kq], an[SC::ka];  // segsum, qk_dot, angles
  };
  // The item's indices: (b, h, c, s0, L, Lx, partial).
  struct StageIdx {
    int b, h, c, s0, L, Lx;
    bool partial;
  };
  auto stage_idx = [&](int64_t item) {
    StageIdx x;
    const int it = static_cast<int>(item), bh = a.div_nch.div(it);
    x.c = it - bh * a.nch;
    x.b = a.div_H.div(bh), x.h = bh - x.b * a.H;
    x.s0 = x.c * C, x.L = bb_min(C, a.S - x.s0), x.Lx = bb_min(x.L + 1, a.S - x.s0);
    x.partial = x.L < C;
    return x;
  };
  auto stage_load = [&](int64_t item, StageRaw& u) {
    const StageIdx x = stage_idx(item);
    BB_UNROLL
    for (int k = 0; k < SC::kb; ++k) {
      const int e = tid + k * NT;
      if (e < (R << lgN)) {
        const int r = e >> lgN, n = e & (N - 1);
        u.qb[k] = rt_ld_raw(a.q_bias.p, o3(a.q_bias, x.h, r, n), a.q_bias.dt);
        u.kb[k] = rt_ld_raw(a.k_bias.p, o3(a.k_bias, x.h, r, n), a.k_bias.dt);
      }
    }
    {
      const int i = tid, t = x.s0 + i;
      const bool in = i < x.L, rev = in && !x.partial;
      if (i < x.Lx) {
        u.da = in ? rt_ld_raw(a.da_cs.p, o3(a.da_cs, x.b, x.h, t), a.da_cs.dt) : 0u;
        u.F = rev ? rt_ld_raw(a.da_cs_rev.p, o3(a.da_cs_rev, x.b, x.h, t), a.da_cs_rev.dt) : 0u;
        u.dt = rt_ld_raw(a.dt.p, o3(a.dt, x.b, x.h, t), a.dt.dt);
        u.tr = rt_ld_raw(a.trap.p, o3(a.trap, x.b, x.h, t), a.trap.dt);
      }
    }
    {
      const int64_t w0 = o3(a.segsum, x.b, x.h, x.c);
      BB_UNROLL
      for (int k = 0; k < SC::kw; ++k) {
        const int e = tid + k * NT, i = e >> lgC, j = e & (C - 1);
        // Zero bits outside (the value 0.f of the loop below).
        if (e < (C << lgC))
          u.w[k] = !x.partial && j < i && i < x.L
                       ? rt_ld_raw(a.segsum.p, w0 + i * a.segsum.s[3] + j * a.segsum.s[4],
                                   a.segsum.dt)
                       : 0u;
      }
    }
    {
      const int64_t qk0 = o3(a.qk_dot, x.b, x.h, x.s0);
      BB_UNROLL
      for (int k = 0; k < SC::kq; ++k) {
        const int e = tid + k * NT;
        const int i = e >> (2 * lgR), r = (e >> lgR) & (R - 1), r2 = e & (R - 1);
        if (e < (x.L << (2 * lgR)))
          u.qk[k] = rt_ld_raw(a.qk_dot.p,
                              qk0 + i * a.qk_dot.s[2] + r * a.qk_dot.s[3] + r2 * a.qk_dot.s[4],
                              a.qk_dot.dt);
      }
    }
    if (cs_tab()) {
      const int64_t ao = int64_t{x.b} * a.angles.s[0] + int64_t{x.h} * a.angles.s[2];
      BB_UNROLL
      for (int k = 0; k < SC::ka; ++k) {
        const int e = tid + k * NT, i = e / A, j = e - i * A;
        if (e < x.L * A)
          u.an[k] = rt_ld_raw(a.angles.p, ao + (x.s0 + i) * a.angles.s[1] + j * a.angles.s[3],
                              a.angles.dt);
      }
    }
  };
  auto stage_store = [&](int64_t item, const StageRaw& u) {
    const StageIdx x = stage_idx(item);
    BB_UNROLL
    for (int k = 0; k < SC::kb; ++k) {
      const int e = tid + k * NT;
      if (e < (R << lgN)) {
        qbias()[e] = rt_raw_f(u.qb[k], a.q_bias.dt);
        kbias()[e] = rt_raw_f(u.kb[k], a.k_bias.dt);
      }
    }
    {
      const int i = tid;
      const bool in = i < x.L, rev = in && !x.partial;
      if (i < x.Lx) {
        if (in) s_dacs[i] = rt_raw_f(u.da, a.da_cs.dt);
        if (rev) s_F[i] = rt_raw_f(u.F, a.da_cs_rev.dt);  // raw here
        s_dt[i] = rt_raw_f(u.dt, a.dt.dt);
        s_lam[i] = sigmoid_f(rt_raw_f(u.tr, a.trap.dt));
      }
    }
    BB_UNROLL
    for (int k = 0; k < SC::kw; ++k) {
      const int e = tid + k * NT;
      if (e < (C << lgC)) s_W[w_idx(e)] = rt_raw_f(u.w[k], a.segsum.dt);
    }
    BB_UNROLL
    for (int k = 0; k < SC::kq; ++k) {
      const int e = tid + k * NT;
      if (e < (x.L << (2 * lgR))) s_qk[e] = rt_raw_f(u.qk[k], a.qk_dot.dt);
    }
    if (float2* tab = cs_tab()) {
      BB_UNROLL
      for (int k = 0; k < SC::ka; ++k) {
        const int e = tid + k * NT;
        if (e < x.L * A) {
          float sv, cv;
          bb_sincos(rt_raw_f(u.an[k], a.angles.dt), &sv, &cv);
          tab[e] = make_float2(sv, cv);
        }
      }
    }
  };
  auto stage_chunk_loops = [&](int64_t item) {
    const int it = static_cast<int>(item), bh = a.div_nch.div(it), c = it - bh * a.nch;
    const int b = a.div_H.div(bh), h = bh - b * a.H;
    const int s0 = c * C, L = bb_min(C, a.S - s0), Lx = bb_min(L + 1, a.S - s0);
    const bool partial = L < C;
    for (int e = tid; e < (R << lgN); e += NT) {
      const int r = e >> lgN, n = e & (N - 1);
      const uint32_t uq = rt_ld_raw(a.q_bias.p, o3(a.q_bias, h, r, n), a.q_bias.dt);
      const uint32_t uk = rt_ld_raw(a.k_bias.p, o3(a.k_bias, h, r, n), a.k_bias.dt);
      qbias()[e] = rt_raw_f(uq, a.q_bias.dt);
      kbias()[e] = rt_raw_f(uk, a.k_bias.dt);
    }
    for (int i = tid; i < Lx; i += NT) {
      const int t = s0 + i;
      const bool in = i < L, rev = in && !partial;
      const uint32_t uda = in ? rt_ld_raw(a.da_cs.p, o3(a.da_cs, b, h, t), a.da_cs.dt) : 0u;
      const uint32_t uF =
          rev ? rt_ld_raw(a.da_cs_rev.p, o3(a.da_cs_rev, b, h, t), a.da_cs_rev.dt) : 0u;
      const uint32_t udt = rt_ld_raw(a.dt.p, o3(a.dt, b, h, t), a.dt.dt);
      const uint32_t utr = rt_ld_raw(a.trap.p, o3(a.trap, b, h, t), a.trap.dt);
      if (in) s_dacs[i] = rt_raw_f(uda, a.da_cs.dt);
      if (rev) s_F[i] = rt_raw_f(uF, a.da_cs_rev.dt);  // raw here
      s_dt[i] = rt_raw_f(udt, a.dt.dt);
      s_lam[i] = sigmoid_f(rt_raw_f(utr, a.trap.dt));
    }
    // The chunk's raw segsum [C][C] (why in shared memory: read per coefficient in the three
    // builds of phase 2, each was an exposed global load); exponentiated in phase 0.
    // (Runtime-dtype loads: a few elements per thread, where a loop per dtype would only add
    // code for the instruction cache.)
    {
      const int64_t w0 = o3(a.segsum, b, h, c);
      for (int e = tid; e < (C << lgC); e += NT) {
        const int i = e >> lgC, j = e & (C - 1);
        s_W[w_idx(e)] = !partial && j < i && i < L
                     ? ld(a.segsum, w0 + i * a.segsum.s[3] + j * a.segsum.s[4])
                     : 0.f;
      }
    }
    {
      const int64_t qk0 = o3(a.qk_dot, b, h, s0);
      for (int e = tid; e < (L << (2 * lgR)); e += NT) {
        const int i = e >> (2 * lgR), r = (e >> lgR) & (R - 1), r2 = e & (R - 1);
        s_qk[e] = ld(a.qk_dot, qk0 + i * a.qk_dot.s[2] + r * a.qk_dot.s[3] + r2 * a.qk_dot.s[4]);
      }
    }
    // tab[i A + j] = (sin, cos) of angle j of step i < L: one sincosf per angle (one per thread
    // at N128 C16), read by phase 0's rotation and by phase 3.
    if (float2* tab = cs_tab()) {
      const int64_t ao = int64_t{b} * a.angles.s[0] + int64_t{h} * a.angles.s[2];
      for (int e = tid; e < L * A; e += NT) {
        const int i = e / A, j = e - i * A;
        float sv, cv;
        bb_sincos(ld(a.angles, ao + (s0 + i) * a.angles.s[1] + j * a.angles.s[3]), &sv, &cv);
        tab[e] = make_float2(sv, cv);
      }
    }
  };

  auto stage_chunk = [&](int64_t item) {
    if constexpr (SC::on) {
      StageRaw u;
      stage_load(item, u);
      stage_store(item, u);
    } else {
      stage_chunk_loops(item);
    }
  };

  // Phase 0's x / dPhiO rows (v, dout) and states / dS rows, loaded a chunk ahead into
  // registers (raw bf16 pairs, fp32 dS pairs): issued right after the previous chunk's DQ / DK
  // barrier, consumed at the top of this chunk's phase 0. Why: phase 0 waited on these loads
  // (L2 hits, prefetch_item) in three rounds (x / dPhiO, then the states in groups of eight
  // rows), the largest long-scoreboard stalls of K3 (~7% of its samples at N128, ~9% at N256 C8
  // in ncu); issued a chunk ahead, their latency overlaps the DQ / DK stores, the DMIMO_V
  // partial and stage_chunk. Specialised kernels only (compile-time counts: RawCounts; the
  // states rows only where RawCounts::st) and the benchmark's layout (no gate, bf16 dout and
  // states, pair loads: raw_on) or, in the combined backward's copy (RawCounts::gate), its
  // gated one (the z rows and the rank's mimo_z pair too, as z_gate2 reads them); elsewhere
  // phase 0 loads them itself. The same rows per thread in the same order, the same values
  // (ld2_t's, rank_weights' as rt_ld_raw / rt_raw_f), the same arithmetic: the same bits.
  using RC = RawCounts<AT>;
  struct RawRows {
    uint32_t v[RC::kx], d[RC::kx];  // bf16 pairs of v and dout (rows >= TL: not loaded)
    uint32_t z[RC::gate ? RC::kx : 1];  // bf16 pairs of z (RC::gate)
    uint32_t st[RC::ks];             // bf16 pairs of states[c]
    float2 ds[RC::ks];               // dS_c pairs
    uint32_t mv[2], mo[2], mz[2];    // the thread's rank's mimo_v, mimo_o, mimo_z pair, raw
  };
  const bool raw_on = RC::on && (RC::gate ? a.gate && a.bf16_z_pairs : !a.gate) && a.vec_v &&
                      a.vec_dout && a.dout.dt == 1 &&
                      (!RC::st || (a.vec_states && a.states.dt == 1));
  RawRows raw;
  // The thread's column pair pc and first row r0 of both pair_rows loops; rows step by rs.
  const int raw_pc = (tid & ((1 << (lgP - 1)) - 1)) * 2, raw_r0 = tid >> (lgP - 1);
  const int raw_rs = NT >> (lgP - 1);
  auto load_raw = [&](int64_t item) {
    const int it = static_cast<int>(item), bh = a.div_nch.div(it), c = it - bh * a.nch;
    const int b = a.div_H.div(bh), h = bh - b * a.H;
    const int s0 = c * C, TL = bb_min(C, a.S - s0) * R;
    const int pc = raw_pc, r0 = raw_r0, rs = raw_rs;
    const int r_t = r0 & (R - 1);  // every row of this thread has this rank (RankWeights)
    {
      const int64_t o = int64_t{h} * a.mimo_v.s[0] + r_t * a.mimo_v.s[1] + pc * a.mimo_v.s[2];
      raw.mv[0] = rt_ld_raw(a.mimo_v.p, o, a.mimo_v.dt);
      raw.mv[1] = rt_ld_raw(a.mimo_v.p, o + a.mimo_v.s[2], a.mimo_v.dt);
    }
    if (a.layout == 0) {
      const int64_t o = int64_t{h} * a.mimo_o.s[0] + r_t * a.mimo_o.s[1] + pc * a.mimo_o.s[2];
      raw.mo[0] = rt_ld_raw(a.mimo_o.p, o, a.mimo_o.dt);
      raw.mo[1] = rt_ld_raw(a.mimo_o.p, o + a.mimo_o.s[2], a.mimo_o.dt);
    }
    if constexpr (RC::gate) {
      const int64_t o = int64_t{h} * a.mimo_z.s[0] + r_t * a.mimo_z.s[1] + pc * a.mimo_z.s[2];
      raw.mz[0] = rt_ld_raw(a.mimo_z.p, o, a.mimo_z.dt);
      raw.mz[1] = rt_ld_raw(a.mimo_z.p, o + a.mimo_z.s[2], a.mimo_z.dt);
    }
    const DoutRows dr = dout_rows(a, b, h);
    const unsigned short* pv = reinterpret_cast<const unsigned short*>(a.v.p) +
                               (int64_t{b} * a.v.s[0] + int64_t{h} * a.v.s[2] +
                                int64_t{s0} * a.v.s[1] + pc * a.v.s[3]);
    const unsigned short* pd = reinterpret_cast<const unsigned short*>(a.dout.p) +
                               (dr.base + int64_t{s0} * dr.st + r_t * dr.sr + pc * dr.sp);
    BB_UNROLL
    for (int k = 0; k < RC::kx; ++k) {
      const int row = r0 + k * rs, i = row >> lgR;
      if (row < TL) {
        raw.v[k] = mimo::mb_ldg(reinterpret_cast<const unsigned int*>(pv + i * a.v.s[1]));
        raw.d[k] = mimo::mb_ldg(reinterpret_cast<const unsigned int*>(pd + i * dr.st));
      }
    }
    if constexpr (RC::gate) {
      const unsigned short* pz = reinterpret_cast<const unsigned short*>(a.z.p) +
                                 (int64_t{b} * a.z.s[0] + int64_t{h} * a.z.s[2] +
                                  int64_t{s0} * a.z.s[1] + pc * a.z.s[3]);
      BB_UNROLL
      for (int k = 0; k < RC::kx; ++k) {
        const int row = r0 + k * rs, i = row >> lgR;
        if (row < TL)
          raw.z[k] = mimo::mb_ldg(reinterpret_cast<const unsigned int*>(pz + i * a.z.s[1]));
      }
    }
    if constexpr (RC::st) {
      const unsigned short* ps = reinterpret_cast<const unsigned short*>(a.states.p) +
                                 (o3(a.states, b, h, c) + pc * a.states.s[4]);
      const float* pds = a.ws_ds + item * (static_cast<int64_t>(N) * P) + pc;
      BB_UNROLL
      for (int k = 0; k < RC::ks; ++k) {
        const int n = r0 + k * rs;
        if (n < N) {
          raw.st[k] = mimo::mb_ldg(reinterpret_cast<const unsigned int*>(ps + n * a.states.s[3]));
          raw.ds[k] = *reinterpret_cast<const float2*>(pds + (n << lgP));
        }
      }
    }
  };

  const int64_t total = static_cast<int64_t>(a.B) * a.H * a.nch;
  // The order a CTA takes its items (item = (b H + h) nch + c) in, and the next one after `item`
  // (valid: whether there is one; QkGroup marks the end with -1). Else grid-stride over the
  // items. QkGroup (AT::kQkGroup): grid-stride over the
  // (b, group, chunk) triples, gi = (b G + g) nch + c, each one's heads in ascending order one
  // after the other, so that the CTA sums dq / dk over the group's heads as it goes (the
  // combined backward's cb_qk pass, folded into the DQ / DK stores; same order, same bits).
  // bh = b H + h = (b G + g) HG + hh: (b G + g) = bh / HG.
  constexpr bool QkGroup = AT::kQkGroup != 0;
  // QkGroup's bulk copies are issued (and waited for) by threads kBulkT0 .. kBulkT0 + 2 T - 1.
  constexpr int kBulkT0 = qk_bulk_t0<AT, NT>();
  // (Without QkGroup: the grid-stride expressions as they were, so that those copies' code does
  // not change: a next-item value kept live across phase 3 cost spills there.)
  auto first_item = [&]() -> int64_t {
    if constexpr (QkGroup) {
      const int64_t ngi = static_cast<int64_t>(a.B) * a.G * a.nch;
      if (bb_bid() >= ngi) return -1;
      const int gi = static_cast<int>(bb_bid()), bg = a.div_nch.div(gi), c = gi - bg * a.nch;
      return static_cast<int64_t>(bg) * a.HG * a.nch + c;
    } else {
      return bb_bid();
    }
  };
  auto next_of = [&](int64_t item) -> int64_t {
    if constexpr (QkGroup) {
      const int it = static_cast<int>(item), bh = a.div_nch.div(it), c = it - bh * a.nch;
      const int bg = a.div_HG.div(bh), hh = bh - bg * a.HG;
      if (hh + 1 < a.HG) return item + a.nch;
      const int64_t gi = static_cast<int64_t>(bg) * a.nch + c + bb_nblocks();
      if (gi >= static_cast<int64_t>(a.B) * a.G * a.nch) return -1;
      const int g2 = static_cast<int>(gi), bg2 = a.div_nch.div(g2), c2 = g2 - bg2 * a.nch;
      return static_cast<int64_t>(bg2) * a.HG * a.nch + c2;
    } else {
      return item + bb_nblocks();
    }
  };
  auto valid = [&](int64_t item) { return QkGroup ? item >= 0 : item < total; };
  if (valid(first_item())) {
    stage_chunk(first_item());
    if (raw_on) load_raw(first_item());
  }
  bb_sync();
  for (int64_t item = first_item(); valid(item); item = next_of(item)) {
    // 32-bit (B H nch < 2^31: make_plan) divisions by multiply-high (Args::div_*).
    const int it = static_cast<int>(item), bh = a.div_nch.div(it), c = it - bh * a.nch;
    const int b = a.div_H.div(bh), h = bh - b * a.H, grp = a.div_HG.div(h);
    const int s0 = c * C, L = bb_min(C, a.S - s0), Lx = bb_min(L + 1, a.S - s0), TL = L * R;
    const bool partial = L < C;
    const float Dh = a.has_d ? ld(a.d, o1(a.d, h)) : 0.f;
    const int64_t NP = static_cast<int64_t>(N) * P;
    const float* dS = a.ws_ds + item * NP;
    // The 64-bit base offsets below are formed in the loop (or block) that uses them, not here:
    // kept live across phase 2 they cost spills at its 128 registers.
    // exp(segsum[c, i, j]), j < i < L; a partial last chunk from da_cs alone (tail contract).
    // (w_idx(i C + j) for j < C, written with i: the builds have it at hand.)
    auto Wf = [&](int i, int j) { return s_W[(i << lgC) + i + j]; };  // exp(segsum[c, i, j])

    // ---- phase 0: planes (the per-step inputs were staged before the chunk: stage_chunk)
    float dd_part = 0.f, dda_part = 0.f;
    if (raw_on) {
      // The rows load_raw loaded for this chunk, first (their registers freed before the
      // rotation): the expressions of xg_rows and states_rows below (their fast paths: pair
      // loads, bf16), rows in the same order per thread.
      const int pc = raw_pc, r0 = raw_r0, rs = raw_rs;
      const float2 mv =
          make_float2(rt_raw_f(raw.mv[0], a.mimo_v.dt), rt_raw_f(raw.mv[1], a.mimo_v.dt));
      const float2 mo = a.layout == 0 ? make_float2(rt_raw_f(raw.mo[0], a.mimo_o.dt),
                                                    rt_raw_f(raw.mo[1], a.mimo_o.dt))
                                      : make_float2(1.f, 1.f);
      const float2 mz = RC::gate ? make_float2(rt_raw_f(raw.mz[0], a.mimo_z.dt),
                                               rt_raw_f(raw.mz[1], a.mimo_z.dt))
                                 : make_float2(1.f, 1.f);
      BB_UNROLL
      for (int k = 0; k < RC::kx; ++k) {
        const int row = r0 + k * rs;
        if (row < T) {
          XGPair o{};  // zero past the sequence
          if (row < TL) {
            const float2 vv = mimo::bf2_f(raw.v[k]);
            o.x = make_float2(vv.x * mv.x, vv.y * mv.y);
            o.g = mimo::bf2_f(raw.d[k]);
            if (a.layout == 0) o.g.x *= mo.x, o.g.y *= mo.y;
            if constexpr (RC::gate) {  // as xg_rows' gated rows
              const float2 gz = z_gate_of(mimo::bf2_f(raw.z[k]), mz);
              o.g.x *= gz.x, o.g.y *= gz.y;
            }
          }
          dd_part += o.g.x * o.x.x;
          dd_part += o.g.y * o.x.y;
          st_split_pair(X, row * ldP + pc, o.x);
          st_split_pair(Gp, row * ldP + pc, o.g);
        }
      }
      if constexpr (RC::st) {
        BB_UNROLL
        for (int k = 0; k < RC::ks; ++k) {
          const int n = r0 + k * rs;
          if (n < N) {
            const float2 sv = mimo::bf2_f(raw.st[k]), ds = raw.ds[k];
            const float4 sd = make_float4(sv.x, sv.y, ds.x, ds.y);
            dda_part += sd.x * sd.z;
            dda_part += sd.y * sd.w;
            st_split_pair(Sp, n * ldP + pc, make_float2(sd.x, sd.y));
          }
        }
      }
    }
    // Decays of the steps; zero past the sequence (those rows are zero, their products too).
    // Here, from the staged scalars (visible since the last barrier; step i's thread alone
    // reads and writes s_F[i], in place), so that phase 0's barrier publishes them and phase 1
    // starts right after it (after it, threads 0 .. C^2 - 1 computed W while the others waited
    // at phase 1's barrier).
    // From the last thread down: the W loop below runs on the first threads.
    const float da_last = s_dacs[L - 1];
    for (int i = NT - 1 - tid; i < C; i += NT) {
      float gam = 0.f, ts = 0.f, E = 0.f, F = 0.f;
      if (i < L) {
        gam = s_dt[i] * s_lam[i];
        ts = gam + (i + 1 < Lx ? s_dt[i + 1] * (1.f - s_lam[i + 1]) : 0.f);
        E = expf(s_dacs[i]);
        F = expf(partial ? da_last - s_dacs[i] : s_F[i]);
      }
      s_gam[i] = gam, s_ts[i] = ts, s_E[i] = E, s_F[i] = F;
    }
    // W[i][j] = exp(segsum[c, i, j]) for j < i < L, else 0; a partial last chunk from da_cs
    // alone (the tail contract), in place over the staged raw segsum.
    for (int e = tid; e < (C << lgC); e += NT) {
      const int i = e >> lgC, j = e & (C - 1);
      s_W[w_idx(e)] =
          j < i && i < L ? expf(partial ? s_dacs[i] - s_dacs[j] : s_W[w_idx(e)]) : 0.f;
    }

    // qh, kh: tasks per source, step and four rotation columns over the R ranks; the biases
    // and the (sin, cos) table from shared memory.
    {
      const RotSrc<std::decay_t<decltype(a.q)>> src[2] = {{&a.q, a.vec_q, Qh},
                                                          {&a.k, a.vec_k, Kh}};
      rotated_quad_rows<NT, 4, kGlobTab>(
          a, src,
          [&](int k, int r, int n) {
            return *reinterpret_cast<const float4*>((k == 0 ? qbias() : kbias()) + (r << lgN) + n);
          },
          b, h, grp, s0, L, cs_tab(), cs_glob(b, h, s0));
    }
    if (!raw_on) {
      with_dout_dtype(a.dout.dt, [&](auto dtag) {
        using TD = typename decltype(dtag)::type;
        const DoutRows dr = dout_rows(a, b, h);
        const int64_t v0 = int64_t{b} * a.v.s[0] + int64_t{h} * a.v.s[2], vs = a.v.s[3];
        // Every row of this thread has its rank r_t (see RankWeights): one mimo_v / mimo_o pair.
        const int r_t = (tid >> (lgP - 1)) & (R - 1), pc_t = (tid & ((1 << (lgP - 1)) - 1)) * 2;
        const float2 mv = rank_weights(a.mimo_v, h, r_t, pc_t);
        const float2 mo =
            a.layout == 0 ? rank_weights(a.mimo_o, h, r_t, pc_t) : make_float2(1.f, 1.f);
        // Offsets of this thread's step s0 (its rank r_t, its columns pc_t); rows add i strides.
        const int64_t vb = v0 + int64_t{s0} * a.v.s[1] + pc_t * vs;
        const int64_t db = dr.base + int64_t{s0} * dr.st + r_t * dr.sr + pc_t * dr.sp;
        // The gated rows (the combined backward) two at a time: four at a time, the gate's
        // registers made ptxas spill; the ungated loop keeps four rows in flight. The pair-load
        // choice (vec_tag: 1 pair loads, 0 two loads each, -1 a.vec_v / a.vec_dout at run time)
        // is compile-time in the ungated loops, so that the fast one issues only its pair loads
        // (with a runtime choice both paths were predicated and issued); the fallback (layouts
        // without pair loads, rare) one row at a time: less code, the same rows in the same order.
        auto xg_rows = [&](auto rows_tag, auto gate_tag, auto vec_tag) {
          constexpr int U = decltype(rows_tag)::value, V = decltype(vec_tag)::value;
          constexpr bool kGate = decltype(gate_tag)::value;
          const bool vec_v = V < 0 ? a.vec_v != 0 : V == 1;
          const bool vec_d = V < 0 ? a.vec_dout != 0 : V == 1;
          pair_rows_steps<U, NT>(
              T, lgP, lgR, a.v.s[1], dr.st,
              [&](int row, int64_t ov, int64_t od, int pc) {
                XGPair o{};  // zero past the sequence
                if (row < TL) {
                  const float2 vv = ld2_t<bf16_t>(a.v, vb + ov, vs, vec_v);
                  o.x = make_float2(vv.x * mv.x, vv.y * mv.y);
                  o.g = ld2_t<TD>(a.dout, db + od, dr.sp, vec_d);
                  if (a.layout == 0) o.g.x *= mo.x, o.g.y *= mo.y;
                  if constexpr (kGate) {
                    const float2 gz = z_gate2(a, b, s0 + (row >> lgR), h, pc,
                                              rank_weights(a.mimo_z, h, row & (R - 1), pc));
                    o.g.x *= gz.x, o.g.y *= gz.y;
                  }
                }
                return o;
              },
              [&](int row, int pc, const XGPair& o) {
                dd_part += o.g.x * o.x.x;
                dd_part += o.g.y * o.x.y;
                st_split_pair(X, row * ldP + pc, o.x);
                st_split_pair(Gp, row * ldP + pc, o.g);
              });
        };
        using Run = std::integral_constant<int, -1>;
        using Pair = std::integral_constant<int, 1>;
        using Two = std::integral_constant<int, 0>;
        if (a.gate)
          xg_rows(std::integral_constant<int, 2>{}, std::true_type{}, Run{});
        else if (a.vec_v && a.vec_dout)
          xg_rows(std::integral_constant<int, 4>{}, std::false_type{}, Pair{});
        else
          xg_rows(std::integral_constant<int, 1>{}, std::false_type{}, Two{});
      });
    }
    if (!raw_on || !RC::st) {
      // states[c] to planes; with them the row dots states . dS for DDA (dS, the workspace:
      // [N][P] fp32 at an even element offset), so that the states are read once per chunk.
      {
        const int64_t sb = o3(a.states, b, h, c), ss3 = a.states.s[3], ss4 = a.states.s[4];
        // U rows in flight; ld_st(off): the states pair at elements off, off + ss4.
        auto states_rows = [&](auto rows_tag, auto ld_st) {
          pair_rows_lin<decltype(rows_tag)::value, NT>(
              N, lgP, ss3,
              [&](int n, int64_t off, int pc) {
                const float2 st = ld_st(sb + off + pc * ss4);
                const float2 ds = *reinterpret_cast<const float2*>(dS + (n << lgP) + pc);
                return make_float4(st.x, st.y, ds.x, ds.y);
              },
              [&](int n, int64_t, int pc, float4 sd) {
                dda_part += sd.x * sd.z;
                dda_part += sd.y * sd.w;
                st_split_pair(Sp, n * ldP + pc, make_float2(sd.x, sd.y));
              });
        };
        // Pair loads by dtype (only they: a runtime pair choice issued both paths), eight rows
        // in flight (a thread's eight rows at N128 P64: one memory latency, not two as with four;
        // the same rows in the same order); layouts without pair loads (rare) in one
        // runtime-dtype loop, a row at a time (the same values, rows and order as the pair loop).
        if (a.vec_states)
          with_dtype(a.states.dt, [&](auto stag) {
            using TS = typename decltype(stag)::type;
            states_rows(std::integral_constant<int, StatesInFlight<AT>::u>{},
                        [&](int64_t o) { return ld2_t<TS>(a.states, o, ss4, true); });
          });
        else
          states_rows(std::integral_constant<int, 1>{}, [&](int64_t o) {
            return make_float2(ld(a.states, o), ld(a.states, o + ss4));
          });
      }
    }
    // Both block sums (DD, DDA) in one warp-shuffle reduction; its barrier also ends the loads
    // above (phase 1 reads the planes) and publishes the decays and W. The DDA total is kept
    // in shared memory (red[2 NW], past the warp partials, which are not rewritten before the
    // next chunk) until the per-step outputs: a register live across phase 2 would cost
    // spills there.
    {
      const float2 tot = block_sum2<NT>(dd_part, dda_part, red);
      if (tid == 0) {
        if (a.has_d) a.ws_dd[item] = tot.x;
        red[2 * kPlanesWarps] = tot.y;
      }
    }

    // ---- phase 1: KQ, XG (one 16 x 16 tile per warp and task, or two: PairKQ)
    if constexpr (PairKQ<AT>::on) {
      constexpr int nTc = PairKQ<AT>::nT, half_tasks = nTc * nTc / 2;
      for (int task = warp; task < nTc * nTc; task += kPlanesWarps) {
        const bool xg = task >= half_tasks;
        const int p = xg ? task - half_tasks : task;
        const int n0 = (p & (nTc - 1)) * 16, ma = (p / nTc) * 16, mb = ma + nTc * 8;
        float acc[2][2][4];
        mimo::zero_acc(acc[0]);
        mimo::zero_acc(acc[1]);
        if (xg)
          mimo::warp_mma_16x16_pair<false, false, kMmaUnroll, kInc>(acc[0], ma, 0, P, acc[1], mb,
                                                                    0, P, X, Gp, n0);
        else
          mimo::warp_mma_16x16_pair<false, false, kMmaUnroll, kInc>(acc[0], ma, 0, N, acc[1], mb,
                                                                    0, N, Kh, Qh, n0);
        store_tile(acc[0], ma, n0, xg ? XG : KQ, ldk);
        store_tile(acc[1], mb, n0, xg ? XG : KQ, ldk);
      }
    } else {
      for (int tile = warp; tile < 2 * nT * nT; tile += kPlanesWarps) {
        const bool xg = tile >= nT * nT;
        const int t2 = xg ? tile - nT * nT : tile;
        const int m0 = (t2 >> lgnT) * 16, n0 = (t2 & (nT - 1)) * 16;
        float acc[2][4];
        mimo::zero_acc(acc);
        if (xg)
          warp_mma_16x16<false, false, kMmaUnroll, kInc>(acc, X, m0, Gp, n0, 0, P);
        else
          warp_mma_16x16<false, false, kMmaUnroll, kInc>(acc, Kh, m0, Qh, n0, 0, N);
        store_tile(acc, m0, n0, xg ? XG : KQ, ldk);
      }
    }
    bb_sync();

    // ---- phase 2: dqh. M1[(i,r)][(j,r')] = W[i][j] ts_j XG[(j,r')][(i,r)] (j < i).
    // The coefficient matrices are built by (row, column pair) tasks, one split pair store per
    // task; the two columns share their step j (one weight) unless R = 1. The three builds with
    // R compile-time (with_pow2): constant shifts, and at R > 1 the second column's step, weight
    // and mask are the first's (ca even), not formed (and loaded) again. Only the 16 x 16
    // blocks the product reads are built, by warp tasks (CoefBlocks). M1 reads XG transposed:
    // its warp task is 16 rows (lanes) x 2 column pairs, conflict-free loads (the pairs
    // 2 (T + kPlanesPad) floats, 16 banks, apart) and 2-way conflicted stores (4-way with 32
    // rows per warp).
    with_pow2(lgR, [&](auto kr) {
      constexpr int KR = decltype(kr)::value, LR = lg_of<KR>;
      const CoefBlocks cbl(nT, true);
      BB_NO_UNROLL  // (as before the templating: unrolled, four copies would be ~1K instructions)
      for (int wt = warp; wt < cbl.tasks; wt += kPlanesWarps) {
        const int row = cbl.a16(wt) + (lane & 15);
        const int ca = cbl.b16(wt) + 4 * (wt & 3) + 2 * (lane >> 4), i = row >> LR;
        const int j0 = ca >> LR, j1 = LR > 0 ? j0 : ca + 1;
        const bool live0 = j0 < i && row < TL, live1 = LR > 0 ? live0 : j1 < i && row < TL;
        const float w0 = live0 ? Wf(i, j0) * s_ts[j0] : 0.f;
        const float w1 = LR > 0 ? w0 : live1 ? Wf(i, j1) * s_ts[j1] : 0.f;
        st_split_pair(Mc, row * ldT + ca,
                      make_float2(live0 ? w0 * XG[ca * ldk + row] : 0.f,
                                  live1 ? w1 * XG[(ca + 1) * ldk + row] : 0.f));
      }
    });
    bb_sync();
    float accq[kPlanesTilesPerWarp][2][4], acck[kPlanesTilesPerWarp][2][4];
    // Tile u of this warp among the nT nN dqh / dkh tiles (at most two per warp: make_plan):
    // warp w owns tiles w and 2 W - 1 - w (W warps), so that each warp has a row block with
    // few intra-chunk k steps and one with many (M1 kh ends at the tile's last row's step,
    // M2 qh starts at its first row's). With tiles w and w + W, at N128 C16 the first 8 warps
    // had 2 k steps (of 12) fewer than the other 8 in the dqh products and 2 more in the dkh
    // ones, each imbalance waited out at the barrier after. Only the owners change: the same
    // products per tile, the same bits.
    // PairTiles: warp w owns the tiles (a, n) and (nT - 1 - a, n), a = w / nN, n = w mod nN
    // (row block, column block): the same row-block balance, and one column block for both.
    static_assert(kPlanesTilesPerWarp == 2, "acc_tile pairs the tiles");
    constexpr bool kPair = PairTiles<AT>::on;
    auto acc_tile = [&](int u) {
      if constexpr (kPair) {
        const int ra = warp >> lgnN, nc = warp & (nN - 1);
        return (u == 0 ? ra : nT - 1 - ra) * nN + nc;
      } else {
        return u == 0 ? warp : 2 * kPlanesWarps - 1 - warp;
      }
    };
    // The intra-chunk products' k ranges, whole 16-column blocks: R divides 16, so the steps of a
    // tile's 16 rows are exactly those of the 16 columns of the same block, and M1 (zero from a
    // row's own step on) ends after the tile's block, M2 and M3 (zero up to it) start at it: the
    // blocks CoefBlocks builds.
    auto dqh_ke = [&](int m0) { return m0 + 16; };
    auto dkh_kb = [&](int m0) { return m0; };
    if constexpr (kPair) {
      // inter_chunk_tile's three steps for both tiles, the products paired.
      const int ma = (acc_tile(0) >> lgnN) * 16, mb = (acc_tile(1) >> lgnN) * 16;
      const int n0 = (acc_tile(0) & (nN - 1)) * 16;
      inter_chunk_pair<kPartCs, kInc>(accq, Gp, Sp, Qh, ma, mb, n0, P, lgR, s_E, part, nN);  // E SG
      mimo::warp_mma_16x16_pair<false, true, kMmaUnroll, kInc>(
          accq[0], ma, 0, dqh_ke(ma), accq[1], mb, 0, dqh_ke(mb), Mc, Kh, n0);
    } else {
      BB_UNROLL
      for (int u = 0; u < kPlanesTilesPerWarp; ++u) {
        const int tile = acc_tile(u);
        mimo::zero_acc(accq[u]);
        if (tile < nT * nN) {
          const int m0 = (tile >> lgnN) * 16, n0 = (tile & (nN - 1)) * 16;
          inter_chunk_tile<kPartCs, kInc>(
              accq[u], Gp, Sp, Qh, m0, n0, P, lgR, s_E, part, nN);  // E SG
          warp_mma_16x16<false, true, kMmaUnroll, kInc>(accq[u], Mc, m0, Kh, n0, 0, dqh_ke(m0));
        }
      }
    }
    bb_sync();  // st and mc are rewritten next

    // ---- dkh. dS_c replaces states[c]; M2[(i,r2)][(j,r)] = W[j][i] XG[(i,r2)][(j,r)] (j > i).
    pair_rows_lin<DsInFlight<AT>::u, NT>(
        N, lgP, int64_t{P},
        [&](int, int64_t off, int pc) { return *reinterpret_cast<const float2*>(dS + off + pc); },
        [&](int n, int64_t, int pc, float2 v) { st_split_pair(Sp, n * ldP + pc, v); });
    // (Not unrolled: it runs with the dqh accumulators live; unrolled, it spilled.)
    with_pow2(lgR, [&](auto kr) {
      constexpr int KR = decltype(kr)::value, LR = lg_of<KR>;
      const CoefBlocks cbl(nT, false);
      BB_NO_UNROLL
      for (int wt = warp; wt < cbl.tasks; wt += kPlanesWarps) {
        const int cb = cbl.b16(wt) + 2 * (lane & 7), row = cbl.row_rm(wt, lane), i = row >> LR;
        const int j0 = cb >> LR, j1 = LR > 0 ? j0 : cb + 1;
        const bool live0 = j0 > i && j0 < L, live1 = LR > 0 ? live0 : j1 > i && j1 < L;
        const float w0 = live0 ? Wf(j0, i) : 0.f;
        const float w1 = LR > 0 ? w0 : live1 ? Wf(j1, i) : 0.f;
        const float2 xg = *reinterpret_cast<const float2*>(XG + row * ldk + cb);
        st_split_pair(Mc, row * ldT + cb,
                      make_float2(live0 ? w0 * xg.x : 0.f, live1 ? w1 * xg.y : 0.f));
      }
    });
    bb_sync();  // mc and the dS planes
    const float dda = expf(da_last) * red[2 * kPlanesWarps];
    if constexpr (kPair) {
      const int ma = (acc_tile(0) >> lgnN) * 16, mb = (acc_tile(1) >> lgnN) * 16;
      const int n0 = (acc_tile(0) & (nN - 1)) * 16;
      inter_chunk_pair<kPartRev, kInc>(acck, X, Sp, Kh, ma, mb, n0, P, lgR, s_F, part, nN);  // F SX
      mimo::warp_mma_16x16_pair<false, true, kMmaUnroll, kInc>(
          acck[0], ma, dkh_kb(ma), T, acck[1], mb, dkh_kb(mb), T, Mc, Qh, n0);
      tile_row_dots<kPartFac>(Kh, ma, n0, acck[0], part, nN);
      tile_row_dots<kPartFac>(Kh, mb, n0, acck[1], part, nN);
    } else {
      BB_UNROLL
      for (int u = 0; u < kPlanesTilesPerWarp; ++u) {
        const int tile = acc_tile(u);
        mimo::zero_acc(acck[u]);
        if (tile < nT * nN) {
          const int m0 = (tile >> lgnN) * 16, n0 = (tile & (nN - 1)) * 16;
          inter_chunk_tile<kPartRev, kInc>(
              acck[u], X, Sp, Kh, m0, n0, P, lgR, s_F, part, nN);  // F SX
          warp_mma_16x16<false, true, kMmaUnroll, kInc>(acck[u], Mc, m0, Qh, n0, dkh_kb(m0), T);
          tile_row_dots<kPartFac>(Kh, m0, n0, acck[u], part, nN);
        }
      }
    }
    bb_sync();  // mc is rewritten next; x is dead (dx goes there)

    // ---- dx. M3[(i,r2)][(j,r)] = W[j][i] ts_i KQ[(i,r2)][(j,r)] (j > i),
    //                              gamma_i qk_dot[i, r, r2] + D [r = r2] (j = i), 0 (j < i).
    with_pow2(lgR, [&](auto kr) {
      constexpr int KR = decltype(kr)::value, LR = lg_of<KR>;
      const CoefBlocks cbl(nT, false);
      BB_NO_UNROLL  // (as M1)
      for (int wt = warp; wt < cbl.tasks; wt += kPlanesWarps) {
        const int cb = cbl.b16(wt) + 2 * (lane & 7), row = cbl.row_rm(wt, lane), i = row >> LR,
                  r2 = row & (KR - 1);
        const float2 kq = *reinterpret_cast<const float2*>(KQ + row * ldk + cb);
        float m[2];
        BB_UNROLL
        for (int u = 0; u < 2; ++u) {
          // (At R > 1 both columns have step cb >> LR: cb is even.)
          const int j = LR > 0 ? cb >> LR : cb + u, r = (cb & (KR - 1)) + (LR > 0 ? u : 0);
          m[u] = 0.f;
          if (row < TL && j < L) {
            if (j > i)
              m[u] = (Wf(j, i) * s_ts[i]) * (u == 0 ? kq.x : kq.y);
            else if (j == i)
              m[u] = s_gam[i] * s_qk[((i * KR + r) << LR) + r2] + (r == r2 ? Dh : 0.f);
          }
        }
        st_split_pair(Mc, row * ldT + cb, make_float2(m[0], m[1]));
      }
    });
    // Per-step outputs (the row partials are complete since the last barrier): a warp per step,
    // eight lanes per sum (DDA_CS, DDA_CS_REV, DFACTOR, DGAMMA), so that every warp has the same
    // share of the work before the barrier below (one thread per step kept 15 warps waiting
    // there). Summation order: lane u of a sum adds its terms j = u, u + 8, u + 16, ... in
    // order, then the eight lane sums in a butterfly (xor 1, 2, 4: ((l0 + l1) + (l2 + l3)) +
    // ((l4 + l5) + (l6 + l7))). Terms: part[(i R nN + j) 3 + which] (j = r nN + nt), and
    // qk_dot[i, r, r2] XG[(i, r2)][(i, r)] (j = r R + r2) for DGAMMA. (L << 5: warp-uniform
    // trip counts, as the shuffles need.) At R = 1 (C = 64: 64 steps of few terms) one thread
    // per step is quicker: the spread's shuffles then cost more than the imbalance
    // (N128 R1 C64: planes K3 1.07 ms spread, 1.02 ms one thread per step).
    if (R == 1) {
      for (int i = tid; i < L; i += NT) {
        float cs = 0.f, rev = 0.f, fac = 0.f;
        for (int nt = 0; nt < nN; ++nt) {
          const int k = ((i << lgnN) + nt) * 3;
          cs += part[k + kPartCs], rev += part[k + kPartRev], fac += part[k + kPartFac];
        }
        float dgam = 0.f;  // (as the general loop: a -0 product gives +0)
        dgam += s_qk[i] * XG[i * ldk + i];
        const int t = s0 + i;  // the per-step outputs are fp32 (params)
        st_t(reinterpret_cast<float*>(a.dda.p) + o3(a.dda, b, h, t), dda);
        st_t(reinterpret_cast<float*>(a.dda_cs.p) + o3(a.dda_cs, b, h, t), cs);
        st_t(reinterpret_cast<float*>(a.dda_cs_rev.p) + o3(a.dda_cs_rev, b, h, t), s_ts[i] * rev);
        st_t(reinterpret_cast<float*>(a.dfactor.p) + o3(a.dfactor, b, h, t), fac);
        st_t(reinterpret_cast<float*>(a.dgamma.p) + o3(a.dgamma, b, h, t), dgam);
      }
    } else
    for (int e = tid; e < (L << 5); e += NT) {
      const int i = e >> 5, which = (e >> 3) & 3, u = e & 7;
      float v = 0.f;
      if (which < 3) {
        const int nq = R << lgnN;
        const float* pp = part + i * nq * 3 + which;
        for (int j = u; j < nq; j += 8) v += pp[j * 3];
      } else {
        for (int j = u; j < (R << lgR); j += 8) {
          const int r = j >> lgR, r2 = j & (R - 1);
          v += s_qk[(i << (2 * lgR)) + j] * XG[((i << lgR) + r2) * ldk + (i << lgR) + r];
        }
      }
      v += mimo::mb_shfl_xor(v, 1);
      v += mimo::mb_shfl_xor(v, 2);
      v += mimo::mb_shfl_xor(v, 4);
      if (u == 0) {
        const int t = s0 + i;  // the per-step outputs are fp32 (params)
        if (which == kPartCs) {
          st_t(reinterpret_cast<float*>(a.dda.p) + o3(a.dda, b, h, t), dda);
          st_t(reinterpret_cast<float*>(a.dda_cs.p) + o3(a.dda_cs, b, h, t), v);
        } else if (which == kPartRev) {
          st_t(reinterpret_cast<float*>(a.dda_cs_rev.p) + o3(a.dda_cs_rev, b, h, t), s_ts[i] * v);
        } else if (which == kPartFac) {
          st_t(reinterpret_cast<float*>(a.dfactor.p) + o3(a.dfactor, b, h, t), v);
        } else {
          st_t(reinterpret_cast<float*>(a.dgamma.p) + o3(a.dgamma, b, h, t), v);
        }
      }
    }
    {
      const int64_t dss0 = o3(a.dssda, b, h, c);
      float* dssda = reinterpret_cast<float*>(a.dssda.p);  // fp32 (params)
      // DSSDA[s, t]: every pair of valid steps, unmasked; rows / columns past the sequence 0.
      // With fewer tasks (C^2) than threads and R > 1, two adjacent lanes per (s, t), so that
      // all 16 warps share them: lane u sums its half of the ranks r (r2 outer, r inner, in
      // order), then the two halves are added (xor 1). Otherwise one lane per task (C >= 32
      // fills every warp already; at R = 1 the second lane would idle). lgU is CTA-uniform
      // (the shuffle's trip counts are warp-uniform: 2 C^2 lanes, C >= 8).
      const int lgU = ((C << lgC) < NT && R > 1) ? 1 : 0;
      // A lane's rank count NR = R >> lgU compile-time (R a power of two: lane u's ranks
      // u NR .. u NR + NR - 1): no predicated-off iterations of a kMaxR-long loop.
      with_pow2(lgR - lgU, [&](auto nr_tag) {
        constexpr int NR = decltype(nr_tag)::value;
        BB_NO_UNROLL  // (as before the templating: code size)
        for (int e = tid; e < (C << (lgC + lgU)); e += NT) {
          const int u = e & lgU, s = e >> (lgC + lgU), tq = (e >> lgU) & (C - 1);
          const int rb = u * NR;
          const bool valid = s < L && tq < L;
          float acc = 0.f;
          if (valid) {
            // The ranks r unrolled (immediate offsets); r2 not (its registers: this runs with
            // the dqh / dkh accumulators live; and code size: four copies).
            BB_NO_UNROLL
            for (int r2 = 0, b2 = (s << lgR) * ldk + (tq << lgR) + rb; r2 < R; ++r2, b2 += ldk) {
              BB_UNROLL
              for (int r = 0; r < NR; ++r) acc += KQ[b2 + r] * XG[b2 + r];
            }
          }
          if (lgU) acc += mimo::mb_shfl_xor(acc, 1);
          if (u == 0)
            dssda[dss0 + s * a.dssda.s[3] + tq * a.dssda.s[4]] = valid ? acc * s_ts[s] : 0.f;
        }
      });
    }
    bb_sync();
    // The diagonal blocks of XG scaled by gamma, for phase 3's DQ / DK tasks (per step, not per
    // column): dg_q[(i R + r) R + r2] = gamma_i XG[(i, r2)][(i, r)], dg_k the transpose; over
    // KQ (2 T R floats of its T ldk: C >= 8), dead since the barrier above (M3 and DSSDA were its
    // last readers; the dx products below read neither KQ nor XG). Here rather than after the dx
    // products: one barrier interval fewer with work for only some threads. From the last
    // thread down: the last warps' dx tiles have the fewest k steps (M3 g starts at the tile's
    // first row's step).
    float* dg_q = KQ;
    float* dg_k = KQ + (T << lgR);
    for (int e = NT - 1 - tid; e < (T << lgR); e += NT) {
      const int row = e >> lgR, i = row >> lgR, r2 = e & (R - 1);
      const float gam = s_gam[i];
      dg_q[e] = gam * XG[((i << lgR) + r2) * ldk + row];
      dg_k[e] = gam * XG[row * ldk + (i << lgR) + r2];
    }
    if constexpr (PairDx<AT>::on) {
      // Tiles (a, j) and (nT - 1 - a, j) of one column block j (PairDx), B loaded once.
      constexpr int nTc = PairDx<AT>::nT, nPc = PairDx<AT>::nP;
      for (int task = warp; task < nTc / 2 * nPc; task += kPlanesWarps) {
        const int p0 = (task % nPc) * 16, ma = (task / nPc) * 16, mb = (nTc - 1) * 16 - ma;
        float acc[2][2][4];
        mimo::zero_acc(acc[0]);
        mimo::zero_acc(acc[1]);
        mimo::warp_mma_16x16_pair<false, true, kMmaUnroll, kInc>(acc[0], ma, 0, N, acc[1], mb, 0,
                                                                 N, Kh, Sp, p0);  // kh dS
        BB_UNROLL
        for (int u = 0; u < 2; ++u) {
          scale_rows(acc[u], u ? mb : ma, lgR, s_F);
          scale_rows(acc[u], u ? mb : ma, lgR, s_ts);
        }
        mimo::warp_mma_16x16_pair<false, true, kMmaUnroll, kInc>(
            acc[0], ma, dkh_kb(ma), T, acc[1], mb, dkh_kb(mb), T, Mc, Gp, p0);
        store_tile(acc[0], ma, p0, dx, ldx);
        store_tile(acc[1], mb, p0, dx, ldx);
      }
    } else {
      for (int tile = warp; tile < (T * P) >> 8; tile += kPlanesWarps) {
        const int m0 = (tile >> lgnP) * 16, p0 = (tile & ((1 << lgnP) - 1)) * 16;
        float acc[2][4];
        mimo::zero_acc(acc);
        warp_mma_16x16<false, true, kMmaUnroll, kInc>(acc, Kh, m0, Sp, p0, 0, N);  // kh dS
        scale_rows(acc, m0, lgR, s_F);
        scale_rows(acc, m0, lgR, s_ts);
        // From the tile's own block on (dkh_kb).
        warp_mma_16x16<false, true, kMmaUnroll, kInc>(acc, Mc, m0, Gp, p0, dkh_kb(m0), T);
        store_tile(acc, m0, p0, dx, ldx);
      }
    }
    bb_sync();  // qh / kh planes dead: dqh / dkh go there

    // ---- phase 3
    BB_UNROLL
    for (int u = 0; u < kPlanesTilesPerWarp; ++u) {
      const int tile = acc_tile(u);
      if (tile < nT * nN) {
        const int m0 = (tile >> lgnN) * 16, n0 = (tile & (nN - 1)) * 16;
        store_tile(accq[u], m0, n0, dqh, ldq);
        store_tile(acck[u], m0, n0, dkh, ldq);
      }
    }
    // Here, not earlier: the accumulators are dead (no registers to spare in phase 2).
    if (a.prefetch && valid(next_of(item))) prefetch_item(a, next_of(item));
    bb_sync();
    // DQ, DK, DANGLES: one task per step and two adjacent rotation pairs (n, half + n), (n + 1,
    // half + n + 1) (n even; half = N / 2 is, N being a power of two >= 16 on this path) over
    // the R ranks, so that the exact q / k rows of the diagonal terms are loaded once per task
    // (R each), not once per output row, the step's diagonal coefficients are read once for
    // both columns, and one sincos serves each column and step.
    const int lgH2 = lgN - 2;  // log2(half / 2): tasks per step
    const int64_t q0 = int64_t{b} * a.q.s[0] + int64_t{grp} * a.q.s[3];
    const int64_t k0 = int64_t{b} * a.k.s[0] + int64_t{grp} * a.k.s[3];
    const int64_t qs2 = a.q.s[2], qs4 = a.q.s[4], ks2 = a.k.s[2], ks4 = a.k.s[4];
    const int64_t qhalf = half * qs4, khalf = half * ks4;
    const float *s_qbias = qbias(), *s_kbias = kbias();
    const float2* tab = cs_tab();
    [[maybe_unused]] const float2* gtab = tab != nullptr ? nullptr : cs_glob(b, h, s0);
    [[maybe_unused]] const int64_t ang0 = int64_t{b} * a.angles.s[0] + int64_t{h} * a.angles.s[2];
    const int64_t dang0 = int64_t{b} * a.dangles.s[0] + int64_t{h} * a.dangles.s[2];
    const int64_t das3 = a.dangles.s[3];
    // q / k column pairs as one 4-byte load where both layouts allow (Args::vec_q, vec_k: unit
    // last stride, even other strides, aligned; n even), else the columns one at a time.
    const bool vec_qk = a.vec_q >= 1 && a.vec_k >= 1;
    // This thread's column pair n is fixed (NT is a multiple of half / 2): its q / k offsets at
    // step s0 + i advance by one 64-bit add per task.
    const int n = (tid & ((1 << lgH2) - 1)) * 2;
    const int64_t qstep = int64_t{NT >> lgH2} * a.q.s[1], kstep = int64_t{NT >> lgH2} * a.k.s[1];
    int64_t qi = q0 + (s0 + (tid >> lgH2)) * a.q.s[1] + n * qs4;
    int64_t ki = k0 + (s0 + (tid >> lgH2)) * a.k.s[1] + n * ks4;
    // DANGLES[b, s0 + i, h, n] (fp32: params) likewise.
    float* pdang = reinterpret_cast<float*>(a.dangles.p) + dang0 +
                   (s0 + (tid >> lgH2)) * a.dangles.s[1] + n * das3;
    const int64_t dstep = int64_t{NT >> lgH2} * a.dangles.s[1];
    const bool rot0 = n < A, rot1 = n + 1 < A;
    // One task (step e >> lgH2, this thread's column pair) at offsets qi, ki, pdang. pre: the
    // task's raw q / k pairs already loaded (QkPre<KR>, Pf3 below), or nullptr (loaded here).
    auto task = [&](int e, int64_t qi, int64_t ki, float* pdang, auto pre) {
      using Pre = decltype(pre);
      const int i = e >> lgH2;
      const float ts = s_ts[i];
      float sn0 = 0.f, cs0 = 1.f, sn1 = 0.f, cs1 = 1.f;
      if (rot0) {
        if (tab != nullptr) {
          const float2 t0 = tab[i * A + n];  // stage_chunk's sincos of the angles
          sn0 = t0.x, cs0 = t0.y;
          if (rot1) {
            const float2 t1 = tab[i * A + n + 1];
            sn1 = t1.x, cs1 = t1.y;
          }
        } else if constexpr (kGlobTab) {  // the workspace's table
          if (rot1 && (A & 1) == 0) {  // one 16-byte load (n even: aligned as in rotated_quad_rows)
            const float4 t = *reinterpret_cast<const float4*>(gtab + i * A + n);
            sn0 = t.x, cs0 = t.y, sn1 = t.z, cs1 = t.w;
          } else {
            const float2 t0 = gtab[i * A + n];
            sn0 = t0.x, cs0 = t0.y;
            if (rot1) {
              const float2 t1 = gtab[i * A + n + 1];
              sn1 = t1.x, cs1 = t1.y;
            }
          }
        } else {  // (not reached: these kernels' layouts have the table)
          const int64_t ao = ang0 + (s0 + i) * a.angles.s[1] + n * a.angles.s[3];
          // Rolled: one copy of sincosf's slow path (its local memory). (Selects, not an
          // indexed array: that would go to local memory.)
          BB_NO_UNROLL
          for (int c = 0; c < 2; ++c) {
            float sv = 0.f, cv = 1.f;
            if (n + c < A) bb_sincos(ld(a.angles, ao + c * a.angles.s[3]), &sv, &cv);
            sn0 = c == 0 ? sv : sn0, cs0 = c == 0 ? cv : cs0;
            sn1 = c == 1 ? sv : sn1, cs1 = c == 1 ? cv : cs1;
          }
        }
      }
      // The task's R ranks with R a compile-time constant KR (1, 2, 4 or 8: a power of two on
      // this path), chosen per task (a uniform branch; the sincos above stays one copy): no
      // predicated-off iterations of kMaxR-long rank loops, and a row's KR diagonal
      // coefficients dg_q / dg_k as vector loads (KR consecutive floats at a multiple of KR;
      // KQ is 16-byte aligned and T R a multiple of 8). NC columns from column n + c0 (NC = 2:
      // both columns, pairs of fp32 values from shared memory, q / k pair loads; NC = 1: one,
      // for R = 8, where the two columns' q / k values would not fit the registers, and for
      // q / k layouts without pair loads). Every output element's
      // expressions and summation order are those of the one-column loop this replaces.
      auto ranks = [&](auto kr, auto nc, int c0, float* dang) {
        constexpr int KR = decltype(kr)::value, NC = decltype(nc)::value;
        const int nn = n + c0;
        float sn[NC], cs[NC];
        bool rot[NC];
        BB_UNROLL
        for (int c = 0; c < NC; ++c) {
          sn[c] = c0 + c == 0 ? sn0 : sn1, cs[c] = c0 + c == 0 ? cs0 : cs1;
          rot[c] = c0 + c == 0 ? rot0 : rot1;
        }
        // Shared-memory fp32 values at p[0 .. NC).
        auto lds = [](const float* p, float (&x)[NC]) {
          if constexpr (NC == 2) {
            const float2 v = *reinterpret_cast<const float2*>(p);
            x[0] = v.x, x[1] = v.y;
          } else {
            x[0] = p[0];
          }
        };
        auto sts = [](float* p, const float (&x)[NC]) {
          if constexpr (NC == 2)
            *reinterpret_cast<float2*>(p) = make_float2(x[0], x[1]);
          else
            p[0] = x[0];
        };
        // bf16 elements p[0], p[1] (NC = 2: one 4-byte load) or p[0] as fp32 (exact).
        auto ldg = [&](const unsigned short* p, float (&x)[NC]) {
          if constexpr (NC == 2) {  // (only where vec_qk holds)
            const float2 v = mimo::bf2_f(mimo::mb_ldg(reinterpret_cast<const unsigned int*>(p)));
            x[0] = v.x, x[1] = v.y;
          } else {
            x[0] = f_of_bits(mimo::mb_ldg(p), DTag<bf16_t>{});
          }
        };
        // Biased, unrotated q / k elements (row i R + r, columns nn + c, half + nn + c), exact
        // fp32. The bf16 elements through running pointers (rank r + 1 at + qs2 / ks2 from rank
        // r, column half + nn at a fixed offset), the biases likewise (+ N per rank).
        float qb1[KR][NC], qb2[KR][NC], kb1[KR][NC], kb2[KR][NC];
        const unsigned short* pq = reinterpret_cast<const unsigned short*>(a.q.p) + qi + c0 * qs4;
        const unsigned short* pk = reinterpret_cast<const unsigned short*>(a.k.p) + ki + c0 * ks4;
        const float *bq = s_qbias + nn, *bk = s_kbias + nn;
        BB_UNROLL
        for (int r = 0; r < KR; ++r, pq += qs2, pk += ks2, bq += N, bk += N) {
          float x1[NC], x2[NC], y1[NC], y2[NC], c1[NC], c2[NC], d1[NC], d2[NC];
          if constexpr (std::is_same_v<Pre, const QkPre<KR>*> && NC == 2) {
            const float2 u1 = mimo::bf2_f(qk_pre<KR>(pre, r, 0)),
                         u2 = mimo::bf2_f(qk_pre<KR>(pre, r, 1));
            const float2 w1 = mimo::bf2_f(qk_pre<KR>(pre, r, 2)),
                         w2 = mimo::bf2_f(qk_pre<KR>(pre, r, 3));
            x1[0] = u1.x, x1[1] = u1.y, x2[0] = u2.x, x2[1] = u2.y;
            y1[0] = w1.x, y1[1] = w1.y, y2[0] = w2.x, y2[1] = w2.y;
          } else {
            ldg(pq, x1), ldg(pq + qhalf, x2), ldg(pk, y1), ldg(pk + khalf, y2);
          }
          lds(bq, c1), lds(bq + half, c2), lds(bk, d1), lds(bk + half, d2);
          BB_UNROLL
          for (int c = 0; c < NC; ++c) {
            qb1[r][c] = x1[c] + c1[c], qb2[r][c] = x2[c] + c2[c];
            kb1[r][c] = y1[c] + d1[c], kb2[r][c] = y2[c] + d2[c];
          }
        }
        BB_UNROLL
        for (int c = 0; c < NC; ++c) dang[c] = 0.f;
        // Row i R + r of dqh / dkh at column nn, + ldq per rank.
        float* rq = dqh + i * KR * ldq + nn;
        float* rk = dkh + i * KR * ldq + nn;
        BB_UNROLL
        for (int r = 0; r < KR; ++r, rq += ldq, rk += ldq) {
          const int row = i * KR + r;
          float q0[NC], q1[NC], g0[NC], g1[NC];
          lds(rq, q0), lds(rq + half, q1), lds(rk, g0), lds(rk + half, g1);
          // Diagonal gamma_i sum qk_dot[i, r, r2] x^r2 with qk_dot = qb . kb (unrotated).
          float xq[KR], xk[KR];
          ld_smem_row<KR>(dg_q + row * KR, xq);
          ld_smem_row<KR>(dg_k + row * KR, xk);
          float oq0[NC], oq1[NC], ok0[NC], ok1[NC];
          BB_UNROLL
          for (int c = 0; c < NC; ++c) {
            g0[c] *= ts, g1[c] *= ts;
            oq0[c] = q0[c], oq1[c] = q1[c], ok0[c] = g0[c], ok1[c] = g1[c];
            if (rot[c]) {
              const float s = sn[c], k = cs[c];
              oq0[c] = q0[c] * k + q1[c] * s, oq1[c] = q1[c] * k - q0[c] * s;
              ok0[c] = g0[c] * k + g1[c] * s, ok1[c] = g1[c] * k - g0[c] * s;
              // d/dtheta of (u cos - w sin, u sin + w cos) is (-y2, y1) of the rotated pair.
              const float qh1 = qb1[r][c] * k - qb2[r][c] * s, qh2 = qb1[r][c] * s + qb2[r][c] * k;
              const float kh1 = kb1[r][c] * k - kb2[r][c] * s, kh2 = kb1[r][c] * s + kb2[r][c] * k;
              dang[c] += q1[c] * qh1 - q0[c] * qh2 + g1[c] * kh1 - g0[c] * kh2;
            }
            BB_UNROLL
            for (int r2 = 0; r2 < KR; ++r2)
              oq0[c] += xq[r2] * kb1[r2][c], oq1[c] += xq[r2] * kb2[r2][c];
            BB_UNROLL
            for (int r1 = 0; r1 < KR; ++r1)
              ok0[c] += xk[r1] * qb1[r1][c], ok1[c] += xk[r1] * qb2[r1][c];
          }
          // In place (this task alone reads and writes these elements); stored to dq, dk below.
          sts(rq, oq0), sts(rq + half, oq1), sts(rk, ok0), sts(rk + half, ok1);
        }
      };
      float dang[2];
      if (lgR <= 2 && vec_qk) {
        if (lgR == 2)
          ranks(std::integral_constant<int, 4>{}, std::integral_constant<int, 2>{}, 0, dang);
        else if (lgR == 1)
          ranks(std::integral_constant<int, 2>{}, std::integral_constant<int, 2>{}, 0, dang);
        else
          ranks(std::integral_constant<int, 1>{}, std::integral_constant<int, 2>{}, 0, dang);
      } else {
        // One column at a time (rolled: one copy of each body): R = 8, and q / k layouts
        // without pair loads (else the compiler predicates both load paths, issuing both).
        BB_NO_UNROLL
        for (int c = 0; c < 2; ++c) {
          float d[1];
          if (lgR == 3)
            ranks(std::integral_constant<int, 8>{}, std::integral_constant<int, 1>{}, c, d);
          else if (lgR == 2)
            ranks(std::integral_constant<int, 4>{}, std::integral_constant<int, 1>{}, c, d);
          else if (lgR == 1)
            ranks(std::integral_constant<int, 2>{}, std::integral_constant<int, 1>{}, c, d);
          else
            ranks(std::integral_constant<int, 1>{}, std::integral_constant<int, 1>{}, c, d);
          dang[0] = c == 0 ? d[0] : dang[0], dang[1] = c == 1 ? d[0] : dang[1];
        }
      }
      if (rot0) pdang[0] = dang[0];
      if (rot1) pdang[das3] = dang[1];
    };
    bool tasks_done = false;
    if constexpr (Pf3<AT>::tasks > 0) {
      // A whole chunk's tasks (L = C) with the next task's q / k pairs loaded before this one
      // runs: one L2 round trip per thread for the whole loop instead of one per task.
      constexpr int KR = AT::R, NTK = Pf3<AT>::tasks;
      if (L == C) {
        tasks_done = true;
        QkPre<KR> cur, nxt;
        auto load_pre = [&](QkPre<KR>& d, int64_t qo, int64_t ko) {
          const unsigned short* pq = reinterpret_cast<const unsigned short*>(a.q.p) + qo;
          const unsigned short* pk = reinterpret_cast<const unsigned short*>(a.k.p) + ko;
          BB_UNROLL
          for (int r = 0; r < KR; ++r, pq += qs2, pk += ks2) {
            d.v[r][0] = mimo::mb_ldg(reinterpret_cast<const unsigned int*>(pq));
            d.v[r][1] = mimo::mb_ldg(reinterpret_cast<const unsigned int*>(pq + qhalf));
            d.v[r][2] = mimo::mb_ldg(reinterpret_cast<const unsigned int*>(pk));
            d.v[r][3] = mimo::mb_ldg(reinterpret_cast<const unsigned int*>(pk + khalf));
          }
        };
        load_pre(cur, qi, ki);
        BB_UNROLL
        for (int t = 0; t < NTK; ++t, qi += qstep, ki += kstep, pdang += dstep) {
          if (t + 1 < NTK) load_pre(nxt, qi + qstep, ki + kstep);
          task(tid + t * NT, qi, ki, pdang, static_cast<const QkPre<KR>*>(&cur));
          if (t + 1 < NTK) cur = nxt;
        }
      }
    }
    if (!tasks_done)
      for (int e = tid; e < (L << lgH2); e += NT, qi += qstep, ki += kstep, pdang += dstep)
        task(e, qi, ki, pdang, nullptr);
    const int64_t v0 = int64_t{b} * a.v.s[0] + int64_t{h} * a.v.s[2], vs = a.v.s[3];
    {
      // This thread's column p is fixed (NT is a multiple of P): its mimo_v[h][r][p] once.
      // R compile-time (with_pow2) for the weight loads and each row's sum: R loads and R terms,
      // not kMaxR predicated ones; the loop and its runtime-dtype store stay one copy.
      const int p = tid & (P - 1);
      const int64_t mv0 = int64_t{h} * a.mimo_v.s[0] + p * a.mimo_v.s[2];
      float mvr[kMaxR] = {};
      with_pow2(lgR, [&](auto kr) {
        constexpr int KR = decltype(kr)::value;
        uint32_t u[KR];  // raw loads first, then their values (rt_ld's values)
        BB_UNROLL
        for (int r = 0; r < KR; ++r)
          u[r] = rt_ld_raw(a.mimo_v.p, mv0 + r * a.mimo_v.s[1], a.mimo_v.dt);
        BB_UNROLL
        for (int r = 0; r < KR; ++r) mvr[r] = rt_raw_f(u[r], a.mimo_v.dt);
      });
      // (A runtime-dtype store: a few elements per thread, as segsum above.)
      const int64_t dv0 = int64_t{b} * a.dv.s[0] + int64_t{h} * a.dv.s[2] + p * a.dv.s[3];
      const int64_t ds1 = a.dv.s[1];
      for (int i = tid >> lgP; i < L; i += NT >> lgP) {
        float acc = 0.f;
        with_pow2(lgR, [&](auto kr) {
          constexpr int KR = decltype(kr)::value;
          // Rows i KR + r through a pointer stepped by ldx (the index was shifts per rank).
          const float* px = dx + i * KR * ldx + p;
          BB_UNROLL
          for (int r = 0; r < KR; ++r, px += ldx) acc += *px * mvr[r];
        });
        st(a.dv, dv0 + (s0 + i) * ds1, acc);
      }
    }
    if constexpr (QkGroup) {
      // The bulk copies of this thread's previous item complete and ordered before the
      // barrier (a last head below loads the sums they wrote; the next copy to the same rows
      // adds after them: only threads kBulkT0 .. kBulkT0 + 2 T - 1 issue any), and every
      // thread's writes to dqh / dkh ordered before this item's copies, which read them.
      if (static_cast<unsigned>(tid - kBulkT0) < 2u * AT::C * AT::R) {
        mimo::bulk_wait();
        mimo::fence_async_global();
      }
      mimo::fence_async_smem();
    }
    bb_sync();  // DQ, DK complete in dqh, dkh
    // The next chunk's phase-0 rows (their registers are free from here: see load_raw).
    if (raw_on && valid(next_of(item))) load_raw(next_of(item));
    // The next chunk's staged inputs, loaded here (SC::on) and stored after the DQ / DK stores
    // and the DMIMO_V partial: their latency under those two.
    StageRaw next_raw;
    if constexpr (SC::on)
      if (valid(next_of(item))) stage_load(next_of(item), next_raw);
    // Their valid rows (row = i R + r: output row (s0 + i) R + r = s0 R + row) to dq and dk in
    // one loop, four columns per task (one float4 read per source, one store per quad where the
    // layout allows: Args::vec_dq, vec_dk), the output dtype dispatched once (dq and dk share
    // it in every call of the op; else runtime-dtype stores per element).
    auto store_dq_dk = [&](auto store4) {
      const int lgQ = lgN - 2, nc = (tid & ((1 << lgQ) - 1)) * 4, rs = NT >> lgQ;
      const auto &vq = a.dq, &vk = a.dk;
      const int64_t sq = vq.s[1], sk = vk.s[1], snq = vq.s[3], snk = vk.s[3];
      const int64_t row0 = int64_t{s0} * R + (tid >> lgQ);
      int64_t oq = int64_t{b} * vq.s[0] + int64_t{h} * vq.s[2] + row0 * sq + nc * snq;
      int64_t ok = int64_t{b} * vk.s[0] + int64_t{h} * vk.s[2] + row0 * sk + nc * snk;
      for (int row = tid >> lgQ; row < TL; row += rs, oq += rs * sq, ok += rs * sk) {
        const int e = row * ldq + nc;
        store4(vq, oq, snq, a.vec_dq, *reinterpret_cast<const float4*>(dqh + e));
        store4(vk, ok, snk, a.vec_dk, *reinterpret_cast<const float4*>(dkh + e));
      }
    };
    if constexpr (QkGroup) {
      // The group sums (AT::kQkGroup): the running sums of this (b, group, chunk) live in the
      // per-head dq / dk rows of the group's first head (fp32, L2-resident). Every head but the
      // last hands its rows to the bulk copy engine (one row of N floats per thread of 2 TL from
      // kBulkT0): the first head's copied as they are, the next ones' added at L2 (each thread's
      // previous copy complete before it issues the next: bulk_wait before the barrier above,
      // so the adds keep head order). The last head loads the sums (L2), adds its rows and
      // rounds them into the caller's dq / dk [B, S, R, G, N]. The same values and order as
      // cb_qk: x_h0 + x_h1 + ... (subnormal sums aside: the L2's add flushes them). Why the
      // bulk engine: the same running sums through the threads' loads and stores (a 2 T N fp32
      // read and write per head) made K3 5-8% slower (H100, session 30); the engine reads the
      // rows from shared memory while the threads go on.
      const int hh = h - grp * a.HG;
      // Row `row` of this chunk's running sums in v (a.dq or a.dk): the group's first head's.
      auto sum_row = [&](const auto& v, int row) {
        return reinterpret_cast<float*>(v.p) + (int64_t{b} * v.s[0] + int64_t{h - hh} * v.s[2] +
                                                (int64_t{s0} * R + row) * v.s[1]);
      };
      if (hh + 1 < a.HG) {
        const int bt = tid - kBulkT0;
        if (static_cast<unsigned>(bt) < static_cast<unsigned>(2 * TL)) {
          const int w = bt >= TL ? 1 : 0, row = bt - w * TL;
          float* gp = sum_row(w ? a.dk : a.dq, row);
          const float* sp = (w ? dkh : dqh) + row * ldq;
          if (hh == 0)
            mimo::bulk_s2g(gp, sp, N * 4);
          else
            mimo::bulk_add_s2g(gp, sp, N * 4);
          mimo::bulk_commit();
        }
      } else {
        const int lgQ = lgN - 2, nc = (tid & ((1 << lgQ) - 1)) * 4, rs = NT >> lgQ;
        constexpr int KQ = (AT::C * AT::R * (AT::N / 4) + NT - 1) / NT;  // rows per thread, at most
        const int64_t sq = a.dq.s[1], sk = a.dk.s[1];
        const float* aq = sum_row(a.dq, tid >> lgQ) + nc;
        const float* ak = sum_row(a.dk, tid >> lgQ) + nc;
        // Every load before any add (the L2 round trips overlap).
        float4 yq[KQ], yk[KQ];
        BB_UNROLL
        for (int j = 0; j < KQ; ++j) {
          const int row = (tid >> lgQ) + j * rs;
          yq[j] = yk[j] = make_float4(0.f, 0.f, 0.f, 0.f);
          if (hh > 0 && row < TL) {
            yq[j] = mimo::ld_cg4(aq + j * rs * sq);
            yk[j] = mimo::ld_cg4(ak + j * rs * sk);
          }
        }
        auto add4 = [](float4 y, float4 x) {
          return make_float4(y.x + x.x, y.y + x.y, y.z + x.z, y.w + x.w);
        };
        BB_UNROLL
        for (int j = 0; j < KQ; ++j) {
          const int row = (tid >> lgQ) + j * rs;
          if (row < TL) {
            const int e = row * ldq + nc;
            const float4 xq = *reinterpret_cast<const float4*>(dqh + e);
            const float4 xk = *reinterpret_cast<const float4*>(dkh + e);
            yq[j] = hh > 0 ? add4(yq[j], xq) : xq;
            yk[j] = hh > 0 ? add4(yk[j], xk) : xk;
          }
        }
        // Row i R + r of the chunk is (t, r) = (s0 + i, r); a thread's rows share r (rs is a
        // multiple of R) and step by rs / R steps.
        const View &oq = a.dq_grp, &ok = a.dk_grp;
        const int r = (tid >> lgQ) & (R - 1);
        const int64_t t0 = s0 + ((tid >> lgQ) >> lgR), ts = rs >> lgR;
        const int64_t bq = b * oq.s[0] + t0 * oq.s[1] + r * oq.s[2] + grp * oq.s[3] + nc * oq.s[4];
        const int64_t bk = b * ok.s[0] + t0 * ok.s[1] + r * ok.s[2] + grp * ok.s[3] + nc * ok.s[4];
        auto out = [&](auto store4) {
          BB_UNROLL
          for (int j = 0; j < KQ; ++j) {
            const int row = (tid >> lgQ) + j * rs;
            if (row < TL) {
              store4(oq, bq + j * ts * oq.s[1], oq.s[4], yq[j]);
              store4(ok, bk + j * ts * ok.s[1], ok.s[4], yk[j]);
            }
          }
        };
        if (oq.dt == ok.dt) {
          with_dtype(oq.dt, [&](auto otag) {
            using TO = typename decltype(otag)::type;
            out([&](const View& v, int64_t off, int64_t sn, float4 x) {
              st4_t<TO>(v, off, sn, a.vec_grp, x);
            });
          });
        } else {
          out([&](const View& v, int64_t off, int64_t sn, float4 x) {
            st(v, off, x.x), st(v, off + sn, x.y), st(v, off + 2 * sn, x.z),
                st(v, off + 3 * sn, x.w);
          });
        }
      }
      // The bias partials of this (b, h, chunk): per (rank r, column n), the sum of its dq / dk
      // over the chunk's valid steps in step order from 0 (cb_qk's segment sums of a chunk),
      // into qk_part[w][b nch + c][r H N + h N + n]. Four columns per task (float4 reads of the
      // tile rows, one float4 store; per column the same sums in the same order as one column
      // per task: the same bits, a quarter of the shared-memory loads). 16-byte aligned: the
      // tile rows (ldq floats apart), and qk_part, a kAlign-aligned piece of the workspace.
      static_assert((AT::N + kPlanesPad) % 4 == 0, "float4 rows of dqh / dkh");
      const int64_t seg = int64_t{b} * a.nch + c, nseg = int64_t{a.B} * a.nch;
      const int lgQ = lgN - 2;
      for (int e = tid; e < (2 * R) << lgQ; e += NT) {
        const int w = e >> (lgR + lgQ), rq = e & ((R << lgQ) - 1);
        const int r = rq >> lgQ, n = (rq & ((1 << lgQ) - 1)) * 4;
        const float* src = (w ? dkh : dqh) + r * ldq + n;
        // In batches of up to 8 steps, each batch's loads before its adds.
        constexpr int U = AT::C < 8 ? AT::C : 8;
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
        BB_UNROLL
        for (int i0 = 0; i0 < AT::C; i0 += U) {
          float4 v[U];
          BB_UNROLL
          for (int j = 0; j < U; ++j)
            v[j] = *reinterpret_cast<const float4*>(src + (i0 + j) * R * ldq);
          BB_UNROLL
          for (int j = 0; j < U; ++j)
            if (i0 + j < L) sum.x += v[j].x, sum.y += v[j].y, sum.z += v[j].z, sum.w += v[j].w;
        }
        *reinterpret_cast<float4*>(
            a.qk_part + ((w * nseg + seg) * R + r) * (int64_t{a.H} << lgN) + (int64_t{h} << lgN) +
            n) = sum;
      }
    } else if (a.dq.dt == a.dk.dt) {
      with_dtype(a.dq.dt, [&](auto otag) {
        using TO = typename decltype(otag)::type;
        store_dq_dk([&](const auto& v, int64_t off, int64_t sn, int vec, float4 x) {
          st4_t<TO>(v, off, sn, vec, x);
        });
      });
    } else {
      store_dq_dk([&](const auto& v, int64_t off, int64_t sn, int, float4 x) {
        st(v, off, x.x), st(v, off + sn, x.y), st(v, off + 2 * sn, x.z), st(v, off + 3 * sn, x.w);
      });
    }
    // The chunk's DMIMO_V partial, sum_i dx[i R + r][p] v[b, s0 + i, h, p] (e = r P + p), in
    // this phase rather than before the barrier above (it reads dx and v only; dx lives over x
    // until the next chunk's phase 0): its serial chain of L global loads per thread kept the
    // warps that ran it (R P threads of 512) behind the others there. From the last thread down:
    // stage_chunk's segsum / qk_dot loads run on the first threads.
    for (int e = NT - 1 - tid; e < (R << lgP); e += NT) {
      const int r = e >> lgP, p = e & (P - 1);
      // dx row i R + r and v[b, s0 + i, h, p] through pointers stepped per step (the dx index
      // was formed by shifts, the v offset by a 64-bit multiply, per element); the same
      // elements, values (ld_t's) and summation order.
      const int64_t vs1 = a.v.s[1];
      const unsigned short* pv =
          reinterpret_cast<const unsigned short*>(a.v.p) + v0 + int64_t{s0} * vs1 + p * vs;
      const float* px = dx + r * ldx + p;
      float acc = 0.f;
      // One batch: the v loads of steps i0 .. i0 + U - 1 (those below n) issued before their
      // terms, then the terms in step order (the same terms and order as a step-by-step loop).
      auto batch = [&](auto u_tag, int i0, int n) {
        constexpr int U = decltype(u_tag)::value;
        unsigned short u[U];
        BB_UNROLL
        for (int j = 0; j < U; ++j) u[j] = i0 + j < n ? mimo::mb_ldg(pv + j * vs1) : 0;
        BB_UNROLL
        for (int j = 0; j < U; ++j, px += R * ldx)
          if (i0 + j < n) acc += *px * f_of_bits(u[j], DTag<bf16_t>{});
        pv += U * vs1;
      };
      bool whole_done = false;
      if constexpr (DmvBatch<AT>::u > 0) {
        // A whole chunk (L = C, compile-time): DmvBatch::u loads per batch, unpredicated.
        constexpr int U = DmvBatch<AT>::u;
        if (L == C) {
          BB_UNROLL
          for (int i0 = 0; i0 < C; i0 += U) batch(std::integral_constant<int, U>{}, i0, C);
          whole_done = true;
        }
      }
      // Any chunk length (the generic kernel; the specialised kernels' partial chunks): eight
      // loads per batch, predicated (the rolled loop before, four steps per trip, waited an L2
      // round trip per trip). Measured (H100, session 29, generic K3 via
      // MAMBA3_BB_SPECIALIZED=0): N128 R4 C16 -1.3%, R1 C64 -0.6%, R2 C32 +0.2%.
      if (!whole_done)
        for (int i0 = 0; i0 < L; i0 += 8) batch(std::integral_constant<int, 8>{}, i0, L);
      a.ws_part[item * (static_cast<int64_t>(R) * P) + e] = acc;
    }
    // The next chunk's per-step inputs (their last readers, the DQ / DK loop, are behind the
    // barrier above; the store loop reads only dqh, dkh).
    if (valid(next_of(item))) {
      if constexpr (SC::on)
        stage_store(next_of(item), next_raw);
      else
        stage_chunk(next_of(item));
    }
    // (QkGroup: dqh / dkh, which the bulk copies read, are rewritten from the next chunk's
    // phase 0 on.)
    if constexpr (QkGroup) mimo::bulk_wait_read();
    bb_sync();  // shared memory is rewritten for the next chunk; the staged inputs are visible
  }
  if constexpr (QkGroup) mimo::bulk_wait();
}

}  // namespace mamba3::cuda::bb
