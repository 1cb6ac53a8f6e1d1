// universal_checkpoint_info: the checkpoint's TP merge patterns (replicated,
// averaged, row-parallel, vocabulary, two sub-params, parameter_with_sub_params)
// compiled on RE2 and matched as Python's re.match does, and the rule each
// parameter name gets (the order ds_to_universal.py tests them in). Contract:
// untrusted patterns run in linear time; one RE2 cannot compile is reported
// (Unusable), never silently dropped.
#include <re2/re2.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ckptfs/geometry.h"
#include "formats/deepspeed/ds_internal.h"
#include "formats/pickle.h"
#include "formats/pickle_writer.h"
#include "formats/torch_file.h"

namespace ckptfs::formats::deepspeed {

PatternList::PatternList(std::vector<std::string> ps) {
  for (auto& p : ps) {
    RE2::Options o;
    o.set_log_errors(false);
    auto re = std::make_shared<RE2>(p, o);
    if (re->ok()) {
      res_.push_back(std::move(re));
    } else {
      bad_.push_back(p);
    }
  }
}

bool PatternList::Match(const std::string& name) const {
  return std::any_of(res_.begin(), res_.end(), [&](const std::shared_ptr<RE2>& r) {
    return r->Match(name, 0, name.size(), RE2::ANCHOR_START, nullptr, 0);
  });
}

Patterns::Patterns(const PyValue* uci) {
  if (uci == nullptr) return;
  present = true;
  replicated = PatternList(StrList(uci->Get("tp_replicated_parameter_patterns")));
  average = PatternList(StrList(uci->Get("parameter_to_average_patterns")));
  row = PatternList(StrList(uci->Get("parameter_with_row_parallelism_patterns")));
  vocab = PatternList(StrList(uci->Get("vocabulary_parameter_patterns")));
  sub2 = PatternList(StrList(uci->Get("parameter_with_2_sub_params_cat_dim_0")));
  std::vector<std::string> sp_list;
  if (const PyValue* sp = uci->Get("parameter_with_sub_params"); sp && sp->IsSeq()) {
    for (PyRef x : sp->items) {
      SubEntry e{x, {}};
      for (const auto& p : StrList(e.Field("patterns"))) {
        sp_list.push_back(p);
        e.patterns.emplace_back(p, PatternList({p}));
      }
      subs.push_back(std::move(e));
    }
  }
  sub_params = PatternList(std::move(sp_list));
  shard_widths = uci->Get("sub_param_shard_widths");
  if (const PyValue* v = uci->Get("original_vocab_size"); v && v->kind == PyKind::kInt) original_vocab = v->i;
  if (const PyValue* v = uci->Get("universal_checkpoint_version")) {
    if (v->kind == PyKind::kFloat) version = v->f;
    if (v->kind == PyKind::kInt) version = static_cast<double>(v->i);
  }
}

std::pair<const Patterns::SubEntry*, std::string> Patterns::SubFor(const std::string& name) const {
  for (const SubEntry& e : subs) {
    for (const auto& [p, list] : e.patterns) {
      if (list.Match(name)) return {&e, p};
    }
  }
  return {nullptr, ""};
}

Status Patterns::ResolveSub(const std::string& name, const std::vector<std::vector<int64_t>>& local, Rule& rule) const {
  auto [e, pattern] = SubFor(name);
  if (e == nullptr) return Internal("no sub-parameter entry for '" + name + "'");
  const PyValue* shape = e->Field("shape");
  ASSIGN_OR_RETURN(int64_t pd, AsInt(e->Field("partition_dim"), "partition_dim of '" + pattern + "'"));
  if (shape == nullptr || !shape->IsSeq() || pd < 0 || static_cast<size_t>(pd) >= shape->items.size()) {
    return Invalid("the sub-parameter shape of '" + pattern + "' has no partition dim " + std::to_string(pd));
  }
  const size_t tp = local.size(), d = static_cast<size_t>(pd);
  SubParams sp;
  sp.dim = static_cast<int>(pd);
  const PyValue* spec = shape->items[d];
  if (spec->IsSeq()) {
    ASSIGN_OR_RETURN(sp.sizes, AsIntVector(spec, "sub-parameter sizes of '" + pattern + "'"));
  } else if (version < 0.4) {
    ASSIGN_OR_RETURN(int64_t n, AsInt(spec, "sub-parameter count of '" + pattern + "'"));
    int64_t full = 0;
    for (const auto& l : local) {
      if (l.size() <= d) return Invalid("'" + name + "' has fewer dims than its sub-parameter partition dim");
      full += l[d];
    }
    if (n <= 0 || full % n != 0) {
      return Invalid("sub-parameter count " + std::to_string(n) + " of '" + name + "' does not divide " +
                     std::to_string(full));
    }
    sp.sizes.assign(static_cast<size_t>(n), full / n);
  } else {
    return Invalid("the sub-parameter shape of '" + pattern + "' has no sizes tuple at its partition dim");
  }
  if (version >= 0.4) {
    const PyValue* w = nullptr;
    if (shard_widths != nullptr && shard_widths->kind == PyKind::kDict) w = shard_widths->Get(pattern);
    if (w == nullptr || !w->IsSeq()) {
      return Invalid("universal checkpoint version " + std::to_string(version) +
                     " records no sub_param_shard_widths for '" + pattern + "'");
    }
    for (PyRef x : w->items) {
      ASSIGN_OR_RETURN(auto ws, AsIntVector(x, "sub_param_shard_widths of '" + pattern + "'"));
      sp.widths.push_back(std::move(ws));
    }
  } else {
    for (int64_t size : sp.sizes) {
      if (size % static_cast<int64_t>(tp) != 0) {
        return Invalid("sub-parameter size " + std::to_string(size) + " of '" + name + "' is not divisible by TP " +
                       std::to_string(tp));
      }
      sp.widths.emplace_back(tp, size / static_cast<int64_t>(tp));
    }
  }
  if (sp.widths.size() != sp.sizes.size()) {
    return Invalid("'" + name + "' has " + std::to_string(sp.widths.size()) + " shard width entries for " +
                   std::to_string(sp.sizes.size()) + " sub-parameters");
  }
  for (size_t j = 0; j < sp.sizes.size(); ++j) {
    int64_t sum = 0;
    for (int64_t x : sp.widths[j]) sum += x;
    if (sp.widths[j].size() != tp || sum != sp.sizes[j]) {
      return Invalid("shard widths of sub-parameter " + std::to_string(j) + " of '" + name + "' do not add up to " +
                     std::to_string(sp.sizes[j]) + " over " + std::to_string(tp) + " TP ranks");
    }
  }
  // The logical shape: tuples summed, the partition dim the sizes' sum, one -1 inferred.
  int64_t total = 0, known = 1, unknown = -1;
  for (const auto& l : local) total += NumelOf(l);
  for (size_t i = 0; i < shape->items.size(); ++i) {
    int64_t v = 0;
    if (i == d) {
      for (int64_t x : sp.sizes) v += x;
    } else if (shape->items[i]->IsSeq()) {
      ASSIGN_OR_RETURN(auto xs, AsIntVector(shape->items[i], "sub-parameter shape"));
      for (int64_t x : xs) v += x;
    } else {
      ASSIGN_OR_RETURN(v, AsInt(shape->items[i], "sub-parameter shape"));
    }
    if (v == -1 && unknown < 0) {
      unknown = static_cast<int64_t>(i);
    } else if (v <= 0) {
      return Invalid("sub-parameter shape of '" + pattern + "' has a dim of " + std::to_string(v));
    } else {
      known *= v;
    }
    sp.logical.push_back(v);
  }
  if (unknown >= 0) {
    if (total % known != 0) return Invalid("cannot infer the -1 dim of '" + name + "'");
    sp.logical[static_cast<size_t>(unknown)] = total / known;
  }
  rule.sub = std::move(sp);
  return Status::Ok();
}

Status Patterns::WriteSubparamShape(PickleWriter& w, const std::string& name, const Rule& rule) const {
  auto [e, pattern] = SubFor(name);
  if (e == nullptr) return Internal("no sub-parameter entry for '" + name + "'");
  auto no_tensor = [](PickleWriter&, const PyValue&) { return Unsupported("a tensor in a sub-parameter shape"); };
  w.Global("deepspeed.checkpoint.universal_checkpoint", "SubparamShape");
  w.BeginTuple();
  w.EndTuple();
  w.NewObj();
  w.BeginDict();
  w.Str("patterns");
  RETURN_IF_ERROR(w.Value(*e->Field("patterns"), no_tensor));
  w.Str("shape");
  const PyValue* shape = e->Field("shape");
  const size_t d = static_cast<size_t>(rule.sub.dim);
  if (shape->items[d]->IsSeq()) {
    RETURN_IF_ERROR(w.Value(*shape, no_tensor));
  } else {
    w.BeginTuple();
    for (size_t i = 0; i < shape->items.size(); ++i) {
      if (i != d) {
        RETURN_IF_ERROR(w.Value(*shape->items[i], no_tensor));
        continue;
      }
      w.BeginTuple();
      for (int64_t x : rule.sub.sizes) w.Int(x);
      w.EndTuple();
    }
    w.EndTuple();
  }
  w.Str("partition_dim");
  RETURN_IF_ERROR(w.Value(*e->Field("partition_dim"), no_tensor));
  w.EndDict();
  w.Build();
  return Status::Ok();
}

std::vector<std::string> Patterns::Unusable() const {
  std::vector<std::string> out;
  for (const PatternList* l : {&replicated, &average, &row, &vocab, &sub2, &sub_params}) {
    out.insert(out.end(), l->bad().begin(), l->bad().end());
  }
  return out;
}

Rule Patterns::For(const std::string& name) const {
  Rule r;
  if (Any(replicated, name)) {
    r.kind = Merge::kReplicated;
  } else if (Any(average, name)) {
    r.kind = Merge::kAverage;
  } else if (Any(sub2, name)) {
    r.kind = Merge::kSub2;
  } else if (Any(sub_params, name)) {
    r.kind = Merge::kSubParams;
  } else {
    r.cat_dim = Any(row, name) ? 1 : 0;
  }
  r.vocab = Any(vocab, name);
  return r;
}

}  // namespace ckptfs::formats::deepspeed
