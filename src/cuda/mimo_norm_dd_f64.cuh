// dD of mamba3_mimo_bwd_combined with the fused pre-gate RMSNorm, in float64 on the GPU.
//
// Why float64: with the norm, dD = sum over rows of dout_pre_rms . x is ill-conditioned in
// float32. RMSNorm's gradient is orthogonal to its input y, so each row's term is a small
// remainder of |dout_pre_rms| |x|, and the rows cancel further: on the failing draws of the
// NormDd tests dD is 1/120 .. 1/5200 of sum |dout_pre_rms| |x|. Every float32 rounding on the
// way to the readout y (bias add, rotation, exp, the states) moves a row's term by ~2^-24
// |dout_pre_rms| |x|, so a float32 dD misses the 2x rule against the float32 reference on some
// draws (docs/ACCURACY.md). The CPU backend recomputes the forward in double for this
// (norm_dd_f64, src/cpu/mimo_bwd_fwd.cpp); these kernels do the same on the GPU, chunk-parallel:
//
//   increment  per (b, h, chunk c < nch - 1, slab of n rows): U_c = sum_j w_j kh_j (x) x_j over
//              the chunk's rows j = (step, rank), w_j = tscale_j exp(da_cs_rev_j)   [N][P]
//   scan       per (b, h, element of [N][P]): S_0 = 0, S_{c+1} = exp(da_cs_{last of c}) S_c + U_c,
//              S_c written over U_c (the state entering chunk c)
//   readout    per (b, h, chunk): y of every row (inter-chunk qh S_c exp(da_cs_i), the strictly
//              causal intra-chunk sum, the diagonal gamma_i qh . kh, D x); each row's term
//              rstd (G . x - (y . x) rstd^2 (G . y) / P), G = dL/dxhat = dout Phi silu(z Zeta) w,
//              summed in row order into the chunk's partial
//   final      per h: dD = sum over b, then c, of the partials (double), stored in dD's dtype
//
// Two kernel sets: the generic bodies (any shape: row tiles of Args::tile rows, flash-style over
// the column tiles up to the row tile's last step) and the whole-chunk body further down
// (fast_ok shapes: the chunk's rows in shared memory once, float64 mma tiles), which also forms
// U_c from the rows it has built and runs the scan as a chain between its blocks (chunk c's
// block publishes S_{c+1} once chunk c - 1's has published S_c), so that U_c is neither written
// nor read back and no increment or scan kernel runs.
// The same formulas as the CPU backend's ChunkForward<double> (tail rule included: a partial
// last chunk takes its decays from da_cs alone), in another order of operations (float64 both;
// dD is stored in float32). Deterministic: fixed owners and fixed-order sums, no atomics.
// The bodies are plain C++ over ndd_tid / ndd_bid / ndd_sync, so that they also run on the host
// (tests/cpp/test_mimo_norm_dd_emulated.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/rt_dtype.cuh"

#if defined(__CUDACC__)
#define NDD_DEV __device__ __forceinline__
#define NDD_HD __host__ __device__ inline
#define NDD_UNROLL _Pragma("unroll")
#else
#define NDD_DEV inline
#define NDD_HD inline
#define NDD_UNROLL
#endif

namespace mamba3::cuda::ndd {

#if defined(__CUDACC__)
NDD_DEV int ndd_tid() { return static_cast<int>(threadIdx.x); }
NDD_DEV int64_t ndd_bid() { return static_cast<int64_t>(blockIdx.x); }
NDD_DEV void ndd_sync() { __syncthreads(); }
// The whole-chunk readout's state chain between CTAs (CUTLASS's GenericBarrier pattern): the
// block's stores, a barrier, then one thread's release store of the flag; one thread's acquire
// loads until the flag is set, then a barrier before the block reads. The states are read
// through L2 (ld.global.cg): another SM wrote them during this kernel.
NDD_DEV void ndd_flag_post(unsigned* f) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(f), "r"(1u) : "memory");
}
// A wait past 10 s (globaltimer) traps: a chain that cannot progress (a block scheduled before
// its predecessor, which CUDA does not promise but does) fails the launch instead of hanging.
NDD_DEV void ndd_flag_wait(const unsigned* f) {
  unsigned v;
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(f) : "memory");
    if (v) return;
    __nanosleep(32);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > 10000000000ull) __trap();
  }
}
NDD_DEV double ndd_ldcg(const double* p) { return __ldcg(p); }
#else
int ndd_tid();
int64_t ndd_bid();
void ndd_sync();
void ndd_flag_post(unsigned* f);
void ndd_flag_wait(const unsigned* f);  // the emulator's: runs CTAs in order, checks the flag
inline double ndd_ldcg(const double* p) { return *p; }
#endif

constexpr int kThreads = 256;
constexpr int kMaxPer = 16;  // accumulators per thread (doubles)

// A tensor: byte pointer, dtype code (0 f16, 1 bf16, 2 f32), element strides.
struct View {
  const unsigned char* p = nullptr;
  int dt = 2;
  int64_t s[5] = {0, 0, 0, 0, 0};
};

struct Args {
  int64_t B = 0, S = 0, H = 0, G = 0, N = 0, P = 0, R = 0, C = 0, nch = 0, A = 0;
  double eps = 1e-5;
  int tile = 16;  // rows per readout tile (8 where 16 would not fit in shared memory)
  bool fast = false;  // the whole-chunk kernels (fast_ok)
  // q, k [B,S,R,G,N]; q_bias, k_bias [H,R,N]; mimo_v / mimo_o / mimo_z [H,R,P]; v, dout, z
  // [B,S,H,P]; angles [B,S,H,A]; da_cs, da_cs_rev, dt, trap [B,H,S]; segsum [B,H,nch,C,C];
  // d [H]; norm_weight [H,P]
  View q, k, q_bias, k_bias, mimo_v, mimo_o, mimo_z, v, dout, z, angles, da_cs, da_cs_rev, dt,
      trap, segsum, d, norm_weight;
  double* states = nullptr;  // [B H][nch][N][P]: U_c, then the state entering chunk c
  double* part = nullptr;    // [B H][nch]: each chunk's sum of its rows' terms
  // [B H][nch][chain_passes]: pass p of S_c published (the whole-chunk readout's state chain;
  // zero before its launch)
  unsigned* flags = nullptr;
  unsigned char* dd = nullptr;  // dD [H], dtype dd_dt, stride dd_s
  int dd_dt = 2;
  int64_t dd_s = 1;
};

NDD_DEV double ldd(const View& v, int64_t off) {
  return static_cast<double>(rt_ld(v.p, off, v.dt));
}
NDD_DEV double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }

// n rows of the increment's slab (elements per thread <= kMaxPer) and the slab count.
NDD_HD int64_t slab_rows(const Args& a) {
  const int64_t per_pass = kThreads / a.P;  // n rows per pass of the CTA's threads (P <= 256)
  const int64_t ns = per_pass * kMaxPer;
  return ns < a.N ? ns : a.N;
}
NDD_HD int64_t slabs(const Args& a) { return (a.N + slab_rows(a) - 1) / slab_rows(a); }

// Shared memory (bytes) of the two chunk kernels.
inline size_t increment_smem(const Args& a) {
  return sizeof(double) * static_cast<size_t>(3 * a.C + 16 * (2 * a.A + slab_rows(a) + a.P));
}
inline size_t readout_smem(const Args& a, int tile) {
  const int64_t ldn = a.N + 1;
  return sizeof(double) *
         static_cast<size_t>(4 * a.C + tile * (4 * a.A + 2 * ldn + 4 * a.P) + tile * (tile + 1));
}

