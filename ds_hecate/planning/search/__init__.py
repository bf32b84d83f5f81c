"""Algorithm 1, sparse materialization: the search for the replicas each layer call gathers, and what drives it."""
