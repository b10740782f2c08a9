// The tensor store's prefetch queue and its workers (Note [residency], Note [write-behind])
// (store/tensor_store_impl.h).

#include "store/tensor_store_impl.h"
#include "util/units.h"

namespace memascend {

using store::Clock;
using store::Since;

// Room may have appeared: the deferred prefetches go back to the head of the queue.
void TensorStore::Impl::RetryDeferredLocked() {
  while (!deferred.empty()) {
    jobs.push_front(std::move(deferred.back()));
    deferred.pop_back();
  }
}

void TensorStore::Impl::Work() {
  for (;;) {
    Job job;
    absl::Status s;
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(
          +[](Impl* m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(m->mu) { return m->stop || !m->jobs.empty(); },
          this));
      if (jobs.empty()) return;
      job = std::move(jobs.front());
      jobs.pop_front();
      Tensor& t = *tensors[job.id];
      if (job.ticket == nullptr) {  // Note [write-behind]
        while (t.state == State::kLoading || t.state == State::kWriting) cv.Wait(&mu);
        if (t.pins == 0 && t.dirty) (void)WriteBackLocked(t);  // a failure stays dirty
        continue;
      }
      if (job.tier == Tier::kGpu) {
        s = GpuResidentLocked(t, job.stream, /*pin=*/false);
      } else if (t.wanted) {  // else used, discarded or evicted since: nothing to do
        s = MakeResidentLocked(t, nullptr, /*prefetch=*/true);
        if (s.code() == absl::StatusCode::kResourceExhausted && t.state == State::kCold &&
            t.wanted) {
          if (options.defer_prefetches) {
            // No room but wanted tensors': wait for some (or for a use, which loads it).
            ++counters.prefetch_deferred;
            deferred.push_back(std::move(job));
            continue;
          }
          t.wanted = false;
          ++counters.prefetch_dropped;
        }
      }
    }
    job.ticket->Finish(std::move(s));
  }
}

}  // namespace memascend
