// Thin libfuse low-level adapter over the Filesystem core. Each handler does
// its work in the core, then makes exactly one fuse_reply_* call; a
// catch-all guard turns anything unexpected into EIO plus a log line.
// Content is immutable, so entries and attributes are cached for a day,
// negative lookups too, and open() sets keep_cache. Every write-type
// operation answers EROFS (the mount is also "ro").
#define FUSE_USE_VERSION 312
#include <fuse3/fuse_lowlevel.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "ckptfs/mount.h"

namespace ckptfs {
namespace {

constexpr double kTimeout = 86400.0;
constexpr unsigned kMaxRequest = 1u << 20;  // 1 MiB reads: max_pages 256

Filesystem& Fs(fuse_req_t req) { return *static_cast<Filesystem*>(fuse_req_userdata(req)); }

// Owner shown for every file: MountOptions uid/gid, else the mounting user.
// Set once before the session starts (a process serves one mount).
uid_t g_uid = 0;
gid_t g_gid = 0;
// The kernel opens directories itself after an ENOSYS to OPENDIR (OnOpendir).
std::atomic<bool> g_no_opendir{false};

// fsname= is parsed by libfuse's option parser, where ',' separates options
// and '\' escapes.
std::string EscapeOptionValue(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == ',' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

void FillStat(const Attr& a, struct stat* st) {
  std::memset(st, 0, sizeof(*st));
  st->st_ino = a.ino;
  st->st_mode = a.is_dir ? (S_IFDIR | 0555) : (S_IFREG | 0444);
  st->st_nlink = a.nlink;
  st->st_size = static_cast<off_t>(a.size);
  // Files: the 1 MiB request size (cp and dd read that much at a time).
  // Directories: glibc's readdir sizes its getdents buffer by st_blksize,
  // and the kernel allocates and maps a buffer that large for every
  // getdents of a FUSE directory (two per directory, the second finding
  // the end): 1 MiB made a fresh mount's `ls -lR` mostly page allocation.
  st->st_blksize = a.is_dir ? 4096 : 1 << 20;
  // Every file is computed from the sources and occupies no storage of its
  // own: `du` shows 0 (as for /proc), `du --apparent-size` the bytes a read
  // returns. Copy tools that see st_blocks < size probe for holes with
  // SEEK_DATA, which FUSE answers as "all data", so they still read it all.
  st->st_blocks = 0;
  st->st_uid = g_uid;
  st->st_gid = g_gid;
  st->st_mtim.tv_sec = a.mtime_ns / 1000000000;
  st->st_mtim.tv_nsec = a.mtime_ns % 1000000000;
  st->st_atim = st->st_mtim;
  st->st_ctim = st->st_mtim;
}

template <typename F>
void Guard(fuse_req_t req, const char* op, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    LogError(std::string("internal error in ") + op + ": " + e.what());
    fuse_reply_err(req, EIO);
  } catch (...) {
    LogError(std::string("internal error in ") + op);
    fuse_reply_err(req, EIO);
  }
}

void OnInit(void*, fuse_conn_info* conn) {
  conn->max_write = kMaxRequest;  // libfuse derives max_pages from this
  conn->max_readahead = kMaxRequest;
  if (conn->capable & FUSE_CAP_SPLICE_WRITE) conn->want |= FUSE_CAP_SPLICE_WRITE;
  // Listings carry attributes (OnReaddirplus), always: the tree answers them
  // without I/O, so the adaptive mode's plain READDIR + LOOKUPs never pays.
  if (conn->capable & FUSE_CAP_READDIRPLUS) conn->want |= FUSE_CAP_READDIRPLUS;
  conn->want &= ~FUSE_CAP_READDIRPLUS_AUTO;
  g_no_opendir.store((conn->capable & FUSE_CAP_NO_OPENDIR_SUPPORT) != 0);
  if (conn->capable & FUSE_CAP_AUTO_INVAL_DATA) conn->want |= FUSE_CAP_AUTO_INVAL_DATA;  // see OnOpendir
  conn->want &= ~FUSE_CAP_ASYNC_READ;
  conn->want |= conn->capable & FUSE_CAP_ASYNC_READ;
}

void OnLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  Guard(req, "lookup", [&] {
    fuse_entry_param e{};
    e.entry_timeout = kTimeout;
    e.attr_timeout = kTimeout;
    auto a = Fs(req).Lookup(parent, name);
    if (!a.ok()) {
      if (a.status().code() == Code::kNotFound) {
        e.ino = 0;  // negative entry, cached for entry_timeout
        fuse_reply_entry(req, &e);
      } else {
        fuse_reply_err(req, ToErrno(a.status()));
      }
      return;
    }
    e.ino = a->ino;
    if (a->dynamic) e.attr_timeout = 0;
    FillStat(*a, &e.attr);
    fuse_reply_entry(req, &e);
  });
}

void OnGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  Guard(req, "getattr", [&] {
    auto a = Fs(req).GetAttr(ino);
    if (!a.ok()) {
      fuse_reply_err(req, ToErrno(a.status()));
      return;
    }
    struct stat st;
    FillStat(*a, &st);
    fuse_reply_attr(req, &st, a->dynamic ? 0 : kTimeout);
  });
}

