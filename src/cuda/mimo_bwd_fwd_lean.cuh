// The lean chunk pass of mamba3_mimo_bwd_fwd: bf16 I/O on tensor cores with pre-split operands.
// Included by mimo_bwd_fwd.cu after mimo_bwd_fwd_kernels.cuh (same arguments, plan, segments,
// epilogue and partial sums; only the per-chunk products differ).
//
// Why a second path: the general kernels keep fp32 tiles and split every operand into 3xTF32 at
// each use, read inputs with per-element runtime-typed loads and index arithmetic, and spent
// ~142K warp instructions per (b, h, chunk) at the reference shape (ncu, 2026-11-30), of which
// mma were 4%. Here each operand is rounded once, when its tile is built, into a bf16 pair
// x = hi + lo (hi = bf16(x), lo = bf16(x - hi)) stored as two planes in shared memory; the
// products read fragments with ldmatrix and run three bf16 mma.sync m16n8k16 per tile product
// (hi*hi + hi*lo + lo*hi: ~2^-17 relative error per product, far below the bf16 tolerance's
// rounding-noise floor of 1e-4, and every sum accumulates in fp32). The running state lives in
// the mma accumulators (registers) across chunks; its bf16 planes feed the readout.
//
// Per chunk c of a segment (T = C R rows i = t R + r, all tiles row-major, rows padded by 8
// elements so that the 8 rows of an ldmatrix hit distinct banks):
//   Qh, Kh [T][N]   biased, rotated q and k
//   X, Xw  [T][P]   x = v * mimo_v and x times the state-update weight
//   Sc     [T][T]   masked, weighted scores (gamma qk_dot + D on the step diagonal)
//   St     [N][P]   the state entering the chunk (planes of the register state)
//   Y      [T][P]   fp32 readout handed to the shared epilogue
// Scores = Qh Kh^T; Y = diag(exp(da_cs)) Qh St + Sc X; St' = e St + Kh^T Xw.
#pragma once

#include <type_traits>

#include "cuda/bf16_split_mma.cuh"
#include "cuda/mimo_bwd_fwd_kernels.cuh"

namespace mamba3::cuda::mimo {

// Every function here that depends on the thread count takes it as NT (256 or 512: the plan's
// MbPlan::nt), not kNT; NT / 32 warps share the tile loops.

// ------------------------------------------------------------------ layout

// Float offsets of the bf16 planes (each region: hi plane then lo plane).
struct LeanTiles {
  int ldN, ldP, ldT;  // row strides in elements
  SplitTile Qh, Kh, X, Xw, St, Sc;
};

template <class AT>
MB_DEV LeanTiles lean_tiles(const AT& a, const MbLayout& L, float* sm) {
  LeanTiles t;
  t.ldN = a.N + 8, t.ldP = a.P + 8, t.ldT = a.Tb + 8;
  auto tile = [&](int off, int rows, int ld) {
    SplitTile s;
    s.h = reinterpret_cast<__nv_bfloat16*>(sm + off);
    s.plane = rows * ld;
    s.ld = ld;
    return s;
  };
  t.Qh = tile(L.QhT, a.Tb, t.ldN);
  t.Kh = tile(L.KhT, a.Tb, t.ldN);
  t.X = tile(L.X, a.Tb, t.ldP);
  t.Xw = tile(L.Khw, a.Tb, t.ldP);
  t.St = tile(L.St, a.N, t.ldP);
  t.Sc = tile(L.ScT, a.Tb, t.ldT);
  return t;
}

// ------------------------------------------------------------------ helpers

// Every loop below reads the MbArgs fields it needs into locals first, dispatches the dtype and
// the load layout once per loop (not per element), and indexes with shifts: the lean plan
// guarantees power-of-two C, R, P and T = C R (make_mimo_plan), and A a multiple of 4
// (rotary_dim_divisor 2 or 4, N a multiple of 16). The per-element versions of these loops
// (64-bit offsets from four or five runtime strides, a runtime layout branch per load, a dtype
// switch per store, divisions by runtime sizes) made the chunk pass instruction-bound.

// log2 of a power of two.
MB_DEV int mb_lg2(int x) {
#if defined(__CUDA_ARCH__)
  return __ffs(x) - 1;
#else
  return __builtin_ctz(static_cast<unsigned>(x));
#endif
}

// Calls f(std::integral_constant<int, DT>) for the dtype code dt (0 f16, 1 bf16, 2 f32).
template <class F>
MB_DEV void with_dt(int dt, F&& f) {
  if (dt == 2) f(std::integral_constant<int, 2>{});
  else if (dt == 1) f(std::integral_constant<int, 1>{});
  else f(std::integral_constant<int, 0>{});
}

// Element off of a tensor of dtype DT := v (rounded to nearest), as rt_st.
template <int DT>
MB_DEV void st_t(unsigned char* p, int64_t off, float v) {
  if constexpr (DT == 2) {
    reinterpret_cast<float*>(p)[off] = v;
  } else if constexpr (DT == 1) {
    reinterpret_cast<unsigned short*>(p)[off] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  } else {
    reinterpret_cast<unsigned short*>(p)[off] = __half_as_ushort(__float2half_rn(v));
  }
}

// Elements off, off + 1 := v0, v1 in one store (off even, base aligned to the pair).
template <int DT>
MB_DEV void st2_t(unsigned char* p, int64_t off, float v0, float v1) {
  if constexpr (DT == 2) {
    *reinterpret_cast<float2*>(reinterpret_cast<float*>(p) + off) = make_float2(v0, v1);
  } else if constexpr (DT == 1) {
    *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<__nv_bfloat16*>(p) + off) =
        __floats2bfloat162_rn(v0, v1);
  } else {
    *reinterpret_cast<__half2*>(reinterpret_cast<__half*>(p) + off) = __floats2half2_rn(v0, v1);
  }
}

// Four bf16 elements (stride st apart) as raw bits: LM 2 one 8-byte load (a.lean_ld 2: unit last
// strides, other strides multiples of 4, 8-byte aligned bases), LM 1 two 4-byte loads (pairs),
// LM 0 four 2-byte loads. All give the same values, so the results do not depend on the layout
// (bitwise).
template <int LM>
MB_DEV uint2 ld_raw4(const unsigned short* e, int64_t st) {
  uint2 u;
  if constexpr (LM == 2) {
    u = mb_ldg(reinterpret_cast<const uint2*>(e));
  } else if constexpr (LM == 1) {
    u.x = mb_ldg(reinterpret_cast<const unsigned int*>(e));
    u.y = mb_ldg(reinterpret_cast<const unsigned int*>(e + 2));
  } else {
    u.x = static_cast<uint32_t>(mb_ldg(e)) | (static_cast<uint32_t>(mb_ldg(e + st)) << 16);
    u.y = static_cast<uint32_t>(mb_ldg(e + 2 * st)) | (static_cast<uint32_t>(mb_ldg(e + 3 * st)) << 16);
  }
  return u;
}

// Calls f(std::integral_constant<int, LM>) for the load layout a.lean_ld.
template <class F>
MB_DEV void with_ld(int lm, F&& f) {
  if (lm == 2) f(std::integral_constant<int, 2>{});
  else if (lm == 1) f(std::integral_constant<int, 1>{});
  else f(std::integral_constant<int, 0>{});
}

// Element e of a staged bf16 row region.
MB_DEV float st_bf(const float* region, int e) {
  return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(region)[e]);
}

// st_split2 with split2f.
MB_DEV void st_split2f(__nv_bfloat16* base, int plane, int e, float x0, float x1) {
  uint32_t hi, lo;
  split2f(x0, x1, hi, lo);
  *reinterpret_cast<uint32_t*>(base + e) = hi;
  *reinterpret_cast<uint32_t*>(base + plane + e) = lo;
}

// Stores the split quad (x0 .. x3) at element e (a multiple of 4) of the hi plane (lo plane
// `plane` elements later, also a multiple of 4): one 8-byte store per plane.
MB_DEV void st_split4(__nv_bfloat16* base, int plane, int e, float x0, float x1, float x2, float x3) {
  uint2 hi, lo;
  split2f(x0, x1, hi.x, lo.x);
  split2f(x2, x3, hi.y, lo.y);
  *reinterpret_cast<uint2*>(base + e) = hi;
  *reinterpret_cast<uint2*>(base + plane + e) = lo;
}

// ------------------------------------------------------------------ tile builders

// cos / sin of chunk c's angles into the table ang[2][C][A] (rows past the sequence: 1 / 0).
// Once per chunk and step, not once per rank and tile row.
template <int NT, int G = 4, class AT>
MB_DEV void lean_chunk_angles(const AT& a, const MbLayout& L, float* sm, const MbCta& k, int c) {
  if (L.ang < 0) return;  // no room for the table: lean_build_qk computes them itself
  const int s0 = c * a.C, Lc = min(a.C, a.S - s0), A = a.A, CA = a.C * A;
  const bool pow2 = (A & (A - 1)) == 0;
  const int lgA = pow2 ? mb_lg2(A) : 0;
  const auto& v = a.angles;
  using O = mb_off_t<decltype(v)>;
  const O s1 = v.s[1], s3 = v.s[3];
  const O base = k.b * v.s[0] + static_cast<O>(s0) * s1 + k.h * v.s[2];
  float* cst = sm + L.ang;
  // A thread's elements in groups of G (4; 1 with 8 state tiles per warp, at their register
  // limit): the group's angle loads first, then the sincosf. Why: one at a time each load
  // waited for the previous element's sincosf (C A = 4 NT at N128 R1 C64: four memory round
  // trips in series after lean_y's barrier). The same values.
  with_dt(v.dt, [&](auto D) {
    constexpr int DT = decltype(D)::value;
    for (int e0 = mb_tid(); e0 < CA; e0 += G * NT) {
      float x[G];
#pragma unroll
      for (int j = 0; j < G; ++j) {
        const int e = e0 + j * NT, t = pow2 ? e >> lgA : e / A, n = e - t * A;
        x[j] = 0.f;
        if (e < CA && t < Lc) x[j] = mb_ldt<DT>(v.p, base + t * s1 + n * s3, v.dt);
      }
      // One rolled sincosf (as lean_build_qk_t: inlined copies need registers); the group's
      // values shift down so that every index is a constant (registers, not local memory).
#pragma unroll 1
      for (int j = 0; j < G; ++j) {
        const int e = e0 + j * NT, t = pow2 ? e >> lgA : e / A;
        if (e >= CA) break;
        float sn = 0.f, cs = 1.f;
        if (t < Lc) sincosf(x[0], &sn, &cs);
        cst[e] = cs;
        cst[CA + e] = sn;
#pragma unroll
        for (int i = 0; i + 1 < G; ++i) x[i] = x[i + 1];
      }
    }
  });
}

