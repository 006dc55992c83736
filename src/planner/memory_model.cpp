// predict_step_memory: a step's allocations replayed from shapes, in the
// order loom's modules, stores and pipeline executor make them. Each
// function below names the code whose tensors it accounts for.
#include <algorithm>
#include <cstring>
#include <array>
#include <limits>
#include <map>
#include <memory>

#include "loom/planner.h"
#include "loom/zero.h"
#include "core/size_class.h"
#include "memory/chunk_sizes.h"

namespace loom {

namespace {

constexpr double kF32 = 4.0;

// The live bytes of one rank per tier, and what was live at each tier's
// highest point. Every tensor of the replay is one allocation; a handle of
// -1 is a tensor that allocates nothing. The caching allocator is replayed
// alongside (core/caching_allocator.cpp): a tensor takes a cached free block
// of its size class or a new one, and gives it back to the cache, so the
// tier's reserved bytes only grow; bytes accounted without memory
// (Allocator::reserve, IoBuffer and NvmeFile) are reserved as they are.
//
// A search replays thousands of layouts, so the hot path does no string
// work: terms are interned by their (static) name, the phase is a name and
// a suffix kept by pointer, and both become strings only when a peak is
// read.
class Timeline {
 public:
  int alloc(Tier tier, const char* term, double bytes) { return bytes <= 0.0 ? -1 : add(tier, term, bytes, false); }
  int alloc(const char* term, double bytes) { return alloc(Tier::device, term, bytes); }
  // A tensor of no elements still takes the smallest block.
  int alloc_empty(Tier tier, const char* term) { return add(tier, term, 0.0, false); }
  int reserve(Tier tier, const char* term, double bytes) { return bytes <= 0.0 ? -1 : add(tier, term, bytes, true); }
  void free(int& id) {
    if (id < 0) return;
    const size_t index = static_cast<size_t>(id) & kIndexMask;
    Entry& e = entries_.at(index);
    LOOM_CHECK(e.live && e.generation == id >> kIndexBits, "memory model: a tensor freed twice");
    e.live = false;
    const int t = static_cast<int>(e.tier);
    // The first free after a new peak: what is live is still the peak's.
    if (peak_terms_stale_[t]) keep_peak_terms(t);
    live_[t] -= e.bytes;
    by_term_[t][e.term] -= e.bytes;
    if (e.raw)
      reserved_[t] -= e.bytes;
    else
      ++cached_[t][static_cast<size_t>(e.block_slot)];
    freed_indices_.push_back(index);
    id = -1;
  }
  void free_all(std::vector<int>& ids) {
    for (int& id : ids) free(id);
    ids.clear();
  }
  // The phase is `name` then `suffix`; both must outlive the replay.
  void set_phase(const char* name, const char* suffix = "") {
    phase_name_ = name;
    phase_suffix_ = suffix;
  }
  void set_phase(const std::string& name, const char* suffix) { set_phase(name.c_str(), suffix); }
  void set_phase(std::string&&, const char*) = delete;
  // Allocator::reset_peak: the high-water marks start again from what is live.
  void reset_peaks() {
    for (int t = 0; t < 3; ++t) {
      new_peak(t);
      peak_[t].reserved = reserved_[t];
    }
  }
  TierPeak peak(Tier tier) {
    if (peak_terms_stale_[static_cast<int>(tier)]) keep_peak_terms(static_cast<int>(tier));
    const Peak& p = peak_[static_cast<int>(tier)];
    TierPeak out{.bytes = p.bytes, .reserved = p.reserved, .phase = str(p.phase_name, p.phase_suffix), .terms = {}};
    // In name order, as they were kept before terms were interned.
    std::vector<size_t> order(p.terms.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return std::strcmp(term_names_[a], term_names_[b]) < 0; });
    for (size_t i : order)
      if (p.terms[i] > 0.0) out.terms.push_back({term_names_[i], p.terms[i]});
    return out;
  }

 private:
  struct Entry {
    Tier tier;
    int term;
    double bytes;
    int block_slot;  // the block size's index in cached_, unless raw
    bool raw;
    bool live;
    int generation;  // how often the entry was taken again, mod kGenerations
  };
  // A freed entry is taken again, so that the entries stay as many as are
  // live at once, and in cache. An id is the entry's index and its
  // generation, so that freeing a tensor twice is still caught after its
  // entry was taken again.
  static constexpr int kIndexBits = 24, kGenerations = 1 << (31 - kIndexBits);
  static constexpr size_t kIndexMask = (size_t{1} << kIndexBits) - 1;
  // A peak as the replay keeps it: bytes per interned term.
  struct Peak {
    double bytes = 0.0, reserved = 0.0;
    const char* phase_name = "start of step";
    const char* phase_suffix = "";
    std::vector<double> terms;
  };
  // The term's index: by pointer first (the names are constants), else by
  // text, so one name spelt in two places is still one term.
  int intern(const char* term) {
    for (size_t i = 0; i < term_names_.size(); ++i)
      if (term_names_[i] == term) return static_cast<int>(i);
    for (size_t i = 0; i < term_names_.size(); ++i)
      if (std::strcmp(term_names_[i], term) == 0) return static_cast<int>(i);
    term_names_.push_back(term);
    for (std::vector<double>& bytes : by_term_) bytes.push_back(0.0);
    return static_cast<int>(term_names_.size()) - 1;
  }
  // The index of a block size in cached_[t]. A replay meets a score of
  // sizes at most, so a scan beats hashing; consecutive requests are often
  // of one size, so the last one found is tried first.
  int block_slot(int t, size_t block) {
    std::vector<size_t>& sizes = block_sizes_[t];
    if (const int last = last_slot_[t]; last >= 0 && sizes[static_cast<size_t>(last)] == block) return last;
    for (size_t i = 0; i < sizes.size(); ++i)
      if (sizes[i] == block) return last_slot_[t] = static_cast<int>(i);
    sizes.push_back(block);
    cached_[t].push_back(0);
    return last_slot_[t] = static_cast<int>(sizes.size()) - 1;
  }
  int add(Tier tier, const char* term, double bytes, bool raw) {
    const int t = static_cast<int>(tier);
    int slot = -1;
    if (raw) {
      reserved_[t] += bytes;
    } else {
      const size_t block = detail::size_class(static_cast<size_t>(bytes));
      slot = block_slot(t, block);
      if (int& free_blocks = cached_[t][static_cast<size_t>(slot)]; free_blocks > 0)
        --free_blocks;
      else
        reserved_[t] += static_cast<double>(block);
    }
    const int term_id = intern(term);
    live_[t] += bytes;
    by_term_[t][static_cast<size_t>(term_id)] += bytes;
    if (live_[t] > peak_[t].bytes) new_peak(t);
    peak_[t].reserved = std::max(peak_[t].reserved, reserved_[t]);
    Entry entry{tier, term_id, bytes, slot, raw, true, 0};
    size_t index = entries_.size();
    if (!freed_indices_.empty()) {
      index = freed_indices_.back();
      freed_indices_.pop_back();
      entry.generation = (entries_[index].generation + 1) % kGenerations;
      entries_[index] = entry;
    } else {
      LOOM_CHECK(index <= kIndexMask, "memory model: more than ", kIndexMask + 1, " tensors live at once");
      entries_.push_back(entry);
    }
    return static_cast<int>(index) | (entry.generation << kIndexBits);
  }
  // A new high-water mark. Its terms are copied when something is next
  // freed (or the peak is asked for): until then only allocations follow,
  // each a new peak, and copying every term at each of them cost the
  // search a tenth of its time.
  void new_peak(int t) {
    Peak& p = peak_[t];
    p.bytes = live_[t];
    p.phase_name = phase_name_;
    p.phase_suffix = phase_suffix_;
    peak_terms_stale_[t] = true;
  }
  void keep_peak_terms(int t) {
    peak_[t].terms = by_term_[t];
    peak_terms_stale_[t] = false;
  }
  std::vector<Entry> entries_;
  double live_[3] = {0.0, 0.0, 0.0}, reserved_[3] = {0.0, 0.0, 0.0};
  std::vector<const char*> term_names_;
  std::vector<double> by_term_[3];
  std::vector<size_t> freed_indices_;  // of entries_, to be taken again
  // Per tier: the block sizes met and each one's free blocks.
  std::vector<size_t> block_sizes_[3];
  std::vector<int> cached_[3];
  int last_slot_[3] = {-1, -1, -1};
  Peak peak_[3];
  bool peak_terms_stale_[3] = {false, false, false};
  const char* phase_name_ = "start of step";
  const char* phase_suffix_ = "";
};

// Term names: model state, then what a step adds to it.
constexpr const char* kParams = "parameters";
constexpr const char* kGrads = "gradients";
constexpr const char* kMaster = "fp32 master weights";
constexpr const char* kMoments = "adamw moments";
constexpr const char* kFrozen = "frozen base weights";
constexpr const char* kCompute = "fp32 working copies";
constexpr const char* kGathered = "gathered zero-3 groups";
constexpr const char* kBuckets = "gradient buckets";
constexpr const char* kKept = "activations kept for backward";
constexpr const char* kTransient = "kernel temporaries";
constexpr const char* kPipeline = "pipeline transfers";
constexpr const char* kBatch = "batch tokens and loss";

// ---------------------------------------------------------------------------
// What a rank holds: its parameter groups, from the modules' constructors
// (nn/*.cpp) with this rank's tensor-parallel shapes.
// ---------------------------------------------------------------------------

// One parameter of a Linear (nn/linear.cpp): `stored_rows` x in elements on
// this rank, of which the layer multiplies by `rows` (fewer only for k and
// v held whole when there are fewer kv heads than ranks), and its adapter.
struct LinearPart {
  int64_t stored_rows = 0, rows = 0;
  int64_t lora_r = 0;
  bool partial_grad = false;  // replicated over tp with partial gradients
};

struct LinearShape {
  int64_t in = 0;  // this rank's input features
  bool bias = false;
  bool column = true;  // ColumnParallelLinear, or RowParallelLinear
  std::vector<LinearPart> parts;
  int64_t out() const {
    int64_t n = 0;
    for (const LinearPart& p : parts) n += p.rows;
    return n;
  }
  bool stacked() const { return parts.size() > 1; }
  double base_numel() const {
    double n = 0.0;
    for (const LinearPart& p : parts) n += static_cast<double>(p.stored_rows) * (static_cast<double>(in) + (bias ? 1 : 0));
    return n;
  }
  // Linear::add_adapter: A [r, in] beside W's input split, B [rows, r] beside
  // its output split.
  double adapter_numel() const {
    double n = 0.0;
    for (const LinearPart& p : parts)
      n += static_cast<double>(p.lora_r) * static_cast<double>(in + p.stored_rows);
    return n;
  }
};

// A grid's linear layer (GridLinear, nn/summa_linear.cpp and
// nn/cube_linear.cpp) on this rank: each part's stored weight rows (of
// `in` local columns) and output features, its bias's elements and the
// axes its gradients are partial sums over.
struct GridLinearShape {
  struct Piece {
    int64_t stored_rows = 0, features = 0;
  };
  int64_t in = 0;  // this rank's input columns
  bool bias = false;
  bool cube = false;
  std::vector<Piece> pieces;
  TpAxes weight_partial = 0, bias_partial = 0;
  int64_t out() const {
    int64_t n = 0;
    for (const Piece& p : pieces) n += p.features;
    return n;
  }
  int64_t stored() const {
    int64_t n = 0;
    for (const Piece& p : pieces) n += p.stored_rows;
    return n;
  }
  bool stacked() const { return pieces.size() > 1; }
};

// The parts of one rank's model for a micro-batch of N = B T tokens.
struct Geometry {
  GPTConfig cfg;
  int64_t tp = 1;
  bool sp = false;
  TensorGridShape grid;  // ranks() 1: 1D
  int64_t B = 1, T = 1;
  int64_t N() const { return B * T; }
  bool on_grid() const { return grid.ranks() > 1; }
  // Token rows between the blocks' tensor-parallel regions
  // (TensorParallel::local_rows), and inside them (all of them in 1D, a
  // grid's token group's).
  int64_t rows() const { return on_grid() ? N() / (int64_t{grid.q} * grid.depth) : sp ? N() / tp : N(); }
  int64_t inner_rows() const { return on_grid() ? rows() : N(); }
  int64_t C() const { return cfg.n_embd; }
  // This rank's columns of the hidden width between the regions.
  int64_t width() const { return on_grid() ? C() / grid.q : C(); }
  int64_t Q() const { return cfg.q_dim(); }  // q's and attention output's width
  int64_t feature_parts() const { return on_grid() ? grid.q : tp; }
  int64_t local_heads() const { return cfg.n_head / feature_parts(); }
  int64_t local_vocab() const {
    if (!on_grid()) return (cfg.vocab_size + tp - 1) / tp;
    return GridLinear::local_features(cfg.vocab_size, grid);
  }
  // The token table's rows this rank stores (TensorGrid::linear_cut).
  int64_t table_rows() const {
    if (!on_grid()) return local_vocab();
    const int64_t parts = grid.cube ? int64_t{grid.q} * grid.q : grid.q;
    return (cfg.vocab_size + parts - 1) / parts;
  }
  int64_t local_I() const { return cfg.intermediate() / feature_parts(); }
  double norm_numel() const { return static_cast<double>(width()) * (cfg.norm == NormKind::layernorm ? 2.0 : 1.0); }
  double norm_stats() const { return static_cast<double>(rows()) * (cfg.norm == NormKind::layernorm ? 2.0 : 1.0); }
  bool lora() const { return cfg.lora.enabled(); }

