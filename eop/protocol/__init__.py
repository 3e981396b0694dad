"""The exactly-once protocol: one message, a batch, ordering, compaction."""
