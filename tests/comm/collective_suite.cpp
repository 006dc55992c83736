#include "comm/collective_suite.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <thread>

namespace loom::comm_suite {
namespace {

constexpr DType kDtypes[] = {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8, DType::f64};
constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};
// Elements in 64 MiB of f32.
constexpr int64_t kLarge = int64_t{16} << 20;

// Empty, one element, odd, and not divisible by the group size.
std::vector<int64_t> counts_for(int n) { return {0, 1, 7, 5 * n + 1}; }

bool is_floating(DType dt) { return dt == DType::f32 || dt == DType::bf16 || dt == DType::f16; }

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Input element `index` of `rank` in test case `seed`, as the bits of one
// element of `dt`. Floats get random signs and exponents over 2^-7..2^7, so
// sums round and their order shows in the result.
uint64_t input_bits(DType dt, uint64_t seed, int rank, int64_t index) {
  const uint64_t h = mix(mix(seed) ^ (static_cast<uint64_t>(rank) << 40) ^ static_cast<uint64_t>(index));
  const uint32_t fbits = static_cast<uint32_t>(((h >> 63) << 31) | ((120 + (h >> 32) % 15) << 23) | (h & 0x7fffff));
  float f;
  std::memcpy(&f, &fbits, 4);
  switch (dt) {
    case DType::f32: return fbits;
    case DType::bf16: return f32_to_bf16(f);
    case DType::f16: return f32_to_f16(f);
    case DType::i32: return static_cast<uint32_t>(h);
    case DType::i64: return h;
    case DType::u8:
    case DType::i8: return h & 0xff;
    case DType::f64: {
      const double d = f;
      uint64_t b;
      std::memcpy(&b, &d, 8);
      return b;
    }
  }
  return 0;
}

double as_double(uint64_t bits) {
  double d;
  std::memcpy(&d, &bits, 8);
  return d;
}

float as_float(DType dt, uint64_t bits) {
  if (dt == DType::bf16) return bf16_to_f32(static_cast<uint16_t>(bits));
  if (dt == DType::f16) return f16_to_f32(static_cast<uint16_t>(bits));
  float f;
  const uint32_t b = static_cast<uint32_t>(bits);
  std::memcpy(&f, &b, 4);
  return f;
}

int64_t as_integer(DType dt, uint64_t bits) {
  if (dt == DType::i32) return static_cast<int32_t>(static_cast<uint32_t>(bits));
  if (dt == DType::u8) return static_cast<int64_t>(bits & 0xff);
  return static_cast<int64_t>(bits);
}

// The result comm.h documents: ranks folded in order 0..n-1, floating types
// in fp32 rounded once, integers in 64 bits with wrapping.
uint64_t expected_bits(DType dt, ReduceOp op, uint64_t seed, int n, int64_t index) {
  if (dt == DType::f64) {  // folded in double
    double acc = as_double(input_bits(dt, seed, 0, index));
    for (int k = 1; k < n; ++k) {
      const double x = as_double(input_bits(dt, seed, k, index));
      if (op == ReduceOp::sum || op == ReduceOp::avg) acc += x;
      if (op == ReduceOp::max && (x > acc || std::isnan(x))) acc = x;
      if (op == ReduceOp::min && (x < acc || std::isnan(x))) acc = x;
    }
    if (op == ReduceOp::avg) acc /= n;
    uint64_t b;
    std::memcpy(&b, &acc, 8);
    return b;
  }
  if (is_floating(dt)) {
    float acc = as_float(dt, input_bits(dt, seed, 0, index));
    for (int k = 1; k < n; ++k) {
      const float x = as_float(dt, input_bits(dt, seed, k, index));
      if (op == ReduceOp::sum || op == ReduceOp::avg) acc += x;
      if (op == ReduceOp::max && (x > acc || std::isnan(x))) acc = x;
      if (op == ReduceOp::min && (x < acc || std::isnan(x))) acc = x;
    }
    if (op == ReduceOp::avg) acc /= static_cast<float>(n);
    if (dt == DType::bf16) return f32_to_bf16(acc);
    if (dt == DType::f16) return f32_to_f16(acc);
    uint32_t b;
    std::memcpy(&b, &acc, 4);
    return b;
  }
  int64_t acc = as_integer(dt, input_bits(dt, seed, 0, index));
  for (int k = 1; k < n; ++k) {
    const int64_t x = as_integer(dt, input_bits(dt, seed, k, index));
    if (op == ReduceOp::sum || op == ReduceOp::avg)
      acc = static_cast<int64_t>(static_cast<uint64_t>(acc) + static_cast<uint64_t>(x));
    if (op == ReduceOp::max) acc = std::max(acc, x);
    if (op == ReduceOp::min) acc = std::min(acc, x);
  }
  if (op == ReduceOp::avg) acc /= n;
  const uint64_t bits = static_cast<uint64_t>(acc);
  if (dt == DType::i32) return bits & 0xffffffffull;
  if (dt == DType::u8) return bits & 0xff;
  return bits;
}

using Bytes = std::vector<uint8_t>;

Bytes make_buffer(DType dt, int64_t count) { return Bytes(static_cast<size_t>(count) * dtype_size(dt) + 1, 0xA5); }

void put(Bytes& buf, DType dt, int64_t i, uint64_t bits) {
  std::memcpy(buf.data() + static_cast<size_t>(i) * dtype_size(dt), &bits, dtype_size(dt));
}

uint64_t get(const uint8_t* buf, DType dt, int64_t i) {
  uint64_t bits = 0;
  std::memcpy(&bits, buf + static_cast<size_t>(i) * dtype_size(dt), dtype_size(dt));
  return bits;
}

// Checks elements [0, count) of `buf` against `expected`; reports the first
// mismatch only, so a wrong large buffer stays readable.
void expect_elements(const uint8_t* buf, DType dt, int64_t count, const std::function<uint64_t(int64_t)>& expected,
                     const std::string& what) {
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t want = expected(i);
    const uint64_t got = get(buf, dt, i);
    if (got != want) {
      ADD_FAILURE() << what << ": element " << i << " of " << count << " has bits 0x" << std::hex << got
                    << ", expected 0x" << want;
      return;
    }
  }
}

