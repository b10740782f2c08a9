# Compiler settings shared by every MemAscend target. Targets opt in by linking the
# internal interface target memascend_build_flags (never exported).
set(CMAKE_CXX_STANDARD 20)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
set(CMAKE_CXX_EXTENSIONS OFF)
set(CMAKE_POSITION_INDEPENDENT_CODE ON)

add_library(memascend_build_flags INTERFACE)
target_compile_options(memascend_build_flags INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
    -Wold-style-cast -Wcast-align -Wunused -Woverloaded-virtual -Wnull-dereference
    -Wdouble-promotion -Wformat=2 -Wimplicit-fallthrough>)
if(MEMASCEND_WERROR)
  target_compile_options(memascend_build_flags INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
endif()

if(MEMASCEND_SANITIZE)
  # Applied globally so that tests, tools and the library agree on the runtime.
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer
                      -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
  add_compile_definitions(MEMASCEND_ASAN=1)
endif()