// Chunk c's scalars (chunk_scalars) and cos / sin table (lean_chunk_angles) in two halves: the
// global loads into registers (lean_chunk_pre_load), issued a phase ahead, and the rest
// (lean_chunk_pre_store) after the barrier that follows their last reads. Why: K3 built them
// after lean_y's barrier, where each warp then waited on its angle load (and warp 0 first on
// the scalar loads, then on its angle load: two memory latencies in series) before the
// epilogue, and every other warp waited for warp 0 at the epilogue's exchange barrier (its
// largest barrier stall, ncu). The same loads and expressions: the same bits. The table's
// loads move only with C A <= NT (one element per thread; every shape of SPEC.md's grid);
// otherwise lean_chunk_angles runs whole in the store half.
struct LeanChunkPre {
  ChunkScalarsRaw sc;
  float ang;  // element mb_tid() of chunk c's angles [C][A] (0 past the sequence)
};

template <int NT, class AT>
MB_DEV LeanChunkPre lean_chunk_pre_load(const AT& a, const MbLayout& L, const MbCta& k, int c) {
  LeanChunkPre r;
  r.sc = a.scal_f32 ? chunk_scalars_load<2>(a, k, c) : chunk_scalars_load<-1>(a, k, c);
  r.ang = 0.f;
  const int A = a.A, CA = a.C * A, e = mb_tid();
  if (L.ang < 0 || CA > NT || e >= CA) return r;
  const int s0 = c * a.C, Lc = min(a.C, a.S - s0);
  const bool pow2 = (A & (A - 1)) == 0;
  const int t = pow2 ? e >> mb_lg2(A) : e / A, n = e - t * A;
  if (t >= Lc) return r;
  const auto& v = a.angles;
  using O = mb_off_t<decltype(v)>;
  const O off = k.b * v.s[0] + static_cast<O>(s0 + t) * v.s[1] + k.h * v.s[2] + n * v.s[3];
  with_dt(v.dt, [&](auto D) { r.ang = mb_ldt<decltype(D)::value>(v.p, off, v.dt); });
  return r;
}

template <int NT, class AT>
MB_DEV void lean_chunk_pre_store(const AT& a, const MbLayout& L, float* sm, const MbCta& k, int c,
                                 const LeanChunkPre& r) {
  if (a.scal_f32) chunk_scalars_store<2>(a, L, sm, c, r.sc);
  else chunk_scalars_store<-1>(a, L, sm, c, r.sc);
  if (L.ang < 0) return;
  const int A = a.A, CA = a.C * A, e = mb_tid();
  if (CA > NT) {
    lean_chunk_angles<NT>(a, L, sm, k, c);
    return;
  }
  if (e >= CA) return;
  const int s0 = c * a.C, Lc = min(a.C, a.S - s0);
  const bool pow2 = (A & (A - 1)) == 0;
  const int t = pow2 ? e >> mb_lg2(A) : e / A;
  float sn = 0.f, cs = 1.f;
  if (t < Lc) sincosf(r.ang, &sn, &cs);
  float* cst = sm + L.ang;
  cst[e] = cs;
  cst[CA + e] = sn;
}

// Asks L2 for the rows chunk c's builds will read: k (and with Q, q) [C R rows of N], v [C of
// P], with X the gate's z [C of P], dout [C, or C R, of P] and (a full chunk) the segsum rows
// of the weights [C of C], the angles [C of A]. Called one
// chunk ahead (why: every chunk's builds otherwise waited on HBM for their rows before any
// product could start; the second pass's K3 gained 4-7% from the same hint). One row per task;
// a row's lines by its 128-byte spans (by elements where the columns are strided). Rows past
// the sequence are not touched. REV: the threads from the last down (task e on thread
// NT - 1 - e; K3 calls it before lean_scores, whose masked tiles lie on the last warps).
template <int NT, bool Q, bool X, bool REV = false, class AT>
MB_DEV void lean_prefetch_chunk(const AT& a, const MbCta& k, int c) {
  // The views through the base (MbArgsCT<.., true> keeps its runtime views filled, the same
  // values): one pointer type for the rows of different tensors.
  const MbArgs& b = a;
  const int s0 = c * a.C, Lc = min(a.C, a.S - s0), R = a.R, lgR = a.lgR, LR = Lc * R;
  const bool hz = X && a.has_z, ro = a.reduce_o;
  const int g_k = LR, g_q = g_k + (Q ? LR : 0), g_v = g_q + Lc, g_z = g_v + (hz ? Lc : 0),
            g_d = g_z + (X ? (ro ? Lc : LR) : 0), g_a = g_d + (b.angles.p ? Lc : 0),
            g_s = g_a + (X && Lc == a.C ? a.C : 0);
  for (int e = REV ? NT - 1 - mb_tid() : mb_tid(); e < g_s; e += NT) {
    const MbView* v;
    int64_t off, stride;
    int cnt;
    if (e < g_q) {  // [B, S, R, G, N]
      const int row = e < g_k ? e : e - g_k, t = row >> lgR, r = row & (R - 1);
      v = e < g_k ? &b.k : &b.q;
      off = k.b * v->s[0] + (s0 + t) * v->s[1] + r * v->s[2] + k.g * v->s[3];
      stride = v->s[4], cnt = a.N;
    } else if (e < g_z) {  // v, z [B, S, H, P]
      v = e < g_v ? &b.v : &b.z;
      off = k.b * v->s[0] + (s0 + e - (e < g_v ? g_q : g_v)) * v->s[1] + k.h * v->s[2];
      stride = v->s[3], cnt = a.P;
    } else if (e < g_d) {  // dout [B, S, H, P] (reduce-O) or [B, S, R, H, P]
      const MbView& o = b.dout;
      const int row = e - g_z;
      v = &o, cnt = a.P;
      if (ro) {
        off = k.b * o.s[0] + (s0 + row) * o.s[1] + k.h * o.s[2], stride = o.s[3];
      } else {
        off = k.b * o.s[0] + (s0 + (row >> lgR)) * o.s[1] + (row & (R - 1)) * o.s[2] +
              k.h * o.s[3];
        stride = o.s[4];
      }
    } else if (e < g_a) {  // angles [B, S, H, A]
      v = &b.angles, cnt = a.A;
      off = k.b * v->s[0] + (s0 + e - g_d) * v->s[1] + k.h * v->s[2], stride = v->s[3];
    } else {  // segsum [B, H, nch, C, C], row t (lean_chunk_weights reads its s < t)
      v = &b.segsum, cnt = a.C;
      off = k.b * v->s[0] + k.h * v->s[1] + static_cast<int64_t>(c) * v->s[2] + (e - g_a) * v->s[3];
      stride = v->s[4];
    }
    mb_prefetch_row(v->p, v->dt == 2 ? 4 : 2, off, stride, cnt);
  }
}

// Qh (if Q) and Kh of chunk c: biased, rotated, split. One task = four adjacent columns
// n .. n + 3 of one row i = t R + r and their rotation partners n + N/2 ..; A is a multiple of
// 4, so a task's columns rotate together. Loads of four elements as LM (a.lean_ld).
// The raw quads of a thread's first two tasks (lean_build_qk_t's MODE 1 / 2).
struct LeanQkRaw {
  uint2 ka, kb, qa, qb;
};
struct LeanQkPre {
  LeanQkRaw u0, u1;
};

