#include "formats/zarr/zarr_reader.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "ckptfs/geometry.h"
#include "common/json_text.h"
#include "formats/byte_reader.h"
#include "formats/torch_file.h"

namespace ckptfs::formats {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr uint64_t kMaxZarray = 1 << 20;
constexpr uint64_t kMaxChunks = 1 << 22;
// An array is indexed chunk by chunk, absent chunks included (each is a hole
// that reads fail on). A .zarray whose grid has far more chunks than its
// directory holds (a damaged or hostile shape) is refused before that loop,
// so memory follows the files that exist, not the numbers in the JSON.
constexpr uint64_t kMaxAbsentChunks = 4096;

// Regular files under an array directory (chunks; nested for '/'), up to `cap`.
uint64_t CountChunkFiles(const std::string& dir, uint64_t cap) {
  std::error_code ec;
  uint64_t n = 0;
  for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::none, ec);
       !ec && it != fs::recursive_directory_iterator() && n <= cap; it.increment(ec)) {
    if (it->is_regular_file(ec) && it->path().filename().string()[0] != '.') ++n;
  }
  return n;
}

// One array: its record and fragments (or a per-array error).
void ReadArray(Files& files, const std::string& root, const std::string& rel_prefix, const std::string& name) {
  Checkpoint& ck = *files.ck;
  const std::string zpath = root + "/" + name + "/.zarray";
  TensorRecord t;
  t.key = name;
  t.encoding = Encoding::kTensor;
  std::vector<Fragment> frags;
  auto fail = [&](const std::string& why) {
    t.error = "cannot read zarr array " + zpath + ": " + why;
    t.dtype = t.dtype == DType::kInvalid ? DType::kU8 : t.dtype;
    ck.info.problems.push_back(t.error);
  };
  auto finish = [&] { ck.AddTensor(std::move(t), std::move(frags)); };
  auto text = ReadWholeFile(zpath, kMaxZarray);
  if (!text.ok()) return fail(text.status().message()), finish();
  json z = json::parse(*text, nullptr, false);
  if (z.is_discarded() || !z.is_object()) return fail("not JSON"), finish();
  try {
    if (z.value("zarr_format", 0) != 2) return fail("zarr_format is not 2"), finish();
    auto dt = ZarrV2DType(z.at("dtype").get<std::string>());
    if (!dt.ok()) return fail(dt.status().message()), finish();
    t.dtype = *dt;
    t.shape = z.at("shape").get<std::vector<int64_t>>();
    auto chunks = z.at("chunks").get<std::vector<int64_t>>();
    if (chunks.size() != t.shape.size()) return fail("chunks and shape have different ranks"), finish();
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (t.shape[d] < 0 || chunks[d] <= 0) return fail("bad shape or chunks"), finish();
    }
    if (z.contains("compressor") && !z["compressor"].is_null()) {
      return fail("compressed chunks (" + JsonText(z["compressor"]) + ") are not supported"), finish();
    }
    if (z.contains("filters") && !z["filters"].is_null()) return fail("filters are not supported"), finish();
    if (z.value("order", std::string("C")) != "C") return fail("Fortran order is not supported"), finish();
    const std::string sep = z.value("dimension_separator", std::string("."));
    if (sep != "." && sep != "/") return fail("bad dimension_separator"), finish();
    // Chunk grid.
    // Chunk grid, overflow-checked (shape, chunks and the products are untrusted).
    std::vector<int64_t> grid(t.shape.size());
    uint64_t n_chunks = 1, chunk_bytes = DTypeSize(t.dtype);
    for (size_t d = 0; d < t.shape.size(); ++d) {
      grid[d] = t.shape[d] / chunks[d] + (t.shape[d] % chunks[d] != 0);
      if (MulOverflow(n_chunks, static_cast<uint64_t>(grid[d]), &n_chunks) || n_chunks > kMaxChunks) {
        return fail("shape " + JsonText(json(t.shape)) + " in chunks of " + JsonText(json(chunks)) +
                    " is more chunks than ckptfs indexes (" + std::to_string(kMaxChunks) + ")"),
               finish();
      }
      if (MulOverflow(chunk_bytes, static_cast<uint64_t>(chunks[d]), &chunk_bytes) ||
          chunk_bytes > (uint64_t{1} << 40)) {
        return fail("a chunk of " + JsonText(json(chunks)) + " elements is larger than 1 TiB"), finish();
      }
    }
    if (n_chunks > kMaxAbsentChunks) {
      const uint64_t present = CountChunkFiles(root + "/" + name, n_chunks);
      if (n_chunks > present + kMaxAbsentChunks) {
        return fail("its shape " + JsonText(json(t.shape)) + " needs " + std::to_string(n_chunks) +
                    " chunks, the directory holds " + std::to_string(present) + " (a damaged .zarray?)"),
               finish();
      }
    }
    const auto strides = ContiguousStrides(chunks);
    std::vector<int64_t> idx(t.shape.size(), 0);
    for (uint64_t c = 0; c < n_chunks; ++c) {
      std::string key;
      for (size_t d = 0; d < idx.size(); ++d) key += (d ? sep : "") + std::to_string(idx[d]);
      if (idx.empty()) key = "0";
      // Registered even when absent: its fragment then fails on read, naming it.
      const FileId file = files.Open(rel_prefix + name + "/" + key, /*parse=*/false)->file;
      const SourceFile& sf = ck.files[file.v];
      Fragment f;
      f.file = file;
      f.dtype = t.dtype;
      f.strides = strides;
      f.data_offset = 0;
      f.data_length = chunk_bytes;
      for (size_t d = 0; d < idx.size(); ++d) {
        f.offsets.push_back(idx[d] * chunks[d]);
        f.lengths.push_back(std::min(chunks[d], t.shape[d] - idx[d] * chunks[d]));
      }
      const bool missing = sf.mtime_ns == -1, bad_size = !missing && sf.size != chunk_bytes;
      if (missing || bad_size) {
        const std::string region = BoxString(Box{f.offsets, f.lengths});
        ck.info.Flag(Check::kCoverage, Severity::kError, name, sf.rel_path,
                     missing
                         ? "zarr chunk " + sf.rel_path + " is missing: a hole at " + region + " of '" + name +
                               "' (reads of that region fail; ckptfs never fills it with fill_value)"
                         : "zarr chunk " + sf.rel_path + " has " + std::to_string(sf.size) + " bytes, a chunk of '" +
                               name + "' needs " + std::to_string(chunk_bytes) + ": left out, a hole at " + region,
                     nlohmann::json({{"holes", {region}}, {"shape", t.shape}}).dump());
      }
      if (!bad_size) frags.push_back(std::move(f));
      for (size_t d = idx.size(); d-- > 0;) {
        if (++idx[d] < grid[d]) break;
        idx[d] = 0;
      }
    }
  } catch (const json::exception& e) {
    return fail(std::string("bad .zarray: ") + e.what()), finish();
  }
  finish();
}

}  // namespace

