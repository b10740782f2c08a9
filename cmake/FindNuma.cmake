# FindNuma
# --------
# Finds libnuma (https://github.com/numactl/numactl), which ships no CMake package.
#
# Imported target:  Numa::Numa
# Result variables: Numa_FOUND, Numa_VERSION, Numa_INCLUDE_DIRS, Numa_LIBRARIES
# Hints:            Numa_ROOT

find_package(PkgConfig QUIET)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(PC_NUMA QUIET numa)
endif()

find_path(Numa_INCLUDE_DIR NAMES numa.h HINTS ${PC_NUMA_INCLUDE_DIRS})
find_library(Numa_LIBRARY NAMES numa HINTS ${PC_NUMA_LIBRARY_DIRS})
if(PC_NUMA_VERSION)
  set(Numa_VERSION "${PC_NUMA_VERSION}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Numa
  REQUIRED_VARS Numa_LIBRARY Numa_INCLUDE_DIR
  VERSION_VAR Numa_VERSION)

if(Numa_FOUND)
  set(Numa_INCLUDE_DIRS "${Numa_INCLUDE_DIR}")
  set(Numa_LIBRARIES "${Numa_LIBRARY}")
  if(NOT TARGET Numa::Numa)
    add_library(Numa::Numa UNKNOWN IMPORTED)
    set_target_properties(Numa::Numa PROPERTIES
      IMPORTED_LOCATION "${Numa_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${Numa_INCLUDE_DIR}")
  endif()
endif()
mark_as_advanced(Numa_INCLUDE_DIR Numa_LIBRARY)
