# Decides whether the CUDA parts are built (OOM_ENABLE_CUDA = AUTO/ON/OFF) and sets them up.
#   OOM_HAS_CUDA           ON when the CUDA language is enabled
#   CMAKE_CUDA_ARCHITECTURES defaults to 90 (H100/H200); 80 and 89 build too.
include(CheckLanguage)

set(OOM_HAS_CUDA OFF)
string(TOUPPER "${OOM_ENABLE_CUDA}" _oom_cuda_mode)
if(NOT _oom_cuda_mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "OOM_ENABLE_CUDA must be AUTO, ON or OFF, not '${OOM_ENABLE_CUDA}'")
endif()

if(NOT _oom_cuda_mode STREQUAL "OFF")
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
    set(CMAKE_CUDA_ARCHITECTURES 90 CACHE STRING "CUDA architectures to build for")
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    set(OOM_HAS_CUDA ON)
  elseif(_oom_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "OOM_ENABLE_CUDA=ON but no CUDA compiler was found "
                        "(set CMAKE_CUDA_COMPILER or put nvcc on PATH)")
  else()
    message(STATUS "oom: no CUDA compiler found; building the host-only parts")
  endif()
endif()

if(OOM_HAS_CUDA)
  # CMake 3.25 does not know cuda_std_20 for nvcc 13: asking for C++20 there either fails at
  # generation (a cxx_std_20 feature reaches .cu targets) or silently compiles .cu files as C++17.
  # Teach it the flag, the way CMake's own compiler modules do for versions it knows.
  if(NOT "cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
    list(APPEND CMAKE_CUDA20_COMPILE_FEATURES cuda_std_20)
  endif()
  if(NOT CMAKE_CUDA_STANDARD)
    set(CMAKE_CUDA_STANDARD 20)
  endif()
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  set(OOM_CUDA_STD_FLAG "")
endif()
