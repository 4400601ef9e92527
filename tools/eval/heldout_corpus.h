#pragma once
// The shared corpus's held-out parts (../shared/data/corpus/DOMAIN.txt), split as
// tools/train_default_model.py splits them: what the evaluation programs read, never what the models were
// trained on.
#include <string>

namespace capserve::tools {

// The file's bytes; runtime::LoadError when it cannot be read.
std::string read_corpus_file(const std::string& path);

// The held-out part: from the line after the first '\n' at or after floor(size * (1 - fraction)).
std::string heldout_text(const std::string& data, double fraction);
// The training part: everything before the held-out part.
std::string training_text(const std::string& data, double fraction);

}  // namespace capserve::tools