  // CausalSelfAttention: c_attn (q | k | v, column-parallel), c_proj (row).
  LinearShape c_attn() const {
    LinearShape l{C(), cfg.attention_bias, true, {}};
    const int64_t hs = cfg.head_dim(), nkv = cfg.kv_heads();
    if (cfg.packed_qkv) {
      l.parts.push_back({3 * Q() / tp, 3 * Q() / tp, cfg.adapter("attn.c_attn").r});
      return l;
    }
    l.parts.push_back({Q() / tp, Q() / tp, cfg.adapter("attn.q").r});
    const bool split = nkv % tp == 0;
    for (const char* name : {"attn.k", "attn.v"})
      l.parts.push_back({split ? nkv * hs / tp : nkv * hs, split ? nkv * hs / tp : hs, cfg.adapter(name).r, !split});
    return l;
  }
  LinearShape attn_proj() const { return {Q() / tp, cfg.attention_bias, false, {{C(), C(), cfg.adapter("attn.c_proj").r}}}; }
  // MLP: c_fc (GELU) or gate | up (SwiGLU), column-parallel; c_proj, row.
  LinearShape c_fc() const {
    LinearShape l{C(), cfg.mlp_bias, true, {}};
    if (cfg.mlp == MlpKind::gelu) {
      l.parts.push_back({local_I(), local_I(), cfg.adapter("mlp.c_fc").r});
    } else {
      for (const char* name : {"mlp.gate", "mlp.up"}) l.parts.push_back({local_I(), local_I(), cfg.adapter(name).r});
    }
    return l;
  }
  LinearShape mlp_proj() const { return {local_I(), cfg.mlp_bias, false, {{C(), C(), cfg.adapter("mlp.c_proj").r}}}; }
  std::vector<LinearShape> block_linears() const { return {c_attn(), attn_proj(), c_fc(), mlp_proj()}; }

  // A grid's layer of parts with `outs` global rows each (`blocks` each),
  // `in` global inputs.
  GridLinearShape grid_linear(const std::vector<std::pair<int64_t, int64_t>>& outs, int64_t in, bool bias,
                              GridSide side) const {
    const int64_t q = grid.q;
    GridLinearShape l{in / q, bias, grid.cube, {}, 0, 0};
    for (const auto& [out, blocks] : outs) {
      const int64_t rows_per_block = out / blocks;
      const int64_t parts = grid.cube ? q * q : q;
      const int64_t stored = blocks * ((rows_per_block + parts - 1) / parts);
      l.pieces.push_back({stored, grid.cube ? stored * q : stored});
    }
    // SUMMA's copies along the depth sum their weight gradients; a cube's
    // are whole. A bias is held by every token row of its output's split.
    l.weight_partial = !grid.cube && grid.depth > 1 ? kTpDepth : 0;
    l.bias_partial = grid.cube && side == GridSide::entering ? kTpCols | kTpDepth : kTpRows | kTpDepth;
    return l;
  }
  GridLinearShape grid_c_attn() const {
    const int64_t kv = cfg.kv_heads() * cfg.head_dim();
    return grid_linear(cfg.packed_qkv ? std::vector<std::pair<int64_t, int64_t>>{{3 * Q(), 3}}
                                      : std::vector<std::pair<int64_t, int64_t>>{{Q(), 1}, {kv, 1}, {kv, 1}},
                       C(), cfg.attention_bias, GridSide::entering);
  }
  GridLinearShape grid_attn_proj() const { return grid_linear({{C(), 1}}, Q(), cfg.attention_bias, GridSide::leaving); }
  GridLinearShape grid_c_fc() const {
    const int64_t I = cfg.intermediate();
    return grid_linear(cfg.mlp == MlpKind::swiglu ? std::vector<std::pair<int64_t, int64_t>>{{I, 1}, {I, 1}}
                                                  : std::vector<std::pair<int64_t, int64_t>>{{I, 1}},
                       C(), cfg.mlp_bias, GridSide::entering);
  }
  GridLinearShape grid_mlp_proj() const {
    return grid_linear({{C(), 1}}, cfg.intermediate(), cfg.mlp_bias, GridSide::leaving);
  }
  // The output head over the token table (GridLinear's head constructor).
  GridLinearShape grid_head() const {
    GridLinearShape l{width(), false, grid.cube, {}, 0, 0};
    l.pieces.push_back({table_rows(), local_vocab()});
    return l;
  }
  std::vector<GridLinearShape> grid_block_linears() const {
    return {grid_c_attn(), grid_attn_proj(), grid_c_fc(), grid_mlp_proj()};
  }
};

// A parameter group (ParamLayout::add_group): elements that train and elements
// frozen (LoRA freezes the whole base model, GPT's constructor), and those of
// its trainable elements whose gradient is a partial sum over tp or summed
// with a tied copy on another stage (Trainer::reduce_model_parallel_gradients).
struct Group {
  std::string name;
  double trainable = 0.0, frozen = 0.0;
  std::vector<double> frozen_params;  // each frozen parameter's elements: each is a tensor of its own
  // Elements by the reduction that completes their gradients: the tp axes
  // they are partial sums over (1D: kTpAll), or kTiedStages.
  std::map<int, double> partial;
};

// The reduction of the gradients of a parameter tied across pipeline
// stages, after the tensor-parallel ones (Trainer::reduce_model_parallel_gradients).
constexpr int kTiedStages = kTpAll + 1;

// Every group's partial elements by reduction.
std::map<int, double> partial_elements(const std::vector<Group>& groups) {
  std::map<int, double> total;
  for (const Group& g : groups)
    for (const auto& [reduction, n] : g.partial) total[reduction] += n;
  return total;
}

struct RankModel {
  std::vector<Group> groups;
  int embedding = -1, ln_f = -1, head = -1;  // group indices; head == embedding when tied on one stage
  std::vector<std::vector<int>> chunks;      // block groups of each chunk
  bool first = true, last = true;
};

// `reduction`: the one that completes the parameter's gradient (0: none).
void add_params(Group& g, const Geometry& geo, double numel, int reduction) {
  (geo.lora() ? g.frozen : g.trainable) += numel;
  if (geo.lora()) g.frozen_params.push_back(numel);
  if (reduction != 0 && !geo.lora() && numel > 0.0) g.partial[reduction] += numel;
}

// What completes the gradient of a parameter along the hidden columns
// between the regions (norms, positions): a grid's token axes, or under
// sequence parallelism the tp group.
int column_reduction(const Geometry& geo) { return geo.on_grid() ? kTpRows | kTpDepth : geo.sp ? kTpAll : 0; }

// A Norm's weight and LayerNorm's bias, a rank's width each.
void add_norm(Group& g, const Geometry& geo) {
  for (double n = 0.0; n < geo.norm_numel(); n += static_cast<double>(geo.width()))
    add_params(g, geo, static_cast<double>(geo.width()), column_reduction(geo));
}

void add_grid_linear(Group& g, const Geometry& geo, const GridLinearShape& l) {
  for (const GridLinearShape::Piece& p : l.pieces) {
    add_params(g, geo, static_cast<double>(p.stored_rows * l.in), l.weight_partial);
    if (l.bias) add_params(g, geo, static_cast<double>(p.features), l.bias_partial);
  }
}

Group block_group(const Geometry& geo, int layer) {
  Group g{"h." + std::to_string(layer), 0.0, 0.0, {}, {}};
  if (geo.on_grid()) {
    const std::vector<GridLinearShape> linears = geo.grid_block_linears();
    for (size_t i = 0; i < linears.size(); ++i) {
      if (i % 2 == 0) add_norm(g, geo);
      add_grid_linear(g, geo, linears[i]);
    }
    return g;
  }
  const std::vector<LinearShape> linears = geo.block_linears();
  for (size_t i = 0; i < linears.size(); ++i) {
    // Block: ln_1, attention's two linears, ln_2, the MLP's two.
    if (i % 2 == 0) add_norm(g, geo);
    const LinearShape& l = linears[i];
    for (const LinearPart& p : l.parts) {
      const double w = static_cast<double>(p.stored_rows) * static_cast<double>(l.in);
      const double b = l.bias ? static_cast<double>(p.stored_rows) : 0.0;
      add_params(g, geo, w, p.partial_grad ? kTpAll : 0);
      // A row-parallel layer's bias is whole on every rank and its gradient
      // partial under sequence parallelism (RowParallelLinear).
      add_params(g, geo, b, p.partial_grad || (!l.column && geo.sp) ? kTpAll : 0);
      if (p.lora_r > 0) {
        const double a = static_cast<double>(p.lora_r * l.in), bb = static_cast<double>(p.stored_rows * p.lora_r);
        g.trainable += a + bb;
        // The factor on W's unsplit side is replicated with a partial
        // gradient (Linear::add_adapter).
        if (geo.tp > 1) g.partial[kTpAll] += p.partial_grad ? a + bb : (l.column ? a : bb);
      }
    }
  }
  return g;
}

RankModel rank_model(const Geometry& geo, const std::vector<LayerRange>& chunks, bool first, bool last, int pp) {
  RankModel m;
  m.first = first;
  m.last = last;
  const GPTConfig& cfg = geo.cfg;
  const double table = static_cast<double>(geo.table_rows() * geo.width());
  if (first) {
    Group g{"embedding", 0.0, 0.0, {}, {}};
    add_params(g, geo, table, pp > 1 && last == false && cfg.tied_embeddings ? kTiedStages : 0);
    if (cfg.positions == PositionKind::learned)
      add_params(g, geo, static_cast<double>(cfg.block_size * geo.width()), column_reduction(geo));
    m.embedding = static_cast<int>(m.groups.size());
    m.groups.push_back(g);
  }
  for (const LayerRange& c : chunks) {
    std::vector<int> ids;
    for (int i = c.begin; i < c.end; ++i) {
      ids.push_back(static_cast<int>(m.groups.size()));
      m.groups.push_back(block_group(geo, i));
    }
    m.chunks.push_back(ids);
  }
  if (last) {
    Group g{"ln_f", 0.0, 0.0, {}, {}};
    add_norm(g, geo);
    m.ln_f = static_cast<int>(m.groups.size());
    m.groups.push_back(g);
    if (!cfg.tied_embeddings || !first) {
      Group h{"head", 0.0, 0.0, {}, {}};
      add_params(h, geo, table, cfg.tied_embeddings ? kTiedStages : 0);
      m.head = static_cast<int>(m.groups.size());
      m.groups.push_back(h);
    } else {
      m.head = m.embedding;
    }
  }
  return m;
}

// ---------------------------------------------------------------------------
// The chunk stores of a memory policy (memory/chunk_*.cpp) over the
// trainable layout: payloads where the placement puts them, whole chunks
// gathered on the device while acquired and prefetched, gradient chunks,
// and the optimizer's staging; and every move between tiers the manager
// counts (ChunkManager::Impl::count), where it counts it.
// ---------------------------------------------------------------------------

// Budgets that hold every chunk on the device: the planner's assumption for
// auto placement (predict_step_memory's comment).
TierBytes unlimited_tiers() {
  TierBytes b;
  for (int t = 0; t < kNumTiers; ++t) b.bytes[static_cast<size_t>(t)] = std::numeric_limits<int64_t>::max() / 4;
  return b;
}

class ChunkModel {
 public:
  ChunkModel(Timeline& tl, const ParamLayout& layout, const MemoryOptions& opts, DType precision, int ranks, int rank)
      : tl_(tl),
        layout_(layout),
        opts_(opts),
        w_(static_cast<double>(dtype_size(precision))),
        precision_(precision),
        ranks_(ranks),
        rank_(rank),
        plan_(plan_memory(layout, opts, precision, ranks, 0, unlimited_tiers())),
        chunks_(layout, plan_.search.chunk_numel, ranks),
        cs_(static_cast<size_t>(chunks_.num_chunks())),
        group_refs_(static_cast<size_t>(layout.num_groups()), 0),
        group_compute_(static_cast<size_t>(layout.num_groups()), -1),
        reuse_(opts.micro_batches == 1) {
    const double S = shard();
    // The manager's AdamW keeps its moments in the payloads: its own are empty.
    for (int moment = 0; moment < 2; ++moment) tl_.alloc_empty(Tier::device, kMoments);
    // ChunkManager::Impl::initialize: each payload on its tier; NVMe ones
    // in slots of one scratch file, reserved whole (NvmeFile); the initial
    // values staged on the host a shard at a time.
    double file = 0.0;
    for (int c = 0; c < chunks_.num_chunks(); ++c) {
      Chunk& s = cs_[static_cast<size_t>(c)];
      s.param_tier = plan_.placement.param[static_cast<size_t>(c)];
      s.optim_tier = plan_.placement.optim[static_cast<size_t>(c)];
      s.not_ready = chunks_.chunk(c).end_param - chunks_.chunk(c).first_param;
      for (auto [tier, bytes] : {std::pair{s.param_tier, S * w_}, {s.optim_tier, optim_bytes()}})
        if (tier == Tier::nvme) file += io_bytes(bytes);
    }
    tl_.reserve(Tier::nvme, "chunk payloads on NVMe", file);
    int values = tl_.alloc(Tier::host, kTransient, 3.0 * S * kF32), working = tl_.alloc(Tier::host, kTransient, S * w_);
    for (Chunk& s : cs_) {
      s.param = payload(s.param_tier, S * w_);
      s.optim = payload(s.optim_tier, optim_bytes());
      if (!reuse_) s.grad_shard = tl_.alloc(s.optim_tier == Tier::device ? Tier::device : Tier::host, kGrads, S * kF32);
    }
    tl_.free(values);
    tl_.free(working);
  }

