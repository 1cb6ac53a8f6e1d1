// ckptfs command-line interface: mount | umount | index | info | ls | cat |
// verify | help, parsed by CLI11 (per-command help, validated values, one-line
// errors). The same binary is mount(8)'s helper when called as mount.ckptfs or
// mount.fuse.ckptfs: `mount -t fuse.ckptfs SRC MNT -o OPTS` and fstab lines.
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ckptfs/formats.h"
#include "ckptfs/fs.h"
#include "ckptfs/mount.h"
#include "ckptfs/progress.h"
#include "ckptfs/verify.h"
#include "cli/mount_options.h"
#include "common/json_text.h"

namespace ckptfs {
namespace {

// Exit codes, the same for every command (also in docs/cli.md and --help).
constexpr int kExitOk = 0;          // success; verify: clean
constexpr int kExitUnreadable = 1;  // the checkpoint, or part of it, cannot be read (or is not one)
constexpr int kExitUsage = 2;       // bad command line
// kExitProblems = 3: verify read the checkpoint and its checks found problems
// (Report::ExitCode()).

constexpr const char* kExitCodes =
    "exit codes (every command): 0 success (verify: clean); 1 the checkpoint, or part of it,\n"
    "cannot be read, or SRC is not a checkpoint (each problem printed as\n"
    "\"cannot <verb> <file>: <reason>\"); 2 bad command line; 3 verify: the checks found problems.";

constexpr const char* kMountFooter = R"(
Index SRC (once; reused while SRC is unchanged) and mount the view at MNT, read-only.
Without -f the daemon detaches once the mount is live; its log goes to --log FILE
(default /tmp/ckptfs-<uid>/<mountpoint path, escaped>.log; each line names the mount).
mount prints one line saying how many tensors cannot be read; --strict refuses to
mount then. A mountpoint that is already a mount (or a dead one) is refused with
the command that cleans it; --nonempty mounts over it anyway.

-o OPT[,OPT..] takes the options of mount(8) / fstab (also through mount.ckptfs and
`mount -t fuse.ckptfs SRC MNT -o ...`): allow_other, uid=N, gid=N, index=DIR, log=FILE,
engine=, gpu=, family=, threads=N, rules=FILE, pp_layers=, hf_shard_size=, hf_arch=, hf_config=,
hf_dtype=, mapped_reads=, read_ahead=, verify_on_read,
nonempty, strict, debug; ro, defaults, noauto, auto, nofail, _netdev, users, noatime,
nosuid, nodev, noexec, x-* and comment= are accepted and have nothing to do here;
rw is refused. The mount shows SRC as its source (findmnt, df) with type fuse.ckptfs.

topo/tp<T>-pp<P>[-dp<D>][-ep<E>]/ is made on first lookup; --rules FILE overrides TP
split rules and stages (JSON, see docs/views.md), --pp-layers sets layers per stage,
--hf-shard-size the hf/ shard size (default 5000000000; K/M/G ok).
hf/ is a transformers model directory (config.json, safetensors with Hugging Face names)
when the architecture is known: Megatron Llama/Mistral/Qwen2/Qwen3/Mixtral/GPT-NeoX/GPT-2
from its args, or a config.json beside the checkpoint (MaxText: --hf-config). --hf-arch NAME (llama, mistral,
qwen2, qwen3, mixtral, qwen3_moe, gpt_neox, gpt2, gemma2) picks one the args allow; --hf-config FILE supplies config.json; --hf-dtype
model (default), source, fp32 (widened), bf16/fp16 (float32 rounded to nearest even),
master (the fp32 master weights). --hf-rope interleaved|halves says how the source pairs
RoPE dimensions where the checkpoint does not record it (MaxText with a Llama 3.x config:
llama3.1-* interleaved, llama3.3 halves). hf/ERRORS says what is left out or missing, and why.
--gpu: where merges, padding strips and dtype casts run (same bytes either way).
auto (default): on a CUDA GPU for plans a calibration measured faster there, else
the CPU; on: every plan with such work on the GPU (an error without one); off: the CPU.
--verify-on-read: check the CRC-32 a source records for each range (ZIP entry)
before serving the first byte over it; a range that fails is EIO for its tensors.
--mapped-reads: on (default): a read that is a plain copy of source bytes (same
dtype, uncompressed: merged shards, ZeRO partitions) is answered from read-only
mappings of the sources, one copy per byte; off: every read is copied through
the read engine.
--read-ahead: on: a reader that opens files one after another in a walk's order
(cp -r, diff -r, rsync, tar) has the sources of its next two files (at most 64 MiB)
read ahead, once it has opened three in a row; off (default): only what is read.
)";

constexpr const char* kIndexFooter = R"(
The index lives in SRC/.ckptfs/index when SRC is writable, else in
$XDG_CACHE_HOME/ckptfs/<hash>; --index DIR puts it elsewhere. Every command that
reads SRC takes --max-metadata-bytes (a DCP .metadata, default 1G) and
--max-item-bytes (a zstd-compressed DCP bytes item once decompressed, default 4G);
K/M/G ok. --family NAME reads SRC as that family where two could claim it (a
Megatron torch_dist directory is also a DCP one): its probe must still recognise
SRC, and an index of another family is rebuilt. Without it the families are
tried in a fixed order (docs/architecture.md) and a fresh index is reused.
)";

