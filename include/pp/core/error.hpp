// Typed exceptions thrown at pp's boundaries (files, requests, frames); hot paths only assert.
#pragma once

#include <stdexcept>
#include <string>

namespace pp {

// Base of every error pp throws on purpose: the message names what was wrong and why.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A GGUF file (or byte span) that is malformed or exceeds a bound.
class GgufError : public Error {
 public:
  explicit GgufError(const std::string& what) : Error("gguf: " + what) {}
};

// A well-formed GGUF whose contents do not describe a model pp can run.
class ModelError : public Error {
 public:
  explicit ModelError(const std::string& what) : Error("model: " + what) {}
};

// A request that is invalid for the current state (bad position, token id, shape, role).
class RequestError : public Error {
 public:
  using Error::Error;
};

// Tokenizer metadata or input that cannot be handled.
class TokenizerError : public Error {
 public:
  explicit TokenizerError(const std::string& what) : Error("tokenizer: " + what) {}
};

// A PCPL frame (TCP pipeline protocol) that is malformed or exceeds a bound.
class FrameError : public Error {
 public:
  explicit FrameError(const std::string& what) : Error("frame: " + what) {}
};

// A socket operation that failed; the message names the peer (host:port) and what happened.
class NetError : public Error {
 public:
  enum class Kind { closed, timeout, reset, refused, other };
  NetError(Kind kind, const std::string& what) : Error(what), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

}  // namespace pp
