// ckptfs_null_fuse: the ceilings of a FUSE daemon on this kernel (issue 18).
//
// Reads, for bench/read_bench.py: a flat read-only tree of N regular files of
// given sizes whose read handler does no work at all: it answers every
// request with fuse_reply_buf over a static, preallocated buffer. Whatever
// GB/s a reader gets from it is what the kernel <-> /dev/fuse round trip
// allows; ckptfs's reads are measured as a fraction of it.
//
// Listings, for bench/scale_bench.py: --tree FILE serves a tree of that shape
// (lines "d<TAB>path<TAB>bytes" and "f<TAB>path<TAB>bytes", parents before
// children, children in listing order) from attributes computed before
// mounting, so an `ls -lR` of it costs the kernel's and the round trips' share
// only.
//
// Every connection and session setting is the one src/fuse/fuse_adapter.cc
// uses, so the kernel treats both daemons alike (keep this list in sync):
//   mount options   "ro,default_permissions,fsname=<name>,subtype=ckptfs"
//                   (no allow_other, no max_read= option)
//   init            max_write = max_readahead = 1 MiB (libfuse derives
//                   max_pages 256 from max_write); FUSE_CAP_SPLICE_WRITE
//                   wanted when capable; FUSE_CAP_ASYNC_READ wanted when capable;
//                   every other capability left at libfuse's defaults
//   bdi readahead   read_ahead_kb raised to 1024 once the mount answers
//                   (RaiseReadahead; --no-raise-readahead skips it)
//   loop            fuse_session_loop_mt, max_threads 16 (--threads), idle 4,
//                   clone_fd off (libfuse default)
//   entries         entry/attr timeouts 86400 s, negative entries cached,
//                   st_blksize 1 MiB, st_blocks 0
//   open            keep_cache = 1, direct_io = 0
//   listings        READDIRPLUS wanted, READDIRPLUS_AUTO not; OPENDIR answered
//                   ENOSYS when NO_OPENDIR_SUPPORT is capable (the kernel opens
//                   and caches directories itself), else keep_cache and
//                   cache_readdir; offsets 0 ".", 1 "..", child i at i + 2;
//                   directories' st_blksize 4096
//   read            reply through fuse_reply_buf (writev; the splice path is
//                   not used for it, as in ckptfs)
//
//   ckptfs_null_fuse MOUNTPOINT [--threads N] [--file NAME:BYTES]...
//                    [--files N --size BYTES] [--tree FILE] [--stats FILE] [--no-raise-readahead]
//                    [--source PATH --mode pread|splice|map] [--mirror DIR [--delay-us N]]
//
// --mirror DIR serves DIR's tree read-only with its real bytes, each read
// request answered --delay-us microseconds late (pread after a sleep; up to
// --threads requests at once): storage whose every read waits on the network
// (NFS, a parallel filesystem), for bench/read_bench.py's cross-file
// read-ahead case (a checkpoint mounted by ckptfs from this mount).
//
// --source serves the bytes of a real file instead (offsets wrap at its size),
// to price what a copy costs on this kernel: `pread` reads them into a per-thread
// buffer and replies with fuse_reply_buf (one copy more than the static buffer,
// as ckptfs's direct path), `splice` replies with fuse_reply_data over an
// fd-backed fuse_bufvec, which libfuse splices from the source's page cache
// into /dev/fuse (SPLICE_WRITE is negotiated, as in ckptfs), and `map` replies
// with fuse_reply_iov over a read-only mapping of the source (the kernel's
// writev copies from the source's page cache: ckptfs's mapped replies).
//
// Serves until unmounted (fusermount3 -u / umount) or signalled, in the
// foreground. With --stats, writes a JSON summary of the read requests (count,
// bytes, size histogram) on exit: the request sizes the kernel sent.
#define FUSE_USE_VERSION 312
#include <dirent.h>
#include <fcntl.h>
#include <fuse3/fuse_lowlevel.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

