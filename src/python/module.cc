// The Python extension `ckptfs._ckptfs`: the FUSE-free filesystem core
// (ckptfs/fs.h) for the package in python/ckptfs, without a mount.
//
// Design note. This layer only converts: Python values into the core's calls
// and Status into exceptions. Tensor bytes go straight from the read engine
// into the caller's buffer (numpy, torch, anything speaking DLPack or the
// buffer protocol, host memory: pageable or pinned), with the GIL released,
// so reads from several Python threads run in parallel in the core. A CUDA
// buffer (DLPack kDLCUDA) is filled on its device: the plan's source spans go
// up once from pinned staging and the merge / strip / widen / mean kernels
// write into the buffer itself (TensorReader::ReadToDevice), after the work
// queued on the caller's stream. The device backends are this process's,
// one per device, checked against the CPU before their first read; they free
// their buffers when idle but never reset the device (torch shares its
// context). Naming tensors, boxes as slices and the torch StorageReader live
// in Python.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ckptfs/formats.h"
#include "ckptfs/fs.h"
#include "ckptfs/io.h"
#include "ckptfs/transforms.h"
#include "ckptfs/verify.h"
#include "ckptfs/views.h"

namespace nb = nanobind;

namespace ckptfs {
namespace {

PyObject* g_error = nullptr;  // ckptfs.Error (an OSError)

// Raises the Status as ckptfs.Error (FileNotFoundError/KeyError for a name that
// does not exist), with the core's "cannot <verb> <file>: <reason>" text.
[[noreturn]] void Raise(const Status& st) {
  if (st.code() == Code::kNotFound) throw nb::key_error(st.message().c_str());
  PyErr_SetString(g_error, st.message().c_str());
  throw nb::python_error();
}

// DLPack type code and bits of a dtype (the buffer the caller hands in must
// hold exactly these elements; a raw-byte view would be silently misread).
std::pair<uint8_t, uint8_t> DlpackOf(DType d) {
  using nb::dlpack::dtype_code;
  const auto c = [](dtype_code x) { return static_cast<uint8_t>(x); };
  switch (d) {
    case DType::kBool:
      return {c(dtype_code::Bool), 8};
    case DType::kU8:
      return {c(dtype_code::UInt), 8};
    case DType::kU16:
      return {c(dtype_code::UInt), 16};
    case DType::kU32:
      return {c(dtype_code::UInt), 32};
    case DType::kU64:
      return {c(dtype_code::UInt), 64};
    case DType::kI8:
      return {c(dtype_code::Int), 8};
    case DType::kI16:
      return {c(dtype_code::Int), 16};
    case DType::kI32:
      return {c(dtype_code::Int), 32};
    case DType::kI64:
      return {c(dtype_code::Int), 64};
    case DType::kF16:
      return {c(dtype_code::Float), 16};
    case DType::kF32:
      return {c(dtype_code::Float), 32};
    case DType::kF64:
      return {c(dtype_code::Float), 64};
    case DType::kBF16:
      return {c(dtype_code::Bfloat), 16};
    case DType::kC64:
      return {c(dtype_code::Complex), 64};
    case DType::kC128:
      return {c(dtype_code::Complex), 128};
    // DLPack 1.1's float8 codes (torch exports these).
    case DType::kF8E4M3FN:
      return {10, 8};
    case DType::kF8E4M3FNUZ:
      return {11, 8};
    case DType::kF8E5M2:
      return {12, 8};
    case DType::kF8E5M2FNUZ:
      return {13, 8};
    case DType::kInvalid:
      break;
  }
  return {255, 0};
}

DType ParseDType(const std::string& name) {
  const DType d = DTypeFromTorchName(name);
  if (d == DType::kInvalid) {
    PyErr_SetString(PyExc_TypeError, ("unknown dtype '" + name + "'").c_str());
    throw nb::python_error();
  }
  return d;
}

using Buffer = nb::ndarray<nb::c_contig>;

class PyCheckpoint {
 public:
  PyCheckpoint(const std::string& src, const std::optional<std::string>& index, const std::string& engine,
               const std::string& gpu, bool rebuild, const std::optional<std::string>& family) {
    FsOptions o;
    if (family.has_value()) {
      const auto f = FamilyFromName(*family);
      if (!f) throw nb::value_error(("family '" + *family + "': expected one of " + FamilyNameList()).c_str());
      o.family = *f;
    }
    o.src = src;
    o.index_dir = index.value_or("");
    auto kind = ParseEngineKind(engine);
    if (!kind.ok()) throw nb::value_error(kind.status().message().c_str());
    o.engine = *kind;
    auto mode = ParseGpuMode(gpu);
    if (!mode.ok()) throw nb::value_error(mode.status().message().c_str());
    o.gpu = *mode;
    o.force_rebuild = rebuild;
    o.cuda.reset_when_idle = false;  // torch's context lives in this process too
    Result<std::unique_ptr<Filesystem>> fs = Internal("not run");
    {
      nb::gil_scoped_release unlocked;  // an index build takes seconds on big checkpoints
      fs = Filesystem::Open(o);
    }
    if (!fs.ok()) Raise(fs.status());
    fs_ = std::move(*fs);
  }

