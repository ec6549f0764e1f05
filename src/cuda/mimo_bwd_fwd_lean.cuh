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

MB_DEV LeanTiles lean_tiles(const MbArgs& a, const MbLayout& L, float* sm) {
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

// ------------------------------------------------------------------ tile builders

// Elements off and off + st of a bf16 tensor: one 4-byte load when the layout allows
// (a.lean_vec: unit last strides, even strides, aligned bases), else two 2-byte loads. Both give
// the same values, so the results do not depend on the layout (bitwise).
MB_DEV uint32_t ld_raw2s(const MbView& v, int64_t off, int64_t st, bool vec) {
  if (vec) {
#if defined(__CUDA_ARCH__)
    return __ldg(reinterpret_cast<const unsigned int*>(reinterpret_cast<const __nv_bfloat16*>(v.p) + off));
#else
    return *reinterpret_cast<const uint32_t*>(reinterpret_cast<const __nv_bfloat16*>(v.p) + off);
#endif
  }
  const unsigned short* e = reinterpret_cast<const unsigned short*>(v.p);
#if defined(__CUDA_ARCH__)
  return static_cast<uint32_t>(__ldg(e + off)) | (static_cast<uint32_t>(__ldg(e + off + st)) << 16);
#else
  return static_cast<uint32_t>(e[off]) | (static_cast<uint32_t>(e[off + st]) << 16);
#endif
}

MB_DEV float2 ld_bf2s(const MbView& v, int64_t off, int64_t st, bool vec) {
  const uint32_t u = ld_raw2s(v, off, st, vec);
  __nv_bfloat162 b;
  *reinterpret_cast<uint32_t*>(&b) = u;
  return __bfloat1622float2(b);
}

// Element e of a staged bf16 row region.
MB_DEV float st_bf(const float* region, int e) {
  return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(region)[e]);
}


// cos / sin of chunk c's angles into the table ang[2][C][A] (rows past the sequence: 1 / 0).
// Once per chunk and step, not once per rank and tile row.
template <int NT>
MB_DEV void lean_chunk_angles(const MbArgs& a, const MbLayout& L, float* sm, const MbCta& k, int c) {
  if (L.ang < 0) return;  // no room for the table: lean_qk_task computes them itself
  const int s0 = c * a.C, Lc = min(a.C, a.S - s0), A = a.A, CA = a.C * A;
  for (int e = mb_tid(); e < CA; e += NT) {
    const int t = e / A, n = e - t * A;
    float sn = 0.f, cs = 1.f;
    if (t < Lc) sincosf(ld4(a.angles, k.b, s0 + t, k.h, n), &sn, &cs);
    sm[L.ang + e] = cs;
    sm[L.ang + CA + e] = sn;
  }
}

