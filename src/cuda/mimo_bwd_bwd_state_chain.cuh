// The state chain of mamba3_mimo_bwd_bwd's planes path: K1 and K2 in one kernel, for the shapes
// and contiguous layouts that have specialised planes kernels (ArgsCT<N, P, R, C, CL>, CL =
// kCtBwdBwd or kCtCombined: mimo_bwd_bwd_ct.cuh).
//
// K1 writes every chunk's increment U_c ([N, P] fp32) to the workspace slab and K2 reads it back
// to run dS_{c-1} = decay_c dS_c + U_c in place: at N256 P64 C8 (B4 S2048 H16) that is 1 GB
// written and 2 GB moved again, ~1.06 ms of the second pass's ~3.6 (H200). Here a CTA owns one
// block of dS's rows and columns of one (b, h) and walks its chunks backwards, each chunk's block
// of U_c made by mma from that chunk's rows (as K1) and added into dS held in the accumulator
// registers: only dS_c is written (the slab K3 reads), U never leaves the SM. Measured (H100,
// session 22, K1 + K2 -> chain with the ranks inside each q task, ms): N256 C8 1.318 -> 0.853,
// N128 P128 C8 1.253 -> 0.672, N128 R4 C16 0.402 -> 0.296, R2 C32 0.221 -> 0.156, R1 C64
// 0.117 -> 0.099, N32 0.163 -> 0.183. This form (one q task per rank, their sin / cos from a
// per-chunk table; 4 CTAs per (b, h) at N256; reads before stores; session 25, H100, ms of the
// chain against session 22's): N256 C8 0.855 -> 0.664, N16 0.277 -> 0.213, R8 C8 0.630 ->
// 0.574, N128 P128 C8 0.673 -> 0.633, R4 C16 -0.003 to -0.020, R2 C32 0.156 -> 0.161, R1 C64
// 0.098 -> 0.098. At N32, where each CTA forms all of q's rows (one row block), it took 0.165
// against K1 + K2's 0.162: K1 + K2 stay there (ct_chain_entry).
//
// Same values as K1 + K2, bit for bit (the CUDA and host-emulated tests compare the slabs): the
// rows E_i qh_i^r and dPhiO_i^r are formed with increment_planes_body's expressions (bias added,
// rotation by mb_fma_rn / mb_fmul_rn, then the E scale; dout mimo_o^r, then the gate), split
// into the same bf16 hi/lo planes, and a block's 16 x 16 tiles are the same
// mimo::warp_mma_16x16 calls over the same T rows as K1's tiles (the same fragments: a tile's
// column of EQ holds the same values whichever other columns sit beside it); the update is
// scan_cells' expression, acc = dec acc + u.
//
// Blocking (ChainSplit): the rotation pairs (n, half + n) stay in one CTA (no exchange for the
// rotation): a block is NBP pair columns (16, 32 at N256), i.e. rows n0 .. n0 + NBP and
// half + n0 .. half + n0 + NBP of dS, and Pb of its P columns, with Pb split so that every shape
// of the grid gets 4 CTAs per (b, h): 256 CTAs at B4 H16, two of 8 warps per SM (264 slots on
// 132 SMs: one wave; 8 CTAs per (b, h) at N256 made two). The q rows of a block are loaded
// once; dout rows are loaded by each of the N / 2 NBP blocks of a column block (cheap: C P per
// chunk against C R N of q). With the combined backward's Z gate each of those blocks also
// forms the gated rows (a silu per element of T x Pb): there N128 P128 takes 2 row blocks by 2
// column blocks instead of 4 by 1 (ChainSplit's Gate; measured slower at the other shapes).
// A q task is one step, rank and column pair (every thread has rows at every shape; with the
// ranks inside a task, at C8 a quarter of the threads had rows to form and the rest waited at
// the barrier); its sin / cos come from a (sin, cos) table of the chunk,
// written one chunk ahead by one sincosf per angle (tasks of one rank each that called sincosf
// themselves measured slower: R times the sincosf).
//
// Per chunk a CTA: forms the chunk's planes from registers loaded two chunks earlier, and the
// next chunk's (sin, cos) table (their global loads overlap two chunks' products and stores; a
// first form, one chunk ahead with 4 warps per CTA, took 2.5-4.4 us per chunk, slower than
// K1 + K2 at 7 of the 11 shapes), one barrier, stores dS_c, then per tile U = EQ^T G and
// acc = dec_c acc + U. The planes are double-buffered, so the one barrier per chunk suffices: a
// buffer is rewritten two chunks after it was read, and every thread has passed the barrier in
// between (the two tables likewise).
#pragma once