constexpr const char* kVerifyFooter = R"(
Checks: coverage holes and overlaps, name collisions (pipeline stages reusing layer
names), optimizer chunks zeroed at step > 0, TP/PP replica drift, ZeRO padding and
partition geometry, fp32 masters against the weights; --deep adds NaN/Inf counts and
norms per tensor (each byte read once). Human table, or JSON with --json (the same as
a mount's .ckptfs/report.json). --num-layers gives the configured layer count
(default: config.json / params.json next to SRC).
Exit 0 clean, 1 something could not be read, 3 problems found.
)";

// What CLI11 parsed, as the command functions read it: positionals in order,
// and each option given under its long name ("" for a flag).
struct Args {
  std::vector<std::string> pos;
  std::map<std::string, std::string> opt;
  bool Has(const std::string& k) const { return opt.count(k) > 0; }
  std::string Get(const std::string& k, const std::string& d = "") const {
    auto it = opt.find(k);
    return it == opt.end() ? d : it->second;
  }
};

int Fail(const Status& s) {
  std::cerr << "ckptfs: " << s.message() << "\n";
  return kExitUnreadable;
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
  struct stat st {};
  if (::stat(o.src.c_str(), &st) != 0) return ErrnoStatus("open", o.src, errno);
  if (!S_ISDIR(st.st_mode)) return Invalid("cannot open " + o.src + ": not a directory");
  o.index_dir = a.Get("--index");
  if (!o.index_dir.empty()) o.index_dir = std::filesystem::absolute(o.index_dir, ec).string();
  o.force_rebuild = a.Has("--force");
  if (a.Has("--family")) {
    auto f = FamilyFromName(a.Get("--family"));
    if (!f) return Invalid("--family '" + a.Get("--family") + "': expected one of " + FamilyNameList());
    o.family = *f;
  }
  o.verify_on_read = a.Has("--verify-on-read");
  o.mapped_reads = a.Get("--mapped-reads", "on") == "on";
  o.read_ahead = a.Get("--read-ahead", "off") == "on";
  ASSIGN_OR_RETURN(o.engine, ParseEngineKind(a.Get("--engine", "auto")));
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
  o.topo.hf_arch = a.Get("--hf-arch", "");
  o.topo.hf_dtype = a.Get("--hf-dtype", "");
  o.topo.hf_rope = a.Get("--hf-rope", "");
  if (a.Has("--hf-config")) {
    o.topo.hf_config = std::filesystem::absolute(a.Get("--hf-config"), ec).string();
    ASSIGN_OR_RETURN(int fd, OpenRegularFile(o.topo.hf_config));  // a missing file is a command-line error now
    ::close(fd);
  }
  return o;
}

