// verl's config directory for hf/: its checkpoint manager saves the model's
// Hugging Face config and tokenizer in a huggingface/ directory beside the
// rank files. The planner asks every convention's config_dir for every
// checkpoint, so any directory laid out this way is served alike.
#include "formats/torchsave/verl_hf.h"

#include <sys/stat.h>

#include <string>

namespace ckptfs::formats {
namespace {

// huggingface/ when `src` holds no config.json beside the weights and that
// directory (a real one: a symlink there is not followed) holds one.
std::string ConfigDir(const std::string& src) {
  struct stat st {};
  if (::lstat((src + "/config.json").c_str(), &st) == 0) return "";
  if (::lstat((src + "/huggingface").c_str(), &st) == 0 && S_ISDIR(st.st_mode) &&
      ::lstat((src + "/huggingface/config.json").c_str(), &st) == 0) {
    return src + "/huggingface";
  }
  return "";
}

}  // namespace

const hf::HfConvention& VerlHfConvention() {
  static const hf::HfConvention kConvention = [] {
    hf::HfConvention c;
    c.name = "verl";
    c.config_dir = &ConfigDir;
    return c;
  }();
  return kConvention;
}

}  // namespace ckptfs::formats
