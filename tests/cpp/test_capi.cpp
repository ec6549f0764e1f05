// C API basics: version, build flags, the thread-local last-error contract, and the CPU workspace.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <thread>

#include "mamba3/mamba3.h"
#include "mamba3_golden/host.hpp"

namespace {

using mamba3::golden::Buffer;
using mamba3::golden::IoType;

// Smallest valid compute_ddt_dtrap_dinput_states call (B=1, H=2, S=5), used to provoke a success.
struct TinyDdt {
  Buffer dscale{IoType::F32, {1, 2, 5}}, dgamma{IoType::F32, {1, 2, 5}};
  Buffer dt{IoType::F32, {1, 2, 5}}, trap{IoType::F32, {1, 2, 5}};
  Buffer ddt{IoType::F32, {1, 2, 5}}, dtrap{IoType::F32, {1, 2, 5}};
  TinyDdt() {
    for (int64_t i = 0; i < 10; ++i) {
      dscale.set(i, 0.1 * i);
      dgamma.set(i, -0.05 * i);
      dt.set(i, 0.25);
      trap.set(i, 0.5 - 0.1 * i);
    }
  }
  mamba3_status call(DLTensor* ddt_override = nullptr) {
    return mamba3_compute_ddt_dtrap_dinput_states(
        dscale.tensor(), dgamma.tensor(), dt.tensor(), trap.tensor(), nullptr, nullptr, nullptr,
        nullptr, ddt_override ? ddt_override : ddt.tensor(), dtrap.tensor(), nullptr, nullptr,
        nullptr, nullptr);
  }
};

TEST(CApi, VersionIsNonEmptyDottedString) {
  const char* v = mamba3_version();
  ASSERT_NE(v, nullptr);
  const std::string s(v);
  EXPECT_FALSE(s.empty());
  EXPECT_NE(s.find('.'), std::string::npos) << s;
}

TEST(CApi, HasCudaMatchesTheBuild) {
#ifdef MAMBA3_WITH_CUDA
  EXPECT_EQ(mamba3_has_cuda(), 1);
#else
  EXPECT_EQ(mamba3_has_cuda(), 0);
#endif
}

TEST(CApi, LastErrorIsSetOnFailureAndClearedOnSuccess) {
  TinyDdt t;
  // A failure: ddt must be float32.
  Buffer bad(IoType::F16, {1, 2, 5});
  ASSERT_EQ(t.call(bad.tensor()), MAMBA3_ERROR_INVALID_ARGUMENT);
  const std::string msg = mamba3_last_error();
  EXPECT_NE(msg.find("ddt"), std::string::npos) << msg;

  ASSERT_EQ(t.call(), MAMBA3_OK) << mamba3_last_error();
  EXPECT_STREQ(mamba3_last_error(), "");
}

TEST(CApi, LastErrorIsPerThread) {
  TinyDdt t;
  Buffer bad(IoType::F16, {1, 2, 5});
  ASSERT_EQ(t.call(bad.tensor()), MAMBA3_ERROR_INVALID_ARGUMENT);
  std::string other_thread_error = "unset";
  std::thread th([&] { other_thread_error = mamba3_last_error(); });
  th.join();
  EXPECT_EQ(other_thread_error, "");
  EXPECT_NE(std::string(mamba3_last_error()), "");  // still set on this thread
}

TEST(CApi, CpuWorkspaceIsZero) {
  Buffer q(IoType::BF16, {2, 33, 1, 64}), scale(IoType::F32, {2, 4, 33});
  for (int64_t chunk : {16, 32, 64, 128, 256}) {
    size_t ws = 12345;
    ASSERT_EQ(mamba3_compute_dqktheta_workspace_size(q.tensor(), scale.tensor(), chunk, nullptr, &ws),
              MAMBA3_OK)
        << mamba3_last_error();
    EXPECT_EQ(ws, 0u) << "chunk " << chunk;
    EXPECT_STREQ(mamba3_last_error(), "");
  }
  // Also in varlen mode.
  Buffer q1(IoType::F32, {1, 40, 2, 32}), scale1(IoType::F32, {1, 2, 40});
  Buffer cu = Buffer::from_double(IoType::I32, {3}, {0, 7, 40});
  size_t ws = 777;
  ASSERT_EQ(mamba3_compute_dqktheta_workspace_size(q1.tensor(), scale1.tensor(), 64, cu.tensor(), &ws),
            MAMBA3_OK)
      << mamba3_last_error();
  EXPECT_EQ(ws, 0u);
}

TEST(CApi, WorkspaceSizeRejectsBadArguments) {
  Buffer q(IoType::F32, {1, 8, 1, 16}), scale(IoType::F32, {1, 1, 8});
  size_t ws = 0;
  EXPECT_EQ(mamba3_compute_dqktheta_workspace_size(q.tensor(), scale.tensor(), 48, nullptr, &ws),
            MAMBA3_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mamba3_last_error()).find("chunk_size"), std::string::npos)
      << mamba3_last_error();
  EXPECT_EQ(mamba3_compute_dqktheta_workspace_size(q.tensor(), scale.tensor(), 64, nullptr, nullptr),
            MAMBA3_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mamba3_last_error()).find("workspace_bytes"), std::string::npos)
      << mamba3_last_error();
  EXPECT_EQ(mamba3_compute_dqktheta_workspace_size(nullptr, scale.tensor(), 64, nullptr, &ws),
            MAMBA3_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mamba3_last_error()).find("q"), std::string::npos) << mamba3_last_error();
}

