"""Device-facing runtime: buckets, batch packing, sampling, the runner (compiled steps)."""
