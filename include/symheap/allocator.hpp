// Deterministic first-fit allocator over a byte range of the symmetric heap.
// Every PE performs the same sequence of collective malloc/free calls, so the
// same request lands at the same offset on every PE.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>

namespace symheap {

class Allocator {
 public:
  Allocator() = default;
  Allocator(size_t begin, size_t end);

  // Returns the offset of a new block; throws HeapExhausted.
  size_t allocate(size_t nbytes, size_t align, size_t heap_size);
  // Throws InvalidArgument if offset is not the start of a live block.
  void release(size_t offset);
  // Size of the live block starting at offset, or 0.
  size_t block_size(size_t offset) const;
  // True when [offset, offset + nbytes) lies inside one live block.
  bool covers(size_t offset, size_t nbytes) const;
  size_t bytes_in_use() const { return in_use_; }
  size_t capacity() const { return end_ - begin_; }
  size_t live_blocks() const { return used_.size(); }

 private:
  size_t begin_ = 0, end_ = 0, in_use_ = 0;
  std::map<size_t, size_t> free_;  // offset -> size, coalesced
  std::map<size_t, size_t> used_;  // offset -> size
};

}  // namespace symheap
