find_package(GTest REQUIRED)
include(GoogleTest)

# loom_add_test_suite(NAME SOURCES a.cpp b.cpp LABELS unit [slow ...] [ENVIRONMENT VAR=value ...])
# One GoogleTest executable per subsystem; every test case becomes a ctest
# test carrying the labels, so `ctest -L unit` selects the fast suite.
function(loom_add_test_suite name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LABELS;ENVIRONMENT" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE loom GTest::gtest GTest::gtest_main)
  target_include_directories(${name} PRIVATE ${CMAKE_SOURCE_DIR}/tests)
  target_compile_definitions(${name} PRIVATE LOOM_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
  gtest_discover_tests(${name} PROPERTIES LABELS "${ARG_LABELS}" ENVIRONMENT "${ARG_ENVIRONMENT}"
                       DISCOVERY_TIMEOUT 60)
endfunction()
