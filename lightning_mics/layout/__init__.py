"""Where things live: the (replicate, shard[, tp]) mesh and its groups, which modules form units, each
parameter's rows of the flat shard and its DTensor, and a module built on meta given its values."""
