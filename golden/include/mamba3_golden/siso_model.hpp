// Golden SISO Mamba-3 model (SPEC.md section 1), templated on the scalar type: the sequential
// recurrence with optional input states and returned final states, and the chunked form. Both
// rotation conventions are available (SISO interleaved pairs; MIMO half pairs).
#pragma once

#include <cstdint>
#include <vector>

namespace mamba3::golden {

enum class Rotation { Interleaved, HalfSplit };

// Rotate x[0..N) in place by the angles theta[0..npairs): pair (2i,2i+1) for Interleaved, pair
// (i, N/2+i) for HalfSplit; other dims untouched.
template <class T>
void rotate(T* x, int64_t N, const T* theta, int64_t npairs, Rotation conv, bool inverse = false);

template <class T>
struct SisoInputs {
  int64_t B = 0, S = 0, H = 0, G = 0, N = 0, P = 0, A = 0;
  Rotation rotation = Rotation::Interleaved;
  std::vector<T> q, k;            // [B,S,G,N]
  std::vector<T> v;               // [B,S,H,P]
  std::vector<T> adt, dt, trap;   // [B,H,S]   (adt = A*dt <= 0; trap pre-sigmoid)
  std::vector<T> q_bias, k_bias;  // [H,N]
  std::vector<T> angles;          // [B,S,H,A] raw angle inputs (tanh applied, then cumsum * pi * dt)
  std::vector<T> D;               // [H] or empty
  std::vector<T> z;               // [B,S,H,P] or empty
  // input states (all empty, or all given): ssm [B,H,P,N], k [B,H,N], v [B,H,P], angle [B,H,A]
  std::vector<T> ssm_state0, k_state0, v_state0, angle_state0;
};

template <class T>
struct SisoOutputs {
  std::vector<T> out;        // [B,S,H,P]
  std::vector<T> ssm_state;  // [B,H,P,N] final state
  std::vector<T> k_state;    // [B,H,N]   final rot(k_last+kb) (rotated, unscaled)
  std::vector<T> v_state;    // [B,H,P]   final v
  std::vector<T> angle_state;// [B,H,A]   final accumulated angles
};

// Sequential recurrence, one step at a time (the definition).
template <class T>
SisoOutputs<T> siso_sequential(const SisoInputs<T>& in);
// Chunked form with chunk size C (what the kernels compute); must agree with siso_sequential.
template <class T>
SisoOutputs<T> siso_chunked(const SisoInputs<T>& in, int64_t C);

}  // namespace mamba3::golden