// MODE 0: the whole build. MODE 1: only the loads of the thread's first pair of tasks, into
// *pre (K3 issues them with the other builds' loads, then computes: one L2 round trip for
// all of them). MODE 2: the build, the first pair from *pre. Tasks in pairs (PAIR; K3) load
// both tasks first; without PAIR (K1, where the pairs measured slower) one task at a time.
template <int NT, bool K, bool Q, int LM, int MODE = 0, bool PAIR = Q, class AT>
MB_DEV void lean_build_qk_t(const AT& a, const MbLayout& L, float* sm, const LeanTiles& tt,
                            const MbCta& k, int c, LeanQkPre* pre = nullptr) {
  const int s0 = c * a.C, Lc = min(a.C, a.S - s0);
  const int N = a.N, half = a.half, A = a.A, lgR = a.lgR, Rm = a.R - 1, T = a.Tb, ldN = tt.ldN;
  const int CA = a.C * A, ang = L.ang;
  // Pointers at the chunk's first step (this CTA's batch and group); a task adds its step, rank
  // and column offsets. LM > 0 implies unit column strides (constants: fewer live registers).
  using O = mb_off_t<decltype(a.k)>;
  static_assert(std::is_same_v<O, mb_off_t<decltype(a.q)>>, "q, k: one offset type");
  const O ks1 = a.k.s[1], ks2 = a.k.s[2], ksn = LM > 0 ? 1 : a.k.s[4], kh = half * ksn;
  const O qs1 = a.q.s[1], qs2 = a.q.s[2], qsn = LM > 0 ? 1 : a.q.s[4], qh = half * qsn;
  const unsigned short* kc = reinterpret_cast<const unsigned short*>(a.k.p) +
                             (k.b * a.k.s[0] + s0 * ks1 + k.g * a.k.s[3]);
  const unsigned short* qc = reinterpret_cast<const unsigned short*>(a.q.p) +
                             (Q ? k.b * a.q.s[0] + s0 * qs1 + k.g * a.q.s[3] : 0);
  const float* kbias = sm + L.kb;
  const float* qbias = sm + L.qb;
  // A task's raw bf16 quads: k and q at columns n.. and half + n.. (zero past the sequence).
  using Raw = LeanQkRaw;
  auto load = [&](int i, O koff, O qoff) {
    const uint2 z = make_uint2(0u, 0u);
    Raw u{z, z, z, z};
    if ((i >> lgR) < Lc) {
      const unsigned short* kp = kc + koff;
      if (K) u.ka = ld_raw4<LM>(kp, ksn), u.kb = ld_raw4<LM>(kp + kh, ksn);
      if (Q) {
        const unsigned short* qp = qc + qoff;
        u.qa = ld_raw4<LM>(qp, qsn), u.qb = ld_raw4<LM>(qp + qh, qsn);
      }
    }
    return u;
  };
  // raw(): the task's quads, called after the angles are read (one task at a time the loads
  // then follow the angles, as before the pairs: fewer live values where sincosf runs).
  auto task = [&](int i, int n, auto&& raw) {
    const int t = i >> lgR, r = i & Rm;
    // The angles first: without the table, sincosf's slow path then runs with few live values.
    float4 cs = make_float4(1.f, 1.f, 1.f, 1.f), sn = make_float4(0.f, 0.f, 0.f, 0.f);
    if (n < A) {
      if (ang >= 0) {
        const int e = t * A + n;
        cs = *reinterpret_cast<const float4*>(sm + ang + e);
        sn = *reinterpret_cast<const float4*>(sm + ang + CA + e);
      } else if (t < Lc) {
        // One rolled sincosf (its slow path needs many registers; four inlined copies spilled
        // with the 8-tile states).
#pragma unroll 1
        for (int j = 0; j < 4; ++j) {
          float sv, cv;
          // (The base's runtime view: ld4 takes an MbView; the same value.)
          sincosf(ld4(static_cast<const MbArgs&>(a).angles, k.b, s0 + t, k.h, n + j), &sv, &cv);
          if (j == 0) cs.x = cv, sn.x = sv;
          else if (j == 1) cs.y = cv, sn.y = sv;
          else if (j == 2) cs.z = cv, sn.z = sv;
          else cs.w = cv, sn.w = sv;
        }
      }
    }
    float4 k1 = make_float4(0.f, 0.f, 0.f, 0.f), k2 = k1, q1 = k1, q2 = k1;
    const Raw u = raw();
    if (t < Lc) {
      // Raw bf16 quads (columns n.., half + n..) plus the bias row of rank r.
      auto biased = [&](uint2 ua, uint2 ub, const float* bias, float4& x1, float4& x2) {
        const float4 fa = bf4_f(ua), fb = bf4_f(ub);
        const float4 ba = *reinterpret_cast<const float4*>(bias + r * N + n);
        const float4 bb = *reinterpret_cast<const float4*>(bias + r * N + n + half);
        x1 = make_float4(fa.x + ba.x, fa.y + ba.y, fa.z + ba.z, fa.w + ba.w);
        x2 = make_float4(fb.x + bb.x, fb.y + bb.y, fb.z + bb.z, fb.w + bb.w);
      };
      if (K) biased(u.ka, u.kb, kbias, k1, k2);
      if (Q) biased(u.qa, u.qb, qbias, q1, q2);
    }
    // (a, b) -> (a cos - b sin, a sin + b cos) on the pairs (n, n + N/2). Which product is
    // fused is fixed (mb_fma_rn, as the second pass's planes K1): left to nvcc, it chose
    // differently in the copies whose builds issue their loads in pairs, whose Kh / Qh bits
    // then differed from the generic kernels'.
    auto rot = [](const float4& x1, const float4& x2, const float4& c, const float4& s,
                  float4& y1, float4& y2) {
      y1.x = mb_fma_rn(x1.x, c.x, -mb_fmul_rn(x2.x, s.x));
      y1.y = mb_fma_rn(x1.y, c.y, -mb_fmul_rn(x2.y, s.y));
      y1.z = mb_fma_rn(x1.z, c.z, -mb_fmul_rn(x2.z, s.z));
      y1.w = mb_fma_rn(x1.w, c.w, -mb_fmul_rn(x2.w, s.w));
      y2.x = mb_fma_rn(x1.x, s.x, mb_fmul_rn(x2.x, c.x));
      y2.y = mb_fma_rn(x1.y, s.y, mb_fmul_rn(x2.y, c.y));
      y2.z = mb_fma_rn(x1.z, s.z, mb_fmul_rn(x2.z, c.z));
      y2.w = mb_fma_rn(x1.w, s.w, mb_fmul_rn(x2.w, c.w));
    };
    const int e1 = i * ldN + n, e2 = e1 + half;
    float4 y1, y2;
    if (K) {
      rot(k1, k2, cs, sn, y1, y2);
      st_split4(tt.Kh.h, tt.Kh.plane, e1, y1.x, y1.y, y1.z, y1.w);
      st_split4(tt.Kh.h, tt.Kh.plane, e2, y2.x, y2.y, y2.z, y2.w);
    }
    if (Q) {
      rot(q1, q2, cs, sn, y1, y2);
      st_split4(tt.Qh.h, tt.Qh.plane, e1, y1.x, y1.y, y1.z, y1.w);
      st_split4(tt.Qh.h, tt.Qh.plane, e2, y2.x, y2.y, y2.z, y2.w);
    }
  };
  auto koff = [&](int i, int n) { return (i >> lgR) * ks1 + (i & Rm) * ks2 + n * ksn; };
  auto qoff = [&](int i, int n) { return Q ? (i >> lgR) * qs1 + (i & Rm) * qs2 + n * qsn : 0; };
  const int qd = half >> 2;  // tasks per row
  if (NT % qd == 0) {  // each thread keeps its columns (qd is a power of two): no division
    const int lg = mb_lg2(qd), n = (mb_tid() & (qd - 1)) << 2, step = NT >> lg;
    const int i0 = mb_tid() >> lg;
    if (PAIR && (step & Rm) == 0) {  // and its rank: the offsets advance by step / R steps
      // Two tasks at a time, both tasks' loads first. Why: one task at a time, each task's
      // compute and stores waited for its loads before the next task's loads were issued: one
      // L2 round trip per task in series (two per chunk at most 512-thread shapes of the grid),
      // with every warp of the CTA waiting at once. The same values and stores.
      const O dk = (step >> lgR) * ks1, dq = (step >> lgR) * qs1;
      O ko = koff(i0, n), qo = qoff(i0, n);
      bool first = true;
      for (int i = i0; i < T; i += 2 * step, ko += 2 * dk, qo += 2 * dq, first = false) {
        const bool two = i + step < T;
        Raw u0, u1;
        if (MODE == 2 && first) {
          u0 = pre->u0, u1 = pre->u1;
        } else {
          u0 = load(i, ko, qo);
          u1 = two ? load(i + step, ko + dk, qo + dq) : Raw{};
        }
        if constexpr (MODE == 1) {
          pre->u0 = u0, pre->u1 = u1;
          return;
        } else {
          task(i, n, [&] { return u0; });
          if (two) task(i + step, n, [&] { return u1; });
        }
      }
      return;
    }
    if constexpr (MODE != 1) {  // (MODE 1 loads nothing here; MODE 2 then loads as MODE 0)
      if ((step & Rm) == 0) {
        const O dk = (step >> lgR) * ks1, dq = (step >> lgR) * qs1;
        O ko = koff(i0, n), qo = qoff(i0, n);
        for (int i = i0; i < T; i += step, ko += dk, qo += dq)
          task(i, n, [&] { return load(i, ko, qo); });
      } else {
        for (int i = i0; i < T; i += step) task(i, n, [&] { return load(i, koff(i, n), qoff(i, n)); });
      }
    }
  } else if constexpr (MODE != 1) {
    for (int u = mb_tid(); u < T * qd; u += NT) {
      const int i = u / qd, n = (u - i * qd) << 2;
      task(i, n, [&] { return load(i, koff(i, n), qoff(i, n)); });
    }
  }
}

// SPLIT: Kh and Qh in two passes (fewer live registers: the 8-tile states).
template <int NT, bool Q, bool SPLIT = false, class AT>
MB_DEV void lean_build_qk(const AT& a, const MbLayout& L, float* sm, const LeanTiles& tt,
                          const MbCta& k, int c) {
  with_ld(a.lean_ld, [&](auto M) {
    constexpr int LM = decltype(M)::value;
    if constexpr (Q && SPLIT) {  // one task at a time (the pairs' registers)
      lean_build_qk_t<NT, true, false, LM, 0, false>(a, L, sm, tt, k, c);
      lean_build_qk_t<NT, false, true, LM, 0, false>(a, L, sm, tt, k, c);
    } else {
      lean_build_qk_t<NT, true, Q, LM>(a, L, sm, tt, k, c);
    }
  });
}

// X = v * mimo_v (if X) and Xw = X * w (state-update weight) of chunk c, split; with X, also
// stages the epilogue's z and dout rows (raw bf16, exact; two per float of shared memory) so
// that their loads overlap the tile loads instead of stalling the epilogue. One task = four
// adjacent columns p .. p + 3 of one step t and a group of R / G ranks: with fewer than NT
// (step, column) pairs, each pair's ranks are split over G threads (G a power of two <= R, the
// most with G C P / 4 <= NT); group 0 stages z and, with reduce-O, group G - 1 dout. Why: with
// every rank on one thread, at C = 8 the X build (R rank rows per task: 8 at R = 8) ran on the
// first C P / 4 threads only (4 of 16 warps at P = 64) and held every other warp at the
// barrier that ends the builds. The same values (each element's products as before).
// MODE as lean_build_qk_t's: 1 loads the thread's first step's v, z and (reduce-O) dout into
// *pre, 2 builds with them.
struct LeanXPre {
  uint2 v, z, d;
};
template <int NT, bool X, int LM, bool SPLIT = true, int MODE = 0, class AT>
MB_DEV void lean_build_x_t(const AT& a, const MbLayout& L, float* sm, const LeanTiles& tt,
                           const MbCta& k, int c, LeanXPre* pre = nullptr) {
  const int s0 = c * a.C, Lc = min(a.C, a.S - s0), C = a.C, R = a.R, P = a.P, Ppt = a.Ppt;
  const int ldP = tt.ldP, lg = a.lgP - 2;  // P / 4 tasks per step (P a power of two >= 16)
  int lgG = 0;
  while (SPLIT && (C << (lg + lgG + 1)) <= NT && (2 << lgG) <= R) ++lgG;
  const int G = 1 << lgG, RG = R >> lgG, lgt = lg + lgG;
  const int grp = (mb_tid() >> lg) & (G - 1), r0 = grp * RG;
  const int p = (mb_tid() & ((P >> 2) - 1)) << 2;
  const bool hz = a.has_z, ro = a.reduce_o;
  // LM > 0 implies unit column strides.
  using O = mb_off_t<decltype(a.v)>;
  static_assert(std::is_same_v<O, mb_off_t<decltype(a.z)>> &&
                std::is_same_v<O, mb_off_t<decltype(a.dout)>>, "v, z, dout: one offset type");
  const O vs1 = a.v.s[1], vsp = LM > 0 ? 1 : a.v.s[3];
  const unsigned short* vc = reinterpret_cast<const unsigned short*>(a.v.p) +
                             (k.b * a.v.s[0] + s0 * vs1 + k.h * a.v.s[2] + p * vsp);
  O zs1 = 0, zsp = 0, ds1 = 0, dsr = 0, dsp = 0;
  const unsigned short* zc = nullptr;
  const unsigned short* dc = nullptr;
  if (X) {
    if (hz) {
      zs1 = a.z.s[1], zsp = LM > 0 ? 1 : a.z.s[3];
      zc = reinterpret_cast<const unsigned short*>(a.z.p) +
           (k.b * a.z.s[0] + s0 * zs1 + k.h * a.z.s[2] + p * zsp);
    }
    const auto& o = a.dout;
    ds1 = o.s[1];
    if (ro) {  // [B, S, H, P]
      dsp = LM > 0 ? 1 : o.s[3];
      dc = reinterpret_cast<const unsigned short*>(o.p) + (k.b * o.s[0] + s0 * ds1 + k.h * o.s[2] + p * dsp);
    } else {  // [B, S, R, H, P]
      dsr = o.s[2], dsp = LM > 0 ? 1 : o.s[4];
      dc = reinterpret_cast<const unsigned short*>(o.p) + (k.b * o.s[0] + s0 * ds1 + k.h * o.s[3] + p * dsp);
    }
  }
  uint2* zs = reinterpret_cast<uint2*>(sm + L.zs);
  uint2* ds = reinterpret_cast<uint2*>(sm + L.ds);
  bool first = true;
  for (int t = mb_tid() >> lgt; t < C; t += NT >> lgt, first = false) {
    const bool valid = t < Lc;
    const uint2 zero = make_uint2(0u, 0u);
    uint2 vr, zr = zero, dr = zero;
    if (MODE == 2 && first) {
      vr = pre->v, zr = pre->z, dr = pre->d;
    } else {
      vr = valid ? ld_raw4<LM>(vc + t * vs1, vsp) : zero;
      // z and (reduce-O) dout loaded before either staging store. Why: each store waited for
      // its own load before the next load was issued: two L2 round trips in series.
      if (X) {
        zr = grp == 0 && hz && valid ? ld_raw4<LM>(zc + t * zs1, zsp) : zero;
        dr = ro && grp == G - 1 && valid ? ld_raw4<LM>(dc + t * ds1, dsp) : zero;
      }
    }
    if constexpr (MODE == 1) {
      pre->v = vr, pre->z = zr, pre->d = dr;
      return;
    }
    if (X) {
      if (grp == 0) zs[(t * P + p) >> 2] = zr;
      if (ro) {
        if (grp == G - 1) ds[(t * P + p) >> 2] = dr;
      } else {
        for (int r = r0; r < r0 + RG; ++r)
          ds[((t * R + r) * P + p) >> 2] = valid ? ld_raw4<LM>(dc + t * ds1 + r * dsr, dsp) : zero;
      }
    }
    const float4 vv = bf4_f(vr);
    const float w = sm[L.wk + t];
    for (int r = r0; r < r0 + RG; ++r) {
      const float4 mv = *reinterpret_cast<const float4*>(sm + L.mv + r * Ppt + p);
      const float x0 = vv.x * mv.x, x1 = vv.y * mv.y, x2 = vv.z * mv.z, x3 = vv.w * mv.w;
      const int e = (t * R + r) * ldP + p;
      if (X) st_split4(tt.X.h, tt.X.plane, e, x0, x1, x2, x3);
      st_split4(tt.Xw.h, tt.Xw.plane, e, x0 * w, x1 * w, x2 * w, x3 * w);
    }
  }
}

