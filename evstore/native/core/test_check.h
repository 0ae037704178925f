// Minimal CHECK macros for the TF-free core test binaries.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

[[noreturn]] inline void TestFail(const char* file, int line, const std::string& what) {
  std::fflush(stdout);
  std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", file, line, what.c_str());
  std::_Exit(1);
}
#define TCHECK(c) \
  do { if (!(c)) TestFail(__FILE__, __LINE__, #c); } while (0)
#define TCHECK_EQ(a, b)                                                    \
  do {                                                                     \
    auto va_ = (a);                                                        \
    auto vb_ = (b);                                                        \
    if (!(va_ == vb_)) {                                                   \
      std::cerr << "  lhs = " << +va_ << ", rhs = " << +vb_ << std::endl;  \
      TestFail(__FILE__, __LINE__, #a " == " #b);                          \
    }                                                                      \
  } while (0)