  // (id, key, role, fqn, state, dtype, shape, error, alias) for every tensor.
  using TensorRow = std::tuple<uint32_t, std::string, std::string, std::string, std::string, std::string,
                               std::vector<int64_t>, std::string, bool>;
  std::vector<TensorRow> Tensors() const {
    static constexpr const char* kRoles[] = {"param", "optim_state", "other", "hidden"};
    std::vector<TensorRow> rows;
    const auto& ts = fs_->index().tensors();
    rows.reserve(ts.size());
    for (uint32_t i = 0; i < ts.size(); ++i) {
      const TensorRecord& t = ts[i];
      if (t.role == Role::kHidden) continue;
      const bool blob = t.encoding != Encoding::kTensor;
      rows.emplace_back(i, t.key, kRoles[static_cast<int>(t.role)], t.fqn, t.state,
                        blob ? std::string("object") : std::string(DTypeName(t.dtype)), t.VocabShape(), t.error,
                        t.alias);
    }
    return rows;
  }

  void ReadInto(uint32_t id, const std::string& out_dtype, const std::optional<std::vector<int64_t>>& offsets,
                const std::optional<std::vector<int64_t>>& lengths, Buffer out, uintptr_t stream) {
    const DType d = ParseDType(out_dtype);
    const auto [code, bits] = DlpackOf(d);
    // numpy has no bfloat16 / fp8 that DLPack can carry: ml_dtypes arrays come
    // as a view of unsigned integers of the same width (ckptfs/__init__.py).
    const bool bits_view =
        (d == DType::kBF16 || DTypeSize(d) == 1) && d != DType::kU8 && d != DType::kI8 && d != DType::kBool &&
        out.dtype().code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt) && out.dtype().bits == bits;
    if (!bits_view && (out.dtype().code != code || out.dtype().bits != bits || out.dtype().lanes != 1)) {
      throw nb::type_error(("the output buffer's element type does not hold " + std::string(DTypeName(d))).c_str());
    }
    const int dev = out.device_type();
    const bool on_device = dev == nb::device::cuda::value;
    if (dev != nb::device::cpu::value && dev != nb::device::cuda_host::value && !on_device) {
      throw nb::type_error("the output buffer must be host memory (pageable or pinned) or CUDA device memory");
    }
    DeviceTarget target;
    if (on_device) {
      DeviceBackend& b = Device(static_cast<int>(out.device_id()));
      target.backend = b.tf.get();
      target.kernels_trusted = b.trusted;
      target.after = reinterpret_cast<void*>(stream);
    }
    const auto& ts = fs_->index().tensors();
    if (id >= ts.size()) throw nb::index_error(("no tensor " + std::to_string(id)).c_str());
    // As params/ serves it: a padded vocabulary's rows cut to the vocabulary.
    Box box = ts[id].VocabBox(false);
    const bool boxed = offsets.has_value();
    int64_t numel = NumelOf(box.lengths);
    if (boxed) {
      if (!lengths || lengths->size() != offsets->size()) throw nb::value_error("offsets and lengths differ in rank");
      box.offsets = *offsets;
      box.lengths = *lengths;
      numel = 1;
      for (int64_t l : box.lengths) numel *= l;
    }
    // The buffer holds the box's elements (any shape with that count: C order).
    if (static_cast<int64_t>(out.size()) != numel) {
      throw nb::value_error(("the output buffer holds " + std::to_string(out.size()) + " elements, the " +
                             (boxed ? "box " : "tensor ") + std::to_string(numel))
                                .c_str());
    }
    const uint64_t len = static_cast<uint64_t>(out.size()) * (bits / 8);
    Status st;
    {
      nb::gil_scoped_release unlocked;
      st = fs_->ReadTensor(TensorId{id}, d, boxed || ts[id].VocabPadded() ? &box : nullptr,
                           static_cast<char*>(out.data()), len, on_device ? &target : nullptr);
    }
    if (!st.ok()) Raise(st);
  }

