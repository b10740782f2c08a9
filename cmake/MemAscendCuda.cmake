# Resolves MEMASCEND_WITH_CUDA (ON/OFF/AUTO) into MEMASCEND_HAVE_CUDA.
# AUTO enables CUDA when nvcc is found (on PATH, via CUDACXX, or in /usr/local/cuda).
set(MEMASCEND_HAVE_CUDA OFF)
string(TOUPPER "${MEMASCEND_WITH_CUDA}" _memascend_cuda_mode)
if(NOT _memascend_cuda_mode MATCHES "^(ON|OFF|AUTO)$")
  message(FATAL_ERROR "MEMASCEND_WITH_CUDA must be ON, OFF or AUTO (got '${MEMASCEND_WITH_CUDA}')")
endif()

if(NOT _memascend_cuda_mode STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc CACHE FILEPATH "CUDA compiler")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # Ampere (A100) and Hopper (H100/H200): the GPUs offloaded fine-tuning runs on.
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    # CMake 3.25 knows no C++20 flag for nvcc 13; device code is C++17.
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(MEMASCEND_HAVE_CUDA ON)
  elseif(_memascend_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "MEMASCEND_WITH_CUDA=ON but no CUDA compiler was found; "
                        "set CUDACXX or CMAKE_CUDA_COMPILER, or use AUTO/OFF")
  else()
    message(STATUS "MemAscend: nvcc not found, building without CUDA")
  endif()
endif()
