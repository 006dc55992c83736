#include <vector>

#include "loom/data.h"
#include "loom/train.h"

namespace loom {

EvalResult evaluate(GPT& model, ParamStore& params, const std::vector<std::filesystem::path>& shards,
                    int64_t seq_len, int64_t micro_batch, double chars_per_token, int64_t max_batches) {
  EvalLoader loader(shards, static_cast<int>(seq_len), static_cast<int>(micro_batch));
  loader.check_vocab(static_cast<int>(model.config().vocab_size));
  std::vector<int32_t> inputs(static_cast<size_t>(micro_batch * seq_len)), targets(inputs.size());
  ForwardOptions fo;
  fo.training = false;
  double sum = 0.0;
  int64_t tokens = 0, batches = 0;
  while (auto rows = loader.next(inputs, targets)) {
    if (*rows > 0) {
      int64_t n = 0;
      for (int32_t t : targets) n += t != -1;
      const float loss = model.forward(params, inputs.data(), targets.data(), {micro_batch, seq_len}, fo);
      sum += static_cast<double>(loss) * static_cast<double>(n);
      tokens += n;
    }
    if (max_batches > 0 && ++batches >= max_batches) break;
  }
  if (tokens == 0) throw Error("evaluation found no complete window: the validation split is shorter than seq_len + 1");
  EvalResult r;
  r.tokens = tokens;
  r.loss_per_token = sum / static_cast<double>(tokens);
  r.loss_per_char = chars_per_token > 0 ? r.loss_per_token / chars_per_token : 0.0;
  return r;
}

}  // namespace loom