  void acquire(int group) {
    for (int c : chunks_.chunks_of_group(group)) {
      Chunk& s = cs_[static_cast<size_t>(c)];
      if (in_step_) {
        if (recording_) {
          recorded_.push_back(c);
        } else if (cursor_ < order_.size() && order_[cursor_] == c) {
          ++cursor_;
        } else {
          order_.clear();
          cursor_ = 0;
        }
      }
      materialize(c, true);
      ++s.refs;
    }
    // Kernels compute in fp32: a 2-byte group is converted once per acquire.
    if (group_refs_[static_cast<size_t>(group)]++ == 0 && precision_ != DType::f32) {
      const auto [begin, end] = layout_.group_range(group);
      group_compute_[static_cast<size_t>(group)] = tl_.alloc(kCompute, static_cast<double>(end - begin) * kF32);
    }
    if (in_step_ && !recording_)
      for (size_t i = cursor_; i < std::min(order_.size(), cursor_ + static_cast<size_t>(opts_.prefetch)); ++i)
        materialize(order_[i], false);
  }
  void release(int group) {
    if (--group_refs_[static_cast<size_t>(group)] == 0) tl_.free(group_compute_[static_cast<size_t>(group)]);
    for (int c : chunks_.chunks_of_group(group)) {
      Chunk& s = cs_[static_cast<size_t>(c)];
      if (--s.refs > 0) continue;
      if (s.write_pending) retire(c);
      if (!s.aliased && !wanted_soon(c)) drop(c);
    }
  }
  // ChunkManager::Impl::grad: a whole fp32 chunk per chunk a gradient is
  // written into, at the first write of one of its parameters: the group's
  // parameters [first, first + count).
  void touch_grads(int group, int first, int count) {
    std::vector<int> ids;
    for (int id = 0; id < static_cast<int>(layout_.params().size()); ++id)
      if (layout_.param(id).group == group) ids.push_back(id);
    for (int i = first; i < std::min<int>(first + count, static_cast<int>(ids.size())); ++i) {
      const int c = chunks_.chunk_of_param(ids[static_cast<size_t>(i)]);
      Chunk& s = cs_[static_cast<size_t>(c)];
      if (s.reduced >= 0) {
        in_flight_.erase(std::find(in_flight_.begin(), in_flight_.end(), c));
        retire(c);
      }
      if (s.grad < 0) s.grad = tl_.alloc(kBuckets, chunk_numel() * kF32);
    }
  }
  void group_ready(int group) {
    for (int id = 0; id < static_cast<int>(layout_.params().size()); ++id) {
      if (layout_.param(id).group != group) continue;
      const int c = chunks_.chunk_of_param(id);
      if (--cs_[static_cast<size_t>(c)].not_ready == 0) reduce(c);
    }
  }
  void finish() {
    while (!in_flight_.empty()) {
      const int c = in_flight_.front();
      in_flight_.erase(in_flight_.begin());
      retire(c);
    }
  }
  void begin_step() {
    in_step_ = true;
    cursor_ = 0;
    recording_ = order_.empty();
    recorded_.clear();
    phase_ = &traffic_.model;
  }
  void end_step() {
    if (recording_) order_ = recorded_;
    in_step_ = false;
    for (int c = 0; c < chunks_.num_chunks(); ++c)
      if (cs_[static_cast<size_t>(c)].refs == 0 && !cs_[static_cast<size_t>(c)].aliased) drop(c);
  }
  // The moves counted since the last reset.
  const StepTraffic& traffic() const { return traffic_; }
  void reset_traffic() { traffic_ = {}; }
  // ChunkManager::Impl::step: per chunk, the update where its optimizer
  // state lives, with an fp32 gradient buffer per tier, parameters staged
  // there when they live elsewhere, NVMe state read two ahead and written
  // behind, and the rounded parameters stored back.
  void step() {
    phase_ = &traffic_.update;
    const double S = shard(), P = S * w_;
    int grads[kNumTiers] = {-1, -1, -1}, staged[kNumTiers] = {-1, -1, -1};
    std::vector<int> ahead;
    int next_read = 0;
    const int n = chunks_.num_chunks();
    for (int c = 0; c < n; ++c) {
      Chunk& s = cs_[static_cast<size_t>(c)];
      if (chunks_.owned(c, rank_).numel() == 0) continue;
      // A read issued for the chunk about to be updated is waited for at
      // once; the others run while earlier chunks update.
      for (; next_read < n && ahead.size() < 2; ++next_read)
        if (cs_[static_cast<size_t>(next_read)].optim_tier == Tier::nvme &&
            chunks_.owned(next_read, rank_).numel() > 0) {
          ahead.push_back(tl_.reserve(Tier::host, kTransient, io_bytes(optim_bytes())));
          count(Tier::nvme, Tier::host, optim_bytes(), next_read != c);
        }
      const Tier on = s.optim_tier == Tier::device ? Tier::device : Tier::host;
      int state = -1;
      if (s.optim_tier == Tier::nvme) {
        state = ahead.front();
        ahead.erase(ahead.begin());
      }
      int& g = grads[static_cast<int>(on)];
      if (g < 0) g = tl_.alloc(on, kTransient, S * kF32);
      // load: the gradient in the parameters' payload staged where the
      // update runs (read from NVMe at once into a host buffer first).
      if (reuse_ && s.param_tier != on) {
        int& st = staged[static_cast<int>(on)];
        if (st < 0) st = tl_.alloc(on, kTransient, S * w_);
        if (s.param_tier == Tier::nvme) {
          int read = tl_.reserve(Tier::host, kTransient, io_bytes(S * w_));
          tl_.free(read);
        }
        load(s.param_tier, on, P);
      }
      // publish: rounded into the payload, or through a zeroed buffer on `on`.
      if (s.param_tier != on) {
        int rounded = tl_.alloc(on, kTransient, S * w_);
        if (s.param_tier == Tier::nvme) write_behind(tl_.reserve(Tier::host, kTransient, io_bytes(S * w_)));
        store(on, s.param_tier, P);
        tl_.free(rounded);
      }
      if (state >= 0) {
        write_behind(state);
        count(Tier::host, Tier::nvme, optim_bytes(), true);
      }
    }
    for (int& g : grads) tl_.free(g);
    for (int& st : staged) tl_.free(st);
    for (int c = 0; c < n; ++c)
      if (!cs_[static_cast<size_t>(c)].aliased) drop(c);
    if (++steps_seen_ == 1 && opts_.policy == MemoryPolicy::automatic) place_after_warm_up();
  }

