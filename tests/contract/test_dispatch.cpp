// A dispatch build's binaries (meson -Dcpu=dispatch, tools/dispatch/): PP_KERNELS lists, forces and refuses
// kernel targets, the automatic choice is the best target this CPU runs, and on emulated CPUs without
// AVX-512 or AVX2 (qemu-x86_64, when installed) the binary picks the copy that CPU can run and computes
// exactly what that copy computes here: no instruction of a higher target runs anywhere, not even in a
// static initializer. The golden suites themselves run on every target (tests/meson.build, golden_*_<target>).
#include <pp/core/cpu_features.hpp>

#include "../common/fixtures.hpp"
#include "../common/node_process.hpp"

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <tuple>

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

std::string generate_bin() { return pp::test::tool_path("pp_generate"); }
std::string tiny(const std::string& dt) {
  return (pp::test::data_dir() / "golden-tiny" / ("golden-tiny-" + dt + ".gguf")).string();
}

// `bin args...` with PP_KERNELS=kernels ("" leaves it unset), through `wrapper` (e.g. qemu) when given.
pp::test::RunResult run(const std::string& kernels, std::vector<std::string> args, std::vector<std::string> wrapper = {},
                        pp::test::Millis timeout = 120s) {
  std::vector<std::string> argv = {"/usr/bin/env", "-u", "PP_KERNELS"};
  if (!kernels.empty()) argv.push_back("PP_KERNELS=" + kernels);
  argv.insert(argv.end(), wrapper.begin(), wrapper.end());
  argv.insert(argv.end(), args.begin(), args.end());
  return pp::test::run_checked(argv, timeout);
}

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> v;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) v.push_back(l);
  return v;
}

std::string targets_of_this_cpu() { return pp::cpu::supported_list(pp::cpu::features()); }

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : " ") + x;
  return s;
}

TEST(Dispatch, ListsForcesAndRefusesTargets) {
  const auto list = run("list", {generate_bin()});
  ASSERT_EQ(list.code, 0) << list.err;
  EXPECT_EQ(joined(lines(list.out)), targets_of_this_cpu());
  const std::string best = lines(list.out).back();

  const auto automatic = run("", {generate_bin(), "--version"});
  ASSERT_EQ(automatic.code, 0) << automatic.err;
  EXPECT_NE(automatic.out.find("(dispatch target " + best + ";"), std::string::npos) << automatic.out;
  for (const std::string& t : lines(list.out)) {
    const auto forced = run(t, {generate_bin(), "--version"});
    ASSERT_EQ(forced.code, 0) << t << ": " << forced.err;
    EXPECT_NE(forced.out.find("(dispatch target " + t + ";"), std::string::npos) << forced.out;
  }
  // A name that is no target: exit 2, the value and the choices named; nothing of the tool runs.
  const auto bogus = run("avx1024\x1b[2J", {generate_bin(), "--version"});
  EXPECT_EQ(bogus.code, 2);
  EXPECT_NE(bogus.err.find("PP_KERNELS=avx1024?[2J:"), std::string::npos) << bogus.err;
  EXPECT_EQ(bogus.err.find('\x1b'), std::string::npos) << "a terminal escape from the environment reached stderr";
  EXPECT_NE(bogus.err.find("sse4.2 avx2 avx512 avx512bf16"), std::string::npos) << bogus.err;
  EXPECT_EQ(bogus.out, "");
}

// The same prompt through pp_generate forced to each target: every target's greedy tokens are the golden
// ones (the golden suites check the logits' tolerance; here the binary as users run it).
TEST(Dispatch, EveryTargetGeneratesTheGoldenTokens) {
  const auto ref = pp::test::load_json(pp::test::data_dir() / "golden-tiny" / "golden-tiny-f32.p7.exact.json");
  const auto out = fs::temp_directory_path() / ("pp_dispatch_" + std::to_string(getpid()) + ".json");
  for (const std::string& t : lines(run("list", {generate_bin()}).out)) {
    const auto r = run(t, {generate_bin(), "-m", tiny("f32"), "--prompt-ids", "496,198,303,365,321,74,280", "-n", "16",
                           "--ignore-eos", "--logits-out", out.string()});
    ASSERT_EQ(r.code, 0) << t << ": " << r.err;
    EXPECT_EQ(pp::test::load_json(out)["greedy"], ref["greedy"]) << t;
  }
  fs::remove(out);
}

std::string qemu_x86() {
  for (const char* p : {"/usr/bin/qemu-x86_64-static", "/usr/bin/qemu-x86_64"})
    if (::access(p, X_OK) == 0) return p;
  return "";
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Emulated CPUs: Nehalem (x86-64-v2, no AVX) must get the sse4.2 copy, Haswell (AVX2, no AVX-512) the avx2
// copy, each refusing a forced higher target, and computing bit for bit what that copy computes natively.
TEST(Dispatch, EmulatedOlderCpusRunTheirOwnCopy) {
  const std::string qemu = qemu_x86();
  if (qemu.empty()) GTEST_SKIP() << "qemu-x86_64 not installed (Debian: qemu-user-static)";
  const auto native_list = lines(run("list", {generate_bin()}).out);
  const fs::path dir = fs::temp_directory_path() / ("pp_dispatch_q" + std::to_string(getpid()));
  fs::create_directories(dir);
  for (const auto& [model, want, higher] : {std::tuple<std::string, std::string, std::string>{"Nehalem", "sse4.2", "avx2"},
                                            {"Haswell", "avx2", "avx512"}}) {
    SCOPED_TRACE(model);
    if (std::find(native_list.begin(), native_list.end(), want) == native_list.end())
      GTEST_SKIP() << "this CPU cannot run the " << want << " copy natively to compare with";
    const std::vector<std::string> wrap = {qemu, "-cpu", model};
    const auto list = run("list", {generate_bin()}, wrap);
    ASSERT_EQ(list.code, 0) << list.err;
    ASSERT_FALSE(lines(list.out).empty());
    EXPECT_EQ(lines(list.out).back(), want) << list.out;
    const auto refused = run(higher, {generate_bin(), "--version"}, wrap);
    EXPECT_EQ(refused.code, 2);
    EXPECT_NE(refused.err.find("this CPU cannot run that target"), std::string::npos) << refused.err;

    const std::vector<std::string> args = {generate_bin(), "-m", tiny("bf16"), "--prompt-ids", "496,198,303", "-n", "4",
                                           "--ignore-eos", "--logits-out"};
    auto emulated = args, native = args;
    emulated.push_back((dir / "emulated.json").string());
    native.push_back((dir / "native.json").string());
    const auto e = run("", emulated, wrap, 600s);  // the automatic choice, emulated
    ASSERT_EQ(e.code, 0) << e.err;
    const auto n = run(want, native);
    ASSERT_EQ(n.code, 0) << n.err;
    EXPECT_EQ(read_bytes(dir / "emulated.json"), read_bytes(dir / "native.json")) << "logits differ";
  }
  fs::remove_all(dir);
}

}  // namespace