int CmdIndex(const Args& a) {
  auto o = FsOpts(a, a.pos[0]);
  if (!o.ok()) return Fail(o.status());
  auto r = OpenOrBuild(o->src, o->index_dir, o->force_rebuild, o->family);
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
  if (a.Has("--plan-views")) {
    // As a mount's first listing of dcp/ (a DCP profile, hf/) would: every
    // later mount of this index then lists them from the saved plans.
    const auto t0 = std::chrono::steady_clock::now();
    auto fs = Filesystem::Open(*o);
    if (!fs.ok()) return Fail(fs.status());
    const std::vector<std::string> saved = (*fs)->view().PlanSavedViews();
    std::printf("planned the saved views in %.3f s:",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    for (const std::string& p : saved) std::printf(" %s", p.c_str());
    std::printf("%s\n", saved.empty() ? " none saved (see the log lines above)" : "");
  }
  return broken ? kExitUnreadable : kExitOk;
}

// Up to ten reasons are printed as they are; more, each distinct reason once,
// in the order first met, with how many tensors it
// affects: a missing or truncated shard makes hundreds of tensors unreadable
// with the same message but for the tensor's name, offset and size, which are
// left out to compare.
void PrintUnreadable(const std::vector<const TensorRecord*>& broken) {
  constexpr size_t kEachUpTo = 10;  // a few are printed whole, offsets and all
  if (broken.size() <= kEachUpTo) {
    for (const TensorRecord* t : broken) std::cerr << "ckptfs: " << t->error << "\n";
    return;
  }
  struct Group {
    const TensorRecord* first;
    uint64_t count;
  };
  std::vector<std::pair<std::string, Group>> groups;
  std::map<std::string, size_t> at;
  for (const TensorRecord* t : broken) {
    std::string shape = t->error;
    for (const std::string& name : {t->key, t->fqn}) {
      if (name.empty()) continue;
      for (size_t p = shape.find(name); p != std::string::npos; p = shape.find(name, p + 3)) {
        shape.replace(p, name.size(), "...");
      }
    }
    // Offsets and sizes differ per tensor; numbers inside names do not count.
    std::string key;
    for (size_t i = 0; i < shape.size(); ++i) {
      const bool starts_number = std::isdigit(static_cast<unsigned char>(shape[i])) &&
                                 (i == 0 || shape[i - 1] == ' ' || shape[i - 1] == '(' || shape[i - 1] == '=');
      if (!starts_number) {
        key += shape[i];
        continue;
      }
      while (i + 1 < shape.size() && std::isdigit(static_cast<unsigned char>(shape[i + 1]))) ++i;
      key += '#';
    }
    auto [it, fresh] = at.emplace(key, groups.size());
    if (fresh) groups.push_back({key, Group{t, 0}});
    groups[it->second].second.count++;
  }
  std::cerr << "ckptfs: " << broken.size() << " tensor(s) cannot be read (" << groups.size()
            << " distinct reason(s)):\n";
  for (const auto& [shape, g] : groups) {
    std::cerr << "ckptfs: " << g.first->error;
    if (g.count > 1) std::cerr << " (and " << g.count - 1 << " more tensor(s) for the same reason)";
    std::cerr << "\n";
  }
}

int CmdInfo(const Args& a) {
  auto o = FsOpts(a, a.pos[0]);
  if (!o.ok()) return Fail(o.status());
  auto r = OpenOrBuild(o->src, o->index_dir, o->force_rebuild, o->family);
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
    j["family"] = FamilyName(info.family);
    j["format"] = info.format_note;
    j["step"] = info.step;
    j["world_size"] = info.world_size;
    j["index"] = ix.dir();
    j["notes"] = info.problems;
    j["tensors"] = nlohmann::ordered_json::array();
    for (const auto& t : ix.tensors()) {
      nlohmann::ordered_json e = {{"key", t.key},
                                  {"fqn", t.fqn},
                                  {"state", t.state},
                                  {"dtype", std::string(DTypeName(t.dtype))},
                                  {"shape", t.shape},
                                  {"bytes", t.byte_size},
                                  {"fragments", t.num_fragments},
                                  {"kind", t.encoding == Encoding::kBytes ? "bytes" : "tensor"}};
      if (t.VocabPadded()) e["vocab_rows"] = t.vocab_rows;  // the stored rows past it are TP padding
      if (!t.error.empty()) e["error"] = t.error;
      j["tensors"].push_back(e);
    }
    std::cout << JsonText(j, 2) << "\n";
  } else {
    std::printf("checkpoint  %s\nfamily      %s (%s)\nstep        %s\nranks       %u\n", ix.src_dir().c_str(),
                std::string(FamilyName(info.family)).c_str(), info.format_note.c_str(),
                info.step >= 0 ? std::to_string(info.step).c_str() : "unknown", info.world_size);
    std::printf("entries     %zu (%llu fragments), %s\nindex       %s%s\n\n", ix.tensors().size(),
                static_cast<unsigned long long>(ix.num_fragments()), HumanBytes(bytes).c_str(), ix.dir().c_str(),
                r->built ? " (built now)" : "");
    // What the reader could not do or chose to do (checkpoint.json "problems"),
    // the first few; each on one line.
    constexpr size_t kShownNotes = 8;
    for (size_t i = 0; i < info.problems.size() && i < kShownNotes; ++i) {
      std::string line = info.problems[i];
      for (char& c : line) {
        if (c == '\n') c = ' ';
      }
      if (line.size() > 300) line = line.substr(0, 280) + "... (checkpoint.json has it whole)";
      std::printf("%s%s\n", i == 0 ? "notes       " : "            ", line.c_str());
    }
    if (info.problems.size() > kShownNotes) {
      std::printf("            and %zu more notes in checkpoint.json\n", info.problems.size() - kShownNotes);
    }
    if (!info.problems.empty()) std::printf("\n");
    size_t w = 3;
    for (const auto& t : ix.tensors()) w = std::max(w, t.key.size());
    w = std::min<size_t>(w, 72);
    std::printf("%-*s  %-15s  %-9s  %-18s  %10s  %5s\n", static_cast<int>(w), "KEY", "ROLE", "DTYPE", "SHAPE", "BYTES",
                "FRAGS");
    for (const auto& t : ix.tensors()) {
      std::string role = t.role == Role::kHidden          ? "universal/"  // backs synthesized files only
                         : t.encoding == Encoding::kBytes ? "bytes"
                         : t.role == Role::kParam         ? "param"
                         : t.role == Role::kOptimState    ? t.state
                                                          : "other";
      // A key longer than 200 bytes is cut (the whole name is in checkpoint.json).
      const std::string key =
          t.key.size() <= 200 ? t.key : t.key.substr(0, 180) + "... (" + std::to_string(t.key.size()) + " bytes)";
      std::printf("%-*s  %-15s  %-9s  %-18s  %10s  %5u%s\n", static_cast<int>(w), key.c_str(), role.c_str(),
                  t.encoding == Encoding::kBytes ? "-" : std::string(DTypeName(t.dtype)).c_str(),
                  t.encoding == Encoding::kBytes ? "-" : ShapeStr(t.shape).c_str(), HumanBytes(t.byte_size).c_str(),
                  t.num_fragments, t.error.empty() ? "" : "  UNREADABLE");
    }
  }
  PrintUnreadable(broken);
  return broken.empty() ? kExitOk : kExitUnreadable;
}

Result<std::unique_ptr<Filesystem>> OpenFs(const Args& a, const std::string& src) {
  ASSIGN_OR_RETURN(FsOptions o, FsOpts(a, src));
  return Filesystem::Open(o);
}

