# FindLiburing
# ------------
# Finds liburing (https://github.com/axboe/liburing), which ships no CMake package.
#
# Imported target:  Liburing::Liburing
# Result variables: Liburing_FOUND, Liburing_VERSION, Liburing_INCLUDE_DIRS, Liburing_LIBRARIES
# Hints:            Liburing_ROOT (CMake >= 3.12 honours <Pkg>_ROOT)

find_package(PkgConfig QUIET)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(PC_LIBURING QUIET liburing)
endif()

find_path(Liburing_INCLUDE_DIR NAMES liburing.h HINTS ${PC_LIBURING_INCLUDE_DIRS})
find_library(Liburing_LIBRARY NAMES uring HINTS ${PC_LIBURING_LIBRARY_DIRS})

if(PC_LIBURING_VERSION)
  set(Liburing_VERSION "${PC_LIBURING_VERSION}")
elseif(Liburing_INCLUDE_DIR AND EXISTS "${Liburing_INCLUDE_DIR}/liburing/io_uring_version.h")
  file(STRINGS "${Liburing_INCLUDE_DIR}/liburing/io_uring_version.h" _lu_ver
       REGEX "#define IO_URING_VERSION_(MAJOR|MINOR)")
  string(REGEX REPLACE ".*MAJOR ([0-9]+).*" "\\1" _lu_major "${_lu_ver}")
  string(REGEX REPLACE ".*MINOR ([0-9]+).*" "\\1" _lu_minor "${_lu_ver}")
  set(Liburing_VERSION "${_lu_major}.${_lu_minor}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Liburing
  REQUIRED_VARS Liburing_LIBRARY Liburing_INCLUDE_DIR
  VERSION_VAR Liburing_VERSION)

if(Liburing_FOUND)
  set(Liburing_INCLUDE_DIRS "${Liburing_INCLUDE_DIR}")
  set(Liburing_LIBRARIES "${Liburing_LIBRARY}")
  if(NOT TARGET Liburing::Liburing)
    add_library(Liburing::Liburing UNKNOWN IMPORTED)
    set_target_properties(Liburing::Liburing PROPERTIES
      IMPORTED_LOCATION "${Liburing_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${Liburing_INCLUDE_DIR}")
  endif()
endif()
mark_as_advanced(Liburing_INCLUDE_DIR Liburing_LIBRARY)
