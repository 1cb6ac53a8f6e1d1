// Discovery: the tag directory (`latest` names it, e.g. global_stepN), its
// files by name (model states, ZeRO optimizer states, PipelineEngine layer
// files, MoE expert files), the TP / PP / DP degrees, the parsed model-states
// and optimizer-states pickles and the model's own copy per TP rank. Contract:
// Discover fails only when the tag as a whole cannot be read (a bad `latest`,
// no readable model states, contradictory degrees); a missing or unreadable
// rank file is recorded on that rank (and flagged), and the read goes on.
#include <re2/re2.h>

#include <cctype>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "formats/byte_reader.h"
#include "formats/deepspeed/ds_internal.h"
#include "formats/pickle.h"
#include "formats/torch_file.h"

namespace ckptfs::formats {

const PickleOptions& DeepSpeedPickleOptions() {
  static const PickleOptions o = [] {
    PickleOptions p;
    p.extra_modules = {"deepspeed"};
    // deepspeed/runtime/zero/config.py; CPython 3.11.0-3.11.4 pickle it by name.
    p.enums = {{"deepspeed.runtime.zero.config",
                "ZeroStageEnum",
                {{"disabled", 0}, {"optimizer_states", 1}, {"gradients", 2}, {"weights", 3}, {"max_stage", 3}}}};
    return p;
  }();
  return o;
}

}  // namespace ckptfs::formats

