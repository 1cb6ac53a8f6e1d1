#include <cerrno>

#include "ckptfs/fs.h"

namespace ckptfs {

int ToErrno(const Status& s) {
  switch (s.code()) {
    case Code::kOk:
      return 0;
    case Code::kNotFound:
      return ENOENT;
    case Code::kStale:
      return ESTALE;
    case Code::kReadOnly:
      return EROFS;
    case Code::kInvalid:
    case Code::kIo:
    case Code::kUnsupported:
    case Code::kInternal:
      return EIO;
  }
  return EIO;
}

}  // namespace ckptfs
