"""Communication: transports and the sparse collectives (SparseAllGather, SparseReduceScatter)."""
