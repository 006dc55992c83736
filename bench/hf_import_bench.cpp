// Import throughput of a sharded Hugging Face checkpoint, as a ratio to
// reading the same files with `cat > /dev/null` in the same run.
//
//   hf_import_bench [n_layer hidden intermediate vocab] [dtype] [shard_mb]
//   e.g. hf_import_bench                      (LLaMA-shaped, ~200M parameters, bf16, 100 MB shards)
//        hf_import_bench 8 1024 2816 32000 f16 50
//
// Writes the checkpoint with loom's exporter into a temporary directory, then
// times (best of 3) `cat` over the shards against loom's import loop, each
// starting with the files evicted from the page cache (posix_fadvise
// DONTNEED), so both read from the disk as an import of a checkpoint that was
// just downloaded or copied does. loom's import loop: open and
// validate the directory (index, headers, the tensor list against config.json)
// and read every parameter in loom's layout as f32 into one reusable buffer,
// which is what the Trainer does for each tensor before it places the values.
// The target is loom >= 0.7 x cat's bytes per second.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "bench_common.h"
#include "loom/hf.h"

using namespace loom;
namespace fs = std::filesystem;

namespace {

// Drops the files' pages from the page cache (written back first).
void evict(const std::vector<fs::path>& files) {
  for (const fs::path& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY);
    if (fd < 0) throw Error("bench: cannot open " + f.string());
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

double seconds_of_cat(const std::vector<fs::path>& files) {
  std::string cmd = "cat";
  for (const fs::path& f : files) cmd += " '" + f.string() + "'";
  cmd += " > /dev/null";
  const double t0 = bench::now_seconds();
  if (std::system(cmd.c_str()) != 0) throw Error("bench: '" + cmd + "' failed");
  return bench::now_seconds() - t0;
}

double seconds_of_import(const fs::path& dir, std::vector<float>& buffer) {
  const double t0 = bench::now_seconds();
  const HFModelConfig cfg = read_hf_config(dir);
  const HFParamMap map(cfg);
  const HFCheckpoint ckpt(dir);
  ckpt.check(map);
  for (const HFParam& p : map.params()) {
    buffer.resize(static_cast<size_t>(shape_numel(p.loom_shape)));
    ckpt.read_param(p, buffer.data());
  }
  return bench::now_seconds() - t0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    HFModelConfig cfg;
    cfg.num_hidden_layers = argc > 4 ? std::atoll(argv[1]) : 12;
    cfg.hidden_size = argc > 4 ? std::atoll(argv[2]) : 1024;
    cfg.intermediate_size = argc > 4 ? std::atoll(argv[3]) : 2816;
    cfg.vocab_size = argc > 4 ? std::atoll(argv[4]) : 32000;
    cfg.num_attention_heads = 16;
    cfg.num_key_value_heads = 8;
    cfg.head_dim = cfg.hidden_size / cfg.num_attention_heads;
    cfg.max_position_embeddings = 2048;
    cfg.norm_eps = 1e-5;
    const std::string dtype_name = argc > 5 ? argv[5] : "bf16";
    const int64_t shard_mb = argc > 6 ? std::atoll(argv[6]) : 100;
    HFExportOptions opts;
    opts.dtype = parse_dtype(dtype_name);
    opts.max_shard_bytes = static_cast<uint64_t>(shard_mb) << 20;
    cfg.dtype = opts.dtype;

    const fs::path dir = fs::temp_directory_path() / ("loom_hf_import_bench_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    const HFParamMap map(cfg);
    int64_t params = 0;
    for (const HFParam& p : map.params()) params += shape_numel(p.loom_shape);
    std::printf("LLaMA-shaped: %lld layers, hidden %lld, intermediate %lld, vocab %lld: %.1fM parameters in %s\n",
                static_cast<long long>(cfg.num_hidden_layers), static_cast<long long>(cfg.hidden_size),
                static_cast<long long>(cfg.intermediate_size), static_cast<long long>(cfg.vocab_size),
                static_cast<double>(params) / 1e6, dtype_name.c_str());
    write_hf_checkpoint(dir, cfg, [](const HFParam& p, float* dst) {
      const int64_t n = shape_numel(p.loom_shape);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(i % 251) * 0.004f - 0.5f;
    }, opts);

    std::vector<fs::path> files;
    uint64_t bytes = 0;
    for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
      files.push_back(e.path());
      bytes += e.file_size();
    }
    std::printf("checkpoint: %zu files, %.1f MB\n", files.size(), static_cast<double>(bytes) / 1e6);

    std::vector<float> buffer;
    double cat = 1e30, import = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      evict(files);
      cat = std::min(cat, seconds_of_cat(files));
      evict(files);
      import = std::min(import, seconds_of_import(dir, buffer));
    }
    fs::remove_all(dir);
    const double gb = static_cast<double>(bytes) / 1e9;
    std::printf("cat > /dev/null: %.3f s = %.2f GB/s\n", cat, gb / cat);
    std::printf("loom import:     %.3f s = %.2f GB/s (to f32 in loom's layout)\n", import, gb / import);
    std::printf("import throughput / cat: %.2f (target >= 0.7)\n", cat / import);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "hf_import_bench: %s\n", e.what());
    return 1;
  }
}
