#include <functional>
#include <vector>

#include "loom/comm.h"
#include "loom/data.h"
#include "loom/train.h"

namespace loom {

namespace {

// The loss of one micro-batch summed over its positions with a target
// (`targets` of them).
using LossSum = std::function<double(const MicroBatch& micro_batch, int64_t targets)>;

// Walks this data-parallel rank's slice of the windows (every rank, dp = the
// whole split) and adds up the ranks' loss sums.
EvalResult evaluate_windows(const std::vector<std::filesystem::path>& shards,
                            const std::vector<std::filesystem::path>& masks, int64_t seq_len, int64_t micro_batch,
                            double chars_per_token, int64_t max_batches, int64_t vocab_size, Communicator* dp,
                            const LossSum& loss_sum) {
  EvalLoader loader(shards, static_cast<int>(seq_len), static_cast<int>(micro_batch), dp ? dp->rank() : 0,
                    dp ? dp->size() : 1, masks);
  loader.check_vocab(static_cast<int>(vocab_size));
  std::vector<int32_t> inputs(static_cast<size_t>(micro_batch * seq_len)), targets(inputs.size());
  // Per rank: the loss summed over target tokens, and their count.
  struct Partial {
    double sum = 0.0;
    int64_t tokens = 0;
  } mine;
  int64_t batches = 0;
  // A batch without real rows (a rank whose slice ran out) still runs its
  // forward: under ZeRO-3 and in a pipeline the forward is collective.
  while (loader.next(inputs, targets)) {
    report_progress("evaluation", -1, "batch", batches);
    int64_t n = 0;
    for (int32_t t : targets) n += t != -1;
    mine.sum += loss_sum({inputs.data(), targets.data(), {micro_batch, seq_len}}, n);
    mine.tokens += n;
    if (++batches == max_batches) break;
  }
  // The communicator reduces in fp32 at most, so the ranks' double sums are
  // gathered as bytes and added here in rank order (the same on every rank).
  std::vector<Partial> partials{mine};
  if (dp) {
    partials.resize(static_cast<size_t>(dp->size()));
    dp->all_gather(&mine, partials.data(), sizeof(Partial), DType::u8);
  }
  double sum = 0.0;
  int64_t tokens = 0;
  for (const Partial& p : partials) {
    sum += p.sum;
    tokens += p.tokens;
  }
  if (tokens == 0) throw Error("evaluation found no complete window: the validation split is shorter than seq_len + 1");
  EvalResult r;
  r.tokens = tokens;
  r.loss_per_token = sum / static_cast<double>(tokens);
  r.loss_per_char = chars_per_token > 0 ? r.loss_per_token / chars_per_token : 0.0;
  return r;
}

}  // namespace

EvalResult evaluate(GPT& model, ParamStore& params, const std::vector<std::filesystem::path>& shards,
                    int64_t seq_len, int64_t micro_batch, double chars_per_token, int64_t max_batches,
                    Communicator* dp, const std::vector<std::filesystem::path>& masks) {
  ForwardOptions fo;
  fo.training = false;
  return evaluate_windows(shards, masks, seq_len, micro_batch, chars_per_token, max_batches, model.config().vocab_size, dp,
                          [&](const MicroBatch& mb, int64_t) {
                            MicroBatchState s;
                            model.forward(params, s, mb.tokens, mb.targets, mb.shape, fo);
                            return s.host_loss_sum();
                          });
}

EvalData eval_data(const std::filesystem::path& shard, const std::string& tokenizer_sha256, int64_t seq_len,
                   int64_t block_size) {
  EvalData e;
  e.shard = shard;
  e.seq_len = seq_len > 0 ? seq_len : block_size;
  std::error_code ec;
  if (!std::filesystem::exists(shard.parent_path() / "dataset.json", ec)) return e;
  const DatasetInfo d = DatasetInfo::read(shard.parent_path());
  if (d.tokenizer_sha256 != tokenizer_sha256)
    throw Error(str("'", shard.string(), "' was tokenized with ", d.tokenizer.string(),
                    ", not the checkpoint's tokenizer: evaluate on data prepared with the same tokenizer"));
  const SplitInfo& split = std::filesystem::equivalent(shard, d.val.file, ec) ? d.val : d.train;
  e.chars_per_token = split.chars_per_token();
  e.masks = split.masks();
  // Packed rows are whole windows only at the packing's length.
  if (seq_len == 0 && d.mode == DatasetMode::sft) e.seq_len = d.seq_len;
  return e;
}

EvalResult evaluate(Trainer& trainer, const std::vector<std::filesystem::path>& shards, int64_t seq_len,
                    int64_t micro_batch, double chars_per_token, int64_t max_batches,
                    const std::vector<std::filesystem::path>& masks) {
  return evaluate_windows(shards, masks, seq_len, micro_batch, chars_per_token, max_batches,
                          trainer.model().config().vocab_size, trainer.data_parallel(),
                          [&](const MicroBatch& mb, int64_t) { return trainer.loss_sum(mb); });
}

}  // namespace loom
