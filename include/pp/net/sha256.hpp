// SHA-256 of a byte span (OpenSSL's EVP): model fingerprints and digests that compare activations and
// logits across processes. to_hex (core/hex.hpp) prints a digest.
#pragma once

#include <openssl/evp.h>

#include <array>
#include <cstdint>
#include <span>

#include "pp/core/error.hpp"
#include "pp/core/hex.hpp"

namespace pp {

using Sha256Digest = std::array<uint8_t, 32>;

inline Sha256Digest sha256(std::span<const uint8_t> data) {
  Sha256Digest out;
  unsigned len = 0;
  if (!EVP_Digest(data.data(), data.size(), out.data(), &len, EVP_sha256(), nullptr) || len != out.size())
    throw Error("SHA-256 failed (OpenSSL)");
  return out;
}

}  // namespace pp
