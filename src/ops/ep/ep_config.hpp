// Expert-parallel dispatch/combine: configuration and the layout of the
// symmetric workspace. Everything here is plain data, shared by the cpu
// implementation and the CUDA kernels.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace symheap::ep {

enum class DType : int32_t { F32 = 0, F16 = 1, BF16 = 2, FP8_E4M3 = 3 };
enum class Kernel : int32_t { Intranode = 0, LowLatency = 1, CopyEngine = 2 };
enum class Layout : int32_t { TokenMajor = 0, ExpertMajor = 1 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
DType parse_dtype(const std::string& name);  // torch names: "bfloat16", "float8_e4m3fn", ...
// dtype of expert outputs and of combine's result: bfloat16 for fp8 dispatch.
inline DType combine_dtype_of(DType t) { return t == DType::FP8_E4M3 ? DType::BF16 : t; }
Kernel parse_kernel(const std::string& name);
const char* kernel_name(Kernel k);
Layout parse_layout(const std::string& name);
const char* layout_name(Layout l);

constexpr int kDefaultGridBlocks = 132;  // an H100 / H200's SMs

struct Config {
  int32_t hidden = 0;
  int32_t max_tokens = 0;  // per rank
  int32_t num_experts = 0;
  int32_t topk = 0;
  DType dtype = DType::BF16;
  int32_t scale_dim = 0;  // 0: no scales; else hidden / scale_dim scales per row
  DType scale_dtype = DType::F32;
  Kernel kernel = Kernel::Intranode;
  Layout layout = Layout::TokenMajor;
  int32_t max_recv_tokens = 0;  // token-major receive bound; 0: n_pes * max_tokens
  int32_t expert_capacity = 0;  // expert-major rows per local expert; 0: n_pes * max_tokens
  // Token-major rows in fixed slots (layout "token_slots"): the row of token
  // t of PE s lies at row s * max_tokens + t of each destination, so no PE
  // waits for another's counts before its rows leave.
  bool token_slots = false;
  // Most blocks in one grid of the device kernels: the SM count of the
  // smallest GPU of the job (the same on every PE: grids and workspace
  // regions depend on it), kDefaultGridBlocks without GPUs.
  int32_t grid_blocks = kDefaultGridBlocks;
};

// Error codes a PE publishes with its routing counts, so that every PE
// aborts the same call together instead of waiting for a peer that gave up.
enum Status : int32_t {
  kOk = 0,
  kTooManyTokens = 1,    // detail: the token count
  kExpertOutOfRange = 2, // detail: the offending expert id (clamped to int32)
  kBadArgument = 3,      // detail: unused (the PE's own exception says what)
  kPeerTimeout = 4,      // cuda: a wait ran out; detail: the late PE
  kRecvOverflow = 5,     // detail: the destination PE (or expert) that overflowed
  kBadHandle = 6,        // combine's handle names rows outside the op's buffers (an edit)
};

// Sizes derived from a Config and the number of PEs, plus byte offsets of
// every region of the symmetric workspace (identical on every PE).
struct Geometry {
  int32_t n_pes = 0;
  int32_t local_experts = 0;
  int32_t scales_per_row = 0;
  int32_t count_words = 0;     // int32 words in one PE's routing-count row
  int64_t recv_rows = 0;       // rows of the receive buffer
  int64_t expert_cap = 0;      // rows per local expert (expert-major)
  int64_t combine_rows = 0;    // rows of the combine buffer
  int32_t send_cols = 0;       // columns of the send-row table: n_pes or topk
  int32_t slot_words = 0;      // token_slots: int32 words of one source's slot bits
  // Combine buffers (and statuses): two sets, used by call parity, let the
  // SM-driven combine skip waiting for its sources to consume the previous
  // call's rows (cuda); the cpu backend and the copy engine use set 0.
  int32_t combine_sets = 1;
  int32_t grid_blocks = 0;     // Config::grid_blocks
  bool padded_output = false;  // outputs keep recv_rows rows (no host-known count)
  DType combine_dtype = DType::BF16;
  size_t row_bytes = 0, scale_row_bytes = 0, combine_row_bytes = 0;

