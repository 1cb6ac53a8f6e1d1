// The pickle dialect matrix: one state (DeepSpeed's ZeroStageEnum members,
// a Megatron-DeepSpeed args Namespace holding megatron.enums.
// PositionEmbeddingType, nested containers) pickled by real interpreters at
// protocols 0-5 (tests/fixtures/make_pickle_dialects.py: CPython 3.11.2,
// Debian 12's, which writes enum members as getattr(Cls, 'name'), and
// 3.11.7, which writes Cls(value)). Every file must read to the same values
// expected.json records; the unknown enum stays an inert placeholder that
// keeps its class and member.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "../test_util.h"
#include "formats/deepspeed/ds_reader.h"
#include "formats/pickle.h"

namespace ckptfs::formats {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The JSON mirror make_pickle_dialects.py writes: enum members as their
// values (a placeholder enum through the table expected.json gives),
// Namespace as its attribute dict, tuples and lists as arrays.
Result<json> Mirror(const PyValue* v, const json& enums) {
  switch (v->kind) {
    case PyKind::kNone:
      return json(nullptr);
    case PyKind::kBool:
      return json(v->b);
    case PyKind::kInt:
      return json(v->i);
    case PyKind::kFloat:
      return json(v->f);
    case PyKind::kStr:
      return json(v->s);
    case PyKind::kTuple:
    case PyKind::kList: {
      json a = json::array();
      for (PyRef x : v->items) {
        ASSIGN_OR_RETURN(json j, Mirror(x, enums));
        a.push_back(std::move(j));
      }
      return a;
    }
    case PyKind::kDict: {
      json o = json::object();
      for (const auto& [k, x] : v->dict) {
        if (!k->IsStr()) return Invalid("a non-str key");
        ASSIGN_OR_RETURN(o[k->s], Mirror(x, enums));
      }
      return o;
    }
    case PyKind::kObject: {
      if (v->ClassName() == "Namespace" && v->state != nullptr) return Mirror(v->state, enums);
      if (auto e = EnumValue(v, "enum"); e.ok()) return json(*e);
      // A placeholder enum member in either form.
      const PyValue* cls = v->callable;
      if (cls != nullptr && cls->kind == PyKind::kGlobal && cls->name() == "getattr" && v->args().size() == 2 &&
          v->args()[0]->placeholder && v->args()[1]->IsStr()) {
        const std::string full = v->args()[0]->s + "." + v->args()[0]->name();
        if (!enums.contains(full) || !enums[full].contains(v->args()[1]->s)) return Invalid("unknown member " + full);
        return enums[full][v->args()[1]->s];
      }
      if (cls != nullptr && cls->placeholder && v->args().size() == 1 && v->args()[0]->kind == PyKind::kInt) {
        return json(v->args()[0]->i);
      }
      return Invalid("an object of " + std::string(v->ClassName()));
    }
    default:
      return Invalid("an unexpected value kind");
  }
}

TEST(PickleDialectsTest, EveryInterpreterAndProtocolReadsTheSameState) {
  const fs::path root = fs::path(CKPTFS_TEST_DATA) / "pickle_dialects";
  int files = 0, by_name = 0;
  for (const auto& dir : fs::directory_iterator(root)) {
    const json expected = json::parse(ckptfs::testing::ReadFile((dir.path() / "expected.json").string()));
    for (int proto = 0; proto <= 5; ++proto) {
      const fs::path f = dir.path() / ("proto" + std::to_string(proto) + ".pkl");
      const std::string what = f.filename().string() + " of " + dir.path().filename().string();
      const std::string data = ckptfs::testing::ReadFile(f.string());
      std::vector<std::string> placeholders;
      PickleOptions ds = DeepSpeedPickleOptions();  // as the DeepSpeed reader reads
      auto r = Unpickle(data, what, ds, &placeholders);
      ASSERT_TRUE(r.ok()) << r.status().message();
      EXPECT_EQ(placeholders, std::vector<std::string>{"megatron.enums.PositionEmbeddingType"}) << what;
      auto got = Mirror(r->get(), expected["enums"]);
      ASSERT_TRUE(got.ok()) << what << ": " << got.status().message();
      EXPECT_EQ(*got, expected["state"]) << what;
      // The same file read in 3-byte windows (how a DCP .metadata is read).
      const PickleRead read = [&](uint64_t off, char* dst, size_t len) {
        data.copy(dst, len, off);
        return Status::Ok();
      };
      ds.read_window = 3;
      auto windowed = Unpickle(data.size(), read, what, ds);
      ASSERT_TRUE(windowed.ok()) << windowed.status().message();
      auto again = Mirror(windowed->get(), expected["enums"]);
      ASSERT_TRUE(again.ok()) << what << ": " << again.status().message();
      EXPECT_EQ(*again, expected["state"]) << what << " in windows";
      const bool getattr_form = data.find("getattr") != std::string::npos;
      EXPECT_EQ(getattr_form, expected["contains_getattr"][std::to_string(proto)].get<bool>()) << what;
      by_name += getattr_form;
      ++files;
    }
  }
  EXPECT_EQ(files, 12);   // two interpreters x six protocols
  EXPECT_EQ(by_name, 6);  // CPython 3.11.2 writes getattr at every protocol
}

}  // namespace
}  // namespace ckptfs::formats
