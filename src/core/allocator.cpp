#include "symheap/allocator.hpp"

#include <string>

#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"

namespace symheap {

Allocator::Allocator(size_t begin, size_t end) : begin_(begin), end_(end) {
  if (end > begin) free_[begin] = end - begin;
}

size_t Allocator::allocate(size_t nbytes, size_t align, size_t heap_size) {
  if (nbytes == 0) nbytes = 1;  // distinct offsets for empty buffers
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    size_t start = it->first, size = it->second;
    size_t aligned = (start + align - 1) / align * align;
    size_t pad = aligned - start;
    if (pad > size || size - pad < nbytes) continue;
    size_t tail = size - pad - nbytes;
    free_.erase(it);
    if (pad) free_[start] = pad;
    if (tail) free_[aligned + nbytes] = tail;
    used_[aligned] = nbytes;
    in_use_ += nbytes;
    return aligned;
  }
  throw HeapExhausted(
      "symmetric heap exhausted: cannot allocate " + format_size(nbytes) + " (heap size " +
      format_size(heap_size) + ", " + format_size(in_use_) + " in use in " +
      std::to_string(used_.size()) +
      " buffers). Raise it with init(..., heap_size=...) or the SYMHEAP_HEAP_SIZE "
      "environment variable (e.g. SYMHEAP_HEAP_SIZE=4G), or free buffers first.");
}

void Allocator::release(size_t offset) {
  auto it = used_.find(offset);
  if (it == used_.end())
    throw InvalidArgument("free: offset " + std::to_string(offset) +
                          " is not a live symmetric allocation (already freed?)");
  size_t size = it->second;
  used_.erase(it);
  in_use_ -= size;
  auto inserted = free_.emplace(offset, size).first;
  auto next = std::next(inserted);
  if (next != free_.end() && inserted->first + inserted->second == next->first) {
    inserted->second += next->second;
    free_.erase(next);
  }
  if (inserted != free_.begin()) {
    auto prev = std::prev(inserted);
    if (prev->first + prev->second == inserted->first) {
      prev->second += inserted->second;
      free_.erase(inserted);
    }
  }
}

size_t Allocator::block_size(size_t offset) const {
  auto it = used_.find(offset);
  return it == used_.end() ? 0 : it->second;
}

bool Allocator::covers(size_t offset, size_t nbytes) const {
  auto it = used_.upper_bound(offset);
  if (it == used_.begin()) return false;
  --it;
  return offset >= it->first && offset + nbytes <= it->first + it->second &&
         offset + nbytes >= offset;
}

}  // namespace symheap
