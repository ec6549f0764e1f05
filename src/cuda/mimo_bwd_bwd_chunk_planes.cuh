// K3 of mamba3_mimo_bwd_bwd on the planes kernel: the chunk pass of mimo_bwd_bwd_kernels.cuh
// (chunk_body: same formulas, same outputs and workspace partials for K4) for 16-bit q, k, v,
// with every chunk operand in shared memory as bf16 hi/lo planes split once per chunk (why:
// chunk_body keeps them in fp32 global scratch and splits every operand at every load; see
// docs/PERF.md, "Design of that chunk kernel"). Products: mimo::warp_mma_16x16 (three bf16
// mma.m16n8k16 per tile, fp32 accumulation, ~2^-17 relative error per product).
//
// One CTA of kPlanesThreads (16 warps) per SM, grid-stride over the (b, h, chunk) items (the
// next item's inputs are prefetched to L2 during this one's phase 3); T = C R rows (zero past
// the sequence).
//   phase 0  per-step scalars; planes qh, kh [T][N] (biased, rotated), x, g = dPhiO [T][P],
//            st = states[c] [N][P]; the chunk's DD partial (sum g x, from the fp32 values)
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
// K1 has a planes version here too (increment_planes_body), taken together with this K3.
#pragma once

#include "cuda/bf16_split_mma.cuh"
#include "cuda/mimo_bwd_bwd_kernels.cuh"