 private:
  struct Chunk {
    Tier param_tier = Tier::device, optim_tier = Tier::device;
    int param = -1, optim = -1, grad_shard = -1;
    int full = -1, staged = -1, read_buffer = -1;
    bool aliased = false;
    int refs = 0, not_ready = 0;
    int grad = -1, reduced = -1;
    bool write_pending = false;
  };
  double shard() const { return static_cast<double>(chunks_.shard_numel()); }
  double chunk_numel() const { return static_cast<double>(chunks_.chunk_numel()); }
  double optim_bytes() const { return static_cast<double>(optim_payload_bytes(chunks_.shard_numel())); }
  static double io_bytes(double bytes) { return static_cast<double>(round_up(static_cast<int64_t>(bytes), int64_t(kIoAlign))); }
  int payload(Tier tier, double bytes) {
    return tier == Tier::nvme ? -1 : tl_.alloc(tier, tier == Tier::device ? kParams : "chunk payloads on the host", bytes);
  }
  bool wanted_soon(int c) const {
    if (!in_step_ || recording_) return false;
    const size_t end = std::min(order_.size(), cursor_ + static_cast<size_t>(opts_.prefetch) + 1);
    for (size_t i = cursor_; i < end; ++i)
      if (order_[i] == c) return true;
    return false;
  }
  // ChunkManager::Impl::materialize: one rank computes on a device payload
  // in place, else copies the shard (an NVMe one read ahead into a host
  // buffer); several ranks stage an off-device shard and all-gather the
  // whole chunk.
  // A prefetch (wait = false) starts the copy or the NVMe read ahead of
  // use; an NVMe chunk's copy to the device waits for its use. Several
  // ranks read an NVMe shard at once (read_now), and the all-gather's issue
  // synchronizes the rank's streams, so their copies are waited for.
  void materialize(int c, bool wait) {
    Chunk& s = cs_[static_cast<size_t>(c)];
    if (s.full >= 0 || s.aliased) return;
    if (opts_.policy == MemoryPolicy::automatic && steps_seen_ > 0 && s.param_tier == Tier::host) cache(s);
    const double S = shard(), P = S * w_;
    if (ranks_ == 1) {
      if (s.param_tier == Tier::device) {
        s.aliased = true;
        return;
      }
      if (s.param_tier == Tier::nvme) {
        if (s.read_buffer < 0) {
          s.read_buffer = tl_.reserve(Tier::host, kTransient, io_bytes(P));
          count(Tier::nvme, Tier::host, P, !wait);
        }
        if (!wait) return;
        s.full = tl_.alloc(kGathered, P);
        count(Tier::host, Tier::device, P, false);
        tl_.free(s.read_buffer);
        return;
      }
      s.full = tl_.alloc(kGathered, P);
      count(Tier::host, Tier::device, P, !wait);
      return;
    }
    if (s.param_tier != Tier::device) {
      s.staged = tl_.alloc(kGathered, P);
      load(s.param_tier, Tier::device, P);
    }
    s.full = tl_.alloc(kGathered, chunk_numel() * w_);
  }
  void drop(int c) {
    Chunk& s = cs_[static_cast<size_t>(c)];
    tl_.free(s.full);
    tl_.free(s.staged);
    tl_.free(s.read_buffer);
    s.aliased = false;
  }
  // auto after its warm-up, with budgets that hold every chunk
  // (place_after_warm_up): the optimizer state moves to the device, and
  // each chunk's parameters follow at their first use (cache).
  void place_after_warm_up() {
    for (Chunk& s : cs_) {
      if (s.optim_tier == Tier::device) continue;
      const int moved = tl_.alloc(kMoments, optim_bytes());
      tl_.free(s.optim);
      s.optim = moved;
      load(s.optim_tier, Tier::device, optim_bytes());
      s.optim_tier = Tier::device;
      if (s.grad_shard >= 0) {
        const int g = tl_.alloc(kGrads, shard() * kF32);
        tl_.free(s.grad_shard);
        s.grad_shard = g;
        count(Tier::host, Tier::device, shard() * kF32, false);
      }
    }
  }
  void cache(Chunk& s) {
    const int moved = tl_.alloc(kParams, shard() * w_);
    tl_.free(s.param);
    s.param = moved;
    count(s.param_tier, Tier::device, shard() * w_, false);
    s.param_tier = Tier::device;
  }
  // ChunkManager::Impl::reduce: one rank writes the gradient at once,
  // several reduce-scatter it into an fp32 shard, two chunks in flight.
  void reduce(int c) {
    Chunk& s = cs_[static_cast<size_t>(c)];
    s.not_ready = chunks_.chunk(c).end_param - chunks_.chunk(c).first_param;
    if (s.grad < 0) s.grad = tl_.alloc(kBuckets, chunk_numel() * kF32);
    if (ranks_ == 1) {
      retire(c);
      return;
    }
    s.reduced = tl_.alloc(kBuckets, shard() * kF32);
    in_flight_.push_back(c);
    while (in_flight_.size() > 2) {
      const int oldest = in_flight_.front();
      in_flight_.erase(in_flight_.begin());
      retire(oldest);
    }
  }
  // ChunkManager::Impl::retire and write_gradient: with one micro-batch the
  // gradient, rounded to the working precision, overwrites the parameter
  // payload once no group of the chunk is acquired; with several it is
  // added into the gradient shard, moved there first when that is on the host.
  void retire(int c) {
    Chunk& s = cs_[static_cast<size_t>(c)];
    if (reuse_ && s.refs > 0) {
      s.write_pending = true;
      return;
    }
    s.write_pending = false;
    const double S = shard();
    if (reuse_) {
      int rounded = precision_ != DType::f32 ? tl_.alloc(kTransient, S * w_) : -1;
      if (s.param_tier == Tier::nvme) write_behind(tl_.reserve(Tier::host, kTransient, io_bytes(S * w_)));
      store(Tier::device, s.param_tier, S * w_);
      tl_.free(rounded);
    } else if (s.optim_tier != Tier::device) {
      int moved = tl_.alloc(Tier::host, kTransient, S * kF32);
      count(Tier::device, Tier::host, S * kF32, false);
      tl_.free(moved);
    }
    tl_.free(s.grad);
    tl_.free(s.reduced);
  }
  // ChunkManager::Impl::count: the bytes of one move between tiers, in the
  // step's phase, waited for or started ahead of use.
  void count(Tier from, Tier to, double bytes, bool ahead) {
    if (from == to) return;
    TierMoves& m = ahead ? phase_->ahead : phase_->waited;
    m.bytes.at(from, to) += static_cast<int64_t>(bytes);
    ++m.count.at(from, to);
  }
  // load: a payload on `from` copied to tier `to`, an NVMe one read at once
  // into a host buffer first; the caller waits for both.
  void load(Tier from, Tier to, double bytes) {
    if (from == Tier::nvme) {
      count(Tier::nvme, Tier::host, bytes, false);
      from = Tier::host;
    }
    count(from, to, bytes, false);
  }
  // store: bytes on tier `from` copied into a payload on `to`, one on NVMe
  // through a host buffer whose write runs behind.
  void store(Tier from, Tier to, double bytes) {
    if (to != Tier::nvme) {
      count(from, to, bytes, false);
      return;
    }
    count(from, Tier::host, bytes, false);
    count(Tier::host, Tier::nvme, bytes, true);
  }
  // write_behind: one NVMe write's buffer stays in flight.
  void write_behind(int buffer) {
    writes_.push_back(buffer);
    while (writes_.size() > 1) {
      tl_.free(writes_.front());
      writes_.erase(writes_.begin());
    }
  }

  Timeline& tl_;
  const ParamLayout& layout_;
  MemoryOptions opts_;
  double w_;
  DType precision_;
  int ranks_, rank_;
  MemoryPlan plan_;
  ChunkLayout chunks_;
  std::vector<Chunk> cs_;
  std::vector<int> group_refs_, group_compute_;
  bool reuse_;
  bool in_step_ = false, recording_ = true;
  std::vector<int> order_, recorded_;
  size_t cursor_ = 0;
  std::vector<int> in_flight_, writes_;
  int steps_seen_ = 0;
  StepTraffic traffic_;
  StepTraffic::Phase* phase_ = &traffic_.model;
};

// ---------------------------------------------------------------------------
// The ZeRO stores (zero/*.cpp, store/frozen.cpp) over the trainable groups.
// ---------------------------------------------------------------------------

// The trainable layout of a rank's groups (FrozenParams::trainable): groups
// with a trainable element, in order; one flat parameter per group stands
// for its elements. to_trainable maps each group to its trainable group, or
// -1.
ParamLayout trainable_groups(const RankModel& m, std::vector<int>& to_trainable) {
  ParamLayout trainable;
  for (size_t g = 0; g < m.groups.size(); ++g) {
    const int64_t n = static_cast<int64_t>(m.groups[g].trainable);
    if (n == 0) {
      to_trainable.push_back(-1);
      continue;
    }
    to_trainable.push_back(trainable.add_group(m.groups[g].name));
    trainable.add(m.groups[g].name, {n}, ParamInit::constant(0.0f), false, to_trainable.back());
  }
  return trainable;
}

// Trainer::build_zero_stores' buckets: stage 3 gathers one group per bucket.
ZeroPartition zero_partition(const ParamLayout& trainable, int stage, DType precision, int64_t bucket_bytes,
                             int ranks, int rank) {
  const int64_t bucket_numel = stage == 3 ? 0 : std::max<int64_t>(1, bucket_bytes / int64_t(dtype_size(precision)));
  return ZeroPartition(trainable, ranks, rank, bucket_numel);
}

class StoreModel {
 public:
  // chunks: under a memory policy, the trainable layout the chunk stores
  // hold (they replace the ZeRO stores; the frozen weights stay beside them).
  StoreModel(Timeline& tl, const RankModel& m, int stage, DType precision, int64_t bucket_bytes, int ranks, int rank,
             const ParamLayout* chunks, const MemoryOptions& memory)
      : tl_(tl), m_(m), stage_(stage), w_(precision), wsize_(static_cast<double>(dtype_size(precision))),
        chunked_(chunks != nullptr || memory.policy != MemoryPolicy::none) {
    layout_ = std::make_unique<ParamLayout>(trainable_groups(m, to_trainable_));
    part_ = std::make_unique<ZeroPartition>(zero_partition(*layout_, stage, precision, bucket_bytes, ranks, rank));
    const ZeroPartition& p = *part_;
    resident_.resize(static_cast<size_t>(layout_->num_groups()));
    scratch_.assign(p.buckets().size(), -1);
    groups_left_.resize(p.buckets().size());
    for (size_t b = 0; b < p.buckets().size(); ++b)
      groups_left_[b] = p.buckets()[b].end_group - p.buckets()[b].first_group;
    frozen_refs_.assign(m.groups.size(), 0);
    frozen_copies_.resize(m.groups.size());

    // FrozenParams: each frozen parameter in the working precision.
    for (const Group& g : m.groups)
      for (double n : g.frozen_params) tl.alloc(kFrozen, n * wsize_);
    if (chunks) chunk_ = std::make_unique<ChunkModel>(tl, *chunks, memory, precision, ranks, rank);
    if (chunked_) return;
    // ZeroParamStore: the padded working copy, or stage 3's shard.
    const double padded = static_cast<double>(p.padded_numel()), shard = static_cast<double>(p.shard_numel());
    tl.alloc(kParams, (stage == 3 ? shard : padded) * wsize_);
    // Its initial values are drawn bucket by bucket in fp32.
    for (const ZeroBucket& b : p.buckets()) {
      const FlatRange r = stage == 3 ? p.owned(b) : FlatRange{b.begin, b.end};
      int init = tl.alloc(kTransient, static_cast<double>(r.numel()) * kF32);
      tl.free(init);
    }
    // ZeroGradStore: stages 2-3 accumulate an fp32 shard, 0-1 the padded
    // gradient in the working precision.
    tl.alloc(kGrads, stage >= 2 ? shard * kF32 : padded * wsize_);
    // ZeroOptimizer: the ranges it updates (every bucket under stage 0, the
    // owned blocks otherwise), fp32 masters unless the parameters are fp32,
    // and AdamW's two moments.
    for (const ZeroBucket& b : p.buckets()) {
      const FlatRange r = stage == 0 ? FlatRange{b.begin, b.end} : p.owned(b);
      if (r.numel() > 0) ranges_.push_back(r);
    }
    double owned = 0.0;
    for (const FlatRange& r : ranges_) owned += static_cast<double>(r.numel());
    if (precision != DType::f32) tl.alloc(kMaster, owned * kF32);
    for (int moment = 0; moment < 2; ++moment) tl.alloc(kMoments, owned * kF32);
  }