int CmdLs(const Args& a) {
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
  const std::string fmt = a.Get("--format", "npy");
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
      if (t.encoding == Encoding::kBytes)
        path = "other/" + PathComponent(t.key);
      else if (t.role == Role::kOther)
        path = "other/" + PathComponent(t.key) + "." + fmt;
      else
        path = "params/" + PathComponent(t.fqn) + "/" + PathComponent(t.state) + "." + fmt;
      break;
    }
    if (path.empty()) return Fail(NotFound("cannot find " + key + " in " + fs.index().src_dir()));
    ino = fs.view().Resolve(path);
    if (!ino.ok()) return Fail(ino.status());
  }
  std::vector<char> buf(4 << 20);
  auto attr = fs.GetAttr(*ino);
  // On a terminal (stderr), a large file shows bytes, rate and ETA.
  std::string shown = fs.view().PathOf(*ino);
  if (!shown.empty() && shown.front() == '/') shown.erase(0, 1);
  Progress progress("cat " + shown, attr.ok() ? attr->size : 0);
  for (uint64_t off = 0;;) {
    auto n = fs.Read(*ino, off, buf.size(), buf.data());
    if (!n.ok()) return Fail(n.status());
    if (*n == 0) break;
    if (std::fwrite(buf.data(), 1, *n, stdout) != *n) return Fail(IoError("cannot write stdout"));
    off += *n;
    progress.Add(*n);
  }
  return std::fflush(stdout) == 0 ? 0 : 1;
}

int CmdVerify(const Args& a) {
  VerifyOptions vo;
  vo.deep = a.Has("--deep");
  if (a.Has("--num-layers")) vo.expected_layers = std::stoll(a.Get("--num-layers"));  // validated by CLI11
  if (a.Has("--threads")) vo.threads = static_cast<unsigned>(std::stoul(a.Get("--threads")));
  auto fs = OpenFs(a, a.pos[0]);
  if (!fs.ok()) return Fail(fs.status());
  auto rep = (*fs)->Verify(vo);
  if (!rep.ok()) return Fail(rep.status());
  if (a.Has("--json")) {
    std::cout << ReportJson(*rep, (*fs)->index());
  } else {
    std::cout << ReportTable(*rep, (*fs)->index());
  }
  std::cout.flush();
  return rep->ExitCode();
}