namespace ckptfs::formats::deepspeed {
namespace {

namespace fs = std::filesystem;

}  // namespace

const RE2& ModelRe() {
  static const RE2 r(R"(mp_rank_(\d+)_model_states\.pt)");
  return r;
}
const RE2& Zero3ModelRe() {
  static const RE2 r(R"((?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt)");
  return r;
}

namespace {

// PipelineEngine: one file per layer and TP rank (PipelineModule.ckpt_layer_path).
const RE2& LayerRe() {
  static const RE2 r(R"(layer_(\d+)-model_(\d+)-model_states\.pt$)");
  return r;
}
const RE2& OptimRe() {
  static const RE2 r(R"((bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt)");
  return r;
}

// DeepSpeed MoE expert files (engine._save_moe_checkpoint): the experts of
// MoE layer L, one file per global expert E, tensors under global names.
const RE2& ExpertFileRe() {
  static const RE2 r(R"(layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt)");
  return r;
}

// The groups of `v`, the param_shapes of model-states file `s` (one group
// when older DeepSpeed wrote a single dict).
Result<std::vector<Shapes>> ParamShapes(const Source& s, const PyValue* v) {
  std::vector<Shapes> out;
  if (v == nullptr || v->kind == PyKind::kNone) return out;
  // Older DeepSpeed wrote one dict for all parameters: a single group.
  std::vector<const PyValue*> groups;
  if (v->kind == PyKind::kDict) {
    groups.push_back(v);
  } else if (v->IsSeq()) {
    groups.assign(v->items.begin(), v->items.end());
  } else {
    return Invalid(s.rel + ": param_shapes is not a list");
  }
  for (const PyValue* g : groups) {
    if (g->kind != PyKind::kDict) return Invalid(s.rel + ": a param_shapes group is not a dict");
    out.emplace_back();
    for (const auto& [k, x] : g->dict) {
      if (!k->IsStr()) return Invalid(s.rel + ": param_shapes has a non-string name");
      ASSIGN_OR_RETURN(auto shape, AsIntVector(x, "param_shapes[" + k->s + "]"));
      out.back().emplace_back(k->s, std::move(shape));
    }
  }
  return out;
}

// The parameter shapes, buffer names, universal_checkpoint_info and (with
// `want_module`) the module state dict of model-states file `m`.
Status ParseModel(ModelStates& m, bool want_module) {
  const Source& s = *m.src;
  const PyValue* root = s.root();
  if (root == nullptr || root->kind != PyKind::kDict) return Invalid(s.rel + ": not a dict");
  ASSIGN_OR_RETURN(m.groups, ParamShapes(s, root->Get("param_shapes")));
  if (want_module) {
    const PyValue* mod = root->Get("module");
    if (mod != nullptr && mod->kind == PyKind::kDict) {
      for (const auto& [k, v] : mod->dict) {
        if (k->IsStr() && v->kind == PyKind::kTensor && m.module_by_name.emplace(k->s, v).second) {
          m.module.emplace_back(k->s, v);
        }
      }
    }
  }
  for (const auto& b : StrList(root->Get("buffer_names"))) m.buffers.insert(b);
  // The model dtype (ZeRO-3 keeps only empty placeholders of the parameters).
  if (const PyValue* mod = root->Get("module"); mod != nullptr && mod->kind == PyKind::kDict) {
    for (const auto& [k, v] : mod->dict) {
      if (!k->IsStr() || v->kind != PyKind::kTensor || m.buffers.count(k->s)) continue;
      if (auto l = Resolve(s, v, "module['" + k->s + "']"); l.ok()) m.model_dtype = l->dtype;
      break;
    }
  }
  if (m.model_dtype == DType::kInvalid) {
    if (const PyValue* cfg = root->Get("ds_config"); cfg != nullptr && cfg->kind == PyKind::kDict) {
      for (const auto& [name, dt] : {std::pair("bf16", DType::kBF16), std::pair("fp16", DType::kF16)}) {
        const PyValue* sec = cfg->Get(name);
        const PyValue* en = sec != nullptr && sec->kind == PyKind::kDict ? sec->Get("enabled") : nullptr;
        if (en != nullptr && en->kind == PyKind::kBool && en->b) m.model_dtype = dt;
      }
    }
  }
  m.uci = root->Get("universal_checkpoint_info");
  if (m.uci != nullptr && m.uci->kind != PyKind::kDict) m.uci = nullptr;
  return Status::Ok();
}

}  // namespace

// The tag directory's files, opened and parsed; mp, tp, pp and dp set.
Status Reader::Discover() {
  std::error_code ec;
  std::string latest = dir + "/latest";
  if (fs::is_regular_file(latest, ec)) {
    ASSIGN_OR_RETURN(std::string tag, ReadWholeFile(latest, 4096));
    while (!tag.empty() && std::isspace(static_cast<unsigned char>(tag.back()))) tag.pop_back();
    if (tag.empty() || tag == "." || tag == ".." || tag.find('/') != std::string::npos ||
        !fs::is_directory(dir + "/" + tag, ec)) {
      return Invalid("cannot parse " + latest + ": names '" + tag + "', which is not a directory here");
    }
    prefix = tag + "/";
  }
  std::map<int, std::string> model_files;
  std::map<std::pair<int, int>, std::string> z3_models, optim_files, layers;  // layers: (layer, tp)
  std::map<std::tuple<int, int, int>, std::string> expert_names;              // (mp, layer, expert)
  // expp_rank_<r>_mp_rank_XX_optim_states.pt: DeepSpeed <= 0.15's MoE saves.
  std::vector<std::string> expp_names;
  std::string opt_prefix;
  for (const auto& e : fs::directory_iterator(dir + "/" + prefix, ec)) {
    std::string n = e.path().filename().string();
    // Ranks that do not fit an int do not match (RE2 checks the conversion).
    int a = 0, b = 0, c = 0;
    std::string dtype_prefix;
    if (RE2::FullMatch(n, ModelRe(), &a)) {
      model_files[a] = n;
    } else if (RE2::FullMatch(n, Zero3ModelRe(), &a, &b)) {
      z3_models[{a, b}] = n;
    } else if (RE2::FullMatch(n, OptimRe(), &dtype_prefix, &a, &b)) {
      optim_files[{a, b}] = n;
      opt_prefix = dtype_prefix;
    } else if (RE2::FullMatch(n, LayerRe(), &a, &b)) {
      layers[{a, b}] = n;
    } else if (RE2::FullMatch(n, ExpertFileRe(), &a, &b, &c)) {
      expert_names[{c, a, b}] = n;
    } else if (n.starts_with("expp_rank_")) {
      expp_names.push_back(n);
    }
  }
  if (ec) return ErrnoStatus("list", dir + "/" + prefix, ec.value());
  pipeline = !layers.empty();
  if (model_files.empty() && z3_models.empty()) {
    if (!optim_files.empty()) {
      return Invalid("cannot read " + dir + "/" + prefix + "mp_rank_00_model_states.pt: missing (" +
                     std::to_string(optim_files.size()) +
                     " optimizer state files are present, but the parameter "
                     "shapes live in the model states)");
    }
    return Invalid("cannot parse " + dir + "/" + prefix +
                   ": no mp_rank_XX_model_states.pt (not a DeepSpeed checkpoint tag directory)");
  }
  files.dir = dir;
  files.ck = &ck;
  files.pickle = DeepSpeedPickleOptions();
  // TP ranks: the model-states files (stage 3: those of DP rank 0).
  std::set<int> mps;
  for (const auto& [mp, n] : model_files) mps.insert(mp);
  for (const auto& [k, n] : z3_models) mps.insert(k.second);
  mp = mps.empty() ? 0 : *mps.rbegin() + 1;
  std::set<int> dps;
  for (const auto& [k, n] : optim_files) dps.insert(k.first);
  for (const auto& [k, n] : z3_models) dps.insert(k.first);
  dp = dps.empty() ? 0 : *dps.rbegin() + 1;
  models.resize(mp);
  for (int t = 0; t < mp; ++t) {
    std::string n;
    if (auto it = model_files.find(t); it != model_files.end()) {
      n = it->second;
    } else if (auto it3 = z3_models.find({0, t}); it3 != z3_models.end()) {
      n = it3->second;
    } else {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "mp_rank_%02d_model_states.pt", t);
      n = buf;
    }
    models[t].src = files.Open(prefix + n);
    if (models[t].src->error.empty()) {
      Status st = ParseModel(models[t], model_files.count(t) > 0);
      if (!st.ok()) models[t].error = st.message();
    } else {
      models[t].error = models[t].src->error;
    }
  }
  // The first readable model-states file stands for the checkpoint's common
  // state (DeepSpeed writes it into every one); an unreadable file loses only
  // its own stage's parameter shapes.
  while (root < mp && !models[root].error.empty()) ++root;
  if (root == mp) return Invalid(models[0].error);
  RETURN_IF_ERROR(Topology(layers));
  if (const PyValue* c = models[root].src->root()->Get("ds_config"); c && c->kind == PyKind::kDict) {
    const PyValue* v = c->Get("use_data_before_expert_parallelism");
    data_before_ep = v != nullptr && v->kind == PyKind::kBool && v->b;
  }
  // The DP degree is what the writer recorded, not what happens to be on disk:
  // a missing last rank must show up as missing.
  if (const PyValue* v = models[root].src->root()->Get("dp_world_size"); v && v->kind == PyKind::kInt && v->i > dp) {
    if (v->i > 1 << 20) return Invalid(models[root].src->rel + ": implausible dp_world_size " + std::to_string(v->i));
    dp = static_cast<int>(v->i);
  }
  if (dp == 0 && !optim_files.empty()) dp = 1;
  optim_on_disk = static_cast<int>(optim_files.size());
  // Stage-3 model files of other DP ranks are part of the checkpoint too.
  for (const auto& [k, n] : z3_models) {
    if (k.first != 0) z3_copies.push_back(files.Open(prefix + n, /*parse=*/false));
  }
  optim.resize(dp);
  for (int d = 0; d < dp; ++d) {
    optim[d].resize(mp);
    for (int t = 0; t < mp; ++t) {
      OptimRank& o = optim[d][t];
      std::string n;
      if (auto it = optim_files.find({d, t}); it != optim_files.end()) {
        n = it->second;
      } else {
        char buf[96];
        std::snprintf(buf, sizeof(buf), "%szero_pp_rank_%d_mp_rank_%02d_optim_states.pt", opt_prefix.c_str(), d, t);
        n = buf;
      }
      o.src = files.Open(prefix + n);
      if (!o.src->error.empty()) {
        o.error = o.src->error;
      } else {
        Status st = ParseOptim(o);
        if (!st.ok()) o.error = st.message();
      }
      if (!o.error.empty()) {
        const bool missing = ck.files[o.src->file.v].mtime_ns == -1;
        ck.info.Flag(missing ? Check::kCoverage : Check::kUnreadable, Severity::kError, "", o.src->rel,
                     missing ? o.src->rel + " is missing (DP=" + std::to_string(dp) +
                                   "): the optimizer partitions "
                                   "it holds are holes in every parameter of its rank"
                             : o.error);
        continue;
      }
      if (stage == 0) {
        stage = o.stage;
        bf16_optimizer = o.bf16_optimizer;
      } else if (o.stage != stage) {
        o.error = o.src->rel + ": ZeRO stage " + std::to_string(o.stage) + " differs from the other ranks' " +
                  std::to_string(stage);
        problems.push_back(o.error);
      }
    }
  }
  ReadModule(layers);
  // MoE experts: the model copy of each global expert (module holds none).
  for (const auto& [key, n] : expert_names) {
    const int m = std::get<0>(key);
    if (m >= mp) continue;
    expert_files.push_back(files.Open(prefix + n));
    const Source& src = *expert_files.back();
    const PyValue* sd = src.root();
    if (!src.error.empty() || sd == nullptr || sd->kind != PyKind::kDict) {
      problems.push_back((src.error.empty() ? src.rel + " is not a state dict" : src.error) +
                         ": the model copy of its experts has no param view");
      continue;
    }
    for (const auto& [k, v] : sd->dict) {
      if (k->IsStr() && v->kind == PyKind::kTensor) module[m % tp].Add(k->s, ModuleEntry{&src, v, ""});
    }
  }
  // DeepSpeed <= 0.15's MoE saves add expp_rank_<r>_mp_rank_XX_optim_states.pt:
  // {'optimizer': None} under ZeRO (the ZeRO files hold the state), else the
  // engine's own optimizer.state_dict() (MoE without ZeRO), which is not read.
  std::sort(expp_names.begin(), expp_names.end());
  for (const std::string& n : expp_names) {
    const Source& s = *expp_files.emplace_back(files.Open(prefix + n));
    const PyValue* root_v = s.error.empty() ? s.root() : nullptr;
    const PyValue* opt = root_v != nullptr && root_v->kind == PyKind::kDict ? root_v->Get("optimizer") : nullptr;
    if (!s.error.empty()) {
      problems.push_back(s.error);
    } else if (opt == nullptr || opt->kind != PyKind::kNone) {
      problems.push_back(s.rel +
                         " holds the MoE run's optimizer state_dict without ZeRO (by parameter id, not "
                         "partitioned), which ckptfs does not map: its parameters have no optimizer state");
    }
  }
  // DeepSpeed <= 0.15 wrote MoE model states without param_shapes.
  if (stage == 1 || stage == 2) {
    for (int m = 0; m < mp; ++m) {
      if (!models[m].error.empty() || !models[m].groups.empty()) continue;
      Status st = SynthesizeParamShapes(m);
      if (st.ok()) {
        problems.push_back(models[m].src->rel +
                           " records no param_shapes (DeepSpeed <= 0.15 MoE saves): the flat groups' layout is "
                           "rebuilt from the optimizer files' param_slice_mappings and the module's shapes");
      } else {
        problems.push_back(models[m].src->rel +
                           " records no param_shapes, and they cannot be rebuilt from the "
                           "optimizer files (" +
                           st.message() + "): its parameters have no optimizer state");
      }
    }
  }
  return Status::Ok();
}

