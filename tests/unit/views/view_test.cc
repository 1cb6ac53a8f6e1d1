#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "../test_util.h"
#include "ckptfs/views.h"

namespace ckptfs {
namespace {

using ckptfs::testing::TempDir;

// A "synthetic" checkpoint of one source file `d` of `bytes` bytes in `t`.
Checkpoint SyntheticCheckpoint(const TempDir& t, size_t bytes) {
  Checkpoint ck;
  ck.info.family = Family::kUnknown;
  ck.files.push_back(SourceFile{"d", 0, 0, 0});
  ckptfs::testing::WriteFile(t.path() + "/d", std::string(bytes, 'a'));
  ckptfs::testing::FillStat(t.path(), &ck.files[0]);
  return ck;
}

// One tensor of `shape` in one C-order fragment at the start of file 0.
void AddTensor(Checkpoint& ck, const std::string& key, Role role, const std::string& fqn, const std::string& state,
               DType dt, std::vector<int64_t> shape) {
  TensorRecord r;
  r.key = key;
  r.role = role;
  r.fqn = fqn;
  r.state = state;
  r.dtype = dt;
  r.shape = shape;
  r.byte_size = r.Numel() * DTypeSize(dt);
  r.num_fragments = 1;
  ck.tensors.push_back(r);
  Fragment f;
  f.offsets.assign(shape.size(), 0);
  f.lengths = shape;
  f.strides.assign(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) f.strides[d - 1] = f.strides[d] * shape[d];
  f.dtype = dt;
  f.data_length = r.byte_size;
  ck.fragments.Append({f});
}

TEST(PathComponentTest, SanitizesKeys) {
  EXPECT_EQ(PathComponent("a/b"), "a%2Fb");
  EXPECT_EQ(PathComponent(""), "_");
  EXPECT_EQ(PathComponent(".."), "_..");
  EXPECT_LE(PathComponent(std::string(600, 'x')).size(), 255u);
}

TEST(ViewTest, LayoutsAndCollisions) {
  TempDir t;
  Checkpoint ck = SyntheticCheckpoint(t, 100);
  auto add = [&](const std::string& key, Role role, const std::string& fqn, const std::string& state, DType dt,
                 std::vector<int64_t> shape) { AddTensor(ck, key, role, fqn, state, dt, shape); };
  add("model.w", Role::kParam, "w", "param", DType::kBF16, {3, 2});
  add("opt.w.exp_avg", Role::kOptimState, "w", "exp_avg", DType::kF32, {3, 2});
  add("x", Role::kOther, "x", "", DType::kI64, {2});
  add("dup", Role::kParam, "w", "param", DType::kF32, {1});
  ASSERT_TRUE(Index::Build(ck, t.path() + "/ix").ok());
  auto ix = Index::Open(t.path() + "/ix", t.path());
  ASSERT_TRUE(ix.ok());
  auto v = View::Build(**ix);
  ASSERT_TRUE(v.ok());
  auto npy = (*v)->Resolve("params/w/param.npy");
  ASSERT_TRUE(npy.ok());
  auto l = (*v)->Layout(*npy);
  ASSERT_TRUE(l.ok());
  ASSERT_EQ((*l)->segments.size(), 2u);
  EXPECT_EQ((*l)->segments[1].out_dtype, DType::kF32);  // bf16 widened
  EXPECT_EQ((*l)->size, (*l)->segments[0].size + 24);
  auto raw = (*v)->Layout(*(*v)->Resolve("params/w/param.raw"));
  EXPECT_EQ((*raw)->size, 12u);
  EXPECT_TRUE((*v)->Resolve("other/x.npy").ok());
  // The colliding fourth entry is kept under a distinct name and reported.
  EXPECT_TRUE((*v)->Resolve("params/w/param.npy~3").ok());
  auto cj = (*v)->Layout(*(*v)->Resolve("checkpoint.json"));
  EXPECT_NE((*cj)->segments[0].literal().find("two entries map to"), std::string::npos);
  EXPECT_EQ((*v)->PathOf(*npy), "/params/w/param.npy");
  // hf/ is planned at its first lookup or listing. When it cannot be (here an
  // --hf-arch that the command line would have refused), hf/ holds only
  // ERRORS, saying why.
  EXPECT_TRUE((*v)->Resolve("hf/model.safetensors.index.json").ok());
  TopoOptions bad;
  bad.hf_arch = "bogus";
  auto w = View::Build(**ix, bad);
  ASSERT_TRUE(w.ok());
  auto hf = (*w)->Resolve("hf");
  ASSERT_TRUE(hf.ok());
  auto listed = (*w)->List(*hf);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(std::get<0>(listed[0]), "ERRORS");
  auto errors = (*w)->Layout(*(*w)->Resolve("hf/ERRORS"));
  ASSERT_TRUE(errors.ok());
  EXPECT_EQ((*errors)->segments[0].literal().rfind("hf/ is not available: --hf-arch 'bogus': expected one of ", 0), 0u)
      << (*errors)->segments[0].literal();
}

TEST(ViewTest, InfoJsonSizeComesFromTheRecordsAndMatchesItsBytes) {
  TempDir t;
  Checkpoint ck;
  ck.info.family = Family::kUnknown;
  ck.files.push_back(SourceFile{"rank \"0\".bin", 0, 0, 0});  // a name JSON must escape
  ckptfs::testing::WriteFile(t.path() + "/rank \"0\".bin", std::string(4096, 'a'));
  ckptfs::testing::FillStat(t.path(), &ck.files[0]);
  auto add = [&](const std::string& state, uint32_t replicas, bool zstd, const std::string& error) {
    TensorRecord r;
    r.key = "k." + state;
    r.role = state == "param" ? Role::kParam : Role::kOptimState;
    r.fqn = "w";
    r.state = state;
    r.dtype = DType::kF32;
    r.shape = {4, 8};
    r.byte_size = 128;
    r.replicas = replicas;
    r.error = error;
    std::vector<Fragment> frags;
    for (uint32_t c = 0; c < replicas && error.empty(); ++c) {
      for (int64_t row = 0; row < 4; row += 2) {
        Fragment f;
        f.offsets = {row, 0};
        f.lengths = {2, 8};
        f.strides = {8, 1};
        f.dtype = DType::kF32;
        f.data_offset = static_cast<uint64_t>(row) * 32 + c * 1000;
        f.data_length = 64;
        f.replica = c;
        if (zstd) {
          f.compression = Compression::kZstd;
          f.item_offset = 77;
          f.item_length = 123456789;
        }
        frags.push_back(f);
      }
    }
    r.num_fragments = static_cast<uint32_t>(frags.size());
    ck.tensors.push_back(r);
    ck.fragments.Append(frags);
  };
  add("param", 1, false, "");
  add("exp_avg", 3, false, "");
  add("exp_avg_sq", 1, true, "");
  add("step", 1, false, "cannot index 'k.step': broken");
  ASSERT_TRUE(Index::Build(ck, t.path() + "/ix").ok());
  auto ix = Index::Open(t.path() + "/ix", t.path());
  ASSERT_TRUE(ix.ok());
  for (const TensorRecord& r : (*ix)->tensors()) EXPECT_EQ(r.fragments_json_bytes == 0, !r.error.empty()) << r.key;
  auto v = View::Build(**ix);
  ASSERT_TRUE(v.ok());
  auto ino = (*v)->Resolve("params/w/info.json");
  ASSERT_TRUE(ino.ok());
  auto size = (*v)->Size(*ino);  // before the layout exists: no fragment read
  ASSERT_TRUE(size.ok()) << size.status().message();
  EXPECT_FALSE((*v)->Get(*ino)->made);
  auto l = (*v)->Layout(*ino);
  ASSERT_TRUE(l.ok()) << l.status().message();
  EXPECT_EQ((*l)->size, *size);
  EXPECT_EQ(*(*v)->Size(*ino), *size);
  std::string text;
  for (const Segment& seg : (*l)->segments)
    text += seg.kind == SegmentKind::kLiteral ? std::string(seg.literal()) : std::string(seg.size, '0');
  auto j = nlohmann::json::parse(text, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << text;
  EXPECT_EQ(j["tensors"]["exp_avg"]["fragments"].size(), 6u);
  EXPECT_EQ(j["tensors"]["exp_avg"]["fragments"][5]["copy"], 2);
  EXPECT_EQ(j["tensors"]["exp_avg_sq"]["fragments"][0]["zstd_item"][1], 123456789);
  EXPECT_EQ(j["tensors"]["param"]["fragments"][0]["file"], "rank \"0\".bin");
  EXPECT_TRUE(j["tensors"]["step"]["fragments"].empty());
}

// A vocabulary stored with tensor-parallel padding rows: params/ serves the
// vocabulary's rows as <state>.npy / .raw and the padding rows as
// <state>.vocab_padding.npy / .raw (each byte once); info.json and dcp/ give
// the vocabulary's shape; vocab_rows survives the index.
TEST(ViewTest, PaddedVocabularyIsCutWithItsPaddingBeside) {
  TempDir t;
  Checkpoint ck = SyntheticCheckpoint(t, 4096);
  AddTensor(ck, "emb", Role::kParam, "emb", "param", DType::kBF16, {8, 2});
  AddTensor(ck, "emb.exp_avg", Role::kOptimState, "emb", "exp_avg", DType::kF32, {8, 2});
  for (TensorRecord& r : ck.tensors) r.vocab_rows = 5;
  ASSERT_TRUE(Index::Build(ck, t.path() + "/ix").ok());
  auto ix = Index::Open(t.path() + "/ix", t.path());
  ASSERT_TRUE(ix.ok());
  EXPECT_EQ((*ix)->tensors()[0].vocab_rows, 5);
  EXPECT_EQ((*ix)->tensors()[0].VocabShape(), (std::vector<int64_t>{5, 2}));
  auto v = View::Build(**ix);
  ASSERT_TRUE(v.ok());
  auto raw = (*v)->Resolve("params/emb/param.raw");
  auto pad = (*v)->Resolve("params/emb/param.vocab_padding.raw");
  ASSERT_TRUE(raw.ok() && pad.ok());
  EXPECT_EQ(*(*v)->Size(*raw), 5u * 2 * 2);
  EXPECT_EQ(*(*v)->Size(*pad), 3u * 2 * 2);
  const FileLayout* lr = *(*v)->Layout(*raw);
  const FileLayout* lp = *(*v)->Layout(*pad);
  EXPECT_EQ(lr->size, 20u);
  ASSERT_EQ(lp->segments.size(), 1u);
  EXPECT_EQ(lp->segments[0].boxes, (std::vector<Box>{Box{{5, 0}, {3, 2}}}));
  auto npy = (*v)->Resolve("params/emb/exp_avg.vocab_padding.npy");
  ASSERT_TRUE(npy.ok());
  const FileLayout* ln = *(*v)->Layout(*npy);
  EXPECT_NE(ln->segments[0].literal().find("'shape': (3, 2)"), std::string::npos) << ln->segments[0].literal();
  EXPECT_EQ(*(*v)->Size(*npy), ln->size);
  auto info = (*v)->Resolve("params/emb/info.json");
  ASSERT_TRUE(info.ok());
  const uint64_t sized = *(*v)->Size(*info);
  const FileLayout* li = *(*v)->Layout(*info);
  EXPECT_EQ(li->size, sized);
  std::string text;
  for (const Segment& seg : li->segments) {
    text += seg.kind == SegmentKind::kLiteral ? std::string(seg.literal()) : std::string(seg.size, '0');
    if (seg.kind == SegmentKind::kHash) {
      EXPECT_EQ(seg.boxes.size(), 1u);  // each hash is of its rows
    }
  }
  auto j = nlohmann::json::parse(text, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << text;
  ASSERT_EQ(j["tensors"].size(), 2u);  // the padding is described inside each state's entry
  EXPECT_EQ(j["tensors"]["param"]["shape"], nlohmann::json::parse("[5, 2]"));
  EXPECT_EQ(j["tensors"]["param"]["bytes"], 20);
  EXPECT_EQ(j["tensors"]["param"]["vocab_padding"]["rows"], 3);
  EXPECT_EQ(j["tensors"]["exp_avg"]["vocab_padding"]["file"], "exp_avg.vocab_padding.npy");
  EXPECT_EQ(j["tensors"]["exp_avg"]["vocab_padding"]["stored_shape"], nlohmann::json::parse("[8, 2]"));
}

}  // namespace
}  // namespace ckptfs

namespace ckptfs {
namespace {

// universal/zero/<name>/ embeds parameter names from the checkpoint: '..',
// '' and over-long components stay single, visible entries inside the tree.
TEST(ViewTest, ExportPathComponentsAreEscaped) {
  ckptfs::testing::TempDir t;
  Checkpoint ck;
  ck.info.family = Family::kUnknown;
  for (const char* p : {"universal/zero/../fp32.pt", "universal/zero//fp32.pt", "universal/zero/./x/fp32.pt"}) {
    ExportFile x;
    x.path = p;
    ExportPart part;
    part.literal = "abc";
    part.size = 3;
    x.parts.push_back(part);
    ck.exports.push_back(x);
  }
  ExportFile longx;
  longx.path = "universal/zero/" + std::string(4000, 'n') + "/fp32.pt";
  longx.parts = ck.exports[0].parts;
  ck.exports.push_back(longx);
  ASSERT_TRUE(Index::Build(ck, t.path() + "/ix").ok());
  auto ix = Index::Open(t.path() + "/ix", t.path());
  ASSERT_TRUE(ix.ok());
  auto v = View::Build(**ix);
  ASSERT_TRUE(v.ok()) << v.status().message();
  EXPECT_TRUE((*v)->Resolve("universal/zero/_../fp32.pt").ok());
  EXPECT_TRUE((*v)->Resolve("universal/zero/_/fp32.pt").ok());
  EXPECT_TRUE((*v)->Resolve("universal/zero/_./x/fp32.pt").ok());
  auto zero = (*v)->Resolve("universal/zero");
  ASSERT_TRUE(zero.ok());
  size_t n = 0;
  for (const auto& [name, ino, is_dir] : (*v)->List(*zero)) {
    EXPECT_TRUE(name != ".." && name != "." && !name.empty() && name.size() <= 255) << name;
    ++n;
  }
  EXPECT_EQ(n, 4u);
}

// hf/'s safetensors headers and model.safetensors.index.json are written as
// text, not through a JSON tree (a 100k-tensor mount spent seconds in it): the
// bytes must stay what nlohmann's dump gives (compact / indent 2), escaping
// included, across shards and with no tensor at all.
TEST(ViewTest, HfHeadersAndIndexJsonAreNlohmannsText) {
  using ojson = nlohmann::ordered_json;
  auto literal = [](const View& v, const std::string& path) {
    auto ino = v.Resolve(path);
    EXPECT_TRUE(ino.ok()) << path;
    if (!ino.ok()) return std::string();
    auto l = v.Layout(*ino);
    EXPECT_TRUE(l.ok() && !(*l)->segments.empty()) << path;
    if (!l.ok() || (*l)->segments.empty()) return std::string();
    return std::string((*l)->segments[0].literal());
  };
  for (bool with_params : {true, false}) {
    TempDir t;
    Checkpoint ck = SyntheticCheckpoint(t, 64);
    const std::vector<std::string> names = {"a.w", "b\"q\\.w", "\xc3\xbc.w", "c\n\b\f\x01.w"};
    for (const std::string& name : names) {
      AddTensor(ck, name, with_params ? Role::kParam : Role::kOptimState, name, with_params ? "param" : "exp_avg",
                DType::kF32, {2, 2});
    }
    ASSERT_TRUE(Index::Build(ck, t.path() + "/ix").ok());
    auto ix = Index::Open(t.path() + "/ix", t.path());
    ASSERT_TRUE(ix.ok());
    TopoOptions topo;
    topo.hf_shard_bytes = 40;  // two tensors per shard
    auto v = View::Build(**ix, topo);
    ASSERT_TRUE(v.ok()) << v.status().message();
    const std::string index_json = literal(**v, "hf/model.safetensors.index.json");
    const ojson parsed = ojson::parse(index_json);
    EXPECT_EQ(index_json, parsed.dump(2) + "\n");
    if (!with_params) {
      EXPECT_EQ(parsed["weight_map"], ojson::object());
      EXPECT_EQ(parsed["metadata"]["total_size"], 0);
      continue;
    }
    ASSERT_EQ(parsed["weight_map"].size(), names.size());
    std::vector<std::string> order;  // the view's tensor order
    for (const auto& [name, shard] : parsed["weight_map"].items()) {
      EXPECT_EQ(shard, order.size() < 2 ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors");
      order.push_back(name);
    }
    EXPECT_EQ(std::set<std::string>(order.begin(), order.end()), std::set<std::string>(names.begin(), names.end()));
    for (int k = 1; k <= 2; ++k) {
      const std::string st = literal(**v, "hf/model-0000" + std::to_string(k) + "-of-00002.safetensors");
      ASSERT_GT(st.size(), 8u);
      std::string header = st.substr(8);
      while (!header.empty() && header.back() == ' ') header.pop_back();
      const ojson h = ojson::parse(header);
      EXPECT_EQ(header, h.dump());
      EXPECT_EQ(h.begin().key(), "__metadata__");
      EXPECT_EQ(h.size(), 3u);
      EXPECT_EQ(h[order[2 * (k - 1) + 1]]["data_offsets"], ojson::array({16, 32}));
      EXPECT_EQ(h[order[2 * (k - 1)]]["shape"], ojson::array({2, 2}));
    }
  }
}

// The tree of a big checkpoint: a directory past the scan limit is found by
// hash while building, every listing is in name order (hf/ added later
// included), a collision in a big directory is still renamed, and the lazy
// .npy / .raw / info.json sizes equal their layouts' once made.
TEST(ViewTest, BigDirectoriesLazyFilesAndLateChildren) {
  TempDir t;
  Checkpoint ck = SyntheticCheckpoint(t, 64);
  auto add = [&](const std::string& key, Role role, const std::string& fqn, const std::string& state, DType dt) {
    AddTensor(ck, key, role, fqn, state, dt, {2, 3});
  };
  std::vector<std::string> fqns;
  for (int i = 29; i >= 0; --i) {  // added in reverse name order
    const std::string fqn = "layers." + std::string(i < 10 ? "0" : "") + std::to_string(i) + ".w";
    fqns.push_back(fqn);
    add("model." + fqn, Role::kParam, fqn, "param", DType::kBF16);
    add("optim." + fqn + ".exp_avg", Role::kOptimState, fqn, "exp_avg", DType::kF32);
  }
  for (int i = 0; i < 12; ++i) add("x" + std::to_string(i), Role::kOther, "", "", DType::kF32);
  add("x3", Role::kOther, "", "", DType::kI64);  // collides with other/x3.npy in a hashed directory
  ASSERT_TRUE(Index::Build(ck, t.path() + "/ix").ok());
  auto ix = Index::Open(t.path() + "/ix", t.path());
  ASSERT_TRUE(ix.ok());
  auto v = View::Build(**ix);
  ASSERT_TRUE(v.ok()) << v.status().message();
  auto names = [&](const std::string& dir) {
    std::vector<std::string> out;
    for (const auto& [name, ino, is_dir] : (*v)->List(*(*v)->Resolve(dir))) out.push_back(name);
    return out;
  };
  std::vector<std::string> params = names("params");
  std::sort(fqns.begin(), fqns.end());
  EXPECT_EQ(params, fqns);
  std::vector<std::string> other = names("other");
  EXPECT_TRUE(std::is_sorted(other.begin(), other.end()));
  EXPECT_EQ(other.size(), 26u);  // 13 x (.npy, .raw)
  auto renamed =
      std::find_if(other.begin(), other.end(), [](const std::string& n) { return n.rfind("x3.npy~", 0) == 0; });
  ASSERT_NE(renamed, other.end());
  EXPECT_TRUE((*v)->Resolve("other/" + *renamed).ok());
  EXPECT_TRUE((*v)->Resolve("other/x11.raw").ok());
  for (const std::string& fqn : {std::string("layers.00.w"), std::string("layers.29.w")}) {
    EXPECT_EQ(names("params/" + fqn),
              (std::vector<std::string>{"exp_avg.npy", "exp_avg.raw", "info.json", "param.npy", "param.raw"}));
    for (const char* f : {"param.npy", "param.raw", "exp_avg.npy", "info.json"}) {
      auto ino = (*v)->Resolve("params/" + fqn + "/" + f);
      ASSERT_TRUE(ino.ok()) << f;
      auto size = (*v)->Size(*ino);
      auto layout = (*v)->Layout(*ino);
      ASSERT_TRUE(size.ok() && layout.ok()) << f;
      EXPECT_EQ(*size, (*layout)->size) << f;
      EXPECT_EQ((*v)->Size(*ino).value(), *size) << f;  // and again once made
    }
  }
  // param.npy: a bf16 tensor widened to f32 behind its .npy header.
  auto npy = (*v)->Layout(*(*v)->Resolve("params/layers.07.w/param.npy"));
  ASSERT_EQ((*npy)->segments.size(), 2u);
  EXPECT_EQ((*npy)->segments[1].out_dtype, DType::kF32);
  EXPECT_EQ((*npy)->segments[1].size, 24u);
  auto raw = (*v)->Layout(*(*v)->Resolve("params/layers.07.w/param.raw"));
  ASSERT_EQ((*raw)->segments.size(), 1u);
  EXPECT_EQ((*raw)->segments[0].out_dtype, DType::kBF16);
  // The root, with hf/'s files made after the build, in name order.
  std::vector<std::string> root = names("");
  EXPECT_TRUE(std::is_sorted(root.begin(), root.end()));
  std::vector<std::string> hf = names("hf");
  EXPECT_TRUE(std::is_sorted(hf.begin(), hf.end()));
  EXPECT_TRUE((*v)->Resolve("hf/model.safetensors.index.json").ok());
  EXPECT_TRUE((*v)->Resolve("hf/ERRORS").ok());
}

}  // namespace
}  // namespace ckptfs
