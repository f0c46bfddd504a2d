// What this CPU can run, read once from CPUID and XGETBV (x86-64) or the kernel's hwcaps (AArch64), and
// the x86-64 kernel targets a dispatch build compiles (meson -Dcpu=dispatch, tools/dispatch/):
//
//   target       -march                                   CPUs
//   sse4.2       x86-64-v2                                every x86-64 from 2009 (Nehalem, Bulldozer)
//   avx2         x86-64-v3                                Haswell+, Zen 1-3, Intel client chips
//   avx512       x86-64-v4                                Skylake-X, Cascade Lake, Ice Lake, Tiger Lake
//   avx512bf16   x86-64-v4 + VNNI, BF16, AMX (runtime)    Cooper Lake, Sapphire Rapids+, Zen 4, Zen 5
//
// A build for one CPU run on a lesser one (an armv8.6-a build on a Raspberry Pi 5) would die of SIGILL
// at its first kernel: missing_for_build() names what the build uses and the CPU lacks, and the tools
// ask it first thing in main, so they say so instead (exit 2). That works where nothing before main
// uses the missing instructions: on AArch64, whose compilers do not put sdot / bfdot into library
// code; an x86-64 -march=native build may already use AVX-512 in static initializers (CLI11's
// validators, under qemu-x86_64 -cpu Haswell), which is what the dispatch build (the default) is for.
//
// A target is usable when the CPU has every instruction set its -march enables *and* the OS saves the
// register state they use (XCR0: YMM for AVX, opmask and ZMM for AVX-512). AMX needs no target of its
// own: the avx512bf16 target asks the kernel for the tile state at run time (kernels/amx.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#if defined(__x86_64__)
#include <cpuid.h>
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

namespace pp::cpu {

struct Features {
  // x86-64-v2
  bool sse42 = false, popcnt = false, cx16 = false;
  // x86-64-v3 (with the OS saving YMM state)
  bool avx = false, avx2 = false, fma = false, f16c = false, bmi1 = false, bmi2 = false, lzcnt = false,
       movbe = false;
  // x86-64-v4 (with the OS saving opmask and ZMM state)
  bool avx512f = false, avx512bw = false, avx512cd = false, avx512dq = false, avx512vl = false;
  bool avx512vnni = false, avx512bf16 = false, amx_tile = false, amx_bf16 = false;
  // AArch64
  bool neon = false, dotprod = false, bf16 = false;
  // Vendor and display family (CPUID leaf 1, base + extended family), for per-CPU tuning
  bool amd = false;
  unsigned family = 0;
};

namespace detail {

#if defined(__x86_64__)
inline void cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
  r[0] = r[1] = r[2] = r[3] = 0;
  __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
}
inline uint64_t xgetbv0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}
inline bool bit(unsigned v, int i) { return (v >> i) & 1u; }
#endif

inline Features detect() {
  Features f;
#if defined(__x86_64__)
  unsigned r[4];
  cpuid(0, 0, r);
  const unsigned max_leaf = r[0];
  cpuid(0x80000000u, 0, r);
  const unsigned max_ext = r[0];
  unsigned l1[4] = {}, l7[4] = {}, l71[4] = {}, e1[4] = {};
  cpuid(1, 0, l1);
  if (max_leaf >= 7) {
    cpuid(7, 0, l7);
    if (l7[0] >= 1) cpuid(7, 1, l71);
  }
  if (max_ext >= 0x80000001u) cpuid(0x80000001u, 0, e1);
  const unsigned ecx1 = l1[2], ebx7 = l7[1], ecx7 = l7[2], edx7 = l7[3], eax71 = l71[0];
  f.sse42 = bit(ecx1, 20) && bit(ecx1, 19) && bit(ecx1, 9) && bit(ecx1, 0);  // + SSE4.1, SSSE3, SSE3
  f.popcnt = bit(ecx1, 23);
  f.cx16 = bit(ecx1, 13);
  const bool osxsave = bit(ecx1, 27);
  const uint64_t xcr0 = osxsave ? xgetbv0() : 0;
  const bool ymm = (xcr0 & 0x6) == 0x6;     // SSE and AVX state
  const bool zmm = (xcr0 & 0xe6) == 0xe6;   // + opmask, ZMM_Hi256, Hi16_ZMM
  f.avx = ymm && bit(ecx1, 28);
  f.fma = f.avx && bit(ecx1, 12);
  f.f16c = f.avx && bit(ecx1, 29);
  f.movbe = bit(ecx1, 22);
  f.avx2 = f.avx && bit(ebx7, 5);
  f.bmi1 = bit(ebx7, 3);
  f.bmi2 = bit(ebx7, 8);
  f.lzcnt = bit(e1[2], 5);
  f.avx512f = zmm && bit(ebx7, 16);
  f.avx512dq = f.avx512f && bit(ebx7, 17);
  f.avx512cd = f.avx512f && bit(ebx7, 28);
  f.avx512bw = f.avx512f && bit(ebx7, 30);
  f.avx512vl = f.avx512f && bit(ebx7, 31);
  f.avx512vnni = f.avx512f && bit(ecx7, 11);
  f.avx512bf16 = f.avx512f && bit(eax71, 5);
  f.amx_bf16 = bit(edx7, 22);
  f.amx_tile = bit(edx7, 24);
  cpuid(0, 0, r);
  f.amd = r[1] == 0x68747541u && r[3] == 0x69746e65u && r[2] == 0x444d4163u;  // "AuthenticAMD"
  const unsigned base_family = (l1[0] >> 8) & 0xf;
  f.family = base_family == 0xf ? base_family + ((l1[0] >> 20) & 0xff) : base_family;
#elif defined(__aarch64__)
  f.neon = true;  // Advanced SIMD is part of the base AArch64 ISA
#if defined(__linux__)
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  f.dotprod = (hw >> 20) & 1;  // HWCAP_ASIMDDP
  f.bf16 = (hw2 >> 14) & 1;    // HWCAP2_BF16
#endif
#endif
  return f;
}

}  // namespace detail