// SPLIT false: every rank on one thread (K3 with 8 state tiles per warp, at its register limit:
// the split spilled there).
template <int NT, bool X, bool SPLIT = true, class AT>
MB_DEV void lean_build_x(const AT& a, const MbLayout& L, float* sm, const LeanTiles& tt,
                         const MbCta& k, int c) {
  with_ld(a.lean_ld, [&](auto M) {
    lean_build_x_t<NT, X, decltype(M)::value, SPLIT>(a, L, sm, tt, k, c);
  });
}

// Intra-chunk weights W[t][s] = tscale_s exp(segsum[t, s]) for s < t (0 elsewhere), as
// chunk_weights (same values) with shifts (C a power of two) and a typed segsum load. REV: the
// threads from the last down (element e on thread NT - 1 - e): an X build without its rank split
// runs on the first C P / 4 threads, so with C C and C P / 4 at most NT / 2 the two loops and
// their loads run on different warps (with the split the X build spreads over every warp).
// A thread's elements in groups of G (4; K3 passes 1 with 8 state tiles per warp, at their
// register limit): the group's loads first, then its exponentials and stores. Why:
// one element at a time, each load sat in its own branch and waited for the previous element's
// store, so at C = 64 (8 elements per thread) every warp waited on 8 memory round trips in
// series before the barrier that ends the builds.
// MODE as lean_build_qk_t's: 1 loads the thread's first group of segsum values into *pre, 2
// computes the weights with them.
struct LeanWPre {
  float seg[4];
};
template <int NT, bool REV = false, int G = 4, int MODE = 0, class AT>
MB_DEV void lean_chunk_weights(const AT& a, const MbLayout& L, float* sm, const MbCta& k, int c,
                               LeanWPre* pre = nullptr) {
  static_assert(G <= 4, "LeanWPre holds four values");
  const int s0 = c * a.C, C = a.C, lgC = mb_lg2(C), CC = C * C;
  const bool partial = a.S - s0 < C;
  const auto& v = a.segsum;
  using O = mb_off_t<decltype(v)>;
  const O s3 = v.s[3], s4 = v.s[4];
  const O base = k.b * v.s[0] + k.h * v.s[1] + static_cast<O>(c) * v.s[2];
  const int u = REV ? NT - 1 - mb_tid() : mb_tid();
  with_dt(v.dt, [&](auto D) {
    constexpr int DT = decltype(D)::value;
    bool first = true;
    for (int e0 = u; e0 < CC; e0 += G * NT, first = false) {
      float seg[G];
#pragma unroll
      for (int j = 0; j < G; ++j) {
        const int e = e0 + j * NT, t = e >> lgC, s = e & (C - 1);
        seg[j] = 0.f;
        if (MODE == 2 && first)
          seg[j] = pre->seg[j];
        else if (e < CC && s < t)
          seg[j] = partial ? sm[L.da + t] - sm[L.da + s] : mb_ldt<DT>(v.p, base + t * s3 + s * s4, v.dt);
      }
      if constexpr (MODE == 1) {
#pragma unroll
        for (int j = 0; j < G; ++j) pre->seg[j] = seg[j];
        return;
      } else {
#pragma unroll
        for (int j = 0; j < G; ++j) {
          const int e = e0 + j * NT, t = e >> lgC, s = e & (C - 1);
          if (e < CC) sm[L.W + e] = s < t ? sm[L.tscale + s] * expf(seg[j]) : 0.f;
        }
      }
    }
  });
}

// ------------------------------------------------------------------ products


// warp_mma_16x16 (bf16_split_mma.cuh) over k in [0, 16 nk): the same loads and the same three
// mma per tile in the same order, but each lane's fragment addresses are formed once and then
// advance by one add per operand and k-step (warp_mma_16x16 forms them from the row and column
// indices at every step: ~10 integer instructions per step where 4 LDSM and 6 HMMA do the work).
// warp_mma_16x16's INC form does the same with B's fragments loaded first; written as a call to
// it (session 14) this kernel's SASS changed, unmeasured, so the two stay separate.
template <bool A_KM, bool B_KN>
MB_DEV void lean_mma(float (&acc)[2][4], const SplitTile& A, int m0, const SplitTile& B, int n0,
                     int nk) {
  const int lane = mb_tid() & 31, lr = lane & 7, lm = lane >> 3;
  SmemAddr pa = smem_addr(A.h + (A_KM ? (lr + 8 * (lm >> 1)) * A.ld + m0 + 8 * (lm & 1)
                                  : (m0 + lr + 8 * (lm & 1)) * A.ld + 8 * (lm >> 1)));
  SmemAddr pb = smem_addr(B.h + (B_KN ? (lr + 8 * (lm & 1)) * B.ld + n0 + 8 * (lm >> 1)
                                  : (n0 + lr + 8 * (lm >> 1)) * B.ld + 8 * (lm & 1)));
  const int da = A_KM ? 16 * A.ld : 16, db = B_KN ? 16 * B.ld : 16;
  for (int s = 0; s < nk; ++s) {
    uint32_t ah[4], al[4], bh[4], bl[4];
    ldsm_at<A_KM>(ah, pa);
    ldsm_at<A_KM>(al, smem_addr_add(pa, A.plane));
    ldsm_at<B_KN>(bh, pb);
    ldsm_at<B_KN>(bl, smem_addr_add(pb, B.plane));
    mma_split3(acc, ah, al, bh, bl);
    pa = smem_addr_add(pa, da);
    pb = smem_addr_add(pb, db);
  }
}

// The j-th score tile (row block m, column block n of nt x nt) in lean_scores' order: the lower
// triangle (n <= m) row by row, then the upper one row by row. With R <= 16 the upper tiles are
// exactly the ones masked to zero (no mma), so the live tiles go to the first warps: at nt = 4
// and 16 warps, warps 0-9, i.e. 3, 3, 2, 2 live tiles on the four schedulers (warp w issues on
// scheduler w % 4) instead of 4, 3, 2, 1 in row-major order, where scheduler 0's tensor pipe
// held every other warp at the barrier after the scores. A permutation of the tiles: each is
// computed and stored as before (the same bits).
MB_DEV void lean_score_tile(int j, int nt, int& m, int& n) {
  const int lower = nt * (nt + 1) / 2;
  m = 0;
  if (j < lower) {
    while (j > m) j -= ++m;  // row m holds m + 1 tiles
    n = j;
  } else {
    j -= lower;
    while (j >= nt - 1 - m) j -= nt - 1 - m, ++m;  // row m holds nt - 1 - m tiles
    n = m + 1 + j;
  }
}

// Sc = mask(Qh Kh^T) (split, into tt.Sc) and the qk_dot output of chunk c.
template <int NT, class AT>
MB_DEV void lean_scores(const AT& a, const MbLayout& L, float* sm, const LeanTiles& tt,
                        const MbCta& k, int c, float Dv) {
  const int T = a.Tb, C = a.C, lgR = a.lgR, Rm = a.R - 1, nt = T >> 4;
  const int N = a.N, ldT = tt.ldT;
  const int lane = mb_tid() & 31, g = lane >> 2, q = lane & 3;
  const int s0 = c * a.C, Lc = min(a.C, a.S - s0);
  const auto& o = a.qk_dot;
  using O = mb_off_t<decltype(o)>;
  const O os2 = o.s[2], os3 = o.s[3], os4 = o.s[4];
  const O obase = k.b * o.s[0] + k.h * o.s[1] + static_cast<O>(s0) * os2;
  const float* W = sm + L.W;
  const float* gamma = sm + L.gamma;
  for (int j = mb_tid() >> 5; j < nt * nt; j += NT / 32) {
    int tm, tn;
    lean_score_tile(j, nt, tm, tn);
    const int m0 = tm << 4, n0 = tn << 4;
    float acc[2][4];
    zero_acc(acc);
    // Key steps all after the query steps: the tile is masked to zero.
    const bool live = (n0 >> lgR) <= ((m0 + 15) >> lgR);
    if (live) lean_mma<false, false>(acc, tt.Qh, m0, tt.Kh, n0, N >> 4);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = m0 + g + 8 * hr, jj = n0 + 8 * j + 2 * q;
        const int tq = i >> lgR, ri = i & Rm;
        const float* Wr = W + tq * C;
        float v2[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = jj + e;
          const int tk = col >> lgR, rj = col & Rm;
          const float sv = acc[j][2 * hr + e];
          float val = 0.f;
          if (tk < tq) {
            val = sv * Wr[tk];
          } else if (tk == tq) {
            // Rounded before D is added (mb_fmul_rn): with R = 1 compile-time (the kernels
            // specialised to N128 P64 R1 C64) ri == rj folds to true and nvcc fused this
            // product with the add into one FMA, where the generic kernel (runtime R: the add
            // conditional) rounds it first: other Y, dz, dmimo_o / dmimo_z bits (session 10).
            val = mb_fmul_rn(gamma[tq], sv);
            if (ri == rj) val += Dv;
            if (tq < Lc) rt_st(o.p, obase + tq * os2 + ri * os3 + rj * os4, o.dt, sv);
          }
          v2[e] = val;
        }
        st_split2f(tt.Sc.h, tt.Sc.plane, i * ldT + jj, v2[0], v2[1]);
      }
    }
  }
}

