// Token-list helpers shared by the GoogleTest suites.
#pragma once

#include <cstdint>
#include <vector>

namespace atom_sched::test {

using V = std::vector<int32_t>;

/// start, start+1, ..., start+n-1
inline V Seq(int32_t start, int32_t n) {
  V v(n);
  for (int32_t i = 0; i < n; ++i) v[i] = start + i;
  return v;
}

/// a followed by b
inline V Cat(V a, const V& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace atom_sched::test