constexpr double kTimeout = 86400.0;        // fuse_adapter.cc kTimeout
constexpr unsigned kMaxRequest = 1u << 20;  // fuse_adapter.cc kMaxRequest

// Inode i + 1 is g_nodes[i]; inode 1 is the root.
struct Node {
  std::string name;
  fuse_ino_t parent = FUSE_ROOT_ID;
  bool dir = false;
  uint64_t size = 0;
  uint32_t subdirs = 0;
  std::vector<fuse_ino_t> children;  // in listing order
  int fd = -1;                       // --mirror: the real file
};

std::vector<Node> g_nodes(1, Node{"", FUSE_ROOT_ID, true, 0, 0, {}, -1});
unsigned g_delay_us = 0;                                 // --mirror: added before each read request is answered
std::unordered_map<std::string, fuse_ino_t> g_by_path;   // "" is the root
std::unordered_map<std::string, fuse_ino_t> g_by_entry;  // "<parent ino>/<name>"
std::atomic<bool> g_no_opendir{false};
int g_src_fd = -1;
uint64_t g_src_size = 0;
bool g_splice = false;
bool g_map = false;
const char* g_src_map = nullptr;
// The bytes every read returns (a repeating pattern, never touched by a read).
alignas(4096) char g_data[kMaxRequest];

// Request sizes: bucket b counts reads of size in (2^(b-1), 2^b].
std::atomic<uint64_t> g_reads{0}, g_bytes{0};
std::atomic<uint64_t> g_hist[32];

const Node* NodeOf(fuse_ino_t ino) { return ino >= 1 && ino <= g_nodes.size() ? &g_nodes[ino - 1] : nullptr; }

const Node* FileOf(fuse_ino_t ino) {
  const Node* n = NodeOf(ino);
  return n != nullptr && !n->dir ? n : nullptr;
}

// Adds a node under the directory `parent`; false when parent is a file.
bool AddNode(fuse_ino_t parent, std::string name, bool dir, uint64_t size) {
  Node& p = g_nodes[parent - 1];
  if (!p.dir) return false;
  const fuse_ino_t ino = g_nodes.size() + 1;
  p.children.push_back(ino);
  if (dir) ++p.subdirs;
  g_by_entry.emplace(std::to_string(parent) + "/" + name, ino);
  g_nodes.push_back(Node{std::move(name), parent, dir, size, 0, {}, -1});
  return true;
}

// --mirror DIR: DIR's files and directories (names sorted), each file read
// from the real one.
bool Mirror(const std::string& dir, fuse_ino_t parent) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return false;
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.emplace_back(e->d_name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const std::string path = dir + "/" + name;
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return false;
    if (S_ISDIR(st.st_mode)) {
      if (!AddNode(parent, name, true, 0) || !Mirror(path, g_nodes.size())) return false;
    } else if (S_ISREG(st.st_mode)) {
      if (!AddNode(parent, name, false, static_cast<uint64_t>(st.st_size))) return false;
      g_nodes.back().fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (g_nodes.back().fd < 0) return false;
    }
  }
  return true;
}

// --tree FILE: "d\tpath\tbytes" / "f\tpath\tbytes", a parent before its children.
bool LoadTree(const char* path) {
  FILE* f = std::fopen(path, "re");
  if (f == nullptr) return false;
  g_by_path.emplace("", FUSE_ROOT_ID);
  char* line = nullptr;
  size_t cap = 0;
  bool ok = true;
  for (ssize_t len; ok && (len = ::getline(&line, &cap, f)) > 0;) {
    std::string l(line, static_cast<size_t>(len));
    if (l.back() == '\n') l.pop_back();
    // The size follows the last tab, so a name may hold tabs (not newlines).
    const size_t t1 = l.find('\t');
    const size_t t2 = l.rfind('\t');
    if (l.size() < 3 || (l[0] != 'd' && l[0] != 'f') || t1 != 1 || t2 <= t1) {
      ok = false;
      break;
    }
    const bool dir = l[0] == 'd';
    const std::string rel = l.substr(2, t2 - 2);
    const uint64_t size = std::strtoull(l.c_str() + t2 + 1, nullptr, 10);
    const size_t slash = rel.rfind('/');
    auto parent = g_by_path.find(slash == std::string::npos ? std::string() : rel.substr(0, slash));
    ok = parent != g_by_path.end() &&
         AddNode(parent->second, slash == std::string::npos ? rel : rel.substr(slash + 1), dir, size);
    if (ok && dir) g_by_path.emplace(rel, g_nodes.size());
  }
  std::free(line);
  std::fclose(f);
  g_by_path.clear();
  return ok;
}