// A chunk's place: batch, head, q / k group, chunk, first step, valid steps L.
struct ChunkPos {
  int64_t b, h, g, c, s0;
  int L;
  bool partial;
};

NDD_DEV ChunkPos chunk_pos(const Args& a, int64_t bh, int64_t c) {
  ChunkPos q;
  q.b = bh / a.H, q.h = bh % a.H, q.g = q.h / (a.H / a.G), q.c = c, q.s0 = c * a.C;
  q.L = static_cast<int>(a.S - q.s0 < a.C ? a.S - q.s0 : a.C);
  q.partial = q.L < a.C;
  return q;
}

// The per-step scalars of the chunk (step i < L by thread i): gamma_i, tscale_i (the
// trapezoid's two halves) and da_cs_i.
NDD_DEV void step_scalars(const Args& a, const ChunkPos& q, double* gam, double* tsc,
                          double* dacs) {
  const int i = ndd_tid();
  if (i >= q.L) return;
  const int64_t t = q.s0 + i;
  auto o3 = [&](const View& v, int64_t tt) { return q.b * v.s[0] + q.h * v.s[1] + tt * v.s[2]; };
  const double dtv = ldd(a.dt, o3(a.dt, t)), lam = sigmoid_d(ldd(a.trap, o3(a.trap, t)));
  gam[i] = dtv * lam;
  // The next step's (1 - lambda) dt half belongs to this step, also the step one past the
  // chunk's end (none past the sequence's last step).
  const bool next = t + 1 < a.S;
  const double nxt =
      next ? ldd(a.dt, o3(a.dt, t + 1)) * (1.0 - sigmoid_d(ldd(a.trap, o3(a.trap, t + 1)))) : 0.0;
  tsc[i] = gam[i] + nxt;
  dacs[i] = ldd(a.da_cs, o3(a.da_cs, t));
}

// (cos, sin) of the rotated pairs of rows row0 .. row0 + nrows - 1 (rows past T: skipped).
NDD_DEV void angle_table(const Args& a, const ChunkPos& q, int64_t row0, int nrows, int T,
                         double* cs, double* sn) {
  for (int e = ndd_tid(); e < nrows * a.A; e += kThreads) {
    const int rr = static_cast<int>(e / a.A);
    const int64_t ai = e % a.A, row = row0 + rr;
    if (row >= T) continue;
    const int64_t t = q.s0 + row / a.R;
    const double th = ldd(a.angles, q.b * a.angles.s[0] + t * a.angles.s[1] +
                                        q.h * a.angles.s[2] + ai * a.angles.s[3]);
    cs[e] = cos(th);
    sn[e] = sin(th);
  }
}

// Element n of row `row` (step row / R, rank row % R) of the biased, rotated q (or k): pairs
// (a, N/2 + a), a < A, turned by the row's angle (cs / sn: the row's table entries).
NDD_DEV double rotated(const Args& a, const View& x, const View& bias, const ChunkPos& q,
                       int64_t row, int64_t n, const double* cs, const double* sn) {
  const int64_t t = q.s0 + row / a.R, r = row % a.R, half = a.N / 2;
  auto el = [&](int64_t m) {
    return ldd(x, q.b * x.s[0] + t * x.s[1] + r * x.s[2] + q.g * x.s[3] + m * x.s[4]) +
           ldd(bias, q.h * bias.s[0] + r * bias.s[1] + m * bias.s[2]);
  };
  if (n < a.A) return el(n) * cs[n] - el(n + half) * sn[n];
  if (n >= half && n - half < a.A) return el(n - half) * sn[n - half] + el(n) * cs[n - half];
  return el(n);
}

// x = v * Psi of row `row`, column p.
NDD_DEV double x_of(const Args& a, const ChunkPos& q, int64_t row, int64_t p) {
  const int64_t t = q.s0 + row / a.R, r = row % a.R;
  return ldd(a.v, q.b * a.v.s[0] + t * a.v.s[1] + q.h * a.v.s[2] + p * a.v.s[3]) *
         ldd(a.mimo_v, q.h * a.mimo_v.s[0] + r * a.mimo_v.s[1] + p * a.mimo_v.s[2]);
}

// ------------------------------------------------------------------ increment

// Grid: B H (nch - 1) slabs. Thread (ng = tid / P, p = tid % P) owns U[n][p] for the slab's n
// = n0 + ng + k (kThreads / P), k < kMaxPer; the chunk's rows in tiles of 16 through shared
// memory, each element's sum over the rows in row order.
NDD_DEV void increment_body(const Args& a, unsigned char* smem) {
  const int64_t nsl = slabs(a), ns = slab_rows(a);
  const int64_t bid = ndd_bid(), slab = bid % nsl, bc = bid / nsl;
  const int64_t c = bc % (a.nch - 1), bh = bc / (a.nch - 1);
  const ChunkPos q = chunk_pos(a, bh, c);  // a whole chunk (only the last can be partial)
  double* sm = reinterpret_cast<double*>(smem);
  double* w = sm;                   // [C] tscale_j exp(da_cs_rev_j)
  double* gam = w + a.C;            // [C] (step_scalars' other outputs, unused here)
  double* dacs = gam + a.C;         // [C]
  double* cs = dacs + a.C;          // [16][A]
  double* sn = cs + 16 * a.A;       // [16][A]
  double* sk = sn + 16 * a.A;       // [16][ns] kh w
  double* sx = sk + 16 * ns;        // [16][P]
  const int tid = ndd_tid();
  const int64_t n0 = slab * ns, nn = a.N - n0 < ns ? a.N - n0 : ns;
  const int64_t per = kThreads / a.P, ng = tid / a.P, p = tid % a.P;
  const bool owner = ng < per;
  step_scalars(a, q, gam, w, dacs);
  if (tid < q.L) {  // (the thread's own step: no barrier needed before the barrier below)
    const int64_t t = q.s0 + tid;
    w[tid] *= exp(ldd(a.da_cs_rev, q.b * a.da_cs_rev.s[0] + q.h * a.da_cs_rev.s[1] +
                                       t * a.da_cs_rev.s[2]));
  }
  double acc[kMaxPer];
  for (int k = 0; k < kMaxPer; ++k) acc[k] = 0.0;
  const int T = static_cast<int>(q.L * a.R);
  for (int64_t row0 = 0; row0 < T; row0 += 16) {
    ndd_sync();
    angle_table(a, q, row0, 16, T, cs, sn);
    ndd_sync();
    for (int64_t e = tid; e < 16 * nn; e += kThreads) {
      const int64_t rr = e / nn, row = row0 + rr;
      sk[e] = row < T ? rotated(a, a.k, a.k_bias, q, row, n0 + e % nn, cs + rr * a.A,
                                sn + rr * a.A) * w[row / a.R]
                      : 0.0;
    }
    for (int64_t e = tid; e < 16 * a.P; e += kThreads) {
      const int64_t rr = e / a.P, row = row0 + rr;
      sx[e] = row < T ? x_of(a, q, row, e % a.P) : 0.0;
    }
    ndd_sync();
    if (owner) {
      for (int rr = 0; rr < 16; ++rr) {
        const double xv = sx[rr * a.P + p];
        for (int k = 0; k < kMaxPer; ++k) {
          const int64_t nl = ng + k * per;
          if (nl < nn) acc[k] += sk[rr * nn + nl] * xv;
        }
      }
    }
  }
  if (!owner) return;
  double* U = a.states + ((bh * a.nch + c) * a.N + n0) * a.P;
  for (int k = 0; k < kMaxPer; ++k) {
    const int64_t nl = ng + k * per;
    if (nl < nn) U[nl * a.P + p] = acc[k];
  }
}