// The TP and PP degrees behind the mp index: checkpoint_parallel_dimensions
// when the writer recorded it (DeepSpeed >= 0.16), else, for PipelineEngine,
// the TP ranks of the layer files (DeepSpeedCheckpoint's rule); without a
// pipeline every mp file is a TP rank.
Status Reader::Topology(const std::map<std::pair<int, int>, std::string>& layers) {
  const Source& s0 = *models[root].src;
  tp = mp;
  pp = 1;
  if (const PyValue* d = s0.root()->Get("checkpoint_parallel_dimensions"); d && d->kind == PyKind::kDict) {
    const PyValue* t = d->Get("tp_degree");
    const PyValue* p = d->Get("pp_degree");
    if (t && p && t->kind == PyKind::kInt && p->kind == PyKind::kInt && t->i > 0 && p->i > 0) {
      if (t->i * p->i != mp) {
        return Invalid("cannot parse " + s0.rel + ": checkpoint_parallel_dimensions says TP=" + std::to_string(t->i) +
                       " PP=" + std::to_string(p->i) + ", but there are " + std::to_string(mp) + " mp_rank files");
      }
      tp = static_cast<int>(t->i);
      pp = static_cast<int>(p->i);
      return Status::Ok();
    }
  }
  if (!layers.empty()) {
    std::set<int> tps;
    for (const auto& [k, n] : layers) tps.insert(k.second);
    const int t = *tps.rbegin() + 1;
    if (mp % t != 0) {
      return Invalid("cannot parse " + dir + "/" + prefix + ": layer files name " + std::to_string(t) +
                     " TP ranks, which do not divide the " + std::to_string(mp) + " mp_rank files");
    }
    tp = t;
    pp = mp / t;
  }
  return Status::Ok();
}