  // FrozenParamStore::acquire / release, then ZeroParamStore's.
  void acquire(int group) {
    const size_t g = static_cast<size_t>(group);
    if (to_trainable_[g] >= 0 && chunk_) chunk_->acquire(to_trainable_[g]);
    if (to_trainable_[g] >= 0 && !chunked_) acquire_trainable(to_trainable_[g]);
    if (frozen_refs_[g]++ == 0 && w_ != DType::f32)
      for (double n : m_.groups[g].frozen_params) frozen_copies_[g].push_back(tl_.alloc(kCompute, n * kF32));
  }
  void release(int group) {
    const size_t g = static_cast<size_t>(group);
    if (to_trainable_[g] >= 0 && chunk_) chunk_->release(to_trainable_[g]);
    if (to_trainable_[g] >= 0 && !chunked_) release_trainable(to_trainable_[g]);
    if (--frozen_refs_[g] == 0) tl_.free_all(frozen_copies_[g]);
  }
  // ZeroGradStore::grad allocates the bucket's fp32 scratch unless stages
  // 0-1 in fp32 accumulate straight into the gradients.
  // The first grad() of the group's trainable parameters [first, first +
  // count) in a micro-batch's backward.
  void touch_grads(int group, int first = 0, int count = std::numeric_limits<int>::max()) {
    const int t = to_trainable_[static_cast<size_t>(group)];
    if (t >= 0 && chunk_) chunk_->touch_grads(t, first, count);
    if (t < 0 || chunked_ || (stage_ <= 1 && w_ == DType::f32)) return;
    const size_t b = static_cast<size_t>(part_->bucket_index(t));
    if (scratch_[b] < 0) scratch_[b] = tl_.alloc(kBuckets, padded(b) * kF32);
  }
  // ZeroGradStore::group_ready and launch.
  void group_ready(int group) {
    const int t = to_trainable_[static_cast<size_t>(group)];
    if (t >= 0 && chunk_) chunk_->group_ready(t);
    if (t < 0 || chunked_) return;
    const size_t b = static_cast<size_t>(part_->bucket_index(t));
    const ZeroBucket& bucket = part_->buckets()[b];
    if (--groups_left_[b] > 0) return;
    groups_left_[b] = bucket.end_group - bucket.first_group;
    if (stage_ <= 1) {
      if (reduce_) communicate(b);
      return;
    }
    // Stages 2-3: the scratch goes out rounded to the working precision, at
    // most two buckets' reductions outstanding.
    int buffer = scratch_[b];
    scratch_[b] = -1;
    if (w_ != DType::f32) {
      const int converted = tl_.alloc(kBuckets, padded(b) * wsize_);
      tl_.free(buffer);
      buffer = converted;
    }
    in_flight_.push_back({b, buffer});
    while (in_flight_.size() > 2) retire();
  }
  void set_reduce(bool reduce) { reduce_ = reduce; }
  void reduce_all() {
    for (size_t b = 0; b < scratch_.size(); ++b) communicate(b);
  }
  void finish() {
    if (chunk_) chunk_->finish();
    while (!in_flight_.empty()) retire();
  }
  void zero() {
    for (int& s : scratch_) tl_.free(s);
    reduce_ = true;
  }
  void begin_step() {
    if (chunk_) chunk_->begin_step();
    in_step_ = true;
    cursor_ = 0;
    recording_ = order_.empty();
    recorded_.clear();
  }
  void end_step() {
    if (chunk_) chunk_->end_step();
    if (recording_) order_ = recorded_;
    in_step_ = false;
    for (size_t g = 0; g < resident_.size(); ++g)
      if (resident_[g].refs == 0) drop(g);
  }
  // ZeroOptimizer::step: gradients in a 2-byte precision (stages 0-1) are
  // widened range by range into one buffer that grows to the largest.
  void optimizer_step() {
    if (chunk_) chunk_->step();
    if (chunked_) return;
    if (stage_ <= 1 && w_ != DType::f32) {
      int converted = -1;
      int64_t size = 0;
      for (const FlatRange& r : ranges_) {
        if (r.numel() <= size) continue;
        const int bigger = tl_.alloc(kTransient, static_cast<double>(r.numel()) * kF32);
        tl_.free(converted);
        converted = bigger;
        size = r.numel();
      }
      tl_.free(converted);
    }
    if (stage_ == 3)
      for (size_t g = 0; g < resident_.size(); ++g) drop(g);
  }
  int stage() const { return stage_; }
  DType precision() const { return w_; }
  // The chunk stores' moves since the last reset (none without them).
  StepTraffic traffic() const { return chunk_ ? chunk_->traffic() : StepTraffic{}; }
  void reset_traffic() {
    if (chunk_) chunk_->reset_traffic();
  }

 private:
  struct Resident {
    int refs = 0;
    int gathered = -1, compute = -1;
    bool compute_defined = false;  // an fp32 view of `gathered` allocates nothing
  };
  double padded(size_t b) const {
    return static_cast<double>(part_->buckets()[b].shard) * static_cast<double>(part_->ranks());
  }
  bool expected_next(int t) const {
    return in_step_ && !recording_ && cursor_ < order_.size() && order_[cursor_] == t;
  }
  void gather(int t) {
    const ZeroBucket& b = part_->bucket_of_group(t);
    resident_[static_cast<size_t>(t)].gathered =
        tl_.alloc(kGathered, static_cast<double>(b.shard) * part_->ranks() * wsize_);
  }
  void acquire_trainable(int t) {
    if (in_step_) {
      if (recording_) {
        recorded_.push_back(t);
      } else if (expected_next(t)) {
        ++cursor_;
      } else {
        order_.clear();
      }
    }
    Resident& r = resident_[static_cast<size_t>(t)];
    if (r.refs++ == 0 && !r.compute_defined) {
      const auto [begin, end] = layout_->group_range(t);
      const double numel = static_cast<double>(end - begin);
      if (stage_ == 3) {
        if (r.gathered < 0) gather(t);
        if (w_ != DType::f32) r.compute = tl_.alloc(kCompute, numel * kF32);
        r.compute_defined = true;
      } else if (w_ != DType::f32) {
        r.compute = tl_.alloc(kCompute, numel * kF32);
        r.compute_defined = true;
      }
    }
    if (stage_ == 3 && in_step_ && !recording_ && cursor_ < order_.size()) {
      const int next = order_[cursor_];
      if (resident_[static_cast<size_t>(next)].gathered < 0) gather(next);
    }
  }
  void release_trainable(int t) {
    Resident& r = resident_[static_cast<size_t>(t)];
    if (--r.refs == 0 && !expected_next(t)) drop(static_cast<size_t>(t));
  }
  void drop(size_t t) {
    Resident& r = resident_[t];
    tl_.free(r.gathered);
    tl_.free(r.compute);
    r.compute_defined = false;
  }
  // ZeroGradStore::communicate: a 2-byte precision's scratch is rounded into
  // the gradients and freed; the reduction itself is in place.
  void communicate(size_t b) { tl_.free(scratch_[b]); }
  // ZeroGradStore::retire: the owners widen their block of a 2-byte bucket.
  void retire() {
    auto [b, buffer] = in_flight_.front();
    in_flight_.erase(in_flight_.begin());
    if (w_ != DType::f32) {
      int widened = tl_.alloc(kTransient, static_cast<double>(part_->buckets()[b].shard) * kF32);
      tl_.free(widened);
    }
    tl_.free(buffer);
  }

  Timeline& tl_;
  const RankModel& m_;
  int stage_;
  DType w_;
  double wsize_;
  bool chunked_;
  std::unique_ptr<ChunkModel> chunk_;
  std::vector<int> to_trainable_;
  std::unique_ptr<ParamLayout> layout_;
  std::unique_ptr<ZeroPartition> part_;
  std::vector<FlatRange> ranges_;
  std::vector<Resident> resident_;
  std::vector<int> scratch_, groups_left_;
  std::vector<int> frozen_refs_;
  std::vector<std::vector<int>> frozen_copies_;
  std::vector<std::pair<size_t, int>> in_flight_;
  bool reduce_ = true, in_step_ = false, recording_ = true;
  std::vector<int> order_, recorded_;
  size_t cursor_ = 0;
};

// ---------------------------------------------------------------------------
// One micro-batch through the modules (nn/*.cpp).
// ---------------------------------------------------------------------------

class ModelReplay {
 public:
  ModelReplay(Timeline& tl, StoreModel& st, const Geometry& geo, const RankModel& m, bool recompute)
      : tl_(tl),
        st_(st),
        geo_(geo),
        m_(m),
        recompute_(recompute),
        linears_(geo.on_grid() ? std::vector<LinearShape>{} : geo.block_linears()),
        grid_linears_(geo.on_grid() ? geo.grid_block_linears() : std::vector<GridLinearShape>{}) {}

  // Per micro-batch: the tensors a forward keeps for its backward.
  struct State {
    std::vector<std::vector<int>> blocks;  // by block group index
    std::vector<int> head;                 // ln_f's, the logits, the loss's lse, x_final
    int tokens = -1, targets = -1;
    int dres = -1;
  };

  // GPT::begin: the token ids (first stage) and targets (last stage) on the device.
  void begin(State& s) {
    s.blocks.assign(m_.groups.size(), {});
    if (m_.first) s.tokens = tl_.alloc(kBatch, static_cast<double>(geo_.N()) * 4.0);
    // A grid's last stage keeps the targets of its token rows.
    if (m_.last) s.targets = tl_.alloc(kBatch, static_cast<double>(geo_.on_grid() ? geo_.rows() : geo_.N()) * 4.0);
  }
  void end(State& s) {
    tl_.free(s.tokens);
    tl_.free(s.targets);
  }

  // GPT::forward_chunk: returns the chunk's output (-1 after the head).
  int forward_chunk(State& s, int chunk, int input) {
    int x = input;
    if (chunk == 0 && m_.first) x = embedding_forward();
    for (int g : m_.chunks[static_cast<size_t>(chunk)]) {
      tl_.set_phase(m_.groups[static_cast<size_t>(g)].name, " forward");
      st_.acquire(g);
      x = block_forward(s.blocks[static_cast<size_t>(g)], x);
      st_.release(g);
    }
    if (chunk + 1 == static_cast<int>(m_.chunks.size()) && m_.last) {
      head_forward(s, x);
      return -1;
    }
    return x;
  }

  // GPT::backward_chunk: returns the gradient of the chunk's input.
  int backward_chunk(State& s, int chunk, int grad_output) {
    int dres = chunk + 1 == static_cast<int>(m_.chunks.size()) && m_.last ? head_backward(s) : grad_output;
    const std::vector<int>& blocks = m_.chunks[static_cast<size_t>(chunk)];
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
      tl_.set_phase(m_.groups[static_cast<size_t>(*it)].name, " backward");
      st_.acquire(*it);
      block_backward(*it, s.blocks[static_cast<size_t>(*it)]);
      st_.release(*it);
      st_.group_ready(*it);
    }
    if (chunk != 0 || !m_.first) return dres;
    embedding_backward();
    tl_.free(dres);
    return -1;
  }

 private:
  double N() const { return static_cast<double>(geo_.N()); }
  double rows() const { return static_cast<double>(geo_.rows()); }
  double inner_rows() const { return static_cast<double>(geo_.inner_rows()); }
  double C() const { return static_cast<double>(geo_.C()); }
  double W() const { return static_cast<double>(geo_.width()); }
  double q() const { return static_cast<double>(geo_.grid.q); }
  // The token rows of a grid's table group (TensorGrid::table_group): a
  // column's in one layer, a cube's column's in every layer.
  double table_group_rows() const { return (geo_.grid.cube ? q() * q() : q()) * rows(); }
  bool dropout() const { return geo_.cfg.dropout > 0.0f; }