// ------------------------------------------------------------------ scan

// Grid: B H ceil(N P / kThreads); one element of [N][P] per thread, serial over the chunks.
NDD_DEV void scan_body(const Args& a) {
  const int64_t np = a.N * a.P, per_bh = (np + kThreads - 1) / kThreads;
  const int64_t bh = ndd_bid() / per_bh, e = (ndd_bid() % per_bh) * kThreads + ndd_tid();
  if (e >= np) return;
  const int64_t b = bh / a.H, h = bh % a.H;
  double* base = a.states + bh * a.nch * np + e;
  double s = 0.0;
  // U_{c+1} is loaded before S_c is stored (they are different elements: the load need not
  // wait for the store).
  double u = a.nch > 1 ? base[0] : 0.0;
  for (int64_t c = 0; c < a.nch; ++c) {
    const double un = c + 2 < a.nch ? base[(c + 1) * np] : 0.0;
    base[c * np] = s;
    if (c + 1 < a.nch) {
      const int64_t tl = c * a.C + a.C - 1;  // the chunk's last step (a whole chunk)
      const double decay =
          exp(ldd(a.da_cs, b * a.da_cs.s[0] + h * a.da_cs.s[1] + tl * a.da_cs.s[2]));
      s = decay * s + u;
    }
    u = un;
  }
}

// ------------------------------------------------------------------ readout

// Grid: B H nch. Rows in tiles of a.tile; thread (rg = tid / P, p = tid % P) owns y[rr][p] of
// the tile's rows rr = rg + k (kThreads / P).
NDD_DEV void readout_body(const Args& a, unsigned char* smem) {
  const int64_t bid = ndd_bid(), c = bid % a.nch, bh = bid / a.nch;
  const ChunkPos q = chunk_pos(a, bh, c);
  const int TR = a.tile;
  const int64_t ldn = a.N + 1, P = a.P;  // (rows of q / k padded: the tile dots' bank spread)
  double* sm = reinterpret_cast<double*>(smem);
  double* gam = sm;             // [C]
  double* tsc = gam + a.C;      // [C]
  double* dacs = tsc + a.C;     // [C]
  double* red = dacs + a.C;     // [C]: thread 0's chunk sum (red[0])
  double* csi = red + a.C;      // [TR][A] the row tile's angles
  double* sni = csi + TR * a.A;
  double* csj = sni + TR * a.A; // [TR][A] the column tile's
  double* snj = csj + TR * a.A;
  double* sq = snj + TR * a.A;  // [TR][ldn] qh of the row tile
  double* sk = sq + TR * ldn;   // [TR][ldn] kh of the column tile
  double* sx = sk + TR * ldn;   // [TR][P] x of the column tile
  double* sxi = sx + TR * P;    // [TR][P] x of the row tile
  double* sy = sxi + TR * P;    // [TR][P] y
  double* sg = sy + TR * P;     // [TR][P] G = dL/dxhat
  double* sa = sg + TR * P;     // [TR][TR + 1] the tile pair's coefficients
  const int tid = ndd_tid();
  step_scalars(a, q, gam, tsc, dacs);
  if (tid == 0) red[0] = 0.0;
  const int T = static_cast<int>(q.L * a.R);
  const int64_t per = kThreads / P, rg = tid / P, p = tid % P;
  const bool owner = rg < per;
  const double* St = a.states + (bh * a.nch + c) * a.N * P;
  const double Dh = ldd(a.d, q.h * a.d.s[0]);
  auto seg = [&](int i, int j) {
    return q.partial ? dacs[i] - dacs[j]
                     : ldd(a.segsum, q.b * a.segsum.s[0] + q.h * a.segsum.s[1] +
                                         c * a.segsum.s[2] + i * a.segsum.s[3] +
                                         j * a.segsum.s[4]);
  };
  // The rotated q (or k) rows and the x rows of the tile from row0 (zero past T), with the
  // tile's angle table cs / sn filled first (barriers before and after it).
  auto tile_rows = [&](int64_t row0, const View& v, const View& bias, double* cs, double* sn,
                       double* dst, double* dx) {
    ndd_sync();
    angle_table(a, q, row0, TR, T, cs, sn);
    ndd_sync();
    for (int64_t e = tid; e < TR * a.N; e += kThreads) {
      const int64_t rr = e / a.N, n = e % a.N, row = row0 + rr;
      dst[rr * ldn + n] = row < T ? rotated(a, v, bias, q, row, n, cs + rr * a.A, sn + rr * a.A)
                                  : 0.0;
    }
    for (int64_t e = tid; e < TR * P; e += kThreads) {
      const int64_t rr = e / P, row = row0 + rr;
      dx[e] = row < T ? x_of(a, q, row, e % P) : 0.0;
    }
    ndd_sync();
  };
  for (int64_t ri0 = 0; ri0 < T; ri0 += TR) {
    // (its first barrier: the step scalars; the previous tile's readers of sq, sx, sy, sg)
    tile_rows(ri0, a.q, a.q_bias, csi, sni, sq, sxi);
    double y[kMaxPer];
    for (int k = 0; k < kMaxPer; ++k) y[k] = 0.0;
    // inter-chunk: exp(da_cs_i) qh S_c (S_0 = 0)
    if (owner && c > 0) {
      for (int64_t n = 0; n < a.N; ++n) {
        const double s = St[n * P + p];
        for (int k = 0; k < kMaxPer; ++k) {
          const int64_t rr = rg + k * per;
          if (rr < TR) y[k] += sq[rr * ldn + n] * s;
        }
      }
      for (int k = 0; k < kMaxPer; ++k) {
        const int64_t rr = rg + k * per, row = ri0 + rr;
        if (rr < TR && row < T) y[k] *= exp(dacs[row / a.R]);
      }
    }
    // intra-chunk, the column tiles up to the last rank of the row tile's last step (past the
    // row tile itself where a step's ranks straddle two tiles: R not a power of two)
    const int64_t last_i = (ri0 + TR - 1 < T ? ri0 + TR - 1 : T - 1) / a.R;
    const int64_t rj_end = (last_i + 1) * a.R;
    for (int64_t rj0 = 0; rj0 < rj_end; rj0 += TR) {
      tile_rows(rj0, a.k, a.k_bias, csj, snj, sk, sx);
      // coefficient of column row rj for row ri: tscale_j exp(segsum_ij) qh . kh (j < i),
      // gamma_i qh . kh (j = i: all rank pairs of the step), 0 after
      for (int e = tid; e < TR * TR; e += kThreads) {
        const int ri = e / TR, rj = e % TR;
        const int64_t rowi = ri0 + ri, rowj = rj0 + rj;
        double v = 0.0;
        if (rowi < T && rowj < T) {
          const int i = static_cast<int>(rowi / a.R), j = static_cast<int>(rowj / a.R);
          if (j <= i) {
            double dot = 0.0;
            for (int64_t n = 0; n < a.N; ++n) dot += sq[ri * ldn + n] * sk[rj * ldn + n];
            v = j < i ? tsc[j] * exp(seg(i, j)) * dot : gam[i] * dot;
          }
        }
        sa[ri * (TR + 1) + rj] = v;
      }
      ndd_sync();
      if (owner) {
        for (int rj = 0; rj < TR; ++rj) {
          const double xv = sx[rj * P + p];
          for (int k = 0; k < kMaxPer; ++k) {
            const int64_t rr = rg + k * per;
            if (rr < TR) y[k] += sa[rr * (TR + 1) + rj] * xv;
          }
        }
      }
    }
    // D x, then y and G to shared memory for the row terms
    if (owner) {
      for (int k = 0; k < kMaxPer; ++k) {
        const int64_t rr = rg + k * per, row = ri0 + rr;
        if (rr >= TR) continue;
        double gv = 0.0;
        if (row < T) {
          y[k] += Dh * sxi[rr * P + p];
          const int64_t t = q.s0 + row / a.R, r = row % a.R;
          const int64_t o =
              q.b * a.dout.s[0] + t * a.dout.s[1] + q.h * a.dout.s[2] + p * a.dout.s[3];
          const int64_t oz = q.b * a.z.s[0] + t * a.z.s[1] + q.h * a.z.s[2] + p * a.z.s[3];
          const double u = ldd(a.z, oz) * ldd(a.mimo_z, q.h * a.mimo_z.s[0] + r * a.mimo_z.s[1] +
                                                           p * a.mimo_z.s[2]);
          gv = ldd(a.dout, o) *
               ldd(a.mimo_o, q.h * a.mimo_o.s[0] + r * a.mimo_o.s[1] + p * a.mimo_o.s[2]) * u *
               sigmoid_d(u) * ldd(a.norm_weight, q.h * a.norm_weight.s[0] + p * a.norm_weight.s[1]);
        }
        sy[rr * P + p] = y[k];
        sg[rr * P + p] = gv;
      }
    }
    ndd_sync();
    // The row terms, one thread per row, then thread 0 adds them in row order.
    if (tid < TR && ri0 + tid < T) {
      const double* yr = sy + tid * P;
      const double* gr = sg + tid * P;
      const double* xr = sxi + tid * P;
      double yy = 0, gx = 0, yx = 0, gy = 0;
      for (int64_t pp = 0; pp < P; ++pp) {
        yy += yr[pp] * yr[pp];
        gx += gr[pp] * xr[pp];
        yx += yr[pp] * xr[pp];
        gy += gr[pp] * yr[pp];
      }
      const double rs = 1.0 / sqrt(yy / static_cast<double>(P) + a.eps);
      sa[tid] = rs * (gx - yx * rs * rs * gy / static_cast<double>(P));  // (sa is free here)
    }
    ndd_sync();
    if (tid == 0) {
      double s = red[0];
      for (int rr = 0; rr < TR && ri0 + rr < T; ++rr) s += sa[rr];
      red[0] = s;
    }
  }
  ndd_sync();
  if (tid == 0) a.part[bh * a.nch + c] = red[0];
}

