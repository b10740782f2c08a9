# memascend-train's refusals say what differs (Note [run identity] in run_identity.h) and what
# a corpus too short needs, in the user's terms rather than tensor sizes or digests.
#   cmake -DTRAIN=<memascend-train> -DDIR=<scratch dir> -P train_messages.cmake
set(vol "${DIR}/messages.vol")
file(REMOVE_RECURSE "${DIR}")
file(MAKE_DIRECTORY "${DIR}")
set(tiny --vocab 256 --channels 32 --heads 2 --seq 16 --batch 2 --sample 0 --volume "${vol}")

function(expect_refusal want)
  execute_process(COMMAND "${TRAIN}" ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(rc EQUAL 0)
    message(FATAL_ERROR "accepted: ${ARGN}\n${out}")
  endif()
  string(FIND "${err}" "${want}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "want '${want}' in the refusal of ${ARGN}, got:\n${err}")
  endif()
endfunction()

execute_process(COMMAND "${TRAIN}" ${tiny} --layers 1 --steps 2 RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the first run failed (${rc})")
endif()
# Another architecture: the model's difference, not "another layout".
expect_refusal("layers: 1 on the volume, 2 in this run" ${tiny} --layers 2 --steps 3 --resume)
# Another hyper-parameter: named with both values.
expect_refusal("lr: 0.003 on the volume, 0.01 in this run" ${tiny} --layers 1 --steps 3 --resume
               --lr 1e-2)
# Untouched by the refusals: the same run resumes.
execute_process(COMMAND "${TRAIN}" ${tiny} --layers 1 --steps 3 --resume RESULT_VARIABLE rc
                OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the same run did not resume after the refusals (${rc})")
endif()

# memascend Note [commit interval]: an interval out of range is refused with its range; a
# run with one ends with every step durable (its last, between two commits, included).
expect_refusal("commit_every 0 is out of range [1, 1000000]" ${tiny} --layers 1 --steps 4 --resume
               --commit-every 0)
execute_process(COMMAND "${TRAIN}" ${tiny} --layers 1 --steps 5 --resume --commit-every 4
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the run with --commit-every 4 failed (${rc})")
endif()
execute_process(COMMAND "${TRAIN}" ${tiny} --layers 1 --steps 6 --resume RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0 OR out MATCHES "step +5/" OR NOT out MATCHES "step +6/6")
  message(FATAL_ERROR "after --steps 5 --commit-every 4, --resume did not start at step 6:\n${out}")
endif()
# The steps between commits write nothing (the whole state resident; the first resumed
# step reads it); each step durable, every step writes.
function(step_io every steps out)
  execute_process(COMMAND "${TRAIN}" ${tiny} --layers 1 --steps ${steps} --resume --commit-every
                          ${every} --json --quiet RESULT_VARIABLE rc OUTPUT_VARIABLE json
                          ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "--commit-every ${every} --json failed (${rc}): ${err}")
  endif()
  string(JSON second GET "${json}" step_io_bytes 1)
  string(JSON third GET "${json}" step_io_bytes 2)
  set(${out} "${second};${third}" PARENT_SCOPE)
endfunction()
step_io(4 9 deferred)
step_io(1 12 durable)
if(NOT deferred STREQUAL "0;0" OR durable MATCHES "(^|;)0(;|$)")
  message(FATAL_ERROR "steps 8-9 with --commit-every 4 moved ${deferred} bytes, steps 11-12 "
                      "durable each ${durable}: the interval is not in effect")
endif()

# --staging step: every step durable, a whole step staged (no batches, no gradient written):
# the run resumes at its next step, and an unknown staging is refused with the choices.
expect_refusal("bounded" ${tiny} --layers 1 --steps 13 --resume --staging whole)
expect_refusal("--staging step: only the memascend policy" ${tiny} --layers 1 --steps 13
               --force --volume "${DIR}/zero.vol" --policy zero-infinity --staging step)
execute_process(COMMAND "${TRAIN}" ${tiny} --layers 1 --steps 13 --resume --staging step
                RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the run with --staging step failed (${rc}): ${err}")
endif()
execute_process(COMMAND "${TRAIN}" ${tiny} --layers 1 --steps 14 --resume --staging step
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0 OR out MATCHES "step +13/" OR NOT out MATCHES "step +14/14")
  message(FATAL_ERROR "after --steps 13 --staging step, --resume did not start at step 14:\n${out}")
endif()

# 17 tokens for --seq 16: what is needed, and why.
execute_process(COMMAND python3 -c "import sys; open(sys.argv[1], 'wb').write(bytes([1, 0, 0, 0]) * 17)"
                        "${DIR}/short.u32" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "could not write the token file")
endif()
expect_refusal("the training text has 17 tokens; batches are windows of --seq + 1 = 17 tokens"
               --vocab 256 --channels 32 --heads 2 --layers 1 --seq 16 --batch 2 --sample 0
               --steps 1 --force --volume "${DIR}/short.vol" --tokens "${DIR}/short.u32")
# A file under one block of data is not a volume to format (it was overwritten).
file(WRITE "${DIR}/note.txt" "precious\n")
expect_refusal("non-zero bytes at offset 0" --vocab 256 --channels 32 --heads 2 --layers 1
               --seq 16 --batch 2 --sample 0 --steps 1 --volume "${DIR}/note.txt")
file(READ "${DIR}/note.txt" kept)
if(NOT kept STREQUAL "precious\n")
  message(FATAL_ERROR "a refused run changed the file given as --volume")
endif()

# A budget factor past what any host holds is refused (a size_t of it was undefined, and
# 1e19x ran with the default budget).
expect_refusal("--host-budget 1e+19x: " --vocab 256 --channels 32 --heads 2 --layers 1
               --seq 16 --batch 2 --sample 0 --steps 1 --force --volume "${DIR}/big.vol"
               --host-budget 1e19x)

# The defaults --help shows are values the parser accepts (it showed 1e8, which it refuses).
execute_process(COMMAND "${TRAIN}" --help RESULT_VARIABLE rc OUTPUT_VARIABLE help)
if(NOT rc EQUAL 0 OR help MATCHES "default: [0-9]+e[0-9]+\\)")
  message(FATAL_ERROR "--help shows a default the parser refuses:\n${help}")
endif()
file(REMOVE_RECURSE "${DIR}")
message(STATUS "memascend-train's messages: OK")
