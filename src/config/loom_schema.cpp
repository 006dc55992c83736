#include "loom/config.h"
#include "loom/nn.h"

namespace loom {

namespace {

ConfigSchema build_loom_schema() {
  constexpr int64_t kMaxDim = int64_t(1) << 20;
  ConfigSchema s;
  std::vector<std::string> presets = GPTConfig::preset_names();
  presets.insert(presets.begin(), "custom");
  s.add_choice("model.preset", "custom", presets,
               "model shape: 'custom' uses the model.* keys below, a preset name fixes them");
  s.add_int("model.n_layer", 4, "transformer blocks", 1, 1024);
  s.add_int("model.n_head", 4, "attention heads per block (must divide model.n_embd unless model.head_dim is set)", 1,
            1024);
  s.add_int("model.n_embd", 256, "hidden size", 1, kMaxDim);
  s.add_int("model.vocab_size", 2048, "embedding rows; at least data.vocab_size", 1, kMaxDim);
  s.add_int("model.block_size", 128, "context length in tokens (longest train.seq_len)", 1, kMaxDim);
  s.add_float("model.dropout", 0.0, "dropout probability on attention and residual paths", 0.0, 1.0);
  // The variants LLaMA-class models differ from GPT-2 by (defaults: GPT-2).
  s.add_choice("model.norm", "layernorm", {"layernorm", "rmsnorm"},
               "block and final normalization: layernorm (GPT-2) or rmsnorm (LLaMA)");
  s.add_float("model.norm_eps", 1e-5, "normalization epsilon (layernorm: 1e-5 only)", 0.0);
  s.add_choice("model.positions", "learned", {"learned", "rope"},
               "position encoding: learned table (GPT-2) or rotary embedding of q and k (LLaMA)");
  s.add_float("model.rope_theta", 10000.0, "RoPE base (LLaMA 2: 1e4, LLaMA 3: 5e5)", 0.0);
  s.add_choice("model.rope_scaling", "none", {"none", "linear", "llama3"},
               "RoPE frequency scaling, as Hugging Face's rope_scaling.rope_type");
  s.add_float("model.rope_scaling_factor", 1.0, "RoPE scaling factor (linear and llama3)", 0.0);
  s.add_float("model.rope_low_freq_factor", 1.0, "llama3 RoPE scaling: low_freq_factor", 0.0);
  s.add_float("model.rope_high_freq_factor", 4.0, "llama3 RoPE scaling: high_freq_factor", 0.0);
  s.add_int("model.rope_original_max_positions", 8192,
            "llama3 RoPE scaling: original_max_position_embeddings", 1, kMaxDim);
  s.add_choice("model.mlp", "gelu", {"gelu", "swiglu"}, "MLP: GELU (GPT-2) or SwiGLU gate/up/down (LLaMA)");
  s.add_int("model.intermediate_size", 0, "MLP hidden size; 0 = 4 * model.n_embd", 0, kMaxDim);
  s.add_int("model.n_kv_head", 0,
            "key/value heads (must divide model.n_head; 1 = multi-query); 0 = model.n_head", 0, 1024);
  s.add_int("model.head_dim", 0,
            "width of each attention head (q: n_head * head_dim, k and v: n_kv_head * head_dim); 0 = n_embd / n_head",
            0, kMaxDim);
  s.add_bool("model.packed_qkv", true,
             "one c_attn parameter for q, k, v (GPT-2's names; needs n_kv_head = n_head) or q, k, v apart (LLaMA)");
  s.add_bool("model.attention_bias", true, "biases on the q/k/v and output projections (GPT-2: on, LLaMA: off)");
  s.add_bool("model.mlp_bias", true, "biases on the MLP's projections (GPT-2: on, LLaMA: off)");
  s.add_bool("model.tied_embeddings", true, "the output head reuses the token embedding; false: its own lm_head");

  s.add_string("init.from", "",
               "initial weights: empty = a fresh initialization; \"hf:DIR\" = the Hugging Face checkpoint in DIR "
               "(its config.json fixes the model, a tokenizer beside it tokenizes the data); a loom checkpoint "
               "directory or run directory = its weights, model and tokenizer (a pruned one keeps its zeros)");

  s.add_string("distill.teacher", "",
               "knowledge distillation from this teacher: a loom checkpoint directory (or a run directory whose "
               "latest checkpoint it is) or \"hf:DIR\"; empty = no distillation. Same vocabulary as the model");
  s.add_float("distill.temperature", 2.0, "softmax temperature T of the KL term (> 0); its gradient is scaled by T^2",
              0.0);
  s.add_float("distill.alpha", 0.5,
              "weight of the KL term: loss = alpha T^2 KL(teacher || student) + (1 - alpha) cross-entropy", 0.0, 1.0);

  s.add_int("lora.r", 0, "LoRA adapter rank; 0 = no adapters (the whole model trains)", 0, kMaxDim);
  s.add_float("lora.alpha", 8.0, "LoRA scale numerator: adapters add (alpha / r) x A^T B^T", 0.0);
  s.add_float("lora.dropout", 0.0, "dropout probability on each adapter's input (PEFT's lora_dropout)", 0.0, 1.0);
  s.add_string("lora.targets", "c_attn",
               "comma-separated linear layers that get adapters, matched by suffix: GPT-2's c_attn, c_proj, "
               "c_fc, attn.c_proj, mlp.c_proj; LLaMA's q, k, v, o, gate, up, down");

  s.add_int("train.batch_size", 32, "global batch in sequences per optimizer step", 1);
  s.add_int("train.micro_batch_size", 16, "sequences per rank per forward/backward (gradient accumulation makes up the rest)", 1);
  s.add_int("train.seq_len", 128, "tokens per training sequence (at most model.block_size)", 1, kMaxDim);
  s.add_int("train.steps", 500, "optimizer steps", 1);
  s.add_float("train.lr", 2e-3, "peak learning rate", 0.0);
  s.add_float("train.min_lr", 2e-4, "learning rate at the end of the cosine decay", 0.0);
  s.add_int("train.warmup_steps", 50, "linear warm-up steps", 0);
  s.add_float("train.weight_decay", 0.1, "AdamW decoupled weight decay (matrices only)", 0.0);
  s.add_float("train.beta1", 0.9, "AdamW first-moment decay", 0.0, 1.0);
  s.add_float("train.beta2", 0.95, "AdamW second-moment decay", 0.0, 1.0);
  s.add_float("train.eps", 1e-8, "AdamW denominator epsilon", 0.0);
  s.add_float("train.grad_clip", 1.0, "global gradient-norm clip; 0 = off", 0.0);
  s.add_int("train.max_skipped_steps", 0,
            "skip the update of a step whose loss is not finite or spikes (train.skip_spike_factor); this many "
            "such steps in a row stop the run; 0 = off: a non-finite loss stops the run at once",
            0);
  s.add_float("train.skip_spike_factor", 0.0,
              "a loss above this factor times the running mean of the last ~10 losses is skipped (needs "
              "train.max_skipped_steps > 0); 0 = off",
              0.0);
  s.add_int("train.seed", 1337, "seed of initialization, dropout and data order", 0);
  s.add_int("train.log_interval", 10, "steps between progress lines", 1);
  s.add_int("train.eval_interval", 100, "steps between validation losses; 0 = never", 0);
  s.add_int("train.eval_batches", 10, "micro-batches per validation loss", 1);
  s.add_int("train.checkpoint_interval", 250, "steps between checkpoints; 0 = only at the end", 0);
  s.add_int("train.keep_last", 2, "checkpoints kept in train.out_dir; 0 = keep all", 0);
  s.add_bool("train.checkpoint_async", false,
             "snapshot each rank's state into host memory at the step boundary and write the checkpoint while "
             "training goes on (one in flight at a time; sharded checkpoints only)");
  s.add_choice("train.checkpoint_failure", "stop", {"stop", "continue"},
               "a checkpoint that cannot be written (a full disk): stop the run, or report it and train on; "
               "either way the previous checkpoint stays intact");
  s.add_string("train.out_dir", "runs/shakespeare", "directory for checkpoints and logs");
  s.add_bool("train.activation_checkpointing", false, "recompute block activations in backward to save memory");
  s.add_int("train.sample_tokens", 200, "tokens generated from train.sample_prompt after training; 0 = none", 0);
  s.add_string("train.sample_prompt", "ROMEO:", "prompt for the sample after training");
  s.add_float("train.watchdog_timeout", 60.0,
              "seconds a rank may make no progress (outside waits on other ranks) before every rank is ended "
              "naming it; 0 = off",
              0.0);
  s.add_string("trace.path", "",
               "Chrome trace / Perfetto JSON timeline of the traced steps, every rank; empty = off; "
               "an existing file is an error");
  s.add_string("trace.steps", "2-4", "steps traced: \"N\" or \"FIRST-LAST\" (step 1 warms caches)");

  s.add_string("data.dir", "runs/data/shakespeare", "prepared dataset: tokenizer and token shards");
  s.add_string("data.text", "data/tinyshakespeare.txt", "raw text prepared into data.dir when it has no shards");
  s.add_int("data.vocab_size", 2048, "tokenizer vocabulary trained by prepare", 2, kMaxDim);
  s.add_float("data.val_fraction", 0.1, "fraction of the text held out for validation", 0.0, 0.5);

  s.add_int("parallel.dp", 1, "data-parallel ranks", 1, 65536);
  s.add_int("parallel.tp", 1, "tensor-parallel ranks (must divide model.n_head; divide or be a multiple of model.n_kv_head)", 1, 1024);
  s.add_choice("parallel.tp_mode", "1d", {"1d", "2d", "2.5d", "3d"},
               "tensor parallelism: 1d (Megatron), 2d (Optimus: parallel.tp = q * q), 2.5d (Tesseract: parallel.tp = "
               "q * q * parallel.tp_depth)");
  s.add_int("parallel.tp_depth", 1, "layers of a 2.5d grid (parallel.tp_mode = \"2.5d\")", 1, 1024);
  s.add_int("parallel.pp", 1, "pipeline stages", 1, 1024);
  s.add_bool("parallel.sequence_parallel", false,
             "split the activations between tensor-parallel regions by token (needs parallel.tp > 1)");
  s.add_choice("parallel.schedule", "1f1b", {"gpipe", "1f1b", "interleaved_1f1b"},
               "pipeline schedule; interleaved_1f1b runs parallel.virtual_stages model chunks per rank");
  s.add_int("parallel.virtual_stages", 1, "model chunks per pipeline rank; > 1 only with interleaved_1f1b", 1, 1024);
  s.add_string("parallel.stage_layers", "",
               "layers per virtual stage in order, e.g. \"3,3,2\"; empty = balanced by estimated cost");
  s.add_choice("parallel.backend", "local", {"local", "mpi"}, "communicator: ranks as threads (local) or processes (mpi)");
  s.add_bool("parallel.auto", false,
             "replace the layout keys by the fastest layout of parallel.dp * tp * pp ranks that fits, as "
             "`loom plan --search` ranks them (needs `loom calibrate`)");
  s.add_int("parallel.nproc", 0, "ranks to run; 0 = parallel.dp * parallel.tp * parallel.pp", 0, 1 << 20);

  s.add_int("zero.stage", 0, "ZeRO stage: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters sharded", 0, 3);
  s.add_int("zero.bucket_mb", 25, "gradient bucket size in MiB for all-reduce / reduce-scatter", 1, 1 << 16);

  s.add_choice("precision", "fp32", {"fp32", "bf16", "fp16"},
               "working dtype of parameters and gradients; bf16/fp16 keep fp32 master weights");

  // fp16's dynamic loss scaling (include/loom/optim.h, LossScaler). Scales
  // below fp16's smallest subnormal, 2^-24, cannot keep any gradient alive;
  // 2^64 is far past any useful scale and well inside fp32.
  constexpr double kSmallestScale = 0x1p-24, kLargestScale = 0x1p64;
  s.add_float("loss_scale.initial", 65536.0, "fp16: loss scale of the first step", kSmallestScale, kLargestScale);
  s.add_int("loss_scale.growth_interval", 1000, "fp16: clean steps in a row before the scale doubles", 1);
  s.add_int("loss_scale.hysteresis", 2,
            "fp16: the n-th overflow since the scale last grew, and each later one, halve it (earlier ones only skip)",
            1, 1 << 20);
  s.add_float("loss_scale.min", 1.0, "fp16: smallest scale; an overflow that would halve it below this stops the run",
              kSmallestScale, kLargestScale);

  s.add_bytes("memory.device_budget", "unlimited", "device-tier bytes per rank, e.g. \"2GiB\"");
  s.add_bytes("memory.host_budget", "unlimited", "host-tier bytes per rank, e.g. \"16GiB\"");
  s.add_string("memory.nvme_dir", "", "directory of the NVMe tier; empty = no NVMe offload");
  s.add_choice("memory.policy", "none", {"none", "static", "auto"},
               "placement: none (all on device), static (the offload fractions), auto (fit the budgets)");
  s.add_float("memory.offload_param_frac", 0.0, "fraction of parameters held off-device under the static policy", 0.0, 1.0);
  s.add_float("memory.offload_optim_frac", 0.0, "fraction of optimizer state held off-device under the static policy", 0.0, 1.0);
  s.add_bytes("memory.chunk_bytes", "0",
              "capacity of a parameter chunk in working-precision bytes, e.g. \"4MiB\"; 0 = searched for the least waste");
  s.add_int("memory.prefetch", 2, "chunks fetched to the device ahead of use", 0, 1024);
  s.add_bool("memory.nvme_io_uring", true, "NVMe I/O through io_uring; false = a pool of threads doing pread/pwrite");
  return s;
}

}  // namespace

const ConfigSchema& loom_schema() {
  static const ConfigSchema schema = build_loom_schema();
  return schema;
}

}  // namespace loom