Result<DType> ZarrV2DType(const std::string& d) {
  if (d == "bfloat16") return DType::kBF16;
  static const std::pair<const char*, DType> kTable[] = {
      {"<f4", DType::kF32}, {"<f2", DType::kF16}, {"<f8", DType::kF64}, {"<i8", DType::kI64},  {"<i4", DType::kI32},
      {"<i2", DType::kI16}, {"|i1", DType::kI8},  {"|u1", DType::kU8},  {"|b1", DType::kBool}, {"<u2", DType::kU16},
      {"<u4", DType::kU32}, {"<u8", DType::kU64}, {"<c8", DType::kC64}, {"<c16", DType::kC128}};
  for (const auto& [name, dt] : kTable) {
    if (d == name) return dt;
  }
  if (d == "<V2" || d == "|V2") {
    return Unsupported("dtype '" + d +
                       "' is a raw 2-byte void (Megatron rewrote bf16 arrays to \"bfloat16\"; this one was not)");
  }
  return Unsupported("dtype '" + d + "' is not supported");
}

Status ReadZarrArrays(const std::string& ckpt_root, const std::string& rel_dir, Checkpoint& ck) {
  const std::string root = rel_dir.empty() ? ckpt_root : ckpt_root + "/" + rel_dir;
  const std::string rel_prefix = rel_dir.empty() ? "" : rel_dir + "/";
  Files files;
  files.dir = ckpt_root;
  files.ck = &ck;
  struct stat st {};
  for (const std::string& name : ListDirectory(root)) {
    const std::string sub = root + "/" + name;
    if (::stat((sub + "/.zarray").c_str(), &st) == 0) {
      ReadArray(files, root, rel_prefix, name);
      continue;
    }
    if (::stat(sub.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    // ShardedObjects: <key>/shard_<offsets>_<shape>.pt, served verbatim.
    for (const std::string& f : ListDirectory(sub)) {
      if (f.rfind("shard_", 0) != 0) continue;
      auto src = files.Open(rel_prefix + name + "/" + f, /*parse=*/false);
      TensorRecord t;
      t.key = name + "/" + f;
      t.error = src->error;
      ck.AddFileBytes(src->file, std::move(t));
    }
  }
  return Status::Ok();
}

}  // namespace ckptfs::formats
