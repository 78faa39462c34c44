# CMake 3.25 does not know cuda_std_20 for nvcc 13: asking for C++20 there either fails at
# generation (a cxx_std_20 usage requirement reaching a target with .cu files) or silently
# compiles .cu files as C++17. Teach it the flag, the way CMake's own compiler modules do for
# standards they know. Included by OOM's build and by oomConfig.cmake (in the consumer's scope).
if(CMAKE_CUDA_COMPILER_LOADED AND NOT "cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
  list(APPEND CMAKE_CUDA20_COMPILE_FEATURES cuda_std_20)
endif()