namespace mamba3::cuda::bb {

// Stores x as the split pair (hi, lo) at element e of a planes tile.
BB_DEV void st_split1(const mimo::SplitTile& t, int e, float x) {
  const __nv_bfloat16 hi = __float2bfloat16_rn(x);
  t.h[e] = hi;
  t.h[t.plane + e] = __float2bfloat16_rn(x - __bfloat162float(hi));
}

// hi + lo of element e (the operand as the products see it).
BB_DEV float plane_val(const mimo::SplitTile& t, int e) {
  return __bfloat162float(t.h[e]) + __bfloat162float(t.h[t.plane + e]);
}

// For a warp's 16 x 16 accumulator tile (rows m0.., columns n0..), the row sums of
// V[row][col] * acc[row][col] over the tile's 16 columns into part[row * ncol_tiles + n0 / 16].
// Every lane of the warp calls it.
BB_DEV void tile_row_dots(const mimo::SplitTile& V, int m0, int n0, const float (&acc)[2][4],
                          float* part, int ncol_tiles) {
  const int lane = bb_tid() & 31, g = lane >> 2, q = lane & 3;
  const int e0 = (m0 + g) * V.ld + n0 + 2 * q, e1 = e0 + 8 * V.ld;
  float v0 = 0.f, v1 = 0.f;
  BB_UNROLL
  for (int j = 0; j < 2; ++j) {
    v0 += plane_val(V, e0 + 8 * j) * acc[j][0] + plane_val(V, e0 + 8 * j + 1) * acc[j][1];
    v1 += plane_val(V, e1 + 8 * j) * acc[j][2] + plane_val(V, e1 + 8 * j + 1) * acc[j][3];
  }
  v0 += mimo::mb_shfl_xor(v0, 1);
  v1 += mimo::mb_shfl_xor(v1, 1);
  v0 += mimo::mb_shfl_xor(v0, 2);
  v1 += mimo::mb_shfl_xor(v1, 2);
  if (q == 0) {
    part[(m0 + g) * ncol_tiles + n0 / 16] = v0;
    part[(m0 + g + 8) * ncol_tiles + n0 / 16] = v1;
  }
}

// acc rows scaled by f[row / R] (rows m0 + g and m0 + g + 8 of the fragment).
BB_DEV void scale_rows(float (&acc)[2][4], int m0, int R, const float* f) {
  const int g = (bb_tid() & 31) >> 2;
  const float s0 = f[(m0 + g) / R], s1 = f[(m0 + g + 8) / R];
  BB_UNROLL
  for (int j = 0; j < 2; ++j) {
    acc[j][0] *= s0;
    acc[j][1] *= s0;
    acc[j][2] *= s1;
    acc[j][3] *= s1;
  }
}

// Stores a 16 x 16 accumulator tile into the fp32 matrix out (row stride ld).
BB_DEV void store_tile(const float (&acc)[2][4], int m0, int n0, float* out, int ld) {
  const int lane = bb_tid() & 31, g = lane >> 2, q = lane & 3;
  BB_UNROLL
  for (int j = 0; j < 2; ++j) {
    float* o = out + (m0 + g) * ld + n0 + 8 * j + 2 * q;
    o[0] = acc[j][0];
    o[1] = acc[j][1];
    o[8 * ld] = acc[j][2];
    o[8 * ld + 1] = acc[j][3];
  }
}

// For e = tid, tid + NT, ... < n: the loads of a group of U elements are all issued before any
// of the group's stores (why: with one CTA per SM, a load-then-store chain per element would keep
// one global load in flight per thread).
template <int U, int NT = kPlanesThreads, class Load, class Store>
BB_DEV void batched_elements(int n, Load load, Store store) {
  for (int e0 = bb_tid(); e0 < n; e0 += U * NT) {
    decltype(load(0)) v[U] = {};
    BB_UNROLL
    for (int u = 0; u < U; ++u) {
      const int e = e0 + u * NT;
      if (e < n) v[u] = load(e);
    }
    BB_UNROLL
    for (int u = 0; u < U; ++u) {
      const int e = e0 + u * NT;
      if (e < n) store(e, v[u]);
    }
  }
}

#if defined(__CUDA_ARCH__)
BB_DEV void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
#else
inline void prefetch_l2(const void*) {}  // a hint: nothing to emulate
#endif

// Asks L2 for the inputs of chunk `item` (q, k rows, v, dPhiO rows, states[c], dS_c, segsum and
// angle rows, per-step scalars), one request per 128-byte line of each row. Called by a CTA for
// its next chunk during the current one's phase 3 (why: one CTA per SM, so nothing else overlaps
// its load phases with DRAM latency; served from L2 they should be ~2x shorter: not measured).
BB_DEV void prefetch_item(const Args& a, int64_t item) {
  const int c = static_cast<int>(item % a.nch);
  const int64_t bh = item / a.nch;
  const int b = static_cast<int>(bh / a.H), h = static_cast<int>(bh % a.H), grp = h / a.HG;
  const int R = a.R, N = a.N, P = a.P, s0 = c * a.C, L = bb_min(a.C, a.S - s0);
  const bool partial = L < a.C;
  const int LR = L * R, nd = a.layout == 0 ? L : LR;
  const int64_t NP = static_cast<int64_t>(N) * P;
  // Row groups, in order: q, k (L R rows of N), v (L of P), dPhiO (nd of P), states (N of P),
  // segsum (L of C, whole chunks only), angles (L of A), da_cs / dt / trap (one row of L each),
  // dS_c (NP / 32 lines of fp32).
  const int g_q = LR, g_k = g_q + LR, g_v = g_k + L, g_d = g_v + nd, g_s = g_d + N,
            g_w = g_s + (partial ? 0 : L), g_a = g_w + L, g_t = g_a + 3;
  const int total = g_t + static_cast<int>((NP + 31) / 32);
  for (int e = bb_tid(); e < total; e += kPlanesThreads) {
    if (e >= g_t) {
      prefetch_l2(a.ws_ds + item * NP + static_cast<int64_t>(e - g_t) * 32);
      continue;
    }
    const View* v;
    int64_t off, stride;
    int cnt;
    if (e < g_k) {
      const int row = e < g_q ? e : e - g_q, i = row / R, r = row % R;
      v = e < g_q ? &a.q : &a.k;
      off = int64_t{b} * v->s[0] + (s0 + i) * v->s[1] + r * v->s[2] + int64_t{grp} * v->s[3];
      stride = v->s[4], cnt = N;
    } else if (e < g_v) {
      v = &a.v, off = o3(a.v, b, s0 + e - g_k, h), stride = a.v.s[3], cnt = P;
    } else if (e < g_d) {
      const int row = e - g_v, i = a.layout == 0 ? row : row / R, r = a.layout == 0 ? 0 : row % R;
      v = &a.dout, off = dphio_row(a, b, s0 + i, r, h), stride = dphio_pstride(a), cnt = P;
    } else if (e < g_s) {
      v = &a.states, off = o4(a.states, b, h, c, e - g_d), stride = a.states.s[4], cnt = P;
    } else if (e < g_w) {
      v = &a.segsum, off = o5(a.segsum, b, h, c, e - g_s, 0), stride = a.segsum.s[4], cnt = a.C;
    } else if (e < g_a) {
      v = &a.angles, off = o4(a.angles, b, s0 + e - g_w, h, 0), stride = a.angles.s[3], cnt = a.A;
    } else {
      v = e == g_a ? &a.da_cs : e == g_a + 1 ? &a.dt : &a.trap;
      off = o3(*v, b, h, s0), stride = v->s[2], cnt = L;
    }
    const int es = v->dt == 2 ? 4 : 2;
    const int64_t span = (stride < 0 ? -stride : stride) * es;
    const int step = span >= 128 || span == 0 ? 1 : static_cast<int>(128 / span);
    for (int k = 0; k < cnt; k += step) prefetch_l2(v->p + (off + k * stride) * es);
  }
}

// K1 on planes: U_c = sum over the chunk's rows of (E_i qh_i^r) (x) dPhiO_i^r (as increment_body),
// one CTA of kIncPlanesThreads per (b, h, c), c >= 1; E qh and dPhiO split into planes once, U in
// 16 x 16 mma tiles (E qh read transposed: the contraction runs along its rows).
// smem: PlanesLayout::inc_bytes.
BB_DEV void increment_planes_body(const Args& a, unsigned char* smem) {
  constexpr int NT = kIncPlanesThreads;
  const int64_t item = bb_bid();  // = bh * nch + c
  const int c = static_cast<int>(item % a.nch);
  if (c == 0) return;  // U_0 would only feed the state entering chunk 0, which nothing reads
  const PlanesLayout& Ly = a.ply;
  const int tid = bb_tid(), warp = tid >> 5;
  const int64_t bh = item / a.nch;
  const int b = static_cast<int>(bh / a.H), h = static_cast<int>(bh % a.H), grp = h / a.HG;
  const int N = a.N, P = a.P, R = a.R, C = a.C, A = a.A, half = a.half, T = C * R;
  const int s0 = c * C, L = bb_min(C, a.S - s0), TL = L * R;
  const int ldN = Ly.ldN, ldP = Ly.ldP;
  const mimo::SplitTile EQ{reinterpret_cast<__nv_bfloat16*>(smem), T * ldN, ldN};
  const mimo::SplitTile Gp{reinterpret_cast<__nv_bfloat16*>(smem + Ly.inc_g), T * ldP, ldP};
  float* s_E = reinterpret_cast<float*>(smem + Ly.inc_E);
  for (int i = tid; i < L; i += NT) s_E[i] = expf(ld(a.da_cs, o3(a.da_cs, b, h, s0 + i)));
  const int64_t dps = dphio_pstride(a);
  batched_elements<4, NT>(
      T * P,
      [&](int e) {
        const int row = e / P, p = e % P, i = row / R, r = row % R;
        float vg = 0.f;
        if (row < TL) {
          vg = ld(a.dout, dphio_row(a, b, s0 + i, r, h) + p * dps);
          if (a.layout == 0) vg *= ld(a.mimo_o, o3(a.mimo_o, h, r, p));
        }
        return vg;
      },
      [&](int e, float vg) { st_split1(Gp, e / P * ldP + e % P, vg); });
  bb_sync();  // s_E
  const int64_t q0 = int64_t{b} * a.q.s[0] + int64_t{grp} * a.q.s[3];
  for (int e = tid; e < C * half; e += NT) {
    const int i = e / half, n = e % half;
    float sn = 0.f, cs = 1.f;
    if (i < L && n < A) bb_sincos(ld(a.angles, o4(a.angles, b, s0 + i, h, n)), &sn, &cs);
    float q1[kMaxR] = {}, q2[kMaxR] = {};  // loads first
    BB_UNROLL
    for (int r = 0; r < kMaxR; ++r) {
      if (r < R && i < L) {
        const int64_t o = q0 + (s0 + i) * a.q.s[1] + r * a.q.s[2];
        q1[r] = ld(a.q, o + n * a.q.s[4]) + ld(a.q_bias, o3(a.q_bias, h, r, n));
        q2[r] = ld(a.q, o + (half + n) * a.q.s[4]) + ld(a.q_bias, o3(a.q_bias, h, r, half + n));
      }
    }
    const float E = i < L ? s_E[i] : 0.f;
    BB_UNROLL
    for (int r = 0; r < kMaxR; ++r) {
      if (r < R) {
        const int row = i * R + r;
        float a1 = q1[r], a2 = q2[r];
        if (n < A) a1 = q1[r] * cs - q2[r] * sn, a2 = q1[r] * sn + q2[r] * cs;
        st_split1(EQ, row * ldN + n, E * a1);
        st_split1(EQ, row * ldN + half + n, E * a2);
      }
    }
  }
  bb_sync();
  float* U = a.ws_ds + item * static_cast<int64_t>(N) * P;
  const int nP = P / 16;
  for (int tile = warp; tile < (N / 16) * nP; tile += NT / 32) {
    const int m0 = tile / nP * 16, n0 = tile % nP * 16;
    float acc[2][4];
    mimo::zero_acc(acc);
    mimo::warp_mma_16x16<true, true>(acc, EQ, m0, Gp, n0, 0, T);
    store_tile(acc, m0, n0, U, P);
  }
}

// smem: PlanesLayout::bytes of dynamic shared memory (16-byte aligned); kPlanesThreads threads.
BB_DEV void chunk_planes_body(const Args& a, unsigned char* smem) {
  using mimo::SplitTile;
  using mimo::warp_mma_16x16;
  const PlanesLayout& Ly = a.ply;
  const int tid = bb_tid(), warp = tid >> 5;
  const int N = a.N, P = a.P, R = a.R, C = a.C, A = a.A, half = a.half, T = C * R;
  const int ldN = Ly.ldN, ldP = Ly.ldP, ldT = Ly.ldT;
  const int nN = N / 16, nP = P / 16, nT = T / 16;  // 16-wide tiles along N, P, T
  auto bfp = [&](int off) { return reinterpret_cast<__nv_bfloat16*>(smem + off); };
  auto flp = [&](int off) { return reinterpret_cast<float*>(smem + off); };
  const SplitTile Qh{bfp(Ly.qh), T * ldN, ldN}, Kh{bfp(Ly.kh), T * ldN, ldN};
  const SplitTile X{bfp(Ly.x), T * ldP, ldP}, Gp{bfp(Ly.g), T * ldP, ldP};
  const SplitTile Sp{bfp(Ly.st), N * ldP, ldP}, Mc{bfp(Ly.mc), T * ldT, ldT};
  float* KQ = flp(Ly.kq);  // [T][T] kh_a . qh_b
  float* XG = flp(Ly.xg);  // [T][T] x_a . dPhiO_b
  float* dqh = flp(Ly.qh);  // phase 3: [T][N]
  float* dkh = flp(Ly.kh);  // phase 3: [T][N] dL/dkh / ts
  float* dx = flp(Ly.x);    // from the dx products on: [T][P]
  float *s_dacs = flp(Ly.dacs), *s_dt = flp(Ly.dt), *s_lam = flp(Ly.lam), *s_E = flp(Ly.E),
        *s_F = flp(Ly.F), *s_ts = flp(Ly.ts), *s_gam = flp(Ly.gam), *s_qk = flp(Ly.qk),
        *red = flp(Ly.red), *s_W = flp(Ly.W);
  float* part_cs = flp(Ly.part);            // [T][nN] qh . SG
  float* part_rev = part_cs + T * nN;       // [T][nN] kh . SX
  float* part_fac = part_rev + T * nN;      // [T][nN] kh . dkh

  const int64_t total = static_cast<int64_t>(a.B) * a.H * a.nch;
  for (int64_t item = bb_bid(); item < total; item += bb_nblocks()) {
    const int c = static_cast<int>(item % a.nch);
    const int64_t bh = item / a.nch;
    const int b = static_cast<int>(bh / a.H), h = static_cast<int>(bh % a.H), grp = h / a.HG;
    const int s0 = c * C, L = bb_min(C, a.S - s0), Lx = bb_min(L + 1, a.S - s0), TL = L * R;
    const bool partial = L < C;
    const float Dh = a.has_d ? ld(a.d, o1(a.d, h)) : 0.f;
    const int64_t NP = static_cast<int64_t>(N) * P;
    const float* dS = a.ws_ds + item * NP;
    const int64_t q0 = int64_t{b} * a.q.s[0] + int64_t{grp} * a.q.s[3];
    const int64_t k0 = int64_t{b} * a.k.s[0] + int64_t{grp} * a.k.s[3];
    // Biased q / k element (row = i R + r of this chunk, column n), exact fp32.
    auto qb_at = [&](int i, int r, int n) {
      return ld(a.q, q0 + (s0 + i) * a.q.s[1] + r * a.q.s[2] + n * a.q.s[4]) +
             ld(a.q_bias, o3(a.q_bias, h, r, n));
    };
    auto kb_at = [&](int i, int r, int n) {
      return ld(a.k, k0 + (s0 + i) * a.k.s[1] + r * a.k.s[2] + n * a.k.s[4]) +
             ld(a.k_bias, o3(a.k_bias, h, r, n));
    };
    auto Wf = [&](int i, int j) { return s_W[i * C + j]; };  // exp(segsum[c, i, j])

    // ---- phase 0: per-step inputs, planes
    for (int i = tid; i < Lx; i += kPlanesThreads) {
      const int t = s0 + i;
      if (i < L) s_dacs[i] = ld(a.da_cs, o3(a.da_cs, b, h, t));
      if (i < L && !partial) s_F[i] = ld(a.da_cs_rev, o3(a.da_cs_rev, b, h, t));  // raw here
      s_dt[i] = ld(a.dt, o3(a.dt, b, h, t));
      s_lam[i] = sigmoid_f(ld(a.trap, o3(a.trap, b, h, t)));
    }
    // Raw segsum now (its loads overlap the planes'), exponentiated with the decays below.
    for (int e = tid; e < C * C; e += kPlanesThreads) {
      const int i = e / C, j = e % C;
      s_W[e] = !partial && j < i && i < L ? ld(a.segsum, o5(a.segsum, b, h, c, i, j)) : 0.f;
    }
    for (int e = tid; e < L * R * R; e += kPlanesThreads) {
      const int i = e / (R * R), r = (e / R) % R, r2 = e % R;
      s_qk[e] = ld(a.qk_dot, o5(a.qk_dot, b, h, s0 + i, r, r2));
    }
    // qh, kh: one task per step and rotation pair (n, half + n), n < half, over the R ranks
    // (one sincos per step and angle).
    for (int e = tid; e < C * half; e += kPlanesThreads) {
      const int i = e / half, n = e % half;
      float sn = 0.f, cs = 1.f;
      if (i < L && n < A) bb_sincos(ld(a.angles, o4(a.angles, b, s0 + i, h, n)), &sn, &cs);
      float q1[kMaxR] = {}, q2[kMaxR] = {}, k1[kMaxR] = {}, k2[kMaxR] = {};  // loads first
      BB_UNROLL
      for (int r = 0; r < kMaxR; ++r) {
        if (r < R && i < L) {
          q1[r] = qb_at(i, r, n), q2[r] = qb_at(i, r, half + n);
          k1[r] = kb_at(i, r, n), k2[r] = kb_at(i, r, half + n);
        }
      }
      BB_UNROLL
      for (int r = 0; r < kMaxR; ++r) {
        if (r < R) {
          const int row = i * R + r;
          float a1 = q1[r], a2 = q2[r], b1 = k1[r], b2 = k2[r];
          if (n < A) {
            a1 = q1[r] * cs - q2[r] * sn, a2 = q1[r] * sn + q2[r] * cs;
            b1 = k1[r] * cs - k2[r] * sn, b2 = k1[r] * sn + k2[r] * cs;
          }
          st_split1(Qh, row * ldN + n, a1);
          st_split1(Qh, row * ldN + half + n, a2);
          st_split1(Kh, row * ldN + n, b1);
          st_split1(Kh, row * ldN + half + n, b2);
        }
      }
    }
    const int64_t dps = dphio_pstride(a);
    float dd_part = 0.f;
    batched_elements<8>(  // 8 in flight: no accumulators are live in phase 0
        T * P,
        [&](int e) {  // (x, dPhiO)
          const int row = e / P, p = e % P, i = row / R, r = row % R, t = s0 + i;
          float2 xg = make_float2(0.f, 0.f);
          if (row < TL) {
            xg.x = ld(a.v, o3(a.v, b, t, h) + p * a.v.s[3]) * ld(a.mimo_v, o3(a.mimo_v, h, r, p));
            xg.y = ld(a.dout, dphio_row(a, b, t, r, h) + p * dps);
            if (a.layout == 0) xg.y *= ld(a.mimo_o, o3(a.mimo_o, h, r, p));
          }
          return xg;
        },
        [&](int e, float2 xg) {
          const int row = e / P, p = e % P;
          dd_part += xg.y * xg.x;
          st_split1(X, row * ldP + p, xg.x);
          st_split1(Gp, row * ldP + p, xg.y);
        });
    const int64_t sb = o3(a.states, b, h, c);
    auto state_at = [&](int e) {
      return ld(a.states, sb + (e / P) * a.states.s[3] + (e % P) * a.states.s[4]);
    };
    batched_elements<8>(
        N * P, state_at, [&](int e, float v) { st_split1(Sp, e / P * ldP + e % P, v); });
    if (a.has_d) {  // uniform over the block; its barriers also end the loads above
      const float tot = block_sum<kPlanesThreads>(dd_part, red);
      if (tid == 0) a.ws_dd[item] = tot;
    } else {
      bb_sync();
    }
    // Decays of the steps; zero past the sequence (those rows are zero, their products too).
    const float da_last = s_dacs[L - 1];
    for (int i = tid; i < C; i += kPlanesThreads) {
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
    // alone (the tail contract).
    for (int e = tid; e < C * C; e += kPlanesThreads) {
      const int i = e / C, j = e % C;
      s_W[e] = j < i && i < L ? expf(partial ? s_dacs[i] - s_dacs[j] : s_W[e]) : 0.f;
    }

    // ---- phase 1: KQ, XG (one 16 x 16 tile per warp and task)
    for (int tile = warp; tile < 2 * nT * nT; tile += kPlanesWarps) {
      const bool xg = tile >= nT * nT;
      const int t2 = xg ? tile - nT * nT : tile, m0 = t2 / nT * 16, n0 = t2 % nT * 16;
      float acc[2][4];
      mimo::zero_acc(acc);
      if (xg)
        warp_mma_16x16<false, false>(acc, X, m0, Gp, n0, 0, P);
      else
        warp_mma_16x16<false, false>(acc, Kh, m0, Qh, n0, 0, N);
      store_tile(acc, m0, n0, xg ? XG : KQ, T);
    }
    bb_sync();

    // ---- phase 2: dqh. M1[(i,r)][(j,r')] = W[i][j] ts_j XG[(j,r')][(i,r)] (j < i).
    // The coefficient matrices are built by (row, step j) tasks over the R ranks of j: one
    // exp(segsum) per task, not per element.
    for (int e = tid; e < T * C; e += kPlanesThreads) {
      const int row = e / C, j = e % C, i = row / R;
      const bool live = j < i && row < TL;
      const float w = live ? Wf(i, j) * s_ts[j] : 0.f;
      for (int r1 = 0; r1 < R; ++r1) {
        const int ra = j * R + r1;
        st_split1(Mc, row * ldT + ra, live ? w * XG[ra * T + row] : 0.f);
      }
    }
    bb_sync();
    float accq[kPlanesTilesPerWarp][2][4], acck[kPlanesTilesPerWarp][2][4];
    BB_UNROLL
    for (int u = 0; u < kPlanesTilesPerWarp; ++u) {
      const int tile = warp + u * kPlanesWarps;
      mimo::zero_acc(accq[u]);
      if (tile < nT * nN) {
        const int m0 = tile / nN * 16, n0 = tile % nN * 16;
        warp_mma_16x16<false, false>(accq[u], Gp, m0, Sp, n0, 0, P);  // SG = dPhiO St^T
        tile_row_dots(Qh, m0, n0, accq[u], part_cs, nN);
        scale_rows(accq[u], m0, R, s_E);
        // Keys of steps before the tile's last row's step (M1 is zero from there on).
        const int ke = bb_min(T, ((m0 + 15) / R * R + 15) / 16 * 16);
        warp_mma_16x16<false, true>(accq[u], Mc, m0, Kh, n0, 0, ke);
      }
    }
    bb_sync();  // st and mc are rewritten next

    // ---- dkh. dS_c replaces states[c]; M2[(i,r2)][(j,r)] = W[j][i] XG[(i,r2)][(j,r)] (j > i).
    float dda_part = 0.f;
    batched_elements<8>(  // 8 in flight: still no spills with the dqh accumulators live
        N * P, [&](int e) { return make_float2(state_at(e), dS[e]); },
        [&](int e, float2 sd) {
          dda_part += sd.x * sd.y;
          st_split1(Sp, e / P * ldP + e % P, sd.y);
        });
    for (int e = tid; e < T * C; e += kPlanesThreads) {
      const int row = e / C, j = e % C, i = row / R;
      const bool live = j > i && j < L;
      const float w = live ? Wf(j, i) : 0.f;
      for (int r = 0; r < R; ++r) {
        const int rb = j * R + r;
        st_split1(Mc, row * ldT + rb, live ? w * XG[row * T + rb] : 0.f);
      }
    }
    const float dda = expf(da_last) * block_sum<kPlanesThreads>(dda_part, red);  // + barrier
    BB_UNROLL
    for (int u = 0; u < kPlanesTilesPerWarp; ++u) {
      const int tile = warp + u * kPlanesWarps;
      mimo::zero_acc(acck[u]);
      if (tile < nT * nN) {
        const int m0 = tile / nN * 16, n0 = tile % nN * 16;
        warp_mma_16x16<false, false>(acck[u], X, m0, Sp, n0, 0, P);  // SX = x dS^T
        tile_row_dots(Kh, m0, n0, acck[u], part_rev, nN);
        scale_rows(acck[u], m0, R, s_F);
        // Queries of steps after the tile's first row's step.
        const int kb = bb_min(T, (m0 / R + 1) * R) / 16 * 16;
        warp_mma_16x16<false, true>(acck[u], Mc, m0, Qh, n0, kb, T);
        tile_row_dots(Kh, m0, n0, acck[u], part_fac, nN);
      }
    }
    bb_sync();  // mc is rewritten next; x is dead (dx goes there)

    // ---- dx. M3[(i,r2)][(j,r)] = W[j][i] ts_i KQ[(i,r2)][(j,r)] (j > i),
    //                              gamma_i qk_dot[i, r, r2] + D [r = r2] (j = i), 0 (j < i).
    for (int e = tid; e < T * C; e += kPlanesThreads) {
      const int row = e / C, j = e % C, i = row / R, r2 = row % R;
      const bool live = row < TL && j < L;
      const float w = live && j > i ? Wf(j, i) * s_ts[i] : 0.f;
      for (int r = 0; r < R; ++r) {
        const int rb = j * R + r;
        float m = 0.f;
        if (live) {
          if (j > i)
            m = w * KQ[row * T + rb];
          else if (j == i)
            m = s_gam[i] * s_qk[(i * R + r) * R + r2] + (r == r2 ? Dh : 0.f);
        }
        st_split1(Mc, row * ldT + rb, m);
      }
    }
    // Per-step outputs (the row partials are complete since the last barrier).
    for (int i = tid; i < L; i += kPlanesThreads) {
      float cs = 0.f, rev = 0.f, fac = 0.f;
      for (int r = 0; r < R; ++r)
        for (int nt = 0; nt < nN; ++nt) {
          const int k = (i * R + r) * nN + nt;
          cs += part_cs[k], rev += part_rev[k], fac += part_fac[k];
        }
      float dgam = 0.f;
      for (int r = 0; r < R; ++r)
        for (int r2 = 0; r2 < R; ++r2)
          dgam += s_qk[(i * R + r) * R + r2] * XG[(i * R + r2) * T + i * R + r];
      const int t = s0 + i;
      st(a.dda, o3(a.dda, b, h, t), dda);
      st(a.dda_cs, o3(a.dda_cs, b, h, t), cs);
      st(a.dda_cs_rev, o3(a.dda_cs_rev, b, h, t), s_ts[i] * rev);
      st(a.dfactor, o3(a.dfactor, b, h, t), fac);
      st(a.dgamma, o3(a.dgamma, b, h, t), dgam);
    }
    for (int e = tid; e < C * C; e += kPlanesThreads) {
      // DSSDA[s, t]: every pair of valid steps, unmasked; rows / columns past the sequence 0.
      const int s = e / C, tq = e % C;
      float acc = 0.f;
      if (s < L && tq < L) {
        for (int r2 = 0; r2 < R; ++r2)
          for (int r = 0; r < R; ++r) {
            const int idx = (s * R + r2) * T + tq * R + r;
            acc += KQ[idx] * XG[idx];
          }
        acc *= s_ts[s];
      }
      st(a.dssda, o5(a.dssda, b, h, c, s, tq), acc);
    }
    bb_sync();
    for (int tile = warp; tile < nT * nP; tile += kPlanesWarps) {
      const int m0 = tile / nP * 16, p0 = tile % nP * 16;
      float acc[2][4];
      mimo::zero_acc(acc);
      warp_mma_16x16<false, true>(acc, Kh, m0, Sp, p0, 0, N);  // kh dS
      scale_rows(acc, m0, R, s_F);
      scale_rows(acc, m0, R, s_ts);
      // From the first row's own step on.
      warp_mma_16x16<false, true>(acc, Mc, m0, Gp, p0, m0 / R * R / 16 * 16, T);
      store_tile(acc, m0, p0, dx, P);
    }
    bb_sync();  // qh / kh planes dead: dqh / dkh go there

    // ---- phase 3
    BB_UNROLL
    for (int u = 0; u < kPlanesTilesPerWarp; ++u) {
      const int tile = warp + u * kPlanesWarps;
      if (tile < nT * nN) {
        const int m0 = tile / nN * 16, n0 = tile % nN * 16;
        store_tile(accq[u], m0, n0, dqh, N);
        store_tile(acck[u], m0, n0, dkh, N);
      }
    }
    // Here, not earlier: the accumulators are dead (no registers to spare in phase 2).
    if (a.prefetch && item + bb_nblocks() < total) prefetch_item(a, item + bb_nblocks());
    bb_sync();
    // DQ, DK, DANGLES: one task per step and rotation pair (n, half + n) over the R ranks, so
    // that the exact q / k rows of the diagonal terms are loaded once per task (R each), not
    // once per output row, and one sincos serves the step.
    for (int e = tid; e < L * half; e += kPlanesThreads) {
      const int i = e / half, n = e % half;
      const float ts = s_ts[i], gam = s_gam[i];
      const bool rot = n < A;
      float sn = 0.f, cs = 1.f;
      if (rot) bb_sincos(ld(a.angles, o4(a.angles, b, s0 + i, h, n)), &sn, &cs);
      float qb1[kMaxR], qb2[kMaxR], kb1[kMaxR], kb2[kMaxR];  // biased, unrotated
      BB_UNROLL
      for (int r = 0; r < kMaxR; ++r) {
        if (r < R) {
          qb1[r] = qb_at(i, r, n), qb2[r] = qb_at(i, r, half + n);
          kb1[r] = kb_at(i, r, n), kb2[r] = kb_at(i, r, half + n);
        }
      }
      float dang = 0.f;
      BB_UNROLL
      for (int r = 0; r < kMaxR; ++r) {
        if (r < R) {
          const int row = i * R + r, base = row * N;
          const float q0 = dqh[base + n], q1 = dqh[base + half + n];
          const float g0 = dkh[base + n] * ts, g1 = dkh[base + half + n] * ts;
          float oq0 = q0, oq1 = q1, ok0 = g0, ok1 = g1;
          if (rot) {
            oq0 = q0 * cs + q1 * sn, oq1 = q1 * cs - q0 * sn;
            ok0 = g0 * cs + g1 * sn, ok1 = g1 * cs - g0 * sn;
            // d/dtheta of (u cos - w sin, u sin + w cos) is (-y2, y1) of the rotated pair.
            const float qh1 = qb1[r] * cs - qb2[r] * sn, qh2 = qb1[r] * sn + qb2[r] * cs;
            const float kh1 = kb1[r] * cs - kb2[r] * sn, kh2 = kb1[r] * sn + kb2[r] * cs;
            dang += q1 * qh1 - q0 * qh2 + g1 * kh1 - g0 * kh2;
          }
          // Diagonal gamma_i sum qk_dot[i, r, r2] x^r2 with qk_dot = qb . kb (unrotated).
          BB_UNROLL
          for (int r2 = 0; r2 < kMaxR; ++r2) {
            if (r2 < R) {
              const float xq = gam * XG[(i * R + r2) * T + row];
              oq0 += xq * kb1[r2], oq1 += xq * kb2[r2];
            }
          }
          BB_UNROLL
          for (int r1 = 0; r1 < kMaxR; ++r1) {
            if (r1 < R) {
              const float xk = gam * XG[row * T + i * R + r1];
              ok0 += xk * qb1[r1], ok1 += xk * qb2[r1];
            }
          }
          const int64_t orow = static_cast<int64_t>(s0 + i) * R + r;
          st(a.dq, o4(a.dq, b, orow, h, n), oq0);
          st(a.dq, o4(a.dq, b, orow, h, half + n), oq1);
          st(a.dk, o4(a.dk, b, orow, h, n), ok0);
          st(a.dk, o4(a.dk, b, orow, h, half + n), ok1);
        }
      }
      if (rot) st(a.dangles, o4(a.dangles, b, s0 + i, h, n), dang);
    }
    for (int e = tid; e < L * P; e += kPlanesThreads) {
      const int i = e / P, p = e % P;
      float acc = 0.f;
      for (int r = 0; r < R; ++r)
        acc += dx[(i * R + r) * P + p] * ld(a.mimo_v, o3(a.mimo_v, h, r, p));
      st(a.dv, o4(a.dv, b, s0 + i, h, p), acc);
    }
    for (int e = tid; e < R * P; e += kPlanesThreads) {
      const int r = e / P, p = e % P;
      float acc = 0.f;
      for (int i = 0; i < L; ++i)
        acc += dx[(i * R + r) * P + p] * ld(a.v, o4(a.v, b, s0 + i, h, p));
      a.ws_part[item * (static_cast<int64_t>(R) * P) + e] = acc;
    }
    bb_sync();  // shared memory is rewritten for the next chunk
  }
}

}  // namespace mamba3::cuda::bb
