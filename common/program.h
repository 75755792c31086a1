#ifndef HIMOE_COMMON_PROGRAM_H_
#define HIMOE_COMMON_PROGRAM_H_

#include <vector>

#include "absl/strings/string_view.h"

namespace himoe {

// Parses the command line of a himoe binary. `usage` heads --help, which
// lists the flags defined in the program's *_main.cc (and --helpfull every
// flag). Exits with status 2 and a message on a positional argument. Also
// turns off abseil's mutex deadlock detection (see program.cc).
void ParseCommandLine(int argc, char** argv, absl::string_view usage);

}  // namespace himoe

#endif  // HIMOE_COMMON_PROGRAM_H_
