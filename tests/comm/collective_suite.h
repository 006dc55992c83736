// The communication test suite shared by the backends: each function checks
// one behaviour with GoogleTest expectations and is called by every rank of
// `comm` (by run_local threads in comm_tests, by each process under mpiexec
// in comm_mpi_tests).
#pragma once

#include "loom/comm.h"

namespace loom::comm_suite {

// Every dtype and op, counts 0, 1, odd and not divisible by the group size:
// the results are bit-identical to the documented rank-order fold.
void all_reduce_folds_in_rank_order(Communicator& comm);
void reduce_scatter_folds_in_rank_order(Communicator& comm);
void all_gather_places_every_block(Communicator& comm);
void broadcast_copies_the_root(Communicator& comm);
void max_and_min_propagate_nan(Communicator& comm);
void tensor_forms_check_their_shapes(Communicator& comm);

// One buffer of at least 64 MiB per collective.
void large_all_reduce(Communicator& comm);
void large_reduce_scatter(Communicator& comm);
void large_all_gather(Communicator& comm);
void large_broadcast(Communicator& comm);

void send_recv_match_by_source_and_tag(Communicator& comm);
void recv_of_the_wrong_size_fails(Communicator& comm);
void sub_groups_follow_color_and_key(Communicator& comm);
void async_collectives_overlap_and_keep_issue_order(Communicator& comm);
void stats_follow_the_ring_cost_model(Communicator& comm);

// Failure cases that leave `comm` usable (they break a sub-group only).
void timeout_names_operation_sequence_and_missing_rank(Communicator& comm);
void mismatched_collectives_are_reported(Communicator& comm);

}  // namespace loom::comm_suite