TEST(CApi, SuccessfulDqkthetaCallClearsError) {
  // B=1, S=3, G=1, H=1, N=4, A=2 with zero inputs: every output is exactly zero.
  Buffer q(IoType::F32, {1, 3, 1, 4}), k(IoType::F32, {1, 3, 1, 4});
  Buffer scale(IoType::F32, {1, 1, 3}), gamma(IoType::F32, {1, 1, 3}), dqk(IoType::F32, {1, 1, 3});
  Buffer qb(IoType::F32, {1, 4}), kb(IoType::F32, {1, 4}), ang(IoType::F32, {1, 3, 1, 2});
  Buffer dqi(IoType::F32, {1, 3, 1, 4}), dki(IoType::F32, {1, 3, 1, 4});
  for (Buffer* b : {&q, &k, &scale, &gamma, &dqk, &qb, &kb, &ang, &dqi, &dki})
    for (int64_t i = 0; i < b->numel(); ++i) b->set(i, 0.0);
  Buffer dq(IoType::F32, {1, 3, 1, 4}), dk(IoType::F32, {1, 3, 1, 4});
  Buffer dqb(IoType::F32, {1, 4}), dkb(IoType::F32, {1, 4}), dang(IoType::F32, {1, 3, 1, 2});
  Buffer dsc(IoType::F32, {1, 1, 3}), dga(IoType::F32, {1, 1, 3});

  Buffer bad(IoType::F32, {1, 3, 1, 5});  // wrong N for dq: provoke an error first
  ASSERT_EQ(mamba3_compute_dqktheta(q.tensor(), k.tensor(), scale.tensor(), gamma.tensor(),
                                    qb.tensor(), kb.tensor(), ang.tensor(), dqi.tensor(),
                                    dki.tensor(), dqk.tensor(), nullptr, 64, nullptr, bad.tensor(),
                                    dk.tensor(), dqb.tensor(), dkb.tensor(), dang.tensor(),
                                    dsc.tensor(), dga.tensor(), nullptr, 0, nullptr),
            MAMBA3_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mamba3_last_error()).find("dq"), std::string::npos);

  ASSERT_EQ(mamba3_compute_dqktheta(q.tensor(), k.tensor(), scale.tensor(), gamma.tensor(),
                                    qb.tensor(), kb.tensor(), ang.tensor(), dqi.tensor(),
                                    dki.tensor(), dqk.tensor(), nullptr, 64, nullptr, dq.tensor(),
                                    dk.tensor(), dqb.tensor(), dkb.tensor(), dang.tensor(),
                                    dsc.tensor(), dga.tensor(), nullptr, 0, nullptr),
            MAMBA3_OK)
      << mamba3_last_error();
  EXPECT_STREQ(mamba3_last_error(), "");
  for (Buffer* b : {&dq, &dk, &dqb, &dkb, &dang, &dsc, &dga})
    for (int64_t i = 0; i < b->numel(); ++i) EXPECT_EQ(b->get(i), 0.0);
}

}  // namespace