int CmdUmount(const Args& a) {
  const std::string& mnt = a.pos[0];
  const bool lazy = a.Has("--lazy");
  pid_t pid = ::fork();
  if (pid == 0) {
    ::execlp("fusermount3", "fusermount3", lazy ? "-uz" : "-u", mnt.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int st = 0;
  if (pid > 0 && ::waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0) return kExitOk;
  if (::umount2(mnt.c_str(), lazy ? MNT_DETACH : 0) == 0) return kExitOk;
  const int err = errno;
  return Fail(Status(Code::kIo, "cannot unmount " + mnt + ": " + std::strerror(err) +
                                    (err == EBUSY ? " (a process still uses it; `ckptfs umount --lazy " + mnt +
                                                        "` detaches it now and finishes when it is free)"
                                                  : "")));
}

// A mountpoint that is already a mount (live, or a dead FUSE mount whose
// daemon is gone: ENOTCONN) would be stacked over, and one umount would then
// remove only the top one. Refused, with the command that cleans it.
Status CheckMountpoint(const std::string& mnt) {
  struct stat st {
  }, parent{};
  if (::stat(mnt.c_str(), &st) != 0) {
    if (errno == ENOTCONN) {
      return Invalid("cannot mount on " + mnt +
                     ": it is a dead FUSE mount (transport endpoint is not connected); "
                     "clean it with: fusermount3 -u " +
                     mnt);
    }
    return ErrnoStatus("mount on", mnt, errno);
  }
  if (!S_ISDIR(st.st_mode)) return Invalid("cannot mount on " + mnt + ": not a directory");
  const std::string up = std::filesystem::path(mnt).parent_path().string();
  if (::stat(up.empty() ? "/" : up.c_str(), &parent) == 0 &&
      (parent.st_dev != st.st_dev || parent.st_ino == st.st_ino)) {
    // A stat may be answered from the kernel's attribute cache; statfs asks
    // the filesystem, which a dead FUSE mount cannot answer.
    struct statvfs vfs {};
    if (::statvfs(mnt.c_str(), &vfs) != 0 && errno == ENOTCONN) {
      return Invalid("cannot mount on " + mnt +
                     ": it is a dead FUSE mount (transport endpoint is not connected); "
                     "clean it with: fusermount3 -u " +
                     mnt);
    }
    return Invalid("cannot mount on " + mnt + ": it is already a mount point (see findmnt " + mnt +
                   "); unmount it first (ckptfs umount " + mnt + "), or pass --nonempty to mount over it");
  }
  return Status::Ok();
}

// The default log of a mount: one file per mountpoint, named after its full
// path ("/mnt/ck" -> "mnt-ck.log"; '-', '%' and bytes outside [A-Za-z0-9._]
// as %XX, so two paths never share a name).
std::string DefaultLogPath(const std::string& mnt) {
  std::string dir = "/tmp/ckptfs-" + std::to_string(::getuid()), name;
  ::mkdir(dir.c_str(), 0700);
  for (size_t i = mnt.front() == '/' ? 1 : 0; i < mnt.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(mnt[i]);
    if (c == '/') {
      name += '-';
    } else if (std::isalnum(c) || c == '.' || c == '_') {
      name += static_cast<char>(c);
    } else {
      char hex[4];
      std::snprintf(hex, sizeof(hex), "%%%02X", c);
      name += hex;
    }
  }
  if (name.empty()) name = "root";
  if (name.size() > 200) name = name.substr(0, 180) + "~" + Hex64(std::hash<std::string>{}(mnt)).substr(0, 16);
  return dir + "/" + name + ".log";
}

// One line for a mount that serves a checkpoint with unreadable tensors
// (empty when all can be read).
std::string UnreadableSummary(const Index& ix) {
  uint64_t broken = 0;
  const TensorRecord* first = nullptr;
  for (const auto& t : ix.tensors()) {
    if (t.error.empty()) continue;
    if (first == nullptr) first = &t;
    ++broken;
  }
  if (broken == 0) return "";
  return std::to_string(broken) + " of " + std::to_string(ix.tensors().size()) +
         " tensors cannot be read and answer EIO (first: " + first->error + "); `ckptfs info " + ix.src_dir() +
         "` lists why";
}

int CmdMount(const Args& a) {
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
  mo.fsname = o->src;
  if (a.Has("--threads")) mo.max_threads = static_cast<unsigned>(std::stoul(a.Get("--threads")));
  if (a.Has("--uid")) mo.uid = std::stoll(a.Get("--uid"));
  if (a.Has("--gid")) mo.gid = std::stoll(a.Get("--gid"));
  const bool foreground = a.Has("-f") || mo.debug;
  const bool strict = a.Has("--strict");
  SetLogTag(mnt);

  if (foreground) {
    if (a.Has("--log")) SetLogFile(a.Get("--log"));
    auto fs = Filesystem::Open(*o);
    if (!fs.ok()) return Fail(fs.status());
    const OpenResult& r = (*fs)->open_result();
    LogInfo(std::string(r.built ? "built" : "reused") + " index " + (*fs)->index().dir() +
            (r.built ? " in " + std::to_string(r.build_seconds) + " s" : ""));
    if (std::string bad = UnreadableSummary((*fs)->index()); !bad.empty()) {
      if (strict) return Fail(Invalid("not mounting " + o->src + " (--strict): " + bad));
      LogWarn(bad);
    }
    return MountAndServe(**fs, mnt, mo, [&](const Status& s) {
      if (s.ok())
        LogInfo("mounted " + o->src + " at " + mnt + " (engine " + (*fs)->engine_name() + ", transforms " +
                (*fs)->transforms_name() + ")");
      else
        LogError(s.message());
    });
  }

  // Daemon: fork first, so that nothing (RocksDB, io_uring) runs before the
  // fork; the parent waits for the child to report the mount live ("ok" and
  // the unreadable summary) or failed (the reason).
  const std::string log = a.Has("--log") ? a.Get("--log") : DefaultLogPath(mnt);
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
    if (msg.rfind("ok\n", 0) == 0) {
      std::printf("mounted %s at %s (log: %s)\n", o->src.c_str(), mnt.c_str(), log.c_str());
      if (msg.size() > 3) std::fprintf(stderr, "ckptfs: warning: %s\n", msg.c_str() + 3);
      return kExitOk;
    }
    std::cerr << "ckptfs: " << (msg.empty() ? "the daemon exited before mounting; see " + log : msg) << "\n";
    return kExitUnreadable;
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
    ::_exit(kExitUnreadable);
  }
  const std::string bad = UnreadableSummary((*fs)->index());
  if (!bad.empty()) {
    if (strict) {
      const std::string why = "not mounting " + o->src + " (--strict): " + bad;
      LogError(why);
      report(why);
      ::_exit(kExitUnreadable);
    }
    LogWarn(bad);
  }
  int rc = MountAndServe(**fs, mnt, mo, [&](const Status& s) {
    if (!s.ok()) {
      LogError(s.message());
      report(s.message());
      return;
    }
    LogInfo("mounted " + o->src + " at " + mnt + " (engine " + (*fs)->engine_name() + ", transforms " +
            (*fs)->transforms_name() + ")");
    int null = ::open("/dev/null", O_RDWR);
    if (null >= 0) {
      ::dup2(null, 0);
      ::dup2(null, 1);
      ::dup2(null, 2);
      if (null > 2) ::close(null);
    }
    if (::chdir("/") != 0) LogWarn("cannot chdir to /");
    report("ok\n" + bad);
  });
  ::_exit(rc);
}

// Replaces every `-o OPTS` / `-oOPTS` after the `mount` command (the first
// command word, so a SRC named "mount" of another command is left alone) by
// the flags they stand for.
Result<std::vector<std::string>> ExpandMountOptions(const std::vector<std::string>& args) {
  static const std::vector<std::string> kCommands = {"mount", "umount", "unmount", "index", "info",
                                                     "ls",    "cat",    "verify",  "help"};
  std::vector<std::string> out;
  std::string command;  // the first word that names one
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (command != "mount") {
      if (command.empty() && std::find(kCommands.begin(), kCommands.end(), a) != kCommands.end()) command = a;
      out.push_back(a);
      continue;
    }
    if (a == "-o" || (a.rfind("-o", 0) == 0 && a.size() > 2 && a[2] != '-')) {
      std::string opts = a.size() > 2 ? a.substr(2) : "";
      if (a == "-o") {
        if (i + 1 >= args.size()) return Invalid("-o needs a value (e.g. -o allow_other,index=DIR)");
        opts = args[++i];
      }
      ASSIGN_OR_RETURN(auto flags, cli::MountOptionFlags(opts));
      out.insert(out.end(), flags.begin(), flags.end());
    } else {
      out.push_back(a);
    }
  }
  return out;
}