std::string context(const Communicator& comm, DType dt, int64_t count) {
  return str("rank ", comm.rank(), " of ", comm.size(), ", ", dtype_name(dt), " x ", count);
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

void all_reduce_folds_in_rank_order(Communicator& comm) {
  const int n = comm.size();
  uint64_t seed = 1000;
  for (DType dt : kDtypes) {
    for (ReduceOp op : kOps) {
      std::vector<int64_t> counts = counts_for(n);
      // Several segments of the mpi backend's pipeline, with a remainder.
      if (op == ReduceOp::sum && (dt == DType::f32 || dt == DType::bf16)) counts.push_back(300007);
      for (int64_t count : counts) {
        ++seed;
        Bytes buf = make_buffer(dt, count);
        for (int64_t i = 0; i < count; ++i) put(buf, dt, i, input_bits(dt, seed, comm.rank(), i));
        comm.all_reduce(buf.data(), count, dt, op);
        expect_elements(
            buf.data(), dt, count, [&](int64_t i) { return expected_bits(dt, op, seed, n, i); },
            str("all_reduce ", reduce_op_name(op), ", ", context(comm, dt, count)));
        EXPECT_EQ(buf.back(), 0xA5) << "all_reduce wrote past the end, " << context(comm, dt, count);
      }
    }
  }
}

void reduce_scatter_folds_in_rank_order(Communicator& comm) {
  const int n = comm.size();
  const int r = comm.rank();
  uint64_t seed = 2000;
  for (DType dt : kDtypes) {
    for (ReduceOp op : kOps) {
      for (int64_t count : counts_for(n)) {
        for (bool in_place : {false, true}) {
          ++seed;
          Bytes send = make_buffer(dt, n * count);
          for (int64_t i = 0; i < n * count; ++i) put(send, dt, i, input_bits(dt, seed, r, i));
          Bytes recv = make_buffer(dt, count);
          uint8_t* out = in_place ? send.data() + static_cast<size_t>(r * count) * dtype_size(dt) : recv.data();
          comm.reduce_scatter(send.data(), out, count, dt, op);
          expect_elements(
              out, dt, count, [&](int64_t i) { return expected_bits(dt, op, seed, n, r * count + i); },
              str("reduce_scatter ", reduce_op_name(op), in_place ? " in place, " : ", ", context(comm, dt, count)));
        }
      }
    }
  }
}

void all_gather_places_every_block(Communicator& comm) {
  const int n = comm.size();
  const int r = comm.rank();
  uint64_t seed = 3000;
  for (DType dt : kDtypes) {
    for (int64_t count : counts_for(n)) {
      for (bool in_place : {false, true}) {
        ++seed;
        Bytes recv = make_buffer(dt, n * count);
        Bytes send = make_buffer(dt, count);
        uint8_t* mine = in_place ? recv.data() + static_cast<size_t>(r * count) * dtype_size(dt) : send.data();
        for (int64_t i = 0; i < count; ++i) {
          const uint64_t bits = input_bits(dt, seed, r, i);
          std::memcpy(mine + static_cast<size_t>(i) * dtype_size(dt), &bits, dtype_size(dt));
        }
        comm.all_gather(mine, recv.data(), count, dt);
        expect_elements(
            recv.data(), dt, n * count,
            [&](int64_t i) { return input_bits(dt, seed, static_cast<int>(i / count), i % count); },
            str("all_gather", in_place ? " in place, " : ", ", context(comm, dt, count)));
        EXPECT_EQ(recv.back(), 0xA5) << "all_gather wrote past the end, " << context(comm, dt, count);
      }
    }
  }
}

void broadcast_copies_the_root(Communicator& comm) {
  const int n = comm.size();
  uint64_t seed = 4000;
  for (DType dt : kDtypes) {
    for (int64_t count : counts_for(n)) {
      for (int root : {0, n - 1}) {
        ++seed;
        Bytes buf = make_buffer(dt, count);
        // Non-roots start from different data, which must be overwritten.
        for (int64_t i = 0; i < count; ++i) put(buf, dt, i, input_bits(dt, seed, comm.rank(), i));
        comm.broadcast(buf.data(), count, dt, root);
        expect_elements(
            buf.data(), dt, count, [&](int64_t i) { return input_bits(dt, seed, root, i); },
            str("broadcast from ", root, ", ", context(comm, dt, count)));
      }
    }
  }
}

void max_and_min_propagate_nan(Communicator& comm) {
  const int n = comm.size();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (ReduceOp op : {ReduceOp::max, ReduceOp::min, ReduceOp::sum}) {
    // Element k is NaN on rank k only.
    std::vector<float> buf(static_cast<size_t>(n) + 1, static_cast<float>(comm.rank()));
    buf[static_cast<size_t>(comm.rank())] = nan;
    comm.all_reduce(buf.data(), n + 1, DType::f32, op);
    for (int k = 0; k < n; ++k) EXPECT_TRUE(std::isnan(buf[static_cast<size_t>(k)])) << reduce_op_name(op) << " " << k;
    const float last = op == ReduceOp::max ? static_cast<float>(n - 1)
                       : op == ReduceOp::min ? 0.0f
                                             : static_cast<float>(n * (n - 1) / 2);
    EXPECT_EQ(buf[static_cast<size_t>(n)], last) << reduce_op_name(op);
  }
}

void tensor_forms_check_their_shapes(Communicator& comm) {
  const int n = comm.size();
  const int r = comm.rank();
  Tensor t = Tensor::empty({3, 5}, DType::f32, Tier::host);
  t.fill_(static_cast<float>(r + 1));
  comm.all_reduce(t);
  for (int64_t i = 0; i < t.numel(); ++i) EXPECT_EQ(t.data<float>()[i], static_cast<float>(n * (n + 1) / 2));

  Tensor blocks = Tensor::empty({n, 4}, DType::bf16, Tier::host);
  blocks.fill_(1.5f);
  Tensor block = Tensor::empty({4}, DType::bf16, Tier::host);
  comm.reduce_scatter(blocks, block, ReduceOp::avg);
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(bf16_to_f32(block.data<uint16_t>()[i]), 1.5f);

  Tensor mine = Tensor::empty({2}, DType::i32, Tier::host);
  mine.data<int32_t>()[0] = r;
  mine.data<int32_t>()[1] = -r;
  Tensor all = Tensor::empty({n, 2}, DType::i32, Tier::host);
  comm.all_gather(mine, all);
  for (int k = 0; k < n; ++k) {
    EXPECT_EQ(all.data<int32_t>()[2 * k], k);
    EXPECT_EQ(all.data<int32_t>()[2 * k + 1], -k);
  }

  Tensor root_data = Tensor::empty({6}, DType::i64, Tier::host);
  for (int64_t i = 0; i < 6; ++i) root_data.data<int64_t>()[i] = r == n - 1 ? i * i : -1;
  comm.broadcast(root_data, n - 1);
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(root_data.data<int64_t>()[i], i * i);

  // Wrong shapes and arguments are caught on the calling rank, before any
  // communication, so every rank sees the same errors and stays in step.
  Tensor odd = Tensor::empty({n * 4 + 1}, DType::bf16, Tier::host);
  EXPECT_THROW(comm.reduce_scatter(odd, block), Error);
  Tensor f32_block = Tensor::empty({4}, DType::f32, Tier::host);
  EXPECT_THROW(comm.reduce_scatter(blocks, f32_block), Error);
  EXPECT_THROW(comm.all_gather(mine, odd), Error);
  EXPECT_THROW(comm.broadcast(t, n), Error);
  EXPECT_THROW(comm.all_reduce(t.raw(), -1, DType::f32), Error);
  EXPECT_THROW(comm.send(t, n, 0), Error);
  EXPECT_THROW(comm.recv(t, 0, kMaxTag + 1), Error);
  comm.barrier();
}

void large_all_reduce(Communicator& comm) {
  const int64_t count = kLarge + 3;  // 64 MiB, not divisible by the group size
  std::vector<float> buf(static_cast<size_t>(count));
  const uint64_t seed = 5001;
  for (int64_t i = 0; i < count; ++i)
    buf[static_cast<size_t>(i)] = as_float(DType::f32, input_bits(DType::f32, seed, comm.rank(), i));
  comm.all_reduce(buf.data(), count, DType::f32);
  expect_elements(
      reinterpret_cast<const uint8_t*>(buf.data()), DType::f32, count,
      [&](int64_t i) { return expected_bits(DType::f32, ReduceOp::sum, seed, comm.size(), i); },
      "large all_reduce, " + context(comm, DType::f32, count));
}

void large_reduce_scatter(Communicator& comm) {
  const int n = comm.size();
  const int64_t count = kLarge / n + 1;
  const uint64_t seed = 5002;
  std::vector<float> send(static_cast<size_t>(n * count)), recv(static_cast<size_t>(count));
  for (int64_t i = 0; i < n * count; ++i)
    send[static_cast<size_t>(i)] = as_float(DType::f32, input_bits(DType::f32, seed, comm.rank(), i));
  comm.reduce_scatter(send.data(), recv.data(), count, DType::f32, ReduceOp::sum);
  expect_elements(
      reinterpret_cast<const uint8_t*>(recv.data()), DType::f32, count,
      [&](int64_t i) { return expected_bits(DType::f32, ReduceOp::sum, seed, n, comm.rank() * count + i); },
      "large reduce_scatter, " + context(comm, DType::f32, count));
}

void large_all_gather(Communicator& comm) {
  const int n = comm.size();
  const int64_t count = kLarge / n + 1;
  std::vector<float> send(static_cast<size_t>(count)), recv(static_cast<size_t>(n * count));
  for (int64_t i = 0; i < count; ++i) send[static_cast<size_t>(i)] = static_cast<float>(comm.rank() * count + i);
  comm.all_gather(send.data(), recv.data(), count, DType::f32);
  for (int64_t i = 0; i < n * count; ++i) {
    if (recv[static_cast<size_t>(i)] != static_cast<float>(i)) {
      ADD_FAILURE() << "large all_gather: element " << i << " is " << recv[static_cast<size_t>(i)] << ", "
                    << context(comm, DType::f32, count);
      break;
    }
  }
}

void large_broadcast(Communicator& comm) {
  const int root = comm.size() - 1;
  const int64_t count = kLarge + 3;
  std::vector<float> buf(static_cast<size_t>(count), -1.0f);
  if (comm.rank() == root) std::iota(buf.begin(), buf.end(), 0.0f);
  comm.broadcast(buf.data(), count, DType::f32, root);
  std::vector<float> expected(static_cast<size_t>(count));
  std::iota(expected.begin(), expected.end(), 0.0f);
  EXPECT_TRUE(buf == expected) << "large broadcast, " << context(comm, DType::f32, count);
}

void send_recv_match_by_source_and_tag(Communicator& comm) {
  const int n = comm.size();
  const int r = comm.rank();
  const int next = (r + 1) % n;
  const int prev = (r + n - 1) % n;

  // Receives posted in another order than the sends match by tag; two
  // messages with the same tag arrive in sending order.
  int64_t got[4] = {};
  Work r2 = comm.recv_async(&got[2], 8, prev, 2);
  Work r1a = comm.recv_async(&got[0], 8, prev, 1);
  Work r1b = comm.recv_async(&got[1], 8, prev, 1);
  Work r0 = comm.recv_async(&got[3], 0, prev, 0);
  const int64_t out[3] = {100 * r + 1, 100 * r + 11, 100 * r + 2};
  Work s1a = comm.send_async(&out[0], 8, next, 1);
  Work s2 = comm.send_async(&out[2], 8, next, 2);
  Work s1b = comm.send_async(&out[1], 8, next, 1);
  Work s0 = comm.send_async(nullptr, 0, next, 0);
  for (Work* w : {&s1a, &s2, &s1b, &s0, &r2, &r1a, &r1b, &r0}) w->wait();
  EXPECT_EQ(got[0], 100 * prev + 1);
  EXPECT_EQ(got[1], 100 * prev + 11);
  EXPECT_EQ(got[2], 100 * prev + 2);

  // A large message around the ring. Odd ranks receive first, which breaks
  // the cycle of synchronous sends.
  const size_t big = (size_t{3} << 20) + 5;
  std::vector<uint8_t> payload(big), received(big);
  for (size_t i = 0; i < big; ++i) payload[i] = static_cast<uint8_t>((i * 7 + static_cast<size_t>(r)) & 0xff);
  if (n == 1) {
    Work self = comm.recv_async(received.data(), big, 0, 5);
    comm.send(payload.data(), big, 0, 5);
    self.wait();
  } else if (r % 2 == 0) {
    comm.send(payload.data(), big, next, 5);
    comm.recv(received.data(), big, prev, 5);
  } else {
    comm.recv(received.data(), big, prev, 5);
    comm.send(payload.data(), big, next, 5);
  }
  for (size_t i = 0; i < big; ++i) {
    if (received[i] != static_cast<uint8_t>((i * 7 + static_cast<size_t>(prev)) & 0xff)) {
      ADD_FAILURE() << "large message byte " << i << " on rank " << r;
      break;
    }
  }
  comm.barrier();
}

void recv_of_the_wrong_size_fails(Communicator& comm) {
  if (comm.size() < 2) return;
  const int64_t value = 42;
  if (comm.rank() == 0) {
    comm.send(&value, 8, 1, 9);
  } else if (comm.rank() == 1) {
    int64_t got[2] = {};
    try {
      comm.recv(got, 16, 0, 9);
      ADD_FAILURE() << "a 16-byte receive matched an 8-byte send";
    } catch (const Error& e) {
      EXPECT_TRUE(contains(e.what(), "sizes must agree")) << e.what();
    }
  }
  comm.barrier();
}

void sub_groups_follow_color_and_key(Communicator& comm) {
  const int n = comm.size();
  const int r = comm.rank();
  const std::vector<int>& world = comm.world_ranks();

  auto parity = comm.split(r % 2, r);
  ASSERT_NE(parity, nullptr);
  EXPECT_EQ(parity->size(), (n - r % 2 + 1) / 2);
  EXPECT_EQ(parity->rank(), r / 2);
  int64_t sum = world[static_cast<size_t>(r)];
  parity->all_reduce(&sum, 1, DType::i64);
  int64_t expected = 0;
  for (int k = r % 2; k < n; k += 2) expected += world[static_cast<size_t>(k)];
  EXPECT_EQ(sum, expected);
  for (int k = 0; k < parity->size(); ++k)
    EXPECT_EQ(parity->world_ranks()[static_cast<size_t>(k)], world[static_cast<size_t>(2 * k + r % 2)]);

  // Keys order the new ranks; a sub-group splits again.
  auto reversed = comm.split(7, -r);
  EXPECT_EQ(reversed->rank(), n - 1 - r);
  auto nested = parity->split(0, -parity->rank());
  EXPECT_EQ(nested->rank(), parity->size() - 1 - parity->rank());
  nested->barrier();

  // A negative color joins no group.
  auto without_first = comm.split(r == 0 ? -1 : 0, r);
  EXPECT_EQ(without_first == nullptr, r == 0);
  if (without_first) {
    EXPECT_EQ(without_first->size(), n - 1);
  }

  // new_group follows the order of its list; non-members get nothing.
  const std::vector<int> members = n >= 2 ? std::vector<int>{n - 1, 0} : std::vector<int>{0};
  auto pair = comm.new_group(members);
  const auto position = std::find(members.begin(), members.end(), r);
  ASSERT_EQ(pair != nullptr, position != members.end());
  if (pair) {
    EXPECT_EQ(pair->rank(), position - members.begin());
    int32_t mine = r, all[2] = {};
    pair->all_gather(&mine, all, 1, DType::i32);
    for (size_t i = 0; i < members.size(); ++i) EXPECT_EQ(all[i], members[i]);
  }
  EXPECT_THROW(comm.new_group({0, 0}), Error);
  EXPECT_THROW(comm.new_group({n}), Error);

  // Collectives on the world and on a sub-group run at the same time.
  float on_world = 1.0f;
  Work pending = comm.all_reduce_async(&on_world, 1, DType::f32);
  float on_parity = 2.0f;
  parity->all_reduce(&on_parity, 1, DType::f32);
  pending.wait();
  EXPECT_EQ(on_world, static_cast<float>(n));
  EXPECT_EQ(on_parity, 2.0f * static_cast<float>(parity->size()));
}

void async_collectives_overlap_and_keep_issue_order(Communicator& comm) {
  const int n = comm.size();
  const int r = comm.rank();

  // Several asynchronous collectives, then a synchronous one: they run in
  // issue order, so once the synchronous one returns all have finished.
  std::vector<float> a(10001, static_cast<float>(r));
  std::vector<int32_t> b(777, r);
  std::vector<int64_t> gathered(static_cast<size_t>(n) * 3, -1);
  const int64_t mine[3] = {r, 2 * r, 3 * r};
  std::vector<uint16_t> c(33, r == 0 ? f32_to_bf16(0.25f) : 0);
  Work wa = comm.all_reduce_async(a.data(), static_cast<int64_t>(a.size()), DType::f32);
  Work wb = comm.all_reduce_async(b.data(), static_cast<int64_t>(b.size()), DType::i32, ReduceOp::max);
  Work wg = comm.all_gather_async(mine, gathered.data(), 3, DType::i64);
  Work wc = comm.broadcast_async(c.data(), static_cast<int64_t>(c.size()), DType::bf16, 0);
  int64_t last = 1;
  comm.all_reduce(&last, 1, DType::i64);
  EXPECT_TRUE(wa.done() && wb.done() && wg.done() && wc.done());
  for (Work* w : {&wa, &wb, &wg, &wc}) w->wait();
  EXPECT_EQ(last, n);
  EXPECT_EQ(a[10000], static_cast<float>(n * (n - 1) / 2));
  EXPECT_EQ(b[0], n - 1);
  for (int k = 0; k < n; ++k) EXPECT_EQ(gathered[static_cast<size_t>(3 * k + 2)], 3 * k);
  EXPECT_EQ(c[32], f32_to_bf16(0.25f));

  // Overlap: the last rank joins late, so the others' collective is still
  // pending while they compute.
  const int late = n - 1;
  if (r == late) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  std::vector<float> grads(1 << 20, 1.0f);
  Work pending = comm.all_reduce_async(grads.data(), static_cast<int64_t>(grads.size()), DType::f32);
  if (r != late) {
    EXPECT_FALSE(pending.done());
  }
  double work = 0;
  for (int i = 0; i < 1000000; ++i) work += std::sqrt(static_cast<double>(i));
  EXPECT_GT(work, 0.0);
  pending.wait();
  EXPECT_TRUE(pending.done());
  EXPECT_EQ(grads[12345], static_cast<float>(n));

  Work fence = comm.barrier_async();
  fence.wait();
}

void stats_follow_the_ring_cost_model(Communicator& comm) {
  auto group = comm.split(0, comm.rank());  // fresh counters
  const int n = group->size();
  const double share = static_cast<double>(n - 1) / n;
  std::vector<float> buf(1000, 1.0f);
  group->all_reduce(buf.data(), 1000, DType::f32);
  std::vector<uint16_t> blocks(static_cast<size_t>(n) * 100), block(100);
  group->reduce_scatter(blocks.data(), block.data(), 100, DType::bf16);
  std::vector<int64_t> mine(50), all(static_cast<size_t>(n) * 50);
  group->all_gather(mine.data(), all.data(), 50, DType::i64);
  group->broadcast(buf.data(), 10, DType::f32, 0);
  group->barrier();
  const CommStats s = group->stats();
  EXPECT_EQ(s.all_reduce.calls, 1);
  EXPECT_DOUBLE_EQ(s.all_reduce.elements, 2 * share * 1000);
  EXPECT_DOUBLE_EQ(s.all_reduce.bytes, 2 * share * 1000 * 4);
  EXPECT_DOUBLE_EQ(s.reduce_scatter.elements, share * n * 100);
  EXPECT_DOUBLE_EQ(s.reduce_scatter.bytes, share * n * 100 * 2);
  EXPECT_DOUBLE_EQ(s.all_gather.elements, share * n * 50);
  EXPECT_DOUBLE_EQ(s.all_gather.bytes, share * n * 50 * 8);
  EXPECT_DOUBLE_EQ(s.broadcast.elements, n > 1 ? 10 : 0);
  EXPECT_EQ(s.barrier.calls, 1);
  EXPECT_DOUBLE_EQ(s.barrier.bytes, 0);
  EXPECT_EQ(s.sent().calls, 5);
  EXPECT_DOUBLE_EQ(s.sent().bytes,
                   s.all_reduce.bytes + s.reduce_scatter.bytes + s.all_gather.bytes + s.broadcast.bytes);
  EXPECT_EQ(group->collectives_issued(), 5u);
}

void timeout_names_operation_sequence_and_missing_rank(Communicator& comm) {
  if (comm.size() < 2) return;
  auto group = comm.split(0, comm.rank());
  group->set_options({std::chrono::milliseconds(1000)});
  group->barrier();  // #1
  const int late = group->size() - 1;
  if (group->rank() == late) {
    // Never joins #2; stays away long enough for the others to give up.
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  } else {
    float x = 1.0f;
    const auto start = std::chrono::steady_clock::now();
    try {
      group->all_reduce(&x, 1, DType::f32);
      ADD_FAILURE() << "an all_reduce that one rank never joined returned";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_TRUE(contains(message, "all_reduce #2")) << message;
      EXPECT_TRUE(contains(message, "timed out after 1.0 s")) << message;
      EXPECT_TRUE(contains(message, str("world rank(s) [", group->world_ranks()[late], "]"))) << message;
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_GE(waited, 0.9);
    EXPECT_LT(waited, 10.0);
    // The group is unusable now, and says why.
    try {
      group->barrier();
      ADD_FAILURE() << "a collective on a timed-out communicator ran";
    } catch (const Error& e) {
      EXPECT_TRUE(contains(e.what(), "unusable after an earlier failure")) << e.what();
      EXPECT_TRUE(contains(e.what(), "all_reduce #2")) << e.what();
    }
  }
  comm.barrier();
}

void mismatched_collectives_are_reported(Communicator& comm) {
  if (comm.size() < 2) return;
  for (bool same_kind : {false, true}) {
    auto group = comm.split(0, comm.rank());
    group->set_options({std::chrono::milliseconds(5000)});
    float x[5] = {};
    try {
      if (group->rank() == 0)
        group->all_reduce(x, 4, DType::f32);
      else if (same_kind)
        group->all_reduce(x, 5, DType::f32);
      else
        group->broadcast(x, 4, DType::f32, 0);
      ADD_FAILURE() << "mismatched collectives ran";
    } catch (const Error& e) {
      EXPECT_TRUE(contains(e.what(), "does not match")) << e.what();
      EXPECT_TRUE(contains(e.what(), same_kind ? "all_reduce #1 (5 x f32" : "broadcast #1")) << e.what();
    }
    comm.barrier();
  }
}

}  // namespace loom::comm_suite
