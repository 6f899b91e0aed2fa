"""What quantized KV costs in accuracy: teacher-forced scoring through the paged cache, metrics and runs (no rendering; the commands render)."""