// Qh (if want_q) and Kh of chunk c: biased, rotated, split. One task = two adjacent columns
// (n, n+1) and their rotation partners (n + N/2, n + N/2 + 1) of one row i = t R + r. Needs the
// angle table.
MB_DEV void lean_qk_task(const MbArgs& a, const MbLayout& L, float* sm, const LeanTiles& tt,
                         const MbCta& k, int s0, int Lc, int i, int n, bool want_q) {
  const int R = a.R, half = a.half, N = a.N;
  const int t = i >> a.lgR, r = i & (R - 1);
  float q1x = 0.f, q1y = 0.f, q2x = 0.f, q2y = 0.f, k1x = 0.f, k1y = 0.f, k2x = 0.f, k2y = 0.f;
  if (t < Lc) {
    const int64_t gi = s0 + t;
    const bool vec = a.lean_vec;
    const int64_t sk = a.k.s[4], sq = a.q.s[4];
    const int64_t ok = k.b * a.k.s[0] + gi * a.k.s[1] + r * a.k.s[2] + k.g * a.k.s[3] + n * sk;
    const float2 ka = ld_bf2s(a.k, ok, sk, vec), kb = ld_bf2s(a.k, ok + half * sk, sk, vec);
    float2 qa = make_float2(0.f, 0.f), qb = qa;
    if (want_q) {
      const int64_t oq = k.b * a.q.s[0] + gi * a.q.s[1] + r * a.q.s[2] + k.g * a.q.s[3] + n * sq;
      qa = ld_bf2s(a.q, oq, sq, vec), qb = ld_bf2s(a.q, oq + half * sq, sq, vec);
    }
    const float* kbias = sm + L.kb + r * N;
    k1x = ka.x + kbias[n], k1y = ka.y + kbias[n + 1];
    k2x = kb.x + kbias[n + half], k2y = kb.y + kbias[n + half + 1];
    if (want_q) {
      const float* qbias = sm + L.qb + r * N;
      q1x = qa.x + qbias[n], q1y = qa.y + qbias[n + 1];
      q2x = qb.x + qbias[n + half], q2y = qb.y + qbias[n + half + 1];
    }
  }
  float cs0 = 1.f, sn0 = 0.f, cs1 = 1.f, sn1 = 0.f;
  if (n < a.A) {  // A is a multiple of 4: n and n + 1 rotate together
    if (L.ang >= 0) {
      const int CA = a.C * a.A, e = t * a.A + n;
      cs0 = sm[L.ang + e], cs1 = sm[L.ang + e + 1];
      sn0 = sm[L.ang + CA + e], sn1 = sm[L.ang + CA + e + 1];
    } else if (t < Lc) {
      sincosf(ld4(a.angles, k.b, s0 + t, k.h, n), &sn0, &cs0);
      sincosf(ld4(a.angles, k.b, s0 + t, k.h, n + 1), &sn1, &cs1);
    }
  }
  // (a, b) -> (a cos - b sin, a sin + b cos) on the pairs (n, n + N/2).
  const int e1 = i * tt.ldN + n, e2 = e1 + half;
  st_split2(tt.Kh.h, tt.Kh.plane, e1, k1x * cs0 - k2x * sn0, k1y * cs1 - k2y * sn1);
  st_split2(tt.Kh.h, tt.Kh.plane, e2, k1x * sn0 + k2x * cs0, k1y * sn1 + k2y * cs1);
  if (want_q) {
    st_split2(tt.Qh.h, tt.Qh.plane, e1, q1x * cs0 - q2x * sn0, q1y * cs1 - q2y * sn1);
    st_split2(tt.Qh.h, tt.Qh.plane, e2, q1x * sn0 + q2x * cs0, q1y * sn1 + q2y * cs1);
  }
}

template <int NT>
MB_DEV void lean_build_qk(const MbArgs& a, const MbLayout& L, float* sm, const LeanTiles& tt,
                          const MbCta& k, int c, bool want_q) {
  const int s0 = c * a.C, Lc = min(a.C, a.S - s0);
  const int hp = a.half / 2, T = a.Tb;
  if (NT % hp == 0) {  // each thread keeps its column pair: no division per task
    const int n = 2 * (mb_tid() % hp), step = NT / hp;
    for (int i = mb_tid() / hp; i < T; i += step) lean_qk_task(a, L, sm, tt, k, s0, Lc, i, n, want_q);
  } else {
    for (int u = mb_tid(); u < T * hp; u += NT)
      lean_qk_task(a, L, sm, tt, k, s0, Lc, u / hp, 2 * (u % hp), want_q);
  }
}