  // (inode, is_dir, size) of a tree path.
  std::tuple<uint64_t, bool, uint64_t> Stat(const std::string& path) const {
    auto ino = fs_->view().Resolve(path);
    if (!ino.ok()) {
      PyErr_SetString(PyExc_FileNotFoundError, ("no such file in the checkpoint tree: " + path).c_str());
      throw nb::python_error();
    }
    auto attr = fs_->GetAttr(*ino);
    if (!attr.ok()) Raise(attr.status());
    return {*ino, attr->is_dir, attr->size};
  }

  std::vector<std::pair<std::string, bool>> ListDir(const std::string& path) const {
    auto [ino, is_dir, size] = Stat(path);
    (void)size;
    if (!is_dir) throw nb::value_error((path + " is not a directory").c_str());
    auto entries = fs_->ReadDir(ino);
    if (!entries.ok()) Raise(entries.status());
    std::vector<std::pair<std::string, bool>> out;
    for (DirEntry& e : *entries) {
      if (e.name != "." && e.name != "..") out.emplace_back(std::move(e.name), e.is_dir);
    }
    return out;
  }

  void Open(uint64_t ino) {
    Status st = fs_->OpenFile(ino);
    if (!st.ok()) Raise(st);
  }

  // Reads into `out` (bytes) at `offset`; returns how many (short only at the end).
  size_t Pread(uint64_t ino, uint64_t offset, nb::ndarray<uint8_t, nb::c_contig, nb::device::cpu> out) {
    Result<size_t> n = Internal("not run");
    {
      nb::gil_scoped_release unlocked;
      n = fs_->Read(ino, offset, out.size(), reinterpret_cast<char*>(out.data()));
    }
    if (!n.ok()) Raise(n.status());
    return *n;
  }

  std::string Verify(bool deep, unsigned threads) const {
    VerifyOptions o;
    o.deep = deep;
    o.threads = threads;
    Result<Report> r = Internal("not run");
    {
      nb::gil_scoped_release unlocked;
      r = fs_->Verify(o);
    }
    if (!r.ok()) Raise(r.status());
    return ReportJson(*r, fs_->index(), /*timing=*/true);
  }

  // (name, kernels trusted, why not, device and pinned bytes held now) of the
  // device backend for CUDA device `ordinal`, made (and checked against the
  // CPU) on first use.
  std::tuple<std::string, bool, std::string, uint64_t> DeviceInfo(int ordinal) {
    DeviceBackend& b = Device(ordinal);
    return {b.tf->name(), b.trusted, b.why, b.tf->HeldBytes()};
  }

  // dcp/'s keys (views/dcp_view.h PlanDcp, the same plan the mount's dcp/
  // is laid out from): ([(key, alias, tensor id, [(chunk offsets, sizes)],
  // literal bytes)], [left out]); a literal entry (its bytes made by the
  // family reader: DeepSpeed's param groups) has tensor id -1.
  using DcpRow = std::tuple<std::string, std::string, int64_t,
                            std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>>, nb::bytes>;
  std::pair<std::vector<DcpRow>, std::vector<std::string>> DcpPlan() const {
    Result<dcp_view::DcpPlan> plan = Internal("not run");
    {
      nb::gil_scoped_release unlocked;
      plan = dcp_view::PlanDcp(fs_->index());
    }
    if (!plan.ok()) Raise(plan.status());
    std::vector<DcpRow> rows;
    rows.reserve(plan->entries.size());
    for (dcp_view::DcpEntry& e : plan->entries) {
      std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> chunks;
      for (Box& b : e.chunks) chunks.emplace_back(std::move(b.offsets), std::move(b.lengths));
      const bool literal = e.tensor == dcp_view::DcpEntry::kLiteral;
      rows.emplace_back(std::move(e.key), std::move(e.alias), literal ? int64_t{-1} : int64_t{e.tensor},
                        std::move(chunks), nb::bytes(e.literal.data(), e.literal.size()));
    }
    return {std::move(rows), std::move(plan->left_out)};
  }

  // The bytes entries the family reader made for dcp/ (dcp_view::FamilyEntries:
  // param groups with their members' FQNs), as [(key, bytes)]; nothing is planned.
  std::vector<std::pair<std::string, nb::bytes>> FamilyEntries() const {
    std::vector<std::string> left_out;
    std::vector<std::pair<std::string, nb::bytes>> out;
    for (auto& [key, bytes] : dcp_view::FamilyEntries(fs_->index(), &left_out)) {
      out.emplace_back(std::move(key), nb::bytes(bytes.data(), bytes.size()));
    }
    return out;
  }

  std::string IndexDir() const { return fs_->index().dir(); }
  bool Built() const { return fs_->open_result().built; }
  std::string Stats() const { return fs_->StatsJson(); }
  std::string EngineName() const { return fs_->engine_name(); }

