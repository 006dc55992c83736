// Published large training runs, as data: what `loom plan --hardware` is
// compared with at a scale this machine cannot measure (bench/planner_bench,
// docs/planning.md). Every figure below is the publication's; what it leaves
// open is named in the run's assumptions.
#include "loom/planner.h"

namespace loom {

namespace {

// Megatron's GPT models: GPT-2's architecture (LayerNorm, GELU, learned
// positions, biases, a tied head), a vocabulary of 51,200 and sequences of
// 2048 tokens.
GPTConfig megatron_gpt(int64_t layers, int64_t heads, int64_t hidden) {
  GPTConfig c;
  c.n_layer = layers;
  c.n_head = heads;
  c.n_embd = hidden;
  c.vocab_size = 51200;
  c.block_size = 2048;
  return c;
}

// Narayanan et al.'s equation (3): the FLOPs of one iteration with
// activation recomputation, 96 B s l h^2 (1 + s / 6h + V / 16lh).
double narayanan_flops(const GPTConfig& m, int64_t batch, int64_t seq_len) {
  const double B = static_cast<double>(batch), s = static_cast<double>(seq_len), l = static_cast<double>(m.n_layer),
               h = static_cast<double>(m.n_embd), V = static_cast<double>(m.vocab_size);
  return 96.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (16.0 * l * h));
}

}  // namespace

std::vector<PublishedRun> published_runs() {
  using S = PipelineSchedule;
  const char* selene = "a100-sxm-80gb.json";
  std::vector<PublishedRun> runs;

  // Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  // Transformer Models": Table 3's configurations (no data parallelism;
  // interleaved with three chunks for 175B and 530B) and Table 5's
  // iteration times, full recompute (tensor parallelism alone) and the
  // present work (sequence parallelism and selective recompute).
  struct Korthikanti {
    const char* name;
    int64_t heads, hidden, layers, tp, pp, batch, micro_batch, chunks;
    double full_recompute_s, present_s;
  };
  for (const Korthikanti& k : {Korthikanti{"22B", 64, 6144, 48, 8, 1, 4, 4, 1, 1.42, 1.10},
                               Korthikanti{"GPT-3 175B", 96, 12288, 96, 8, 8, 64, 1, 3, 18.13, 13.75},
                               Korthikanti{"MT-NLG 530B", 128, 20480, 105, 8, 35, 280, 1, 3, 49.05, 37.83},
                               Korthikanti{"1T", 160, 25600, 128, 8, 64, 512, 1, 1, 94.42, 71.49}}) {
    for (bool present : {false, true}) {
      PublishedRun r;
      r.name = str(k.name, present ? ", sequence parallel + selective recompute" : ", full recompute");
      r.source = "Korthikanti et al. 2022, Tables 3 and 5";
      r.hardware = selene;
      r.problem = {.model = megatron_gpt(k.layers, k.heads, k.hidden), .global_batch = k.batch, .seq_len = 2048};
      r.layout = {.tp = k.tp,
                  .pp = k.pp,
                  .sequence_parallel = present,
                  .schedule = k.chunks > 1 ? S::interleaved_1f1b : S::one_f_one_b,
                  .virtual_stages = k.chunks,
                  .micro_batch = k.micro_batch,
                  .recompute = !present};
      r.reported_step_s = present ? k.present_s : k.full_recompute_s;
      r.assumptions = present ? "selective recompute as loom's attention, which keeps its log-sum-exp only"
                              : "full recompute of every layer";
      runs.push_back(r);
    }
  }

  // Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
  // GPU Clusters Using Megatron-LM", Table 2: PTD parallelism (tensor 8,
  // the rest pipeline) against ZeRO-3 alone, at a fixed global batch, with
  // the per-GPU teraFLOP/s reported; the iteration time is their equation
  // (3)'s FLOPs over the GPUs' throughput. Both recompute activations, as
  // equation (3) counts.
  struct Narayanan {
    const char* name;
    int64_t heads, hidden, layers, model_parallel, batch, gpus, micro_batch;
    double tflops_per_gpu;
    bool zero3;
  };
  for (const Narayanan& n : {Narayanan{"GPT-3 175B", 96, 12288, 96, 96, 1536, 384, 1, 153, false},
                             Narayanan{"GPT-3 175B", 96, 12288, 96, 96, 1536, 768, 1, 149, false},
                             Narayanan{"GPT-3 175B", 96, 12288, 96, 96, 1536, 1536, 1, 141, false},
                             Narayanan{"530B", 128, 20480, 105, 280, 2240, 560, 1, 171, false},
                             Narayanan{"530B", 128, 20480, 105, 280, 2240, 1120, 1, 167, false},
                             Narayanan{"530B", 128, 20480, 105, 280, 2240, 2240, 1, 159, false},
                             Narayanan{"GPT-3 175B", 96, 12288, 96, 1, 1536, 384, 4, 144, true},
                             Narayanan{"GPT-3 175B", 96, 12288, 96, 1, 1536, 768, 2, 88, true},
                             Narayanan{"GPT-3 175B", 96, 12288, 96, 1, 1536, 1536, 1, 44, true},
                             Narayanan{"530B", 128, 20480, 105, 1, 2240, 1120, 2, 98, true},
                             Narayanan{"530B", 128, 20480, 105, 1, 2240, 2240, 1, 48, true}}) {
    PublishedRun r;
    r.name = str(n.name, n.zero3 ? ", ZeRO-3 " : ", PTD ", n.gpus, " GPUs");
    r.source = "Narayanan et al. 2021, Table 2";
    r.hardware = selene;
    r.problem = {.model = megatron_gpt(n.layers, n.heads, n.hidden), .global_batch = n.batch, .seq_len = 2048};
    const int64_t tp = n.zero3 ? 1 : 8, pp = n.model_parallel / tp;
    r.layout = {.dp = n.gpus / n.model_parallel,
                .tp = tp,
                .pp = pp,
                .micro_batch = n.micro_batch,
                .zero_stage = n.zero3 ? 3 : 0,
                .recompute = true};
    r.reported_step_s = narayanan_flops(r.problem.model, n.batch, 2048) / (static_cast<double>(n.gpus) * n.tflops_per_gpu * 1e12);
    r.assumptions = n.zero3 ? "every layer's activations recomputed"
                            : "the non-interleaved 1F1B schedule (Table 2 does not say which)";
    runs.push_back(r);
  }
  return runs;
}

}  // namespace loom
