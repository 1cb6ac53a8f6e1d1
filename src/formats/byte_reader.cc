#include "formats/byte_reader.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <nlohmann/json.hpp>

#include "ckptfs/progress.h"

namespace ckptfs::formats {

namespace {
Status PastEnd(const std::string& name, uint64_t offset, uint64_t len, uint64_t size) {
  return Invalid("cannot read " + name + ": range [" + std::to_string(offset) + ", +" + std::to_string(len) +
                 ") passes the end (" + std::to_string(size) + " bytes)");
}
}  // namespace

Result<std::string> MemoryReader::ReadAt(uint64_t offset, uint64_t len) const {
  uint64_t end;
  if (AddOverflow(offset, len, &end) || end > data_.size()) {
    return PastEnd(name_, offset, len, data_.size());
  }
  return std::string(data_.substr(offset, len));
}

Status PreadExact(int fd, uint64_t offset, char* dst, uint64_t len, const std::string& name) {
  uint64_t done = 0;
  while (done < len) {
    ssize_t n = ::pread(fd, dst + done, len - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("read", name, errno);
    }
    if (n == 0) {
      return Invalid("cannot read " + name + ": file is truncated (wanted " + std::to_string(len) +
                     " bytes at offset " + std::to_string(offset) + ")");
    }
    done += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Result<std::string> FileSliceReader::Pread(uint64_t offset, uint64_t len) const {
  std::string out(len, '\0');
  RETURN_IF_ERROR(PreadExact(fd_, base_ + offset, out.data(), len, name_));
  ReportProgress(len);  // the index build's progress (ProgressScope)
  return out;
}

Result<std::string> FileSliceReader::ReadAt(uint64_t offset, uint64_t len) const {
  uint64_t end;
  if (AddOverflow(offset, len, &end) || end > size_) return PastEnd(name_, offset, len, size_);
  if (end <= kWindow) {
    if (!head_loaded_) {
      ASSIGN_OR_RETURN(head_, Pread(0, std::min(size_, kWindow)));
      head_loaded_ = true;
    }
    return head_.substr(offset, len);
  }
  uint64_t tail_start = size_ > kWindow ? size_ - kWindow : 0;
  if (offset >= tail_start) {
    if (!tail_loaded_) {
      ASSIGN_OR_RETURN(tail_, Pread(tail_start, size_ - tail_start));
      tail_loaded_ = true;
    }
    return tail_.substr(offset - tail_start, len);
  }
  return Pread(offset, len);
}

namespace {

// `fd` (owned) if its size is at most max_bytes; sets `size`.
Result<int> Bounded(int fd, const std::string& path, uint64_t max_bytes, uint64_t* size) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    return ErrnoStatus("stat", path, e);
  }
  *size = static_cast<uint64_t>(st.st_size);
  if (*size > max_bytes) {
    ::close(fd);
    return Invalid("cannot read " + path + ": " + std::to_string(*size) + " bytes is more than the " +
                   std::to_string(max_bytes) + " allowed");
  }
  return fd;
}

// All of `fd` (owned, `size` bytes).
Result<std::string> ReadAll(int fd, uint64_t size, const std::string& path) {
  FileSliceReader r(fd, 0, size, path);
  auto res = size == 0 ? Result<std::string>(std::string()) : r.ReadAt(0, size);
  ::close(fd);
  return res;
}

}  // namespace

Result<int> OpenBoundedFile(const std::string& path, uint64_t max_bytes, uint64_t* size) {
  ASSIGN_OR_RETURN(int fd, OpenRegularFile(path));
  return Bounded(fd, path, max_bytes, size);
}

Result<std::string> ReadWholeFile(const std::string& path, uint64_t max_bytes) {
  uint64_t size = 0;
  ASSIGN_OR_RETURN(int fd, OpenBoundedFile(path, max_bytes, &size));
  return ReadAll(fd, size, path);
}

Result<std::string> ReadWholeSourceFile(const std::string& root, const std::string& rel, uint64_t max_bytes) {
  const std::string path = root + "/" + rel;
  uint64_t size = 0;
  ASSIGN_OR_RETURN(int opened, OpenSourceFile(root, rel));
  ASSIGN_OR_RETURN(int fd, Bounded(opened, path, max_bytes, &size));
  return ReadAll(fd, size, path);
}

Result<int> OpenAndFingerprint(const std::string& dir, SourceFile& f) {
  const std::string path = dir + "/" + f.rel_path;
  auto opened = OpenSourceFile(dir, f.rel_path);
  if (!opened.ok()) {
    // Refused but present (outside the tree, a FIFO, a directory): its
    // fingerprint as the staleness check sees it, so the index stays valid
    // and every read of it fails with the refusal; absent: missing (-1).
    struct stat st {};
    if (opened.status().code() != Code::kNotFound && ::stat(path.c_str(), &st) == 0) {
      f.size = static_cast<uint64_t>(st.st_size);
      f.mtime_ns = StatNs(st.st_mtim);
      f.ctime_ns = StatNs(st.st_ctim);
      f.inode = st.st_ino;
    } else {
      f.mtime_ns = -1;
    }
    return opened.status();
  }
  const int fd = *opened;
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    Status err = ErrnoStatus("stat", path, errno);
    ::close(fd);
    f.mtime_ns = -1;
    return err;
  }
  f.size = static_cast<uint64_t>(st.st_size);
  f.mtime_ns = StatNs(st.st_mtim);
  f.ctime_ns = StatNs(st.st_ctim);
  f.inode = st.st_ino;
  return fd;
}

std::vector<std::string> ListDirectory(const std::string& path) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(path.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n != "." && n != "..") out.push_back(std::move(n));
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

int64_t TrainerStateStep(const std::string& dir) {
  auto text = ReadWholeSourceFile(dir, "trainer_state.json", uint64_t{16} << 20);
  if (!text.ok()) return -1;
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
  if (j.is_object() && j.contains("global_step") && j["global_step"].is_number_integer()) {
    return j["global_step"].get<int64_t>();
  }
  return -1;
}

}  // namespace ckptfs::formats
