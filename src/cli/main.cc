// ckptfs command-line interface: mount | umount | index | info | ls | cat | verify.
// Exit codes: 0 success; 1 the checkpoint (or part of it) could not be read;
// 2 usage error. verify: 0 clean, 1 problems found, 2 could not read.
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckptfs/formats.h"
#include "ckptfs/fs.h"
#include "ckptfs/mount.h"
#include "ckptfs/verify.h"
#include "common/json_text.h"

namespace ckptfs {
namespace {

constexpr const char* kUsage = R"(ckptfs: mount training checkpoints as a lazily computed, read-only tree.

usage:
  ckptfs --version
  ckptfs mount SRC MNT [-f] [--index DIR] [--log FILE] [--engine auto|uring|pread]
                       [--gpu auto|on|off] [--threads N] [--allow-other] [--debug]
                       [--rules FILE] [--pp-layers N,N,..] [--hf-shard-size BYTES]
                       [--verify-on-read] [--nonempty]
      Index SRC (once; reused while SRC is unchanged) and mount the view at MNT.
      Without -f the daemon detaches once the mount is live; its log goes to
      --log FILE (default /tmp/ckptfs-<uid>/<mountpoint-name>.log).
      topo/tp<T>-pp<P>[-dp<D>]/ is made on first lookup; --rules FILE overrides
      TP split rules and stages (JSON, see README), --pp-layers sets layers per
      stage, --hf-shard-size the hf/ shard size (default 5000000000; K/M/G ok).
      --gpu: where merges, padding strips and widening casts run (same bytes
      either way). auto (default): on a CUDA GPU for plans a calibration
      measured faster there, else the CPU; on: every plan with such work on
      the GPU (an error without one); off: the CPU. mount, cat and verify
      take it.
      A mountpoint that is already a mount (or a dead one) is refused with the
      command that cleans it; --nonempty mounts over it anyway.
      --verify-on-read (mount, cat): check the CRC-32 a source records for
      each range (ZIP entry) before serving the first byte over it; a range
      that fails is EIO for its tensors (verify always checks them all).
      Bounds on untrusted metadata (every command; K/M/G ok):
      --max-metadata-bytes (a DCP .metadata, default 1G) and --max-item-bytes
      (a zstd-compressed DCP bytes item once decompressed, default 4G; a
      tensor item is bounded by its chunk's size).
  ckptfs umount MNT
  ckptfs index SRC [--index DIR] [--force]
      Build (or check) the index; prints what was found and how long it took.
  ckptfs info SRC [--index DIR] [--json]
      Family, step, ranks and a table of every tensor. Exit 1 if any tensor is
      unreadable (each reason is printed as "cannot <verb> <file>: <reason>").
  ckptfs ls SRC [PATH] [--index DIR] [--rules FILE] [--pp-layers N,N,..]
      List a directory of the view without mounting.
  ckptfs cat SRC KEY [--format npy|raw] [--index DIR] [--rules FILE] [--pp-layers ..]
      Write one file of the view to stdout: the same bytes as the mount, no FUSE.
      KEY is a view path (params/w/param.npy) or a checkpoint key / FQN.

  ckptfs verify SRC [--json] [--deep] [--num-layers N] [--threads N] [--index DIR]
      Integrity report: coverage holes and overlaps, name collisions (pipeline
      stages reusing layer names), optimizer chunks zeroed at step > 0, TP/PP
      replica drift, ZeRO padding/partition geometry; --deep adds NaN/Inf
      counts and norms per tensor (each byte read once). Human table, or JSON
      with --json (the same as a mount's .ckptfs/report.json). --num-layers
      gives the configured layer count (default: config.json / params.json
      next to SRC). Exit 0 clean, 1 problems found, 2 something unreadable.

The index lives in SRC/.ckptfs/index when SRC is writable, else in
$XDG_CACHE_HOME/ckptfs/<hash>; --index DIR puts it elsewhere.
)";

struct Args {
  std::vector<std::string> pos;
  std::map<std::string, std::string> opt;
  bool Has(const std::string& k) const { return opt.count(k) > 0; }
  std::string Get(const std::string& k, const std::string& d = "") const {
    auto it = opt.find(k);
    return it == opt.end() ? d : it->second;
  }
};

bool ParseArgs(int argc, char** argv, int start, Args* a, std::string* err) {
  static const std::map<std::string, bool> kTakesValue = {
      {"--index", true}, {"--log", true},     {"--engine", true}, {"--gpu", true},      {"--threads", true}, {"--format", true},
      {"-f", false},     {"--force", false},  {"--allow-other", false}, {"--debug", false}, {"--json", false},
      {"--help", false}, {"-h", false},       {"--foreground", false}, {"--deep", false},
      {"--num-layers", true}, {"--rules", true}, {"--pp-layers", true}, {"--hf-shard-size", true},
      {"--max-item-bytes", true}, {"--max-metadata-bytes", true}, {"--verify-on-read", false},
      {"--nonempty", false}, {"--version", false}, {"-q", false}, {"--quiet", false}};
  for (int i = start; i < argc; ++i) {
    std::string s = argv[i];
    if (s.size() > 1 && s[0] == '-') {
      std::string key = s, value;
      size_t eq = s.find('=');
      if (eq != std::string::npos) {
        key = s.substr(0, eq);
        value = s.substr(eq + 1);
      }
      auto it = kTakesValue.find(key);
      if (it == kTakesValue.end()) {
        *err = "unknown option " + key;
        return false;
      }
      if (it->second && eq == std::string::npos) {
        if (i + 1 >= argc) {
          *err = key + " needs a value";
          return false;
        }
        value = argv[++i];
      }
      a->opt[key] = value;
    } else {
      a->pos.push_back(s);
    }
  }
  return true;
}

int Fail(const Status& s) {
  std::cerr << "ckptfs: " << s.message() << "\n";
  return 1;
}

// "5000", "5K", "5M", "5G" (decimal units); nullopt for anything else or 0.
std::optional<uint64_t> ParseBytes(std::string v) {
  uint64_t mult = 1;
  if (!v.empty() && (v.back() == 'K' || v.back() == 'M' || v.back() == 'G')) {
    mult = v.back() == 'K' ? 1000 : v.back() == 'M' ? 1000'000 : 1000'000'000;
    v.pop_back();
  }
  if (v.empty() || v.size() > 15 || v.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  const uint64_t n = std::stoull(v) * mult;
  if (n == 0) return std::nullopt;
  return n;
}

Result<FsOptions> FsOpts(const Args& a, const std::string& src) {
  FsOptions o;
  std::error_code ec;
  o.src = std::filesystem::absolute(src, ec).lexically_normal().string();
  while (o.src.size() > 1 && o.src.back() == '/') o.src.pop_back();
  struct stat st{};
  if (::stat(o.src.c_str(), &st) != 0) return ErrnoStatus("open", o.src, errno);
  if (!S_ISDIR(st.st_mode)) return Invalid("cannot open " + o.src + ": not a directory");
  o.index_dir = a.Get("--index");
  if (!o.index_dir.empty()) o.index_dir = std::filesystem::absolute(o.index_dir, ec).string();
  o.force_rebuild = a.Has("--force");
  o.verify_on_read = a.Has("--verify-on-read");
  std::string e = a.Get("--engine", "auto");
  if (e == "auto") o.engine = EngineKind::kAuto;
  else if (e == "uring" || e == "io_uring") o.engine = EngineKind::kUring;
  else if (e == "pread") o.engine = EngineKind::kPread;
  else return Invalid("unknown --engine " + e + " (auto, uring, pread)");
  ASSIGN_OR_RETURN(o.gpu, ParseGpuMode(a.Get("--gpu", "auto")));
  if (a.Has("--rules")) {
    RETURN_IF_ERROR(ParseRulesFile(std::filesystem::absolute(a.Get("--rules"), ec).string(), o.topo));
  }
  if (a.Has("--pp-layers")) {
    ASSIGN_OR_RETURN(o.topo.pp_layers, ParsePpLayers(a.Get("--pp-layers")));
  }
  if (a.Has("--hf-shard-size")) {
    auto n = ParseBytes(a.Get("--hf-shard-size"));
    if (!n) return Invalid("--hf-shard-size '" + a.Get("--hf-shard-size") + "': expected bytes, e.g. 5G");
    o.topo.hf_shard_bytes = *n;
  }
  return o;
}

std::string HumanBytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

int CmdIndex(const Args& a) {
  if (a.pos.size() != 1) return std::cerr << "usage: ckptfs index SRC [--index DIR] [--force]\n", 2;
  auto o = FsOpts(a, a.pos[0]);
  if (!o.ok()) return Fail(o.status());
  auto r = OpenOrBuild(o->src, o->index_dir, o->force_rebuild);
  if (!r.ok()) return Fail(r.status());
  const Index& ix = *r->index;
  uint64_t broken = 0;
  for (const auto& t : ix.tensors()) broken += t.error.empty() ? 0 : 1;
  std::printf("%s %s: %zu tensors, %llu fragments, %zu files%s\n", r->built ? "built" : "reused", ix.dir().c_str(),
              ix.tensors().size(), static_cast<unsigned long long>(ix.num_fragments()), ix.files().size(),
              broken ? (", " + std::to_string(broken) + " unreadable").c_str() : "");
  if (r->built) {
    std::printf("build time %.3f s (%.0f fragments/s)\n", r->build_seconds,
                r->build_seconds > 0 ? static_cast<double>(ix.num_fragments()) / r->build_seconds : 0.0);
  }
  return broken ? 1 : 0;
}

int CmdInfo(const Args& a) {
  if (a.pos.size() != 1) return std::cerr << "usage: ckptfs info SRC [--index DIR] [--json]\n", 2;
  auto o = FsOpts(a, a.pos[0]);
  if (!o.ok()) return Fail(o.status());
  auto r = OpenOrBuild(o->src, o->index_dir, o->force_rebuild);
  if (!r.ok()) return Fail(r.status());
  const Index& ix = *r->index;
  const CheckpointInfo& info = ix.info();
  std::vector<const TensorRecord*> broken;
  uint64_t bytes = 0;
  for (const auto& t : ix.tensors()) {
    bytes += t.byte_size;
    if (!t.error.empty()) broken.push_back(&t);
  }
  if (a.Has("--json")) {
    nlohmann::ordered_json j;
    j["source"] = ix.src_dir();
    j["family"] = info.family;
    j["format"] = info.format_note;
    j["step"] = info.step;
    j["world_size"] = info.world_size;
    j["index"] = ix.dir();
    j["tensors"] = nlohmann::ordered_json::array();
    for (const auto& t : ix.tensors()) {
      nlohmann::ordered_json e = {{"key", t.key}, {"fqn", t.fqn}, {"state", t.state},
                                  {"dtype", std::string(DTypeName(t.dtype))}, {"shape", t.shape},
                                  {"bytes", t.byte_size}, {"fragments", t.num_fragments},
                                  {"kind", t.encoding == Encoding::kBytes ? "bytes" : "tensor"}};
      if (!t.error.empty()) e["error"] = t.error;
      j["tensors"].push_back(e);
    }
    std::cout << JsonText(j, 2) << "\n";
  } else {
    std::printf("checkpoint  %s\nfamily      %s (%s)\nstep        %s\nranks       %u\n", ix.src_dir().c_str(),
                info.family.c_str(), info.format_note.c_str(),
                info.step >= 0 ? std::to_string(info.step).c_str() : "unknown", info.world_size);
    std::printf("entries     %zu (%llu fragments), %s\nindex       %s%s\n\n", ix.tensors().size(),
                static_cast<unsigned long long>(ix.num_fragments()), HumanBytes(bytes).c_str(), ix.dir().c_str(),
                r->built ? " (built now)" : "");
    size_t w = 3;
    for (const auto& t : ix.tensors()) w = std::max(w, t.key.size());
    w = std::min<size_t>(w, 72);
    std::printf("%-*s  %-15s  %-9s  %-18s  %10s  %5s\n", static_cast<int>(w), "KEY", "ROLE", "DTYPE", "SHAPE",
                "BYTES", "FRAGS");
    for (const auto& t : ix.tensors()) {
      std::string role = t.role == Role::kHidden         ? "universal/"  // backs synthesized files only
                         : t.encoding == Encoding::kBytes ? "bytes"
                         : t.role == Role::kParam     ? "param"
                         : t.role == Role::kOptimState ? t.state
                                                        : "other";
      // A key longer than 200 bytes is cut (the whole name is in checkpoint.json).
      const std::string key = t.key.size() <= 200 ? t.key : t.key.substr(0, 180) + "... (" +
                                                             std::to_string(t.key.size()) + " bytes)";
      std::printf("%-*s  %-15s  %-9s  %-18s  %10s  %5u%s\n", static_cast<int>(w), key.c_str(), role.c_str(),
                  t.encoding == Encoding::kBytes ? "-" : std::string(DTypeName(t.dtype)).c_str(),
                  t.encoding == Encoding::kBytes ? "-" : ShapeStr(t.shape).c_str(), HumanBytes(t.byte_size).c_str(),
                  t.num_fragments, t.error.empty() ? "" : "  UNREADABLE");
    }
  }
  for (const TensorRecord* t : broken) std::cerr << "ckptfs: " << t->error << "\n";
  return broken.empty() ? 0 : 1;
}

Result<std::unique_ptr<Filesystem>> OpenFs(const Args& a, const std::string& src) {
  ASSIGN_OR_RETURN(FsOptions o, FsOpts(a, src));
  return Filesystem::Open(o);
}

int CmdLs(const Args& a) {
  if (a.pos.empty() || a.pos.size() > 2) return std::cerr << "usage: ckptfs ls SRC [PATH]\n", 2;
  auto fs = OpenFs(a, a.pos[0]);
  if (!fs.ok()) return Fail(fs.status());
  auto ino = (*fs)->view().Resolve(a.pos.size() == 2 ? a.pos[1] : "");
  if (!ino.ok()) return Fail(ino.status());
  auto entries = (*fs)->ReadDir(*ino);
  if (!entries.ok()) return Fail(entries.status());
  for (const auto& e : *entries) {
    if (e.name == "." || e.name == "..") continue;
    auto attr = (*fs)->GetAttr(e.ino);
    std::printf("%12llu  %s%s\n", attr.ok() ? static_cast<unsigned long long>(attr->size) : 0ull, e.name.c_str(),
                e.is_dir ? "/" : "");
  }
  return 0;
}

int CmdCat(const Args& a) {
  if (a.pos.size() != 2) return std::cerr << "usage: ckptfs cat SRC KEY [--format npy|raw]\n", 2;
  std::string fmt = a.Get("--format", "npy");
  if (fmt != "npy" && fmt != "raw") return std::cerr << "ckptfs: --format is npy or raw\n", 2;
  auto fs_or = OpenFs(a, a.pos[0]);
  if (!fs_or.ok()) return Fail(fs_or.status());
  Filesystem& fs = **fs_or;
  const std::string& key = a.pos[1];
  auto ino = fs.view().Resolve(key);
  if (!ino.ok() || fs.view().Get(*ino)->is_dir) {
    // A checkpoint key or FQN: find its file in the view.
    std::string path;
    for (const auto& t : fs.index().tensors()) {
      if (t.key != key && !(t.role == Role::kParam && t.fqn == key) &&
          !(t.role == Role::kOptimState && t.fqn + "." + t.state == key)) {
        continue;
      }
      if (t.encoding == Encoding::kBytes) path = "other/" + PathComponent(t.key);
      else if (t.role == Role::kOther) path = "other/" + PathComponent(t.key) + "." + fmt;
      else path = "params/" + PathComponent(t.fqn) + "/" + PathComponent(t.state) + "." + fmt;
      break;
    }
    if (path.empty()) return Fail(NotFound("cannot find " + key + " in " + fs.index().src_dir()));
    ino = fs.view().Resolve(path);
    if (!ino.ok()) return Fail(ino.status());
  }
  std::vector<char> buf(4 << 20);
  for (uint64_t off = 0;;) {
    auto n = fs.Read(*ino, off, buf.size(), buf.data());
    if (!n.ok()) return Fail(n.status());
    if (*n == 0) break;
    if (std::fwrite(buf.data(), 1, *n, stdout) != *n) return Fail(IoError("cannot write stdout"));
    off += *n;
  }
  return std::fflush(stdout) == 0 ? 0 : 1;
}

int CmdVerify(const Args& a) {
  if (a.pos.size() != 1) {
    return std::cerr << "usage: ckptfs verify SRC [--json] [--deep] [--num-layers N] [--threads N]\n", 2;
  }
  VerifyOptions vo;
  vo.deep = a.Has("--deep");
  if (a.Has("--num-layers")) {
    char* end = nullptr;
    const std::string v = a.Get("--num-layers");
    vo.expected_layers = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || vo.expected_layers < 0) return std::cerr << "ckptfs: --num-layers needs a count\n", 2;
  }
  if (a.Has("--threads")) vo.threads = static_cast<unsigned>(std::max(1, std::atoi(a.Get("--threads").c_str())));
  // Exit 2 (could not read) for everything that stops verify from running.
  auto fs = OpenFs(a, a.pos[0]);
  if (!fs.ok()) return Fail(fs.status()), 2;
  auto rep = (*fs)->Verify(vo);
  if (!rep.ok()) return Fail(rep.status()), 2;
  if (a.Has("--json")) {
    std::cout << ReportJson(*rep, (*fs)->index());
  } else {
    std::cout << ReportTable(*rep, (*fs)->index());
  }
  std::cout.flush();
  return rep->ExitCode();
}

int CmdUmount(const Args& a) {
  if (a.pos.size() != 1) return std::cerr << "usage: ckptfs umount MNT\n", 2;
  const std::string& mnt = a.pos[0];
  pid_t pid = ::fork();
  if (pid == 0) {
    ::execlp("fusermount3", "fusermount3", "-u", mnt.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int st = 0;
  if (pid > 0 && ::waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0) return 0;
  if (::umount2(mnt.c_str(), 0) == 0) return 0;
  return Fail(ErrnoStatus("unmount", mnt, errno));
}

// A mountpoint that is already a mount (live, or a dead FUSE mount whose
// daemon is gone: ENOTCONN) would be stacked over, and one umount would then
// remove only the top one. Refused, with the command that cleans it.
Status CheckMountpoint(const std::string& mnt) {
  struct stat st{}, parent{};
  if (::stat(mnt.c_str(), &st) != 0) {
    if (errno == ENOTCONN) {
      return Invalid("cannot mount on " + mnt + ": it is a dead FUSE mount (transport endpoint is not connected); "
                     "clean it with: fusermount3 -u " + mnt);
    }
    return ErrnoStatus("mount on", mnt, errno);
  }
  if (!S_ISDIR(st.st_mode)) return Invalid("cannot mount on " + mnt + ": not a directory");
  const std::string up = std::filesystem::path(mnt).parent_path().string();
  if (::stat(up.empty() ? "/" : up.c_str(), &parent) == 0 && (parent.st_dev != st.st_dev || parent.st_ino == st.st_ino)) {
    // A stat may be answered from the kernel's attribute cache; statfs asks
    // the filesystem, which a dead FUSE mount cannot answer.
    struct statvfs vfs{};
    if (::statvfs(mnt.c_str(), &vfs) != 0 && errno == ENOTCONN) {
      return Invalid("cannot mount on " + mnt + ": it is a dead FUSE mount (transport endpoint is not connected); "
                     "clean it with: fusermount3 -u " + mnt);
    }
    return Invalid("cannot mount on " + mnt + ": it is already a mount point (see findmnt " + mnt +
                   "); unmount it first (ckptfs umount " + mnt + "), or pass --nonempty to mount over it");
  }
  return Status::Ok();
}

int CmdMount(const Args& a) {
  if (a.pos.size() != 2) return std::cerr << "usage: ckptfs mount SRC MNT [-f] [--index DIR]\n", 2;
  auto o = FsOpts(a, a.pos[0]);
  if (!o.ok()) return Fail(o.status());
  std::error_code ec;
  std::string mnt = std::filesystem::absolute(a.pos[1], ec).lexically_normal().string();
  while (mnt.size() > 1 && mnt.back() == '/') mnt.pop_back();
  if (!a.Has("--nonempty")) {
    if (Status s = CheckMountpoint(mnt); !s.ok()) return Fail(s);
  }
  MountOptions mo;
  mo.allow_other = a.Has("--allow-other");
  mo.debug = a.Has("--debug");
  if (a.Has("--threads")) mo.max_threads = static_cast<unsigned>(std::max(1, std::atoi(a.Get("--threads").c_str())));
  const bool foreground = a.Has("-f") || a.Has("--foreground") || mo.debug;

  if (foreground) {
    auto fs = Filesystem::Open(*o);
    if (!fs.ok()) return Fail(fs.status());
    const OpenResult& r = (*fs)->open_result();
    LogInfo(std::string(r.built ? "built" : "reused") + " index " + (*fs)->index().dir() +
            (r.built ? " in " + std::to_string(r.build_seconds) + " s" : ""));
    return MountAndServe(**fs, mnt, mo, [&](const Status& s) {
      if (s.ok()) LogInfo("mounted " + o->src + " at " + mnt + " (engine " + (*fs)->engine_name() + ", transforms " + (*fs)->transforms_name() + ")");
      else LogError(s.message());
    });
  }

  // Daemon: fork first, so that nothing (RocksDB, io_uring) runs before the
  // fork; the parent waits for the child to report the mount live or failed.
  std::string log = a.Get("--log");
  if (log.empty()) {
    std::string dir = "/tmp/ckptfs-" + std::to_string(::getuid());
    ::mkdir(dir.c_str(), 0700);
    log = dir + "/" + std::filesystem::path(mnt).filename().string() + ".log";
  }
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) return Fail(ErrnoStatus("create", "pipe", errno));
  pid_t pid = ::fork();
  if (pid < 0) return Fail(ErrnoStatus("fork", "daemon", errno));
  if (pid > 0) {
    ::close(pipefd[1]);
    std::string msg;
    char buf[512];
    ssize_t n;
    while ((n = ::read(pipefd[0], buf, sizeof(buf))) > 0) msg.append(buf, static_cast<size_t>(n));
    if (msg == "ok") {
      std::printf("mounted %s at %s (log: %s)\n", o->src.c_str(), mnt.c_str(), log.c_str());
      return 0;
    }
    std::cerr << "ckptfs: " << (msg.empty() ? "the daemon exited before mounting; see " + log : msg) << "\n";
    return 1;
  }
  ::close(pipefd[0]);
  ::setsid();
  SetLogFile(log);
  auto report = [&](const std::string& m) {
    (void)!::write(pipefd[1], m.data(), m.size());
    ::close(pipefd[1]);
  };
  auto fs = Filesystem::Open(*o);
  if (!fs.ok()) {
    LogError(fs.status().message());
    report(fs.status().message());
    ::_exit(1);
  }
  int rc = MountAndServe(**fs, mnt, mo, [&](const Status& s) {
    if (!s.ok()) {
      LogError(s.message());
      report(s.message());
      return;
    }
    LogInfo("mounted " + o->src + " at " + mnt + " (engine " + (*fs)->engine_name() + ", transforms " + (*fs)->transforms_name() + ")");
    int null = ::open("/dev/null", O_RDWR);
    if (null >= 0) {
      ::dup2(null, 0);
      ::dup2(null, 1);
      ::dup2(null, 2);
      if (null > 2) ::close(null);
    }
    if (::chdir("/") != 0) LogWarn("cannot chdir to /");
    report("ok");
  });
  ::_exit(rc);
}

}  // namespace
}  // namespace ckptfs

int main(int argc, char** argv) {
  using namespace ckptfs;
  if (argc >= 2 && (std::string(argv[1]) == "--version" || std::string(argv[1]) == "version")) {
    std::printf("ckptfs %s (index schema v%u)\n", CKPTFS_VERSION, Index::kSchemaVersion);
    return 0;
  }
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h" || std::string(argv[1]) == "help") {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  std::string cmd = argv[1];
  Args a;
  std::string err;
  if (!ParseArgs(argc, argv, 2, &a, &err)) {
    std::cerr << "ckptfs " << cmd << ": " << err << "\n" << kUsage;
    return 2;
  }
  if (a.Has("--help") || a.Has("-h")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  SetProgressQuiet(a.Has("-q") || a.Has("--quiet"));
  {
    ReadLimits limits;
    for (auto [flag, field] : {std::pair{"--max-item-bytes", &limits.max_item_bytes},
                               std::pair{"--max-metadata-bytes", &limits.max_metadata_bytes}}) {
      if (!a.Has(flag)) continue;
      auto n = ParseBytes(a.Get(flag));
      if (!n) {
        std::cerr << "ckptfs " << cmd << ": " << flag << " '" << a.Get(flag) << "': expected bytes, e.g. 8G\n";
        return 2;
      }
      *field = *n;
    }
    SetReadLimits(limits);
  }
  if (cmd == "mount") return CmdMount(a);
  if (cmd == "umount" || cmd == "unmount") return CmdUmount(a);
  if (cmd == "index") return CmdIndex(a);
  if (cmd == "info") return CmdInfo(a);
  if (cmd == "ls") return CmdLs(a);
  if (cmd == "cat") return CmdCat(a);
  if (cmd == "verify") return CmdVerify(a);
  std::cerr << "ckptfs: unknown command '" << cmd << "'\n" << kUsage;
  return 2;
}