  // Sync words (uint64): flags written by peers, indexed by the writer.
  size_t off_count_flag = 0;    // [n] epoch of the routing-count row from PE i (cpu; device:
                                // PEs of other nodes, whose rows the host puts)
  size_t off_data_flag = 0;     // [n] dispatch rows from PE i have landed
  size_t off_combine_flag = 0;  // [n] combine rows from PE i have landed
  size_t off_freed_flag = 0;    // [n] PE i has consumed its combine buffer
  size_t off_entered = 0;       // [n] device, token_slots: the last dispatch PE i started
  size_t off_local = 0;         // [kLocalWords] this PE's own epochs, counters, error word
  // Routing-count rows [n][count_words]: int32 on the cpu backend; on the
  // device, two sets (by call parity) of uint64 words (epoch << 32 | value)
  // that need no flag.
  size_t off_count_rows = 0;
  size_t off_send_prefix = 0;   // device: uint64 (tagged) [n or E] this PE's send order
  size_t off_combine_status = 0;  // int32 [combine_sets][n]
  // cuda, SM-driven combine: [combine_rows][kMaxPieces] epoch of the last
  // combine whose piece of that row has landed here (set by the sender).
  size_t off_row_flags = 0;
  // Dispatch routing (device): the counts every block of the grid adds up,
  // two sets by call parity, int32 [2][n + E + 1] (rows per destination,
  // pairs per expert, lowest bad pair encoded as INT32_MAX - index).
  size_t off_route_totals = 0;
  // Per block of the dispatch grid (device, uint64 tagged with the epoch):
  // its rows per destination (token-major) or pairs per expert [blocks][n or
  // E], which later blocks rank from, and whether its counts are in the
  // totals [blocks].
  size_t off_route_counts = 0, off_route_done = 0;
  // Token-major dispatch routing (device): cell [q][d] sums PE q's rows to
  // PE d and cell [q][n] its failures (a bad argument or id), every block of
  // PE q adding kSumBlock plus its share on every PE, so a row is complete
  // once it counts every block of the grid (no wait for PE q's ticket 0).
  // uint64 [2][n][n + 1], two sets by call parity.
  size_t off_dest_sums = 0;
  // Dispatch with outputs published to peers (device, one process; see
  // Op::peers_write_outputs): where PE i's receive outputs of its current
  // call lie, uint64 [n][kOutFields], each field (epoch & kOutTagMask) <<
  // kOutTagShift | address >> 4 (address 0: PE i's rows from this PE go to
  // its receive buffer).
  size_t off_out_board = 0;
  // This PE's routing scratch (device): the rank of every (token, column)
  // among this PE's (small calls) or its dispatch block's rows to its
  // destination or expert [max_tokens, send_cols].
  size_t off_scratch_pos = 0;
  // Receive side of dispatch.
  size_t off_recv_x = 0, off_recv_scales = 0, off_recv_idx = 0, off_recv_w = 0, off_recv_meta = 0;
  // Source side of combine.
  size_t off_combine_buf = 0;  // [combine_sets][combine_rows][combine_row_bytes]
  // Local staging for the copy-engine kernel.
  size_t off_stage_x = 0, off_stage_scales = 0, off_stage_idx = 0, off_stage_w = 0,
         off_stage_meta = 0, off_stage_combine = 0;
  // Forwarding inside a node (cpu, jobs across nodes; see ep_cpu.cpp): per
  // source PE, the epoch of its forwarded rows (uint64 [n], a sync word), how
  // many it sent (int32 [n]), and its records [n][max_tokens][fwd_rec_bytes]:
  // int32 header [fwd_header_words] (token, destination row and combine row
  // per send column, expert ids [topk], float weights [topk]), then the row
  // at fwd_x_at and its scales at fwd_scales_at. Empty on the device path
  // (whose regions follow) and on one node.
  size_t off_fwd_flag = 0, off_fwd_count = 0, off_fwd_rec = 0;
  size_t fwd_rec_bytes = 0, fwd_x_at = 0, fwd_scales_at = 0;
  int32_t fwd_header_words = 0;
  // Forwarding on the device path (copy_engine across nodes, when the op
  // forwards; see ep_device_driver.hpp): per source PE, its epoch (off_fwd_flag
  // above), the rows of its tokens bound for this node, by token,
  // [n][max_tokens] rows and scales, and what per-PE sending puts beside
  // each row, by the source's staging row: [n][combine_rows] ids (token-major),
  // weights and metadata.
  bool fwd_on_device = false;
  size_t off_fwd_x = 0, off_fwd_scales = 0, off_fwd_idx = 0, off_fwd_w = 0, off_fwd_meta = 0;
  // Combine's reverse: per source PE, the epoch of its reduction plan (uint64
  // [n]), its record count (int32 [n]) and records [n][max_tokens]
  // [plan_words] (token, combine row per send column, float weight per
  // column); per writer PE of this node, the epoch of the rows it staged here
  // (uint64 [n]); staged rows [n sources][combine_rows] and the partial sums
  // this PE receives [n forwarders][max_tokens], of combine_row_bytes.
  size_t off_plan_flag = 0, off_plan_count = 0, off_plan_rec = 0, off_stage_flag = 0;
  size_t off_stage_rows = 0, off_partial = 0;
  int32_t plan_words = 0;
  // The device path (fwd_on_device) shares the plan and staging regions; its
  // forwarder writes the partial sums it sends into off_partial [source]
  // [record] before they cross. A source stages its plans there per node
  // (off_plan_out [n][4 + max_tokens * plan_words] int32: the count, then
  // the records), and its reduction reads the handle's send table and
  // weights as rewritten for forwarding: a token's rows on another node
  // become one row, the partial sum, weight 1 (off_fwd_send, off_fwd_weights).
  size_t off_plan_out = 0, off_fwd_send = 0, off_fwd_weights = 0;
  // Redispatch's forwarded records [n][max_tokens][row_rec_bytes]: int32
  // combine row per send column, then at row_rec_row_at the row (combine
  // dtype); counts and flags share the plan's words.
  size_t off_row_rec = 0, row_rec_bytes = 0, row_rec_row_at = 0;
  size_t sync_bytes = 0;  // [0, sync_bytes) is zeroed when the op is created
  size_t total = 0;
};

// Slots of the local words (uint64) at off_local.
enum LocalWord : int {
  kDispatchEpoch = 0,  // last finished dispatch
  kCombineEpoch = 1,   // last finished combine
  kDispatchTicket = 2, // dispatch: blocks that took their tokens (cuda)
  kDispatchDone = 3,
  kSendDone = 4,
  kReduceDone = 5,
  kErrorWord = 6,      // first device-side failure (cuda)
  kHandleBad = 7,      // combine: 1 when this call's handle failed its bounds check (cuda)
  kCombineTicket = 8,  // combine: roles taken so far (low half, wrapping; cuda)
  kMetaHelp = 9,       // dispatch: [kMetaHelpers] helpers' decisions (cuda, epoch-tagged)
  kSendNext = 16,      // combine: [2] senders' next unit, by call parity (cuda)
  kReduceNext = 18,    // combine: [2] reducers' next unit, by call parity (cuda)
  kSlotsDone = 20,     // token_slots dispatch: outputs written, 1 if aborted (cuda, epoch-tagged)
  kRemotePayload = 21, // where the host's put_signal of a bare flag to another node lands
  kLocalWords = 24
};
// Blocks that may help dispatch's last block copy the metadata (cuda).
constexpr int kMetaHelpers = 6;
static_assert(kMetaHelp + kMetaHelpers <= kSendNext, "local words");


// The fields of a dispatch's published outputs (Geometry::off_out_board).
enum OutField : int { kOutX = 0, kOutScales = 1, kOutIdx = 2, kOutW = 3, kOutMeta = 4, kOutFields = 5 };
constexpr int kOutTagShift = 44;  // addresses below 2^48, 16-byte aligned
constexpr uint64_t kOutTagMask = (uint64_t{1} << (64 - kOutTagShift)) - 1;
// Most PEs whose dispatch outputs peers store into directly.
constexpr int kMaxOutPeers = 16;

// Most warps that share one row in a call of few rows (cuda kernels).
constexpr int kMaxPieces = 8;

// A dispatch's summary for combine (handle storage), int32
// [summary_words]: per source PE s, [4s] = first row of this PE's rows in
// s's combine buffer, [4s+1] = rows from s, [4s+2] = first receive row from
// s (token-major), [4s+3] = first row of this PE's combine buffer for its
// rows to s; then [4n + l] = rows of local expert l; [4n + L] = total.
// token_slots: rows from s are its slots (rows [s * M, (s + 1) * M), M =
// max_tokens), [4n + L] is their extent n * M, and [4n + L + 4 + s * W + i]
// (W = slot_words) holds bits 32 i .. 32 i + 31 of "token t of s is here".
inline int64_t summary_words(int n_pes, int local_experts, int slot_words) {
  return 4 * static_cast<int64_t>(n_pes) + local_experts + 4 +
         static_cast<int64_t>(n_pes) * slot_words;
}
// Where the summary's per-expert row counts start ([4n + l] above).
constexpr int64_t summary_counts_at(int n_pes) { return 4 * static_cast<int64_t>(n_pes); }
constexpr int64_t slot_bits_at(int n_pes, int local_experts) {
  return 4 * static_cast<int64_t>(n_pes) + local_experts + 4;
}

// The PE that holds column j (combine row crow) of one of a PE's tokens:
// token-major, PE j; expert-major, the PE whose range of the combine rows
// holds it (they are in destination order: summary[4q + 3] is its first).
inline int holder_of(bool token_major, int n_pes, const int32_t* summary, int j, int32_t crow) {
  if (token_major) return j;
  int q = 0;
  for (int p = 0; p < n_pes; ++p)
    if (summary[4 * p + 3] <= crow) q = p;
  return q;
}

// Fields of one received row's metadata (int32 [recv_rows][4]).
enum MetaField : int { kMetaSrcPe = 0, kMetaToken = 1, kMetaSlot = 2, kMetaCombineRow = 3 };
constexpr int kMetaWords = 4;

// Layout of a routing-count row: [status, detail, dest_count[n], expert_count[E]],
// then (token_slots) slot bits [n][slot_words]: which tokens go to each PE.
constexpr int kCountStatus = 0, kCountDetail = 1, kCountDest = 2;
constexpr int count_bits_at(int n_pes, int num_experts) { return kCountDest + n_pes + num_experts; }

// One dispatch's handle storage (what combine needs: see DispatchArgs) and
// its two small outputs, laid out in one int32 allocation so that a call
// allocates once. Offsets in int32 words, each region 256-byte aligned.
struct HandleLayout {
  int64_t num_recv = 0;       // [1]
  int64_t expert_counts = 0;  // [local_experts]
  int64_t send_rows = 0;      // [max_tokens][send_cols]
  int64_t summary = 0;        // [summary_words]
  int64_t recv_meta = -1;     // expert-major: [recv_rows][kMetaWords]; else -1
  int64_t weights = -1;       // expert-major: float32 [max_tokens][topk]; else -1
  int64_t words = 0;          // total
};

// Whether the EP ops of this process run the device kernels' host emulation
// on the cpu backend (SYMHEAP_EP_EMULATE_DEVICE, read when an op is made).
bool emulate_device();

void validate_config(const Config& c);
Geometry make_geometry(const Config& c, int n_pes);
HandleLayout handle_layout(const Config& c, const Geometry& g);
std::string describe_status(int32_t status, int64_t detail, int pe, const Config& c);

}  // namespace symheap::ep
