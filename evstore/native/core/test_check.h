// The one check harness of the TF-free core test binaries (*_test.cc, built
// and run by tests/native/CMakeLists.txt (make test-native)). A failed check prints file:line and
// the expression (with both values for CHECK_EQ) and exits 1 at once; a binary
// that reaches its end prints "all tests passed", which the driver requires.
#pragma once
#include <stdlib.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

[[noreturn]] inline void TestFail(const char* file, int line, const std::string& what) {
  std::fflush(stdout);
  std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", file, line, what.c_str());
  std::_Exit(1);
}
#define CHECK(c) \
  do { if (!(c)) TestFail(__FILE__, __LINE__, #c); } while (0)
#define CHECK_EQ(a, b)                                                     \
  do {                                                                     \
    auto va_ = (a);                                                        \
    auto vb_ = (b);                                                        \
    if (!(va_ == vb_)) {                                                   \
      std::cerr << "  lhs = " << +va_ << ", rhs = " << +vb_ << std::endl;  \
      TestFail(__FILE__, __LINE__, #a " == " #b);                          \
    }                                                                      \
  } while (0)
#define CHECK_THROWS(expr, Exc)                                            \
  do {                                                                     \
    bool thrown_ = false;                                                  \
    try { expr; } catch (const Exc&) { thrown_ = true; }                   \
    if (!thrown_) TestFail(__FILE__, __LINE__, #expr " throws " #Exc);     \
  } while (0)

// Whether test `name` runs: every test, or with EVSTORE_TEST_FILTER set
// (comma-separated substrings) those whose name contains one of them (the
// ThreadSanitizer build runs only the tests where threads race).
inline bool TestSelected(const char* name) {
  const char* f = std::getenv("EVSTORE_TEST_FILTER");
  if (!f || !*f) return true;
  std::string filter(f), n(name);
  for (size_t b = 0; b <= filter.size();) {
    size_t e = filter.find(',', b);
    if (e == std::string::npos) e = filter.size();
    if (e > b && n.find(filter.substr(b, e - b)) != std::string::npos) return true;
    b = e + 1;
  }
  return false;
}
// Runs one test function and reports it ("ok <name>", or "skip <name>"
// when the filter leaves it out).
#define RUN(fn) \
  (TestSelected(#fn) ? (fn(), std::printf("ok %s\n", #fn)) : std::printf("skip %s\n", #fn), std::fflush(stdout))
// Runs a key-templated test for both key types.
#define RUN_K(fn) (RUN(fn<int64_t>), RUN(fn<int32_t>))
// A new directory `<prefix>XXXXXX` (mkdtemp) for a test binary's files; it is
// removed with everything in it when the binary ends normally (a failed CHECK
// exits at once and leaves it to look at). The prefix picks the file system:
// a relative one lands in the working directory (the build tree, on a disk),
// where /tmp may be a tmpfs.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& prefix) : path_(prefix + "XXXXXX") {
    if (::mkdtemp(path_.data()) == nullptr) TestFail(__FILE__, __LINE__, "mkdtemp " + path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A test binary's main(): runs the statements given (RUN / RUN_K lines, in
// order), then prints the line the driver requires. Each binary states only its list:
//   TEST_MAIN(RUN(test_a); RUN_K(test_b);)
#define TEST_MAIN(...)                  \
  int main() {                          \
    __VA_ARGS__                         \
    std::printf("all tests passed\n"); \
    return 0;                           \
  }
