#pragma once
// Argument checks of backend operations, which run on every layer: the message (a string, or a callable that
// builds one) is made only when the check fails, so a passing check allocates nothing.
#include <stdexcept>
#include <string>
#include <type_traits>

namespace capserve::kernels {

// std::invalid_argument "<backend>::<op>: <what>" unless ok.
template <class Message>
void require_argument(bool ok, const char* backend, const char* op, const Message& what) {
  if (ok) return;
  std::string message;
  if constexpr (std::is_invocable_v<Message>) {
    message = what();
  } else {
    message = what;
  }
  throw std::invalid_argument(std::string(backend) + "::" + op + ": " + message);
}

}  // namespace capserve::kernels