// X = v * mimo_v (if want_x) and Xw = X * w (state-update weight) of chunk c, split.
MB_DEV void lean_x_task(const MbArgs& a, const MbLayout& L, float* sm, const LeanTiles& tt,
                        const MbCta& k, int s0, int Lc, int t, int p, bool want_x) {
  const int R = a.R;
  float2 vv = make_float2(0.f, 0.f);
  const int64_t gi = s0 + t;
  const bool vec = a.lean_vec;
  if (t < Lc)
    vv = ld_bf2s(a.v, k.b * a.v.s[0] + gi * a.v.s[1] + k.h * a.v.s[2] + p * a.v.s[3], a.v.s[3], vec);
  if (want_x) {
    // Stage the epilogue's z and dout rows (fp32) now: their loads overlap the tile loads
    // instead of stalling the epilogue.
    // Raw bf16 pairs (exact), two per float of shared memory.
    uint32_t* zs = reinterpret_cast<uint32_t*>(sm + L.zs);
    uint32_t* ds = reinterpret_cast<uint32_t*>(sm + L.ds);
    const int pw = p / 2, P2 = a.P / 2;
    zs[t * P2 + pw] = a.has_z && t < Lc
                          ? ld_raw2s(a.z, k.b * a.z.s[0] + gi * a.z.s[1] + k.h * a.z.s[2] + p * a.z.s[3],
                                     a.z.s[3], vec)
                          : 0u;
    if (a.reduce_o) {
      ds[t * P2 + pw] =
          t < Lc ? ld_raw2s(a.dout, k.b * a.dout.s[0] + gi * a.dout.s[1] + k.h * a.dout.s[2] +
                                        p * a.dout.s[3], a.dout.s[3], vec)
                 : 0u;
    } else {
      for (int r = 0; r < R; ++r)
        ds[(t * R + r) * P2 + pw] =
            t < Lc ? ld_raw2s(a.dout, k.b * a.dout.s[0] + gi * a.dout.s[1] + r * a.dout.s[2] +
                                          k.h * a.dout.s[3] + p * a.dout.s[4], a.dout.s[4], vec)
                   : 0u;
    }
  }
  const float w = sm[L.wk + t];
  for (int r = 0; r < R; ++r) {
    const float* mv = sm + L.mv + r * a.Ppt + p;
    const float x0 = vv.x * mv[0], x1 = vv.y * mv[1];
    const int e = (t * R + r) * tt.ldP + p;
    if (want_x) st_split2(tt.X.h, tt.X.plane, e, x0, x1);
    st_split2(tt.Xw.h, tt.Xw.plane, e, x0 * w, x1 * w);
  }
}

template <int NT>
MB_DEV void lean_build_x(const MbArgs& a, const MbLayout& L, float* sm, const LeanTiles& tt,
                         const MbCta& k, int c, bool want_x) {
  const int s0 = c * a.C, Lc = min(a.C, a.S - s0);
  const int pp = a.P / 2;
  if (NT % pp == 0) {
    const int p = 2 * (mb_tid() % pp), step = NT / pp;
    for (int t = mb_tid() / pp; t < a.C; t += step) lean_x_task(a, L, sm, tt, k, s0, Lc, t, p, want_x);
  } else {
    for (int u = mb_tid(); u < a.C * pp; u += NT)
      lean_x_task(a, L, sm, tt, k, s0, Lc, u / pp, 2 * (u % pp), want_x);
  }
}

// ------------------------------------------------------------------ products

// Sc = mask(Qh Kh^T) (split, into tt.Sc) and the qk_dot output of chunk c.
template <int NT>
MB_DEV void lean_scores(const MbArgs& a, const MbLayout& L, float* sm, const LeanTiles& tt,
                        const MbCta& k, int c, float Dv) {
  const int T = a.Tb, R = a.R, nt = T / 16;
  const int lane = mb_tid() & 31, g = lane >> 2, q = lane & 3;
  const int s0 = c * a.C, Lc = min(a.C, a.S - s0);
  for (int tile = mb_tid() >> 5; tile < nt * nt; tile += NT / 32) {
    const int m0 = (tile / nt) * 16, n0 = (tile % nt) * 16;
    float acc[2][4];
    zero_acc(acc);
    // Key steps all after the query steps: the tile is masked to zero.
    const bool live = (n0 >> a.lgR) <= ((m0 + 15) >> a.lgR);
    if (live) warp_mma_16x16<false, false>(acc, tt.Qh, m0, tt.Kh, n0, 0, a.N);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = m0 + g + 8 * hr, jj = n0 + 8 * j + 2 * q;
        const int tq = i >> a.lgR, ri = i & (R - 1);
        float v2[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = jj + e;
          const int tk = col >> a.lgR, rj = col & (R - 1);
          const float sv = acc[j][2 * hr + e];
          float val = 0.f;
          if (tk < tq) {
            val = sv * sm[L.W + tq * a.C + tk];
          } else if (tk == tq) {
            val = sm[L.gamma + tq] * sv;
            if (ri == rj) val += Dv;
            if (tq < Lc) st5(a.qk_dot, k.b, k.h, s0 + tq, ri, rj, sv);
          }
          v2[e] = val;
        }
        st_split2(tt.Sc.h, tt.Sc.plane, i * tt.ldT + jj, v2[0], v2[1]);
      }
    }
  }
}

