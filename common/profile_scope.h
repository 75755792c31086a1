#ifndef HIMOE_COMMON_PROFILE_SCOPE_H_
#define HIMOE_COMMON_PROFILE_SCOPE_H_

#include <ATen/record_function.h>

// Marks a region of a training step for the step profiler
// (trainer/step_profiler.h), as a LibTorch USER_SCOPE record named
// "himoe::<category>". Costs a flag check when no profiler is on. One per
// C++ block (the macro declares a variable).
#define HIMOE_PROFILE_SCOPE(category) RECORD_USER_SCOPE("himoe::" category)

#endif  // HIMOE_COMMON_PROFILE_SCOPE_H_
