// Pieces shared by the cpu and CUDA paths, so both compute the same function:
// the dropout generator, the visibility rule and scalar conversions.
#pragma once
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define SH_HD __host__ __device__ __forceinline__
#else
#define SH_HD inline
#endif

namespace symheap::attention::detail {

// Philox4x32 with 10 rounds (Salmon et al., SC'11): a counter-based generator,
// so any element's bits are computed directly, in any order, on any device.
struct U32x4 {
  uint32_t x, y, z, w;
};

SH_HD void mul_hi_lo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
#ifdef __CUDA_ARCH__
  *hi = __umulhi(a, b);
  *lo = a * b;
#else
  uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
#endif
}

SH_HD U32x4 philox4x32_10(U32x4 ctr, uint32_t k0, uint32_t k1) {
  const uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  const uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mul_hi_lo(kMul0, ctr.x, &hi0, &lo0);
    mul_hi_lo(kMul1, ctr.z, &hi1, &lo1);
    ctr = U32x4{hi1 ^ ctr.y ^ k0, lo1, hi0 ^ ctr.w ^ k1, lo0};
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return ctr;
}

// Eight consecutive keys (j = 8*octet .. 8*octet+7) of one (bh, i) row share
// a Philox call; element j takes 16 bits of it, half j % 2 of word (j % 8) / 2
// (dropout_half). Sixteen bits a score, not 32: a call serves twice the keys,
// and the keep test's resolution, 2^-16, is far below bf16's.
SH_HD U32x4 dropout_octet(uint64_t seed, uint64_t offset, uint32_t bh, uint32_t i, uint32_t octet) {
  return philox4x32_10(U32x4{octet, i, bh, static_cast<uint32_t>(offset)},
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

SH_HD uint32_t pick(const U32x4& r, uint32_t lane) {
  return lane == 0 ? r.x : lane == 1 ? r.y : lane == 2 ? r.z : r.w;
}

// Key j's 16 bits (0 .. 65535) of its octet's Philox call r.
SH_HD uint32_t dropout_half(const U32x4& r, uint32_t j) {
  return (pick(r, (j >> 1) & 3u) >> (16u * (j & 1u))) & 0xffffu;
}

// Visible key range [lo, hi) of query row i from the window (causal included).
struct KeyRange {
  int lo, hi;
};
SH_HD KeyRange visible_keys(int i, int sq, int sk, int left, int right) {
  long long diag = static_cast<long long>(i) + sk - sq;
  long long lo = left < 0 ? 0 : diag - left;
  long long hi = right < 0 ? sk : diag + right + 1;
  if (lo < 0) lo = 0;
  if (hi > sk) hi = sk;
  if (hi < lo) hi = lo;
  return KeyRange{static_cast<int>(lo), static_cast<int>(hi)};
}

// ---- scalar conversions (round to nearest even), for the cpu path
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3FFu) << 13;
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t exp = (x >> 23) & 0xFFu;
  uint32_t man = x & 0x7FFFFFu;
  if (exp == 0xFF) return static_cast<uint16_t>(sign | 0x7C00u | (man ? 0x200u : 0u));
  int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 0x1F) return static_cast<uint16_t>(sign | 0x7C00u);  // overflow: inf
  if (e <= 0) {                                                  // subnormal or zero
    if (e < -10) return static_cast<uint16_t>(sign);
    man |= 0x800000u;
    int shift = 14 - e;
    uint32_t half = man >> shift;
    uint32_t rest = man & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = static_cast<uint32_t>(e) << 10 | man >> 13;
  uint32_t rest = man & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // may carry into exp: fine
  return static_cast<uint16_t>(sign | half);
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7F800000u) == 0x7F800000u && (x & 0x7FFFFFu))
    return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

}  // namespace symheap::attention::detail