// mount.ckptfs SRC MNT [-sfnv] [-o OPTS] [-t TYPE] (how mount(8) calls a
// helper) as `ckptfs mount SRC MNT [-o OPTS]`; empty for -f, which mount(8)
// means as "fake: do everything but the mount".
Result<std::vector<std::string>> MountHelperArgs(const std::vector<std::string>& args) {
  std::vector<std::string> pos, out = {"mount"};
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-o" || a == "-t") {
      if (i + 1 >= args.size()) return Invalid(a + " needs a value");
      if (a == "-o") {
        // mount(8) adds "rw" whenever "ro" is not given; the mount is
        // read-only either way, so only an explicit `ckptfs mount -o rw` is
        // refused.
        std::string kept;
        for (const std::string& o : cli::SplitMountOptions(args[i + 1])) {
          if (o == "rw") continue;
          if (!kept.empty()) kept += ',';
          for (char c : o) {
            if (c == ',' || c == '\\') kept += '\\';
            kept += c;
          }
        }
        if (!kept.empty()) out.insert(out.end(), {"-o", kept});
      }
      ++i;
    } else if (a.size() > 1 && a[0] == '-' && a.find_first_not_of("sfnvwr", 1) == std::string::npos) {
      if (a.find('f') != std::string::npos) return std::vector<std::string>{};
      if (a.find('w') != std::string::npos) return Invalid("cannot mount read-write: ckptfs is a read-only filesystem");
    } else if (a.size() > 1 && a[0] == '-') {
      return Invalid("unknown option " + a + " (usage: mount.ckptfs SRC MNT [-o OPTIONS])");
    } else {
      pos.push_back(a);
    }
  }
  if (pos.size() != 2) return Invalid("usage: mount.ckptfs SRC MNT [-o OPTIONS]");
  out.insert(out.begin() + 1, pos.begin(), pos.end());
  return out;
}

// A subcommand name (ckptfs CMD ...), as Main's CLI11 app defines them.
bool IsCommand(const std::string& a) {
  for (const char* c : {"mount", "umount", "unmount", "index", "info", "ls", "cat", "verify", "help"}) {
    if (a == c) return true;
  }
  return false;
}

