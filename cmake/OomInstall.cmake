# Install rules, the exported package (oomConfig.cmake + version file) and the build-tree export.
include(CMakePackageConfigHelpers)

set(OOM_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/oom")

install(TARGETS ${OOM_EXPORTED_TARGETS} EXPORT oomTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/oom" DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT oomTargets NAMESPACE oom:: DESTINATION ${OOM_CMAKE_DIR})
export(EXPORT oomTargets NAMESPACE oom:: FILE "${PROJECT_BINARY_DIR}/oomTargets.cmake")

configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/oomConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/oomConfig.cmake"
  INSTALL_DESTINATION ${OOM_CMAKE_DIR})
write_basic_package_version_file("${PROJECT_BINARY_DIR}/oomConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion)
foreach(_module FindNCCL.cmake OomCudaStd.cmake)  # the build-tree package needs them beside it too
  configure_file("${PROJECT_SOURCE_DIR}/cmake/${_module}" "${PROJECT_BINARY_DIR}/${_module}" COPYONLY)
endforeach()
install(FILES
  "${PROJECT_BINARY_DIR}/oomConfig.cmake"
  "${PROJECT_BINARY_DIR}/oomConfigVersion.cmake"
  "${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake"
  "${PROJECT_SOURCE_DIR}/cmake/OomCudaStd.cmake"
  DESTINATION ${OOM_CMAKE_DIR})