// No OPENDIR round trips. The first is answered ENOSYS, and a kernel that
// offers NO_OPENDIR_SUPPORT then opens directories itself, caching their
// listings (FOPEN_CACHE_DIR is its default then): a fresh `ls -lR` costs two
// READDIRPLUS round trips per directory instead of three and a RELEASEDIR,
// and a later one none. topo/, which gains entries, moves its mtime on
// (View::ChangedNs) and has no attribute timeout; with AUTO_INVAL_DATA the
// kernel checks that mtime when a listing starts and drops the cached one.
// An older kernel gets a reply that caches every listing but topo/'s.
void OnOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Guard(req, "opendir", [&] {
    if (g_no_opendir.load()) return static_cast<void>(fuse_reply_err(req, ENOSYS));
    const bool dynamic = Fs(req).Dynamic(ino);
    fi->cache_readdir = dynamic ? 0 : 1;
    fi->keep_cache = dynamic ? 0 : 1;
    fuse_reply_open(req, fi);
  });
}

// Listings hold no open handle: each request names its directory and the
// offset it resumes at.
Result<std::vector<DirEntry>> ListingPage(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                                          size_t min_entry_bytes) {
  if (off < 0) return Status(Code::kInvalid, "negative directory offset");
  return Fs(req).ReadDirPage(ino, static_cast<uint64_t>(off), size / min_entry_bytes + 1);
}

void ReplyListingError(fuse_req_t req, const Status& s) {
  fuse_reply_err(req, s.code() == Code::kInvalid ? ENOTDIR : ToErrno(s));
}

void OnReaddir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info*) {
  Guard(req, "readdir", [&] {
    auto entries = ListingPage(req, ino, size, off, /*fuse_dirent + a name=*/32);
    if (!entries.ok()) return ReplyListingError(req, entries.status());
    thread_local std::vector<char> buf;  // not zeroed per call: the kernel may ask for 1 MiB
    if (buf.size() < size) buf.resize(size);
    size_t used = 0;
    for (const DirEntry& d : *entries) {
      struct stat st {};
      st.st_ino = d.ino;
      st.st_mode = d.is_dir ? S_IFDIR : S_IFREG;
      size_t n =
          fuse_add_direntry(req, buf.data() + used, size - used, d.name.c_str(), &st, static_cast<off_t>(d.next));
      if (n > size - used) break;
      used += n;
    }
    fuse_reply_buf(req, buf.data(), used);
  });
}

// READDIRPLUS: each entry with its attributes, answered from the tree, so
// `ls -l` / `find -size` of a directory costs one round trip per buffer of
// entries instead of a LOOKUP per name. "." and ".." carry no entry (no lookup
// count), nor does a file whose attributes fail: the kernel then looks it up
// and the error is answered there.
void OnReaddirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info*) {
  Guard(req, "readdirplus", [&] {
    auto entries = ListingPage(req, ino, size, off, /*fuse_direntplus + a name=*/160);
    if (!entries.ok()) return ReplyListingError(req, entries.status());
    thread_local std::vector<char> buf;  // not zeroed per call: the kernel may ask for 1 MiB
    if (buf.size() < size) buf.resize(size);
    size_t used = 0;
    for (const DirEntry& d : *entries) {
      fuse_entry_param e{};
      e.attr.st_ino = d.ino;
      e.attr.st_mode = d.is_dir ? S_IFDIR : S_IFREG;
      if (d.name != "." && d.name != "..") {
        auto a = Fs(req).GetAttr(d.ino);
        if (a.ok()) {
          e.ino = d.ino;
          e.entry_timeout = kTimeout;
          e.attr_timeout = a->dynamic ? 0 : kTimeout;
          FillStat(*a, &e.attr);
        }
      }
      size_t n =
          fuse_add_direntry_plus(req, buf.data() + used, size - used, d.name.c_str(), &e, static_cast<off_t>(d.next));
      if (n > size - used) break;
      used += n;
    }
    fuse_reply_buf(req, buf.data(), used);
  });
}

void OnOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Guard(req, "open", [&] {
    if ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC)) {
      fuse_reply_err(req, EROFS);
      return;
    }
    Status s = Fs(req).OpenFile(ino, static_cast<uint32_t>(fuse_req_ctx(req)->pid));
    if (!s.ok()) {
      fuse_reply_err(req, ToErrno(s));
      return;
    }
    const bool dynamic = Fs(req).Dynamic(ino);
    fi->keep_cache = dynamic ? 0 : 1;
    fi->direct_io = dynamic ? 1 : 0;  // topo/ERRORS: its size changes under the page cache
    fuse_reply_open(req, fi);
  });
}

// At most this many pieces in a mapped reply: libfuse adds its header to the
// iovec array and writev takes at most IOV_MAX (1024).
constexpr size_t kMaxReplyPieces = 1000;

void OnRead(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info*) {
  Guard(req, "read", [&] {
    // Plain copies of source bytes: one writev from the sources' mappings.
    thread_local MappedRead mapped;
    if (Fs(req).ReadMapped(ino, static_cast<uint64_t>(off), size, kMaxReplyPieces, &mapped)) {
      const auto& iov = mapped.bytes.pieces;
      const int rc = fuse_reply_iov(req, iov.data(), static_cast<int>(iov.size()));
      mapped.Clear();  // unpins the windows
      if (rc < 0 && rc != -ENOENT)
        Fs(req).MappedReplyFailed(ino, static_cast<uint64_t>(off), -rc);  // ENOENT: interrupted
      return;
    }
    mapped.Clear();
    thread_local std::vector<char> buf;
    if (buf.size() < size) buf.resize(size);
    auto n = Fs(req).Read(ino, static_cast<uint64_t>(off), size, buf.data());
    if (!n.ok()) {
      fuse_reply_err(req, ToErrno(n.status()));
      return;
    }
    fuse_reply_buf(req, buf.data(), *n);
  });
}

void OnStatfs(fuse_req_t req, fuse_ino_t) {
  struct statvfs sv {};
  sv.f_bsize = 1 << 20;
  sv.f_frsize = 4096;
  sv.f_files = Fs(req).view().num_nodes();
  sv.f_namemax = 255;
  sv.f_flag = ST_RDONLY;
  fuse_reply_statfs(req, &sv);
}

void ReadOnly(fuse_req_t req) { fuse_reply_err(req, EROFS); }

// The kernel offers FUSE only its default readahead (128 KiB) at INIT and a
// filesystem may lower it, not raise it, so buffered reads would arrive as
// 128 KiB requests. Once the mount answers, raise the mount's bdi readahead to
// the 1 MiB request size. Runs on its own thread: the stat() is served by the
// session loop. Needs root (sysfs); otherwise reads stay at 128 KiB (logged).
void RaiseReadahead(const std::string& mountpoint) {
  struct stat st {};
  if (::stat(mountpoint.c_str(), &st) != 0) return;
  char path[96];
  std::snprintf(path, sizeof(path), "/sys/class/bdi/%u:%u/read_ahead_kb", major(st.st_dev), minor(st.st_dev));
  FILE* f = std::fopen(path, "we");
  if (f == nullptr || std::fprintf(f, "%u\n", kMaxRequest / 1024) < 0 || std::fclose(f) != 0) {
    LogInfo(std::string("cannot raise readahead via ") + path + ": " + std::strerror(errno) +
            " (reads stay at the kernel's default size)");
    return;
  }
  LogInfo(std::string("readahead set to 1 MiB via ") + path);
}

