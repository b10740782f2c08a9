// Replaces the global operator new and delete of the memascend binary with versions
// that count the bytes asked for, so benchmarks can report what a kernel allocates.
#include "alloc_counter.h"

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

namespace memascend::cli {
namespace {
std::atomic<std::uint64_t> g_bytes{0};

void* Allocate(std::size_t n, std::size_t align) {
  g_bytes.fetch_add(n, std::memory_order_relaxed);
  if (n == 0) n = 1;
  void* p = align <= alignof(std::max_align_t)
                ? std::malloc(n)
                : std::aligned_alloc(align, (n + align - 1) / align * align);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

std::uint64_t AllocatedBytes() noexcept { return g_bytes.load(std::memory_order_relaxed); }

}  // namespace memascend::cli

void* operator new(std::size_t n) { return memascend::cli::Allocate(n, 0); }
void* operator new[](std::size_t n) { return memascend::cli::Allocate(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) {
  return memascend::cli::Allocate(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return memascend::cli::Allocate(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
