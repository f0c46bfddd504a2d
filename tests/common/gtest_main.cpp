// GoogleTest's main for the tests a dispatch build compiles once per kernel target (tests/meson.build):
// each copy's `main` is renamed pp_main_<target> and tools/dispatch/dispatch_main.cpp calls the chosen one.
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
