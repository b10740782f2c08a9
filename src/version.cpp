#include <memascend/version.h>

namespace memascend {

std::string_view VersionString() noexcept { return MEMASCEND_VERSION_STRING; }

bool BuiltWithCuda() noexcept { return MEMASCEND_HAVE_CUDA != 0; }

}  // namespace memascend
