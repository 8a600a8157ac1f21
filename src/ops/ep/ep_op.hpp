// Expert-parallel dispatch/combine: the op core, free of Python.
//
// An Op lives in the device slot of its PE (a registry kept in PeState's
// caches), so any thread that knows (job, rank, id) reaches it through the
// process-wide rank -> device map: the Python front end and, later, XLA FFI
// handlers call the same entry points. Every buffer (inputs, outputs, handle
// storage) and the stream are passed in; the only memory the op owns is its
// symmetric workspace, allocated collectively by the caller.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include <vector>

#include "ops/ep/ep_config.hpp"
#include "transports/copy_engine_issue_board.hpp"
#include "symheap/runtime.hpp"

namespace symheap::ep {

// Routing and payload of one dispatch call. Pointers live on the PE's device
// (host memory on the cpu backend).
struct DispatchArgs {
  const void* x = nullptr;          // [num_tokens, hidden] of config dtype
  const void* scales = nullptr;     // [num_tokens, hidden / scale_dim] or null
  const void* topk_idx = nullptr;   // [num_tokens, topk] int32 or int64; -1 drops a slot
  bool idx_int64 = true;
  const float* topk_weights = nullptr;  // [num_tokens, topk]
  int64_t num_tokens = 0;
  int32_t status = kOk;  // the caller found a bad argument: abort on every PE

