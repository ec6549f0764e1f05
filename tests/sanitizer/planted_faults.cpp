// Probes for scripts/emulated_sanitizers.sh: one planted fault each, so that the script can show
// its sanitizers do report what they are run for (a check that cannot fail checks nothing).
//   -DPLANT_RACE: the CTA emulator's threads read a neighbour's shared-memory word with the
//                 mb_sync between the write and the read left out (ThreadSanitizer: data race);
//                 with -DWITH_SYNC the same program is clean.
//   -DPLANT_OOB:  a thread reads one element past the end of a heap buffer (AddressSanitizer).
#include <cstdio>
#include <vector>

#include "cta_emulator.hpp"
#include "cuda/bf16_split_mma.cuh"  // mb_tid, mb_sync

int main() {
  using mamba3::cuda::mimo::mb_tid;
  std::vector<float> sm(128, 0.f);  // stands for a CTA's shared memory
  float sink = 0.f;
  mamba3::test::emu::launch(2, 64, [&] {
    const int t = mb_tid();
    sm[t] = static_cast<float>(t);
#if defined(WITH_SYNC)
    mamba3::cuda::mimo::mb_sync();
#endif
#if defined(PLANT_RACE) || defined(WITH_SYNC)
    sm[64 + t] = sm[(t + 1) % 64];  // a neighbour's word: needs the barrier above
#endif
#if defined(PLANT_OOB)
    if (t == 0) sink += sm.data()[sm.size()];  // one past the end
#endif
  });
  std::printf("%f %f\n", sm[70], sink);
  return 0;
}
