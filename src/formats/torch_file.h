// Shared pieces of the family readers: registering each source file once
// (fingerprinted; a torch.save .pt also parsed), resolving a pickled tensor to
// the byte range of its storage, and the fragment of a whole tensor.
#ifndef CKPTFS_FORMATS_TORCH_FILE_H_
#define CKPTFS_FORMATS_TORCH_FILE_H_

#include <unistd.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/geometry.h"
#include "ckptfs/model.h"
#include "formats/byte_reader.h"
#include "formats/pickle.h"
#include "formats/torch_save.h"

namespace ckptfs::formats {

// The str items of a list / tuple (others skipped); empty for anything else.
std::vector<std::string> StrList(const PyValue* v);

// A tensor inside one source archive: where its elements lie.
struct Loc {
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape, strides;
  uint64_t data_offset = 0, data_length = 0;  // absolute in the file
  int64_t Numel() const { return NumelOf(shape); }
  bool Contiguous() const { return strides == ContiguousStrides(shape); }
};

// One opened .pt of the checkpoint.
struct Source {
  FileId file;
  std::string rel;
  int fd = -1;
  std::unique_ptr<FileSliceReader> reader;
  TorchSaveArchive archive;
  std::string error;  // non-empty: unusable, and why
  const PyValue* root() const { return archive.root.get(); }
  ~Source() {
    if (fd >= 0) ::close(fd);
  }
};

struct Files {
  std::string dir;
  Checkpoint* ck = nullptr;
  PickleOptions pickle;  // modules a family's pickles may name

  // Registers, stats and parses `rel` (an absent file is recorded as missing).
  std::unique_ptr<Source> Open(const std::string& rel, bool parse = true);
  // One line for checkpoint.json's notes naming the unknown pickle globals
  // the opened files held as placeholders (empty when none did).
  std::string PlaceholderNote() const;

 private:
  struct Seen {
    size_t files = 0;
    std::string first;
  };
  std::map<std::string, Seen> placeholders_;  // "module.name" -> where
};

// The tensor `v` of source `s` (an error naming `what` when it is not one or
// its elements leave the storage record).
Result<Loc> Resolve(const Source& s, const PyValue* v, const std::string& what);

// One fragment holding all of `l` (in `file`) at the origin of the tensor.
Fragment WholeFragment(const Loc& l, FileId file);

}  // namespace ckptfs::formats

#endif  // CKPTFS_FORMATS_TORCH_FILE_H_
