// Host conversions between float and the 16-bit float formats (round to
// nearest even), for the cpu implementation's fp32 accumulation.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ops/ep/ep_config.hpp"

namespace symheap::ep {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float fp16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t float_to_fp16(float f) {
  uint32_t x = float_to_bits(f);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00 : 0x7c00);
  if (x >= 0x477ff000u) return sign | 0x7c00;  // rounds to infinity
  if (x < 0x38800000u) {                        // subnormal half (or zero)
    float scaled = bits_to_float(x) * 16777216.0f;  // exact: times 2^24
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  uint32_t mant = x & 0x7fffffu;
  uint32_t h = ((((x >> 23) - 127u + 15u)) << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}

inline float load_as_float(const void* base, size_t i, DType t) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(base)[i];
    case DType::F16: return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::BF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return NAN;
  }
}

inline void store_from_float(void* base, size_t i, DType t, float v) {
  switch (t) {
    case DType::F32: static_cast<float*>(base)[i] = v; break;
    case DType::F16: static_cast<uint16_t*>(base)[i] = float_to_fp16(v); break;
    case DType::BF16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); break;
    default: break;
  }
}

}  // namespace symheap::ep