// This CPU, detected once.
inline const Features& features() {
  static const Features f = detail::detect();
  return f;
}

// How far ahead of the read the weight-streaming kernels prefetch (simd::prefetch_ahead), in bytes; 0 = no
// software prefetch. Measured in pp_bench decode (docs/PERFORMANCE.md, "Prefetch distance by CPU"): on Zen 4
// (AMD family 0x19 with AVX-512) prefetching a page ahead cost BF16 decode 10-15% and Q4_K_M at 2 threads
// ~15% against none; on Zen 5 a page ahead beat half a page by 6-12% for every weight type, and the Intel
// hosts measured before gained ~15% of a core's read stream from it. `env` (PP_PREFETCH_BYTES) overrides:
// a multiple of 64 up to 65536; anything else is ignored and the default kept.
inline std::size_t prefetch_bytes(const Features& f, const char* env) {
  if (env && *env) {
    char* end = nullptr;
    const unsigned long v = std::strtoul(env, &end, 10);
    if (*end == '\0' && env[0] >= '0' && env[0] <= '9' && v <= 65536 && v % 64 == 0) return v;
  }
  const bool zen4 = f.amd && f.family == 0x19 && f.avx512f;
  return zen4 ? 0 : 4096;
}

// This CPU's prefetch distance (PP_PREFETCH_BYTES as read at start-up), detected once.
inline std::size_t prefetch_bytes() {
  static const std::size_t b = prefetch_bytes(features(), std::getenv("PP_PREFETCH_BYTES"));
  return b;
}

// The x86-64 kernel targets of a dispatch build, the lowest first.
enum class Target { Sse42, Avx2, Avx512, Avx512Bf16 };
inline constexpr Target kTargets[] = {Target::Sse42, Target::Avx2, Target::Avx512, Target::Avx512Bf16};

inline constexpr std::string_view name(Target t) {
  switch (t) {
    case Target::Sse42: return "sse4.2";
    case Target::Avx2: return "avx2";
    case Target::Avx512: return "avx512";
    case Target::Avx512Bf16: return "avx512bf16";
  }
  return "?";
}

// Whether `f` runs every instruction the target's -march lets the compiler emit.
inline bool supports(const Features& f, Target t) {
  const bool v2 = f.sse42 && f.popcnt && f.cx16;
  const bool v3 = v2 && f.avx2 && f.fma && f.f16c && f.bmi1 && f.bmi2 && f.lzcnt && f.movbe;
  const bool v4 = v3 && f.avx512f && f.avx512bw && f.avx512cd && f.avx512dq && f.avx512vl;
  switch (t) {
    case Target::Sse42: return v2;
    case Target::Avx2: return v3;
    case Target::Avx512: return v4;
    case Target::Avx512Bf16: return v4 && f.avx512vnni && f.avx512bf16;
  }
  return false;
}

// "sse4.2 avx2 avx512": the names of the targets `keep(t)` accepts, the lowest first.
template <class Keep>
std::string target_list(Keep keep) {
  std::string s;
  for (Target t : kTargets)
    if (keep(t)) {
      if (!s.empty()) s += ' ';
      s += name(t);
    }
  return s;
}

// The targets `f` can run.
inline std::string supported_list(const Features& f) {
  return target_list([&f](Target t) { return supports(f, t); });
}

// The instruction sets the including code was compiled to use (its -march, as the compiler's feature
// macros tell) that `f` lacks, comma-separated; "" when `f` runs them all. AMX is not among them: it is
// enabled at run time only where present (kernels/amx.hpp).
inline std::string missing_for_build([[maybe_unused]] const Features& f) {
  std::string m;
  [[maybe_unused]] auto need = [&m](bool have, const char* what) {
    if (have) return;
    if (!m.empty()) m += ", ";
    m += what;
  };
#if defined(__SSE4_2__)
  need(f.sse42, "SSE4.2");
#endif
#if defined(__AVX2__)
  need(f.avx2, "AVX2");
#endif
#if defined(__FMA__)
  need(f.fma, "FMA");
#endif
#if defined(__F16C__)
  need(f.f16c, "F16C");
#endif
#if defined(__AVX512F__)
  need(f.avx512f, "AVX-512F");
#endif
#if defined(__AVX512BW__)
  need(f.avx512bw, "AVX-512BW");
#endif
#if defined(__AVX512VNNI__)
  need(f.avx512vnni, "AVX-512 VNNI");
#endif
#if defined(__AVX512BF16__)
  need(f.avx512bf16, "AVX-512 BF16");
#endif
#if defined(__ARM_FEATURE_DOTPROD)
  need(f.dotprod, "the dot-product extension (sdot; -march=armv8.2-a+dotprod)");
#endif
#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
  need(f.bf16, "BF16 (bfdot; -march=armv8.6-a or +bf16)");
#endif
  return m;
}

}  // namespace pp::cpu
