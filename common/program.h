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

// The start of every himoe binary's main(): blocks the stop signals before
// any thread starts (BlockStopSignals(watch_children)), parses the command
// line, then installs the crash handler (PrintStackOnCrash).
void InitProgram(int argc, char** argv, absl::string_view usage, bool watch_children = false);

}  // namespace himoe

#endif  // HIMOE_COMMON_PROGRAM_H_
