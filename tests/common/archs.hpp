// Runs a test body once per SIMD architecture compiled into this binary (pp::simd::Archs).
#pragma once

#include <pp/kernels/simd.hpp>

namespace pp::test {

template <class F, class... A>
void for_each(pp::simd::ArchList<A...>, F&& f) {
  (f(A{}), ...);
}

// f(arch) for every compiled-in architecture, best first.
template <class F>
void for_each_arch(F&& f) {
  for_each(pp::simd::Archs{}, f);
}

}  // namespace pp::test