// Y = diag(exp(da_cs)) Qh St + Sc X into the fp32 Y tile (row stride a.LP), one 16 x 16 tile
// (tile = row block m, column block n: m P / 16 + n) in two halves: lean_y_qst, acc = diag(e)
// Qh St (needs only the builds and the state planes), then lean_y_sx, acc += Sc X and the
// stores (needs the scores).
template <class AT>
MB_DEV void lean_y_qst(const AT& a, const MbLayout& L, const float* sm, const LeanTiles& tt,
                       int tile, float (&acc)[2][4]) {
  const int lgR = a.lgR, N = a.N, lgn = a.lgP - 4, ntp = a.P >> 4;
  const int g = (mb_tid() & 31) >> 2;
  const float* expda = sm + L.expda;
  const int m0 = (tile >> lgn) << 4, n0 = (tile & (ntp - 1)) << 4;
  zero_acc(acc);
  lean_mma<false, true>(acc, tt.Qh, m0, tt.St, n0, N >> 4);
  const float e0 = expda[(m0 + g) >> lgR], e1 = expda[(m0 + g + 8) >> lgR];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    acc[j][0] *= e0, acc[j][1] *= e0;
    acc[j][2] *= e1, acc[j][3] *= e1;
  }
}

template <class AT>
MB_DEV void lean_y_sx(const AT& a, const MbLayout& L, float* sm, const LeanTiles& tt, int tile,
                      float (&acc)[2][4]) {
  const int T = a.Tb, lgR = a.lgR, LP = a.LP, lgn = a.lgP - 4, ntp = a.P >> 4;
  const int lane = mb_tid() & 31, g = lane >> 2, q = lane & 3;
  float* Y = sm + L.Y;
  const int m0 = (tile >> lgn) << 4, n0 = (tile & (ntp - 1)) << 4;
  // Keys up to the tile's last step (Sc is zero past it).
  const int k1 = min(T, (((((m0 + 15) >> lgR) + 1) << lgR) + 15) & ~15);
  lean_mma<false, true>(acc, tt.Sc, m0, tt.X, n0, k1 >> 4);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int col = n0 + 8 * j + 2 * q;
    *reinterpret_cast<float2*>(Y + (m0 + g) * LP + col) = make_float2(acc[j][0], acc[j][1]);
    *reinterpret_cast<float2*>(Y + (m0 + g + 8) * LP + col) = make_float2(acc[j][2], acc[j][3]);
  }
}

// How many Y tiles (the last ones: the largest Sc X halves) have their Qh St half computed
// during the scores, by the warps that hold no live score tile: lean_scores gives the
// nt (nt + 1) / 2 lower-triangle tiles (all live; with R <= 16 every upper one is masked) to
// warps 0 .. in its first round, so with fewer of them than warps the warps from nt (nt + 1) / 2
// up have only masked tiles (zero stores). Why: with T = 32 (C R = 8 x 4) only 3 of 16 warps
// compute scores, while lean_y's Qh St halves (N / 16 k-steps each) waited for them at the
// barrier. Each tile is still one accumulator chain in the same order (the same bits).
// HOLD false: none (the 8-tile states, at their register limit).
template <int NT, bool HOLD, class AT>
MB_DEV int lean_y_held(const AT& a) {
  if constexpr (!HOLD) {
    return 0;
  } else {
    constexpr int NW = NT / 32;
    const int nt = a.Tb >> 4, live = nt * (nt + 1) / 2, ny = nt << (a.lgP - 4);
    if (a.R > 16 || live >= NW) return 0;
    return min(NW - live, ny);
  }
}

// Before the barrier after the scores: the Qh St half of this warp's held tile into acc; its
// index, or -1 without one.
template <int NT, bool HOLD, class AT>
MB_DEV int lean_y_pre(const AT& a, const MbLayout& L, const float* sm, const LeanTiles& tt,
                      float (&acc)[2][4]) {
  const int held = lean_y_held<NT, HOLD>(a);
  if (held == 0) return -1;
  const int nt = a.Tb >> 4, live = nt * (nt + 1) / 2, ny = nt << (a.lgP - 4);
  const int w = mb_tid() >> 5;
  if (w < live || w >= live + held) return -1;
  const int tile = ny - held + (w - live);
  lean_y_qst(a, L, sm, tt, tile, acc);
  return tile;
}

// After it: the held tile's Sc X half, then the other tiles whole (on warps 0 .., those with
// the live score tiles first).
template <int NT, bool HOLD, class AT>
MB_DEV void lean_y(const AT& a, const MbLayout& L, float* sm, const LeanTiles& tt, int held_tile,
                   float (&hacc)[2][4]) {
  if (held_tile >= 0) lean_y_sx(a, L, sm, tt, held_tile, hacc);
  const int rest = ((a.Tb >> 4) << (a.lgP - 4)) - lean_y_held<NT, HOLD>(a);
  for (int tile = mb_tid() >> 5; tile < rest; tile += NT / 32) {
    float acc[2][4];
    lean_y_qst(a, L, sm, tt, tile, acc);
    lean_y_sx(a, L, sm, tt, tile, acc);
  }
}

// ------------------------------------------------------------------ epilogue (gradients of Y)

// The gate of rank r at (t, p) from the staged z: u = z mimo_z, gate = silu(u), dsilu = silu'(u).
struct LeanGate {
  float u, gate, dsilu;
};
// The sigmoid with the approximate division (rcp.approx and a multiply, ~2 ulp), as silu_f of
// the second pass: the IEEE division was a multi-instruction sequence with a slow-path branch
// per (t, r, p) element, ~5% of the chunk pass's instructions (ncu). Its ~1e-7 relative error
// is far below the outputs' tolerances. The host emulation (no __fdividef) divides exactly.
// FAST false (the 8-tile states, at their 128-register limit): the IEEE division, with which
// <512, 8> does not spill (with the fast one it did: one more spill slot).
template <bool FAST = true>
MB_DEV LeanGate lean_gate(float z, float mz) {
  LeanGate g;
  g.u = z * mz;
#if defined(__CUDA_ARCH__)
  const float sg = FAST ? __fdividef(1.f, 1.f + __expf(-g.u)) : 1.f / (1.f + __expf(-g.u));
#else
  const float sg = 1.f / (1.f + __expf(-g.u));
#endif
  g.gate = g.u * sg;
  g.dsilu = sg * (1.f + g.u * (1.f - sg));
  return g;
}

// RMSNorm row statistics from the Y tile and the staged z / dout (as epi_norm_stats). The
// threads per row (tpr) follow NT, and so does the order of the row sums.
template <int NT, bool FAST, class AT>
MB_DEV void lean_norm_stats(const AT& a, const MbLayout& L, float* sm, int Lc) {
  const int R = a.R, T = a.Tb, P = a.P, LP = a.LP;
  int tpr = 1;  // threads per row
  while (tpr * 2 * T <= NT && tpr < 64) tpr *= 2;
  for (int task = mb_tid(); task < T * tpr; task += NT) {
    const int i = task / tpr, sl = task - i * tpr;
    const int t = i >> a.lgR, r = i & (R - 1);
    float ss = 0.f, sd = 0.f;
    if (t < Lc) {
      for (int p = sl; p < P; p += tpr) {
        const float y = sm[L.Y + i * LP + p];
        const float d = st_bf(sm + L.ds, t * P + p);
        const LeanGate gt = lean_gate<FAST>(st_bf(sm + L.zs, t * P + p), sm[L.mz + r * P + p]);
        const float dxhat = d * sm[L.mo + r * P + p] * gt.gate * sm[L.nw + p];
        ss = fmaf(y, y, ss);
        sd = fmaf(dxhat, y, sd);
      }
    }
    sm[L.red + 2 * task] = ss;
    sm[L.red + 2 * task + 1] = sd;
  }
  mb_sync();
  for (int i = mb_tid(); i < T; i += NT) {
    float ss = 0.f, sd = 0.f;
    for (int sl = 0; sl < tpr; ++sl) {
      ss += sm[L.red + 2 * (i * tpr + sl)];
      sd += sm[L.red + 2 * (i * tpr + sl) + 1];
    }
    const float rstd = 1.f / sqrtf(ss / static_cast<float>(P) + a.eps);
    sm[L.rstd + i] = rstd;
    sm[L.rdot + i] = rstd * sd / static_cast<float>(P);
  }
  mb_sync();
}

// Where the epilogue's per-thread partials are exchanged (ered[kind][t0][r][p], kind slots
// 0 .. 2 for mimo_o, the gate, the norm), and whether their sums wait for the next chunk.
// Deferred (the plan's layout_lean put the exchange, L.ered, in the Sc planes, enlarged where
// they hold fewer than the slots of the kinds that are on): the Sc planes are dead from the end
// of lean_y until the next chunk's scores write them. The epilogue then has no barrier of its
// own: each warp goes on to its state update when its steps are done, and the sums run after
// the next chunk's first barrier (lean_epilogue_sums), or after the segment's last chunk. Why:
// at the exchange barrier every warp waited for the slowest one's epilogue (K3's largest
// barrier stall, ncu); the enlarged planes bring that to the C R = 32 shapes and to R = 8.
// Otherwise: in L.ered (other planes), summed after a barrier in the epilogue. The same sums in
// the same order either way (the same bits).
MB_DEV bool lean_defer_sums(const MbLayout& L) { return L.ScT >= 0 && L.ered == L.ScT; }

template <int NT, class AT>
MB_DEV float* lean_ered(const AT&, const MbLayout& L, float* sm) {
  return sm + L.ered;
}

