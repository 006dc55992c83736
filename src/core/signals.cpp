#include "loom/core.h"

namespace loom {

ScopedTerminationHandler::ScopedTerminationHandler(void (*handler)(int), int flags) {
  struct sigaction action {};
  action.sa_handler = handler;
  sigemptyset(&action.sa_mask);
  action.sa_flags = flags;
  sigaction(SIGTERM, &action, &previous_term_);
  sigaction(SIGINT, &action, &previous_int_);
}

ScopedTerminationHandler::~ScopedTerminationHandler() {
  sigaction(SIGTERM, &previous_term_, nullptr);
  sigaction(SIGINT, &previous_int_, nullptr);
}

}  // namespace loom