// Y = diag(exp(da_cs)) Qh St + Sc X into the fp32 Y tile (row stride a.LP).
template <int NT>
MB_DEV void lean_y(const MbArgs& a, const MbLayout& L, float* sm, const LeanTiles& tt) {
  const int T = a.Tb, ntp = a.P / 16, LP = a.LP;
  const int lane = mb_tid() & 31, g = lane >> 2, q = lane & 3;
  for (int tile = mb_tid() >> 5; tile < (T / 16) * ntp; tile += NT / 32) {
    const int m0 = (tile / ntp) * 16, n0 = (tile % ntp) * 16;
    float acc[2][4];
    zero_acc(acc);
    warp_mma_16x16<false, true>(acc, tt.Qh, m0, tt.St, n0, 0, a.N);
    const float e0 = sm[L.expda + ((m0 + g) >> a.lgR)], e1 = sm[L.expda + ((m0 + g + 8) >> a.lgR)];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      acc[j][0] *= e0, acc[j][1] *= e0;
      acc[j][2] *= e1, acc[j][3] *= e1;
    }
    // Keys up to the tile's last step (Sc is zero past it).
    const int k1 = min(T, (((((m0 + 15) >> a.lgR) + 1) << a.lgR) + 15) & ~15);
    warp_mma_16x16<false, true>(acc, tt.Sc, m0, tt.X, n0, 0, k1);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = n0 + 8 * j + 2 * q;
      *reinterpret_cast<float2*>(sm + L.Y + (m0 + g) * LP + col) = make_float2(acc[j][0], acc[j][1]);
      *reinterpret_cast<float2*>(sm + L.Y + (m0 + g + 8) * LP + col) =
          make_float2(acc[j][2], acc[j][3]);
    }
  }
}

// ------------------------------------------------------------------ epilogue (gradients of Y)

// The gate of rank r at (t, p) from the staged z: u = z mimo_z, gate = silu(u), dsilu = silu'(u).
struct LeanGate {
  float u, gate, dsilu;
};
MB_DEV LeanGate lean_gate(float z, float mz) {
  LeanGate g;
  g.u = z * mz;
  const float sg = 1.f / (1.f + __expf(-g.u));
  g.gate = g.u * sg;
  g.dsilu = sg * (1.f + g.u * (1.f - sg));
  return g;
}

