// One KV-cache attention call as the XLA FFI handler prepares it: the op
// core's CacheArgs plus what the handler does around the core. Plain data, so
// the CUDA side needs no XLA header.
#pragma once
#include <cstddef>
#include <cstdint>

#include "ops/attention/decode.hpp"

namespace symheap::attention::xla {

struct CacheCallBuffers {
  CacheArgs args;  // reads and writes the caches through the result buffers when appending
  // Appending: the caches as operands. XLA aliases them to the results, so
  // they are normally the same buffers; if not, they are copied over first.
  const void* k_cache_in = nullptr;
  const void* v_cache_in = nullptr;
  size_t cache_bytes = 0;
  // Varlen: rows outside every sequence are never written by the core, so
  // the handler clears out (zeros) and lse (-inf) first.
  bool clear_rows = false;
  size_t out_bytes = 0;
  int64_t lse_count = 0;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
};

#ifdef SYMHEAP_WITH_CUDA
// Enqueues the cache copies (if any) and the clears on `stream` (no host
// synchronisation, no allocation).
void prepare_cache_call_cuda(const CacheCallBuffers& c, int device, void* stream);
#endif

}  // namespace symheap::attention::xla
