find_package(GTest REQUIRED)
include(GoogleTest)

# loom_add_test_suite(NAME SOURCES a.cpp b.cpp LABELS unit [slow ...] [ENVIRONMENT VAR=value ...]
#                     [ASYNC_STREAMS])
# One GoogleTest executable per subsystem; every test case becomes a ctest
# test carrying the labels, so `ctest -L unit` selects the fast suite.
# ASYNC_STREAMS registers every test case a second time, named
# `<test>.async_streams` and labelled `async` only, with the CPU backend's streams
# on worker threads of their own (LOOM_CPU_STREAMS=async): a missing
# synchronization between the host and the device's work fails there. The
# directory's tests also get the label `streams_twinned`, so the test command's
# whole-suite pass under LOOM_CPU_STREAMS=async can leave out the cases that
# ran in that mode already.
function(loom_add_test_suite name)
  cmake_parse_arguments(ARG "ASYNC_STREAMS" "" "SOURCES;LABELS;ENVIRONMENT" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE loom GTest::gtest GTest::gtest_main)
  target_include_directories(${name} PRIVATE ${CMAKE_SOURCE_DIR}/tests)
  target_compile_definitions(${name} PRIVATE LOOM_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
  # Parsing GoogleTest and nlohmann/json takes about 6 s of every test file's
  # compile; a precompiled header parses them once per suite.
  target_precompile_headers(${name} PRIVATE <gtest/gtest.h> <nlohmann/json.hpp>)
  gtest_discover_tests(${name} PROPERTIES LABELS "${ARG_LABELS}" ENVIRONMENT "${ARG_ENVIRONMENT}"
                       DISCOVERY_TIMEOUT 60)
  if(ARG_ASYNC_STREAMS)
    # Only the `async` label (the sanitizer run's `-L unit` leaves them out),
    # and the mode as an environment modification: test discovery passes
    # each property one value.
    gtest_discover_tests(${name} TEST_SUFFIX .async_streams
                         PROPERTIES LABELS async ENVIRONMENT "${ARG_ENVIRONMENT}"
                                    ENVIRONMENT_MODIFICATION LOOM_CPU_STREAMS=set:async
                         DISCOVERY_TIMEOUT 60)
    set_property(DIRECTORY APPEND PROPERTY LABELS streams_twinned)
  endif()
endfunction()
