// Real mode's plug point: opens a pp::Stage-backed Backend for the resolved GGUF (not built yet).
#pragma once

#include "backend.hpp"
#include "startup.hpp"

#include <pp/io/ollama.hpp>

#include <memory>

namespace pp::worker {

// Maps the stage's tensors of `model` for cfg.stage of cfg.num_stages, with KV capacity
// cfg.ctx (default min(4096, the model's context length)). Throws StartupError (exit 2) when the
// model cannot be loaded.
//
// TODO(lead): replace the body with a RealBackend wrapping pp::Stage (include/pp/stage.hpp).
inline std::unique_ptr<Backend> open_real_backend(const WorkerConfig& cfg, const ResolvedModel& model) {
  (void)cfg;
  throw StartupError("real mode not built yet (model resolved to '" + model.path +
                     "'); run with --stub or PP_WORKER_STUB=1");
}

}  // namespace pp::worker