  // Linear::forward: several parts' weights (and biases) stacked into one
  // GEMM operand; each adapter's h = drop(in) A^T.
  void linear_forward(const LinearShape& l) {
    const double out = static_cast<double>(l.out()), in = static_cast<double>(l.in);
    int w = l.stacked() ? tl_.alloc(kTransient, out * in * kF32) : -1;
    int b = l.stacked() && l.bias ? tl_.alloc(kTransient, out * kF32) : -1;
    for (const LinearPart& p : l.parts) {
      if (p.lora_r == 0) continue;
      int h = tl_.alloc(kTransient, N() * static_cast<double>(p.lora_r) * kF32);
      int dropped = geo_.cfg.lora.dropout > 0.0f ? tl_.alloc(kTransient, N() * in * kF32) : -1;
      tl_.free(dropped);
      tl_.free(h);
    }
    tl_.free(b);
    tl_.free(w);
  }
  // Linear::backward: the stacked weights; the stacked gradients, or, with
  // every part frozen, a zero scratch per part (grad_pieces) dropped at
  // once; then each adapter's h, dh and dropped input.
  void linear_backward(const LinearShape& l) {
    const double out = static_cast<double>(l.out()), in = static_cast<double>(l.in);
    int w = l.stacked() ? tl_.alloc(kTransient, out * in * kF32) : -1;
    st_.touch_grads(touch_.group, touch_.first, touch_.count);
    for (bool bias : {false, true}) {
      if (bias && !l.bias) continue;
      const double width = bias ? 1.0 : in;
      if (geo_.lora()) {
        std::vector<int> zeros;
        for (const LinearPart& p : l.parts)
          zeros.push_back(tl_.alloc(kTransient, static_cast<double>(p.rows) * width * kF32));
        tl_.free_all(zeros);
      }
    }
    int dw = !geo_.lora() && l.stacked() ? tl_.alloc(kTransient, out * in * kF32) : -1;
    int db = !geo_.lora() && l.stacked() && l.bias ? tl_.alloc(kTransient, out * kF32) : -1;
    tl_.free(dw);
    tl_.free(db);
    for (const LinearPart& p : l.parts) {
      if (p.lora_r == 0) continue;
      const double r = static_cast<double>(p.lora_r);
      int dropped = geo_.cfg.lora.dropout > 0.0f ? tl_.alloc(kTransient, N() * in * kF32) : -1;
      int h = tl_.alloc(kTransient, N() * r * kF32);
      tl_.free(h);
      int dh = tl_.alloc(kTransient, N() * r * kF32);
      int dx = dropped >= 0 ? tl_.alloc(kTransient, N() * in * kF32) : -1;
      tl_.free(dx);
      tl_.free(dh);
      tl_.free(dropped);
    }
    tl_.free(w);
  }
  // TensorParallelRegion's all-gather of the rows under sequence parallelism.
  int gather_rows(double width) { return geo_.sp ? tl_.alloc(kTransient, N() * width * kF32) : -1; }

  // ColumnParallelLinear::forward: y [N, out], the input gathered first
  // under sequence parallelism. `term` names what y is to the caller.
  int column_forward(const LinearShape& l, const char* term) {
    int full = gather_rows(static_cast<double>(l.in));
    int y = tl_.alloc(term, N() * static_cast<double>(l.out()) * kF32);
    linear_forward(l);
    tl_.free(full);
    return y;
  }
  // ColumnParallelLinear::backward: dx [N, in] (its rows reduce-scattered
  // under sequence parallelism), the input gathered again.
  int column_backward(const LinearShape& l) {
    int full = gather_rows(static_cast<double>(l.in));
    int dx = tl_.alloc(kTransient, N() * static_cast<double>(l.in) * kF32);
    linear_backward(l);
    if (geo_.sp) {
      int mine = tl_.alloc(kTransient, rows() * static_cast<double>(l.in) * kF32);
      tl_.free(dx);
      tl_.free(full);
      return mine;
    }
    tl_.free(full);
    return dx;
  }
  // RowParallelLinear::forward: the partial [N, out], reduce-scattered into
  // this rank's rows under sequence parallelism.
  int row_forward(const LinearShape& l) {
    int partial = tl_.alloc(kTransient, N() * static_cast<double>(l.out()) * kF32);
    linear_forward(l);
    if (!geo_.sp) return partial;
    int y = tl_.alloc(kTransient, rows() * static_cast<double>(l.out()) * kF32);
    tl_.free(partial);
    return y;
  }
  // RowParallelLinear::backward: dx [N, in], dy gathered under sequence parallelism.
  int row_backward(const LinearShape& l) {
    int full = gather_rows(static_cast<double>(l.out()));
    int dx = tl_.alloc(kTransient, N() * static_cast<double>(l.in) * kF32);
    linear_backward(l);
    tl_.free(full);
    return dx;
  }
  // SummaLinear::gather_panels (the pieces stacked, the column's panels
  // gathered) or CubeLinear::gather_weight (the pieces stacked, the layers'
  // gathered, put in feature order): returns the gathered weight.
  int grid_weight(const GridLinearShape& l) {
    const double in = static_cast<double>(l.in), stored = static_cast<double>(l.stored());
    int stack = l.stacked() ? tl_.alloc(kTransient, stored * in * kF32) : -1;
    int gathered = tl_.alloc(kTransient, q() * stored * in * kF32);
    if (!l.cube) {
      tl_.free(stack);
      return gathered;
    }
    int w = tl_.alloc(kTransient, static_cast<double>(l.out()) * in * kF32);
    tl_.free(gathered);
    tl_.free(stack);
    return w;
  }
  // SummaLinear::forward or CubeLinear::forward: y [rows, out] (`term` to
  // the caller), the stacked bias added.
  int grid_forward(const GridLinearShape& l, const char* term) {
    const double in = static_cast<double>(l.in), out = static_cast<double>(l.out());
    int xs = l.cube ? tl_.alloc(kTransient, q() * rows() * in * kF32) : -1;
    int partial = tl_.alloc(kTransient, q() * rows() * out * kF32);
    int w = grid_weight(l);
    if (l.cube) {
      tl_.free(w);
      tl_.free(xs);
    }
    int y = tl_.alloc(term, rows() * out * kF32);
    int bias = l.bias && l.stacked() ? tl_.alloc(kTransient, out * kF32) : -1;
    tl_.free(bias);
    tl_.free(partial);
    tl_.free(w);
    return y;
  }
  // SummaLinear::backward or CubeLinear::backward: dx [rows, in].
  int grid_backward(const GridLinearShape& l) {
    const double in = static_cast<double>(l.in), out = static_cast<double>(l.out());
    const double stored = static_cast<double>(l.stored());
    if (l.bias) {
      int db = tl_.alloc(kTransient, out * kF32);
      st_.touch_grads(touch_.group, touch_.first, touch_.count);
      tl_.free(db);
    }
    int dys = tl_.alloc(kTransient, q() * rows() * out * kF32);
    if (!l.cube) {
      int dx = tl_.alloc(kTransient, rows() * in * kF32);
      int panels = grid_weight(l);
      tl_.free(panels);
      int dws = tl_.alloc(kTransient, q() * out * in * kF32);
      tl_.free(dys);
      int dw = tl_.alloc(kTransient, out * in * kF32);
      tl_.free(dws);
      if (!l.bias) st_.touch_grads(touch_.group, touch_.first, touch_.count);
      tl_.free(dw);
      return dx;
    }
    int xs = tl_.alloc(kTransient, q() * rows() * in * kF32);
    int dxs = tl_.alloc(kTransient, q() * rows() * in * kF32);
    int dw = tl_.alloc(kTransient, out * in * kF32);
    int w = grid_weight(l);
    tl_.free(w);
    tl_.free(dys);
    tl_.free(xs);
    int dx = tl_.alloc(kTransient, rows() * in * kF32);
    tl_.free(dxs);
    int layers = tl_.alloc(kTransient, q() * stored * in * kF32);
    tl_.free(dw);
    int pieces = tl_.alloc(kTransient, stored * in * kF32);
    if (!l.bias) st_.touch_grads(touch_.group, touch_.first, touch_.count);
    tl_.free(pieces);
    tl_.free(layers);
    return dx;
  }
  // The block's four linear layers (c_attn, attn.c_proj, c_fc, mlp.c_proj),
  // 1D's column- and row-parallel ones or a grid's. `term` names what an
  // entering layer's output is to the caller.
  int layer_forward(int which, const char* term) {
    if (geo_.on_grid()) return grid_forward(grid_linears_[static_cast<size_t>(which)], term);
    const LinearShape l = linears_[static_cast<size_t>(which)];
    return which % 2 == 0 ? column_forward(l, term) : row_forward(l);
  }
  int layer_backward(int which) {
    if (geo_.on_grid()) return grid_backward(grid_linears_[static_cast<size_t>(which)]);
    const LinearShape l = linears_[static_cast<size_t>(which)];
    return which % 2 == 0 ? column_backward(l) : row_backward(l);
  }
  // A layer's output features on this rank, and its trainable parameters in
  // ParamLayout order.
  double layer_out(int which) const {
    return static_cast<double>(geo_.on_grid() ? grid_linears_[static_cast<size_t>(which)].out()
                                              : linears_[static_cast<size_t>(which)].out());
  }
  int layer_params(int which) const {
    if (!geo_.on_grid()) return linear_params(linears_[static_cast<size_t>(which)]);
    const GridLinearShape l = grid_linears_[static_cast<size_t>(which)];
    return static_cast<int>(l.pieces.size()) * (l.bias ? 2 : 1);
  }
  // Norm::backward's row sums, all-reduced over a grid's hidden group.
  void norm_sums() {
    int sums = geo_.on_grid() ? tl_.alloc(kTransient, rows() * 2.0 * kF32) : -1;
    tl_.free(sums);
  }

  // CausalSelfAttention::rotate: RoPE's inverse frequencies and cos/sin tables.
  void rope_tables() {
    if (geo_.cfg.positions != PositionKind::rope) return;
    const double half = static_cast<double>(geo_.cfg.head_dim() / 2), T = static_cast<double>(geo_.T);
    std::vector<int> t = {tl_.alloc(kTransient, half * kF32), tl_.alloc(kTransient, T * half * kF32),
                          tl_.alloc(kTransient, T * half * kF32)};
    tl_.free_all(t);
  }
  // Norm::forward: out [rows, C], rstd (and LayerNorm's mean) [rows].
  void norm_forward(std::vector<int>& saved) {
    saved.push_back(tl_.alloc(kKept, rows() * W() * kF32));
    saved.push_back(tl_.alloc(kKept, geo_.norm_stats() * kF32));
  }

