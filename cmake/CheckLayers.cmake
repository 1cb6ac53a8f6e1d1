# The layer rules, checked on every build before anything compiles (run by
# the ckptfs_layers target: cmake -DROOT=<source dir> -P CheckLayers.cmake).
# A wrong include fails the build with the file, the line and the rule.
#
#   common  -> nothing above it
#   formats -> common                     (never index, views, io, verify, fs)
#   index   -> formats, common
#   views   -> index, formats (generic files only: no family folder)
#   io      -> index                      (never views)
#   verify  -> io, index, common          (no family folder)
#   fuse / cli / python: anything below, but no family folder either
# libfuse only in src/fuse, RocksDB only in src/index, liburing and CUDA only
# in src/io. A family folder is any directory under src/formats/.
cmake_minimum_required(VERSION 3.16)
if(NOT ROOT)
  message(FATAL_ERROR "CheckLayers.cmake: pass -DROOT=<source dir>")
endif()

file(GLOB family_dirs LIST_DIRECTORIES true RELATIVE "${ROOT}/src/formats" "${ROOT}/src/formats/*")
set(families "")
foreach(d IN LISTS family_dirs)
  if(IS_DIRECTORY "${ROOT}/src/formats/${d}")
    list(APPEND families "${d}")
  endif()
endforeach()
list(JOIN families "|" family_alt)
set(family_re "\"formats/(${family_alt})/")

# layer -> regex of includes it must not have
set(up_from_formats "\"(index|views|io|verify|fuse|cli|python)/|\"ckptfs/(index|views|io|verify|fs|mount|topo)\\.h\"")
set(rules
  "common|\"(formats|index|views|io|verify|fuse|cli|python)/|\"ckptfs/(formats|index|views|io|verify|fs|mount|topo)\\.h\""
  "formats|${up_from_formats}"
  "index|\"(views|io|verify|fuse|cli|python)/|\"ckptfs/(views|io|verify|fs|mount|topo)\\.h\"|${family_re}"
  "views|\"(io|verify|fuse|cli|python)/|\"ckptfs/(io|verify|fs|mount)\\.h\"|${family_re}"
  "io|\"(views|verify|fuse|cli|python)/|\"ckptfs/(views|verify|fs|mount|topo)\\.h\"|${family_re}"
  "verify|\"(views|fuse|cli|python)/|\"ckptfs/(views|fs|mount|topo)\\.h\"|${family_re}"
  "fuse|${family_re}"
  "cli|${family_re}"
  "python|${family_re}")
# third-party headers and the one layer each belongs to
set(owned "fuse|<fuse" "index|<rocksdb/" "io|<liburing" "io|<cuda")

set(problems "")
file(GLOB_RECURSE sources RELATIVE "${ROOT}" "${ROOT}/src/*.cc" "${ROOT}/src/*.h" "${ROOT}/src/*.cu")
foreach(f IN LISTS sources)
  string(REGEX MATCH "^src/([a-z]+)/" _ "${f}")
  set(layer "${CMAKE_MATCH_1}")
  file(STRINGS "${ROOT}/${f}" includes REGEX "^[ \t]*#[ \t]*include")
  foreach(rule IN LISTS rules)
    string(FIND "${rule}" "|" bar)
    string(SUBSTRING "${rule}" 0 ${bar} rl)
    math(EXPR start "${bar} + 1")
    string(SUBSTRING "${rule}" ${start} -1 forbidden)
    if(NOT rl STREQUAL layer)
      continue()
    endif()
    foreach(inc IN LISTS includes)
      if(inc MATCHES "${forbidden}")
        string(STRIP "${inc}" inc)
        list(APPEND problems "${f}: ${inc} (the ${layer} layer may not include that: cmake/CheckLayers.cmake)")
      endif()
    endforeach()
  endforeach()
  foreach(o IN LISTS owned)
    string(FIND "${o}" "|" bar)
    string(SUBSTRING "${o}" 0 ${bar} ol)
    math(EXPR start "${bar} + 1")
    string(SUBSTRING "${o}" ${start} -1 prefix)
    if(ol STREQUAL layer)
      continue()
    endif()
    foreach(inc IN LISTS includes)
      string(FIND "${inc}" "${prefix}" at)
      if(NOT at EQUAL -1)
        string(STRIP "${inc}" inc)
        list(APPEND problems "${f}: ${inc} (only src/${ol} may include it: cmake/CheckLayers.cmake)")
      endif()
    endforeach()
  endforeach()
endforeach()
if(problems)
  list(JOIN problems "\n  " text)
  message(FATAL_ERROR "layer rules broken:\n  ${text}")
endif()