 private:
  struct DeviceBackend {
    std::unique_ptr<Transforms> tf;
    bool trusted = false;
    std::string why;  // why the kernels are not trusted
  };
  // The backend for CUDA device `ordinal`: made on first use and run against
  // the CPU on the check plans (CheckAgainstCpu); a backend that differed
  // still uploads, but every read renders on the host (logged once).
  DeviceBackend& Device(int ordinal) {
    std::unique_ptr<Transforms> made;
    {
      std::lock_guard<std::mutex> l(dev_mu_);
      auto it = devices_.find(ordinal);
      if (it != devices_.end()) return it->second;
    }
    CudaOptions co;
    co.device = ordinal;
    co.reset_when_idle = false;
    auto tf = MakeCudaTransforms(co);
    if (!tf.ok()) {
      PyErr_SetString(
          g_error, ("cannot read into CUDA device " + std::to_string(ordinal) + ": " + tf.status().message()).c_str());
      throw nb::python_error();
    }
    Status check = Internal("not run");
    {
      nb::gil_scoped_release unlocked;
      check = CheckAgainstCpu(**tf);
    }
    if (!check.ok()) LogError("device reads render on the host, then upload: " + check.message());
    std::lock_guard<std::mutex> l(dev_mu_);
    auto [it, fresh] = devices_.try_emplace(ordinal);
    if (fresh) it->second = DeviceBackend{std::move(*tf), check.ok(), check.ok() ? "" : check.message()};
    return it->second;
  }

  std::unique_ptr<Filesystem> fs_;
  std::mutex dev_mu_;
  std::map<int, DeviceBackend> devices_;  // entries are never erased (references stay valid)
};

}  // namespace
}  // namespace ckptfs

NB_MODULE(_ckptfs, m) {
  using ckptfs::PyCheckpoint;
  m.doc() = "ckptfs core (see the ckptfs package)";
  ckptfs::g_error = PyErr_NewExceptionWithDoc("ckptfs.Error",
                                              "A checkpoint ckptfs cannot read: the message names the file and the "
                                              "problem (what the mount answers with EIO).",
                                              PyExc_OSError, nullptr);
  m.attr("Error") = nb::handle(ckptfs::g_error);
  // The families the core reads (family.h): (name, title), in id order.
  m.def("families", [] {
    std::vector<std::pair<std::string, std::string>> out;
    for (const ckptfs::FamilyTraits& f : ckptfs::AllFamilies()) out.emplace_back(f.name, f.title);
    return out;
  });
  // Whether the read engine renders dtype `src` as `dst` (torch spellings):
  // identity, widening to float32, float32 to bf16 / f16 (model.h Renders).
  m.def("renders", [](const std::string& src, const std::string& dst) {
    const ckptfs::DType a = ckptfs::DTypeFromTorchName(src), b = ckptfs::DTypeFromTorchName(dst);
    return a != ckptfs::DType::kInvalid && b != ckptfs::DType::kInvalid && ckptfs::Renders(a, b);
  });
  nb::class_<PyCheckpoint>(m, "_Checkpoint")
      .def(nb::init<const std::string&, const std::optional<std::string>&, const std::string&, const std::string&, bool,
                    const std::optional<std::string>&>(),
           nb::arg("src"), nb::arg("index").none() = nb::none(), nb::arg("engine") = "auto", nb::arg("gpu") = "auto",
           nb::arg("rebuild") = false, nb::arg("family").none() = nb::none())
      .def("tensors", &PyCheckpoint::Tensors)
      .def("read_into", &PyCheckpoint::ReadInto, nb::arg("id"), nb::arg("dtype"), nb::arg("offsets").none(),
           nb::arg("lengths").none(), nb::arg("out").noconvert(), nb::arg("stream") = 0)
      .def("device_info", &PyCheckpoint::DeviceInfo, nb::arg("ordinal"))
      .def("dcp_plan", &PyCheckpoint::DcpPlan)
      .def("family_entries", &PyCheckpoint::FamilyEntries)
      .def("stat", &PyCheckpoint::Stat)
      .def("listdir", &PyCheckpoint::ListDir)
      .def("open", &PyCheckpoint::Open)
      .def("pread", &PyCheckpoint::Pread, nb::arg("ino"), nb::arg("offset"), nb::arg("out").noconvert())
      .def("verify", &PyCheckpoint::Verify, nb::arg("deep") = false, nb::arg("threads") = 0)
      .def_prop_ro("index_dir", &PyCheckpoint::IndexDir)
      .def_prop_ro("built", &PyCheckpoint::Built)
      .def_prop_ro("engine", &PyCheckpoint::EngineName)
      .def("stats", &PyCheckpoint::Stats);
}
