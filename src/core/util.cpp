#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <fstream>
#include <string>

#include "symheap/errors.hpp"
#include "symheap/runtime.hpp"

namespace symheap {

size_t parse_size(const std::string& text) {
  std::string t;
  for (char c : text)
    if (!std::isspace(static_cast<unsigned char>(c))) t += c;
  size_t i = 0;
  while (i < t.size() && std::isdigit(static_cast<unsigned char>(t[i]))) ++i;
  if (i == 0 || i > 18)
    throw InvalidArgument("cannot parse heap size '" + text +
                          "': use a byte count with an optional K, M, G or T suffix, e.g. 512M");
  unsigned long long value = std::stoull(t.substr(0, i));
  std::string unit = t.substr(i);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  unsigned shift = 0;
  if (unit == "" || unit == "B") shift = 0;
  else if (unit == "K" || unit == "KB" || unit == "KIB") shift = 10;
  else if (unit == "M" || unit == "MB" || unit == "MIB") shift = 20;
  else if (unit == "G" || unit == "GB" || unit == "GIB") shift = 30;
  else if (unit == "T" || unit == "TB" || unit == "TIB") shift = 40;
  else
    throw InvalidArgument("cannot parse heap size '" + text +
                          "': unknown unit '" + unit + "' (use K, M, G or T)");
  if (shift && (value >> (64 - shift)) != 0)
    throw InvalidArgument("heap size '" + text + "' is too large");
  return static_cast<size_t>(value << shift);
}

std::string format_size(size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4 && static_cast<size_t>(v) % 1024 == 0) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.0f %s", v, units[u]);
  if (u == 0 && bytes >= 1024) std::snprintf(buf, sizeof buf, "%zu B", bytes);
  return buf;
}

std::string this_node_id() {
  if (const char* forced = std::getenv("SYMHEAP_NODE_ID")) return forced;
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  std::string id = host;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (boot && std::getline(boot, boot_id)) id += "/" + boot_id;
  return id;
}

bool compare_holds(uint64_t lhs, Compare cmp, uint64_t rhs) {
  switch (cmp) {
    case Compare::Eq: return lhs == rhs;
    case Compare::Ne: return lhs != rhs;
    case Compare::Gt: return lhs > rhs;
    case Compare::Ge: return lhs >= rhs;
    case Compare::Lt: return lhs < rhs;
    case Compare::Le: return lhs <= rhs;
  }
  return false;
}

const char* compare_name(Compare cmp) {
  static const char* names[] = {"==", "!=", ">", ">=", "<", "<="};
  return names[static_cast<int>(cmp)];
}

const char* peer_kind_name(PeerKind kind) {
  static const char* names[] = {"self", "same_process", "same_node", "remote"};
  return names[static_cast<int>(kind)];
}

}  // namespace symheap
