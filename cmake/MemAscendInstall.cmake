# Installs the library, public headers, the exported target set (namespace
# memascend::), the package config + version files with the Find modules they need,
# and a pkg-config file.
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

set(MEMASCEND_PC_PRIVATE_LIBS "")
if(MEMASCEND_PACKAGE_CUDART)  # Note [cudart in the package]
  set(MEMASCEND_PC_PRIVATE_LIBS "\${libdir}/memascend/libcudart_static.a -ldl -lrt")
endif()
configure_file(cmake/memascend.pc.in "${PROJECT_BINARY_DIR}/memascend.pc" @ONLY)
install(FILES "${PROJECT_BINARY_DIR}/memascend.pc" DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
