// What every EP kernel receives: the launch-wide constants and the call's
// arguments (Params, passed by value), and the host-mapped mirror's layout.
#pragma once
#include <algorithm>
#include <cstdint>

#include "ops/ep/ep_config.hpp"
#include "ops/ep/ep_device_compat.hpp"
#include "symheap/backend.hpp"  // StreamHandle (the host launchers)

namespace symheap::ep::EP_DEVICE_NS::kernels {

// Combine reduces each token as soon as its rows landed (one flag per piece
// of a row) from this many combine rows on; smaller calls wait for whole PEs.
#ifdef __CUDACC__
constexpr int kThreads = 512;  // dispatch / combine blocks
constexpr int64_t kRowFlagRows = 2048;
#else  // the host emulation: fewer OS threads per block, hence more blocks per grid
constexpr int kThreads = 64;
constexpr int64_t kRowFlagRows = 64;
#endif
constexpr int kWarpsPerBlock = kThreads / 32;
// With row flags, combine sums each piece of a row in this many parts (each
// a warp's unit): the sums left when the last rows land take fewer rounds.
constexpr int kReduceSplit = 2;
// Combine's reducers keep where each row of a token lies in shared memory
// ([warps][send_cols] pointers) when a token has at most this many columns.
constexpr int kMaxCachedCols = 128;
// kRouteGraceNs: how long dispatch's ticket 0 waits for the other blocks'
// counts before it counts every token itself (they are late only when the
// grid is not resident at once; the emulation runs one block at a time).
// kHelpNs: how long a block that arrived just before dispatch's last one
// waits for every row to land, to copy a part of the metadata.
#ifdef __CUDACC__
constexpr uint64_t kRouteGraceNs = 20000;
constexpr uint64_t kHelpNs = 20000;
#else
constexpr uint64_t kRouteGraceNs = 0;
constexpr uint64_t kHelpNs = 0;
#endif

// Host-mapped mirror (int32 words): what the host reads without a device
// synchronisation, or after one.
enum HostWord : int {
  kHostStatus = 0, kHostDetail = 1, kHostPe = 2, kHostEpoch = 3,  // first recorded failure
  kHostNumRecv = 4,  // rows received (sync paths)
  kHostAbort = 5,    // the last packed call was aborted (copy engine)
  kHostSegments = 6, // number of copy segments below
  // A timed-out wait (with the first failure): which flags, the late PE's
  // flag as last read, and the value waited for.
  kHostWait = 7, kHostSeen = 8, kHostTarget = 9,
  kHostSegment0 = 12  // [4 * i]: (peer, staging / source row, destination row, rows)
};

// What a wait was for (kHostWait).
enum WaitKind : int32_t { kWaitNone = 0, kWaitCounts = 1, kWaitData = 2, kWaitFreed = 3,
                          kWaitCombine = 4, kWaitEntered = 5, kWaitForward = 6,
                          kWaitStaged = 7, kWaitPlan = 8 };

// A launch's arguments, identical for every thread. Fields used only by
// dispatch or only by combine are left zero by the other.
struct Params {
  Config cfg;
  Geometry geo;
  // Where things are.
  char* const* peer_bases;    // heap base of every PE, as seen from this device (device table)
  uint64_t workspace_offset;  // heap offset of the op's workspace
  char* my_workspace;         // this PE's workspace: local words need no load from the table
  int32_t my_pe, n_pes;
  int32_t* host_mirror;       // device address of the host-mapped mirror (HostWord)
  uint64_t timeout_ns;        // bound of every wait
  // The call.
  int64_t num_tokens;          // tokens of this call (0 when this PE aborts)
  int32_t arg_status;          // what the host's argument checks found (kOk or a Status)
  int32_t arg_detail;          // and the value they name
  int32_t pack_for_copy_engine;  // stage rows locally; the host's copy engines move them
  int32_t has_remote_peers;    // some PE (another node) has no load/store path: kernels store
                               // into mapped PEs only, the host reaches the others
  int64_t tokens_per_block;    // dispatch_kernel: tokens routed and sent by one block
  int32_t spare_ticket0;       // dispatch_kernel: ticket 0 (which totals the counts) takes no
                               // tokens; ticket t takes those of slot t - 1
  int32_t flag_per_epoch;      // what each peer adds to a data / combine flag per call
  int32_t row_pieces;          // warps that share one row (at most kMaxPieces)
  int32_t sender_blocks;       // combine_kernel: blocks that send (the others reduce)
  int32_t per_row_flags;       // combine_kernel: reducers wait per row, not for whole PEs
  int32_t reduce_pieces;       // warps that share one token's sum (per_row_flags:
                               // kReduceSplit * row_pieces)
  // Dispatch: inputs, then outputs.
  const char* tokens;          // [num_tokens][hidden] rows to send
  const char* token_scales;    // their scales (fp8), or null
  const void* topk_idx;        // [num_tokens][topk] expert ids, int32 or int64
  int32_t topk_idx_is_int64;
  const float* topk_weights;   // [num_tokens][topk], or null
  int32_t* num_recv;
  int32_t* expert_counts;
  int32_t* send_rows;          // the handle's send table
  int32_t* recv_meta;          // the handle's per-row metadata
  int32_t* recv_summary;       // the handle's summary
  float* saved_weights;        // received rows' weights
  // Caller-owned receive outputs (DispatchArgs::out_*), or null: dispatch
  // stores the rows a PE sends itself there (token-major), collect_kernel
  // the others, unless this call publishes them: then every PE's dispatch
  // stores its rows straight there, and no collect follows.
  int32_t peers_write_outputs;  // Op::peers_write_outputs: read each peer's outputs off the board
  int32_t publish_outputs;      // this call's outputs are on the board (and this PE's rows go there)
  char* out_x;
  char* out_scales;
  int32_t* out_idx;
  float* out_w;
  int32_t* out_meta;
  // Combine: the handle of the dispatch, the experts' rows and the output.
  const char* expert_output;
  const int32_t* handle_send_rows;
  const int32_t* handle_recv_meta;
  const int32_t* handle_summary;
  const float* combine_weights;
  char* combined_out;
  // Redispatch (with the handle fields above): this PE's token rows, and the
  // received rows' output [recv_rows][hidden].
  const char* token_rows;
  char* redispatched_out;
};

}  // namespace symheap::ep::EP_DEVICE_NS::kernels
