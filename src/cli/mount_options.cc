#include "cli/mount_options.h"

#include <algorithm>
#include <map>

namespace ckptfs::cli {

// Splits a mount(8) option string at unescaped commas ("a,b\,c" -> a, b,c).
std::vector<std::string> SplitMountOptions(const std::string& s) {
  std::vector<std::string> out(1);
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) {
      out.back() += s[++i];
    } else if (s[i] == ',') {
      out.emplace_back();
    } else {
      out.back() += s[i];
    }
  }
  std::vector<std::string> kept;
  for (auto& o : out) {
    if (!o.empty()) kept.push_back(std::move(o));
  }
  return kept;
}

// `-o OPT,..` of mount(8) and fstab, as the command-line flags they stand for
// (so that CLI11 validates both spellings the same way).
Result<std::vector<std::string>> MountOptionFlags(const std::string& opts) {
  static const std::map<std::string, std::string> kValued = {{"uid", "--uid"},
                                                             {"gid", "--gid"},
                                                             {"index", "--index"},
                                                             {"log", "--log"},
                                                             {"engine", "--engine"},
                                                             {"gpu", "--gpu"},
                                                             {"threads", "--threads"},
                                                             {"rules", "--rules"},
                                                             {"pp_layers", "--pp-layers"},
                                                             {"pp-layers", "--pp-layers"},
                                                             {"hf_shard_size", "--hf-shard-size"},
                                                             {"hf-shard-size", "--hf-shard-size"},
                                                             {"hf_arch", "--hf-arch"},
                                                             {"hf-arch", "--hf-arch"},
                                                             {"hf_config", "--hf-config"},
                                                             {"hf-config", "--hf-config"},
                                                             {"hf_dtype", "--hf-dtype"},
                                                             {"hf-dtype", "--hf-dtype"},
                                                             {"hf_rope", "--hf-rope"},
                                                             {"hf-rope", "--hf-rope"},
                                                             {"mapped_reads", "--mapped-reads"},
                                                             {"mapped-reads", "--mapped-reads"},
                                                             {"read_ahead", "--read-ahead"},
                                                             {"read-ahead", "--read-ahead"},
                                                             {"max_metadata_bytes", "--max-metadata-bytes"},
                                                             {"max_item_bytes", "--max-item-bytes"},
                                                             {"family", "--family"}};
  static const std::map<std::string, std::string> kFlags = {{"allow_other", "--allow-other"},
                                                            {"verify_on_read", "--verify-on-read"},
                                                            {"nonempty", "--nonempty"},
                                                            {"strict", "--strict"},
                                                            {"debug", "--debug"}};
  // Options that mount(8), fstab or systemd pass and that mean nothing (or
  // what ckptfs always does: ro, default_permissions) here.
  static const std::vector<std::string> kIgnored = {"ro",
                                                    "defaults",
                                                    "auto",
                                                    "noauto",
                                                    "nofail",
                                                    "_netdev",
                                                    "user",
                                                    "users",
                                                    "nouser",
                                                    "owner",
                                                    "group",
                                                    "noexec",
                                                    "exec",
                                                    "nosuid",
                                                    "suid",
                                                    "nodev",
                                                    "dev",
                                                    "noatime",
                                                    "atime",
                                                    "relatime",
                                                    "norelatime",
                                                    "nodiratime",
                                                    "diratime",
                                                    "strictatime",
                                                    "lazytime",
                                                    "nolazytime",
                                                    "async",
                                                    "sync",
                                                    "silent",
                                                    "loud",
                                                    "default_permissions",
                                                    "fsname",
                                                    "subtype"};
  std::vector<std::string> out;
  for (const std::string& o : SplitMountOptions(opts)) {
    const size_t eq = o.find('=');
    const std::string key = o.substr(0, eq);
    if (eq != std::string::npos && kValued.count(key)) {
      out.push_back(kValued.at(key));
      out.push_back(o.substr(eq + 1));
    } else if (eq == std::string::npos && kFlags.count(key)) {
      out.push_back(kFlags.at(key));
    } else if (std::find(kIgnored.begin(), kIgnored.end(), key) != kIgnored.end() || key.rfind("x-", 0) == 0 ||
               key == "comment") {
      continue;
    } else if (key == "rw") {
      return Invalid("cannot mount read-write: ckptfs is a read-only filesystem (use ro)");
    } else {
      return Invalid("unknown mount option '" + o + "'");
    }
  }
  return out;
}

}  // namespace ckptfs::cli
