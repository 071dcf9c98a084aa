"""Seesaw's machinery: weight re-sharding between two layouts, the CPU KV store, the prefetcher."""
