#include <openssl/evp.h>

#include "io/hex.h"
#include "loom/io.h"

namespace loom {

namespace {

// OpenSSL reports failures through its error queue; these calls fail only on
// allocation failure or a broken build, so they are invariants.
void check_openssl(int ok, const char* call) { LOOM_CHECK(ok == 1, "OpenSSL ", call, " failed"); }

}  // namespace

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  LOOM_CHECK(ctx_ != nullptr, "OpenSSL EVP_MD_CTX_new failed");
  check_openssl(EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr), "EVP_DigestInit_ex");
}

Sha256::~Sha256() { EVP_MD_CTX_free(ctx_); }

void Sha256::update(const void* data, size_t bytes) {
  LOOM_CHECK(!finished_, "Sha256::update after finish");
  check_openssl(EVP_DigestUpdate(ctx_, data, bytes), "EVP_DigestUpdate");
}

std::array<uint8_t, 32> Sha256::finish() {
  LOOM_CHECK(!finished_, "Sha256::finish called twice");
  finished_ = true;
  std::array<uint8_t, 32> digest{};
  unsigned int length = 0;
  check_openssl(EVP_DigestFinal_ex(ctx_, digest.data(), &length), "EVP_DigestFinal_ex");
  LOOM_CHECK(length == digest.size(), "SHA-256 digest of ", length, " bytes");
  return digest;
}

std::string Sha256::hex_digest() {
  const std::array<uint8_t, 32> digest = finish();
  return io_detail::lower_hex(digest.data(), digest.size());
}

std::string sha256_hex(std::string_view bytes) {
  Sha256 h;
  h.update(bytes);
  return h.hex_digest();
}

}  // namespace loom
