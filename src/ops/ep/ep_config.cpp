#include "ops/ep/ep_config.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "ops/ep/ep_op.hpp"
#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"

namespace symheap::ep {

namespace {
size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
std::string str(int64_t v) { return std::to_string(v); }
// Whether the calling thread's PE has peers on another node (false before init).
bool spans_nodes() {
  try {
    auto s = Runtime::instance().current();
    for (const Peer& p : s->peers)
      if (p.info.node_id != s->peers[s->my_pe].info.node_id) return true;
  } catch (const std::exception&) {
  }
  return false;
}
// Whether an op of the calling thread's PE forwards inside nodes (ep_op.hpp).
bool layout_forwards() {
  try {
    return node_layout(*Runtime::instance().current()).forward;
  } catch (const std::exception&) {
  }
  return false;
}
}  // namespace

bool emulate_device() {
  const char* v = std::getenv("SYMHEAP_EP_EMULATE_DEVICE");
  return v && *v && std::strcmp(v, "0") != 0;
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::FP8_E4M3: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
    case DType::FP8_E4M3: return "float8_e4m3fn";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  if (name == "float32" || name == "fp32" || name == "float") return DType::F32;
  if (name == "float16" || name == "fp16" || name == "half") return DType::F16;
  if (name == "bfloat16" || name == "bf16") return DType::BF16;
  if (name == "float8_e4m3fn" || name == "fp8" || name == "fp8_e4m3" || name == "e4m3")
    return DType::FP8_E4M3;
  throw InvalidArgument("unsupported dtype '" + name +
                        "': use bfloat16, float16, float32 or float8_e4m3fn");
}

Kernel parse_kernel(const std::string& name) {
  if (name == "intranode") return Kernel::Intranode;
  if (name == "low_latency") return Kernel::LowLatency;
  if (name == "copy_engine") return Kernel::CopyEngine;
  throw InvalidArgument("unknown kernel '" + name +
                        "': use 'intranode', 'low_latency' or 'copy_engine'");
}

const char* kernel_name(Kernel k) {
  static const char* names[] = {"intranode", "low_latency", "copy_engine"};
  return names[static_cast<int>(k)];
}

Layout parse_layout(const std::string& name) {
  if (name == "token_major") return Layout::TokenMajor;
  if (name == "expert_major") return Layout::ExpertMajor;
  throw InvalidArgument("unknown layout '" + name +
                        "': use 'token_major', 'token_slots' or 'expert_major'");
}

const char* layout_name(Layout l) {
  return l == Layout::TokenMajor ? "token_major" : "expert_major";
}

void validate_config(const Config& c) {
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw InvalidArgument("EpConfig: " + msg);
  };
  need(c.hidden > 0, "hidden must be positive, got " + str(c.hidden));
  need(c.max_tokens > 0, "max_tokens_per_rank must be positive, got " + str(c.max_tokens));
  need(c.num_experts > 0, "num_experts must be positive, got " + str(c.num_experts));
  need(c.topk > 0 && c.topk <= c.num_experts && c.topk <= 64,
       "topk must be in [1, min(num_experts, 64)], got " + str(c.topk));
  size_t row = static_cast<size_t>(c.hidden) * dtype_size(c.dtype);
  need(row % 16 == 0, "hidden * itemsize must be a multiple of 16 bytes (rows move as 16-byte "
                      "vectors); hidden=" + str(c.hidden) + " of " + dtype_name(c.dtype) +
                      " is " + str(static_cast<int64_t>(row)) + " bytes");
  if (c.dtype == DType::FP8_E4M3)
    need(c.hidden % 8 == 0, "fp8 dispatch combines in bfloat16: hidden must be a multiple of 8");
  need(c.scale_dim >= 0, "scale_dim must be >= 0");
  if (c.scale_dim > 0) {
    need(c.hidden % c.scale_dim == 0, "scale_dim=" + str(c.scale_dim) +
                                          " must divide hidden=" + str(c.hidden));
    need(c.scale_dtype != DType::FP8_E4M3, "scale_dtype must be float32, float16 or bfloat16");
  }
  need(c.grid_blocks >= 1, "grid_blocks must be positive, got " + str(c.grid_blocks));
  need(c.max_recv_tokens >= 0, "max_recv_tokens must be positive");
  need(c.expert_capacity >= 0, "expert_capacity must be positive");
  if (c.token_slots) {
    need(c.layout == Layout::TokenMajor, "token_slots is a token-major layout");
    need(c.kernel != Kernel::CopyEngine,
         "layout='token_slots' runs on the SM kernels (intranode, low_latency); copy_engine "
         "moves packed rows: use layout='token_major'");
    need(c.max_recv_tokens == 0,
         "layout='token_slots' receives n_pes * max_tokens_per_rank slots; max_recv_tokens "
         "bounds the packed token_major layout only");
  }
  if (c.layout == Layout::ExpertMajor)
    need(c.max_recv_tokens == 0,
         "max_recv_tokens bounds token-major receives; for layout='expert_major' set "
         "expert_capacity (rows per local expert)");
  else
    need(c.expert_capacity == 0, "expert_capacity applies to layout='expert_major' only");
}

