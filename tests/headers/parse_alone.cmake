# Parses each public header alone (a TU that includes only it) with COMPILER in C++20: a header
# that leans on what another header happened to include first, or on a C++20 feature one of the
# compilers we build with lacks, fails here. cmake -DCOMPILER=... -DINCLUDE=... -DHEADERS=a;b -P
foreach(var COMPILER INCLUDE HEADERS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "parse_alone.cmake needs -D${var}=...")
  endif()
endforeach()
set(failed "")
foreach(h IN LISTS HEADERS)
  execute_process(COMMAND "${COMPILER}" -std=c++20 -fsyntax-only "-I${INCLUDE}" ${EXTRA_FLAGS} -x c++ -include "${h}" /dev/null
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message("${h} does not parse alone with ${COMPILER}:\n${err}")
    list(APPEND failed "${h}")
  endif()
endforeach()
list(LENGTH HEADERS n)
if(failed)
  message(FATAL_ERROR "headers that do not parse alone: ${failed}")
endif()
message("${n} headers parse alone with ${COMPILER}")