#include <cstdint>

#include "cuda/mimo_bwd_bwd_chunk_planes.cuh"

namespace mamba3::cuda::bb {

constexpr int kChainThreads = 256;

// The block split of shape (N, P) (see the top of this file). Gate (the combined backward's
// gated dPhiO rows, a silu per element, formed by every row block of a column block): at
// P >= 128 with 4 row blocks, 2 row blocks by 2 column blocks of P / 2 >= 64 columns, so that
// each CTA forms half as many gated rows and twice as many q rows (still 4 CTAs per (b, h)).
// Measured (H200, session 32, the combined op's chain, ms): N128 P128 C8 0.825 -> 0.757; with
// narrower column blocks it lost: N128 P64 R4 C16 0.380 -> 0.403, P32 0.256 -> 0.334, N256 C8
// 0.766 -> 0.904, R8 C8 0.779 -> 0.866, R2 C32 0.211 -> 0.224, R1 C64 0.132 -> 0.142.
template <int N, int P, bool Gate = false>
struct ChainSplit {
  static constexpr int half = N / 2;
  // Pair columns (n, half + n) per block: 16, or half / 4 at N256, so that every (b, h) has 4
  // row blocks at most (8 at N256 made 512 CTAs, two waves of the 264 slots).
  static constexpr int NBP0 = half < 16 ? half : half / 4 > 16 ? half / 4 : 16;
  static constexpr int NBP = Gate && half / NBP0 == 4 && P >= 128 ? 2 * NBP0 : NBP0;
  static constexpr int Nb = 2 * NBP;                 // dS rows per block
  static constexpr int nNb = half / NBP;             // row blocks
  static constexpr int nPb0 = nNb >= 4 ? 1 : 4 / nNb;
  static constexpr int nPb = P / nPb0 >= 16 ? nPb0 : P / 16;  // column blocks
  static constexpr int Pb = P / nPb;                          // dS columns per block
  static constexpr int ldNb = Nb + kPlanesPad, ldPb = Pb + kPlanesPad;
  static constexpr int tiles = (Nb / 16) * (Pb / 16);
  static constexpr int TPW = (tiles + kChainThreads / 32 - 1) / (kChainThreads / 32);
  static_assert(Nb % 16 == 0 && Pb % 16 == 0, "whole 16 x 16 tiles");
};

// The split of the chain kernel of parameter block AT (ArgsCT<N, P, R, C, CL>).
template <class AT>
using ChainSplitOf = ChainSplit<AT::N, AT::P, AT::gate != 0>;

// Shared memory of the chain kernel (bytes): two buffers of the EQ [T][ldNb] and G [T][ldPb]
// hi/lo planes, then the block's q_bias [R][Nb], mimo_o [R][Pb] and mimo_z [R][Pb] (fp32), then
// two chunks' (sin, cos) tables [C][NBP] (float2).
template <class AT>
constexpr int chain_smem_bytes() {
  using S = ChainSplitOf<AT>;
  constexpr int R = AT::R, C = AT::C, T = C * R;
  return 2 * (2 * T * S::ldNb + 2 * T * S::ldPb) * 2 + (R * S::Nb + 2 * R * S::Pb) * 4 +
         2 * C * S::NBP * 8;
}

// One CTA per (b, h, row block, column block): blocks() of them per (b, h).
template <class AT>
constexpr int chain_blocks_per_bh() {
  return ChainSplitOf<AT>::nNb * ChainSplitOf<AT>::nPb;
}

template <class AT>
BB_DEV void state_chain_body(const AT& a, unsigned char* smem) {
  constexpr int NT = kChainThreads;
  constexpr int N = AT::N, P = AT::P, R = AT::R, C = AT::C, A = AT::A, T = C * R;
  using S = ChainSplitOf<AT>;
  constexpr int NBP = S::NBP, Nb = S::Nb, Pb = S::Pb, half = S::half;
  constexpr int ldNb = S::ldNb, ldPb = S::ldPb;
  // q tasks: (step i, rank r, pair j) with columns n0 + 2j, n0 + 2j + 1 and their partners;
  // a thread keeps its j and r, so every thread has rows at every shape (with the ranks inside
  // a task, at C8 a quarter of the threads formed q rows: 37% of the stall samples at the
  // barrier, N256 C8). Their sin / cos come from a table per chunk (cs tasks: step i, pair
  // column m), made one chunk ahead: one sincosf per angle, not one per rank.
  // dout tasks: (step i, column pair pc of the block), ranks inside; a thread keeps its pc.
  constexpr int QJ = NBP / 2, QSTEP = NT / (QJ * R), QPT = (C + QSTEP - 1) / QSTEP;
  constexpr int SSTEP = NT / NBP, SPT = (C + SSTEP - 1) / SSTEP;
  constexpr int GJ = Pb / 2, GSTEP = NT / GJ, GPT = (C + GSTEP - 1) / GSTEP;
  constexpr bool kGate = AT::gate != 0;
  // mz's extent, named: as an array bound inside a lambda the expression crashes g++ 12.
  constexpr int kRz = kGate ? R : 1;
  static_assert(AT::layout == 0, "reduce-O dout (the contiguous-layout sets)");
  static_assert(NT % (QJ * R) == 0 && NT % NBP == 0 && NT % GJ == 0,
                "a thread keeps its columns (and rank)");

  const int tid = bb_tid(), warp = tid >> 5;
  const int it = static_cast<int>(bb_bid());
  const int pb = it % S::nPb, nb = (it / S::nPb) % S::nNb, bh = it / (S::nPb * S::nNb);
  const int b = bh / a.H, h = bh % a.H, grp = h / a.HG;
  const int n0 = nb * NBP, p0 = pb * Pb, nch = a.nch;

  // Shared memory: planes buffers, then the block's weights.
  constexpr int kEQ = 2 * T * ldNb, kG = 2 * T * ldPb;  // bf16 elements per buffer's planes
  __nv_bfloat16* planes = reinterpret_cast<__nv_bfloat16*>(smem);
  float* s_bias = reinterpret_cast<float*>(smem + 2 * (kEQ + kG) * 2);  // [R][Nb]
  float* s_wo = s_bias + R * Nb;                                         // [R][Pb]
  float* s_wz = s_wo + R * Pb;                                           // [R][Pb]
  float2* s_cs = reinterpret_cast<float2*>(s_wz + R * Pb);  // [2][C][NBP] (sin, cos)
  auto eq_of = [&](int buf) {
    return mimo::SplitTile{planes + buf * (kEQ + kG), T * ldNb, ldNb};
  };
  auto g_of = [&](int buf) {
    return mimo::SplitTile{planes + buf * (kEQ + kG) + kEQ, T * ldPb, ldPb};
  };
  for (int e = tid; e < R * Nb; e += NT) {
    const int r = e / Nb, m = e % Nb, n = m < NBP ? n0 + m : half + n0 + (m - NBP);
    s_bias[e] = ld(a.q_bias, o3(a.q_bias, h, r, n));
  }
  for (int e = tid; e < R * Pb; e += NT) {
    const int r = e / Pb, pl = e % Pb;
    s_wo[e] = ld(a.mimo_o, o3(a.mimo_o, h, r, p0 + pl));
    if constexpr (kGate) s_wz[e] = ld(a.mimo_z, o3(a.mimo_z, h, r, p0 + pl));
  }

  // This thread's columns (and rank).
  const int qj = tid % QJ, qr = (tid / QJ) % R, qi0 = tid / (QJ * R);
  const int n = n0 + 2 * qj;  // global q column of the pair (partner half + n)
  const int sm = tid % NBP, si0 = tid / NBP;  // cs task column n0 + sm
  const int gj = tid % GJ, gi0 = tid / GJ;
  const unsigned short* qp = reinterpret_cast<const unsigned short*>(a.q.p);
  const unsigned short* dp = reinterpret_cast<const unsigned short*>(a.dout.p);

  // A chunk's inputs in registers: per q task its q pairs (lo at n, hi at half + n) and da_cs
  // (E), per cs task its angle, per dout task its dout (and z) pair, the chunk's decay exponent.
  struct Raw {
    uint32_t q[QPT][2];
    float ang[SPT];
    float eda[QPT];
    uint32_t d[GPT];
    uint32_t z[kGate ? GPT : 1];
    float dec;
  };
  auto load = [&](Raw& w, int c) {
    const int s0 = c * C, L = bb_min(C, a.S - s0);
    BB_UNROLL
    for (int k = 0; k < QPT; ++k) {
      const int i = qi0 + k * QSTEP;
      if (i < L) {
        const int s = s0 + i;
        w.eda[k] = ld(a.da_cs, o3(a.da_cs, b, h, s));
        const int64_t o = o5(a.q, b, s, qr, grp, n);
        w.q[k][0] = mimo::mb_ldg(reinterpret_cast<const uint32_t*>(qp + o));
        w.q[k][1] = mimo::mb_ldg(reinterpret_cast<const uint32_t*>(qp + o + half));
      }
    }
    BB_UNROLL
    for (int k = 0; k < SPT; ++k) {
      const int i = si0 + k * SSTEP;
      if (i < L && n0 + sm < A) w.ang[k] = ld(a.angles, o4(a.angles, b, s0 + i, h, n0 + sm));
    }
    BB_UNROLL
    for (int k = 0; k < GPT; ++k) {
      const int i = gi0 + k * GSTEP;
      if (i < L) {
        const int64_t o = o4(a.dout, b, s0 + i, h, p0 + 2 * gj);
        w.d[k] = mimo::mb_ldg(reinterpret_cast<const uint32_t*>(dp + o));
        if constexpr (kGate) {
          const int64_t oz = o4(a.z, b, s0 + i, h, p0 + 2 * gj);
          w.z[k] = mimo::mb_ldg(reinterpret_cast<const uint32_t*>(
              reinterpret_cast<const unsigned short*>(a.z.p) + oz));
        }
      }
    }
    w.dec = ld(a.da_cs, o3(a.da_cs, b, h, bb_min(c * C + C, a.S) - 1));
  };
  // This thread's q_bias pairs (its rank and columns: the same every chunk), in registers from
  // the kernel's first barrier on.
  float2 qb1, qb2;
  // The chunk's planes from w (increment_planes_body's values: see the top of this file). Every
  // shared-memory read of a build (the (sin, cos) of its q tasks, the mimo_o / mimo_z weights of
  // its ranks) is issued before its first plane store: read between the stores, each waited out
  // its latency after the previous store (nvcc keeps loads behind stores it cannot tell apart
  // from them; ncu at R2 C32: 12% of the chain's stall samples on those weights' products).
  auto build = [&](const Raw& w, int c, int buf) {
    const int L = bb_min(C, a.S - c * C);
    const mimo::SplitTile EQ = eq_of(buf), Gp = g_of(buf);
    const float2* tab = s_cs + (c & 1) * (C * NBP);
    float4 sc[QPT];  // (sin, cos) of columns n, n + 1
    BB_UNROLL
    for (int k = 0; k < QPT; ++k) {
      const int i = qi0 + k * QSTEP;
      sc[k] = make_float4(0.f, 1.f, 0.f, 1.f);
      if (i < L) {
        if (n < A) {
          const float2 t = tab[i * NBP + 2 * qj];
          sc[k].x = t.x, sc[k].y = t.y;
        }
        if (n + 1 < A) {
          const float2 t = tab[i * NBP + 2 * qj + 1];
          sc[k].z = t.x, sc[k].w = t.y;
        }
      }
    }
    float2 mo[R], mz[kRz];
    BB_UNROLL
    for (int r = 0; r < R; ++r) {
      mo[r] = *reinterpret_cast<const float2*>(s_wo + r * Pb + 2 * gj);
      if constexpr (kGate) mz[r] = *reinterpret_cast<const float2*>(s_wz + r * Pb + 2 * gj);
    }
    BB_UNROLL
    for (int k = 0; k < QPT; ++k) {
      const int i = qi0 + k * QSTEP;
      if (i < C) {
        float2 y1 = make_float2(0.f, 0.f), y2 = y1;
        if (i < L) {
          const float2 sn = make_float2(sc[k].x, sc[k].z), cs = make_float2(sc[k].y, sc[k].w);
          const float E = expf(w.eda[k]);
          const float2 lo = mimo::bf2_f(w.q[k][0]), hi = mimo::bf2_f(w.q[k][1]);
          const float2 x1 = make_float2(lo.x + qb1.x, lo.y + qb1.y);
          const float2 x2 = make_float2(hi.x + qb2.x, hi.y + qb2.y);
          y1 = x1, y2 = x2;
          if (n < A)
            y1.x = mimo::mb_fma_rn(x1.x, cs.x, -mimo::mb_fmul_rn(x2.x, sn.x)),
            y2.x = mimo::mb_fma_rn(x1.x, sn.x, mimo::mb_fmul_rn(x2.x, cs.x));
          if (n + 1 < A)
            y1.y = mimo::mb_fma_rn(x1.y, cs.y, -mimo::mb_fmul_rn(x2.y, sn.y)),
            y2.y = mimo::mb_fma_rn(x1.y, sn.y, mimo::mb_fmul_rn(x2.y, cs.y));
          y1.x *= E, y1.y *= E, y2.x *= E, y2.y *= E;
        }
        const int row = i * R + qr;
        st_split_pair(EQ, row * ldNb + 2 * qj, y1);
        st_split_pair(EQ, row * ldNb + NBP + 2 * qj, y2);
      }
    }
    BB_UNROLL
    for (int k = 0; k < GPT; ++k) {
      const int i = gi0 + k * GSTEP;
      if (i < C) {
        const float2 d = i < L ? mimo::bf2_f(w.d[k]) : make_float2(0.f, 0.f);
        float2 z = make_float2(0.f, 0.f);
        if constexpr (kGate) z = i < L ? mimo::bf2_f(w.z[k]) : z;
        BB_UNROLL
        for (int r = 0; r < R; ++r) {
          float2 g = make_float2(0.f, 0.f);
          if (i < L) {
            g = d;
            g.x *= mo[r].x, g.y *= mo[r].y;
            if constexpr (kGate) {
              const float2 gz = make_float2(silu_f(z.x * mz[r].x), silu_f(z.y * mz[r].y));
              g.x *= gz.x, g.y *= gz.y;
            }
          }
          st_split_pair(Gp, (i * R + r) * ldPb + 2 * gj, g);
        }
      }
    }
  };

  // Chunk c's (sin, cos) table from w (the same sincosf of the same angles as K1's rows), for
  // the next chunk's build: written before the barrier that precedes that build; its slot was
  // last read by the build two chunks earlier, before the previous barrier.
  auto table = [&](const Raw& w, int c) {
    const int L = bb_min(C, a.S - c * C);
    float2* tab = s_cs + (c & 1) * (C * NBP);
    BB_UNROLL
    for (int k = 0; k < SPT; ++k) {
      const int i = si0 + k * SSTEP;
      if (i < L && n0 + sm < A) {
        float sv, cv;
        bb_sincos(w.ang[k], &sv, &cv);
        tab[i * NBP + sm] = make_float2(sv, cv);
      }
    }
  };

  // dS of this warp's tiles (t = warp + 4 u), leaving the current chunk.
  constexpr int NW = NT / 32, kPbT = Pb / 16;
  float ds[S::TPW][2][4];
  BB_UNROLL
  for (int u = 0; u < S::TPW; ++u) mimo::zero_acc(ds[u]);
  const int lane = tid & 31, fg = lane >> 2, fq = lane & 3;
  // Stores dS_c of this warp's tiles into the slab (row m of the block: dS row n0 + m, or
  // half + n0 + m - NBP).
  auto store = [&](int c) {
    float* out = a.ws_ds + (static_cast<int64_t>(bh) * nch + c) * (N * P);
    BB_UNROLL
    for (int u = 0; u < S::TPW; ++u) {
      const int t = warp + NW * u;
      if (t < S::tiles) {
        const int mt = t / kPbT, nt = t % kPbT;
        BB_UNROLL
        for (int hf = 0; hf < 2; ++hf) {
          const int m = mt * 16 + fg + 8 * hf;
          const int nrow = m < NBP ? n0 + m : half + n0 + (m - NBP);
          float* o = out + nrow * P + p0 + nt * 16 + 2 * fq;
          BB_UNROLL
          for (int j = 0; j < 2; ++j)
            *reinterpret_cast<float2*>(o + 8 * j) =
                make_float2(ds[u][j][2 * hf], ds[u][j][2 * hf + 1]);
        }
      }
    }
  };

  // One chunk: its planes from wr (loaded two chunks earlier), the barrier, wr reloaded with
  // chunk c - 2 (its loads in flight during two chunks' products and stores), dS_c stored, U_c
  // and the update.
  auto step = [&](Raw& wr, const Raw& wn, int c, int buf) {
    build(wr, c, buf);
    if (c > 1) table(wn, c - 1);
    // Formed before the barrier (mb_pin): nvcc sank the expf past it, next to the update, and
    // so copied wr.dec at the loop top, where the copy waited on the load of wr issued late in
    // the previous chunk (3.4% of the stall samples at N256 C8, H100).
    const float dec = mimo::mb_pin(expf(wr.dec));
    bb_sync();
    if (c > 2) load(wr, c - 2);
    store(c);
    const mimo::SplitTile EQ = eq_of(buf), Gp = g_of(buf);
    BB_UNROLL
    for (int u = 0; u < S::TPW; ++u) {
      const int t = warp + NW * u;
      if (t < S::tiles) {
        float acc[2][4];
        mimo::zero_acc(acc);
        mimo::warp_mma_16x16<true, true, 0, true>(acc, EQ, (t / kPbT) * 16, Gp, (t % kPbT) * 16,
                                                  0, T);
        BB_UNROLL
        for (int j = 0; j < 2; ++j)
          BB_UNROLL
          for (int e = 0; e < 4; ++e) ds[u][j][e] = dec * ds[u][j][e] + acc[j][e];
      }
    }
  };
  // Two register sets, alternating (the loop unrolled by two keeps their indexing static).
  Raw w0, w1;
  if (nch > 1) load(w0, nch - 1);
  if (nch > 2) load(w1, nch - 2);
  if (nch > 1) table(w0, nch - 1);
  bb_sync();  // the block's weights, the first chunk's table
  {
    const float* bv = s_bias + qr * Nb;
    qb1 = make_float2(bv[2 * qj], bv[2 * qj + 1]);
    qb2 = make_float2(bv[NBP + 2 * qj], bv[NBP + 2 * qj + 1]);
  }
  for (int c = nch - 1; c >= 1; c -= 2) {
    step(w0, w1, c, 0);
    if (c > 1) step(w1, w0, c - 1, 1);
  }
  store(0);  // (U_0 is never formed: nothing reads the state entering chunk 0)
}

}  // namespace mamba3::cuda::bb