// The exchange's sums of a chunk into the Kahan partials: accumulator (kind, q) adds the sum
// over t0 (in t0 order) of the chunk's partials; the (kind, q) tasks are spread over the
// threads. Deferred, K3 calls it after the next barrier; else the epilogue after its own.
template <int NT, class AT>
MB_DEV void lean_epilogue_sums(const AT& a, const MbLayout& L, float* sm) {
  const bool ro = a.reduce_o, hz = a.has_z, hn = a.has_norm;
  if (!ro && !hz) return;  // as lean_epilogue: nothing was exchanged
  const int RP = a.R * a.P, lgRP = a.lgR + a.lgP, tstep = NT >> a.lgP;
  const float* ex = lean_ered<NT>(a, L, sm);
  for (int u = mb_tid(); u < kParts * RP; u += NT) {
    const int kind = u >> lgRP, q = u & (RP - 1);
    if (!(kind == 0 ? ro : kind == 1 ? hz : hn)) continue;
    const float* e = ex + kind * tstep * RP + q;
    float v = 0.f;
    for (int j = 0; j < tstep; ++j) v += e[j * RP];
    float* acc = sm + L.acc + kind * 2 * RP + q;
    kahan_add(acc, acc + RP, v);
  }
}

// dz, dout_pre_rms and the chunk's contributions to dmimo_o / dmimo_z / dnorm_weight, in one
// pass: thread (p, t0) handles column p of steps t0, t0 + NT/P, ... (every rank), sums its
// steps' contributions per rank in registers, and the threads of one column then add theirs
// to the Kahan partials in a fixed order (deterministic; the grouping follows NT). Needs
// NT % P == 0. R is a template parameter (unrolled rank loop, registers per rank).
template <int NT, int R, bool FAST, class AT>
MB_DEV void lean_epilogue_r(const AT& a, const MbLayout& L, float* sm, const MbCta& k, int s0,
                            int Lc) {
  const bool ro = a.reduce_o, hz = a.has_z, hn = a.has_norm;
  const int P = a.P, lgP = a.lgP, LP = a.LP, tstep = NT >> lgP;
  const int p = mb_tid() & (P - 1), t0 = mb_tid() >> lgP;
  float so[R], sz[R], sn[R];
#pragma unroll
  for (int r = 0; r < R; ++r) so[r] = sz[r] = sn[r] = 0.f;
  const float* mz = sm + L.mz + p;
  const float* mo = sm + L.mo + p;
  const float nwp = hn ? sm[L.nw + p] : 1.f;
  // Output offsets at the chunk's first step (column p); a step adds t (dz) or i (dout_pre).
  const auto& oz = a.dz;
  const auto& op = a.dout_pre;
  using OZ = mb_off_t<decltype(oz)>;
  const OZ zs1 = oz.s[1];
  const int64_t ps2 = op.s[2];
  const OZ zbase = hz ? k.b * oz.s[0] + s0 * zs1 + k.h * oz.s[2] + p * oz.s[3] : 0;
  const int64_t pbase =
      hn ? k.b * op.s[0] + k.h * op.s[1] + static_cast<int64_t>(s0) * R * ps2 + p * op.s[3] : 0;
  const float* Y = sm + L.Y;
  for (int t = t0; t < Lc; t += tstep) {
    const float zz = st_bf(sm + L.zs, t * P + p);
    const float d = ro ? st_bf(sm + L.ds, t * P + p) : 0.f;
    float dzs = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int i = t * R + r;
      const float y = Y[i * LP + p];
      if (!hz) {  // reduce-O without a gate
        so[r] = fmaf(d, y, so[r]);
        continue;
      }
      const float mzv = mz[r * P];
      const float dr = ro ? d * mo[r * P] : st_bf(sm + L.ds, i * P + p);
      const LeanGate gt = lean_gate<FAST>(zz, mzv);
      float yg = y;  // what the gate multiplies
      if (hn) {
        const float rstd = sm[L.rstd + i];
        const float xhat = y * rstd;
        yg = xhat * nwp;
        const float dxhat = dr * gt.gate * nwp;
        rt_st(op.p, pbase + i * ps2, op.dt, rstd * (dxhat - xhat * sm[L.rdot + i]));
        sn[r] = fmaf(dr * gt.gate, xhat, sn[r]);
      }
      if (ro) so[r] = fmaf(d * gt.gate, yg, so[r]);
      const float gz = dr * yg * gt.dsilu;
      sz[r] = fmaf(gz, zz, sz[r]);
      dzs = fmaf(gz, mzv, dzs);
    }
    if (hz) rt_st(oz.p, zbase + t * zs1, oz.dt, dzs);
  }
  // Exchange: ered[kind][t0][r][p], then the first row of threads adds them in t0 order. A kind
  // that is off (no mimo_o, gate or norm) has only zero contributions and zero partials: skipped.
  float* ex = lean_ered<NT>(a, L, sm);
  const int RP = R * P;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (ro) ex[(0 * tstep + t0) * RP + r * P + p] = so[r];
    if (hz) ex[(1 * tstep + t0) * RP + r * P + p] = sz[r];
    if (hn) ex[(2 * tstep + t0) * RP + r * P + p] = sn[r];
  }
  if (lean_defer_sums(L)) return;  // summed after the next barrier
  mb_sync();
  lean_epilogue_sums<NT>(a, L, sm);  // now: the same sums, in the same order
}

// lean_epilogue_r for the benchmark and training case (reduce-O, the gate, no norm, bf16 dz)
// with those known at compile time. Why: the generic loop tests the three flags per element,
// reloads mimo_z / mimo_o of column p from shared memory per element and stores dz through a
// per-step dtype switch (~56 of its ~163 warp instructions per step at R = 4). Here the thread's
// mimo_z / mimo_o sit in registers across the step loop, dz is stored as bf16 and the offsets
// advance by steps. The float expressions, the exchange and the summation orders are the generic
// ones: the outputs are bitwise the same.
template <int NT, int R, bool FAST, class AT>
MB_DEV void lean_epilogue_gate_r(const AT& a, const MbLayout& L, float* sm, const MbCta& k,
                                 int s0, int Lc) {
  const int P = a.P, lgP = a.lgP, LP = a.LP, tstep = NT >> lgP;
  const int p = mb_tid() & (P - 1), t0 = mb_tid() >> lgP;
  float so[R], sz[R];
#pragma unroll
  for (int r = 0; r < R; ++r) so[r] = sz[r] = 0.f;
  float mzr[R], mor[R];
#pragma unroll
  for (int r = 0; r < R; ++r) mzr[r] = sm[L.mz + r * P + p], mor[r] = sm[L.mo + r * P + p];
  // Running offsets (integer only): the dz element, the staged rows' element, Y's row (t, 0).
  const auto& oz = a.dz;
  using O = mb_off_t<decltype(oz)>;
  const O zs1 = oz.s[1], zstep = tstep * zs1;
  O zo = k.b * oz.s[0] + (s0 + t0) * zs1 + k.h * oz.s[2] + p * oz.s[3];
  const int sstep = tstep * P, ystep = tstep * R * LP;
  int e = t0 * P + p;
  const float* Yt = sm + L.Y + t0 * R * LP + p;
  for (int t = t0; t < Lc; t += tstep, zo += zstep, e += sstep, Yt += ystep) {
    const float zz = st_bf(sm + L.zs, e);
    const float d = st_bf(sm + L.ds, e);
    float dzs = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float y = Yt[r * LP];
      const float mzv = mzr[r];
      const float dr = d * mor[r];
      const LeanGate gt = lean_gate<FAST>(zz, mzv);
      so[r] = fmaf(d * gt.gate, y, so[r]);
      const float gz = dr * y * gt.dsilu;
      sz[r] = fmaf(gz, zz, sz[r]);
      dzs = fmaf(gz, mzv, dzs);
    }
    st_t<1>(oz.p, zo, dzs);
  }
  // The generic exchange and sums of the two kinds that are on (mimo_o, gate), in its order.
  float* ex = lean_ered<NT>(a, L, sm);
  const int RP = R * P;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    ex[(0 * tstep + t0) * RP + r * P + p] = so[r];
    ex[(1 * tstep + t0) * RP + r * P + p] = sz[r];
  }
  if (lean_defer_sums(L)) return;  // summed after the next barrier
  mb_sync();
  lean_epilogue_sums<NT>(a, L, sm);  // now: the same sums, in the same order
}

template <int NT, bool FAST, class AT>
MB_DEV void lean_epilogue(const AT& a, const MbLayout& L, float* sm, const MbCta& k, int s0,
                          int Lc) {
  if (!a.reduce_o && !a.has_z) return;  // nothing to do without mimo_o and the gate
  // The common case through its compile-time copy, every other one through the generic code.
  // Not with 8 state tiles per warp (FAST false): <512, 8> sits at its 128-register limit and
  // spilled with the copy.
  if constexpr (FAST) {
    if (a.reduce_o && a.has_z && !a.has_norm && a.dz.dt == 1) {
      switch (a.R) {
        case 1: lean_epilogue_gate_r<NT, 1, FAST>(a, L, sm, k, s0, Lc); break;
        case 2: lean_epilogue_gate_r<NT, 2, FAST>(a, L, sm, k, s0, Lc); break;
        case 4: lean_epilogue_gate_r<NT, 4, FAST>(a, L, sm, k, s0, Lc); break;
        default: lean_epilogue_gate_r<NT, 8, FAST>(a, L, sm, k, s0, Lc); break;
      }
      return;
    }
  }
  switch (a.R) {
    case 1: lean_epilogue_r<NT, 1, FAST>(a, L, sm, k, s0, Lc); break;
    case 2: lean_epilogue_r<NT, 2, FAST>(a, L, sm, k, s0, Lc); break;
    case 4: lean_epilogue_r<NT, 4, FAST>(a, L, sm, k, s0, Lc); break;
    default: lean_epilogue_r<NT, 8, FAST>(a, L, sm, k, s0, Lc); break;
  }
}

// The register state: warp w owns the 16 x 16 tiles w, w + NT / 32, ... of St [N][P].
template <int ST>
struct LeanState {
  float acc[ST][2][4];
};