// The model's own copy per TP rank. PipelineEngine keeps it in layer files
// with layer-local names: layer L's `k` is `L.k` when a stage's param_shapes
// (or buffer_names) has that name, else the one tied module parameter
// `tied_modules.<key>.k` the stages have, else `L.k` (a buffer or frozen
// tensor without optimizer state). The first layer file naming a tied module
// wins (the others hold the same tensor).
void Reader::ReadModule(const std::map<std::pair<int, int>, std::string>& layers) {
  module.resize(tp);
  if (!pipeline) {
    for (int t = 0; t < tp; ++t) {
      if (!models[t].error.empty()) {
        module[t].error = models[t].error;
        continue;
      }
      for (const auto& [name, v] : models[t].module) module[t].Add(name, ModuleEntry{models[t].src.get(), v, ""});
    }
    return;
  }
  std::vector<std::set<std::string>> known(tp);  // trainable and buffer names per TP rank, all stages
  std::vector<std::vector<std::string>> trainable(tp);
  for (int m = 0; m < mp; ++m) {
    for (const Shapes& g : models[m].groups) {
      for (const auto& [n, shape] : g) {
        if (known[m % tp].insert(n).second) trainable[m % tp].push_back(n);
      }
    }
    for (const auto& b : models[m].buffers) known[m % tp].insert(b);
  }
  // Every layer a stage's parameters name must have its file: one the
  // directory lacks is registered as missing (and its weights are EIO).
  std::map<std::pair<int, int>, std::string> want = layers;
  std::map<std::pair<int, int>, std::string> failed;  // (layer, tp) -> why
  static const RE2 kLayerName(R"(^(\d+)\.)", RE2::Latin1);
  for (int t = 0; t < tp; ++t) {
    for (const auto& n : trainable[t]) {
      int layer = 0;
      if (!RE2::PartialMatch(n, kLayerName, &layer)) continue;
      char buf[64];
      std::snprintf(buf, sizeof(buf), "layer_%02d-model_%02d-model_states.pt", layer, t);
      want.emplace(std::make_pair(layer, t), buf);
    }
  }
  for (const auto& [key, n] : want) {
    const auto [layer, t] = key;
    if (t >= tp) continue;
    layer_files.push_back(files.Open(prefix + n));
    const Source& src = *layer_files.back();
    if (!src.error.empty()) {
      failed[key] = src.error;
      problems.push_back(src.error + ": the weights of layer " + std::to_string(layer) + " (TP rank " +
                         std::to_string(t) + ") have no param view");
      continue;
    }
    const PyValue* sd = src.root();
    if (sd == nullptr || sd->kind != PyKind::kDict) {
      problems.push_back(src.rel + " is not a state dict: the weights of layer " + std::to_string(layer) +
                         " have no param view");
      continue;
    }
    for (const auto& [k, v] : sd->dict) {
      if (!k->IsStr() || v->kind != PyKind::kTensor) continue;
      std::string name = std::to_string(layer) + "." + k->s;
      if (!known[t].count(name)) {
        std::string tied;
        int found = 0;
        for (const auto& cand : known[t]) {
          if (cand.starts_with("tied_modules.") && cand.size() > k->s.size() + 1 && cand.ends_with("." + k->s)) {
            tied = cand;
            ++found;
          }
        }
        if (found == 1) name = tied;
      }
      module[t].Add(name, ModuleEntry{&src, v, ""});
    }
  }
  for (int t = 0; t < tp; ++t) {
    for (const auto& n : trainable[t]) {
      if (module[t].by_name.count(n)) continue;
      std::string why = "no layer file of TP rank " + std::to_string(t) + " holds '" + n + "'";
      if (int layer = 0; RE2::PartialMatch(n, kLayerName, &layer)) {
        if (auto it = failed.find({layer, t}); it != failed.end()) why = it->second;
      }
      module[t].Add(n, ModuleEntry{nullptr, nullptr, why});
    }
  }
}

}  // namespace ckptfs::formats::deepspeed