// ------------------------------------------------------------------ whole-chunk kernels
//
// Where a chunk's rows fit in shared memory (N, P multiples of 8; the bench grid's shapes), the
// readout builds the chunk's qh, kh and x once and runs its products (A, U_c, Y) on the float64
// tensor cores (mma m8n8k4: a warp's 8 x 8 tile, one double of A and of B per lane), S_c
// staged through shared memory in blocks of n rows. The generic bodies above re-read
// q / k per tile pair and S_c from L2 per row group (24 ms for the readout at N128 P64 R4 C16
// B4 S2048 H16, H100); 4 x 4 FMA register tiles took 4.6 ms there, issue-bound (session 42),
// these 3.4 ms with 8 warps per block (session 43: most of it the builds' load latency and the
// scalar work around the products, not the products).
// The same formulas; sums in another fixed order (float64 both).
//
// Row strides (doubles) for the fragments' loads, two wavefronts per warp load: A-layout reads
// (8 rows g, 4 columns q) want a stride of 8 words mod 32 (ldq = N + 4, lda = T + 4 with N, T
// multiples of 16); B-layout reads (4 rows q, 8 columns g) 16 words mod 32 (ldx = P + 8). The
// U products read kh in that layout with ldq (its A-layout stride for the coefficients):
// not checked for bank conflicts on a GPU yet.

#if defined(__CUDACC__)
// d += A B for the warp's 8 x 8 tile: a = A[lane / 4][lane % 4], b = B[lane % 4][lane / 4],
// d = D[lane / 4][2 (lane % 4) + {0, 1}].
NDD_DEV void ndd_dmma884(double (&d)[2], double a, double b) {
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
               : "+d"(d[0]), "+d"(d[1])
               : "d"(a), "d"(b));
}
#else
void ndd_dmma884(double (&d)[2], double a, double b);  // the host emulator's
#endif

// 16 warps per block: one block per SM at most shapes (shared memory), so its own warps hide
// the load and mma latencies (8 warps: 1.1x slower at N128 P64 R4 C16, session 43).
constexpr int kFastThreads = 512;
constexpr int kWarps = kFastThreads / 32;
constexpr int kColTiles = 4;      // 8 x 8 tiles per warp strip (32 columns)
constexpr int kYStrips = 2;       // the readout's Y strips per warp, at most
constexpr int kUStrips = 2;       // the readout's U strips per warp and chain pass
constexpr int kStageDoubles = 2048;  // the readout's S_c stage (n rows x ldx)

NDD_HD int64_t fast_ldq(const Args& a) { return a.N + 4; }
NDD_HD int64_t fast_ldx(const Args& a) { return a.P + 8; }
NDD_HD int64_t fast_T(const Args& a) { return a.C * a.R; }
NDD_HD int64_t fast_lda(const Args& a) { return fast_T(a) + 4; }
NDD_HD int64_t col_chunks(const Args& a) { return (a.P + 8 * kColTiles - 1) / (8 * kColTiles); }
// The readout's state chain in passes of kWarps kUStrips strips of U_c (8 n rows x 32 columns),
// each with its own flag per chunk: 1 at N P <= 4096, 2 at N 256 P 64 and N 128 P 128.
NDD_HD int64_t chain_passes(int64_t N, int64_t P) {
  const int64_t strips = (N / 8) * ((P + 8 * kColTiles - 1) / (8 * kColTiles));
  return (strips + int64_t{kWarps} * kUStrips - 1) / (int64_t{kWarps} * kUStrips);
}
NDD_HD int64_t stage_rows(const Args& a) {
  const int64_t r = (kStageDoubles / fast_ldx(a)) / 4 * 4;
  return r < a.N ? r : a.N;
}
inline size_t fast_readout_smem(const Args& a) {
  const int64_t T = fast_T(a);
  return sizeof(double) * static_cast<size_t>(4 * a.C + 2 * T * fast_ldq(a) + T * fast_lda(a) +
                                              T * fast_ldx(a) + stage_rows(a) * fast_ldx(a));
}
// The readout's S_c stage in n rows: over kh (dead after the coefficients) and the stage region
// that follows it, so that most shapes stage S_c at once (one barrier, one load latency).
NDD_HD int64_t readout_stage_rows(const Args& a) {
  const int64_t r = ((fast_T(a) * fast_ldq(a) + stage_rows(a) * fast_ldx(a)) / fast_ldx(a)) / 4 * 4;
  return r < a.N ? r : a.N;
}
// Whether the step pairs' coefficient table [C][C] fits the stage region (else per element).
NDD_HD bool coef_table(const Args& a) { return a.C * a.C <= stage_rows(a) * fast_ldx(a); }
// Whether the whole-chunk kernels take this shape (`limit`: shared memory per block).
inline bool fast_ok(const Args& a, size_t limit) {
  const int64_t T = fast_T(a);
  return a.N % 8 == 0 && a.P % 8 == 0 && T % 8 == 0 && stage_rows(a) >= 4 &&
         (T / 8) * col_chunks(a) <= int64_t{kWarps} * kYStrips &&
         // the row terms' partials [T][4 col_chunks][4] go over qh and the coefficients
         T * fast_ldq(a) + T * fast_lda(a) >= T * 16 * col_chunks(a) &&
         fast_readout_smem(a) <= limit;
}