  // Block::forward_into up to the MLP's activation (all the recompute
  // rebuilds), then the MLP's output projection and residual when `y` is
  // given.
  void block_body(std::vector<int>& saved, bool full) {
    const double heads = static_cast<double>(geo_.local_heads()), hs = static_cast<double>(geo_.cfg.head_dim());
    norm_forward(saved);
    saved.push_back(layer_forward(0, kKept));  // qkv
    rope_tables();
    saved.push_back(tl_.alloc(kKept, inner_rows() * heads * hs * kF32));  // att
    saved.push_back(tl_.alloc(kKept, inner_rows() * heads * kF32));       // lse
    int a = layer_forward(1, kTransient);
    saved.push_back(tl_.alloc(kKept, rows() * W() * kF32));  // resid
    tl_.free(a);
    norm_forward(saved);
    saved.push_back(layer_forward(2, kKept));                                                     // fc
    saved.push_back(tl_.alloc(kKept, inner_rows() * static_cast<double>(geo_.local_I()) * kF32));  // act
    if (!full) return;
    int m = layer_forward(3, kTransient);
    tl_.free(m);
  }
  // Block::forward: y, then the body; under recompute only the input stays.
  int block_forward(std::vector<int>& saved, int x) {
    int y = tl_.alloc(kKept, rows() * W() * kF32);
    block_body(saved, true);
    if (recompute_) tl_.free_all(saved);
    saved.push_back(x);
    return y;
  }
  // Trainable parameters of a norm and of a linear layer, in ParamLayout
  // order (Linear: per part its weight and bias, then its adapter's two).
  int norm_params() const { return geo_.lora() ? 0 : (geo_.cfg.norm == NormKind::layernorm ? 2 : 1); }
  int linear_params(const LinearShape& l) const {
    int n = 0;
    for (const LinearPart& p : l.parts) n += (geo_.lora() ? 0 : 1 + (l.bias ? 1 : 0)) + (p.lora_r > 0 ? 2 : 0);
    return n;
  }
  // Block::backward: dres is updated in place; everything the block kept,
  // its input included, is freed at the end. Gradients are first written
  // module by module (mlp.c_proj, c_fc, ln_2, attn.c_proj, c_attn, ln_1),
  // which matters where a chunk's gradient appears at its first write.
  void block_backward(int group, std::vector<int>& saved) {
    if (recompute_) block_body(saved, false);
    const int ln_1 = 0, c_attn = ln_1 + norm_params(), c_proj = c_attn + layer_params(0);
    const int ln_2 = c_proj + layer_params(1), c_fc = ln_2 + norm_params(), mlp_c_proj = c_fc + layer_params(2);
    int dm = dropout() ? tl_.alloc(kTransient, rows() * W() * kF32) : -1;
    {
      touch_ = {group, mlp_c_proj, layer_params(3)};
      int dact = layer_backward(3);
      int dfc = tl_.alloc(kTransient, inner_rows() * layer_out(2) * kF32);
      tl_.free(dact);
      touch_ = {group, c_fc, layer_params(2)};
      int dln = layer_backward(2);
      tl_.free(dfc);
      tl_.free(dm);
      st_.touch_grads(group, ln_2, norm_params());
      norm_sums();
      tl_.free(dln);
    }
    dm = dropout() ? tl_.alloc(kTransient, rows() * W() * kF32) : -1;
    {
      touch_ = {group, c_proj, layer_params(1)};
      int datt = layer_backward(1);
      int dqkv = tl_.alloc(kTransient, inner_rows() * layer_out(0) * kF32);
      tl_.free(datt);
      rope_tables();
      touch_ = {group, c_attn, layer_params(0)};
      int dln = layer_backward(0);
      tl_.free(dqkv);
      tl_.free(dm);
      st_.touch_grads(group, ln_1, norm_params());
      norm_sums();
      tl_.free(dln);
    }
    tl_.free_all(saved);
  }

  // Embedding::forward: [N, C], or this rank's partial lookup reduced (and
  // reduce-scattered under sequence parallelism).
  int embedding_forward() {
    tl_.set_phase("embedding forward");
    st_.acquire(m_.embedding);
    if (geo_.on_grid()) {
      // Embedding::grid_forward: the table group's tokens looked up in this
      // rank's rows, reduce-scattered.
      int partial = tl_.alloc(kTransient, table_group_rows() * W() * kF32);
      int out = tl_.alloc(kKept, rows() * W() * kF32);
      tl_.free(partial);
      st_.release(m_.embedding);
      return out;
    }
    const bool whole = geo_.tp == 1 && geo_.cfg.positions == PositionKind::learned;
    int out = tl_.alloc(kKept, N() * C() * kF32);
    if (!whole && geo_.sp) {
      int mine = tl_.alloc(kKept, rows() * C() * kF32);
      tl_.free(out);
      out = mine;
    }
    st_.release(m_.embedding);
    return out;
  }
  // Embedding::backward: scatters into the table's gradient; the gathered
  // rows under sequence parallelism.
  void embedding_backward() {
    tl_.set_phase("embedding backward");
    int demb = dropout() ? tl_.alloc(kTransient, rows() * W() * kF32) : -1;
    st_.touch_grads(m_.embedding);
    const bool whole = geo_.tp == 1 && geo_.cfg.positions == PositionKind::learned;
    if (geo_.on_grid()) {
      // Embedding::grid_backward: the table group's rows gathered.
      int gathered = tl_.alloc(kTransient, table_group_rows() * W() * kF32);
      tl_.free(gathered);
    } else if (!whole) {
      int full = gather_rows(C());
      tl_.free(full);
    }
    tl_.free(demb);
    st_.group_ready(m_.embedding);
  }

  // GPT::head_forward and CrossEntropyLoss::forward (fused with its backward:
  // the logits become their gradient in place).
  void head_forward(State& s, int x) {
    tl_.set_phase("head forward");
    s.head.push_back(x);  // x_final
    st_.acquire(m_.ln_f);
    norm_forward(s.head);
    st_.release(m_.ln_f);
    st_.acquire(m_.head);
    s.head.push_back(gather_rows(C()));  // head_input under sequence parallelism
    // The logits of every token (1D), or of the grid's token rows.
    const double n = geo_.on_grid() ? rows() : N();
    s.head.push_back(geo_.on_grid()
                         ? grid_forward(geo_.grid_head(), kKept)
                         : tl_.alloc(kKept, N() * static_cast<double>(geo_.local_vocab()) * kF32));  // logits
    st_.release(m_.head);
    s.head.push_back(tl_.alloc(kKept, n * kF32));  // lse
    std::vector<int> temps = {tl_.alloc(kTransient, n * kF32), tl_.alloc(kTransient, n * kF32)};  // losses, dl
    if (geo_.tp > 1) {
      temps.push_back(tl_.alloc(kTransient, n * kF32));        // row_max
      temps.push_back(tl_.alloc(kTransient, 2.0 * n * kF32));  // sums
    }
    tl_.free_all(temps);
  }
  // GPT::head_backward: dh [N, C] while the logits live, then the residual
  // stream's gradient dres.
  int head_backward(State& s) {
    tl_.set_phase("head backward");
    st_.acquire(m_.head);
    st_.acquire(m_.ln_f);
    int dh = -1;
    if (geo_.on_grid()) {
      touch_ = {m_.head, 0, 1};  // the token table, first in its group
      dh = grid_backward(geo_.grid_head());
    } else {
      dh = tl_.alloc(kTransient, N() * C() * kF32);
      st_.touch_grads(m_.head, 0, 1);
    }
    // head: x_final, ln_f out, stats, head_input, logits, lse.
    tl_.free(s.head[3]);
    tl_.free(s.head[4]);
    tl_.free(s.head[5]);
    if (geo_.tp > 1 && geo_.sp) {
      int mine = tl_.alloc(kTransient, rows() * C() * kF32);
      tl_.free(dh);
      dh = mine;
    }
    int dres = tl_.alloc(kTransient, rows() * W() * kF32);
    st_.touch_grads(m_.ln_f);
    norm_sums();
    tl_.free(dh);
    tl_.free_all(s.head);
    st_.release(m_.ln_f);
    st_.group_ready(m_.ln_f);
    st_.release(m_.head);
    if (m_.head != m_.embedding) st_.group_ready(m_.head);
    return dres;
  }

  Timeline& tl_;
  StoreModel& st_;
  const Geometry& geo_;
  const RankModel& m_;
  bool recompute_;
  // The block's four linear layers (1D's, or a grid's), shaped once.
  const std::vector<LinearShape> linears_;
  const std::vector<GridLinearShape> grid_linears_;
  // The parameters whose gradients the next linear layer's backward writes.
  struct {
    int group = 0, first = 0, count = 0;
  } touch_;
};

// ---------------------------------------------------------------------------
// The step (Trainer::step, run_micro_batches, run_pipeline).
// ---------------------------------------------------------------------------

struct RankSetup {
  Geometry geo;
  RankModel model;
  int stage = 0, pp = 1, chunks = 1;
  int64_t micro_batches = 1;
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
  bool mesh = false, recompute = false;
  // Trainer's defer_reduction_: pipeline stages, or partial tensor-parallel
  // gradients, reduce after the schedule.
  bool defer = false;
};

void replay_step(Timeline& tl, StoreModel& st, const RankSetup& r) {
  ModelReplay replay(tl, st, r.geo, r.model, r.recompute);
  st.zero();
  st.begin_step();
  const int n = static_cast<int>(r.micro_batches);
  if (!r.mesh) {
    // The losses' f64 accumulator, read once on the host.
    int loss = tl.alloc(kBatch, 8.0);
    for (int m = 0; m < n; ++m) {
      st.set_reduce(m + 1 == n);
      ModelReplay::State s;
      replay.begin(s);
      replay.forward_chunk(s, 0, -1);
      replay.backward_chunk(s, 0, -1);
      replay.end(s);
    }
    int host = tl.alloc(Tier::host, kBatch, 8.0);
    tl.free(host);
    tl.free(loss);
  } else {
    int loss = tl.alloc(kBatch, 8.0);  // MicroBatchWork::loss_sum_
    std::vector<ModelReplay::State> states(static_cast<size_t>(n));
    std::vector<bool> begun(static_cast<size_t>(n), false);
    // run_pipeline's sends are asynchronous and rendezvous with the
    // neighbour's receive; a sent tensor is freed at the first action after
    // one that saw it delivered. Bound from the schedules alone: delivered
    // once this rank has received from that neighbour something it sent
    // after posting the matching receive.
    const int virtual_stages = r.pp * r.chunks;
    std::vector<std::vector<PipelineAction>> orders;
    for (int s = 0; s < r.pp; ++s) orders.push_back(pipeline_actions(r.schedule, r.pp, s, n, r.chunks));
    // Where each (kind, chunk, micro-batch) falls in its rank's order.
    const auto action_index = [&](PipelineAction::Kind kind, int chunk, int mb) {
      return static_cast<size_t>(((kind == PipelineAction::Kind::forward ? 0 : 1) * r.chunks + chunk) * n + mb);
    };
    std::vector<std::vector<int>> positions(static_cast<size_t>(r.pp));
    for (int s = 0; s < r.pp; ++s) {
      positions[static_cast<size_t>(s)].assign(static_cast<size_t>(2 * r.chunks * n), -1);
      const std::vector<PipelineAction>& o = orders[static_cast<size_t>(s)];
      for (size_t i = 0; i < o.size(); ++i)
        positions[static_cast<size_t>(s)][action_index(o[i].kind, o[i].chunk, o[i].micro_batch)] = static_cast<int>(i);
    }
    const auto position = [&](int vs, PipelineAction::Kind kind, int mb) {
      return positions[static_cast<size_t>(vs % r.pp)][action_index(kind, vs / r.pp, mb)];
    };
    struct Send {
      int tensor, stage, receive_at;
      bool delivered = false;
    };
    std::vector<Send> sends;
    const auto received = [&](int from_vs, int sent_at) {
      for (Send& s : sends)
        if (s.stage == from_vs % r.pp && sent_at > s.receive_at) s.delivered = true;
    };
    const double boundary = static_cast<double>(r.geo.rows() * r.geo.width()) * kF32;
    for (const PipelineAction& a : orders[static_cast<size_t>(r.stage)]) {
      std::erase_if(sends, [&](Send& s) {
        if (s.delivered) tl.free(s.tensor);
        return s.delivered;
      });
      const int vs = a.chunk * r.pp + r.stage;
      const bool first = vs == 0, last = vs == virtual_stages - 1;
      ModelReplay::State& s = states[static_cast<size_t>(a.micro_batch)];
      if (a.kind == PipelineAction::Kind::forward) {
        int input = -1;
        if (!first) {
          input = tl.alloc(kKept, boundary);
          received(vs - 1, position(vs - 1, a.kind, a.micro_batch));
        }
        if (!begun[static_cast<size_t>(a.micro_batch)]) {
          replay.begin(s);
          begun[static_cast<size_t>(a.micro_batch)] = true;
        }
        const int out = replay.forward_chunk(s, a.chunk, input);
        if (!last) sends.push_back({out, (vs + 1) % r.pp, position(vs + 1, a.kind, a.micro_batch)});
      } else {
        st.set_reduce(!r.defer && a.micro_batch + 1 == n);
        int grad = -1;
        if (!last) {
          grad = tl.alloc(kPipeline, boundary);
          received(vs + 1, position(vs + 1, a.kind, a.micro_batch));
        }
        const int din = replay.backward_chunk(s, a.chunk, grad);
        if (!first) sends.push_back({din, (vs - 1) % r.pp, position(vs - 1, a.kind, a.micro_batch)});
      }
    }
    for (Send& s : sends) tl.free(s.tensor);
    if (r.defer) {
      // Trainer::reduce_model_parallel_gradients: the partial gradients of
      // each reduction packed into one fp32 buffer and summed, one
      // reduction after another, then every bucket.
      for (const auto& [reduction, n] : partial_elements(r.model.groups)) {
        if (reduction != kTiedStages && r.geo.tp == 1) continue;
        int packed = tl.alloc(kTransient, n * kF32);
        tl.free(packed);
      }
      st.reduce_all();
    }
    int host = tl.alloc(Tier::host, kBatch, 8.0);
    tl.free(host);
    for (ModelReplay::State& s : states) replay.end(s);
    tl.free(loss);
  }
  tl.set_phase("optimizer step");
  st.finish();
  st.end_step();
  st.optimizer_step();
}

}  // namespace

