"""SiPipe (../shared/papers/sipipe.txt): column-wise CPU sampling in sampler processes, the
token-safe execution model and structure-aware transmission, on the multi-process runtime."""