void FillStat(fuse_ino_t ino, struct stat* st) {
  std::memset(st, 0, sizeof(*st));
  st->st_ino = ino;
  const Node& n = *NodeOf(ino);
  st->st_mode = n.dir ? (S_IFDIR | 0555) : (S_IFREG | 0444);
  st->st_nlink = n.dir ? 2 + n.subdirs : 1;
  st->st_size = static_cast<off_t>(n.size);
  st->st_blksize = n.dir ? 4096 : 1 << 20;
  st->st_blocks = 0;
  st->st_uid = ::getuid();
  st->st_gid = ::getgid();
}

void OnInit(void*, fuse_conn_info* conn) {
  conn->max_write = kMaxRequest;
  conn->max_readahead = kMaxRequest;
  if (conn->capable & FUSE_CAP_SPLICE_WRITE) conn->want |= FUSE_CAP_SPLICE_WRITE;
  if (conn->capable & FUSE_CAP_READDIRPLUS) conn->want |= FUSE_CAP_READDIRPLUS;
  conn->want &= ~FUSE_CAP_READDIRPLUS_AUTO;
  g_no_opendir.store((conn->capable & FUSE_CAP_NO_OPENDIR_SUPPORT) != 0);
  if (conn->capable & FUSE_CAP_AUTO_INVAL_DATA) conn->want |= FUSE_CAP_AUTO_INVAL_DATA;
  conn->want &= ~FUSE_CAP_ASYNC_READ;
  conn->want |= conn->capable & FUSE_CAP_ASYNC_READ;
}

void OnLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  fuse_entry_param e{};
  e.entry_timeout = kTimeout;
  e.attr_timeout = kTimeout;
  auto it = g_by_entry.find(std::to_string(parent) + "/" + name);
  if (it != g_by_entry.end()) {
    e.ino = it->second;
    FillStat(e.ino, &e.attr);
    fuse_reply_entry(req, &e);
    return;
  }
  e.ino = 0;  // negative entry, cached for entry_timeout
  fuse_reply_entry(req, &e);
}

void OnGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  if (NodeOf(ino) == nullptr) {
    fuse_reply_err(req, ENOENT);
    return;
  }
  struct stat st;
  FillStat(ino, &st);
  fuse_reply_attr(req, &st, kTimeout);
}

void OnOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (g_no_opendir.load()) {
    fuse_reply_err(req, ENOSYS);
    return;
  }
  const Node* n = NodeOf(ino);
  if (n == nullptr || !n->dir) {
    fuse_reply_err(req, ENOTDIR);
    return;
  }
  fi->cache_readdir = 1;
  fi->keep_cache = 1;
  fuse_reply_open(req, fi);
}