fuse_lowlevel_ops MakeOps() {
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
  ops.setattr = [](fuse_req_t r, fuse_ino_t, struct stat*, int, fuse_file_info*) { ReadOnly(r); };
  ops.mknod = [](fuse_req_t r, fuse_ino_t, const char*, mode_t, dev_t) { ReadOnly(r); };
  ops.mkdir = [](fuse_req_t r, fuse_ino_t, const char*, mode_t) { ReadOnly(r); };
  ops.unlink = [](fuse_req_t r, fuse_ino_t, const char*) { ReadOnly(r); };
  ops.rmdir = [](fuse_req_t r, fuse_ino_t, const char*) { ReadOnly(r); };
  ops.symlink = [](fuse_req_t r, const char*, fuse_ino_t, const char*) { ReadOnly(r); };
  ops.rename = [](fuse_req_t r, fuse_ino_t, const char*, fuse_ino_t, const char*, unsigned) { ReadOnly(r); };
  ops.link = [](fuse_req_t r, fuse_ino_t, fuse_ino_t, const char*) { ReadOnly(r); };
  ops.write = [](fuse_req_t r, fuse_ino_t, const char*, size_t, off_t, fuse_file_info*) { ReadOnly(r); };
  ops.create = [](fuse_req_t r, fuse_ino_t, const char*, mode_t, fuse_file_info*) { ReadOnly(r); };
  ops.setxattr = [](fuse_req_t r, fuse_ino_t, const char*, const char*, size_t, int) { ReadOnly(r); };
  ops.removexattr = [](fuse_req_t r, fuse_ino_t, const char*) { ReadOnly(r); };
  ops.fallocate = [](fuse_req_t r, fuse_ino_t, int, off_t, off_t, fuse_file_info*) { ReadOnly(r); };
  return ops;
}

}  // namespace

int MountAndServe(Filesystem& fs, const std::string& mountpoint, const MountOptions& opts,
                  const std::function<void(const Status&)>& ready) {
  g_uid = opts.uid >= 0 ? static_cast<uid_t>(opts.uid) : ::getuid();
  g_gid = opts.gid >= 0 ? static_cast<gid_t>(opts.gid) : ::getgid();
  std::string o = "ro,default_permissions,fsname=" + EscapeOptionValue(opts.fsname.empty() ? "ckptfs" : opts.fsname) +
                  ",subtype=ckptfs";
  if (opts.allow_other) o += ",allow_other";
  std::vector<std::string> argv = {"ckptfs", "-o", o};
  if (opts.debug) argv.push_back("-d");
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  fuse_args args = FUSE_ARGS_INIT(static_cast<int>(cargv.size()), cargv.data());
  static const fuse_lowlevel_ops kOps = MakeOps();
  fuse_session* se = fuse_session_new(&args, &kOps, sizeof(kOps), &fs);
  if (se == nullptr) {
    ready(Internal("cannot create a FUSE session"));
    return 1;
  }
  if (fuse_set_signal_handlers(se) != 0) {
    fuse_session_destroy(se);
    ready(Internal("cannot install signal handlers"));
    return 1;
  }
  if (fuse_session_mount(se, mountpoint.c_str()) != 0) {
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    ready(IoError("cannot mount at " + mountpoint + " (is /dev/fuse available and the directory empty?)"));
    return 1;
  }
  // The daemon converts widened reads straight from the sources' mappings
  // (Filesystem::ReadMapped); the guard turns a source cut short under a
  // mapping into an error for that read. Only the daemon installs it (the
  // Python package opens a Filesystem inside someone else's process).
  if (fs.mapped_reads()) {
    if (Status g = InstallSigbusGuard(); !g.ok()) LogWarn(g.message() + ": conversions are read through the engine");
  }
  ready(Status::Ok());
  std::thread(RaiseReadahead, mountpoint).detach();
  fuse_loop_config* cfg = fuse_loop_cfg_create();
  fuse_loop_cfg_set_max_threads(cfg, opts.max_threads);
  fuse_loop_cfg_set_idle_threads(cfg, 4);
  int rc = fuse_session_loop_mt(se, cfg);
  fuse_loop_cfg_destroy(cfg);
  fuse_session_unmount(se);
  fuse_remove_signal_handlers(se);
  fuse_session_destroy(se);
  fuse_opt_free_args(&args);
  return rc == 0 ? 0 : 1;
}

}  // namespace ckptfs