// St = e St + Kh^T Xw. The k-steps run outermost and the warp's tiles inside: each tile gets
// the products of one lean_mma per tile in the same order (k ascending, the same three mma per
// step), but the tiles' independent mma chains interleave, and when P / 16 divides NT / 32
// (P <= NT / 2) all of a warp's tiles lie in one column block and read the Xw fragments of a
// k-step once, not once per tile. With 8 tiles (64 accumulators) the shared fragments spill at
// 512 threads (128 registers): one lean_mma per tile there.
template <int NT, int ST, class AT>
MB_DEV void lean_state_update(const AT& a, const LeanTiles& tt, LeanState<ST>& s, float e) {
  constexpr int NW = NT / 32;
  const int lgn = a.lgP - 4, ntiles = (a.N >> 4) << lgn, ntp = a.P >> 4, nk = a.Tb >> 4;
  const int w = mb_tid() >> 5, lane = mb_tid() & 31, lr = lane & 7, lm = lane >> 3;
  int nj = 0;  // the warp's tiles w + j NW, j < nj (the ones below ntiles: a prefix)
#pragma unroll
  for (int j = 0; j < ST; ++j) {
    const int tile = w + j * NW;
    if (tile >= ntiles) break;
    nj = j + 1;
#pragma unroll
    for (int x = 0; x < 2; ++x)
#pragma unroll
      for (int y = 0; y < 4; ++y) s.acc[j][x][y] *= e;
    if constexpr (ST >= 8)
      lean_mma<true, true>(s.acc[j], tt.Kh, (tile >> lgn) << 4, tt.Xw, (tile & (ntp - 1)) << 4, nk);
  }
  if constexpr (ST >= 8) return;
  const SplitTile& A = tt.Kh;  // [T][N]: k-major, read transposed
  const SplitTile& B = tt.Xw;  // [T][P]: [k][n], read transposed
  const bool one_col = (NW & (ntp - 1)) == 0;
  // Lane addresses at k = 0, row 0 and column 0 (warp_mma_16x16's A_KM / B_KN offsets).
  const SmemAddr a0 = smem_addr(A.h + (lr + 8 * (lm >> 1)) * A.ld + 8 * (lm & 1));
  const SmemAddr b0 = smem_addr(B.h + (lr + 8 * (lm & 1)) * B.ld + 8 * (lm >> 1));
  if constexpr (ST == 2) {
    if (one_col && nj == ST) {
      // Both tiles' fragments first, then each of the three mma stages over both tiles: four
      // independent accumulator chains between dependent mma instead of two.
      const SmemAddr pb0 = smem_addr_add(b0, (w & (ntp - 1)) << 4);
      for (int ks = 0; ks < nk; ++ks) {
        const int ka = (ks * A.ld) << 4, kb = (ks * B.ld) << 4;
        uint32_t bh[4], bl[4], ah[ST][4], al[ST][4];
        const SmemAddr pb = smem_addr_add(pb0, kb);
        ldsm_at<true>(bh, pb);
        ldsm_at<true>(bl, smem_addr_add(pb, B.plane));
#pragma unroll
        for (int j = 0; j < ST; ++j) {
          const SmemAddr pa = smem_addr_add(a0, ka + (((w + j * NW) >> lgn) << 4));
          ldsm_at<true>(ah[j], pa);
          ldsm_at<true>(al[j], smem_addr_add(pa, A.plane));
        }
#pragma unroll
        for (int j = 0; j < ST; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) mma16816(s.acc[j][h], al[j], bh[2 * h], bh[2 * h + 1]);
#pragma unroll
        for (int j = 0; j < ST; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) mma16816(s.acc[j][h], ah[j], bl[2 * h], bl[2 * h + 1]);
#pragma unroll
        for (int j = 0; j < ST; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) mma16816(s.acc[j][h], ah[j], bh[2 * h], bh[2 * h + 1]);
      }
      return;
    }
  }
  for (int ks = 0; ks < nk; ++ks) {
    const int ka = (ks * A.ld) << 4, kb = (ks * B.ld) << 4;
    uint32_t bh[4], bl[4];
#pragma unroll
    for (int j = 0; j < ST; ++j) {
      if (j >= nj) break;
      const int tile = w + j * NW;
      if (j == 0 || !one_col) {
        const SmemAddr pb = smem_addr_add(b0, kb + ((tile & (ntp - 1)) << 4));
        ldsm_at<true>(bh, pb);
        ldsm_at<true>(bl, smem_addr_add(pb, B.plane));
      }
      const SmemAddr pa = smem_addr_add(a0, ka + ((tile >> lgn) << 4));
      uint32_t ah[4], al[4];
      ldsm_at<true>(ah, pa);
      ldsm_at<true>(al, smem_addr_add(pa, A.plane));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mma16816(s.acc[j][h], al, bh[2 * h], bh[2 * h + 1]);
        mma16816(s.acc[j][h], ah, bl[2 * h], bl[2 * h + 1]);
        mma16816(s.acc[j][h], ah, bh[2 * h], bh[2 * h + 1]);
      }
    }
  }
}

// Applies f(n, p, v0, v1) to every owned state element pair (columns p, p + 1).
template <int NT, int ST, class F, class AT>
MB_DEV void lean_state_foreach(const AT& a, const LeanState<ST>& s, F f) {
  const int lgn = a.lgP - 4, ntiles = (a.N >> 4) << lgn, ntp = a.P >> 4;
  const int lane = mb_tid() & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int j = 0; j < ST; ++j) {
    const int tile = (mb_tid() >> 5) + j * (NT / 32);
    if (tile >= ntiles) break;
    const int m0 = (tile >> lgn) << 4, n0 = (tile & (ntp - 1)) << 4;
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const int p = n0 + 8 * x + 2 * q;
      f(m0 + g, p, s.acc[j][x][0], s.acc[j][x][1]);
      f(m0 + g + 8, p, s.acc[j][x][2], s.acc[j][x][3]);
    }
  }
}

// The bf16 planes of the register state (for lean_y) and states[b, h, c] = St in one pass over
// the owned pairs (paired stores when the layout allows; dtype and layout dispatched once).
// OUT false: the planes only (states[c] then comes from lean_states_copy).
template <int NT, int ST, bool OUT = true, class AT>
MB_DEV void lean_state_out(const AT& a, const LeanTiles& tt, const MbCta& k, int c,
                           const LeanState<ST>& s) {
  if constexpr (!OUT) {
    const int ldP = tt.ldP;
    lean_state_foreach<NT>(a, s, [&](int n, int p, float v0, float v1) {
      st_split2f(tt.St.h, tt.St.plane, n * ldP + p, v0, v1);
    });
    return;
  }
  const auto& o = a.states;
  using O = mb_off_t<decltype(o)>;
  const O sn = o.s[3], sp = o.s[4];
  const O base = k.b * o.s[0] + k.h * o.s[1] + static_cast<O>(c) * o.s[2];
  const int ldP = tt.ldP;
  const bool v2 = a.states_vec4;
  with_dt(o.dt, [&](auto D) {
    constexpr int DT = decltype(D)::value;
    lean_state_foreach<NT>(a, s, [&](int n, int p, float v0, float v1) {
      st_split2f(tt.St.h, tt.St.plane, n * ldP + p, v0, v1);
      const O off = base + n * sn;
      if (v2) {
        st2_t<DT>(o.p, off + p, v0, v1);
      } else {
        st_t<DT>(o.p, off + p * sp, v0);
        st_t<DT>(o.p, off + (p + 1) * sp, v1);
      }
    });
  });
}

// states[b, h, c] := the hi plane of St (the state entering chunk c), for the contiguous-layout
// copies, whose states are bf16 [B, H, nch, N, P] with aligned 4-element rows (MbArgsCT<..,
// true>): the hi plane is bf16_rn of the state, the value lean_state_out stores, so the bits
// are the same. Why: lean_state_out stored each thread's mma fragment pairs, 4 bytes per lane
// and 16 per row of 8 lanes (half sectors, ~16 stores per thread per chunk at four tiles per
// warp); here 8 bytes per lane in whole rows. Called after a barrier that follows the planes'
// stores and before the next chunk's (the loop top).
template <int NT, class AT>
MB_DEV void lean_states_copy(const AT& a, const LeanTiles& tt, const MbCta& k, int c) {
  constexpr int N = AT::N, P = AT::P, Q4 = P / 4;
  static_assert((N * Q4) % NT == 0, "whole rounds of 4-element pieces");
  const auto& o = a.states;
  using O = mb_off_t<decltype(o)>;
  const O base = k.b * o.s[0] + k.h * o.s[1] + static_cast<O>(c) * o.s[2];
  auto* dst = reinterpret_cast<uint2*>(reinterpret_cast<unsigned short*>(o.p) + base);
  const int ldP = tt.ldP;
#pragma unroll
  for (int j = 0; j < N * Q4 / NT; ++j) {
    const int e = mb_tid() + j * NT, n = e / Q4, q = e - n * Q4;
    dst[e] = *reinterpret_cast<const uint2*>(tt.St.h + n * ldP + 4 * q);
  }
}

// ------------------------------------------------------------------ kernel bodies

// Whether AT is MbArgsCT<.., true> (the contiguous-layout copies: layouts and dtypes known at
// compile time).
template <class AT, class = void>
struct mb_ct_layout : std::false_type {};
template <class AT>
struct mb_ct_layout<AT, std::enable_if_t<AT::kContiguousLayout>> : std::true_type {};

// Whether K3 issues its three builds' loads together (the fused sequence in k3_lean_body): the
// contiguous-layout copies (lean_ld a constant) with at most two state tiles per warp, P <= 64
// and R <= 4. Why not elsewhere: ptxas (sm_90a) showed the generic kernels, with three copies
// of the builds under the runtime layout switch, spilling 400-684 bytes at 512 threads, and the
// four-tile copies 24-80 bytes; at P 128 and R 8 the fused copies measured slower (H200,
// session 19: K3 +3.3% at N64 P128 R4 C16, +1.3% at N128 P64 R8 C8; -2% to -7% at the other
// 512-thread copies).
template <class AT>
constexpr bool lean_fused_build_loads(int st) {
  if constexpr (mb_ct_layout<AT>::value) {
    return st <= 2 && AT::P <= 64 && AT::R <= 4;
  } else {
    return false;
  }
}

// Whether states[c] comes from the hi plane (lean_states_copy): the contiguous-layout copies
// with P >= 64. Measured (H200, session 19, K3 ms without -> with): N256 P64 R4 C8 1.206 ->
// 1.116, N128 P128 R4 C8 1.134 -> 1.087, N128 P64 R4 C16 0.605 -> 0.589, R2 C32 0.323 ->
// 0.312; at N128 P32 R4 C16 0.479 -> 0.488 (slower: not there).
template <class AT>
constexpr bool lean_states_from_planes() {
  if constexpr (mb_ct_layout<AT>::value) {
    return AT::P >= 64;
  } else {
    return false;
  }
}

