# Decides whether the CUDA parts are built (OOM_ENABLE_CUDA = AUTO/ON/OFF) and sets them up.
#   OOM_HAS_CUDA           ON when the CUDA language is enabled
#   OOM_CUDA_BUILDS_SM90   ON when CMAKE_CUDA_ARCHITECTURES has 90: the Hopper (wgmma) kernels are
#                          then built too, for the arch-specific target sm_90a
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

set(OOM_CUDA_BUILDS_SM90 OFF)
if(OOM_HAS_CUDA)
  foreach(_oom_arch IN LISTS CMAKE_CUDA_ARCHITECTURES)
    if(_oom_arch MATCHES "^90a?(-real|-virtual)?$")
      set(OOM_CUDA_BUILDS_SM90 ON)
    endif()
  endforeach()
  include(OomCudaStd)
  if(NOT CMAKE_CUDA_STANDARD)
    set(CMAKE_CUDA_STANDARD 20)
  endif()
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
endif()
