"""Device ops of a layer call, one per module (MegaBlocks style): the grouped expert compute, the weighted
un-permute that combines the routed outputs, and DeepSpeed's top-k gate without the parts Hecate discards. torch only; the runtime picks the implementation (grouped GEMM or
per-expert loop, CUDA kernel or torch) and owns the tables they read."""
