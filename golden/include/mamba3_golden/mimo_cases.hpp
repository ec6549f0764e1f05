// Test/self-check harness of the MIMO backward operators. First pass mamba3_mimo_bwd_fwd: one
// "case" = sizes + dtypes + options. run_mimo_bwd_fwd_case() draws deterministic random inputs
// rounded to the case's dtypes (da_cs, da_cs_rev and segsum derived from one random adt <= 0 by
// mimo_dacs_segsum, then rounded), computes the float64 golden and the float32 reference from
// exactly those rounded values, runs the operator through the public C API on the chosen device
// with NaN-poisoned outputs, and compares every output with the SPEC.md section 3 rule (per-batch
// dmimo_o / dmimo_z / dnorm_weight as whole tensors).
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "mamba3_golden/host.hpp"
#include "mamba3_golden/mimo.hpp"
#include "mamba3_golden/siso_cases.hpp"  // Device, CaseReport

namespace mamba3::golden {

struct MimoBwdFwdCase {
  int64_t B = 1, S = 64, H = 2, G = 1, N = 64, P = 64, R = 4, chunk = 16, rdd = 4;
  IoType act = IoType::F32;    // dout, q, k, v, z
  IoType param = IoType::F32;  // q_bias, k_bias, mimo_v, mimo_o, mimo_z, d, norm_weight
  IoType decay = IoType::F32;  // angles, da_cs, da_cs_rev, dt, trap, segsum
  IoType out = IoType::F32;    // output dtype: states, qk_dot, dz, dout_pre_rms
  bool reduce_o = true;        // mimo_o given (dout [B,S,H,P]); else per-rank dout [B,S,R,H,P]
  bool z = false;              // SiLU gate (z and mimo_z)
  bool d = false;              // D skip
  bool norm = false;           // fused pre-gate RMSNorm (needs reduce_o and z)
  double norm_eps = 1e-5;
  int64_t pad = 0;             // pad the innermost dim of every input (non-contiguous views)
  // Fill what the operator must not read with NaN: segsum on and above the diagonal, and in a
  // partial last chunk that chunk's segsum and da_cs_rev (the tail contract).
  bool nan_unread = true;
  uint64_t seed = 1;
  std::string describe() const;  // e.g. "B2 S50 H4 G2 N64 P32 R4 C16 rdd4 bf16/f32/f32->f16 z D"
};

// The first pass's inputs of a case (what mamba3_mimo_bwd_fwd and the combined backward both
// take), drawn from rng as run_mimo_bwd_fwd_case / run_mimo_bwd_combined_case draw them: rounded
// to the case's dtypes (padded when c.pad), NaN where the operator must not read (c.nan_unread),
// and the same values as the inputs of the float64 golden (gi) and of the float32 reference (fi).
struct MimoFwdInputs {
  Buffer dout, q, k, v, qb, kb, mv, mo, mz, z, d, nw, angles, dt, trap, da_cs, da_cs_rev, segsum;
  MimoInputs<double> gi;
  MimoInputs<float> fi;
};
MimoFwdInputs make_mimo_fwd_inputs(const MimoBwdFwdCase& c, std::mt19937_64& rng);

// Runs the case `repeats` times and also checks that all runs are bitwise identical (recorded as
// an extra output row "bitwise_repeat" when repeats > 1).
CaseReport run_mimo_bwd_fwd_case(const MimoBwdFwdCase& c, Device dev, int repeats = 1);

// Second pass mamba3_mimo_bwd_bwd: inputs drawn and rounded as for the first pass; states and
// qk_dot are the float64 first pass of those rounded inputs, rounded to `cache` (as the first
// pass would hand them over); the golden and the float32 reference see exactly the rounded
// values. Every one of the 12 outputs is compared (dangles and dda with max_rel, the seed's
// nearly-zero outputs), the outputs are NaN-poisoned, and a repeat must be bitwise identical.
enum class MimoDoutKind { ReduceO, PerRank, Packed };
struct MimoBwdBwdCase {
  int64_t B = 1, S = 64, H = 2, G = 1, N = 64, P = 64, R = 4, chunk = 16, rdd = 4;
  IoType act = IoType::F32;    // dout, q, k, v
  IoType param = IoType::F32;  // q_bias, k_bias, mimo_v, mimo_o, d
  IoType decay = IoType::F32;  // angles, da_cs, da_cs_rev, dt, trap, segsum
  IoType cache = IoType::F32;  // states, qk_dot (the first pass's output dtype)
  IoType out = IoType::F32;    // dq, dk, dv (the other outputs are f32)
  MimoDoutKind dout = MimoDoutKind::ReduceO;
  bool d = false;              // D skip
  int64_t pad = 0;             // pad the innermost dim of every input (non-contiguous views)
  bool nan_unread = true;      // NaN where the operator must not read (as MimoBwdFwdCase)
  uint64_t seed = 1;
  std::string describe() const;
};

CaseReport run_mimo_bwd_bwd_case(const MimoBwdBwdCase& c, Device dev, int repeats = 1);

// The combined backward mamba3_mimo_bwd_combined: a case is a first-pass case (the same inputs
// and options; `out` is the dtype of dq, dk, dv and dz); all 15 gradients (those present) are
// compared with the golden mimo_bwd_combined (dangles and dmimo_z with max_rel).
using MimoCombinedCase = MimoBwdFwdCase;
CaseReport run_mimo_bwd_combined_case(const MimoCombinedCase& c, Device dev, int repeats = 1);

// SPEC.md section 4's benchmark grid, (N, P, R, C) (upstream's reference shapes; the CUDA
// backend compiles shape-specialised chunk kernels for them).
inline constexpr int64_t kReferenceShapes[11][4] = {
    {16, 64, 4, 8},   {32, 64, 4, 16},  {64, 64, 4, 16}, {128, 64, 4, 16},
    {256, 64, 4, 8},  {64, 128, 4, 16}, {128, 32, 4, 16}, {128, 128, 4, 8},
    {128, 64, 8, 8},  {128, 64, 2, 32}, {128, 64, 1, 64}};

}  // namespace mamba3::golden