  // Outputs, caller-allocated.
  int32_t* num_recv = nullptr;       // [1] rows received
  int32_t* expert_counts = nullptr;  // [local_experts] (row, slot) pairs per local expert
  // Handle storage, caller-allocated, read back by combine.
  int32_t* send_rows = nullptr;      // [max_tokens, send_cols] combine row or -1
  int32_t* recv_meta = nullptr;      // expert-major: [recv_rows, 4] (src pe, token, slot, combine row)
  int32_t* recv_summary = nullptr;   // [summary_words] see ep_config.hpp
  float* saved_weights = nullptr;    // [max_tokens, topk] (expert-major), may be null otherwise
  // Received rows delivered into caller-owned buffers (null: they stay in the
  // op's receive buffer, where the caller reads them). Shaped like that
  // buffer: x [recv_rows, hidden], scales [recv_rows, scales_per_row], and
  // token-major idx [recv_rows, topk], w [recv_rows, topk], meta
  // [recv_rows, kMetaWords]; expert-major w [recv_rows] (its metadata goes
  // to recv_meta above; idx and meta unused). Only rows within the counts
  // are written; past them token-major idx is -1, w 0 and meta -1
  // (expert-major w 0), and x and scales are left as they were. Rows this
  // PE sends to itself go straight there (device kernels, token-major).
  void* out_x = nullptr;
  void* out_scales = nullptr;
  int32_t* out_idx = nullptr;
  float* out_w = nullptr;
  int32_t* out_meta = nullptr;
  StreamHandle stream = 0;
};

struct CombineArgs {
  const void* expert_out = nullptr;  // [recv_rows or num_recv, hidden] of the combine dtype
  int64_t expert_rows = 0;           // rows the caller passed
  const int32_t* send_rows = nullptr;
  const int32_t* recv_meta = nullptr;
  const int32_t* recv_summary = nullptr;
  const float* weights = nullptr;    // [num_tokens, topk] (expert-major)
  int64_t num_tokens = 0;
  void* out = nullptr;               // [num_tokens, hidden] of the combine dtype
  int32_t status = kOk;
  StreamHandle stream = 0;
};

// Sends token rows to where an earlier dispatch placed that token's rows,
// through that dispatch's handle: no new routing. The reverse of combine
// (the gradient of combine, and of expert-major dispatch's rows).
struct RedispatchArgs {
  const void* rows = nullptr;        // [num_tokens, hidden] of the combine dtype
  int64_t num_tokens = 0;            // the dispatch's token count
  const int32_t* send_rows = nullptr;
  const int32_t* recv_meta = nullptr;     // expert-major
  const int32_t* recv_summary = nullptr;
  void* out = nullptr;  // [recv_rows, hidden] of the combine dtype; rows nothing landed in are zeroed
  int32_t status = kOk;
  StreamHandle stream = 0;
};

// Which PEs share a node (the peer table's node ids), and whether the op
// forwards inside nodes (ep_cpu.cpp; the device path: ep_device_driver.hpp):
// a row bound for several PEs of another node crosses once, to the
// forwarder there, which stores it into each destination; combine sums
// there and sends one row back.
struct NodeLayout {
  std::vector<int> node_of;                // PE -> node index (nodes by first PE)
  std::vector<int> local_index;            // PE -> rank among the PEs of its node
  std::vector<std::vector<int>> pes_of;    // node -> its PEs, ascending
  bool forward = false;  // more than one node and one holds several PEs (unless turned off)
  // The PE of `node` that forwards rows from `src`: the one with src's local
  // index (modulo the node's size).
  int forwarder(int src, int node) const {
    const std::vector<int>& pes = pes_of[node];
    return pes[local_index[src] % pes.size()];
  }
};
NodeLayout node_layout(const PeState& s);

// One dispatch/combine instance on one PE.
struct Op {
  int64_t id = 0;
  Config cfg;
  Geometry geo;
  uint64_t job = 0;
  int my_pe = -1;
  int n_pes = 0;
  int device = -1;
  size_t ws_offset = 0;  // heap offset of the symmetric workspace
  double timeout_s = kDefaultTimeoutS;
  NodeLayout nodes;
  // Device implementation: the PEs of other nodes (no load/store path), which
  // the host reaches through the remote transport (ep_device_driver.hpp).
  std::vector<int> remote_pes;
  std::mutex mu;         // one call at a time per op
  // Host-side epochs: the cpu implementation's, and on the device those of ops
  // with remote_pes (whose kernels also keep their own on the device).
  uint64_t dispatch_epoch = 0;
  uint64_t combine_epoch = 0;
  std::shared_ptr<class DeviceImpl> impl;  // CUDA (or its emulation); null: cpu implementation
  // Device kernels (intranode, low_latency; not token_slots) of an op whose
  // caller owns the receive outputs (DispatchArgs::out_*) and whose PEs all
  // live in this process: each dispatch publishes its outputs' addresses to
  // the peers (Geometry::off_out_board), which store their rows straight
  // there, so no copy from the receive buffer follows (collect_kernel).
  bool peers_write_outputs = false;
  // copy_engine on cuda with other PEs in this process (see
  // transports/copy_engine_issue_board.hpp): series 0 counts dispatches, 1 combines.
  std::shared_ptr<IssueBoard> board;
  std::vector<int> same_process_peers;
  uint64_t queued_dispatches = 0, queued_combines = 0;
  // Why a call failed part-way; non-empty: every later call raises it (see ep_op.cpp).
  std::string failure;
};

// Creates the op on the calling thread's PE, zeroes its sync words, and
// returns its id. The caller must barrier before any PE dispatches.
// `caller_outputs`: every dispatch passes DispatchArgs::out_* (the same on
// every PE; see Op::peers_write_outputs).
int64_t create(PeState& s, const Config& cfg, size_t ws_offset, size_t ws_bytes,
               bool caller_outputs = false);
void destroy(PeState& s, int64_t id);
std::shared_ptr<Op> find(uint64_t job, int rank, int64_t id, std::shared_ptr<PeState>* state);
// As above, for the slot of (job, rank) the caller already looked up (or null).
std::shared_ptr<Op> find(std::shared_ptr<PeState> slot, int rank, int64_t id,
                         std::shared_ptr<PeState>* state);
// The op `id` of the PE `s` (already looked up by the caller).
std::shared_ptr<Op> find(PeState& s, int64_t id);

// Most blocks in one grid of the op's kernels on the calling thread's PE:
// its GPU's SM count on cuda, kDefaultGridBlocks otherwise. A job takes the
// smallest over its PEs (Config::grid_blocks).
int local_grid_blocks(PeState& s);

// Returns the rows received when the host knows it (cpu, copy_engine, and
// intranode without max_recv_tokens); -1 when only the device knows.
int64_t dispatch(PeState& s, Op& op, const DispatchArgs& a);
void combine(PeState& s, Op& op, const CombineArgs& a);
// Collective like combine, and shares its buffers and epochs. The cpu
// implementation and the intranode / low_latency kernels (copy_engine raises
// Unsupported).
void redispatch(PeState& s, Op& op, const RedispatchArgs& a);
// Whether redispatch serves this op (front ends pick combine's gradient by it).
bool has_redispatch(const Op& op);
// Raises the first error a device-side call recorded (cuda); nothing on cpu.
// With sync, waits for the stream first.
void check(PeState& s, Op& op, StreamHandle stream, bool sync);
// What a call checks on the host before it runs, without running one: raises
// if the op failed earlier (as the call would). Errors that device-side calls
// recorded are left to check(): one PE's host may see them before another's,
// and a PE that refused to run while its peers ran would leave the op out of
// step. For callers whose calls a CUDA graph replays without the host (XLA's
// command buffers): they run this before every replay.
void ready(PeState& s, Op& op);

// The cpu implementation (the device one is in ep_device.hpp).
int64_t dispatch_cpu(PeState& s, Op& op, const DispatchArgs& a);
void combine_cpu(PeState& s, Op& op, const CombineArgs& a);
void redispatch_cpu(PeState& s, Op& op, const RedispatchArgs& a);

// Address of `offset` within PE pe's copy of the workspace, as the host sees
// it (a device address on cuda: usable by copies and kernels, not by the host).
inline char* ws_addr(const PeState& s, const Op& op, int pe, size_t offset) {
  return static_cast<char*>(s.peers[pe].base) + op.ws_offset + offset;
}

}  // namespace symheap::ep
