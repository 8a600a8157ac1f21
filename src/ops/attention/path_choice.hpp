// Which CUDA path an attention call takes: cuDNN's fused attention or the
// op's own kernels. One rule for every front end (torch, XLA FFI).
#pragma once
#include <optional>
#include <string>

namespace symheap::attention {

enum class Path { Auto, Cudnn, Own };

// The environment variable read when a call names no path.
inline constexpr const char* kPathEnv = "SYMHEAP_ATTN_BACKEND";

// "auto", "cudnn", "own".
const char* path_name(Path p);
// The names a caller may give, comma separated and quoted: "'auto', 'cudnn', 'own'".
std::string path_names();

// "" when the cuDNN path is built and usable, else why not.
std::string cudnn_unavailable_reason();

// The path of one call. `requested`: a path name, or nullopt for
// $SYMHEAP_ATTN_BACKEND (unset or empty: "auto"). cpu calls always take the
// cpu kernels (Own): the variable is ignored for them, and an explicit
// "cudnn" is InvalidArgument. A forced "cudnn" without a usable cuDNN path is
// Unsupported, naming why; an unknown name is InvalidArgument.
Path choose_path(const std::optional<std::string>& requested, bool on_cuda);

}  // namespace symheap::attention
