#include "formats/state_dict_roles.h"

#include <algorithm>
#include <cstring>
#include <set>

namespace ckptfs::formats {
namespace {

std::string Join(const std::vector<std::string>& v, size_t from) {
  std::string out;
  for (size_t i = from; i < v.size(); ++i) {
    if (!out.empty()) out.push_back('.');
    out += v[i];
  }
  return out;
}

}  // namespace

bool IsOptimizerRoot(std::string_view s) {
  if (s == "optimizer" || s == "optim" || s == "optimizers") return true;
  return s.size() > 10 && s.rfind("optimizer_", 0) == 0 &&
         std::all_of(s.begin() + 10, s.end(), [](char c) { return c >= '0' && c <= '9'; });
}
namespace {

// The roots a model's state dict sits under: "model" (torch's get_state_dict,
// Fabric, Accelerate), "state_dict" (Lightning's Trainer).
bool IsModelRoot(const std::string& s) { return s == "model" || s == "state_dict"; }
bool IsNonModelRoot(const std::string& s) {
  static const std::set<std::string> kRoots = {"lr_scheduler", "scheduler",   "dataloader", "train_state",
                                               "extra",        "extra_state", "rng",        "rng_state",
                                               "args",         "trainer",     "metrics"};
  return kRoots.count(s) > 0 || IsOptimizerRoot(s);
}

// Splits "<fqn>.<state>" where fqn is the longest known parameter name.
bool SplitByKnownFqn(const std::string& rest, const std::set<std::string>& fqns, std::string* fqn, std::string* state) {
  for (size_t dot = rest.rfind('.'); dot != std::string::npos && dot > 0; dot = rest.rfind('.', dot - 1)) {
    if (fqns.count(rest.substr(0, dot))) {
      *fqn = rest.substr(0, dot);
      *state = rest.substr(dot + 1);
      return true;
    }
  }
  return false;
}

}  // namespace

// Assigns role / fqn / state. Documented in docs/tree.md "How keys map to params/".
// `paths`: each tensor's state-dict path (PathOf), parallel to `tensors`.
void ClassifyStateDict(std::vector<TensorRecord>& tensors, const std::vector<std::vector<std::string>>& paths) {
  bool has_model_root = false;
  for (const auto& p : paths) {
    if (p.size() > 1 && IsModelRoot(p[0])) has_model_root = true;
  }
  std::set<std::string> fqns;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TensorRecord& t = tensors[i];
    const auto& p = paths[i];
    t.role = Role::kOther;
    t.fqn = t.key;
    t.state.clear();
    if (t.encoding != Encoding::kTensor) continue;
    if (p.size() > 1 && IsModelRoot(p[0])) {
      t.role = Role::kParam;
      t.fqn = Join(p, 1);
    } else if (p.size() == 1 && !has_model_root && !IsNonModelRoot(p[0].substr(0, p[0].find('.'))) &&
               !(t.shape.empty() && (p[0] == "step" || p[0] == "epoch" || p[0] == "iteration"))) {
      t.role = Role::kParam;  // torchtitan-style bare FQNs at the top level
      t.fqn = p[0];
    }
    if (t.role == Role::kParam) {
      t.state = "param";
      fqns.insert(t.fqn);
    }
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    TensorRecord& t = tensors[i];
    const auto& p = paths[i];
    if (t.encoding != Encoding::kTensor || t.role == Role::kParam) continue;
    std::string fqn, state;
    bool ok = false;
    if (p.size() >= 4 && IsOptimizerRoot(p[0]) && p[1] == "state") {
      fqn = p[2];
      state = Join(p, 3);
      ok = fqns.count(fqn) > 0 || fqns.empty() || !std::all_of(fqn.begin(), fqn.end(), ::isdigit);
    } else if (p.size() >= 2 && IsOptimizerRoot(p[0])) {
      std::string rest = Join(p, 1);  // "state.<fqn>.<k>" when flattened into one key
      if (rest.rfind("state.", 0) == 0) ok = SplitByKnownFqn(rest.substr(6), fqns, &fqn, &state);
    } else if (p.size() == 1) {
      const std::string& k = p[0];
      const size_t dot = k.find(".state.");
      if (dot != std::string::npos && IsOptimizerRoot(k.substr(0, dot))) {
        ok = SplitByKnownFqn(k.substr(dot + 7), fqns, &fqn, &state);
      }
    }
    if (ok && !state.empty()) {
      t.role = Role::kOptimState;
      t.fqn = fqn;
      t.state = state;
    }
  }
}

}  // namespace ckptfs::formats