// One page of a listing: "." at offset 0, ".." at 1, child i at i + 2, each
// entry's `off` the offset of the next; `plus` adds its attributes.
void ReplyListing(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, bool plus) {
  const Node* n = NodeOf(ino);
  if (n == nullptr || !n->dir) {
    fuse_reply_err(req, ENOTDIR);
    return;
  }
  thread_local std::vector<char> buf;
  if (buf.size() < size) buf.resize(size);
  size_t used = 0;
  for (size_t pos = static_cast<size_t>(off); pos < n->children.size() + 2; ++pos) {
    const fuse_ino_t child = pos == 0 ? ino : pos == 1 ? n->parent : n->children[pos - 2];
    const char* name = pos == 0 ? "." : pos == 1 ? ".." : g_nodes[child - 1].name.c_str();
    fuse_entry_param e{};
    e.attr.st_ino = child;
    e.attr.st_mode = NodeOf(child)->dir ? S_IFDIR : S_IFREG;
    size_t len;
    if (plus) {
      if (pos >= 2) {  // "." and ".." carry no entry (no lookup count), as in ckptfs
        e.ino = child;
        e.entry_timeout = kTimeout;
        e.attr_timeout = kTimeout;
        FillStat(child, &e.attr);
      }
      len = fuse_add_direntry_plus(req, buf.data() + used, size - used, name, &e, static_cast<off_t>(pos + 1));
    } else {
      len = fuse_add_direntry(req, buf.data() + used, size - used, name, &e.attr, static_cast<off_t>(pos + 1));
    }
    if (len > size - used) break;
    used += len;
  }
  fuse_reply_buf(req, buf.data(), used);
}

void OnReaddir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info*) {
  ReplyListing(req, ino, size, off, false);
}

void OnReaddirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info*) {
  ReplyListing(req, ino, size, off, true);
}

void OnOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (FileOf(ino) == nullptr) {
    fuse_reply_err(req, EISDIR);
    return;
  }
  if ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC)) {
    fuse_reply_err(req, EROFS);
    return;
  }
  fi->keep_cache = 1;
  fi->direct_io = 0;
  fuse_reply_open(req, fi);
}

void OnRead(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info*) {
  const Node* f = FileOf(ino);
  if (f == nullptr) {
    fuse_reply_err(req, EISDIR);
    return;
  }
  const uint64_t o = static_cast<uint64_t>(off);
  size_t n = o >= f->size ? 0 : static_cast<size_t>(std::min<uint64_t>(size, f->size - o));
  if (n > sizeof(g_data)) n = sizeof(g_data);  // never: the kernel asks for <= max_pages
  g_reads.fetch_add(1, std::memory_order_relaxed);
  g_bytes.fetch_add(n, std::memory_order_relaxed);
  unsigned b = 0;
  while (b < 31 && (size_t{1} << b) < size) ++b;
  g_hist[b].fetch_add(1, std::memory_order_relaxed);
  if (f->fd >= 0) {  // --mirror: a storage round trip of g_delay_us, then the real bytes
    if (g_delay_us > 0) ::usleep(g_delay_us);
    thread_local std::vector<char> buf;
    if (buf.size() < n) buf.resize(n);
    const ssize_t got = ::pread(f->fd, buf.data(), n, off);
    if (got < 0) {
      fuse_reply_err(req, errno);
      return;
    }
    fuse_reply_buf(req, buf.data(), static_cast<size_t>(got));
    return;
  }
  if (g_src_fd < 0) {
    fuse_reply_buf(req, g_data, n);
    return;
  }
  const uint64_t so = o % g_src_size;
  n = static_cast<size_t>(std::min<uint64_t>(n, g_src_size - so));  // wraps in the next request
  if (g_splice) {
    fuse_bufvec bv = FUSE_BUFVEC_INIT(n);
    bv.buf[0].flags = static_cast<fuse_buf_flags>(FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK);
    bv.buf[0].fd = g_src_fd;
    bv.buf[0].pos = static_cast<off_t>(so);
    fuse_reply_data(req, &bv, FUSE_BUF_SPLICE_MOVE);
    return;
  }
  if (g_map) {
    iovec iov{const_cast<char*>(g_src_map + so), n};
    fuse_reply_iov(req, &iov, 1);
    return;
  }
  thread_local std::vector<char> buf;
  if (buf.size() < n) buf.resize(n);
  ssize_t got = ::pread(g_src_fd, buf.data(), n, static_cast<off_t>(so));
  if (got < 0) {
    fuse_reply_err(req, errno);
    return;
  }
  fuse_reply_buf(req, buf.data(), static_cast<size_t>(got));
}

