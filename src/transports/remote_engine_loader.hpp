#pragma once
#include <string>

#include "transports/remote_engine.hpp"

namespace symheap {
namespace remote {

// `file` in the folder of the file that holds symheap's core (the Python module,
// or a test executable), symlinks resolved; `file` alone if that is unknown.
// Where the engine libraries are installed.
std::string beside_core(const char* file);

// `symbol` of the library `file` beside the core, opened (and kept loaded);
// null with the reason in `why_not`, naming the library as `what`. `path`
// (if given) gets where the library was looked for.
void* symbol_beside_core(const char* file, const char* symbol, const std::string& what,
                         std::string* why_not, std::string* path = nullptr);

// The process's remote engine for host memory (the cpu backend), loaded on
// first success and kept; null with the reason and the way to get one.
Engine* process_engine(std::string* why_not);

}  // namespace remote
}  // namespace symheap