// RMSNorm row statistics from the Y tile and the staged z / dout (as epi_norm_stats). The
// threads per row (tpr) follow NT, and so does the order of the row sums.
template <int NT>
MB_DEV void lean_norm_stats(const MbArgs& a, const MbLayout& L, float* sm, int Lc) {
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
        const LeanGate gt = lean_gate(st_bf(sm + L.zs, t * P + p), sm[L.mz + r * P + p]);
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

// dz, dout_pre_rms and the chunk's contributions to dmimo_o / dmimo_z / dnorm_weight, in one
// pass: thread (p, t0) handles column p of steps t0, t0 + NT/P, ... (every rank), sums its
// steps' contributions per rank in registers, and the threads of one column then add theirs
// to the Kahan partials in a fixed order (deterministic; the grouping follows NT). Needs
// NT % P == 0.
template <int NT>
MB_DEV void lean_epilogue(const MbArgs& a, const MbLayout& L, float* sm, const MbCta& k, int s0,
                          int Lc) {
  if (!a.reduce_o && !a.has_z) return;  // nothing to do without mimo_o and the gate
  const int R = a.R, P = a.P, LP = a.LP, tstep = NT / P;
  const int p = mb_tid() % P, t0 = mb_tid() / P;
  float so[kMaxR], sz[kMaxR], sn[kMaxR];
#pragma unroll
  for (int r = 0; r < kMaxR; ++r) so[r] = sz[r] = sn[r] = 0.f;
  const float nwp = a.has_norm ? sm[L.nw + p] : 1.f;
  for (int t = t0; t < Lc; t += tstep) {
    const int64_t gi = s0 + t;
    const float zz = st_bf(sm + L.zs, t * P + p);
    const float d = a.reduce_o ? st_bf(sm + L.ds, t * P + p) : 0.f;
    float dzs = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxR; ++r) {
      if (r >= R) break;
      const int i = t * R + r;
      const float y = sm[L.Y + i * LP + p];
      if (!a.has_z) {  // reduce-O without a gate
        so[r] = fmaf(d, y, so[r]);
        continue;
      }
      const float mzv = sm[L.mz + r * P + p];
      const float dr = a.reduce_o ? d * sm[L.mo + r * P + p] : st_bf(sm + L.ds, i * P + p);
      const LeanGate gt = lean_gate(zz, mzv);
      float yg = y;  // what the gate multiplies
      if (a.has_norm) {
        const float rstd = sm[L.rstd + i];
        const float xhat = y * rstd;
        yg = xhat * nwp;
        const float dxhat = dr * gt.gate * nwp;
        st4(a.dout_pre, k.b, k.h, gi * R + r, p, rstd * (dxhat - xhat * sm[L.rdot + i]));
        sn[r] = fmaf(dr * gt.gate, xhat, sn[r]);
      }
      if (a.reduce_o) so[r] = fmaf(d * gt.gate, yg, so[r]);
      const float gz = dr * yg * gt.dsilu;
      sz[r] = fmaf(gz, zz, sz[r]);
      dzs = fmaf(gz, mzv, dzs);
    }
    if (a.has_z) st4(a.dz, k.b, gi, k.h, p, dzs);
  }
  // Exchange: ered[kind][t0][r][p], then the first row of threads adds them in t0 order.
  float* ex = sm + L.ered;
  const int RP = R * P;
#pragma unroll
  for (int r = 0; r < kMaxR; ++r) {
    if (r >= R) break;
    ex[(0 * tstep + t0) * RP + r * P + p] = so[r];
    ex[(1 * tstep + t0) * RP + r * P + p] = sz[r];
    ex[(2 * tstep + t0) * RP + r * P + p] = sn[r];
  }
  mb_sync();
  for (int q = mb_tid(); q < RP; q += NT) {
    for (int kind = 0; kind < kParts; ++kind) {
      float v = 0.f;
      for (int j = 0; j < tstep; ++j) v += ex[(kind * tstep + j) * RP + q];
      float* acc = sm + L.acc + kind * 2 * RP + q;
      kahan_add(acc, acc + RP, v);
    }
  }
}

// The register state: warp w owns the 16 x 16 tiles w, w + NT / 32, ... of St [N][P].
template <int ST>
struct LeanState {
  float acc[ST][2][4];
};

// St = e St + Kh^T Xw.
template <int NT, int ST>
MB_DEV void lean_state_update(const MbArgs& a, const LeanTiles& tt, LeanState<ST>& s, float e) {
  const int ntp = a.P / 16, ntiles = (a.N / 16) * ntp;
#pragma unroll
  for (int j = 0; j < ST; ++j) {
    const int tile = (mb_tid() >> 5) + j * (NT / 32);
    if (tile >= ntiles) break;
#pragma unroll
    for (int x = 0; x < 2; ++x)
#pragma unroll
      for (int y = 0; y < 4; ++y) s.acc[j][x][y] *= e;
    warp_mma_16x16<true, true>(s.acc[j], tt.Kh, (tile / ntp) * 16, tt.Xw, (tile % ntp) * 16, 0,
                               a.Tb);
  }
}