void OnStatfs(fuse_req_t req, fuse_ino_t) {
  struct statvfs sv {};
  sv.f_bsize = 1 << 20;
  sv.f_frsize = 4096;
  sv.f_files = g_nodes.size();
  sv.f_namemax = 255;
  sv.f_flag = ST_RDONLY;
  fuse_reply_statfs(req, &sv);
}

// Same as fuse_adapter.cc RaiseReadahead: FUSE can only lower the kernel's
// 128 KiB default readahead at INIT, so raise the bdi's once the mount answers.
void RaiseReadahead(const std::string& mountpoint) {
  struct stat st {};
  if (::stat(mountpoint.c_str(), &st) != 0) return;
  char path[96];
  std::snprintf(path, sizeof(path), "/sys/class/bdi/%u:%u/read_ahead_kb", major(st.st_dev), minor(st.st_dev));
  FILE* f = std::fopen(path, "we");
  if (f == nullptr || std::fprintf(f, "%u\n", kMaxRequest / 1024) < 0 || std::fclose(f) != 0) {
    std::fprintf(stderr, "null_fuse: cannot raise readahead via %s: %s\n", path, std::strerror(errno));
    return;
  }
  std::fprintf(stderr, "null_fuse: readahead set to 1 MiB via %s\n", path);
}

void WriteStats(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "we");
  if (f == nullptr) return;
  std::fprintf(f, "{\"reads\": %llu, \"bytes\": %llu, \"size_hist\": {",
               static_cast<unsigned long long>(g_reads.load()), static_cast<unsigned long long>(g_bytes.load()));
  bool first = true;
  for (unsigned b = 0; b < 32; ++b) {
    uint64_t c = g_hist[b].load();
    if (c == 0) continue;
    std::fprintf(f, "%s\"%llu\": %llu", first ? "" : ", ", 1ull << b, static_cast<unsigned long long>(c));
    first = false;
  }
  std::fprintf(f, "}}\n");
  std::fclose(f);
}

uint64_t ParseBytes(const char* s) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  switch (end != nullptr ? *end : '\0') {
    case 'K':
    case 'k':
      v *= 1024.0;
      break;
    case 'M':
    case 'm':
      v *= 1024.0 * 1024.0;
      break;
    case 'G':
    case 'g':
      v *= 1024.0 * 1024.0 * 1024.0;
      break;
    default:
      break;
  }
  return static_cast<uint64_t>(v);
}

