#include "dir_harness.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "ckptfs/fs.h"
#include "dir_archive.h"

namespace ckptfs::fuzz {
namespace {

namespace fs = std::filesystem;

const std::string& WorkDir() {
  static const std::string dir = [] {
    const char* t = std::getenv("TMPDIR");
    std::string base = t != nullptr ? t : (fs::exists("/dev/shm") ? "/dev/shm" : "/tmp");
    return base + "/ckptfs-fuzz-" + std::to_string(::getpid());
  }();
  return dir;
}

// Reads every byte of the file (in 1 MiB pieces), ignoring errors: the point
// is that nothing crashes, hangs or leaks, not what a broken tensor says.
void ReadAll(Filesystem& f, uint64_t ino, uint64_t size) {
  static std::vector<char> buf(1 << 20);
  if (!f.OpenFile(ino).ok()) return;
  for (uint64_t off = 0; off < size && off < (uint64_t{64} << 20); off += buf.size()) {
    if (!f.Read(ino, off, buf.size(), buf.data()).ok()) return;
  }
}

void Walk(Filesystem& f, uint64_t ino, int depth, bool everything) {
  auto entries = f.ReadDir(ino);
  if (!entries.ok() || depth > 8) return;
  for (const DirEntry& e : *entries) {
    if (e.name == "." || e.name == "..") continue;
    if (!everything && depth == 0 && e.name != "params" && e.name != "checkpoint.json" && e.name != "other") continue;
    auto a = f.Lookup(ino, e.name);
    if (!a.ok()) continue;
    if (e.is_dir) {
      Walk(f, e.ino, depth + 1, everything);
    } else {
      ReadAll(f, e.ino, a->size);
    }
  }
}

}  // namespace

void RunDirectory(const uint8_t* data, size_t size, Depth depth) {
  // Damaged inputs log one line per failed read: to /dev/null, or the
  // fuzzer spends its time (and the disk) on them.
  static const bool quiet = (SetLogFile("/dev/null"), true);
  (void)quiet;
  const std::string root = WorkDir(), ck = root + "/ck", ix = root + "/ix";
  std::error_code ec;
  fs::remove_all(root, ec);
  fs::create_directories(ck, ec);
  UnpackArchive(data, size, ck);
  FsOptions o;
  o.src = ck;
  o.index_dir = ix;
  o.engine = EngineKind::kPread;
  o.gpu = GpuMode::kOff;
  auto f = Filesystem::Open(o);
  if (f.ok()) {
    const bool views = depth == Depth::kViews;
    if (views) {
      for (const char* t : {"tp2-pp1", "tp1-pp2", "tp2-pp2-dp2"}) {
        if (auto topo = (*f)->Lookup(1, "topo"); topo.ok()) (void)(*f)->Lookup(topo->ino, t);
      }
    }
    Walk(**f, 1, 0, views);
  }
  fs::remove_all(root, ec);
}

}  // namespace ckptfs::fuzz
