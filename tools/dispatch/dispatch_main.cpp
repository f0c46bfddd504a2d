// The entry point of a dispatch build (meson -Dcpu=dispatch): one x86-64 binary that runs on every CPU
// from x86-64-v2 up and uses the best kernels each one has.
//
// The program (a tool, pp_bench, a golden test) is compiled once per target of pp/core/cpu_features.hpp,
// each copy with its own -march, its namespace `pp` renamed to `pp_<target>` and its `main` renamed to
// `pp_main_<target>` (tools/dispatch/meson.build), so no inline function compiled for one target can
// stand in for another's. tools/dispatch/isolate.py moves each copy's static initializers out of
// .init_array into a section of its own (pp_init_<target>): the C runtime runs none of them, and this
// file, compiled for plain x86-64, runs only the chosen copy's before calling its main. A copy for a
// CPU without AVX-512 therefore never executes an AVX-512 instruction, not even in a constructor.
//
// Shared code outside `pp` (the C++ library's templates, nlohmann-json, CLI11, GoogleTest) is linked
// once, from the lowest target that uses it (the copies are linked lowest first): a higher target may
// call a lower target's copy, never the reverse.
//
//   PP_KERNELS=auto (or unset)   the best target this CPU runs
//   PP_KERNELS=avx2              force one (tests, comparisons); refused when this CPU cannot run it
//   PP_KERNELS=list              print the targets this CPU runs, the best last, and exit
#include <pp/core/cpu_features.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

using InitFn = void (*)();

// Each target's main and the bounds of its initializer section; weak, so a build may link fewer targets.
#define PP_DISPATCH_DECLARE(sym)                                            \
  int pp_main_##sym(int, char**) __attribute__((weak));                     \
  extern "C" InitFn __start_pp_init_##sym[] __attribute__((weak, visibility("hidden"))); \
  extern "C" InitFn __stop_pp_init_##sym[] __attribute__((weak, visibility("hidden")));
PP_DISPATCH_DECLARE(sse42)
PP_DISPATCH_DECLARE(avx2)
PP_DISPATCH_DECLARE(avx512)
PP_DISPATCH_DECLARE(avx512bf16)
#undef PP_DISPATCH_DECLARE

namespace {

struct Copy {
  pp::cpu::Target target;
  int (*main)(int, char**);
  InitFn* init_begin;
  InitFn* init_end;
};

// Indexed like pp::cpu::kTargets (lowest first).
const Copy kCopies[] = {
    {pp::cpu::Target::Sse42, pp_main_sse42, __start_pp_init_sse42, __stop_pp_init_sse42},
    {pp::cpu::Target::Avx2, pp_main_avx2, __start_pp_init_avx2, __stop_pp_init_avx2},
    {pp::cpu::Target::Avx512, pp_main_avx512, __start_pp_init_avx512, __stop_pp_init_avx512},
    {pp::cpu::Target::Avx512Bf16, pp_main_avx512bf16, __start_pp_init_avx512bf16, __stop_pp_init_avx512bf16},
};

// The targets this binary carries a copy of.
std::string linked_list() {
  return pp::cpu::target_list([](pp::cpu::Target t) {
    return std::ranges::any_of(kCopies, [t](const Copy& c) { return c.target == t && c.main != nullptr; });
  });
}

// An environment value as it may reach a terminal: printable ASCII, at most 64 bytes, '?' for the rest.
std::string printable(std::string_view v) {
  std::string s;
  for (char c : v.substr(0, 64)) s += (c >= 0x20 && c < 0x7f) ? c : '?';
  return v.size() > 64 ? s + "..." : s;
}

}  // namespace

int main(int argc, char** argv) {
  const pp::cpu::Features& f = pp::cpu::features();
  const char* env = std::getenv("PP_KERNELS");
  const std::string_view want = env ? env : "";
  const char* prog = argc > 0 && argv[0] ? argv[0] : "pp";

  if (want == "list") {
    for (const Copy& c : kCopies)
      if (c.main && pp::cpu::supports(f, c.target)) std::printf("%s\n", std::string(pp::cpu::name(c.target)).c_str());
    return 0;
  }
  const Copy* chosen = nullptr;
  if (want.empty() || want == "auto") {
    for (const Copy& c : kCopies)
      if (c.main && pp::cpu::supports(f, c.target)) chosen = &c;
    if (!chosen) {
      std::fprintf(stderr, "%s: this CPU runs none of this binary's kernel targets (%s): x86-64-v2 (SSE4.2, POPCNT) "
                   "is the least it needs\n", prog, linked_list().c_str());
      return 2;
    }
  } else {
    for (const Copy& c : kCopies)
      if (c.main && want == pp::cpu::name(c.target)) chosen = &c;
    if (!chosen) {
      std::fprintf(stderr, "%s: PP_KERNELS=%s: no such kernel target in this binary (auto, list, %s)\n", prog,
                   printable(want).c_str(), linked_list().c_str());
      return 2;
    }
    if (!pp::cpu::supports(f, chosen->target)) {
      std::fprintf(stderr, "%s: PP_KERNELS=%s: this CPU cannot run that target (it runs: %s)\n", prog,
                   std::string(pp::cpu::name(chosen->target)).c_str(), pp::cpu::supported_list(f).c_str());
      return 2;
    }
  }
  for (InitFn* fn = chosen->init_begin; fn && fn != chosen->init_end; ++fn) (*fn)();
  return chosen->main(argc, argv);
}
