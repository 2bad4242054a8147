"""What a server and its logits processors build on to stay up under abuse: a fair queue for
shared work (``fair``), calls a deadline can stop (``sandbox``), what an output constraint asks
for before anything compiles it (``constraint_shape``), and a cache bounded by bytes (``lru``)."""
