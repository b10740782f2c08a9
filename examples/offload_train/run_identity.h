// What a run is, for its volume: a fingerprint the SDK checks on --resume
// (OffloadedAdamOptions::fingerprint), and the same facts as text kept in each commit
// record, so that a refused --resume names what differs.
//
// Note [run identity]: what the fingerprint digests, as "key=value" lines (RunIdentity),
// kept in each commit record's caller bytes, so that a refused --resume says what differs
// (RunDifference: "layers: 1 on the volume, 2 in this run") rather than that a digest does.
#ifndef MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_RUN_IDENTITY_H_
#define MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_RUN_IDENTITY_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <memascend/object_store.h>

#include "trainer.h"

namespace offload_train {

// An order-dependent digest of token ids (the data of a --tokens run).
std::uint64_t TokensFingerprint(const std::vector<std::int32_t>& tokens);

// The run's fingerprint: the model, the hyper-parameters, the data's digest and size, and
// the volume's layout version.
std::uint64_t Fingerprint(const TrainOptions& o, std::uint64_t data, std::size_t corpus_tokens);

// Note [run identity]: the fingerprint's facts as "key=value" lines.
std::string RunIdentity(const TrainOptions& o, std::uint64_t data, std::size_t corpus_tokens,
                        int world);

// "layers: 1 on the volume, 2 in this run; ..." from the record `name` on the volume and
// this run's identity; empty when the record is missing or carries none.
std::string RunDifference(memascend::ObjectStore* volume, const std::string& name,
                          const std::string& ours);

}  // namespace offload_train

#endif  // MEMASCEND_EXAMPLES_OFFLOAD_TRAIN_RUN_IDENTITY_H_
