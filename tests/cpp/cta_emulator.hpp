// Host emulation of CUDA thread blocks for kernel bodies written against the primitives of
// src/cuda/bf16_split_mma.cuh (mb_tid / mb_bid / mb_sync and the warp-collective ldsm4 /
// ldsm4t / mma16816 / mb_shfl_xor), so that they run on machines without a GPU.
//
// A CTA of n threads is n std::threads: mb_sync is a barrier of all n; every warp (threads
// 32 w .. 32 w + 31) has its own rendezvous for the collective instructions: each lane deposits
// its operands (a row address, or its fragments), all 32 wait, each lane computes its own result
// from all the deposits. The deposit slots are double-buffered (one rendezvous per instruction:
// a lane can refill a slot only after the whole warp has passed the next rendezvous, i.e. after
// every lane has finished reading it). launch() runs the CTAs of a grid one after another with
// the same threads. Fragment layouts: see cta_emulator.cpp.
//
// The primitives are defined once for the test program, in cta_emulator.cpp (CUDA builds only:
// they use the CUDA headers' bf16 type).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace mamba3::test::emu {

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    const int64_t gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_, count_ = 0;
  int64_t gen_ = 0;
};

// One warp's rendezvous and its lanes' deposits (two slots, alternating per instruction).
struct Warp {
  Barrier bar{32};
  const void* ptr[2][32];
  uint32_t a[2][32][4], b[2][32][2];
  int seq[32] = {};  // collective instructions issued, per lane (all lanes issue the same ones)
};

// One emulated CTA: the block barrier and the warps.
struct Cta {
  explicit Cta(int n) : nthreads(n), bar(n), warps(new Warp[(n + 31) / 32]) {}
  int nthreads;
  Barrier bar;
  std::unique_ptr<Warp[]> warps;
};

// The running launch and the calling thread's indices (defined in cta_emulator.cpp).
extern Cta* g_cta;
extern thread_local int t_tid;
extern thread_local int64_t t_bid;

// The calling lane's warp and the deposit slot of its next collective instruction (for
// collectives defined outside cta_emulator.cpp, e.g. the float64 mma of mimo_norm_dd_f64.cuh).
Warp& collective_warp(int& slot);

// Runs body() on every thread of `grid` CTAs of `nthreads` threads, one CTA after another.
// before(blk), when given, runs on thread 0 before CTA blk starts (e.g. to poison its shared
// memory); the other threads wait for it.
template <class F>
void launch(int64_t grid, int nthreads, F body,
            const std::function<void(int64_t)>& before = nullptr) {
  Cta cta(nthreads);
  g_cta = &cta;
  std::vector<std::thread> threads;
  threads.reserve(nthreads);
  for (int t = 0; t < nthreads; ++t)
    threads.emplace_back([&, t] {
      t_tid = t;
      for (int64_t blk = 0; blk < grid; ++blk) {
        t_bid = blk;
        if (before) {
          if (t == 0) before(blk);
          cta.bar.wait();
        }
        body();
        cta.bar.wait();  // the next CTA starts when every thread of this one is done
      }
    });
  for (std::thread& th : threads) th.join();
  g_cta = nullptr;
}

}  // namespace mamba3::test::emu