Geometry make_geometry(const Config& c, int n_pes) {
  validate_config(c);
  if (n_pes < 1) throw InvalidArgument("EpConfig: no PEs");
  if (c.num_experts % n_pes != 0)
    throw InvalidArgument("EpConfig: num_experts=" + str(c.num_experts) +
                          " must be a multiple of the number of PEs (" + str(n_pes) +
                          "): every PE hosts num_experts / n_pes experts");
  Geometry g;
  g.n_pes = n_pes;
  g.grid_blocks = c.grid_blocks;
  g.local_experts = c.num_experts / n_pes;
  g.scales_per_row = c.scale_dim > 0 ? c.hidden / c.scale_dim : 0;
  g.slot_words = c.token_slots ? (c.max_tokens + 31) / 32 : 0;
  g.count_words = static_cast<int32_t>(
      align_up(count_bits_at(n_pes, c.num_experts) + static_cast<size_t>(n_pes) * g.slot_words, 4));
  const int64_t worst = static_cast<int64_t>(n_pes) * c.max_tokens;
  if (c.token_slots) {
    g.recv_rows = worst;
    g.expert_cap = 0;
    g.combine_rows = worst;  // token t's row back from PE d: row d * max_tokens + t
    g.send_cols = n_pes;
    g.padded_output = true;
  } else if (c.layout == Layout::TokenMajor) {
    if (c.max_recv_tokens > worst)
      throw InvalidArgument("EpConfig: max_recv_tokens=" + str(c.max_recv_tokens) +
                            " exceeds n_pes * max_tokens_per_rank = " + str(worst) +
                            ", the most a PE can receive");
    g.recv_rows = c.max_recv_tokens > 0 ? c.max_recv_tokens : worst;
    g.expert_cap = 0;
    g.combine_rows = static_cast<int64_t>(c.max_tokens) * std::min(n_pes, c.topk);
    g.send_cols = n_pes;
    g.padded_output = c.kernel == Kernel::LowLatency ||
                      (c.kernel == Kernel::Intranode && c.max_recv_tokens > 0);
  } else {
    if (c.expert_capacity > worst)
      throw InvalidArgument("EpConfig: expert_capacity=" + str(c.expert_capacity) +
                            " exceeds n_pes * max_tokens_per_rank = " + str(worst) +
                            ", the most one expert can receive");
    g.expert_cap = c.expert_capacity > 0 ? c.expert_capacity : worst;
    g.recv_rows = g.expert_cap * g.local_experts;
    g.combine_rows = static_cast<int64_t>(c.max_tokens) * c.topk;
    g.send_cols = c.topk;
    g.padded_output = true;
  }
  // The kernels index (token, column, piece) units with 32-bit integers.
  if (static_cast<int64_t>(c.max_tokens) * g.send_cols * kMaxPieces > INT32_MAX)
    throw InvalidArgument("EpConfig: max_tokens_per_rank=" + str(c.max_tokens) + " with " +
                          str(g.send_cols) + " rows per token is too large (at most " +
                          str(INT32_MAX / (static_cast<int64_t>(g.send_cols) * kMaxPieces)) +
                          " tokens per rank)");
  g.combine_dtype = combine_dtype_of(c.dtype);
  g.row_bytes = static_cast<size_t>(c.hidden) * dtype_size(c.dtype);
  g.scale_row_bytes = static_cast<size_t>(g.scales_per_row) * dtype_size(c.scale_dtype);
  g.combine_row_bytes = static_cast<size_t>(c.hidden) * dtype_size(g.combine_dtype);
  // A second combine set costs at most kTwoCombineSetsBytes of heap per PE.
  constexpr size_t kTwoCombineSetsBytes = size_t{128} << 20;
  const size_t combine_bytes = static_cast<size_t>(g.combine_rows) * g.combine_row_bytes;
  g.combine_sets = c.kernel != Kernel::CopyEngine && combine_bytes <= kTwoCombineSetsBytes ? 2 : 1;

  const size_t n = static_cast<size_t>(n_pes);
  const bool token_major = c.layout == Layout::TokenMajor;
  const size_t A = 256;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    size_t off = at;
    at = align_up(at + bytes, A);
    return off;
  };
  g.off_count_flag = take(n * 8);
  g.off_data_flag = take(n * 8);
  g.off_combine_flag = take(n * 8);
  g.off_freed_flag = take(n * 8);
  g.off_entered = take(n * 8);
  g.off_local = take(kLocalWords * 8);
  g.off_count_rows = take(2 * n * g.count_words * 8);  // device: two sets, by parity
  g.off_send_prefix = take(std::max(n, static_cast<size_t>(c.num_experts)) * 8);
  g.off_combine_status = take(static_cast<size_t>(g.combine_sets) * n * 4);
  g.off_row_flags = take(c.kernel == Kernel::CopyEngine
                             ? 0
                             : static_cast<size_t>(g.combine_rows) * kMaxPieces * 8);
  g.off_route_totals = take(2 * (n + c.num_experts + 1) * 4);
  g.off_dest_sums = take(token_major ? 2 * n * (n + 1) * 8 : 0);
  g.off_out_board = take(n <= kMaxOutPeers ? n * kOutFields * 8 : 0);
  // Only jobs across nodes need the forwarding regions: the cpu
  // implementation's records, or the device path's (copy_engine, only when
  // the op forwards: they hold n * max_tokens rows).
  const bool device_path = Runtime::instance().backend_name() != "cpu" || emulate_device();
  const bool forwards = !device_path && spans_nodes();
  g.fwd_on_device = device_path && c.kernel == Kernel::CopyEngine && layout_forwards();
  g.off_fwd_flag = take(forwards || g.fwd_on_device ? n * 8 : 0);
  g.off_fwd_count = take(forwards ? n * 4 : 0);
  const bool sums = forwards || g.fwd_on_device;  // combine sums inside nodes
  g.off_plan_flag = take(sums ? n * 8 : 0);
  g.off_plan_count = take(sums ? n * 4 : 0);
  g.off_stage_flag = take(sums ? n * 8 : 0);
  // Each dispatch block's counts and done word carry the call's epoch, which
  // restarts at 1 in every op: zeroed with the flags, so that a new op on the
  // heap range of a closed one never reads that op's words as its own.
  const size_t route_cols = token_major ? n : static_cast<size_t>(c.num_experts);
  g.off_route_counts = take(static_cast<size_t>(g.grid_blocks) * route_cols * 8);
  g.off_route_done = take(static_cast<size_t>(g.grid_blocks) * 8);
  g.sync_bytes = at;
  if (forwards) {
    g.fwd_header_words = 1 + 2 * g.send_cols + 2 * c.topk;
    g.fwd_x_at = align_up(static_cast<size_t>(g.fwd_header_words) * 4, 16);
    g.fwd_scales_at = g.fwd_x_at + align_up(g.row_bytes, 16);
    g.fwd_rec_bytes = g.fwd_scales_at + align_up(g.scale_row_bytes, 16);
  }
  g.off_fwd_rec = take(n * static_cast<size_t>(c.max_tokens) * g.fwd_rec_bytes);
  g.plan_words = sums ? 1 + 2 * g.send_cols : 0;
  g.off_plan_rec = take(n * static_cast<size_t>(c.max_tokens) * g.plan_words * 4);
  g.off_stage_rows = take(sums ? n * combine_bytes : 0);
  g.off_partial = take(sums ? n * static_cast<size_t>(c.max_tokens) * g.combine_row_bytes : 0);
  {  // the device path's combine: plans to send, and the reduction's own handle view
    const bool f = g.fwd_on_device;
    g.off_plan_out = take(f ? n * (4 + static_cast<size_t>(c.max_tokens) * g.plan_words) * 4 : 0);
    g.off_fwd_send = take(f ? static_cast<size_t>(c.max_tokens) * g.send_cols * 4 : 0);
    g.off_fwd_weights = take(f && !token_major ? static_cast<size_t>(c.max_tokens) * c.topk * 4 : 0);
  }
  if (forwards) {
    g.row_rec_row_at = align_up(static_cast<size_t>(g.send_cols) * 4, 16);
    g.row_rec_bytes = g.row_rec_row_at + align_up(g.combine_row_bytes, 16);
  }
  g.off_row_rec = take(n * static_cast<size_t>(c.max_tokens) * g.row_rec_bytes);
  {
    const bool f = g.fwd_on_device;
    const size_t by_token = n * static_cast<size_t>(c.max_tokens);
    const size_t by_row = n * static_cast<size_t>(g.combine_rows);
    g.off_fwd_x = take(f ? by_token * g.row_bytes : 0);
    g.off_fwd_scales = take(f ? by_token * g.scale_row_bytes : 0);
    g.off_fwd_idx = take(f && token_major ? by_row * c.topk * 4 : 0);
    g.off_fwd_w = take(f ? by_row * (token_major ? c.topk : 1) * 4 : 0);
    g.off_fwd_meta = take(f ? by_row * kMetaWords * 4 : 0);
  }
  g.off_scratch_pos = take(static_cast<size_t>(c.max_tokens) * g.send_cols * 4);
  const size_t rows = static_cast<size_t>(g.recv_rows);
  g.off_recv_x = take(rows * g.row_bytes);
  g.off_recv_scales = take(rows * g.scale_row_bytes);
  g.off_recv_idx = take(token_major ? rows * c.topk * 4 : 0);
  g.off_recv_w = take(rows * (token_major ? c.topk : 1) * 4);
  g.off_recv_meta = take(rows * kMetaWords * 4);
  g.off_combine_buf = take(static_cast<size_t>(g.combine_sets) * combine_bytes);
  if (c.kernel == Kernel::CopyEngine) {
    // Rows in send order (by destination, then by combine row), moved per peer.
    const size_t send = static_cast<size_t>(g.combine_rows);
    g.off_stage_x = take(send * g.row_bytes);
    g.off_stage_scales = take(send * g.scale_row_bytes);
    g.off_stage_idx = take(token_major ? send * c.topk * 4 : 0);
    g.off_stage_w = take(send * (token_major ? c.topk : 1) * 4);
    g.off_stage_meta = take(send * kMetaWords * 4);
    g.off_stage_combine = take(token_major ? 0 : rows * g.combine_row_bytes);
  }
  g.total = at;
  return g;
}

