#pragma once
#include <string>

#include "transports/remote_engine.hpp"

namespace symheap {
namespace remote {

// `file` in the folder of the file that holds symheap's core (the Python module,
// or a test executable), symlinks resolved; `file` alone if that is unknown.
// Where the engine libraries are installed.
std::string beside_core(const char* file);

// The process's remote engine for host memory (the cpu backend), loaded on
// first success and kept; null with the reason and the way to get one.
Engine* process_engine(std::string* why_not);

}  // namespace remote
}  // namespace symheap
