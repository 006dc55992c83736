#include <gtest/gtest.h>

#include "loom/device.h"
#include "loom/core.h"

namespace loom {
namespace {

TEST(Tensor, ViewsShareStorage) {
  Tensor t = Tensor::zeros({4, 3});
  Tensor r = t.rows(1, 2);
  EXPECT_EQ(r.shape(), (Shape{2, 3}));
  r.data<float>()[0] = 5.f;
  EXPECT_EQ(t.data<float>()[3], 5.f);
  Tensor f = t.flat(3, 6).view({2, 3});
  EXPECT_EQ(f.data<float>()[0], 5.f);
}

TEST(Tensor, CopyConvertsDtype) {
  Tensor a = Tensor::empty({3});
  a.data<float>()[0] = 1.f;
  a.data<float>()[1] = 1.00390625f;  // halfway between two bf16 values: rounds to even
  a.data<float>()[2] = -3.f;
  Tensor b = Tensor::empty({3}, DType::bf16);
  b.copy_from(a);
  Tensor c = b.clone(Tier::host);
  Tensor d = Tensor::empty({3});
  d.copy_from(c);
  EXPECT_EQ(d.data<float>()[0], 1.f);
  EXPECT_EQ(d.data<float>()[1], 1.f);
  EXPECT_EQ(d.data<float>()[2], -3.f);
  EXPECT_EQ(c.tier(), Tier::host);
}

TEST(Tensor, AllocationIsAccountedAndFreed) {
  MemoryContext ctx;
  MemoryContext::Install install(ctx);
  {
    Tensor t = Tensor::empty({10, 10}, DType::f16, Tier::host);
    EXPECT_EQ(ctx.tier(Tier::host).used(), 200u);
    Tensor alias = t.view({100});
    t = Tensor();
    EXPECT_EQ(ctx.tier(Tier::host).used(), 200u);  // the view keeps it alive
  }
  EXPECT_EQ(ctx.tier(Tier::host).used(), 0u);
}

TEST(Tensor, FillRoundsToDtype) {
  Tensor t = Tensor::empty({2}, DType::f16);
  t.fill_(0.1f);
  ops::synchronize();  // the fill is stream work
  EXPECT_EQ(t.data<uint16_t>()[1], f32_to_f16(0.1f));
}

}  // namespace
}  // namespace loom