// Applies f(n, p, v0, v1) to every owned state element pair (columns p, p + 1).
template <int NT, int ST, class F>
MB_DEV void lean_state_foreach(const MbArgs& a, const LeanState<ST>& s, F f) {
  const int ntp = a.P / 16, ntiles = (a.N / 16) * ntp;
  const int lane = mb_tid() & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int j = 0; j < ST; ++j) {
    const int tile = (mb_tid() >> 5) + j * (NT / 32);
    if (tile >= ntiles) break;
    const int m0 = (tile / ntp) * 16, n0 = (tile % ntp) * 16;
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const int p = n0 + 8 * x + 2 * q;
      f(m0 + g, p, s.acc[j][x][0], s.acc[j][x][1]);
      f(m0 + g + 8, p, s.acc[j][x][2], s.acc[j][x][3]);
    }
  }
}

template <int NT, int ST>
MB_DEV void lean_state_to_planes(const MbArgs& a, const LeanTiles& tt, const LeanState<ST>& s) {
  lean_state_foreach<NT>(a, s, [&](int n, int p, float v0, float v1) {
    st_split2(tt.St.h, tt.St.plane, n * tt.ldP + p, v0, v1);
  });
}

// states[b, h, c] = St (paired stores when the layout allows).
template <int NT, int ST>
MB_DEV void lean_write_states(const MbArgs& a, const MbCta& k, int c, const LeanState<ST>& s) {
  const MbView& o = a.states;
  const int64_t base = k.b * o.s[0] + k.h * o.s[1] + static_cast<int64_t>(c) * o.s[2];
  lean_state_foreach<NT>(a, s, [&](int n, int p, float v0, float v1) {
    const int64_t off = base + n * o.s[3] + p;
    if (a.states_vec4) {
      if (o.dt == 2) {
        *reinterpret_cast<float2*>(reinterpret_cast<float*>(o.p) + off) = make_float2(v0, v1);
      } else if (o.dt == 1) {
        *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<__nv_bfloat16*>(o.p) + off) =
            __floats2bfloat162_rn(v0, v1);
      } else {
        *reinterpret_cast<__half2*>(reinterpret_cast<__half*>(o.p) + off) = __floats2half2_rn(v0, v1);
      }
    } else {
      rt_st(o.p, off, o.dt, v0);
      rt_st(o.p, off + o.s[4], o.dt, v1);
    }
  });
}

// ------------------------------------------------------------------ kernel bodies

// K1 (lean): local recurrence of one sub-segment from a zero state.
template <int NT, int ST>
MB_DEV void k1_lean_body(const MbArgs& a, float* sm) {
  const MbLayout& L = a.l1;
  const int64_t bid = mb_bid();
  const int sub = static_cast<int>(bid % a.nsub);
  MbCta k;
  k.bhi = static_cast<int>(bid / a.nsub);
  k.b = k.bhi / a.H, k.h = k.bhi % a.H, k.g = k.h / a.HG;
  k.p0 = 0, k.Pv = a.P;
  const LeanTiles tt = lean_tiles(a, L, sm);
  load_consts<NT>(a, L, sm, k, false, false, a.Ppt);
  LeanState<ST> st;
#pragma unroll
  for (int j = 0; j < ST; ++j) zero_acc(st.acc[j]);
  float dec = 0.f;
  const int c0 = sub * a.L1, c1 = c0 + a.L1;  // sub-segments never reach the last chunk
  for (int c = c0; c < c1; ++c) {
    mb_sync();
    chunk_scalars(a, L, sm, k, c);
    lean_chunk_angles<NT>(a, L, sm, k, c);
    mb_sync();
    dec += sm[L.misc + 1];
    const float e = sm[L.misc];
    lean_build_qk<NT>(a, L, sm, tt, k, c, false);
    lean_build_x<NT>(a, L, sm, tt, k, c, false);
    mb_sync();
    lean_state_update<NT>(a, tt, st, e);
  }
  float* out = a.ws_local + (static_cast<int64_t>(k.bhi) * a.nsub + sub) * a.N * a.P;
  lean_state_foreach<NT>(a, st, [&](int n, int p, float v0, float v1) {
    *reinterpret_cast<float2*>(out + static_cast<int64_t>(n) * a.P + p) = make_float2(v0, v1);
  });
  if (mb_tid() == 0) a.ws_dec[static_cast<int64_t>(k.bhi) * a.nsub + sub] = dec;
}

