#pragma once
// Model loading fails with LoadError; its message names the file, key or tensor at fault so a person can act
// on it. Loading happens before any request exists, so these exceptions are caught at the program boundary.
#include <stdexcept>

namespace capserve::runtime {

class LoadError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace capserve::runtime