int Main(std::vector<std::string> raw) {
  CLI::App app{"ckptfs: mount training checkpoints as a lazily computed, read-only tree.", "ckptfs"};
  app.set_version_flag("--version", std::string("ckptfs ") + CKPTFS_VERSION + " (index schema v" +
                                        std::to_string(Index::SchemaVersion()) + ")");
  app.set_help_all_flag("--help-all", "every command's help (the man page is made from it)");
  app.fallthrough();  // global options may follow the command
  app.footer(std::string("\nRun `ckptfs help CMD` or `ckptfs CMD --help` for a command's options.\n") + kExitCodes);
  std::map<std::string, std::string> str;  // option name -> value, filled by CLI11
  std::vector<std::string> pos;
  bool quiet = false;
  app.add_flag("-q,--quiet", quiet, "no progress output (it is shown only on a terminal anyway)");
  const auto bytes_check = CLI::Validator(
      [](std::string& v) { return ParseBytes(v) ? std::string() : "expected bytes, e.g. 8G (K/M/G ok)"; }, "BYTES");
  for (const char* flag : {"--max-metadata-bytes", "--max-item-bytes"}) {
    app.add_option(flag, str[flag], "bound on untrusted metadata (see `ckptfs help index`)")
        ->check(bytes_check)
        ->option_text("BYTES");
  }

  std::string cmd_src, cmd_mnt, cmd_path, cmd_key;
  auto add_src = [&](CLI::App* c) { c->add_option("SRC", cmd_src, "checkpoint directory")->required(); };
  auto add_index = [&](CLI::App* c) {
    c->add_option("--index", str["--index"], "index directory (default: SRC/.ckptfs/index or the user cache)")
        ->option_text("DIR");
    std::vector<std::string> families;
    for (const FamilyTraits& f : AllFamilies()) families.push_back(std::string(f.name));
    c->add_option("--family", str["--family"], "read SRC as this family (default: detect; see below)")
        ->check(CLI::IsMember(families))
        ->option_text("NAME");
  };
  auto add_view = [&](CLI::App* c) {
    c->add_option("--rules", str["--rules"], "TP split rules and stages for topo/ (JSON)")->option_text("FILE");
    c->add_option("--pp-layers", str["--pp-layers"], "layers per pipeline stage for topo/")->option_text("N,N,..");
    c->add_option("--hf-shard-size", str["--hf-shard-size"], "hf/ shard size (default 5000000000)")
        ->check(bytes_check)
        ->option_text("BYTES");
    c->add_option("--hf-arch", str["--hf-arch"], "hf/ target architecture when the checkpoint records too little")
        ->check(CLI::IsMember(HfArchNames()))
        ->option_text("NAME");
    c->add_option("--hf-config", str["--hf-config"], "hf/ config.json to use (its model_type picks the mapping)")
        ->option_text("FILE");
    c->add_option("--hf-dtype", str["--hf-dtype"], "hf/ dtype (default model: the parameters' dtype)")
        ->check(CLI::IsMember(HfDtypeNames()))
        ->option_text("DTYPE");
    c->add_option("--hf-rope", str["--hf-rope"],
                  "how the source pairs RoPE dimensions, when it does not record it (default auto)")
        ->check(CLI::IsMember(HfRopeNames()))
        ->option_text("PAIRS");
  };
  auto add_read = [&](CLI::App* c) {
    c->add_option("--engine", str["--engine"], "read engine (default auto)")
        ->check(CLI::IsMember({"auto", "uring", "io_uring", "pread"}));
    c->add_option("--gpu", str["--gpu"], "where element transforms run (default auto)")
        ->check(CLI::IsMember({"auto", "on", "off"}));
  };
  std::map<std::string, bool> flag;
  auto add_flag = [&](CLI::App* c, const std::string& names, const std::string& key, const std::string& help) {
    c->add_flag(names, flag[key], help);
  };
  const auto threads_check = CLI::Range(1, 1024);
  const auto kIdCheck = CLI::Range(int64_t{0}, int64_t{4294967294});  // (uid_t)-1 means "unchanged"

  CLI::App* mount = app.add_subcommand("mount", "mount SRC at MNT");
  add_src(mount);
  mount->add_option("MNT", cmd_mnt, "mountpoint (an empty directory)")->required();
  add_flag(mount, "-f,--foreground", "-f", "stay in the foreground, logging to stderr (or --log)");
  mount->add_option("-o", str["-o"], "mount(8) options, see below")->option_text("OPT[,OPT..]");
  add_index(mount);
  mount->add_option("--log", str["--log"], "log file of the daemon")->option_text("FILE");
  add_read(mount);
  mount->add_option("--threads", str["--threads"], "FUSE worker threads (default 16)")
      ->check(threads_check)
      ->option_text("N");
  add_flag(mount, "--allow-other", "--allow-other", "let other users (and root) see the mount");
  mount->add_option("--uid", str["--uid"], "owner shown for every file (default: the mounting user)")
      ->check(kIdCheck)
      ->option_text("N");
  mount->add_option("--gid", str["--gid"], "group shown for every file")->check(kIdCheck)->option_text("N");
  add_flag(mount, "--debug", "--debug", "trace every FUSE request (implies -f)");
  add_view(mount);
  add_flag(mount, "--verify-on-read", "--verify-on-read", "check source CRCs before serving");
  mount->add_option("--mapped-reads", str["--mapped-reads"], "answer plain copies from mapped sources (default on)")
      ->check(CLI::IsMember({"on", "off"}));
  mount
      ->add_option("--read-ahead", str["--read-ahead"],
                   "read the next files' sources ahead of a reader walking the tree (default off)")
      ->check(CLI::IsMember({"on", "off"}));
  add_flag(mount, "--nonempty", "--nonempty", "mount even over an existing mount");
  add_flag(mount, "--strict", "--strict", "refuse to mount when any tensor cannot be read");
  mount->footer(std::string(kMountFooter) + kIndexFooter);

  CLI::App* umount = app.add_subcommand("umount", "unmount MNT")->alias("unmount");
  umount->add_option("MNT", cmd_mnt, "mountpoint")->required();
  add_flag(umount, "-z,--lazy", "--lazy", "detach now, finish when the mount is no longer busy");

  CLI::App* index = app.add_subcommand("index", "build (or check) the index; prints counts and build time");
  add_src(index);
  add_index(index);
  add_flag(index, "--force", "--force", "rebuild even when the index is current");
  add_flag(index, "--plan-views", "--plan-views",
           "also plan dcp/, a family's DCP profile (torch_dist/) and hf/ (default --hf-* options) and save "
           "their plans beside the index, so every mount lists them at once");
  index->footer(kIndexFooter);

  CLI::App* info = app.add_subcommand("info", "family, step, ranks and a table of every tensor");
  add_src(info);
  add_index(info);
  add_flag(info, "--json", "--json", "machine-readable output");
  info->footer(std::string("\nExit 1 if any tensor cannot be read; each distinct reason is printed once as\n"
                           "\"cannot <verb> <file>: <reason>\" with how many tensors it affects.\n") +
               kIndexFooter);

  CLI::App* ls = app.add_subcommand("ls", "list a directory of the view without mounting");
  add_src(ls);
  ls->add_option("PATH", cmd_path, "directory in the view (default: the root)");
  add_index(ls);
  add_read(ls);  // the reader is opened (sizes, --gpu=on without a device is an error)
  add_view(ls);

  CLI::App* cat = app.add_subcommand("cat", "write one file of the view to stdout (same bytes as the mount)");
  add_src(cat);
  cat->add_option("KEY", cmd_key, "a view path (params/w/param.npy), a checkpoint key or an FQN")->required();
  cat->add_option("--format", str["--format"], "for keys and FQNs: npy (default) or raw")
      ->check(CLI::IsMember({"npy", "raw"}));
  add_index(cat);
  add_read(cat);
  add_view(cat);
  add_flag(cat, "--verify-on-read", "--verify-on-read", "check source CRCs before serving");

  CLI::App* verify = app.add_subcommand("verify", "integrity report");
  add_src(verify);
  add_flag(verify, "--json", "--json", "the report as JSON");
  add_flag(verify, "--deep", "--deep", "also NaN/Inf counts and norms (reads every byte once)");
  verify->add_option("--num-layers", str["--num-layers"], "the configured layer count")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20))
      ->option_text("N");
  verify->add_option("--threads", str["--threads"], "reader threads")->check(threads_check)->option_text("N");
  add_index(verify);
  add_read(verify);
  verify->footer(std::string(kVerifyFooter) + kIndexFooter);

  CLI::App* help = app.add_subcommand("help", "help for a command");
  help->add_option("CMD", cmd_key, "command");
  app.require_subcommand(0, 1);

  auto expanded = ExpandMountOptions(raw);
  if (!expanded.ok()) {
    std::cerr << "ckptfs mount: " << expanded.status().message() << " (see `ckptfs mount --help`)\n";
    return kExitUsage;
  }
  std::vector<std::string> rev(expanded->rbegin(), expanded->rend());
  try {
    app.parse(rev);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    if (app.get_subcommands().empty() && !raw.empty() && !raw[0].empty() && raw[0][0] != '-') {
      std::cerr << "ckptfs: unknown command '" << raw[0] << "' (see `ckptfs --help`)\n";
      return kExitUsage;
    }
    std::string where = "ckptfs", pointer = "ckptfs --help";
    for (CLI::App* c : app.get_subcommands()) {
      where += " " + c->get_name();
      pointer = "ckptfs " + c->get_name() + " --help";
    }
    std::cerr << where << ": " << e.what() << " (see `" << pointer << "`)\n";
    return kExitUsage;
  }
  if (app.get_subcommands().empty()) {
    std::cerr << app.help();
    return kExitUsage;
  }
  CLI::App* cmd = app.get_subcommands().front();
  if (cmd == help) {
    if (cmd_key.empty()) {
      std::cout << app.help();
      return kExitOk;
    }
    CLI::App* target = nullptr;
    try {
      target = app.get_subcommand(cmd_key);
    } catch (const CLI::OptionNotFound&) {
    }
    if (target == nullptr || target == help) {
      std::cerr << "ckptfs help: no command '" << cmd_key << "' (see `ckptfs --help`)\n";
      return kExitUsage;
    }
    std::cout << target->help("ckptfs");
    return kExitOk;
  }
  SetProgressQuiet(quiet);
  Args a;
  for (auto& [key, value] : str) {
    if (!value.empty()) a.opt[key] = value;
  }
  for (auto& [key, on] : flag) {
    if (on) a.opt[key] = "";
  }
  for (const std::string* p : {&cmd_src, &cmd_mnt}) {
    if (!p->empty()) a.pos.push_back(*p);
  }
  if (cmd == ls && !cmd_path.empty()) a.pos.push_back(cmd_path);
  if (cmd == cat) a.pos.push_back(cmd_key);
  ReadLimits limits;
  if (a.Has("--max-item-bytes")) limits.max_item_bytes = *ParseBytes(a.Get("--max-item-bytes"));
  if (a.Has("--max-metadata-bytes")) limits.max_metadata_bytes = *ParseBytes(a.Get("--max-metadata-bytes"));
  SetReadLimits(limits);
  if (cmd == mount) return CmdMount(a);
  if (cmd == umount) return CmdUmount(a);
  if (cmd == index) return CmdIndex(a);
  if (cmd == info) return CmdInfo(a);
  if (cmd == ls) return CmdLs(a);
  if (cmd == cat) return CmdCat(a);
  return CmdVerify(a);
}
}  // namespace
}  // namespace ckptfs

