# Note [bench targets] (tools/io_bench.h): a benchmark that writes never writes over what a
# target holds (a volume, a file of data) without --destroy-data, and never over a target
# another process has locked; its own scratch file it writes again.
set(scratch "${WORK}/bench_targets_scratch.dat")
set(vol "${WORK}/bench_targets_volume.img")
set(data "${WORK}/bench_targets_data.bin")
set(copy "${WORK}/bench_targets_data.copy")
set(blob "${WORK}/bench_targets_blob.bin")
set(back "${WORK}/bench_targets_back.bin")
file(REMOVE "${scratch}" "${vol}" "${data}" "${copy}" "${blob}" "${back}")
string(RANDOM LENGTH 65536 chunk)
file(WRITE "${blob}" "${chunk}")
foreach(i RANGE 79)  # 5 MiB of data that is not a volume
  file(APPEND "${data}" "${chunk}")
endforeach()
file(COPY_FILE "${data}" "${copy}")
set(small --block 256K --qd 4 --size 4M)

# run(EXPECTED_RC MESSAGE_OR_EMPTY args...): runs the CLI, checks its exit status and that
# its error output names MESSAGE.
function(run expect_rc message)
  execute_process(COMMAND "${CLI}" ${ARGN} OUTPUT_VARIABLE out ERROR_VARIABLE err
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL expect_rc)
    message(FATAL_ERROR "memascend ${ARGN}: exit ${rc}, expected ${expect_rc}\n${out}\n${err}")
  endif()
  if(message AND NOT err MATCHES "${message}")
    message(FATAL_ERROR "memascend ${ARGN}: the error does not say '${message}':\n${err}")
  endif()
endfunction()

function(same_bytes a b what)
  execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files "${a}" "${b}" RESULT_VARIABLE diff)
  if(NOT diff EQUAL 0)
    message(FATAL_ERROR "${what}")
  endif()
endfunction()

# A new file is the benchmark's: written, and written again (it holds only the pattern).
run(0 "" bench io --target "${scratch}" --rw write ${small})
run(0 "" bench io --target "${scratch}" --rw write ${small})
run(0 "" bench tune --target "${scratch}" --size 16M)

# A volume holding an object: refused by both benchmarks, and left whole.
run(0 "" volume format "${vol}" --size 32M)
run(0 "" volume put "${vol}" weights "${blob}")
run(1 "memascend signature.*--destroy-data" bench io --target "${vol}" --rw write ${small})
run(1 "memascend signature" bench tune --target "${vol}" --size 16M)
run(0 "" volume fsck "${vol}" --verify-data)
run(0 "" volume get "${vol}" weights "${back}")
same_bytes("${blob}" "${back}" "a refused benchmark changed the volume's object")

# bench store formats its --volume: one holding an object is refused and left whole.
set(workload "${CMAKE_CURRENT_LIST_DIR}/../../data/workloads/gpt2-xl.tsv")
set(store_args --workload "${workload}" --scale 256 --host-budget 32M --reps 1)
run(1 "memascend signature.*--destroy-data" bench store ${store_args} --volume "${vol}")
run(0 "" volume get "${vol}" weights "${back}" --force)
same_bytes("${blob}" "${back}" "a refused bench store changed the volume's object")
run(1 "non-zero bytes.*--destroy-data" bench store ${store_args} --volume "${data}")
same_bytes("${data}" "${copy}" "a refused bench store changed the data file")

# Usage errors are found before the target is created: no empty file is left.
set(fresh "${WORK}/bench_targets_fresh.dat")
file(REMOVE "${fresh}")
run(2 "--size" bench io --target "${fresh}" --rw write)
run(2 "--size" bench io --target "${fresh}" --rw write --size 4K --block 1M)
run(2 "--size.*8M" bench tune --target "${fresh}" --size 4M)
if(EXISTS "${fresh}")
  message(FATAL_ERROR "a refused benchmark left ${fresh} behind")
endif()

# A file under one block of data is data too.
set(note "${WORK}/bench_targets_note.txt")
file(WRITE "${note}" "precious\n")
run(1 "non-zero bytes.*--destroy-data" bench io --target "${note}" --rw write ${small})
run(1 "non-zero bytes" bench tune --target "${note}" --size 16M)
file(READ "${note}" kept)
if(NOT kept STREQUAL "precious\n")
  message(FATAL_ERROR "a refused benchmark changed a small file")
endif()
file(REMOVE "${note}")

# A file of data: refused and unchanged; read, it is left as it is; with --destroy-data,
# written.
run(1 "non-zero bytes.*--destroy-data" bench io --target "${data}" --rw write ${small})
same_bytes("${data}" "${copy}" "a refused benchmark changed the data file")
run(0 "" bench io --target "${data}" --rw read ${small})
same_bytes("${data}" "${copy}" "a read benchmark changed the data file")
run(0 "" bench io --target "${data}" --rw write ${small} --destroy-data)

# A volume another process holds (its lock): refused even with --destroy-data.
find_program(FLOCK flock)
if(FLOCK)
  execute_process(COMMAND "${FLOCK}" "${vol}" "${CLI}" bench io --target "${vol}" --rw write
                          ${small} --destroy-data
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 1 OR NOT err MATCHES "locked by another process")
    message(FATAL_ERROR "a locked volume was not refused (exit ${rc}):\n${out}\n${err}")
  endif()
  run(0 "" volume get "${vol}" weights "${back}" --force)
  same_bytes("${blob}" "${back}" "a refused benchmark changed the locked volume")
else()
  message(STATUS "flock(1) not found: the locked-volume case is not checked here")
endif()
file(REMOVE "${scratch}" "${vol}" "${data}" "${copy}" "${blob}" "${back}")
message(STATUS "bench targets OK")
