// Pairwise covering arrays for the operator test grids: every pair of values of two axes that
// can occur together appears in at least one generated case, which keeps a grid small while every
// value of every axis is exercised.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <tuple>
#include <vector>

namespace mamba3::test {

// Greedy pairwise generator (deterministic). `ok` judges a partial assignment (-1 = unset) and
// returns false only when the values already set cannot occur together.
using Assignment = std::vector<int>;
inline std::vector<Assignment> pairwise(const std::vector<int>& sizes,
                                        const std::function<bool(const Assignment&)>& ok,
                                        uint64_t seed) {
  const int na = static_cast<int>(sizes.size());
  // uncovered[(i,vi,j,vj)] for i < j, only pairs that can occur at all.
  std::map<std::tuple<int, int, int, int>, bool> uncovered;
  for (int i = 0; i < na; ++i)
    for (int j = i + 1; j < na; ++j)
      for (int vi = 0; vi < sizes[i]; ++vi)
        for (int vj = 0; vj < sizes[j]; ++vj) {
          Assignment a(na, -1);
          a[i] = vi;
          a[j] = vj;
          if (ok(a)) uncovered[{i, vi, j, vj}] = true;
        }
  auto gain = [&](const Assignment& a, int axis) {
    int g = 0;
    for (int o = 0; o < na; ++o) {
      if (o == axis || a[o] < 0) continue;
      const auto key = o < axis ? std::make_tuple(o, a[o], axis, a[axis])
                                : std::make_tuple(axis, a[axis], o, a[o]);
      g += uncovered.count(key) ? 1 : 0;
    }
    return g;
  };
  std::mt19937_64 rng(seed);
  std::vector<Assignment> out;
  while (!uncovered.empty()) {
    const auto first = uncovered.begin()->first;
    Assignment best;
    int best_cov = -1;
    for (int cand = 0; cand < 40; ++cand) {
      Assignment a(na, -1);
      a[std::get<0>(first)] = std::get<1>(first);
      a[std::get<2>(first)] = std::get<3>(first);
      std::vector<int> order;
      for (int i = 0; i < na; ++i)
        if (a[i] < 0) order.push_back(i);
      std::shuffle(order.begin(), order.end(), rng);
      bool feasible = true;
      for (int axis : order) {
        int bv = -1, bg = -1;
        const int start = static_cast<int>(rng() % sizes[axis]);
        for (int k = 0; k < sizes[axis]; ++k) {
          a[axis] = (start + k) % sizes[axis];
          if (!ok(a)) continue;
          const int g = gain(a, axis);
          if (g > bg) bg = g, bv = a[axis];
        }
        if (bv < 0) {
          feasible = false;
          break;
        }
        a[axis] = bv;
      }
      if (!feasible) continue;
      int cov = 0;
      for (int i = 0; i < na; ++i)
        for (int j = i + 1; j < na; ++j) cov += uncovered.count({i, a[i], j, a[j]}) ? 1 : 0;
      if (cov > best_cov) best_cov = cov, best = a;
    }
    if (best_cov <= 0) {
      ADD_FAILURE() << "pairwise generator stuck";
      break;
    }
    for (int i = 0; i < na; ++i)
      for (int j = i + 1; j < na; ++j) uncovered.erase({i, best[i], j, best[j]});
    out.push_back(best);
  }
  return out;
}

}  // namespace mamba3::test
