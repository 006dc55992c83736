// Streams, events and the dispatch point, in both CPU stream modes.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "loom/comm.h"
#include "loom/device.h"
#include "test_util.h"

namespace loom {
namespace {

using namespace std::chrono_literals;

using testing::with_cpu_stream_mode;

class StreamModes : public ::testing::TestWithParam<CpuStreamMode> {};

TEST_P(StreamModes, WorkRunsInEnqueueOrderAndEventsMarkIt) {
  with_cpu_stream_mode(GetParam(), [] {
    const Stream s = current_stream();
    std::vector<int> order;
    for (int i = 0; i < 50; ++i) s.enqueue([&order, i] { order.push_back(i); });
    const Event e = Event::record(s);
    e.synchronize();
    EXPECT_TRUE(e.query());
    ASSERT_EQ(order.size(), 50u);
    for (int i = 0; i < 50; ++i) EXPECT_EQ(order[static_cast<size_t>(i)], i);
  });
}

TEST_P(StreamModes, KernelsThroughTheDispatchMatchTheCpuKernels) {
  with_cpu_stream_mode(GetParam(), [] {
    const int64_t N = 64, C = 48, OC = 40;
    Tensor x = Tensor::empty({N, C}), w = Tensor::empty({OC, C}), b = Tensor::empty({OC});
    {
      const HostSection host;
      fill_normal(x.data<float>(), x.numel(), 1, 0, 0.0f, 1.0f);
      fill_normal(w.data<float>(), w.numel(), 2, 0, 0.0f, 0.1f);
      fill_normal(b.data<float>(), b.numel(), 3, 0, 0.0f, 0.1f);
    }
    Tensor y = Tensor::empty({N, OC});
    ops::linear_forward(y.data<float>(), x.data<float>(), w.data<float>(), b.data<float>(), N, C, OC);
    ops::gelu_forward(y.data<float>(), y.data<float>(), y.numel());
    const Tensor got = y.clone(Tier::host);

    std::vector<float> want(static_cast<size_t>(N * OC));
    ops::synchronize();
    cpu::linear_forward(want.data(), x.data<float>(), w.data<float>(), b.data<float>(), N, C, OC);
    cpu::gelu_forward(want.data(), want.data(), N * OC);
    for (int64_t i = 0; i < N * OC; ++i) ASSERT_EQ(got.data<float>()[i], want[static_cast<size_t>(i)]) << i;
  });
}

TEST_P(StreamModes, ResultsReturnedToTheHostAreReadAfterTheWork) {
  with_cpu_stream_mode(GetParam(), [] {
    Tensor x = Tensor::empty({1000});
    x.fill_(2.0f);
    ops::scale(x.data<float>(), x.numel(), 3.0f);
    EXPECT_EQ(ops::sum_squares(x.data<float>(), x.numel()), 1000.0 * 36.0);
    Tensor h = Tensor::from_host(std::vector<int32_t>{1, 2, 3}.data(), {3}, DType::i32);
    EXPECT_EQ(h.clone(Tier::host).data<int32_t>()[2], 3);
  });
}

TEST_P(StreamModes, AFailureInStreamWorkIsRethrownAtTheNextWait) {
  with_cpu_stream_mode(GetParam(), [] {
    const Stream s = current_stream();
    const auto fail = [] { throw Error("planted failure"); };
    if (GetParam() == CpuStreamMode::sync) {
      // Synchronous work fails where it is enqueued, as a kernel call would.
      EXPECT_THROW(s.enqueue(fail), Error);
      return;
    }
    s.enqueue(fail);
    std::atomic<bool> ran{false};
    s.enqueue([&] { ran = true; });
    EXPECT_THROW(s.synchronize(), Error);
    EXPECT_FALSE(ran.load()) << "work after a failure is skipped";
  });
}

TEST_P(StreamModes, AnEventOrdersAnotherStreamWithoutBlockingTheHost) {
  with_cpu_stream_mode(GetParam(), [] {
    MemoryContext& ctx = MemoryContext::current();
    const Stream compute(ctx.stream(MemoryContext::StreamRole::compute));
    const Stream copy(ctx.stream(MemoryContext::StreamRole::copy));
    std::atomic<int> value{0};
    compute.enqueue([&] {
      std::this_thread::sleep_for(20ms);
      value = 1;
    });
    Event::record(compute).wait(copy);
    int seen = -1;
    copy.enqueue([&] { seen = value.load(); });
    copy.synchronize();
    EXPECT_EQ(seen, 1);
  });
}

INSTANTIATE_TEST_SUITE_P(Cpu, StreamModes, ::testing::Values(CpuStreamMode::sync, CpuStreamMode::async),
                         [](const auto& info) { return std::string(cpu_stream_mode_name(info.param)); });

// The reason the asynchronous mode exists: host code that reads a kernel's
// result without waiting for it reads the old bytes. The same code with the
// wait reads the new ones.
TEST(AsyncStreams, AMissingWaitReadsStaleData) {
  with_cpu_stream_mode(CpuStreamMode::async, [] {
    Tensor x = Tensor::zeros({4096});
    ops::synchronize();
    // The stream is busy when the kernel is enqueued, as a GPU often is.
    current_stream().enqueue([] { std::this_thread::sleep_for(50ms); });
    ops::fill(x.data<float>(), DType::f32, x.numel(), 1.0f);
    const float unsynchronized = x.data<float>()[4095];  // the planted missing wait
    ops::synchronize();
    const float synchronized = x.data<float>()[4095];
    EXPECT_EQ(unsynchronized, 0.0f);
    EXPECT_EQ(synchronized, 1.0f);
  });
}

TEST(AsyncStreams, MemoryIsCountedFreeAtOnceAndReturnedInStreamOrder) {
  with_cpu_stream_mode(CpuStreamMode::async, [] {
    Allocator& device = MemoryContext::current().tier(Tier::device);
    std::atomic<bool> read_after_free{false};
    {
      Tensor t = Tensor::empty({1024});
      t.fill_(7.0f);
      float* p = t.data<float>();
      current_stream().enqueue([] { std::this_thread::sleep_for(30ms); });
      // Work enqueued before the free still sees the memory intact.
      current_stream().enqueue([p, &read_after_free] { read_after_free = p[1023] == 7.0f; });
      EXPECT_EQ(device.used(), 1024u * 4);
    }
    EXPECT_EQ(device.used(), 0u) << "the bytes are free for the host's accounting at once";
    ops::synchronize();
    EXPECT_TRUE(read_after_free.load());
  });
}

TEST(AsyncStreams, CollectivesSeeTheResultsOfEarlierKernels) {
  with_cpu_stream_mode(CpuStreamMode::async, [] {
    run_local(2, [](Communicator& comm) {
      Tensor x = Tensor::zeros({256});
      current_stream().enqueue([] { std::this_thread::sleep_for(20ms); });
      x.fill_(static_cast<float>(comm.rank() + 1));
      comm.all_reduce(x);
      EXPECT_EQ(x.clone(Tier::host).data<float>()[255], 3.0f);
    });
  });
}

TEST(Device, NamesAndTheRanksDevice) {
  EXPECT_EQ(Device::cpu().name(), "cpu");
  EXPECT_EQ(Device::cuda(1).name(), "cuda:1");
  EXPECT_EQ(MemoryContext::current().device(), Device::cpu());
  EXPECT_EQ(Tensor::empty({2}).device(), Device::cpu());
}

}  // namespace
}  // namespace loom
