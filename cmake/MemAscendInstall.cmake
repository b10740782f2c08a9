# Installs the library, public headers, the exported target set (namespace
# memascend::), the package config + version files with the Find modules they need,
# and a pkg-config file. Both the CMake package and the pkg-config file find their files
# relative to where they are installed: a prefix may be chosen at install time
# (cmake --install --prefix) or moved.
include(CMakePackageConfigHelpers)
set(MEMASCEND_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/MemAscend")
get_target_property(_memascend_type memascend TYPE)

# Note [cudart in the package]: a CUDA build links the CUDA runtime statically
# (CUDA::cudart_static), so a static libmemascend needs libcudart_static.a wherever it is
# linked, also by a consumer that uses no CUDA and has no toolkit. The package installs its
# own copy (a redistributable of the CUDA toolkit) under <libdir>/memascend/, and
# MemAscendConfig.cmake makes it the imported target memascend::cudart_static: a consumer
# does not find_package(CUDAToolkit). A shared libmemascend holds cudart itself.
set(MEMASCEND_CUDART_DIR "${CMAKE_INSTALL_LIBDIR}/memascend")
if(NOT MEMASCEND_PACKAGE_CUDART)  # set by src/CMakeLists.txt
  set(MEMASCEND_PACKAGE_CUDART OFF)
endif()
if(MEMASCEND_PACKAGE_CUDART)
  file(REAL_PATH "${CUDA_cudart_static_LIBRARY}" _memascend_cudart)
  install(FILES "${_memascend_cudart}" DESTINATION "${MEMASCEND_CUDART_DIR}"
          RENAME libcudart_static.a)
endif()

install(TARGETS memascend EXPORT MemAscendTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/memascend DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h")
install(FILES "${PROJECT_BINARY_DIR}/include/memascend/version.h"
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/memascend)

install(EXPORT MemAscendTargets NAMESPACE memascend:: DESTINATION ${MEMASCEND_CMAKE_DIR})
configure_package_config_file(cmake/MemAscendConfig.cmake.in
  "${PROJECT_BINARY_DIR}/MemAscendConfig.cmake" INSTALL_DESTINATION ${MEMASCEND_CMAKE_DIR}
  PATH_VARS MEMASCEND_CUDART_DIR)
write_basic_package_version_file("${PROJECT_BINARY_DIR}/MemAscendConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion)
install(FILES
  "${PROJECT_BINARY_DIR}/MemAscendConfig.cmake"
  "${PROJECT_BINARY_DIR}/MemAscendConfigVersion.cmake"
  cmake/FindLiburing.cmake
  cmake/FindNuma.cmake
  DESTINATION ${MEMASCEND_CMAKE_DIR})

# pkg-config: prefix is the pkg-config file's own directory, up as many levels as
# CMAKE_INSTALL_LIBDIR/pkgconfig has (pkg-config sets ${pcfiledir}). An absolute libdir
# or includedir is written as it is (and then the prefix is the configured one).
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
  set(MEMASCEND_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
  set(MEMASCEND_PC_LIBDIR "${CMAKE_INSTALL_LIBDIR}")
else()
  file(RELATIVE_PATH _memascend_up "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
  string(REGEX REPLACE "/$" "" _memascend_up "${_memascend_up}")
  set(MEMASCEND_PC_PREFIX "\${pcfiledir}/${_memascend_up}")
  set(MEMASCEND_PC_LIBDIR "\${prefix}/${CMAKE_INSTALL_LIBDIR}")
endif()
if(IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  set(MEMASCEND_PC_INCLUDEDIR "${CMAKE_INSTALL_INCLUDEDIR}")
else()
  set(MEMASCEND_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
endif()
# What the library links besides absl::status(or), which its headers use. A static
# libmemascend needs all of it at a consumer's link (`pkg-config --libs` without --static
# gives only Requires and Libs); a shared one only its headers' dependencies.
set(_memascend_pc_deps "liburing numa fmt absl_flat_hash_map absl_strings absl_str_format \
absl_synchronization absl_time")
set(_memascend_pc_libs "-pthread")
if(MEMASCEND_PACKAGE_CUDART)  # Note [cudart in the package]
  set(_memascend_pc_libs "\${libdir}/memascend/libcudart_static.a -ldl -lrt -pthread")
endif()
if(_memascend_type STREQUAL "STATIC_LIBRARY")
  set(MEMASCEND_PC_REQUIRES "absl_status absl_statusor ${_memascend_pc_deps}")
  set(MEMASCEND_PC_REQUIRES_PRIVATE "")
  set(MEMASCEND_PC_LIBS "-L\${libdir} -lmemascend ${_memascend_pc_libs}")
  set(MEMASCEND_PC_LIBS_PRIVATE "")
else()
  set(MEMASCEND_PC_REQUIRES "absl_status absl_statusor")
  set(MEMASCEND_PC_REQUIRES_PRIVATE "${_memascend_pc_deps}")
  set(MEMASCEND_PC_LIBS "-L\${libdir} -lmemascend")
  set(MEMASCEND_PC_LIBS_PRIVATE "${_memascend_pc_libs}")
endif()
configure_file(cmake/memascend.pc.in "${PROJECT_BINARY_DIR}/memascend.pc" @ONLY)
install(FILES "${PROJECT_BINARY_DIR}/memascend.pc" DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
