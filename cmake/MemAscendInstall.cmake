# Installs the library, public headers, the exported target set (namespace
# memascend::), the package config + version files with the Find modules they need,
# and a pkg-config file.
include(CMakePackageConfigHelpers)
set(MEMASCEND_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/MemAscend")

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
  "${PROJECT_BINARY_DIR}/MemAscendConfig.cmake" INSTALL_DESTINATION ${MEMASCEND_CMAKE_DIR})
write_basic_package_version_file("${PROJECT_BINARY_DIR}/MemAscendConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion)
install(FILES
  "${PROJECT_BINARY_DIR}/MemAscendConfig.cmake"
  "${PROJECT_BINARY_DIR}/MemAscendConfigVersion.cmake"
  cmake/FindLiburing.cmake
  cmake/FindNuma.cmake
  DESTINATION ${MEMASCEND_CMAKE_DIR})

set(MEMASCEND_PC_PRIVATE_LIBS "")
if(MEMASCEND_HAVE_CUDA)
  set(MEMASCEND_PC_PRIVATE_LIBS "-L${CUDAToolkit_LIBRARY_DIR} -lcudart_static -ldl -lrt")
endif()
configure_file(cmake/memascend.pc.in "${PROJECT_BINARY_DIR}/memascend.pc" @ONLY)
install(FILES "${PROJECT_BINARY_DIR}/memascend.pc" DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
