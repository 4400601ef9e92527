# Writes OUT (version_git.h) with the source tree's git commit; run at every build, it rewrites the header only
# when the commit changed (configure_file leaves an identical file alone), so an unchanged tree rebuilds nothing.
execute_process(COMMAND git -C "${SOURCE_DIR}" rev-parse --short=12 HEAD OUTPUT_VARIABLE commit
                OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR commit STREQUAL "")
  set(commit "unknown")
else()
  execute_process(COMMAND git -C "${SOURCE_DIR}" diff --quiet HEAD -- RESULT_VARIABLE dirty ERROR_QUIET)
  if(NOT dirty EQUAL 0)
    string(APPEND commit "+dirty")
  endif()
endif()
file(WRITE "${OUT}.tmp" "#pragma once\n#define CAPSERVE_GIT_COMMIT \"${commit}\"\n")
configure_file("${OUT}.tmp" "${OUT}" COPYONLY)