// K3 (lean): one segment of one (b, h): the full chunk pass.
template <int NT, int ST>
MB_DEV void k3_lean_body(const MbArgs& a, float* sm) {
  const MbLayout& L = a.l3;
  const int64_t bid = mb_bid();
  const int seg = static_cast<int>(bid % a.nseg);
  MbCta k;
  k.bhi = static_cast<int>(bid / a.nseg);
  k.b = k.bhi / a.H, k.h = k.bhi % a.H, k.g = k.h / a.HG;
  k.p0 = 0, k.Pv = a.P;
  const int Ppt = a.Ppt;
  const LeanTiles tt = lean_tiles(a, L, sm);
  // The epilogue's Kahan partials start from zero.
  for (int e = mb_tid(); e < 2 * kParts * a.R * Ppt; e += NT) sm[L.acc + e] = 0.f;
  load_consts<NT>(a, L, sm, k, true, true, Ppt);
  LeanState<ST> st;
  if (seg > 0) {
    const float* in = a.ws_enter + (static_cast<int64_t>(k.bhi) * (a.nseg - 1) + seg - 1) * a.N * a.P;
    const int ntp = a.P / 16, ntiles = (a.N / 16) * ntp;
    const int lane = mb_tid() & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int j = 0; j < ST; ++j) {
      const int tile = (mb_tid() >> 5) + j * (NT / 32);
      if (tile >= ntiles) break;
      const int m0 = (tile / ntp) * 16, n0 = (tile % ntp) * 16;
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int p = n0 + 8 * x + 2 * q;
        const float2 v0 = *reinterpret_cast<const float2*>(in + static_cast<int64_t>(m0 + g) * a.P + p);
        const float2 v1 = *reinterpret_cast<const float2*>(in + static_cast<int64_t>(m0 + g + 8) * a.P + p);
        st.acc[j][x][0] = v0.x, st.acc[j][x][1] = v0.y, st.acc[j][x][2] = v1.x, st.acc[j][x][3] = v1.y;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < ST; ++j) zero_acc(st.acc[j]);
  }
  lean_state_to_planes<NT>(a, tt, st);
  const float Dv = a.has_d ? ld1(a.d, k.h) : 0.f;

  const int c0 = seg * a.L3, c1 = min(a.nch, c0 + a.L3);
  for (int c = c0; c < c1; ++c) {
    const int s0 = c * a.C, Lc = min(a.C, a.S - s0);
    mb_sync();
    chunk_scalars(a, L, sm, k, c);
    lean_chunk_angles<NT>(a, L, sm, k, c);
    lean_write_states<NT>(a, k, c, st);
    mb_sync();
    chunk_weights<NT>(a, L, sm, k, c);
    const float e_chunk = sm[L.misc];
    lean_build_qk<NT>(a, L, sm, tt, k, c, true);
    lean_build_x<NT>(a, L, sm, tt, k, c, true);
    mb_sync();
    lean_scores<NT>(a, L, sm, tt, k, c, Dv);
    mb_sync();
    lean_y<NT>(a, L, sm, tt);
    mb_sync();
    if (a.has_norm) lean_norm_stats<NT>(a, L, sm, Lc);
    lean_epilogue<NT>(a, L, sm, k, s0, Lc);
    // The state planes were last read by lean_y (before the barrier above); the epilogue does
    // not touch them.
    if (c + 1 < a.nch) {
      lean_state_update<NT>(a, tt, st, e_chunk);
      lean_state_to_planes<NT>(a, tt, st);
    }
  }
  mb_sync();
  write_partials<NT>(a, L, sm, k, seg, Ppt);
}

}  // namespace mamba3::cuda::mimo
