"""A limiter node: the single authority for its shard of keys."""
