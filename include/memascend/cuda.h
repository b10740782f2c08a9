// memascend/cuda.h: the CUDA types of MemAscend's API, usable without CUDA headers.
//
//   cudaStream_t s = ...;                         // the caller's stream
//   memascend::CudaStreamView view{s};            // non-owning
//   cudaMemcpyAsync(dev, block.data(), n, cudaMemcpyHostToDevice, s);
//   MEMASCEND_ASSIGN_OR_RETURN(auto fence, memascend::RecordCudaFence(view));
//   block.SetReuseFence(std::move(fence));        // block reused only after the copy
//
// Thread-safety: a fence may be polled from any thread.
// Lifetime: a stream view does not own its stream; the stream must outlive the calls
// that take the view. A fence owns its CUDA event.
#ifndef MEMASCEND_CUDA_H_
#define MEMASCEND_CUDA_H_

#include <memory>

#include <absl/status/statusor.h>

#include <memascend/types.h>

namespace memascend {

// Records a CUDA event on `stream`; the fence is ready when the event has completed.
// kFailedPrecondition when the library was built without CUDA or no device is present.
absl::StatusOr<std::unique_ptr<ReuseFence>> RecordCudaFence(CudaStreamView stream);

}  // namespace memascend

#endif  // MEMASCEND_CUDA_H_