// The compiled dtype specialization of the whole-chunk kernels for these tensors: the
// activations' dtype code when q, k, v, z and dout share it and every parameter (biases,
// mimo_v / o / z, norm_weight) is float32; else -1 (the runtime-dtype kernels).
inline int fast_act_dtype(const Args& a) {
  const int d = a.q.dt;
  for (const View* v : {&a.k, &a.v, &a.z, &a.dout})
    if (v->dt != d) return -1;
  for (const View* v : {&a.q_bias, &a.k_bias, &a.mimo_v, &a.mimo_o, &a.mimo_z, &a.norm_weight})
    if (v->dt != 2) return -1;
  return d;
}
// The parameters' dtype code of a specialization (float32), or -1 with the runtime one.
constexpr int par_dtype(int act) { return act < 0 ? -1 : 2; }
// Calls f(std::integral_constant<int, D>{}) with D = fast_act_dtype(a) (host side).
template <class F>
void with_act_dtype(const Args& a, F&& f) {
  switch (fast_act_dtype(a)) {
    case 0: f(std::integral_constant<int, 0>{}); break;
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, -1>{}); break;
  }
}
// row / R: a shift where R is a power of two (rsh >= 0), else a division.
NDD_HD int log2_or_neg(int r) {
  int s = 0;
  while ((1 << s) < r) ++s;
  return (1 << s) == r ? s : -1;
}
NDD_DEV int step_of(int row, int R, int rsh) { return rsh >= 0 ? row >> rsh : row / R; }

// The chunk's rows into shared memory: qh (when given) and kh [T][ldq], x [T][ldx]; rows past
// the sequence zero. Each (step, pair) turns by one
// sincos for all ranks of q and k. DA / DP: the activations' (q, k, v) and the parameters'
// (biases, mimo_v) dtype codes, or -1 for the runtime ones (fast_act_dtype).
template <int DA, int DP>
NDD_DEV void build_chunk(const Args& a, const ChunkPos& q, double* qh, double* kh, int64_t ldq,
                         double* x, int64_t ldx) {
  // (Loads as raw bits first, converted after: a run of them waits one memory latency, not one
  // per element, as rt_ld's dtype branches made it.)
  const int tid = ndd_tid();
  const int64_t R = a.R, N = a.N, half = N / 2, T = a.C * R, TL = q.L * R;
  auto off = [&](const View& v, int64_t t, int64_t r, int64_t m) {
    return q.b * v.s[0] + t * v.s[1] + r * v.s[2] + q.g * v.s[3] + m * v.s[4];
  };
  auto boff = [&](const View& v, int64_t r, int64_t m) {
    return q.h * v.s[0] + r * v.s[1] + m * v.s[2];
  };
  auto raw_a = [](const View& v, int64_t o) { return rt_ld_raw<DA>(v.p, o, v.dt); };
  auto raw_p = [](const View& v, int64_t o) { return rt_ld_raw<DP>(v.p, o, v.dt); };
  auto val_a = [](const View& v, uint32_t u) { return static_cast<double>(rt_raw_f<DA>(u, v.dt)); };
  auto val_p = [](const View& v, uint32_t u) { return static_cast<double>(rt_raw_f<DP>(u, v.dt)); };
  // The rotated pairs: (step, pair) by thread, its ranks in batches of kRB with their loads
  // first, the first batch's issued before the sincos (their latency under it).
  constexpr int kRB = 2;
  for (int64_t e = tid; e < q.L * a.A; e += kFastThreads) {
    const int64_t i = e / a.A, ai = e % a.A, t = q.s0 + i;
    const double th = ldd(a.angles, q.b * a.angles.s[0] + t * a.angles.s[1] +
                                        q.h * a.angles.s[2] + ai * a.angles.s[3]);
    double cs = 0.0, sn = 0.0;
    for (int64_t rb = 0; rb < R; rb += kRB) {
      uint32_t u[kRB][8];
      NDD_UNROLL
      for (int v = 0; v < kRB; ++v) {
        const int64_t r = rb + v;
        if (r >= R) continue;
        u[v][0] = raw_a(a.k, off(a.k, t, r, ai));
        u[v][1] = raw_a(a.k, off(a.k, t, r, ai + half));
        u[v][2] = raw_p(a.k_bias, boff(a.k_bias, r, ai));
        u[v][3] = raw_p(a.k_bias, boff(a.k_bias, r, ai + half));
        if (qh) {
          u[v][4] = raw_a(a.q, off(a.q, t, r, ai));
          u[v][5] = raw_a(a.q, off(a.q, t, r, ai + half));
          u[v][6] = raw_p(a.q_bias, boff(a.q_bias, r, ai));
          u[v][7] = raw_p(a.q_bias, boff(a.q_bias, r, ai + half));
        }
      }
      if (rb == 0) cs = cos(th), sn = sin(th);
      NDD_UNROLL
      for (int v = 0; v < kRB; ++v) {
        const int64_t r = rb + v, row = i * R + r;
        if (r >= R) continue;
        if (qh) {
          const double qu = val_a(a.q, u[v][4]) + val_p(a.q_bias, u[v][6]);
          const double qv = val_a(a.q, u[v][5]) + val_p(a.q_bias, u[v][7]);
          qh[row * ldq + ai] = qu * cs - qv * sn;
          qh[row * ldq + ai + half] = qu * sn + qv * cs;
        }
        const double ku = val_a(a.k, u[v][0]) + val_p(a.k_bias, u[v][2]);
        const double kv = val_a(a.k, u[v][1]) + val_p(a.k_bias, u[v][3]);
        kh[row * ldq + ai] = ku * cs - kv * sn;
        kh[row * ldq + ai + half] = ku * sn + kv * cs;
      }
    }
  }
  // The unrotated columns A .. half - 1, half + A .. N - 1 and x: rows by thread rows (ty),
  // columns by lanes (tx), kB rows per round with their loads first; 32-bit in-chunk indices,
  // each row's step, rank and element offsets but the column's formed once per round (a
  // division per element, in 64 bits, cost more than the loads; the offsets were ~1/6 of the
  // readout's instructions, session 43's profile).
  constexpr int kB = 4, kTX = 32, kTY = kFastThreads / kTX;
  const int tx = tid % kTX, ty = tid / kTX;
  const int Ti = static_cast<int>(T), TLi = static_cast<int>(TL), Ri = static_cast<int>(R);
  const int nu = static_cast<int>(N - 2 * a.A), Ai = static_cast<int>(a.A);
  const int halfi = static_cast<int>(half), Pi = static_cast<int>(a.P);
  for (int row0 = ty; row0 < Ti; row0 += kB * kTY) {
    int64_t tv[kB], oq[kB], oqb[kB], ok[kB], okb[kB];
    int rv[kB];
    bool live[kB];
    NDD_UNROLL
    for (int v = 0; v < kB; ++v) {
      const int row = row0 + v * kTY, i = row / Ri;
      tv[v] = q.s0 + i, rv[v] = row - i * Ri, live[v] = row < TLi;
      oq[v] = off(a.q, tv[v], rv[v], 0), oqb[v] = boff(a.q_bias, rv[v], 0);
      ok[v] = off(a.k, tv[v], rv[v], 0), okb[v] = boff(a.k_bias, rv[v], 0);
    }
    for (int m = tx; m < nu; m += kTX) {
      const int n = m < halfi - Ai ? Ai + m : halfi + Ai + (m - (halfi - Ai));
      uint32_t uq[kB], uqb[kB], uk[kB], ukb[kB];
      NDD_UNROLL
      for (int v = 0; v < kB; ++v) {
        uq[v] = uqb[v] = uk[v] = ukb[v] = 0;
        if (live[v]) {
          if (qh) {
            uq[v] = raw_a(a.q, oq[v] + n * a.q.s[4]);
            uqb[v] = raw_p(a.q_bias, oqb[v] + n * a.q_bias.s[2]);
          }
          uk[v] = raw_a(a.k, ok[v] + n * a.k.s[4]);
          ukb[v] = raw_p(a.k_bias, okb[v] + n * a.k_bias.s[2]);
        }
      }
      NDD_UNROLL
      for (int v = 0; v < kB; ++v) {
        const int row = row0 + v * kTY;
        if (row >= Ti) continue;
        const int64_t d = int64_t{row} * ldq + n;
        if (qh) qh[d] = live[v] ? val_a(a.q, uq[v]) + val_p(a.q_bias, uqb[v]) : 0.0;
        kh[d] = live[v] ? val_a(a.k, uk[v]) + val_p(a.k_bias, ukb[v]) : 0.0;
      }
    }
    int64_t ov[kB], om[kB];
    NDD_UNROLL
    for (int v = 0; v < kB; ++v) {
      ov[v] = q.b * a.v.s[0] + tv[v] * a.v.s[1] + q.h * a.v.s[2];
      om[v] = q.h * a.mimo_v.s[0] + rv[v] * a.mimo_v.s[1];
    }
    for (int p = tx; p < Pi; p += kTX) {
      uint32_t uv[kB], um[kB];
      NDD_UNROLL
      for (int v = 0; v < kB; ++v) {
        uv[v] = um[v] = 0;
        if (live[v]) {
          uv[v] = raw_a(a.v, ov[v] + p * a.v.s[3]);
          um[v] = raw_p(a.mimo_v, om[v] + p * a.mimo_v.s[2]);
        }
      }
      NDD_UNROLL
      for (int v = 0; v < kB; ++v) {
        const int row = row0 + v * kTY;
        if (row < Ti) x[row * ldx + p] = live[v] ? val_a(a.v, uv[v]) * val_p(a.mimo_v, um[v]) : 0.0;
      }
    }
  }
  for (int e = tid; e < (Ti - TLi) * 2 * Ai; e += kFastThreads) {  // rotated columns, dead rows
    const int row = TLi + e / (2 * Ai), m = e % (2 * Ai);
    const int n = m < Ai ? m : halfi + (m - Ai);
    if (qh) qh[int64_t{row} * ldq + n] = 0.0;
    kh[int64_t{row} * ldq + n] = 0.0;
  }
}

