#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "test_util.h"
#include "loom/config.h"

namespace loom {
namespace {

using testing::error_of;
using testing::TempDir;

const ConfigSchema& test_schema() {
  static const ConfigSchema s = [] {
    ConfigSchema s;
    s.add_int("model.n_layer", 4, "transformer blocks", 1, 96);
    s.add_int("model.n_head", 4, "attention heads", 1);
    s.add_float("model.dropout", 0.1, "dropout probability", 0.0, 1.0);
    s.add_float("train.lr", 1e-3, "peak learning rate", 0.0);
    s.add_bool("train.activation_checkpointing", false, "recompute activations");
    s.add_string("train.out_dir", "runs/x", "output directory");
    s.add_choice("precision", "fp32", {"fp32", "bf16", "fp16"}, "compute dtype");
    s.add_bytes("memory.device_budget", "unlimited", "device bytes");
    return s;
  }();
  return s;
}

TEST(Config, StartsAtDefaults) {
  Config c(test_schema());
  EXPECT_EQ(c.get<int64_t>("model.n_layer"), 4);
  EXPECT_DOUBLE_EQ(c.get<double>("train.lr"), 1e-3);
  EXPECT_FALSE(c.get<bool>("train.activation_checkpointing"));
  EXPECT_EQ(c.get<std::string>("precision"), "fp32");
  EXPECT_EQ(c.get_bytes("memory.device_budget"), kUnlimited);
  EXPECT_TRUE(c.is_default("model.n_layer"));
  EXPECT_EQ(c.source("model.n_layer"), "default");
}

TEST(Config, LoadsTomlWithSectionsDottedKeysAndTopLevelKeys) {
  TempDir dir;
  auto path = dir.write("run.toml", R"(precision = "bf16"
train.lr = 3e-4

[model]
n_layer = 6
dropout = 0     # an integer is fine for a float key

[memory]
device_budget = "2GiB"
)");
  Config c(test_schema());
  c.load_toml(path);
  EXPECT_EQ(c.get<std::string>("precision"), "bf16");
  EXPECT_DOUBLE_EQ(c.get<double>("train.lr"), 3e-4);
  EXPECT_EQ(c.get<int64_t>("model.n_layer"), 6);
  EXPECT_DOUBLE_EQ(c.get<double>("model.dropout"), 0.0);
  EXPECT_EQ(c.get_bytes("memory.device_budget"), size_t(2) << 30);
  EXPECT_EQ(c.source("model.n_layer"), path.string() + ":5");
  EXPECT_TRUE(c.is_default("model.n_head"));
}

TEST(Config, OverridesAreTypedByTheSchema) {
  Config c(test_schema());
  c.set_override("model.n_layer=6");
  c.set_override("train.lr = 3e-4");
  c.set_override("train.activation_checkpointing=true");
  c.set_override("precision=bf16");
  c.set_override("train.out_dir=runs/a=b");
  c.set_override("memory.device_budget=512MiB");
  EXPECT_EQ(c.get<int64_t>("model.n_layer"), 6);
  EXPECT_DOUBLE_EQ(c.get<double>("train.lr"), 3e-4);
  EXPECT_TRUE(c.get<bool>("train.activation_checkpointing"));
  EXPECT_EQ(c.get<std::string>("precision"), "bf16");
  EXPECT_EQ(c.get<std::string>("train.out_dir"), "runs/a=b");
  EXPECT_EQ(c.get_bytes("memory.device_budget"), size_t(512) << 20);
  EXPECT_EQ(c.source("model.n_layer"), "override 'model.n_layer=6'");
}

TEST(Config, OverrideLaterWinsOverFile) {
  Config c(test_schema());
  c.load_toml_string("[model]\nn_layer = 6\n", "a.toml");
  c.set_override("model.n_layer=8");
  EXPECT_EQ(c.get<int64_t>("model.n_layer"), 8);
}

TEST(Config, IllTypedOverrideNamesKeyTypeAndValue) {
  Config c(test_schema());
  std::string msg = error_of([&] { c.set_override("model.n_layer=3e-4"); });
  EXPECT_CONTAINS(msg, "model.n_layer expects an integer");
  EXPECT_CONTAINS(msg, "\"3e-4\"");
  msg = error_of([&] { c.set_override("train.activation_checkpointing=yes"); });
  EXPECT_CONTAINS(msg, "train.activation_checkpointing expects a");
  EXPECT_CONTAINS(error_of([&] { c.set_override("n_layer"); }), "not of the form key=value");
  EXPECT_CONTAINS(error_of([&] { c.set_override("train.lr=inf"); }), "train.lr expects a");
  EXPECT_EQ(c.get<int64_t>("model.n_layer"), 4);  // failed overrides change nothing
}

TEST(Config, IllTypedTomlValueNamesFileLineKeyTypeAndValue) {
  Config c(test_schema());
  std::string msg = error_of([&] { c.load_toml_string("[model]\n\nn_layer = \"six\"\n", "configs/x.toml"); });
  EXPECT_EQ(msg, "configs/x.toml:3: model.n_layer expects an integer in [1, 96], found string \"six\"");
  msg = error_of([&] { c.load_toml_string("[model]\nn_layer = 6.0\n", "configs/x.toml"); });
  EXPECT_CONTAINS(msg, "found number 6.0");
  msg = error_of([&] { c.load_toml_string("[model]\nn_layer = [1, 2]\n", "configs/x.toml"); });
  EXPECT_CONTAINS(msg, "configs/x.toml:2: model.n_layer expects an integer in [1, 96], found a TOML array");
  msg = error_of([&] { c.load_toml_string("model = 3\n", "configs/x.toml"); });
  EXPECT_CONTAINS(msg, "'model' is a section");
}

TEST(Config, OutOfRangeNamesTheAllowedRange) {
  Config c(test_schema());
  std::string msg = error_of([&] { c.load_toml_string("[model]\ndropout = 1.5\n", "x.toml"); });
  EXPECT_EQ(msg, "x.toml:2: model.dropout = 1.5 is out of range: allowed number in [0.0, 1.0]");
  msg = error_of([&] { c.set_override("model.n_head=0"); });
  EXPECT_CONTAINS(msg, "model.n_head = 0 is out of range: allowed integer >= 1");
}

TEST(Config, ChoiceAndByteSizeAreChecked) {
  Config c(test_schema());
  std::string msg = error_of([&] { c.set_override("precision=bf61"); });
  EXPECT_CONTAINS(msg, "precision = \"bf61\" is not one of fp32, bf16, fp16 (did you mean 'bf16'?)");
  msg = error_of([&] { c.load_toml_string("[memory]\ndevice_budget = \"2 gigs\"\n", "x.toml"); });
  EXPECT_CONTAINS(msg, "x.toml:2: memory.device_budget: invalid byte size '2 gigs'");
}

TEST(Config, UnknownKeySuggestsTheClosest) {
  TempDir dir;
  auto path = dir.write("x.toml", "[model]\nn_layer = 2\nn_layers = 6\n");
  Config c(test_schema());
  std::string msg = error_of([&] { c.load_toml(path); });
  EXPECT_EQ(msg, str("unknown key 'model.n_layers' in ", path.string(), ":3: did you mean 'model.n_layer'?"));
  EXPECT_CONTAINS(error_of([&] { c.set_override("model.nlayer=6"); }), "did you mean 'model.n_layer'?");
  EXPECT_CONTAINS(error_of([&] { c.set_override("train.n_layer=6"); }), "did you mean 'model.n_layer'?");
  EXPECT_CONTAINS(error_of([&] { c.load_toml_string("[modle]\nn_layer = 2\n", "y.toml"); }), "unknown key 'modle' in y.toml:1: did you mean 'model'?");
  EXPECT_CONTAINS(error_of([&] { c.set_override("optimizer.kind=adam"); }), "known sections are [memory] [model] [train] and top-level keys precision");
}

TEST(Config, SyntaxErrorNamesLineAndColumn) {
  Config c(test_schema());
  std::string msg = error_of([&] { c.load_toml_string("[model]\nn_layer = 6\nn_head = = 4\n", "bad.toml"); });
  EXPECT_CONTAINS(msg, "TOML syntax error in bad.toml:3:");
}

TEST(Config, MissingFileNamesThePath) {
  TempDir dir;
  Config c(test_schema());
  std::string msg = error_of([&] { c.load_toml(dir / "nope.toml"); });
  EXPECT_CONTAINS(msg, (dir / "nope.toml").string());
  EXPECT_CONTAINS(msg, "does not exist");
  EXPECT_CONTAINS(error_of([&] { c.load_toml(dir.path()); }), "is a directory");
}

TEST(Config, RoundTripsThroughJsonAndToml) {
  Config c(test_schema());
  c.set_override("model.n_layer=7");
  c.set_override("train.lr=0.00030000000000000003");  // needs all 17 digits
  c.set_override("train.activation_checkpointing=true");
  c.set_override("train.out_dir=runs/\"quoted\"\\x\ty");
  c.set_override("precision=fp16");
  c.set_override("model.dropout=1");
  c.set_override("memory.device_budget=3GiB");

  nlohmann::json j = c.to_json();
  EXPECT_EQ(j["model"]["n_layer"], 7);
  EXPECT_EQ(j["precision"], "fp16");
  Config from_json = Config::from_json(test_schema(), nlohmann::json::parse(j.dump()));

  Config from_toml(test_schema());
  from_toml.load_toml_string(c.to_toml(), "to_toml");

  for (const ConfigKey& k : test_schema().keys()) {
    EXPECT_EQ(from_json.value(k.name), c.value(k.name)) << k.name;
    EXPECT_EQ(from_toml.value(k.name), c.value(k.name)) << k.name;
  }
  EXPECT_EQ(from_json.source("model.n_layer"), "JSON config");
}

TEST(Config, TomlOutputPutsTopLevelKeysFirstWithDocs) {
  std::string toml = Config(test_schema()).to_toml();
  EXPECT_EQ(toml.substr(0, toml.find('\n', toml.find('\n') + 1) + 1), "# compute dtype\nprecision = \"fp32\"\n");
  EXPECT_CONTAINS(toml, "[model]\n# transformer blocks\nn_layer = 4\n");
  EXPECT_CONTAINS(toml, "dropout = 0.1\n");
}

TEST(Config, FromJsonRejectsUnknownAndIllTypedKeys) {
  auto j = nlohmann::json::parse(R"({"model": {"n_layers": 6}})");
  EXPECT_CONTAINS(error_of([&] { Config::from_json(test_schema(), j); }), "unknown key 'model.n_layers' in JSON config: did you mean 'model.n_layer'?");
  j = nlohmann::json::parse(R"({"model": {"n_layer": null}})");
  EXPECT_CONTAINS(error_of([&] { Config::from_json(test_schema(), j); }), "found JSON null");
  j = nlohmann::json::parse(R"({"train": {"lr": 1}})");
  EXPECT_DOUBLE_EQ(Config::from_json(test_schema(), j).get<double>("train.lr"), 1.0);
}

TEST(Config, ConfigErrorNamesFieldValueOriginRuleAndFix) {
  Config c(test_schema());
  c.load_toml_string("[model]\nn_head = 3\n", "configs/x.toml");
  ConfigError e(c, "model.n_head", "must divide model.n_embd = 128", "set model.n_head to 4");
  EXPECT_STREQ(e.what(),
               "model.n_head = 3 (configs/x.toml:2): must divide model.n_embd = 128; fix: set model.n_head to 4");
  const Error& as_error = e;  // catchable as any loom::Error
  EXPECT_NE(std::string(as_error.what()).find("fix:"), std::string::npos);
}

TEST(ConfigDeathTest, ReadingWithTheWrongTypeIsABug) {
  Config c(test_schema());
  EXPECT_DEATH(c.get<double>("model.n_layer"), "read with the wrong C\\+\\+ type");
  EXPECT_DEATH(c.get<int64_t>("model.n_layers"), "did you mean 'model.n_layer'");
}

TEST(ParseBytes, AcceptsBinaryAndDecimalUnits) {
  EXPECT_EQ(parse_bytes("2GiB"), size_t(2) << 30);
  EXPECT_EQ(parse_bytes("512MiB"), size_t(512) << 20);
  EXPECT_EQ(parse_bytes("1.5 GiB"), size_t(3) << 29);
  EXPECT_EQ(parse_bytes("64KB"), 64000u);
  EXPECT_EQ(parse_bytes("4096"), 4096u);
  EXPECT_EQ(parse_bytes("10B"), 10u);
  EXPECT_EQ(parse_bytes("unlimited"), kUnlimited);
}

TEST(ParseBytes, RejectsWithAClearMessage) {
  EXPECT_CONTAINS(error_of([] { parse_bytes("2 gigs"); }), "unknown unit 'gigs'");
  EXPECT_CONTAINS(error_of([] { parse_bytes("GiB"); }), "does not start with a number");
  EXPECT_CONTAINS(error_of([] { parse_bytes("-1GiB"); }), "negative");
  EXPECT_CONTAINS(error_of([] { parse_bytes("0.3B"); }), "whole number of bytes");
  EXPECT_CONTAINS(error_of([] { parse_bytes("99999999TiB"); }), "64 bits");
  EXPECT_CONTAINS(error_of([] { parse_bytes(""); }), "\"2GiB\"");
}

TEST(DidYouMean, FindsTyposButNotUnrelatedWords) {
  std::vector<std::string> words{"model.n_layer", "model.n_head", "train.lr"};
  EXPECT_EQ(did_you_mean("model.n_layre", words), "model.n_layer");
  EXPECT_EQ(did_you_mean("train.lrr", words), "train.lr");
  EXPECT_EQ(did_you_mean("optimizer.kind", words), std::nullopt);
}

}  // namespace
}  // namespace loom
