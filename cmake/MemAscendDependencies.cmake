# Every external dependency of the library, found once. MemAscendConfig.cmake.in must
# re-find each of these (keep the two lists in step).
set(THREADS_PREFER_PTHREAD_FLAG ON)
find_package(Threads REQUIRED)
find_package(absl REQUIRED)
find_package(fmt REQUIRED)
find_package(Liburing 2.0 REQUIRED)
find_package(Numa REQUIRED)
