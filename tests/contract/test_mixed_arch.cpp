// A mixed pipeline (issue 20): this machine's pp_node as coordinator, an aarch64 pp_node as the worker of
// the last stage under qemu user emulation, over loopback. The coordinator's plan names the worker's
// kernels and says byte-identity is not expected (the two ends' numeric profiles differ: x86 and NEON sum
// in different orders), its probe reports the difference as expected, and the greedy tokens of
// golden-tiny (wide margins) still equal the single-process run's.
//
// Needs PP_ARM_NODE_BIN (an aarch64 pp_node, e.g. build-arm/tools/pp_node from scripts/test_arm.sh) and
// qemu-aarch64-static; skipped without them.
#include "../common/fixtures.hpp"
#include "../common/node_process.hpp"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <regex>

namespace {

using namespace std::chrono_literals;

std::string golden(const std::string& dt) {
  return (pp::test::data_dir() / "golden-tiny" / ("golden-tiny-" + dt + ".gguf")).string();
}

std::string tokens_of(const std::string& out) {
  std::smatch m;
  return std::regex_search(out, m, std::regex("\n  tokens:([ 0-9]*)\n")) ? std::string(m[1]) : "<none>";
}

TEST(MixedArch, X86CoordinatorWithAnAarch64WorkerGivesTheSingleProcessTokens) {
  const char* arm = std::getenv("PP_ARM_NODE_BIN");
  if (!arm || !*arm) GTEST_SKIP() << "PP_ARM_NODE_BIN (an aarch64 pp_node) not set: scripts/test_arm.sh sets it";
  const std::string qemu = "/usr/bin/qemu-aarch64-static";
  if (::access(qemu.c_str(), X_OK) != 0) GTEST_SKIP() << "qemu-aarch64-static not installed";
  const std::string model = golden("bf16");

  // Emulation is 10-50x slower than native: the start-up guard is generous (and scaled like every guard).
  auto w = pp::test::start_listening({qemu, arm, "--worker", "--model", model, "--host", "127.0.0.1", "--port", "0",
                                      "--threads", "2"},
                                     300s, "listening on 127\\.0\\.0\\.1:(\\d+)  \\(Ctrl-C to stop\\)");
  ASSERT_TRUE(w);
  const std::vector<std::string> prompt = {"--prompt-ids", "496,198,303,365,321,74,280", "--ignore-eos"};
  auto coord = pp::test::node_argv({"--coordinator", w->addr(), "--model", model, "--cuts", "1", "--tokens", "12",
                                    "--threads", "1"});
  coord.insert(coord.end(), prompt.begin(), prompt.end());
  const auto r = pp::test::run_checked(coord, 600s);
  // The plan names the far end's kernels and the difference; the bring-up probe (the first 4 tokens' hidden
  // states against this process) then finds them different and says it was expected: status 1, as for
  // every failed byte-identity check (docs/CLI.md), with the tokens all generated.
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("numeric profiles differ (coordinator "), std::string::npos) << r.out;
  EXPECT_TRUE(std::regex_search(
      r.out, std::regex("byte-identity: [0-9]/4 identical  FAIL \\([0-9]\\)  \\(numeric profiles differ: identity "
                        "was not expected\\)")))
      << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("stage 1 [^\n]*arm64\\+neon"))) << r.out;  // xsimd neon64::name()

  const char* gen = std::getenv("PP_GENERATE_BIN");
  ASSERT_TRUE(gen && *gen) << "PP_GENERATE_BIN not set";
  std::vector<std::string> g = {gen, "-m", model, "-n", "12", "-t", "1", "--ids"};
  g.insert(g.end(), prompt.begin(), prompt.end());
  const auto single = pp::test::run_checked(g, 120s);
  ASSERT_EQ(single.code, 0) << single.err;
  EXPECT_EQ(tokens_of(r.out), tokens_of("\n  tokens: " + single.out)) << r.out << single.out;
}

}  // namespace