// K1 (lean): local recurrence of one sub-segment from a zero state.
template <int NT, int ST, class AT>
MB_DEV void k1_lean_body(const AT& a, float* sm) {
  const MbLayout& L = a.l1;
  const int64_t bid = mb_bid();
  const int sub = static_cast<int>(bid % a.nsub);
  MbCta k0;
  k0.bhi = static_cast<int>(bid / a.nsub);
  k0.b = k0.bhi / a.H, k0.h = k0.bhi % a.H, k0.g = k0.h / a.HG;
  k0.p0 = 0, k0.Pv = a.P;
  const MbCta& k = k0;
  const LeanTiles tt = lean_tiles(a, L, sm);
  load_consts<NT>(a, L, sm, k, false, false, a.Ppt);
  LeanState<ST> st;
#pragma unroll
  for (int j = 0; j < ST; ++j) zero_acc(st.acc[j]);
  float dec = 0.f;
  const int c0 = sub * a.L1, c1 = c0 + a.L1;  // sub-segments never reach the last chunk
  // Each chunk's scalars and cos / sin table are built during the previous chunk (see
  // k3_lean_body): one barrier per chunk fewer.
  chunk_scalars(a, L, sm, k, c0);
  lean_chunk_angles<NT, (ST < 8 ? 4 : 1)>(a, L, sm, k, c0);
  for (int c = c0; c < c1; ++c) {
    MbCta k = k0;  // per chunk, opaque (see mb_opaque)
    k.b = mb_opaque(k0.b), k.h = mb_opaque(k0.h), k.g = mb_opaque(k0.g);
    mb_sync();
    dec += sm[L.misc + 1];
    const float e = sm[L.misc];
    // Chunk c + 1's scalar and angle loads in flight across the builds (lean_chunk_pre_load,
    // as in K3; not with 8 state tiles per warp). Why: loaded after the barrier below, each
    // warp waited on them (warp 0 on the scalars, then on its angle: two round trips) before
    // its state update.
    [[maybe_unused]] LeanChunkPre pre{};
    if constexpr (ST < 8)
      if (c + 1 < c1) pre = lean_chunk_pre_load<NT>(a, L, k, c + 1);
    lean_build_qk<NT, false>(a, L, sm, tt, k, c);
    lean_build_x<NT, false>(a, L, sm, tt, k, c);
    mb_sync();
    // The next chunk's rows on their way to L2 while this chunk's state update runs.
    if (a.prefetch && c + 1 < c1) lean_prefetch_chunk<NT, false, false>(a, k, c + 1);
    // Chunk c's scalars and table were last read above (before the barrier).
    if (c + 1 < c1) {
      if constexpr (ST < 8) {
        lean_chunk_pre_store<NT>(a, L, sm, k, c + 1, pre);
      } else {
        chunk_scalars(a, L, sm, k, c + 1);
        lean_chunk_angles<NT, 1>(a, L, sm, k, c + 1);
      }
    }
    lean_state_update<NT>(a, tt, st, e);
  }
  float* out = a.ws_local + (static_cast<int64_t>(k.bhi) * a.nsub + sub) * a.N * a.P;
  const int P = a.P;
  lean_state_foreach<NT>(a, st, [&](int n, int p, float v0, float v1) {
    *reinterpret_cast<float2*>(out + n * P + p) = make_float2(v0, v1);
  });
  if (mb_tid() == 0) a.ws_dec[static_cast<int64_t>(k.bhi) * a.nsub + sub] = dec;
}

// K3 (lean): one segment of one (b, h): the full chunk pass.
template <int NT, int ST, class AT>
MB_DEV void k3_lean_body(const AT& a, float* sm) {
  const MbLayout& L = a.l3;
  const int64_t bid = mb_bid();
  const int seg = static_cast<int>(bid % a.nseg);
  MbCta k0;
  k0.bhi = static_cast<int>(bid / a.nseg);
  k0.b = k0.bhi / a.H, k0.h = k0.bhi % a.H, k0.g = k0.h / a.HG;
  k0.p0 = 0, k0.Pv = a.P;
  const MbCta& k = k0;
  const int Ppt = a.Ppt;
  const LeanTiles tt = lean_tiles(a, L, sm);
  // The epilogue's Kahan partials start from zero.
  for (int e = mb_tid(); e < 2 * kParts * a.R * Ppt; e += NT) sm[L.acc + e] = 0.f;
  load_consts<NT>(a, L, sm, k, true, true, Ppt);
  LeanState<ST> st;
  if (seg > 0) {
    const float* in = a.ws_enter + (static_cast<int64_t>(k.bhi) * (a.nseg - 1) + seg - 1) * a.N * a.P;
    const int P = a.P, lgn = a.lgP - 4, ntp = P >> 4, ntiles = (a.N >> 4) << lgn;
    const int lane = mb_tid() & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int j = 0; j < ST; ++j) {
      const int tile = (mb_tid() >> 5) + j * (NT / 32);
      if (tile >= ntiles) break;
      const int m0 = (tile >> lgn) << 4, n0 = (tile & (ntp - 1)) << 4;
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int p = n0 + 8 * x + 2 * q;
        const float2 v0 = *reinterpret_cast<const float2*>(in + (m0 + g) * P + p);
        const float2 v1 = *reinterpret_cast<const float2*>(in + (m0 + g + 8) * P + p);
        st.acc[j][x][0] = v0.x, st.acc[j][x][1] = v0.y, st.acc[j][x][2] = v1.x, st.acc[j][x][3] = v1.y;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < ST; ++j) zero_acc(st.acc[j]);
  }
  const float Dv = a.has_d ? ld1(a.d, k.h) : 0.f;

  const int c0 = seg * a.L3, c1 = min(a.nch, c0 + a.L3);
  // The planes of the state entering chunk c0 and states[c0]; each later state's planes and
  // output are written together right after its update (the end of the previous chunk). With
  // kCopy only the planes: states[c] is copied from them at chunk c's top (lean_states_copy).
  constexpr bool kCopy = lean_states_from_planes<AT>();
  lean_state_out<NT, ST, !kCopy>(a, tt, k, c0, st);
  // Chunk c's scalars (da, expda, gamma, tscale, wk, misc) and cos / sin table are built during
  // chunk c - 1, after the barrier that follows their last reads (lean_y), so that their global
  // loads overlap the other warps' epilogue and state update instead of stalling every warp at
  // a barrier of their own (the second barrier per chunk before the tile builds).
  chunk_scalars(a, L, sm, k, c0);
  lean_chunk_angles<NT, (ST < 8 ? 4 : 1)>(a, L, sm, k, c0);
  const bool defer = lean_defer_sums(L);
  for (int c = c0; c < c1; ++c) {
    const int s0 = c * a.C, Lc = min(a.C, a.S - s0);
    MbCta k = k0;  // per chunk, opaque (see mb_opaque)
    k.b = mb_opaque(k0.b), k.h = mb_opaque(k0.h), k.g = mb_opaque(k0.g);
    mb_sync();
    // The previous chunk's epilogue partials (in the Sc planes: nothing here writes them before
    // the next barrier).
    if (defer && c > c0) lean_epilogue_sums<NT>(a, L, sm);
    const float e_chunk = sm[L.misc];
    if constexpr (lean_fused_build_loads<AT>(ST)) {
      // Every global load of the three builds first (the first pair of q / k tasks, the first
      // step's v, z and dout, the first segsum group), then their arithmetic and stores. Why:
      // each build waited for its own loads before the next one issued its: three or four L2
      // round trips in series per chunk, every warp of the CTA waiting at once. The same
      // values and stores (the same bits).
      with_ld(a.lean_ld, [&](auto M) {
        constexpr int LM = decltype(M)::value;
        LeanXPre xp;
        LeanWPre wp;
        LeanQkPre qp;
        lean_build_x_t<NT, true, LM, true, 1>(a, L, sm, tt, k, c, &xp);
        lean_chunk_weights<NT, true, 4, 1>(a, L, sm, k, c, &wp);
        lean_build_qk_t<NT, true, true, LM, 1>(a, L, sm, tt, k, c, &qp);
        // states[c] while the loads are in flight.
        if constexpr (kCopy) lean_states_copy<NT>(a, tt, k, c);
        lean_chunk_weights<NT, true, 4, 2>(a, L, sm, k, c, &wp);
        lean_build_qk_t<NT, true, true, LM, 2>(a, L, sm, tt, k, c, &qp);
        lean_build_x_t<NT, true, LM, true, 2>(a, L, sm, tt, k, c, &xp);
      });
    } else {
      if constexpr (kCopy) lean_states_copy<NT>(a, tt, k, c);
      // Reversed (see lean_chunk_weights) but with 8 state tiles per warp: <512, 8> sits at its
      // 128-register limit and spilled with it.
      lean_chunk_weights<NT, (ST < 8), (ST < 8 ? 4 : 1)>(a, L, sm, k, c);
      lean_build_qk<NT, true, (ST >= 8)>(a, L, sm, tt, k, c);
      lean_build_x<NT, true, (ST < 8)>(a, L, sm, tt, k, c);
    }
    mb_sync();
    // Chunk c + 1's scalar and angle loads in flight across the scores and lean_y (see
    // lean_chunk_pre_load; not with 8 state tiles per warp, at their register limit).
    [[maybe_unused]] LeanChunkPre pre{};
    if constexpr (ST < 8)
      if (c + 1 < c1) pre = lean_chunk_pre_load<NT>(a, L, k, c + 1);
    // The next chunk's rows on their way to L2 while this chunk's products run (not with 8
    // state tiles per warp: there its registers spilled).
    if constexpr (ST < 8)
      if (a.prefetch && c + 1 < c1) lean_prefetch_chunk<NT, true, true, true>(a, k, c + 1);
    lean_scores<NT>(a, L, sm, tt, k, c, Dv);
    // The held Y tiles' Qh St halves (see lean_y_held; not with 8 state tiles per warp).
    float yacc[2][4];
    const int ytile = lean_y_pre<NT, (ST < 8)>(a, L, sm, tt, yacc);
    mb_sync();
    lean_y<NT, (ST < 8)>(a, L, sm, tt, ytile, yacc);
    mb_sync();
    // The norm statistics and the epilogue read none of the scalar regions nor the table.
    if (c + 1 < c1) {
      if constexpr (ST < 8) {
        lean_chunk_pre_store<NT>(a, L, sm, k, c + 1, pre);
      } else {
        chunk_scalars(a, L, sm, k, c + 1);
        lean_chunk_angles<NT, (ST < 8 ? 4 : 1)>(a, L, sm, k, c + 1);
      }
    }
    if (a.has_norm) lean_norm_stats<NT, (ST < 8)>(a, L, sm, Lc);
    lean_epilogue<NT, (ST < 8)>(a, L, sm, k, s0, Lc);
    // The state planes were last read by lean_y (before the barrier above); the epilogue does
    // not touch them. The state after the segment's last chunk is not needed (the next segment
    // starts from ws_enter).
    if (c + 1 < c1) {
      lean_state_update<NT>(a, tt, st, e_chunk);
      lean_state_out<NT, ST, !kCopy>(a, tt, k, c + 1, st);
    }
  }
  mb_sync();
  if (defer && c1 > c0) {  // the last chunk's
    lean_epilogue_sums<NT>(a, L, sm);
    mb_sync();
  }
  write_partials<NT>(a, L, sm, k, seg, Ppt);
}

}  // namespace mamba3::cuda::mimo