HandleLayout handle_layout(const Config& c, const Geometry& g) {
  HandleLayout h;
  int64_t at = 0;
  auto take = [&](int64_t words) {
    int64_t off = at;
    at = static_cast<int64_t>(align_up(static_cast<size_t>(at + words), 64));
    return off;
  };
  h.num_recv = take(1);
  h.expert_counts = take(g.local_experts);
  h.send_rows = take(static_cast<int64_t>(c.max_tokens) * g.send_cols);
  h.summary = take(summary_words(g.n_pes, g.local_experts, g.slot_words));
  if (c.layout == Layout::ExpertMajor) {
    h.recv_meta = take(g.recv_rows * kMetaWords);
    h.weights = take(static_cast<int64_t>(c.max_tokens) * c.topk);
  }
  h.words = at;
  return h;
}

std::string describe_status(int32_t status, int64_t detail, int pe, const Config& c) {
  std::string who = "PE " + str(pe);
  switch (status) {
    case kTooManyTokens:
      return who + " passed " + str(detail) + " tokens, more than max_tokens_per_rank=" +
             str(c.max_tokens);
    case kExpertOutOfRange: {
      // (the id travels between PEs in 32 bits, clamped: an end means "at least that far")
      const std::string id = detail >= INT32_MAX   ? "an expert id >= " + str(INT32_MAX)
                             : detail <= INT32_MIN ? "an expert id <= " + str(INT32_MIN)
                                                   : "expert id " + str(detail);
      return who + " passed " + id + " in topk_idx, outside [0, " + str(c.num_experts) +
             ") (use -1 to drop a slot)";
    }
    case kBadArgument:
      return who + " passed an invalid argument (its own exception says which)";
    case kPeerTimeout:
      return who + " timed out waiting for PE " + str(detail);
    case kBadHandle:
      return who + " passed a combine handle whose rows lie outside this op's buffers (was it "
                   "modified?)";
    case kRecvOverflow:
      return who + " would overflow its receive buffer";
    default:
      return who + " reported status " + str(status);
  }
}

}  // namespace symheap::ep
