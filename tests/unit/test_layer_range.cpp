// compute_layer_range: the spec's examples, the remainder on the last stage, every rejection.
#include <pp/model/layer_range.hpp>

#include <gtest/gtest.h>

namespace {

using pp::compute_layer_range;
using pp::LayerRange;

TEST(LayerRange, SpecExamples) {
  EXPECT_EQ(compute_layer_range(0, 2, 16), (LayerRange{0, 8}));
  EXPECT_EQ(compute_layer_range(1, 2, 15), (LayerRange{7, 15}));
}

TEST(LayerRange, LastStageTakesTheRemainder) {
  EXPECT_EQ(compute_layer_range(0, 3, 16), (LayerRange{0, 5}));
  EXPECT_EQ(compute_layer_range(1, 3, 16), (LayerRange{5, 10}));
  EXPECT_EQ(compute_layer_range(2, 3, 16), (LayerRange{10, 16}));
  EXPECT_EQ(compute_layer_range(3, 4, 4), (LayerRange{3, 4}));
}

TEST(LayerRange, RangesTileTheModel) {
  for (int total = 2; total <= 40; ++total)
    for (int n = 2; n <= total; ++n) {
      int next = 0;
      for (int s = 0; s < n; ++s) {
        const LayerRange r = compute_layer_range(s, n, total);
        EXPECT_EQ(r.lo, next) << s << "/" << n << " of " << total;
        EXPECT_GE(r.size(), 1);
        next = r.hi;
      }
      EXPECT_EQ(next, total);
    }
}

TEST(LayerRange, RejectsFewerThanTwoStages) {
  EXPECT_THROW(compute_layer_range(0, 1, 16), pp::Error);
  EXPECT_THROW(compute_layer_range(0, 0, 16), pp::Error);
}

TEST(LayerRange, RejectsStageOutsideRange) {
  EXPECT_THROW(compute_layer_range(-1, 2, 16), pp::Error);
  EXPECT_THROW(compute_layer_range(2, 2, 16), pp::Error);
}

TEST(LayerRange, RejectsMoreStagesThanBlocks) {
  EXPECT_THROW(compute_layer_range(0, 5, 4), pp::Error);
  try {
    compute_layer_range(0, 5, 4);
  } catch (const pp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("total_blocks 4 < num_stages 5"), std::string::npos) << e.what();
  }
}

TEST(LayerRange, Roles) {
  EXPECT_EQ(pp::stage_role(0, 3), pp::StageRole::first);
  EXPECT_EQ(pp::stage_role(1, 3), pp::StageRole::middle);
  EXPECT_EQ(pp::stage_role(2, 3), pp::StageRole::last);
  EXPECT_EQ(pp::stage_role(1, 2), pp::StageRole::last);
}

}  // namespace
