#include "formats/torchsave/state_walk.h"

namespace ckptfs::formats {
namespace {

// Nesting deeper than this is not a state dict; it is cut off with a note.
constexpr size_t kMaxDepth = 32;

bool IsTorchDistributedObject(const PyValue* v, std::string_view cls) {
  return v != nullptr && v->kind == PyKind::kObject && v->callable && v->callable->kind == PyKind::kGlobal &&
         v->callable->name() == cls && v->callable->s.rfind("torch.distributed", 0) == 0;
}

}  // namespace

bool IsDTensor(const PyValue* v) { return IsTorchDistributedObject(v, "DTensor"); }
bool IsShardedTensor(const PyValue* v) { return IsTorchDistributedObject(v, "ShardedTensor"); }

// Every tensor of a nested dict / list, with its path; non-tensor leaves are
// counted (they are metadata: param_groups, counters, strings).
void WalkStateDict(const PyValue* v, std::vector<std::string>& path, std::vector<Leaf>& out, size_t* skipped,
                   bool* too_deep) {
  if (v->kind == PyKind::kTensor || IsDTensor(v) || IsShardedTensor(v)) {
    out.push_back(Leaf{path, v});
    return;
  }
  if (path.size() >= kMaxDepth) {
    *too_deep = true;
    return;
  }
  if (v->kind == PyKind::kDict) {
    for (const auto& [k, x] : v->dict) {
      if (k->kind == PyKind::kStr) {
        path.push_back(k->s);
      } else if (k->kind == PyKind::kInt) {
        path.push_back(std::to_string(k->i));
      } else {
        ++*skipped;
        continue;
      }
      WalkStateDict(x, path, out, skipped, too_deep);
      path.pop_back();
    }
  } else if (v->IsSeq()) {
    for (size_t i = 0; i < v->items.size(); ++i) {
      path.push_back(std::to_string(i));
      WalkStateDict(v->items[i], path, out, skipped, too_deep);
      path.pop_back();
    }
  } else {
    ++*skipped;
  }
}

std::string JoinPath(const std::vector<std::string>& p) {
  std::string s;
  for (const std::string& x : p) s += (s.empty() ? "" : ".") + x;
  return s;
}

}  // namespace ckptfs::formats