int Usage() {
  std::fprintf(stderr,
               "usage: ckptfs_null_fuse MOUNTPOINT [--threads N] [--file NAME:BYTES]... "
               "[--files N --size BYTES] [--tree FILE] [--stats FILE] [--no-raise-readahead] [-d]\n"
               "       [--source PATH --mode pread|splice|map] [--mirror DIR [--delay-us N]]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Usage();
  std::string mountpoint = argv[1];
  unsigned threads = 16;  // MountOptions::max_threads default
  uint64_t n_files = 0, size = 0;
  std::string stats;
  bool raise = true, debug = false;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    const char* v = nullptr;
    if (a == "--threads" && (v = next())) {
      threads = static_cast<unsigned>(std::strtoul(v, nullptr, 10));
    } else if (a == "--file" && (v = next())) {
      const char* colon = std::strrchr(v, ':');
      if (colon == nullptr || colon == v) return Usage();
      AddNode(FUSE_ROOT_ID, std::string(v, colon), false, ParseBytes(colon + 1));
    } else if (a == "--files" && (v = next())) {
      n_files = std::strtoull(v, nullptr, 10);
    } else if (a == "--size" && (v = next())) {
      size = ParseBytes(v);
    } else if (a == "--tree" && (v = next())) {
      if (!LoadTree(v)) {
        std::fprintf(stderr, "null_fuse: cannot read the tree %s (lines d|f<TAB>path<TAB>bytes)\n", v);
        return 1;
      }
    } else if (a == "--mirror" && (v = next())) {
      if (!Mirror(v, FUSE_ROOT_ID)) {
        std::fprintf(stderr, "null_fuse: cannot mirror %s: %s\n", v, std::strerror(errno));
        return 1;
      }
    } else if (a == "--delay-us" && (v = next())) {
      g_delay_us = static_cast<unsigned>(std::strtoul(v, nullptr, 10));
    } else if (a == "--stats" && (v = next())) {
      stats = v;
    } else if (a == "--source" && (v = next())) {
      g_src_fd = ::open(v, O_RDONLY | O_CLOEXEC);
      struct stat st {};
      if (g_src_fd < 0 || ::fstat(g_src_fd, &st) != 0 || st.st_size == 0) {
        std::fprintf(stderr, "null_fuse: cannot open %s: %s\n", v, std::strerror(errno));
        return 1;
      }
      g_src_size = static_cast<uint64_t>(st.st_size);
    } else if (a == "--mode" && (v = next())) {
      g_splice = std::string(v) == "splice";
      g_map = std::string(v) == "map";
    } else if (a == "--no-raise-readahead") {
      raise = false;
    } else if (a == "-d") {
      debug = true;
    } else {
      return Usage();
    }
  }
  for (uint64_t i = 0; i < n_files; ++i) {
    char name[32];
    std::snprintf(name, sizeof(name), "f%llu", static_cast<unsigned long long>(i));
    AddNode(FUSE_ROOT_ID, name, false, size);
  }
  if (g_nodes.size() == 1) AddNode(FUSE_ROOT_ID, "f0", false, 1ull << 30);
  if (g_map) {
    void* m = ::mmap(nullptr, g_src_size, PROT_READ, MAP_SHARED, g_src_fd, 0);
    if (m == MAP_FAILED) {
      std::fprintf(stderr, "null_fuse: cannot map the source: %s\n", std::strerror(errno));
      return 1;
    }
    g_src_map = static_cast<const char*>(m);
  }
  for (size_t i = 0; i < sizeof(g_data); ++i) g_data[i] = static_cast<char>(i * 131u);

  fuse_lowlevel_ops ops{};
  ops.init = OnInit;
  ops.lookup = OnLookup;
  ops.getattr = OnGetattr;
  ops.opendir = OnOpendir;
  ops.readdir = OnReaddir;
  ops.readdirplus = OnReaddirplus;
  ops.open = OnOpen;
  ops.read = OnRead;
  ops.statfs = OnStatfs;

  std::string o = "ro,default_permissions,fsname=null_fuse,subtype=ckptfs";
  std::vector<std::string> args_s = {"ckptfs_null_fuse", "-o", o};
  if (debug) args_s.push_back("-d");
  std::vector<char*> cargv;
  for (auto& s : args_s) cargv.push_back(s.data());
  fuse_args args = FUSE_ARGS_INIT(static_cast<int>(cargv.size()), cargv.data());
  fuse_session* se = fuse_session_new(&args, &ops, sizeof(ops), nullptr);
  if (se == nullptr) return 1;
  if (fuse_set_signal_handlers(se) != 0 || fuse_session_mount(se, mountpoint.c_str()) != 0) {
    fuse_session_destroy(se);
    std::fprintf(stderr, "null_fuse: cannot mount at %s\n", mountpoint.c_str());
    return 1;
  }
  if (raise) std::thread(RaiseReadahead, mountpoint).detach();
  fuse_loop_config* cfg = fuse_loop_cfg_create();
  fuse_loop_cfg_set_max_threads(cfg, threads);
  fuse_loop_cfg_set_idle_threads(cfg, 4);
  int rc = fuse_session_loop_mt(se, cfg);
  fuse_loop_cfg_destroy(cfg);
  fuse_session_unmount(se);
  fuse_remove_signal_handlers(se);
  fuse_session_destroy(se);
  fuse_opt_free_args(&args);
  if (!stats.empty()) WriteStats(stats);
  return rc == 0 ? 0 : 1;
}
