// mount(8)'s option strings for the ckptfs command line: `-o OPT,..` from
// mount(8), fstab and systemd, split and turned into the flags they stand
// for, so CLI11 validates both spellings the same way.
#ifndef CKPTFS_CLI_MOUNT_OPTIONS_H_
#define CKPTFS_CLI_MOUNT_OPTIONS_H_

#include <string>
#include <vector>

#include "ckptfs/common.h"

namespace ckptfs::cli {

// Splits a mount(8) option string at unescaped commas ("a,b\\,c" -> a, b,c).
std::vector<std::string> SplitMountOptions(const std::string& s);

// `-o OPT,..` as command-line flags ("index=/x" -> "--index", "/x"); options
// mount(8), fstab or systemd pass that mean nothing here are dropped; rw and
// unknown options are errors naming them.
Result<std::vector<std::string>> MountOptionFlags(const std::string& opts);

}  // namespace ckptfs::cli

#endif  // CKPTFS_CLI_MOUNT_OPTIONS_H_