// Grid: nch B H, chunk-major (block c BH + bh). A block's predecessor in the state chain (chunk
// c - 1) has a lower index, so it was scheduled first and the chain cannot deadlock; chunk-major
// so that the blocks resident together are few chunks of many heads, not a head's whole chain
// (which would run its links one after another while its blocks wait). The chunk's
// coefficient matrix A (T x T: row tiles by warp, column tiles up to the row tile's last step);
// then, but for the last chunk, the state chain: U_c = kh^T diag(w) x in registers (warp strips
// of 8 n rows x up to 32 columns, w_j = tscale_j exp(da_cs_rev_j)) and, once chunk c - 1 has
// published S_c, S_{c+1} = exp(da_cs_{last of c}) S_c + U_c stored and published; then
// Y = exp(da_cs) qh S_c + A x + D x in warp strips (8 rows x up to 32 columns; S_c staged by n
// rows over kh and the stage region), then the row terms from per-lane partial sums. DA / DP as
// build_chunk's.
template <int DA = -1, int DP = -1>
NDD_DEV void readout_fast_body(const Args& a, unsigned char* smem) {
  const int64_t BH = a.B * a.H, bid = ndd_bid(), c = bid / BH, bh = bid % BH;
  const ChunkPos q = chunk_pos(a, bh, c);
  const int64_t T = fast_T(a), ldq = fast_ldq(a), lda = fast_lda(a), ldx = fast_ldx(a);
  const int64_t P = a.P, N = a.N, R = a.R, TL = q.L * R, ns = readout_stage_rows(a);
  const int64_t ncc = col_chunks(a), npart = 4 * ncc;  // row-term partials per row
  const int Ri = static_cast<int>(R), rsh = log2_or_neg(Ri), Ci = static_cast<int>(a.C);
  double* sm = reinterpret_cast<double*>(smem);
  double* gam = sm;              // [C]
  double* tsc = gam + a.C;       // [C]
  double* dacs = tsc + a.C;      // [C]
  double* wv = dacs + a.C;       // [C] w_j = tscale_j exp(da_cs_rev_j) (the chain's chunks)
  double* qh = wv + a.C;         // [T][ldq]
  double* A = qh + T * ldq;      // [T][lda]
  double* x = A + T * lda;       // [T][ldx]
  double* kh = x + T * ldx;      // [T][ldq]
  double* st = kh;               // [ns][ldx] S_c's stage (after A: over kh and what follows)
  double* E = kh + T * ldq;      // [C][C] the step pairs' coefficients (coef_table)
  double* part = qh;             // [T][npart][4] (after Y: over qh and A)
  double* terms = kh;            // [T] the rows' terms (after the partials)
  const int tid = ndd_tid(), warp = tid / 32, lane = tid % 32, g = lane / 4, qq = lane % 4;
  const bool chain = c + 1 < a.nch;  // (a whole chunk: only the last can be partial)
  step_scalars(a, q, gam, tsc, dacs);
  if (chain && tid < q.L) {  // (the thread's own step)
    wv[tid] = tsc[tid] * exp(ldd(a.da_cs_rev, q.b * a.da_cs_rev.s[0] + q.h * a.da_cs_rev.s[1] +
                                                  (q.s0 + tid) * a.da_cs_rev.s[2]));
  }
  build_chunk<DA, DP>(a, q, qh, kh, ldq, x, ldx);
  // A[i][j] = qh_i . kh_j times the coefficient of steps (si, sj): tscale_j exp(segsum_ij)
  // (sj < si), gamma_i (same step), 0 (later step, or past the sequence).
  auto coef = [&](int si, int sj) -> double {
    if (si >= q.L || sj > si) return 0.0;
    if (sj == si) return gam[si];
    const double sg = q.partial ? dacs[si] - dacs[sj]
                                : ldd(a.segsum, q.b * a.segsum.s[0] + q.h * a.segsum.s[1] +
                                                    c * a.segsum.s[2] + si * a.segsum.s[3] +
                                                    sj * a.segsum.s[4]);
    return tsc[sj] * exp(sg);
  };
  // Once per step pair where the table fits (R^2 fewer exp and segsum loads than per element).
  const bool table = coef_table(a);
  ndd_sync();  // (the step scalars)
  if (table)
    for (int e = tid; e < Ci * Ci; e += kFastThreads) E[e] = coef(e / Ci, e % Ci);
  ndd_sync();
  // Items (row tile rt, column strip from c0) by warp; column tiles up to row 8 rt + 7's last
  // rank.
  const int64_t ncs = (T + 8 * kColTiles - 1) / (8 * kColTiles);  // column strips
  for (int64_t item = warp; item < (T / 8) * ncs; item += kWarps) {
    const int64_t r0 = (item / ncs) * 8, c0 = (item % ncs) * 8 * kColTiles;
    const int64_t cend = (static_cast<int>(r0 + 7) / Ri + 1) * R;  // columns < cend
    const int si = step_of(static_cast<int>(r0) + g, Ri, rsh);
    const int64_t cl = (cend < T ? cend : T) - c0;  // live columns from c0
    const int nct =
        cl <= 0 ? 0 : static_cast<int>(cl >= 8 * kColTiles ? kColTiles : (cl + 7) / 8);
    double acc[kColTiles][2];
    NDD_UNROLL
    for (int ct = 0; ct < kColTiles; ++ct) acc[ct][0] = acc[ct][1] = 0.0;
    for (int64_t k0 = 0; k0 < (nct > 0 ? N : 0); k0 += 4) {
      const double av = qh[(r0 + g) * ldq + k0 + qq];
      NDD_UNROLL
      for (int ct = 0; ct < kColTiles; ++ct)
        if (ct < nct) ndd_dmma884(acc[ct], av, kh[(c0 + 8 * ct + g) * ldq + k0 + qq]);
    }
    NDD_UNROLL
    for (int ct = 0; ct < kColTiles; ++ct) {
      if (c0 + 8 * ct >= T) continue;
      NDD_UNROLL
      for (int e = 0; e < 2; ++e) {
        const int rj = static_cast<int>(c0) + 8 * ct + 2 * qq + e;
        const int sj = step_of(rj, Ri, rsh);
        const double f = table ? E[si * Ci + sj] : coef(si, sj);
        A[(r0 + g) * lda + rj] = f * acc[ct][e];
      }
    }
  }
  // The state chain, in passes (chain_passes): kUStrips strips per warp of U_c (n rows n0 ..
  // n0 + 7, columns from c0; A[n][j] = kh[j][n] w_j, each lane's k over the chunk's rows in
  // order), then, once chunk c - 1 has published this pass of S_c, this pass of S_{c+1}, and
  // its flag. Per chunk and pass, the chain's serial part is the wait, S_c's load from L2, the
  // stores and the flag; the products run before it.
  const int64_t npass = chain_passes(N, P);
  const double* Sc = a.states + (bh * a.nch + c) * N * P;  // S_c (c > 0)
  unsigned* flag_c = a.flags + (bh * a.nch + c) * npass;  // S_c's (c > 0)
  // With one pass and S_c within the stage (9 of the 11 grid shapes), the link also writes the
  // S_c it has loaded into the stage, and Y's stage loads (another L2 latency per chunk) are
  // skipped. (With more passes the stage, over kh, would overwrite rows the next pass reads.)
  const bool link_stages = chain && c > 0 && npass == 1 && ns >= N;
  if (chain) {
    double* Sn = a.states + (bh * a.nch + c + 1) * N * P;
    const double decay = exp(dacs[Ci - 1]);
    const int64_t nus = (N / 8) * ncc;
    for (int64_t pass = 0; pass < npass; ++pass) {
      const int64_t s0 = pass * kWarps * kUStrips;
      double u[kUStrips][kColTiles][2];
      NDD_UNROLL
      for (int us = 0; us < kUStrips; ++us) {
        NDD_UNROLL
        for (int ct = 0; ct < kColTiles; ++ct) u[us][ct][0] = u[us][ct][1] = 0.0;
        const int64_t sidx = s0 + warp + int64_t{us} * kWarps;
        if (sidx >= nus) continue;
        const int64_t n0 = (sidx / ncc) * 8, c0 = (sidx % ncc) * 8 * kColTiles;
        const int nct = static_cast<int>((P - c0) / 8 < kColTiles ? (P - c0) / 8 : kColTiles);
        for (int64_t j0 = 0; j0 < T; j0 += 4) {
          const int j = static_cast<int>(j0) + qq;
          const double av = kh[j * ldq + n0 + g] * wv[step_of(j, Ri, rsh)];
          NDD_UNROLL
          for (int ct = 0; ct < kColTiles; ++ct)
            if (ct < nct) ndd_dmma884(u[us][ct], av, x[j * ldx + c0 + 8 * ct + g]);
        }
      }
      if (c > 0 && tid == 0) ndd_flag_wait(flag_c + pass);
      ndd_sync();  // (this pass of S_c published)
      // Per strip, its S_c elements' loads first (one L2 latency per strip on the chain's
      // serial path, not one per element: the compiler cannot move a load of S_c above a
      // store to S_{c+1}; per pass they would spill), then the stores.
      NDD_UNROLL
      for (int us = 0; us < kUStrips; ++us) {
        const int64_t sidx = s0 + warp + int64_t{us} * kWarps;
        if (sidx >= nus) continue;
        const int64_t n0 = (sidx / ncc) * 8, c0 = (sidx % ncc) * 8 * kColTiles;
        const int nct = static_cast<int>((P - c0) / 8 < kColTiles ? (P - c0) / 8 : kColTiles);
        const int64_t o = (n0 + g) * P + c0 + 2 * qq;
        double sv[kColTiles][2];
        NDD_UNROLL
        for (int ct = 0; ct < kColTiles; ++ct) {
          const bool live = c > 0 && ct < nct;
          sv[ct][0] = live ? ndd_ldcg(Sc + o + 8 * ct) : 0.0;
          sv[ct][1] = live ? ndd_ldcg(Sc + o + 8 * ct + 1) : 0.0;
        }
        NDD_UNROLL
        for (int ct = 0; ct < kColTiles; ++ct) {
          if (ct >= nct) continue;
          Sn[o + 8 * ct] = decay * sv[ct][0] + u[us][ct][0];
          Sn[o + 8 * ct + 1] = decay * sv[ct][1] + u[us][ct][1];
          if (link_stages) {  // (kh is dead: every U product came before the barrier above)
            double* sr = st + (n0 + g) * ldx + c0 + 8 * ct + 2 * qq;
            sr[0] = sv[ct][0], sr[1] = sv[ct][1];
          }
        }
      }
      ndd_sync();  // (every thread's stores before the flag)
      if (tid == 0) ndd_flag_post(flag_c + npass + pass);
    }
  } else if (c > 0 && tid == 0) {
    // The last chunk: S_c whole. The last pass's flag covers the earlier passes' stores (each
    // flag is released after a barrier that follows them). The stage's first barrier follows.
    ndd_flag_wait(flag_c + npass - 1);
  }
  // Y strips: this warp's strips warp + u kWarps: row tile sidx / ncc, columns from
  // 8 kColTiles (sidx % ncc)
  const int64_t nstrips = (T / 8) * ncc;
  double y[kYStrips][kColTiles][2];
  NDD_UNROLL
  for (int u = 0; u < kYStrips; ++u)
    NDD_UNROLL
    for (int ct = 0; ct < kColTiles; ++ct) y[u][ct][0] = y[u][ct][1] = 0.0;
  auto strip = [&](int u, int64_t& r0, int64_t& c0, int& nct) {
    const int64_t sidx = warp + int64_t{u} * kWarps;
    r0 = (sidx / ncc) * 8, c0 = (sidx % ncc) * 8 * kColTiles;
    nct = static_cast<int>((P - c0) / 8 < kColTiles ? (P - c0) / 8 : kColTiles);
    return sidx < nstrips;
  };
  if (c > 0) {  // S_0 = 0
    for (int64_t n0 = 0; n0 < N; n0 += ns) {
      const int64_t nn = N - n0 < ns ? N - n0 : ns;  // (a multiple of 4: N and ns are)
      ndd_sync();  // (kh's readers; the previous stage's; the link's stage stores)
      if (!link_stages) {  // (else S_c is in the stage: the link's stores, then barriers)
        for (int64_t e0 = tid; e0 < nn * P; e0 += 4 * kFastThreads) {  // (loads first)
          double v[4];
          NDD_UNROLL
          for (int u = 0; u < 4; ++u)
            v[u] = e0 + u * kFastThreads < nn * P ? ndd_ldcg(Sc + n0 * P + e0 + u * kFastThreads)
                                                  : 0.0;
          NDD_UNROLL
          for (int u = 0; u < 4; ++u) {
            const int64_t e = e0 + u * kFastThreads;
            if (e < nn * P) st[(e / P) * ldx + e % P] = v[u];
          }
        }
        ndd_sync();
      }
      NDD_UNROLL
      for (int u = 0; u < kYStrips; ++u) {
        int64_t r0, c0;
        int nct;
        if (!strip(u, r0, c0, nct)) continue;
        for (int64_t k0 = 0; k0 < nn; k0 += 4) {
          const double av = qh[(r0 + g) * ldq + n0 + k0 + qq];
          NDD_UNROLL
          for (int ct = 0; ct < kColTiles; ++ct)
            if (ct < nct) ndd_dmma884(y[u][ct], av, st[(k0 + qq) * ldx + c0 + 8 * ct + g]);
        }
      }
    }
    NDD_UNROLL
    for (int u = 0; u < kYStrips; ++u) {
      int64_t r0, c0;
      int nct;
      if (!strip(u, r0, c0, nct)) continue;
      const int64_t row = r0 + g;
      const double e = row < TL ? exp(dacs[step_of(static_cast<int>(row), Ri, rsh)]) : 0.0;
      NDD_UNROLL
      for (int ct = 0; ct < kColTiles; ++ct) y[u][ct][0] *= e, y[u][ct][1] *= e;
    }
  }
  ndd_sync();  // A complete
  const double Dh = ldd(a.d, q.h * a.d.s[0]);
  NDD_UNROLL
  for (int u = 0; u < kYStrips; ++u) {
    int64_t r0, c0;
    int nct;
    if (!strip(u, r0, c0, nct)) continue;
    const int64_t cend = (static_cast<int>(r0 + 7) / Ri + 1) * R;  // A's columns < cend
    for (int64_t j0 = 0; j0 < (cend < T ? cend : T); j0 += 4) {
      const double av = A[(r0 + g) * lda + j0 + qq];
      NDD_UNROLL
      for (int ct = 0; ct < kColTiles; ++ct)
        if (ct < nct) ndd_dmma884(y[u][ct], av, x[(j0 + qq) * ldx + c0 + 8 * ct + g]);
    }
    NDD_UNROLL
    for (int ct = 0; ct < kColTiles; ++ct)
      if (ct < nct) {
        const double* xr = x + (r0 + g) * ldx + c0 + 8 * ct + 2 * qq;
        y[u][ct][0] += Dh * xr[0], y[u][ct][1] += Dh * xr[1];
      }
  }
  ndd_sync();  // qh, kh and A are dead: the partials go over them
  NDD_UNROLL
  for (int u = 0; u < kYStrips; ++u) {
    int64_t r0, c0;
    int nct;
    if (!strip(u, r0, c0, nct)) continue;
    const int64_t row = r0 + g;
    double yy = 0, yx = 0, gy = 0, gx = 0;
    if (row < TL) {
      const int ii = step_of(static_cast<int>(row), Ri, rsh);
      const int64_t t = q.s0 + ii, r = row - int64_t{ii} * R;
      NDD_UNROLL
      for (int ct = 0; ct < kColTiles; ++ct) {
        if (ct >= nct) continue;
        uint32_t u5[2][5];  // (raw loads first)
        NDD_UNROLL
        for (int e = 0; e < 2; ++e) {
          const int64_t p = c0 + 8 * ct + 2 * qq + e;
          u5[e][0] = rt_ld_raw<DA>(a.z.p, q.b * a.z.s[0] + t * a.z.s[1] + q.h * a.z.s[2] +
                                              p * a.z.s[3], a.z.dt);
          u5[e][1] = rt_ld_raw<DP>(a.mimo_z.p, q.h * a.mimo_z.s[0] + r * a.mimo_z.s[1] +
                                                   p * a.mimo_z.s[2], a.mimo_z.dt);
          u5[e][2] = rt_ld_raw<DA>(a.dout.p, q.b * a.dout.s[0] + t * a.dout.s[1] +
                                                 q.h * a.dout.s[2] + p * a.dout.s[3], a.dout.dt);
          u5[e][3] = rt_ld_raw<DP>(a.mimo_o.p, q.h * a.mimo_o.s[0] + r * a.mimo_o.s[1] +
                                                   p * a.mimo_o.s[2], a.mimo_o.dt);
          u5[e][4] = rt_ld_raw<DP>(a.norm_weight.p, q.h * a.norm_weight.s[0] +
                                                        p * a.norm_weight.s[1], a.norm_weight.dt);
        }
        NDD_UNROLL
        for (int e = 0; e < 2; ++e) {
          const double zu = double{rt_raw_f<DA>(u5[e][0], a.z.dt)} *
                            double{rt_raw_f<DP>(u5[e][1], a.mimo_z.dt)};
          const double gv = double{rt_raw_f<DA>(u5[e][2], a.dout.dt)} *
                            double{rt_raw_f<DP>(u5[e][3], a.mimo_o.dt)} * zu * sigmoid_d(zu) *
                            double{rt_raw_f<DP>(u5[e][4], a.norm_weight.dt)};
          const double yv = y[u][ct][e], xv = x[row * ldx + c0 + 8 * ct + 2 * qq + e];
          yy += yv * yv, yx += yv * xv, gy += gv * yv, gx += gv * xv;
        }
      }
    }
    double* pp = part + (row * npart + (c0 / (8 * kColTiles)) * 4 + qq) * 4;
    pp[0] = yy, pp[1] = yx, pp[2] = gy, pp[3] = gx;
  }
  ndd_sync();
  if (tid < TL) {  // one thread per row: its partials in column order, then its term
    double yy = 0, yx = 0, gy = 0, gx = 0;
    for (int64_t k = 0; k < npart; ++k) {
      const double* pp = part + (tid * npart + k) * 4;
      yy += pp[0], yx += pp[1], gy += pp[2], gx += pp[3];
    }
    const double rs = 1.0 / sqrt(yy / static_cast<double>(P) + a.eps);
    terms[tid] = rs * (gx - yx * rs * rs * gy / static_cast<double>(P));
  }
  ndd_sync();
  if (tid == 0) {
    double s = 0.0;
    for (int64_t row = 0; row < TL; ++row) s += terms[row];
    a.part[bh * a.nch + c] = s;
  }
}

// ------------------------------------------------------------------ final

// Grid: ceil(H / kThreads); dD[h] = sum over b (outer), c (inner) of the partials.
NDD_DEV void final_body(const Args& a) {
  const int64_t h = ndd_bid() * kThreads + ndd_tid();
  if (h >= a.H) return;
  double s = 0.0;
  for (int64_t b = 0; b < a.B; ++b) {
    double sb = 0.0;
    for (int64_t c = 0; c < a.nch; ++c) sb += a.part[(b * a.H + h) * a.nch + c];
    s += sb;
  }
  rt_st(a.dd, h * a.dd_s, a.dd_dt, static_cast<float>(s));
}

}  // namespace mamba3::cuda::ndd