int main(int argc, char** argv) {
  const std::string self = std::filesystem::path(argc > 0 ? argv[0] : "ckptfs").filename().string();
  std::vector<std::string> args(argv + std::min(argc, 1), argv + argc);
  if (self == "mount.ckptfs" || self == "mount.fuse.ckptfs") {
    // mount(8) helper: mount.ckptfs SRC MNT [-sfnv] [-o OPTS] [-t TYPE].
    auto translated = ckptfs::MountHelperArgs(args);
    if (!translated.ok()) {
      std::cerr << self << ": " << translated.status().message() << "\n";
      return ckptfs::kExitUsage;
    }
    if (translated->empty()) return ckptfs::kExitOk;  // -f: mount(8)'s "fake"
    args = std::move(translated).value();
  } else if (args.size() >= 2 && !ckptfs::IsCommand(args[0]) && args[0][0] != '-' &&
             std::filesystem::is_directory(args[0]) && std::filesystem::is_directory(args[1])) {
    // /sbin/mount.fuse3 for a fuse.ckptfs entry with no mount.fuse.ckptfs
    // installed (a binary copied onto a node, a Python wheel) runs
    // `ckptfs SRC MNT -o OPTS`: the helper's form.
    auto translated = ckptfs::MountHelperArgs(args);
    if (!translated.ok()) {
      std::cerr << "ckptfs: " << translated.status().message() << "\n";
      return ckptfs::kExitUsage;
    }
    if (translated->empty()) return ckptfs::kExitOk;
    args = std::move(translated).value();
  }
  return ckptfs::Main(args);
}