std::string RankMemory::describe(Tier t) const {
  const TierPeak& p = tiers[static_cast<int>(t)];
  std::string s = str(tier_name(t), " peak ", format_bytes(p.bytes), " (reserved ", format_bytes(p.reserved), ") in ",
                      p.phase, ":");
  for (const MemoryTerm& term : p.terms) s += str("\n  ", term.name, " ", format_bytes(term.bytes));
  return s;
}

namespace {

// One rank's replay: the peaks and the chunk stores' moves of its last step.
// Each pipeline stage's ranks as a replay sees them: the geometry, the
// model groups of its layers (model_parallel_for's split), the schedule.
std::vector<RankSetup> stage_setups(const LayoutProblem& problem, const Layout& layout) {
  const GPTConfig& cfg = problem.model;
  const int pp = static_cast<int>(layout.pp), tp = static_cast<int>(layout.tp);
  const int chunks = static_cast<int>(layout.virtual_stages);
  // model_parallel_for: an interleaved pipeline's virtual stages get equal
  // layer counts, the others a balance of their costs at model.block_size.
  std::vector<int> given;
  if (layout.schedule == PipelineSchedule::interleaved_1f1b)
    given.assign(static_cast<size_t>(pp * chunks), static_cast<int>(cfg.n_layer) / (pp * chunks));
  const std::vector<int> layers = pipeline_stage_layers(cfg, cfg.block_size, pp * chunks, given);
  std::vector<int> first_layer{0};
  for (int n : layers) first_layer.push_back(first_layer.back() + n);
  std::vector<RankSetup> stages(static_cast<size_t>(pp));
  for (int stage = 0; stage < pp; ++stage) {
    RankSetup& r = stages[static_cast<size_t>(stage)];
    r.geo.cfg = cfg;
    r.geo.tp = tp;
    r.geo.sp = layout.sequence_parallel && tp > 1;
    r.geo.grid = tensor_grid_shape(layout.tp_mode, layout.tp, layout.tp_depth);
    r.geo.B = layout.micro_batch;
    r.geo.T = problem.seq_len;
    r.stage = stage;
    r.pp = pp;
    r.chunks = chunks;
    r.schedule = layout.schedule;
    r.micro_batches = problem.global_batch / (layout.micro_batch * layout.dp);
    r.mesh = tp > 1 || pp > 1;
    r.recompute = layout.recompute;
    std::vector<LayerRange> ranges;
    for (int c = 0; c < chunks; ++c) {
      const size_t k = static_cast<size_t>(c * pp + stage);
      ranges.push_back({first_layer[k], first_layer[k + 1]});
    }
    r.model = rank_model(r.geo, ranges, stage == 0, stage == pp - 1, pp);
    r.defer = pp > 1 || (tp > 1 && !partial_elements(r.model.groups).empty());
  }
  return stages;
}

struct ReplayedRank {
  RankMemory memory;
  StepTraffic traffic;
};

// Every rank's replay of `steps` steps: the ZeRO stores, or under a memory
// policy all but the chunk stores, or all.
std::vector<ReplayedRank> replay_ranks(const LayoutProblem& problem, const Layout& layout,
                                       const StepMemoryOptions& options, bool with_chunks, int steps) {
  // A memory policy's chunks pack the trainable parameters whole (GPT's
  // constructor declares the layout and allocates nothing); chunk placement
  // runs on dp alone, so the layout is the whole model's.
  std::unique_ptr<ParamLayout> chunk_layout;
  MemoryOptions memory = options.memory;
  memory.policy = layout.memory_policy;
  if (layout.memory_policy != MemoryPolicy::none && with_chunks) {
    const GPT whole(problem.model);
    std::vector<bool> frozen;
    for (const ParamSpec& p : whole.layout().params()) frozen.push_back(!p.trainable);
    chunk_layout = std::make_unique<ParamLayout>(std::find(frozen.begin(), frozen.end(), true) != frozen.end()
                                                     ? trainable_layout(whole.layout(), frozen)
                                                     : whole.layout());
  }
  const int pp = static_cast<int>(layout.pp), tp = static_cast<int>(layout.tp), dp = static_cast<int>(layout.dp);

  // The chunks a memory policy packs, as ChunkModel places them, for the
  // ranks' shares of them.
  std::unique_ptr<ChunkLayout> placed_chunks;
  if (chunk_layout)
    placed_chunks = std::make_unique<ChunkLayout>(
        *chunk_layout,
        plan_memory(*chunk_layout, memory, options.precision, dp, 0, unlimited_tiers()).search.chunk_numel, dp);

  // A replay reads nothing of a rank's place in its stage but the elements
  // it owns of each ZeRO bucket or chunk (the model's groups are the same on
  // every tensor-parallel rank), so the ranks of a stage with the same
  // shares have the same peaks: each such class is replayed once. A search
  // over hundreds of ranks then replays a handful.
  const std::vector<RankSetup> stages = stage_setups(problem, layout);
  std::vector<ParamLayout> trainable;
  for (const RankSetup& r : stages) {
    std::vector<int> unused;
    trainable.push_back(trainable_groups(r.model, unused));
  }
  const auto shares = [&](int stage, int dp_rank) {
    std::vector<int64_t> owned{stage};
    if (placed_chunks) {
      for (int c = 0; c < placed_chunks->num_chunks(); ++c) owned.push_back(placed_chunks->owned(c, dp_rank).numel());
    } else if (memory.policy == MemoryPolicy::none) {
      const ZeroPartition part = zero_partition(trainable[static_cast<size_t>(stage)], layout.zero_stage,
                                                options.precision, options.bucket_bytes, dp, dp_rank);
      for (const ZeroBucket& b : part.buckets()) owned.push_back(part.owned(b).numel());
    }
    return owned;
  };

  // Each class's peaks and the chunk stores' moves of its last step (the
  // moves, too, follow from the elements a rank owns of each chunk).
  struct Replayed {
    std::array<TierPeak, kNumTiers> peaks;
    StepTraffic traffic;
  };
  std::map<std::vector<int64_t>, Replayed> replayed;
  std::vector<ReplayedRank> out;
  for (int rank = 0; rank < pp * dp * tp; ++rank) {
    RankMemory mem;
    mem.pp_stage = rank / (dp * tp);
    mem.dp_rank = rank / tp % dp;
    mem.tp_rank = rank % tp;
    const std::vector<int64_t> key = shares(mem.pp_stage, mem.dp_rank);
    auto found = replayed.find(key);
    if (found == replayed.end()) {
      const RankSetup& r = stages[static_cast<size_t>(mem.pp_stage)];
      Timeline tl;
      StoreModel st(tl, r.model, layout.zero_stage, options.precision, options.bucket_bytes, dp, mem.dp_rank,
                    chunk_layout.get(), memory);
      for (int step = 1; step <= steps; ++step) {
        if (step == steps) {
          tl.reset_peaks();
          st.reset_traffic();
        }
        replay_step(tl, st, r);
      }
      Replayed done;
      done.traffic = st.traffic();
      for (Tier t : {Tier::device, Tier::host, Tier::nvme}) done.peaks[static_cast<size_t>(t)] = tl.peak(t);
      found = replayed.emplace(key, std::move(done)).first;
    }
    for (int t = 0; t < kNumTiers; ++t) mem.tiers[t] = found->second.peaks[static_cast<size_t>(t)];
    StepTraffic traffic = found->second.traffic;
    traffic.dp_rank = mem.dp_rank;
    out.push_back({std::move(mem), traffic});
  }
  return out;
}

// The first step learns ZeRO-3's order and the chunks'; the second is the
// steady state of the peaks.
constexpr int kPeakStep = 2;

}  // namespace

double device_bytes_beside_chunks(const LayoutProblem& problem, const Layout& layout,
                                  const StepMemoryOptions& options) {
  LOOM_CHECK(layout.memory_policy != MemoryPolicy::none, "device_bytes_beside_chunks needs a memory policy");
  double most = 0.0;
  for (const ReplayedRank& r : replay_ranks(problem, layout, options, false, kPeakStep))
    most = std::max(most, r.memory.peak(Tier::device));
  return most;
}

std::vector<RankMemory> predict_step_memory(const LayoutProblem& problem, const Layout& layout,
                                            const StepMemoryOptions& options) {
  std::vector<RankMemory> out;
  for (ReplayedRank& r : replay_ranks(problem, layout, options, true, kPeakStep)) out.push_back(std::move(r.memory));
  return out;
}

std::vector<StepTraffic> predict_step_traffic(const LayoutProblem& problem, const Layout& layout,
                                              const StepMemoryOptions& options, int step) {
  LOOM_CHECK(step >= 1, "steps are counted from 1, not ", step);
  std::vector<StepTraffic> out;
  for (const ReplayedRank& r : replay_ranks(problem, layout, options, true, step)) out.push_back(r.traffic);
  return out;
}

std::vector<StageGradients> predict_stage_gradients(const LayoutProblem& problem, const Layout& layout) {
  std::vector<StageGradients> out;
  for (const RankSetup& r : stage_setups(problem, layout)) {
    StageGradients g;
    for (const Group& group : r.model.groups) g.trainable += group.trainable;
    for (const auto& [reduction, n] : partial_elements(r.model.groups)) {
      if (reduction == kTiedStages)
        g.tied_across_stages += n;
      else if (layout.tp > 1)  // Trainer::reduce_model_parallel_gradients: none over a group of one
        g.over_tp[static_cast<TpAxes>(reduction)] += n;
    }
    g.reduced_after_pipeline = r.defer;
    out.push_back(std::move(g));
  }
  return out;
}

TierTraffic StepTraffic::bytes() const {
  TierTraffic sum;
  for (const Phase* p : {&model, &update}) {
    sum += p->waited.bytes;
    sum += p->ahead.bytes;
  }
  return sum;
}

}  // namespace loom
