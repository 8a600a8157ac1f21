#pragma once
#include <string>

#include "transports/remote_engine.hpp"

namespace symheap {
namespace remote {

// The process's remote engine for host memory (the cpu backend), loaded on
// first success and kept; null with the reason and the way to get one.
Engine* process_engine(std::string* why_not);

}  // namespace remote
}  // namespace symheap
